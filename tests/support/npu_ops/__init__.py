"""Plain-torch emulations of the NPU ops that vllm-ascend's eager forward, KV-cache writes, attention, sampler and
drafter call (test-only; docs/e2e.md lists them and what each covers). One module per op family; each op
documents its semantics and raises NotImplementedError naming the op and the argument combination it does not
implement. ``bind(torch_npu)`` hangs them on the torch_npu stand-in.
"""

from __future__ import annotations

from . import activation, attention, kv_cache, mla, norm, rope

TORCH_NPU_OPS: dict[str, object] = {
    **norm.OPS,
    **activation.OPS,
    **kv_cache.OPS,
    **attention.OPS,
    **rope.OPS,
    **mla.OPS,
}


def bind(torch_npu) -> None:
    for name, fn in TORCH_NPU_OPS.items():
        setattr(torch_npu, name, fn)
    torch_npu.atb = mla.atb_namespace()  # torch_npu.atb.npu_ring_mla / npu_paged_cache_load (MLA prefill)
