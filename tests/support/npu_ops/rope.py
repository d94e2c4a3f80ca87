"""``torch_npu._npu_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox_style)``: rotary
position embedding applied in place (ATB/torch_npu port of vLLM's ``rotary_embedding`` kernel; returns None).

vllm-ascend 0.13 (``ops/rotary_embedding.py`` ``_rope_forward_oot``, the branch taken with custom ops disabled and
``rotary_dim == head_size``) calls it with ``query [T, N * head_size]``, ``key [T, KVN * head_size]`` (contiguous,
flattened heads), ``positions [T]`` and ``cos_sin_cache [max_position, rot_dim]`` whose first half of each row is
``cos`` and second half ``sin`` of ``positions * inv_freq``. For token ``t`` and every head, with
``c, s = cos_sin_cache[positions[t]].chunk(2)`` and the head split into halves ``x1, x2`` (NeoX style):
``x1' = x1 * c - x2 * s``, ``x2' = x2 * c + x1 * s``. (0.18 runs vllm-ascend's Triton RoPE kernel instead.)

Implemented: NeoX style, ``rot_dim == head_size``; ``query``, ``key`` and ``cos_sin_cache`` float16 or bfloat16, one
dtype (ATB RopeOperation's types; the release casts the cache to the query's dtype first), float32 refused. GPT-J
(interleaved) style, a partial rotary dim, or shapes that are not ``[T, heads * head_size]`` raise
NotImplementedError.
"""

from __future__ import annotations

import torch

from ._check import HALF, dtypes, unsupported

OP = "_npu_rotary_embedding"


def _npu_rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool,
) -> None:
    dtypes(OP, HALF, query=query, key=key, cos_sin_cache=cos_sin_cache)
    if not is_neox_style:
        raise unsupported(OP, "is_neox_style=False (GPT-J interleaved rotation)")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_size:
        raise unsupported(
            OP, f"cos_sin_cache {tuple(cos_sin_cache.shape)} for head_size={head_size} (only full rotary)"
        )
    tokens = positions.shape[0]
    for name, x in (("query", query), ("key", key)):
        if positions.dim() != 1 or x.dim() != 2 or x.shape[0] != tokens or x.shape[1] % head_size:
            raise unsupported(OP, f"{name} {tuple(x.shape)} with positions {tuple(positions.shape)}")
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, head_size / 2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    for x in (query, key):
        heads = x.view(tokens, -1, head_size)
        x1, x2 = heads.float().chunk(2, dim=-1)
        heads.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype))


OPS = {OP: _npu_rotary_embedding}
