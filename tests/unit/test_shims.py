"""zb_patch.shims logic with plain attribute holders (the real CpuGpuBuffer is covered in
tests/contract/test_shims_real.py, where vLLM and torch are installed)."""

from zb_patch import shims


class _Dev:
    def __init__(self, type_):
        self.type = type_

    def __str__(self):
        return self.type


class _T:
    """Minimal tensor-shaped holder (only what shims reads: device, dtype, shape, numpy())."""

    def __init__(self, dev, dtype="torch.int32", shape=(4,)):
        self.device, self.dtype, self.shape = _Dev(dev), dtype, shape

    def numpy(self):
        return ("np-of", self)


class _Buf:
    def __init__(self):
        self.cpu, self.gpu, self.np = _T("cpu"), _T("cuda"), "np"


def test_buffer_detection_and_views():
    buf = _Buf()
    assert shims.is_buffer(buf)
    assert shims.device_view(buf) is buf.gpu
    assert shims.host_view(buf) is buf.cpu
    assert shims.numpy_view(buf) == "np"
    assert shims.describe(buf).startswith("CpuGpuBuffer[int32, (4,)")


def test_plain_tensors():
    dev, host = _T("npu"), _T("cpu")
    assert not shims.is_buffer(dev) and not shims.is_buffer(host)
    assert shims.device_view(dev) is dev
    assert shims.host_view(dev) is None          # reading it on the host would synchronize
    assert shims.numpy_view(dev) is None
    assert shims.host_view(host) is host
    assert shims.numpy_view(host) == ("np-of", host)
    assert shims.describe(dev) == "Tensor[int32, (4,), npu]"


def test_tensor_cpu_method_is_not_a_buffer():
    class HasCpuMethod(_T):
        gpu = None

        def cpu(self):  # torch.Tensor.cpu is a method, a buffer's .cpu is a tensor
            return self

    assert not shims.is_buffer(HasCpuMethod("cuda"))
