"""triton-ascend language extensions (``triton.language.extra.cann.extension``) that vllm-ascend's Triton kernels
call, written with plain Triton language ops so the kernels run under ``TRITON_INTERPRET=1`` on CPU.

- ``get_element(src, indice)``: the scalar ``src[indice]`` of a 1-D block ``src`` (triton-ascend: "get a single
  element from a tensor by index"). vllm-ascend's rejection sampler (``ops/triton/reject_sample.py``) reads
  per-request counts, start offsets and draft / target ids from 1-D blocks with ``get_element(x, (pos,))``:
  0.18 resolves it from ``triton.language.extra.cann.extension``, 0.13 calls ``tl.get_element`` (the triton-ascend
  build of 0.13's time put it on ``triton.language`` itself).
  Emulated as a masked sum over the block (exact: every other lane contributes 0); a boolean block gives a
  boolean. Only 1-D blocks.
- ``insert_slice`` / ``extract_slice`` are not on the eager Llama + EAGLE path (used by swiglu_quant and the
  FLA kernels); they stay the stand-in's raising functions.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def get_element(src, indice):
    tl.static_assert(len(src.shape) == 1, "emulated get_element: only 1-D blocks are implemented")
    tl.static_assert(len(indice) == 1, "emulated get_element: only a 1-tuple index is implemented")
    lanes = tl.arange(0, src.shape[0])
    if src.dtype == tl.int1:
        # a sum over a boolean block is an int32: the element comes back as a boolean again (compiled Triton refuses
        # `not rejected and <int32>`, the rejection kernel's use of a mask element)
        element = tl.sum(tl.where(lanes == indice[0], src.to(tl.int32), 0), axis=0) != 0
    else:
        element = tl.sum(tl.where(lanes == indice[0], src, tl.zeros_like(src)), axis=0)
    return element


EXTENSION_OPS = {"get_element": get_element}


def bind(family: str) -> None:
    """Put the emulations where the stand-in family's vllm-ascend looks them up; must run before
    vllm_ascend.ops.triton is imported (0.18+ resolves them at import)."""
    if family == "0.13":
        # the real triton.language gains the name only in the engine process that installs the emulation
        namespace = tl
    else:
        import triton.language.extra.cann.extension as namespace  # the stand-in module

    for name, fn in EXTENSION_OPS.items():
        setattr(namespace, name, fn)
