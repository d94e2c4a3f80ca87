"""Import the worker-side modules of the installed vLLM / vllm-ascend pair, in the order a real
NPU worker process imports them.

Order matters: importing ``vllm_ascend.worker.model_runner_v1`` first dies on a circular import
(``DeviceOperator`` from ``vllm_ascend.device.device_op`` <-> ``vllm_ascend.utils`` /
``vllm_ascend.ops``). A real worker never hits it because ``vllm.platforms.current_platform``
resolves the ascend platform plugin first (``vllm_ascend.platform``), and the worker class
(``vllm_ascend.worker.worker[_v1].NPUWorker``) is what pulls in the model runner.
"""

from __future__ import annotations

import importlib
import importlib.util
import types

from . import detect_family, install

# family -> vllm_ascend modules, in import order (first = what current_platform resolution imports)
ASCEND_WORKER_MODULES: dict[str, tuple[str, ...]] = {
    "0.11": (
        "vllm_ascend.platform",
        "vllm_ascend.worker.worker_v1",
        "vllm_ascend.worker.model_runner_v1",
        "vllm_ascend.worker.npu_input_batch",
        "vllm_ascend.worker.block_table",
        "vllm_ascend.spec_decode.eagle_proposer",
        "vllm_ascend.spec_decode.mtp_proposer",
    ),
    "0.13": (
        "vllm_ascend.platform",
        "vllm_ascend.worker.worker",
        "vllm_ascend.worker.model_runner_v1",
        "vllm_ascend.worker.npu_input_batch",
        "vllm_ascend.worker.block_table",
        "vllm_ascend.spec_decode.eagle_proposer",
        "vllm_ascend.spec_decode.mtp_proposer",
        "vllm_ascend.core.recompute_scheduler",  # the PD decode node's scheduler (engine patches)
    ),
    "0.18": (
        "vllm_ascend.platform",
        "vllm_ascend.worker.worker",
        "vllm_ascend.worker.model_runner_v1",
        "vllm_ascend.worker.npu_input_batch",
        "vllm_ascend.worker.block_table",
        "vllm_ascend.spec_decode.eagle_proposer",
        "vllm_ascend.core.recompute_scheduler",  # the PD decode node's scheduler (engine patches)
    ),
    "0.23": (
        "vllm_ascend.platform",
        "vllm_ascend.worker.worker",
        "vllm_ascend.worker.model_runner_v1",
        "vllm_ascend.worker.npu_input_batch",
        "vllm_ascend.worker.block_table",
        "vllm_ascend.spec_decode.eagle_proposer",
        "vllm_ascend.core.recompute_scheduler",  # the PD decode node's scheduler (engine patches)
    ),
}

# upstream vLLM modules the adapters patch or read (each imported only if the release has it)
UPSTREAM_WORKER_MODULES: tuple[str, ...] = (
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu_input_batch",
    "vllm.v1.worker.block_table",
    "vllm.v1.spec_decode.eagle",
    "vllm.v1.spec_decode.utils",
    "vllm.v1.core.sched.async_scheduler",
)


def worker_module_names(family: str | None = None) -> list[str]:
    """The ordered module list for ``family`` (default: the installed vllm-ascend's)."""
    family = family or detect_family()
    if family is None:
        raise RuntimeError("ascend_imports: vllm-ascend is not installed in this environment")
    names = list(ASCEND_WORKER_MODULES[family])
    for name in UPSTREAM_WORKER_MODULES:
        if _exists(name):
            names.append(name)
    return names


def _exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def import_worker_modules(family: str | None = None) -> dict[str, types.ModuleType]:
    """Install the stand-in (idempotent) and import the worker-side modules in order."""
    install()
    return {name: importlib.import_module(name) for name in worker_module_names(family)}
