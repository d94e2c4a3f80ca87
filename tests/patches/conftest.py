"""Fixtures for behaviour tests of patched upstream methods (real vLLM + vllm-ascend classes on CPU tensors).

vllm-ascend's worker patches replace vLLM's GroupCoordinator with an HCCL one (needs an NPU), so vLLM's
distributed state is initialised *before* the worker modules are imported, with vLLM's own CPU platform and
a gloo world of one process. Everything after that is the release's real code.
"""

from __future__ import annotations

import socket

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")


@pytest.fixture(scope="session")
def cpu_worker():
    if npu_standin.detect_family() is None:
        pytest.skip("vllm-ascend is not installed in this env")
    npu_standin.install()
    import vllm.platforms as platforms
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()  # vLLM's real CPU platform: gloo groups on "cpu"
    if ps._WORLD is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with set_current_vllm_config(VllmConfig()):
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                            distributed_init_method=f"tcp://127.0.0.1:{port}")
            ps.initialize_model_parallel(1, 1, backend="gloo")
    from npu_standin.ascend_imports import import_worker_modules

    return import_worker_modules()
