"""Stand-in for scipy on the GPU host, where scipy (~95 MB unpacked) is not carried (docs/environments.md, "GPU host").
On the path only when the real scipy cannot be imported (benchmarks/bench_engine_gpu.py decides).

vllm-ascend 0.18 imports ``from scipy import stats`` and ``from scipy.optimize import linear_sum_assignment`` at module
level in ``eplb/core/policy/policy_flashlb.py`` (model_runner_v1 -> eplb_worker -> policy_factory) and uses them only
when EPLB's FlashLB policy runs, which the engine runs never do: ``stats`` and ``optimize`` exist, every use raises.
No dist-info is carried, so transformers' ``is_scipy_available()`` (find_spec + package metadata) stays False.
"""

from __future__ import annotations


def __getattr__(name: str):
    raise AttributeError(f"scipy stand-in: no attribute {name} (tests/support/gpu_box/absent/scipy)", name=name)
