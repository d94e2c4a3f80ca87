"""Stand-in for numba on the GPU host, where numba + llvmlite (~150 MB unpacked) are not carried (docs/environments.md,
"GPU machine"). On the path only when the real numba cannot be imported (benchmarks/bench_engine_gpu.py decides).

vllm-ascend 0.18 imports ``from numba import njit`` at module level in ``eplb/core/policy/policy_flashlb.py``
(model_runner_v1 -> eplb_worker -> policy_factory) and decorates its FlashLB functions with ``@njit`` /
``@njit(fastmath=True, cache=True)``. EPLB is off in the engine runs, so they are never called: the decorated function
keeps its name and raises when called. vLLM 0.18's ``v1/spec_decode/ngram_proposer.py`` (imported through
vllm-ascend's n-gram proposer) imports ``get_num_threads, jit, njit, prange, set_num_threads``: ``jit`` / ``njit``
decorate, the others are called only when n-gram drafting runs (EAGLE here) and raise. Every other numba name raises
AttributeError.
"""

from __future__ import annotations

import functools


def njit(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return _not_compiled(args[0])
    return _not_compiled


jit = njit


def _unavailable(name: str):
    def call(*args, **kwargs):
        raise RuntimeError(f"numba stand-in: numba.{name} is not available on this machine")

    call.__name__ = call.__qualname__ = name
    return call


get_num_threads = _unavailable("get_num_threads")
set_num_threads = _unavailable("set_num_threads")
prange = _unavailable("prange")


def _not_compiled(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        raise RuntimeError(f"numba stand-in: {fn.__qualname__} is numba-compiled; numba is not on this machine")

    return call


def __getattr__(name: str):
    raise AttributeError(f"numba stand-in: no attribute {name} (tests/support/gpu_box/absent/numba)", name=name)
