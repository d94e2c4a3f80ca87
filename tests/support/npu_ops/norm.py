"""RMS norm ops: ``torch_npu.npu_rms_norm`` and ``torch_npu.npu_add_rms_norm``.

torch_npu semantics (op-plugin docs):
- ``npu_rms_norm(x, gamma, epsilon=1e-6) -> (y, rstd)``: ``rstd = 1 / sqrt(mean(x**2) + epsilon)`` over the
  trailing ``gamma.dim()`` dimensions of ``x`` (computed in float32, shape = ``x.shape`` with those dimensions
  set to 1), ``y = x * rstd * gamma`` in ``x``'s dtype.
- ``npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6) -> (y, rstd, x)``: ``x = x1 + x2`` (the new residual),
  then ``y, rstd`` as above on ``x``.
vllm-ascend (``ops/layernorm.py`` AscendRMSNorm.forward_oot) calls ``npu_rms_norm(x, weight, eps)`` on
``[num_tokens, hidden]`` and ``npu_add_rms_norm(x, residual, weight, eps)`` when a residual is carried; it
keeps ``y`` and, for the add variant, ``x`` as the next residual. ``x`` (``x1``, ``x2``) and ``gamma`` are float16,
bfloat16 or float32, one dtype; anything else is refused.
"""

from __future__ import annotations

import torch

from ._check import HALF_OR_FLOAT, dtypes, unsupported


def _rms(x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    dtypes("npu_rms_norm", HALF_OR_FLOAT, x=x, gamma=gamma)
    if gamma.shape != x.shape[x.dim() - gamma.dim() :]:
        raise unsupported("npu_rms_norm", f"gamma shape {tuple(gamma.shape)} vs x shape {tuple(x.shape)}")
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = (xf * rstd * gamma.float()).to(x.dtype)
    return y, rstd


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    return _rms(x, gamma, epsilon)


def npu_add_rms_norm(
    x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dtypes("npu_add_rms_norm", HALF_OR_FLOAT, x1=x1, x2=x2, gamma=gamma)
    if x1.shape != x2.shape:
        raise unsupported("npu_add_rms_norm", f"broadcasting x1 {tuple(x1.shape)} + x2 {tuple(x2.shape)}")
    x = x1 + x2
    y, rstd = _rms(x, gamma, epsilon)
    return y, rstd, x


OPS = {"npu_rms_norm": npu_rms_norm, "npu_add_rms_norm": npu_add_rms_norm}
