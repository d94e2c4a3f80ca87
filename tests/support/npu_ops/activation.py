"""``torch_npu.npu_swiglu(x, dim=-1)``: split ``x`` into two equal halves ``a, b`` along ``dim`` and return
``silu(a) * b`` (torch_npu docs: "Swish(A) * B", A the first half). vllm-ascend's AscendSiluAndMul
(``ops/activation.py``) calls it on the gate_up projection ``[num_tokens, 2 * intermediate]`` (gate first).
``x`` is float16, bfloat16 or float32; anything else is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._check import HALF_OR_FLOAT, dtypes, unsupported


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    dtypes("npu_swiglu", HALF_OR_FLOAT, x=x)
    if x.shape[dim] % 2:
        raise unsupported("npu_swiglu", f"odd split size {x.shape[dim]} along dim {dim}")
    a, b = x.chunk(2, dim=dim)
    return (F.silu(a.float()) * b.float()).to(x.dtype)


OPS = {"npu_swiglu": npu_swiglu}
