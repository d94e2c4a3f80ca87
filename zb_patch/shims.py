"""CpuGpuBuffer / plain-tensor shims: the one place that knows whether a runner attribute is a vLLM
``CpuGpuBuffer`` (``.cpu`` / ``.gpu`` / ``.np`` and ``copy_to_gpu``) or a plain tensor.

vLLM <= 0.18 keeps ``positions`` and ``seq_lens`` (and more) as ``CpuGpuBuffer``; vLLM 0.19 (#32951) turned them
into plain device tensors plus ``optimistic_seq_lens_cpu``. Code that must read either form (patched runner
methods, the selftest harness) asks here instead of testing ``hasattr(x, "gpu")`` inline.

No torch import at module level: these helpers only look at attributes.
"""

from __future__ import annotations

from typing import Any, Optional

_BUFFER_ATTRS = ("cpu", "gpu")


def is_buffer(value: Any) -> bool:
    """True for a vLLM ``CpuGpuBuffer`` (or anything shaped like one: ``.cpu`` and ``.gpu`` tensors)."""
    return all(hasattr(value, a) for a in _BUFFER_ATTRS) and not callable(getattr(value, "cpu"))


def device_view(value: Any) -> Any:
    """The device-side tensor: ``buf.gpu`` for a buffer, the tensor itself otherwise."""
    return value.gpu if is_buffer(value) else value


def host_view(value: Any) -> Optional[Any]:
    """The host-side tensor without a device->host copy: ``buf.cpu`` for a buffer, the tensor itself when it
    lives on the CPU, ``None`` for a device tensor (reading it on the host would synchronize)."""
    if is_buffer(value):
        return value.cpu
    device = getattr(value, "device", None)
    return value if device is not None and device.type == "cpu" else None


def numpy_view(value: Any) -> Optional[Any]:
    """The numpy view of the host side (``buf.np``; a CPU tensor's ``.numpy()``), else ``None``."""
    if is_buffer(value):
        return getattr(value, "np", None)
    host = host_view(value)
    return host.numpy() if host is not None else None


def describe(value: Any) -> str:
    """``"CpuGpuBuffer[int32, (8,)]"`` / ``"Tensor[int64, (16,), cuda:0]"`` for logs and reports."""
    if is_buffer(value):
        g = value.gpu
        return f"CpuGpuBuffer[{str(g.dtype).replace('torch.', '')}, {tuple(g.shape)}]"
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return type(value).__name__
    return f"Tensor[{str(dtype).replace('torch.', '')}, {tuple(value.shape)}, {value.device}]"
