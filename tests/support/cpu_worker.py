"""Set up a worker-side process on CPU for tests that run real vLLM / vllm-ascend worker classes.

vLLM distributed state on vLLM's own ``CpuPlatform`` (gloo, world of one process), then the worker modules
in the real worker's import order. The order matters: vllm-ascend's worker patches replace vLLM's
``GroupCoordinator`` with an HCCL one (which needs an NPU), so the state must exist before they are imported.
Idempotent; the platform switch is global to the process (run such tests in their own pytest process).
"""

from __future__ import annotations

import socket
import sys
from typing import Any


def _rebind_pin_memory(value: bool) -> None:
    """vLLM 0.25+ computes ``vllm.utils.torch_utils.PIN_MEMORY`` once, at its first import (here: under the Ascend
    platform, True; CPU torch has no pinned allocator), and its modules bind it by name and as ``CpuGpuBuffer``'s
    default. After the switch to the CPU platform every binding gets the CPU platform's answer. Older vLLMs ask
    ``is_pin_memory_available()`` (``functools.cache``: an answer given under the Ascend platform, by a test that ran
    before this setup, would stay) and have no PIN_MEMORY."""
    platform_utils = sys.modules.get("vllm.utils.platform_utils")  # not imported yet: nothing cached
    cache_clear = getattr(getattr(platform_utils, "is_pin_memory_available", None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()
    for name, module in list(sys.modules.items()):
        if (name == "vllm" or name.startswith("vllm.")) and isinstance(getattr(module, "PIN_MEMORY", None), bool):
            module.PIN_MEMORY = value
    from vllm.v1.utils import CpuGpuBuffer

    defaults = CpuGpuBuffer.__init__.__kwdefaults__
    if defaults and "pin_memory" in defaults:
        defaults["pin_memory"] = value


def setup_cpu_worker() -> dict[str, Any]:
    import npu_standin

    npu_standin.install()
    import vllm.platforms as platforms
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if ps._WORLD is None:
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with set_current_vllm_config(VllmConfig()):
            ps.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{port}"
            )
            ps.initialize_model_parallel(1, 1, backend="gloo")
        _rebind_pin_memory(platforms.current_platform.is_pin_memory_available())
    from npu_standin.ascend_imports import import_worker_modules

    return import_worker_modules()
