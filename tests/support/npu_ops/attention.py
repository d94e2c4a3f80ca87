"""``torch_npu.npu_fused_infer_attention_score`` (FIA): incremental / prefill attention, the one attention op
vllm-ascend 0.18's ``AscendAttentionBackendImpl`` calls in eager mode with speculative decoding
(``using_paged_attention`` is False whenever a speculative config is set, so ``_npu_paged_attention`` is not
reached).

Implemented modes -- exactly how ``forward_fused_infer_attention`` calls it for every attention state
(PrefillNoCache, PrefillCacheHit, ChunkedPrefill, DecodeOnly, SpecDecoding):
``input_layout="TND"``, ``sparse_mode=3`` (or ``0`` without a mask), ``scale``, ``num_heads``,
``num_key_value_heads``.

- ``query [T, N, D]``: the batch's query tokens, request after request.
- ``actual_seq_lengths``: cumulative query ends per request (``query_start_loc[1:]``); request ``b`` owns
  query rows ``[ends[b-1], ends[b])``.
- without ``block_table``: ``key/value [T, KVN, D]`` hold the same tokens as the query (prefill without cache);
  ``actual_seq_lengths_kv`` are cumulative too.
- with ``block_table [B, max_blocks]`` and ``block_size``: ``key/value`` are the paged caches viewed as
  ``[num_blocks, block_size, KVN * D]``; request ``b``'s KV token ``j`` lives in block
  ``block_table[b, j // block_size]`` at offset ``j % block_size``; ``actual_seq_lengths_kv[b]`` is request
  ``b``'s KV length (per request, not cumulative: the release passes ``seq_lens``).
- ``sparse_mode=3`` ("rightDownCausal"): query row ``i`` of a request with ``q`` query and ``kv`` KV tokens
  attends KV tokens ``j <= kv - q + i`` (the causal diagonal aligned to the bottom right). On the NPU the
  mask comes in as the compressed 2048x2048 ``atten_mask``; it must be given and is otherwise not read here.
- ``sparse_mode=0`` ("defaultMask") without ``atten_mask``: no mask, every query row attends all ``kv`` KV tokens of
  its request. The ``releases/v0.18.0`` head calls it so for the DecodeOnly state (#10302: one query token per
  request, where it equals right-down causal). ``sparse_mode=0`` with a mask is refused (not used).
- grouped-query attention: head ``h`` reads KV head ``h // (N // KVN)``.
Returns ``(attention_out [T, N, D], softmax_lse [T, N, 1] float32)``; softmax in float32.
``query`` / ``key`` / ``value`` are float16 or bfloat16, one dtype (the op's documented types; int8 only with the
quantisation arguments): float32 is refused, as the NPU refuses it.
Every other layout, sparse mode, quantisation, pse/sink argument raises NotImplementedError. With ``query_rope`` the
call is one of FIA's RoPE modes (vllm-ascend's ``AscendMLAImpl``: 0.13's decode, 0.23's prefill), implemented in
``mla.py`` (``fia_v1_with_rope``).
"""

from __future__ import annotations

import torch

from ._check import HALF, dtypes, only_defaults, unsupported

OP = "npu_fused_infer_attention_score"
_INT_MAX = 2147483647


def npu_fused_infer_attention_score(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    num_heads: int = 1,
    scale: float = 1.0,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    block_table: torch.Tensor | None = None,
    block_size: int = 0,
    **other,
) -> tuple[torch.Tensor, torch.Tensor]:
    if other.get("query_rope") is not None:  # the RoPE modes (vllm-ascend's AscendMLAImpl): npu_ops/mla.py
        from .mla import fia_v1_with_rope

        return fia_v1_with_rope(
            query,
            key,
            value,
            atten_mask=atten_mask,
            actual_seq_lengths=actual_seq_lengths,
            actual_seq_lengths_kv=actual_seq_lengths_kv,
            num_heads=num_heads,
            scale=scale,
            input_layout=input_layout,
            num_key_value_heads=num_key_value_heads,
            sparse_mode=sparse_mode,
            block_table=block_table,
            block_size=block_size,
            **other,
        )
    only_defaults(
        OP, other, {"pre_tokens": _INT_MAX, "next_tokens": _INT_MAX, "inner_precise": 0, "softmax_lse_flag": False}
    )
    dtypes(OP, HALF, query=query, key=key, value=value)
    if input_layout != "TND":
        raise unsupported(OP, f"input_layout={input_layout!r} (only 'TND')")
    if sparse_mode == 0 and atten_mask is not None:
        raise unsupported(OP, "sparse_mode=0 with atten_mask (only without: no mask)")
    if sparse_mode not in (0, 3):
        raise unsupported(OP, f"sparse_mode={sparse_mode} (only 3, right-down causal, or 0 without a mask)")
    if sparse_mode == 3 and atten_mask is None:
        raise unsupported(OP, "sparse_mode=3 without atten_mask (the NPU op requires the compressed mask)")
    causal = sparse_mode == 3
    kv_heads = num_key_value_heads or num_heads
    tokens, heads, head_dim = query.shape
    if heads != num_heads or num_heads % kv_heads:
        raise unsupported(OP, f"num_heads={num_heads}, num_key_value_heads={kv_heads}, query {tuple(query.shape)}")
    q_ends = [int(x) for x in _as_list(actual_seq_lengths)]
    kv_lens_arg = [int(x) for x in _as_list(actual_seq_lengths_kv)]
    if len(q_ends) != len(kv_lens_arg):
        raise unsupported(OP, f"{len(q_ends)} query lengths vs {len(kv_lens_arg)} kv lengths")
    if q_ends and q_ends[-1] > tokens:
        raise unsupported(OP, f"query lengths end at {q_ends[-1]} > {tokens} query rows")

    if block_table is None:
        if key.dim() != 3 or key.shape[1:] != (kv_heads, head_dim):
            raise unsupported(OP, f"unpaged key {tuple(key.shape)} (only [T, KVN, D])")
        kv_starts = [0] + kv_lens_arg[:-1]
        kv_lens = [e - s for s, e in zip(kv_starts, kv_lens_arg)]
    else:
        if block_size <= 0 or key.dim() != 3 or key.shape[1] != block_size or key.shape[2] != kv_heads * head_dim:
            raise unsupported(
                OP, f"paged key {tuple(key.shape)} with block_size={block_size} (only [blocks, block_size, KVN*D])"
            )
        if block_table.shape[0] < len(q_ends):
            raise unsupported(OP, f"block_table rows {block_table.shape[0]} < {len(q_ends)} requests")
        kv_lens = kv_lens_arg

    out = torch.zeros_like(query)  # rows past the last request are not written by the NPU op either
    lse = torch.full((tokens, heads, 1), float("inf"), dtype=torch.float32, device=query.device)
    group = num_heads // kv_heads
    q_start = 0
    for b, q_end in enumerate(q_ends):
        q_len, kv_len = q_end - q_start, kv_lens[b]
        if q_len > kv_len:
            raise unsupported(OP, f"request {b}: {q_len} query tokens > {kv_len} kv tokens")
        if q_len == 0:
            continue
        if block_table is None:
            k = key[kv_starts[b] : kv_starts[b] + kv_len]
            v = value[kv_starts[b] : kv_starts[b] + kv_len]
        else:
            n_blocks = -(-kv_len // block_size)
            blocks = block_table[b, :n_blocks].long()
            k = key[blocks].reshape(-1, kv_heads, head_dim)[:kv_len]
            v = value[blocks].reshape(-1, kv_heads, head_dim)[:kv_len]
        q = query[q_start:q_end].float().transpose(0, 1)  # [N, q, D]
        k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [N, kv, D]
        v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [N, q, kv]
        if causal:
            kv_pos, q_pos = torch.arange(kv_len, device=query.device), torch.arange(q_len, device=query.device)
            allowed = kv_pos[None, :] <= (kv_len - q_len + q_pos)[:, None]
            scores = scores.masked_fill(~allowed, float("-inf"))
        lse[q_start:q_end] = torch.logsumexp(scores, dim=-1).transpose(0, 1)[..., None]
        out[q_start:q_end] = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(0, 1).to(query.dtype)
        q_start = q_end
    return out, lse


def _as_list(x) -> list:
    if x is None:
        raise unsupported(OP, "missing actual_seq_lengths / actual_seq_lengths_kv (TND needs both)")
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


OPS = {OP: npu_fused_infer_attention_score}
