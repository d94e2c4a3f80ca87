"""``torch_npu._npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices)`` (ATB ReshapeAndCache,
ND cache layout): for every token ``t`` with ``slot = slot_indices[t] >= 0``, write ``key[t]`` to
``key_cache[slot // block_size, slot % block_size]`` and ``value[t]`` likewise, in place.

Layouts as vllm-ascend 0.18 uses them (``attention/attention_v1.py`` reshape_and_cache via
``device/device_op.py`` BaseDeviceAdaptor): ``key/value [num_tokens, num_kv_heads, head_size]``,
``key_cache/value_cache [num_blocks, block_size, num_kv_heads, head_size]``, ``slot_indices [num_tokens]``
int32/int64. Negative slots (padding) are skipped, as vLLM's own reshape_and_cache kernels do.
"""

from __future__ import annotations

import torch

from ._check import unsupported


def _npu_reshape_and_cache(
    *,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    op = "_npu_reshape_and_cache"
    if key_cache.dim() != 4 or key.dim() != 3 or key_cache.shape[2:] != key.shape[1:]:
        raise unsupported(
            op,
            f"layout key {tuple(key.shape)} / key_cache {tuple(key_cache.shape)} (only ND "
            "[tokens, kv_heads, head] -> [blocks, block_size, kv_heads, head])",
        )
    if value.shape != key.shape or value_cache.shape != key_cache.shape:
        raise unsupported(op, "value / value_cache shapes different from key / key_cache")
    if slot_indices.shape != (key.shape[0],):
        raise unsupported(op, f"slot_indices shape {tuple(slot_indices.shape)} for {key.shape[0]} tokens")
    block_size = key_cache.shape[1]
    slots = slot_indices.long()
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[keep].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[keep].to(value_cache.dtype)


OPS = {"_npu_reshape_and_cache": _npu_reshape_and_cache}
