"""``torch_npu._npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices)`` (ATB ReshapeAndCache,
ND cache layout): for every token ``t`` with ``slot = slot_indices[t] >= 0``, write ``key[t]`` to
``key_cache[slot // block_size, slot % block_size]`` and ``value[t]`` likewise, in place.

Layouts as vllm-ascend 0.18 uses them (``attention/attention_v1.py`` reshape_and_cache via
``device/device_op.py`` BaseDeviceAdaptor): ``key/value [num_tokens, num_kv_heads, head_size]``,
``key_cache/value_cache [num_blocks, block_size, num_kv_heads, head_size]``, ``slot_indices [num_tokens]``
int32/int64. Negative slots (padding) are skipped, as vLLM's own reshape_and_cache kernels do. Key, value and both
caches are float16 or bfloat16, one dtype (ATB's documented types besides int8, which is not implemented here):
float32 is refused, as ATB refuses it.

Written without boolean indexing, which would make the host wait for the device on every call (on CUDA, where the
GPU machine runs it): every token scatters into slot ``max(slot, 0)`` by accumulation, padding tokens with zeros, and a
slot takes its scattered value when a non-padding token targets it (the non-padding tokens of one call target
distinct slots: one token per slot).

A slot at or past the cache's end is outside the op's semantics (ATB would write past the cache): the scatter raises
(``IndexError`` on CPU, a device-side assert on CUDA, reported asynchronously). ``NPU_OPS_CHECK_SLOTS=1`` checks
first and raises ``IndexError`` naming the slots and the caller's stack, at the cost of one host wait per call (a
debugging switch for the GPU machine, where the assert names no values).
"""

from __future__ import annotations

import os
import traceback

import torch

from ._check import HALF, dtypes, unsupported


def _npu_reshape_and_cache(
    *,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    op = "_npu_reshape_and_cache"
    dtypes(op, HALF, key=key, value=value, key_cache=key_cache, value_cache=value_cache)
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
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_indices.long()
    if os.environ.get("NPU_OPS_CHECK_SLOTS") == "1":
        past = (slots >= num_slots).nonzero().view(-1).tolist()  # waits for the device
        if past:
            # the release's frames (torch's module-call plumbing left out), innermost first
            frames = [f for f in traceback.extract_stack()[:-1] if f"{os.sep}torch{os.sep}" not in f.filename]
            callers = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-14:]))
            raise IndexError(
                f"{op}: slots {slots[past].tolist()} of tokens {past} (of {slots.numel()}) are past the cache's "
                f"{num_slots} slots ({key_cache.shape[0]} blocks of {key_cache.shape[1]}); called from {callers}"
            )
    keep = slots >= 0
    target = slots.clamp(min=0)
    written = torch.zeros(num_slots, dtype=torch.int32, device=slots.device)
    written = written.index_put_((target,), keep.int(), accumulate=True).view(-1, 1, 1) > 0
    for src, cache in ((key, key_cache), (value, value_cache)):
        flat = cache.view(num_slots, *cache.shape[2:])  # the cache itself (a view raises if it is not contiguous)
        rows = torch.where(
            keep.view(-1, 1, 1), src.to(cache.dtype), torch.zeros((), dtype=cache.dtype, device=cache.device)
        )
        staged = torch.zeros_like(flat).index_put_((target,), rows, accumulate=True)
        flat.copy_(torch.where(written, staged, flat))


OPS = {"_npu_reshape_and_cache": _npu_reshape_and_cache}
