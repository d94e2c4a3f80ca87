"""zb_patch.shims against vLLM's real CpuGpuBuffer and torch tensors of this env."""

import pytest

torch = pytest.importorskip("torch", reason="needs torch (va0xx envs)")
vllm_utils = pytest.importorskip("vllm.v1.utils", reason="needs vLLM (va0xx envs)")

from zb_patch import shims  # noqa: E402


def test_real_cpu_gpu_buffer():
    buf = vllm_utils.CpuGpuBuffer(4, dtype=torch.int32, device=torch.device("cpu"), pin_memory=False)
    assert shims.is_buffer(buf)
    assert shims.device_view(buf) is buf.gpu
    assert shims.host_view(buf) is buf.cpu
    assert shims.numpy_view(buf) is buf.np
    t = torch.arange(3)
    assert not shims.is_buffer(t)
    assert shims.device_view(t) is t and shims.host_view(t) is t
    assert list(shims.numpy_view(t)) == [0, 1, 2]
