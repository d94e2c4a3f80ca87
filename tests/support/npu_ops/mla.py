"""The NPU ops of vllm-ascend's MLA attention (``attention/mla_v1.py`` ``AscendMLAImpl``, unquantised, no MLAPO, ND
caches), as the eager forward of a DeepSeek-V3-style model calls them on 0.18.0, 0.13.0 and 0.23.0. Every op documents
its semantics (torch_npu / ATB documentation: op-plugin ``torch_npu-<op>.md``, ops-transformer READMEs, ATB
``RingMLAOperation`` / ``PagedCacheLoadOperation``) for the argument combinations the release uses, refuses the
dtypes, head counts and dims the real op refuses, and raises NotImplementedError naming the op and the argument for
any other mode. The widths are DeepSeek's: latent (``kv_lora_rank``) 512, RoPE 64, no-RoPE query / key and value
heads 128 (Ring MLA's), 32 / 64 / 128 query heads (FIA's MLA mode).

RoPE layout (``npu_interleave_rope`` and the RoPE half of ``npu_kv_rmsnorm_rope_cache``): the input's 64 dims hold
(x0, x1) pairs interleaved; the op first de-interleaves them, ``q = cat(x[..., 0::2], x[..., 1::2])``, then rotates
NeoX style, ``q * cos + rotate_half(q) * sin`` with ``rotate_half(q) = cat(-q[32:], q[:32])``: the output is in the
de-interleaved (half) layout. vllm-ascend's cos / sin rows are ``cat(c, c)`` / ``cat(s, s)`` of the 32 frequencies
(``_record_cos_and_sin_cache_interleaved``); query and key get the same treatment, so their dot products are
transformers' DeepSeek-V3 ``apply_rotary_pos_emb_interleave``'s.

No op reads a value back to the host except where the release hands a length list the NPU op also takes on the host
(FIA's ``actual_seq_*``, Ring MLA's ``seqlen``, the context lengths of ``npu_paged_cache_load``, which ATB reads on the
host as well).
"""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import torch

from ._check import HALF, HALF_OR_FLOAT, dtypes, only_defaults, unsupported

LATENT, ROPE, NOPE, V_HEAD = 512, 64, 128, 128
FIA_MLA_HEADS = (32, 64, 128)  # FIA's MLA mode: query heads (KV heads 1)
FIA_MAX_QUERY = 16  # TND: query tokens per request
FIA_MLA_BLOCK_SIZES = (16, 128)

# "<op> <mode>" -> calls that passed the argument checks (tests/engine/run_engine.py reports those of the generation)
CALLS: Counter[str] = Counter()


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """De-interleave the last dim, then NeoX rotation; float32."""
    xf = x.float()
    q = torch.cat((xf[..., 0::2], xf[..., 1::2]), dim=-1)
    half = q.shape[-1] // 2
    rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    return q * cos.float() + rotated * sin.float()


# -- torch_npu.npu_interleave_rope -------------------------------------------------------------------------------


def npu_interleave_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``npu_interleave_rope(x [B, N, S, 64], cos [B, 1, S or 1, 64], sin) -> y [B, N, S, 64]``: RoPE of an
    interleaved-pair input (module docstring), result in the de-interleaved layout. vllm-ascend 0.13 / 0.18
    ``AscendMLAImpl.rope_single``: the query's RoPE part, ``[tokens, heads, 1, 64]`` with ``[tokens, 1, 1, 64]``
    rows. The op's constraints: 4-D ``x`` / ``cos`` / ``sin``, D = 64, cos / sin with N = 1 and S 1 or ``x``'s S,
    float16 / bfloat16 (one dtype). The release hands it a strided view (the query's RoPE columns): the aclnn kernel
    takes non-contiguous tensors (aclnnInterleaveRope), so the emulation does too."""
    op = "npu_interleave_rope"
    dtypes(op, HALF, x=x, cos=cos, sin=sin)
    if x.dim() != 4 or x.shape[-1] != ROPE:
        raise unsupported(op, f"x {tuple(x.shape)} (only [B, N, S, {ROPE}])")
    b, _, s, d = x.shape
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 4 or t.shape[0] != b or t.shape[1] != 1 or t.shape[2] not in (1, s) or t.shape[3] != d:
            raise unsupported(op, f"{name} {tuple(t.shape)} for x {tuple(x.shape)} (only [B, 1, S or 1, {d}])")
    CALLS[f"{op} interleaved"] += 1
    return _rotate_interleaved(x, cos, sin).to(x.dtype)


# -- torch_npu.npu_kv_rmsnorm_rope_cache ---------------------------------------------------------------------------


def npu_kv_rmsnorm_rope_cache(
    kv: torch.Tensor,
    gamma: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    index: torch.Tensor,
    k_cache: torch.Tensor,
    ckv_cache: torch.Tensor,
    *,
    epsilon: float = 1e-5,
    cache_mode: str = "Norm",
    is_output_kv: bool = False,
    **other,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``npu_kv_rmsnorm_rope_cache(kv [B, 1, S, 576], gamma [512], cos [B, 1, S, 64], sin, index [B * S] int64,
    k_cache [blocks, block_size, 1, 64], ckv_cache [blocks, block_size, 1, 512], epsilon=, cache_mode="PA",
    is_output_kv=) -> (k_cache, ckv_cache, k_rope, c_kv)``: for every token, ``c_kv = rms_norm(kv[..., :512]) *
    gamma`` (float32 statistics) and ``k_rope`` = the interleaved RoPE of ``kv[..., 512:]`` (module docstring),
    scattered in place into ``ckv_cache`` / ``k_cache`` at the token's global slot ``index`` (PagedAttention mode:
    slot // block_size, slot % block_size). vllm-ascend passes -1 (PAD_SLOT_ID) for padding tokens: a negative
    slot writes nothing. ``is_output_kv=True`` (the prefill path, ``exec_kv_prefill``) also returns ``k_rope``
    [B, 1, S, 64] and ``c_kv`` [B, 1, S, 512]; otherwise those two outputs are empty (the release discards them).

    Refused: any cache mode but "PA" (Norm, PA_BNSD, PA_NZ, PA_BLK_*), the quantisation arguments, hidden sizes other
    than 512 + 64 (the op's only ones), dtypes other than float16 / bfloat16 (one dtype for kv, gamma, cos, sin and
    both caches: int8 caches are the quantised modes), index not int64. Non-negative slots of one call are distinct
    (the op's constraint; not checked: that would read the slots back to the host). Written without boolean indexing
    (no host wait on CUDA): padding tokens scatter zeros into slot 0 by accumulation and a slot keeps its value unless
    a real token targets it."""
    op = "npu_kv_rmsnorm_rope_cache"
    only_defaults(op, other, {})
    if cache_mode != "PA":
        raise unsupported(op, f"cache_mode={cache_mode!r} (only 'PA')")
    dtypes(op, HALF, kv=kv, gamma=gamma, cos=cos, sin=sin, k_cache=k_cache, ckv_cache=ckv_cache)
    if kv.dim() != 4 or kv.shape[1] != 1 or kv.shape[3] != LATENT + ROPE:
        raise unsupported(op, f"kv {tuple(kv.shape)} (only [B, 1, S, {LATENT + ROPE}])")
    b, _, s, _ = kv.shape
    if gamma.shape != (LATENT,):
        raise unsupported(op, f"gamma {tuple(gamma.shape)} (only [{LATENT}])")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (b, 1, s, ROPE):
            raise unsupported(op, f"{name} {tuple(t.shape)} (only [{b}, 1, {s}, {ROPE}])")
    if index.dtype != torch.int64 or index.shape != (b * s,):
        raise unsupported(op, f"index {index.dtype} {tuple(index.shape)} (PA: int64 [B * S])")
    if k_cache.dim() != 4 or k_cache.shape[2:] != (1, ROPE) or ckv_cache.shape != (*k_cache.shape[:2], 1, LATENT):
        raise unsupported(
            op, f"caches {tuple(k_cache.shape)} / {tuple(ckv_cache.shape)} (PA: [blocks, block_size, 1, 64 / 512])"
        )
    CALLS[f"{op} PA{' is_output_kv' if is_output_kv else ''}"] += 1
    x = kv.float()
    c = x[..., :LATENT]
    c_kv = c * torch.rsqrt(c.pow(2).mean(dim=-1, keepdim=True) + epsilon) * gamma.float()
    k_rope = _rotate_interleaved(kv[..., LATENT:], cos, sin)
    _scatter(index, k_rope.reshape(b * s, ROPE), k_cache)
    _scatter(index, c_kv.reshape(b * s, LATENT), ckv_cache)
    if is_output_kv:
        return k_cache, ckv_cache, k_rope.to(kv.dtype), c_kv.to(kv.dtype)
    empty = kv.new_empty(0)
    return k_cache, ckv_cache, empty, empty


def _scatter(slots: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor) -> None:
    """cache.view(slots, width)[slot] = row for every slot >= 0, in place (the accumulation trick of kv_cache.py)."""
    num_slots = cache.shape[0] * cache.shape[1]
    flat = cache.view(num_slots, -1)
    keep = slots >= 0
    target = slots.clamp(min=0)
    written = torch.zeros(num_slots, dtype=torch.int32, device=slots.device)
    written = written.index_put_((target,), keep.int(), accumulate=True).view(-1, 1) > 0
    rows = torch.where(keep.view(-1, 1), rows.to(cache.dtype), torch.zeros((), dtype=cache.dtype, device=cache.device))
    staged = torch.zeros_like(flat).index_put_((target,), rows, accumulate=True)
    flat.copy_(torch.where(written, staged, flat))


# -- FIA in its MLA mode: npu_fused_infer_attention_score_v2 (0.18), npu_fused_infer_attention_score (0.13) -------


def _fia_mla(
    op: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_rope: torch.Tensor,
    key_rope: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    input_layout: str,
    atten_mask: torch.Tensor | None,
    sparse_mode: int,
    scale: float,
    block_table: torch.Tensor | None,
    block_size: int,
    q_ends,
    kv_lens,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention over paged latent caches (see the two entry points), in two layouts:

    * ``TND_NTD``, right-down causal (``sparse_mode=3`` with the compressed mask): query rows of each request up to
      its cumulative end, output ``[N, T, 512]``;
    * ``BNSD_NBSD`` with one query token per batch entry (S = 1), ``sparse_mode=0`` without mask, no query lengths:
      entry b attends to all ``kv_lens[b]`` keys (what right-down causal gives a single last token), output
      ``[N, B, 1, 512]`` (vllm-ascend 0.13's decode of a batch its runner does not call speculative: every request
      new, e.g. one-token prompts)."""
    dtypes(op, HALF, query=query, key=key, query_rope=query_rope, key_rope=key_rope)
    if value is not key:
        raise unsupported(op, "value other than key (the MLA mode attends over the latent cache as key and value)")
    if input_layout == "BNSD_NBSD":
        if sparse_mode != 0 or atten_mask is not None or q_ends is not None:
            raise unsupported(op, "BNSD_NBSD with a mask, sparse_mode other than 0 or query lengths")
        if query.dim() != 4 or query.shape[2] != 1 or query_rope.dim() != 4 or query_rope.shape[2] != 1:
            raise unsupported(op, f"BNSD_NBSD query {tuple(query.shape)}: only one query token per batch entry (S = 1)")
        # one token per entry: the TND rows below with ends 1..B; right-down causal lets a last token see every key
        query, query_rope, q_ends = query[:, :, 0], query_rope[:, :, 0], list(range(1, query.shape[0] + 1))
    elif input_layout != "TND_NTD":
        raise unsupported(op, f"input_layout={input_layout!r} (only 'TND_NTD' and 'BNSD_NBSD')")
    elif sparse_mode != 3:
        raise unsupported(op, f"sparse_mode={sparse_mode} (TND_NTD: only 3, right-down causal)")
    elif atten_mask is None:
        raise unsupported(op, "sparse_mode=3 without atten_mask (the NPU op requires the compressed mask)")
    if num_heads not in FIA_MLA_HEADS or num_kv_heads != 1:
        raise unsupported(
            op, f"{num_heads} query / {num_kv_heads} KV heads (MLA: query heads {FIA_MLA_HEADS}, one KV head)"
        )
    if query.dim() != 3 or query.shape[1:] != (num_heads, LATENT) or query_rope.shape != (*query.shape[:2], ROPE):
        raise unsupported(op, f"query {tuple(query.shape)} / query_rope {tuple(query_rope.shape)} (MLA: 512 + 64)")
    if block_table is None or block_size not in FIA_MLA_BLOCK_SIZES:
        raise unsupported(op, f"block_table / block_size={block_size} (MLA: paged, blocks of {FIA_MLA_BLOCK_SIZES})")
    if key.dim() != 4 or key.shape[1:] != (1, block_size, LATENT) or key_rope.shape != (*key.shape[:3], ROPE):
        raise unsupported(
            op, f"key {tuple(key.shape)} / key_rope {tuple(key_rope.shape)} (paged [blocks, 1, block_size, 512 / 64])"
        )
    q_ends, kv_lens = [int(x) for x in _as_list(op, q_ends)], [int(x) for x in _as_list(op, kv_lens)]
    tokens = query.shape[0]
    if len(q_ends) != len(kv_lens) or not q_ends or q_ends[-1] != tokens:
        raise unsupported(op, f"query ends {q_ends} / kv lengths {kv_lens} for {tokens} query rows (TND)")
    if block_table.shape[0] < len(q_ends):
        raise unsupported(op, f"block_table rows {block_table.shape[0]} < {len(q_ends)} requests")
    CALLS[f"{op} MLA {input_layout} sparse_mode={sparse_mode} paged"] += 1
    out = torch.zeros(num_heads, tokens, LATENT, dtype=query.dtype, device=query.device)
    lse = torch.zeros(tokens, num_heads, 1, dtype=torch.float32, device=query.device)
    start = 0
    for b, end in enumerate(q_ends):
        q_len, kv_len = end - start, kv_lens[b]
        if q_len > FIA_MAX_QUERY or q_len > kv_len:
            raise unsupported(op, f"request {b}: {q_len} query tokens with {kv_len} kv tokens (TND: 1..16, q <= kv)")
        if q_len == 0:
            continue
        blocks = block_table[b, : -(-kv_len // block_size)].long()
        c = key[blocks].reshape(-1, LATENT)[:kv_len].float()  # [kv, 512]: key and value
        r = key_rope[blocks].reshape(-1, ROPE)[:kv_len].float()
        qn = query[start:end].float().transpose(0, 1)  # [N, q, 512]
        qr = query_rope[start:end].float().transpose(0, 1)
        scores = (qn @ c.T + qr @ r.T) * scale  # [N, q, kv]
        allowed = (
            torch.arange(kv_len, device=query.device)[None, :]
            <= (kv_len - q_len + torch.arange(q_len, device=query.device))[:, None]
        )
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse[start:end] = torch.logsumexp(scores, dim=-1).transpose(0, 1)[..., None]
        out[:, start:end] = (torch.softmax(scores, dim=-1) @ c).to(query.dtype)
        start = end
    if input_layout == "BNSD_NBSD":
        return out[:, :, None], lse[:, :, None]
    return out, lse


def _as_list(op: str, x) -> list:
    if x is None:
        raise unsupported(op, "missing query / kv lengths (TND needs both)")
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def npu_fused_infer_attention_score_v2(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    query_rope: torch.Tensor | None = None,
    key_rope: torch.Tensor | None = None,
    num_query_heads: int = 1,
    num_key_value_heads: int = 0,
    input_layout: str = "BSH",
    atten_mask: torch.Tensor | None = None,
    sparse_mode: int = 0,
    softmax_scale: float = 1.0,
    block_table: torch.Tensor | None = None,
    block_size: int = 0,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    **other,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FIA v2 in its MLA mode, as vllm-ascend 0.18 ``AscendMLAImpl._forward_decode`` calls it for every query of at
    most 1 + k tokens per request (decode, spec-decode verify, the MTP drafter's passes, short prefills with a
    speculative config): ``query [T, N, 512]`` (the query absorbed into the latent space), ``key`` = ``value`` = the
    latent cache ``[blocks, 1, block_size, 512]``, ``query_rope [T, N, 64]``, ``key_rope`` = the RoPE cache
    ``[blocks, 1, block_size, 64]``, ``num_key_value_heads=1``, ``input_layout="TND_NTD"``, ``sparse_mode=3`` with
    the compressed mask, ``block_table [B, max_blocks]``, ``actual_seq_qlen`` = cumulative query ends (the last equals
    T), ``actual_seq_kvlen`` = per-request KV lengths. Request b's query row i attends its KV tokens j <=
    kv_b - q_b + i with score ``(q_nope . c_j + q_rope . r_j) * softmax_scale`` (float32 softmax) and value ``c_j``.
    Returns ``(out [N, T, 512], lse [T, N, 1] float32)`` (NTD output; rows past the last request are not written: 0).

    Refused: any call without ``query_rope`` (FIA v2's dense modes are not reached by vllm-ascend's eager paths),
    other layouts / sparse modes, query heads outside 32 / 64 / 128 or KV heads other than 1 (the MLA mode's),
    widths other than 512 + 64, more than 16 query tokens per request, blocks other than 16 / 128, float32 and mixed
    dtypes, quantisation / pse / learnable-sink / lse arguments."""
    op = "npu_fused_infer_attention_score_v2"
    only_defaults(op, other, {"softmax_lse_flag": False, "inner_precise": 0})
    if query_rope is None or key_rope is None:
        raise unsupported(op, "a call without query_rope / key_rope (only the MLA mode)")
    return _fia_mla(
        op,
        query,
        key,
        value,
        query_rope,
        key_rope,
        num_heads=num_query_heads,
        num_kv_heads=num_key_value_heads,
        input_layout=input_layout,
        atten_mask=atten_mask,
        sparse_mode=sparse_mode,
        scale=softmax_scale,
        block_table=block_table,
        block_size=block_size,
        q_ends=actual_seq_qlen,
        kv_lens=actual_seq_kvlen,
    )


def fia_v1_mla(query, key, value, *, query_rope, key_rope, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``npu_fused_infer_attention_score`` (v1) in its MLA mode, as vllm-ascend 0.13 ``AscendMLAImpl._forward_decode``
    calls it: the v2 mode above under v1's argument names (``num_heads``, ``scale``, ``actual_seq_lengths`` /
    ``actual_seq_lengths_kv``) plus ``antiquant_mode=0`` / ``antiquant_scale=None``; reached through
    ``attention.npu_fused_infer_attention_score`` when ``query_rope`` is given."""
    op = "npu_fused_infer_attention_score"
    names = ("num_heads", "scale", "input_layout", "num_key_value_heads", "sparse_mode", "atten_mask")
    names += ("block_table", "block_size", "actual_seq_lengths", "actual_seq_lengths_kv")
    args = {n: kwargs.pop(n, None) for n in names}
    only_defaults(op, kwargs, {"antiquant_mode": 0, "inner_precise": 0, "softmax_lse_flag": False})
    return _fia_mla(
        op,
        query,
        key,
        value,
        query_rope,
        key_rope,
        num_heads=args["num_heads"] or 1,
        num_kv_heads=args["num_key_value_heads"] or 0,
        input_layout=args["input_layout"] or "BSH",
        atten_mask=args["atten_mask"],
        sparse_mode=args["sparse_mode"] or 0,
        scale=1.0 if args["scale"] is None else args["scale"],
        block_table=args["block_table"],
        block_size=args["block_size"] or 0,
        q_ends=args["actual_seq_lengths"],
        kv_lens=args["actual_seq_lengths_kv"],
    )


def fia_v1_with_rope(query, key, value, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``npu_fused_infer_attention_score`` with ``query_rope`` / ``key_rope``: the op's two documented RoPE modes,
    told apart by the query's last dim as the op tells them apart -- 512, the MLA mode (vllm-ascend 0.13's decode,
    ``fia_v1_mla``); otherwise the RoPE-split TND mode (vllm-ascend 0.23's MLA prefill, ``fia_v1_rope_split``), which
    refuses any width but 128."""
    if query.shape[-1] == LATENT:
        return fia_v1_mla(query, key, value, **kwargs)
    return fia_v1_rope_split(query, key, value, **kwargs)


FIA_ROPE_SPLIT_MAX_BATCH = 4096  # the op's limit on the length lists' entries in this mode


def fia_v1_rope_split(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    query_rope: torch.Tensor,
    key_rope: torch.Tensor,
    num_heads: int = 1,
    num_key_value_heads: int = 0,
    scale: float = 1.0,
    input_layout: str = "BSH",
    atten_mask: torch.Tensor | None = None,
    sparse_mode: int = 0,
    block_table: torch.Tensor | None = None,
    block_size: int = 0,
    actual_seq_lengths=None,
    actual_seq_lengths_kv=None,
    softmax_lse_flag: bool = False,
    **other,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``npu_fused_infer_attention_score`` (v1), TND, with the key's RoPE part passed apart (op-plugin
    ``torch_npu-npu_fused_infer_attention_score.md``, "query的d等于128"), as vllm-ascend 0.23
    ``AscendMLAImpl._forward_prefill`` / ``_compute_prefill_context`` call it for the prefill tokens' decompressed
    heads: ``query [T, N, 128]`` + ``query_rope [T, N, 64]``, ``key [S, N, 128]`` + ``key_rope [S, N, 64]``,
    ``value [S, N, 128]``, ``num_heads`` = ``num_key_value_heads`` = N, unpaged; ``actual_seq_lengths`` /
    ``actual_seq_lengths_kv`` the cumulative query / key ends per request (TND: the last ones equal T / S). Query row
    i of request b (q_b rows, kv_b keys) scores key j with ``(q_nope . k_nope_j + q_rope . k_rope_j) * scale``
    (float32 softmax) and returns the softmax-weighted values:

    - ``sparse_mode=3`` with the compressed mask (the new tokens, causal): keys j <= kv_b - q_b + i (right-down
      causal); the release passes equal query and key lists.
    - ``sparse_mode=0`` without a mask (a context chunk): every key of the request's chunk.

    Returns ``(attention_out [T, N, 128], softmax_lse)``: with ``softmax_lse_flag=True`` the LSE ``[T, N, 1]``
    float32 (natural log of the softmax denominator, max-shifted as the op documents); otherwise the op's ``[1]``
    zero. A request with no key in the call (a prefill without context in a context chunk: its chunk length is 0)
    gets output 0 and LSE -inf: the output is the op's documented fill for an empty key; the LSE for it is not
    documented, and -inf (log of an empty sum) is the one value with which the release's merge of the chunks
    (``npu_attention_update``) leaves such a request's result unchanged, as it must.

    Refused (the op's constraints in this mode, or modes the release does not use): dtypes other than bfloat16 (the
    only one this mode takes), widths other than 128 + 64 and value 128, different query / key / value head counts,
    NTD_TND and other layouts, sparse modes but 0 without mask / 3 with mask, page attention, more than 4096
    requests, query rows past a request's keys under sparse_mode 3 (the document says "<"; the release's prefill
    passes equal lists, which is causal self-attention), lists that do not end at T / S, quantisation / pse / padding
    arguments."""
    op = "npu_fused_infer_attention_score"
    only_defaults(op, other, {"antiquant_mode": 0, "inner_precise": 0})
    dtypes(op, ("bfloat16",), query=query, key=key, value=value, query_rope=query_rope, key_rope=key_rope)
    if input_layout != "TND":
        raise unsupported(op, f"input_layout={input_layout!r} with query_rope and d=128 (only 'TND')")
    if block_table is not None or block_size:
        raise unsupported(op, "page attention with query_rope and d=128 (the mode is unpaged)")
    if (sparse_mode, atten_mask is None) not in ((0, True), (3, False)):
        raise unsupported(
            op, f"sparse_mode={sparse_mode} with atten_mask {'absent' if atten_mask is None else 'given'}"
        )
    heads = num_key_value_heads or num_heads
    tokens, keys = query.shape[0], key.shape[0]
    expected = {
        "query": (query, (tokens, num_heads, NOPE)),
        "query_rope": (query_rope, (tokens, num_heads, ROPE)),
        "key": (key, (keys, heads, NOPE)),
        "key_rope": (key_rope, (keys, heads, ROPE)),
        "value": (value, (keys, heads, V_HEAD)),
    }
    for name, (t, shape) in expected.items():
        if t.dim() != 3 or tuple(t.shape) != shape or heads != num_heads:
            raise unsupported(op, f"{name} {tuple(t.shape)} with {num_heads} / {heads} heads (TND: 128 + 64, N = KV_N)")
    q_ends, kv_ends = (
        [int(x) for x in _as_list(op, actual_seq_lengths)],
        [int(x) for x in _as_list(op, actual_seq_lengths_kv)],
    )
    if len(q_ends) != len(kv_ends) or not 0 < len(q_ends) <= FIA_ROPE_SPLIT_MAX_BATCH:
        raise unsupported(op, f"{len(q_ends)} query / {len(kv_ends)} kv lengths (TND: one per request, <= 4096)")
    if q_ends[-1] != tokens or kv_ends[-1] != keys:
        raise unsupported(op, f"lists ending at {q_ends[-1]} / {kv_ends[-1]} for {tokens} query / {keys} key rows")
    CALLS[f"{op} TND rope-split sparse_mode={sparse_mode}{' softmax_lse' if softmax_lse_flag else ''}"] += 1
    out = torch.zeros(tokens, num_heads, V_HEAD, dtype=query.dtype, device=query.device)
    lse = torch.full((tokens, num_heads, 1), -math.inf, dtype=torch.float32, device=query.device)
    q_start = kv_start = 0
    for b, (q_end, kv_end) in enumerate(zip(q_ends, kv_ends)):
        q_len, kv_len = q_end - q_start, kv_end - kv_start
        if q_len < 0 or kv_len < 0:
            raise unsupported(op, f"request {b}: decreasing cumulative lengths {q_ends} / {kv_ends}")
        if sparse_mode == 3 and q_len > kv_len:
            raise unsupported(op, f"request {b}: {q_len} query rows > {kv_len} keys under sparse_mode=3")
        if q_len and kv_len:
            qn = query[q_start:q_end].float().transpose(0, 1)  # [N, q, 128]
            qr = query_rope[q_start:q_end].float().transpose(0, 1)
            kn = key[kv_start:kv_end].float().transpose(0, 1)  # [N, kv, 128]
            kr = key_rope[kv_start:kv_end].float().transpose(0, 1)
            v = value[kv_start:kv_end].float().transpose(0, 1)
            scores = (qn @ kn.transpose(1, 2) + qr @ kr.transpose(1, 2)) * scale  # [N, q, kv]
            if sparse_mode == 3:
                allowed = (
                    torch.arange(kv_len, device=query.device)[None, :]
                    <= (kv_len - q_len + torch.arange(q_len, device=query.device))[:, None]
                )
                scores = scores.masked_fill(~allowed, -math.inf)
            lse[q_start:q_end] = torch.logsumexp(scores, dim=-1).transpose(0, 1)[..., None]
            out[q_start:q_end] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).to(query.dtype)
        q_start, kv_start = q_end, kv_end
    if not softmax_lse_flag:
        lse = torch.zeros(1, dtype=torch.float32, device=query.device)
    return out, lse


# -- torch_npu.npu_attention_update ----------------------------------------------------------------------------------

ATTENTION_UPDATE_MAX_PARTS = 16


def npu_attention_update(lse, local_out, update_type: int) -> tuple[torch.Tensor, None]:
    """``npu_attention_update(lse: [M] float32 x sp, local_out: [M, D] x sp, update_type=0) -> (out [M, D], None)``
    (ops-transformer ``AttentionUpdate``): merges sp partial attention results of the same M query rows through their
    LSEs -- ``lse_max = max_i lse_i``, ``lse_m = lse_max + log(sum_i exp(lse_i - lse_max))``, ``out = sum_i O_i *
    exp(lse_i - lse_m)`` (float32), in ``local_out``'s dtype. ``update_type=0`` returns no merged LSE (torch_npu hands
    back an undefined tensor: ``None``). vllm-ascend 0.23 ``_compute_prefill_context``: the prefill's causal part and
    each context chunk, rows = tokens x heads. A part with LSE -inf for a row adds nothing to it.

    Refused: ``update_type`` 1 (the merged LSE; not used), fewer than 1 or more than 16 parts, LSEs not float32 or
    outputs not float32 / float16 / bfloat16 (one dtype), shapes that differ between parts, D outside [8, 512] or not
    a multiple of 8, non-contiguous tensors (the op's constraints)."""
    op = "npu_attention_update"
    if update_type != 0:
        raise unsupported(op, f"update_type={update_type} (only 0)")
    lse, local_out = list(lse), list(local_out)
    if not 1 <= len(lse) <= ATTENTION_UPDATE_MAX_PARTS or len(lse) != len(local_out):
        raise unsupported(op, f"{len(lse)} LSEs / {len(local_out)} outputs (1..16 parts, one LSE per output)")
    dtypes(op, ("float32",), **{f"lse[{i}]": t for i, t in enumerate(lse)})
    dtypes(op, HALF_OR_FLOAT, **{f"local_out[{i}]": t for i, t in enumerate(local_out)})
    rows = lse[0].shape[0] if lse[0].dim() == 1 else -1
    for i, (part_lse, part_out) in enumerate(zip(lse, local_out)):
        shapes = f"lse {tuple(part_lse.shape)} / local_out {tuple(part_out.shape)}"
        if part_lse.shape != (rows,) or part_out.dim() != 2 or part_out.shape != local_out[0].shape:
            raise unsupported(op, f"part {i}: {shapes} (all [M] / [M, D])")
        if part_out.shape[0] != rows:
            raise unsupported(op, f"part {i}: {shapes} (all [M] / [M, D])")
        if not (part_lse.is_contiguous() and part_out.is_contiguous()):
            raise unsupported(op, f"part {i}: a non-contiguous tensor")
    d = local_out[0].shape[1]
    if not 8 <= d <= 512 or d % 8:
        raise unsupported(op, f"D={d} (8..512, a multiple of 8)")
    CALLS[f"{op} update_type=0"] += 1
    stacked = torch.stack([part.float() for part in lse])  # [sp, M]
    lse_max = stacked.max(dim=0).values
    lse_m = lse_max + torch.log(torch.exp(stacked - lse_max).sum(dim=0))
    weights = torch.exp(stacked - lse_m)  # [sp, M]
    out = sum(w[:, None] * o.float() for w, o in zip(weights, local_out))
    return out.to(local_out[0].dtype), None


# -- torch_npu.npu_transpose_batchmatmul ---------------------------------------------------------------------------


def npu_transpose_batchmatmul(
    input: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    perm_x1=None,
    perm_x2=None,
    perm_y=None,
    batch_split_factor: int = 1,
) -> torch.Tensor:
    """``npu_transpose_batchmatmul(x [B, M, K], w [B, K, N], perm_y=(1, 0, 2)) -> [M, B, N]``: the batched product
    ``x[b] @ w[b]`` (float32 accumulation), its batch and row axes swapped. vllm-ascend ``_v_up_proj``: the
    attention output per head ``[heads, tokens, 512]`` times ``W_UV [heads, 512, v_head_dim]``. Refused: permutations
    of the inputs, any output permutation but (1, 0, 2), bias / scale (quantised), batch splitting, K or N not a
    multiple of 128 (the op's constraint), float32 and mixed dtypes."""
    op = "npu_transpose_batchmatmul"
    dtypes(op, HALF, input=input, weight=weight)
    for name, perm in (("perm_x1", perm_x1), ("perm_x2", perm_x2)):
        if perm is not None and tuple(perm) != (0, 1, 2):
            raise unsupported(op, f"{name}={tuple(perm)}")
    if perm_y is None or tuple(perm_y) != (1, 0, 2):
        raise unsupported(op, f"perm_y={perm_y} (only (1, 0, 2))")
    if bias is not None or scale is not None or batch_split_factor != 1:
        raise unsupported(op, "bias / scale / batch_split_factor")
    if input.dim() != 3 or weight.dim() != 3 or input.shape[0] != weight.shape[0] or input.shape[2] != weight.shape[1]:
        raise unsupported(op, f"shapes {tuple(input.shape)} x {tuple(weight.shape)} (only [B, M, K] x [B, K, N])")
    if input.shape[2] % 128 or weight.shape[2] % 128:
        raise unsupported(op, f"K={input.shape[2]}, N={weight.shape[2]} (multiples of 128)")
    CALLS[f"{op} perm_y=(1, 0, 2)"] += 1
    return torch.bmm(input.float(), weight.float()).to(input.dtype).permute(1, 0, 2).contiguous()


# -- torch_npu.npu_format_cast ---------------------------------------------------------------------------------------

ACL_FORMAT_FRACTAL_ND = 2


def npu_format_cast(tensor: torch.Tensor, acl_format: int) -> torch.Tensor:
    """``npu_format_cast(t, 2)``: the tensor in ACL's ND format. vllm-ascend ``process_weights_after_loading`` casts
    ``kv_b_proj``'s weight to ND before splitting it into W_UK / W_UV; a CPU tensor is ND already, so the cast is the
    tensor itself (what torch_npu returns when the format matches). Any other format (FRACTAL_NZ 29, ...) is refused:
    it changes the memory layout, which plain torch has no form for."""
    if acl_format != ACL_FORMAT_FRACTAL_ND:
        raise unsupported("npu_format_cast", f"acl_format={acl_format} (only ACL_FORMAT_FRACTAL_ND = 2)")
    return tensor


# -- torch_npu.atb.npu_ring_mla --------------------------------------------------------------------------------------


def npu_ring_mla(
    *,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    seqlen: torch.Tensor,
    head_num: int,
    kv_head_num: int,
    pre_out: torch.Tensor | None,
    prev_lse: torch.Tensor | None,
    qk_scale: float,
    kernel_type: str,
    mask_type: str,
    input_layout: str,
    calc_type: str,
    output: torch.Tensor,
    softmax_lse: torch.Tensor,
) -> None:
    """ATB RingMLA (``torch_npu.atb.npu_ring_mla``): multi-head attention with the key split into a no-RoPE part
    (128 per head) and a RoPE part (64), value 128 per head, ``input_layout="type_bsnd"`` (tokens of all requests
    one after another), score ``(q_nope . k_nope + q_rope . k_rope) * qk_scale``, float32 softmax
    (``kernel_type_high_precision``). Writes ``output [T, N, 128]`` and ``softmax_lse [N, T]`` float32 (natural log of
    the softmax denominator) in place. The two modes vllm-ascend 0.13 / 0.18 ``AscendMLAImpl._forward_prefill`` use:

    - ``calc_type="calc_type_first_ring"``, ``mask_type="mask_type_triu"``, ``seqlen [P]``: each prefill request's new
      tokens attend the same tokens causally (query and key lengths both ``seqlen[b]``); no previous result.
    - ``calc_type="calc_type_default"``, ``mask_type="no_mask"``, ``seqlen [2, P]`` (query lengths, key lengths): the
      queries attend one chunk of their context without a mask, and the result is merged with ``pre_out`` /
      ``prev_lse`` through the LSE: ``lse = logaddexp(prev_lse, lse_chunk)``, ``out = e^(prev_lse - lse) pre_out +
      e^(lse_chunk - lse) out_chunk``; a request with no key in the chunk keeps its previous result. ``output`` /
      ``softmax_lse`` may be ``pre_out`` / ``prev_lse`` (the release updates in place).

    Refused: other calc / mask / kernel types and layouts, a mask missing in triu mode, a previous result given to the
    first ring or missing in the default mode, widths other than 128 / 64 / 128, ``kv_head_num`` not dividing
    ``head_num``, float32 and mixed dtypes, lengths that do not add up to the rows given."""
    op = "npu_ring_mla"
    dtypes(op, HALF, q_nope=q_nope, q_rope=q_rope, k_nope=k_nope, k_rope=k_rope, value=value, output=output)
    if kernel_type != "kernel_type_high_precision" or input_layout != "type_bsnd":
        raise unsupported(op, f"kernel_type={kernel_type!r} / input_layout={input_layout!r}")
    if softmax_lse.dtype != torch.float32:
        raise unsupported(op, f"softmax_lse dtype {softmax_lse.dtype} (float32)")
    first = calc_type == "calc_type_first_ring"
    if first:
        if mask_type != "mask_type_triu" or mask is None or pre_out is not None or prev_lse is not None:
            raise unsupported(op, "first ring without the triu mask, or with a previous result")
    elif calc_type == "calc_type_default":
        if mask_type != "no_mask" or pre_out is None or prev_lse is None:
            raise unsupported(op, "default calc type with a mask or without the previous result")
    else:
        raise unsupported(op, f"calc_type={calc_type!r}")
    tq, n = q_nope.shape[:2]
    if n != head_num or kv_head_num <= 0 or head_num % kv_head_num:
        raise unsupported(op, f"head_num={head_num}, kv_head_num={kv_head_num} for query {tuple(q_nope.shape)}")
    if q_nope.shape[2] != NOPE or q_rope.shape != (tq, n, ROPE):
        raise unsupported(op, f"query {tuple(q_nope.shape)} / {tuple(q_rope.shape)} (128 + 64 per head)")
    tk = k_nope.shape[0]
    if k_nope.shape != (tk, kv_head_num, NOPE) or k_rope.shape != (tk, kv_head_num, ROPE):
        raise unsupported(op, f"key {tuple(k_nope.shape)} / {tuple(k_rope.shape)} (128 + 64 per KV head)")
    if value.shape != (tk, kv_head_num, V_HEAD) or output.shape != (tq, n, V_HEAD) or softmax_lse.shape != (n, tq):
        raise unsupported(
            op, f"value {tuple(value.shape)} / output {tuple(output.shape)} / lse {tuple(softmax_lse.shape)}"
        )
    lens = seqlen.tolist()
    q_lens, k_lens = (lens, lens) if first and seqlen.dim() == 1 else (lens[0], lens[1])
    if (first and seqlen.dim() != 1) or (not first and seqlen.dim() != 2):
        raise unsupported(op, f"seqlen {tuple(seqlen.shape)} for {calc_type}")
    if sum(q_lens) != tq or sum(k_lens) != tk:
        raise unsupported(op, f"lengths {q_lens} / {k_lens} for {tq} query and {tk} key rows")
    CALLS[f"{op} {'first_ring triu' if first else 'default no_mask (context chunk)'}"] += 1
    group = head_num // kv_head_num
    new_out = torch.empty(tq, n, V_HEAD, dtype=torch.float32, device=q_nope.device)
    new_lse = torch.empty(n, tq, dtype=torch.float32, device=q_nope.device)
    qs = ks = 0
    for ql, kl in zip(q_lens, k_lens):
        qn = q_nope[qs : qs + ql].float().transpose(0, 1)  # [N, q, 128]
        qr = q_rope[qs : qs + ql].float().transpose(0, 1)
        kn = k_nope[ks : ks + kl].float().repeat_interleave(group, dim=1).transpose(0, 1)
        kr = k_rope[ks : ks + kl].float().repeat_interleave(group, dim=1).transpose(0, 1)
        v = value[ks : ks + kl].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (qn @ kn.transpose(1, 2) + qr @ kr.transpose(1, 2)) * qk_scale  # [N, q, k]
        if first:
            scores = scores.masked_fill(torch.ones(ql, kl, dtype=torch.bool, device=q_nope.device).triu(1), -math.inf)
        lse = torch.logsumexp(scores, dim=-1)  # [N, q]; -inf where no key
        out = (torch.softmax(scores, dim=-1) @ v).nan_to_num(0.0)  # [N, q, 128]
        if not first:
            prev = prev_lse[:, qs : qs + ql].float()
            total = torch.logaddexp(prev, lse)
            w_prev = torch.exp(prev - total)[..., None]
            w_new = torch.exp(lse - total).nan_to_num(0.0)[..., None]
            out = w_prev * pre_out[qs : qs + ql].float().transpose(0, 1) + w_new * out
            lse = total
        new_out[qs : qs + ql] = out.transpose(0, 1)
        new_lse[:, qs : qs + ql] = lse
        qs, ks = qs + ql, ks + kl
    output.copy_(new_out.to(output.dtype))
    softmax_lse.copy_(new_lse)


# -- torch_npu.atb.npu_paged_cache_load ------------------------------------------------------------------------------


def npu_paged_cache_load(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    seq_starts: torch.Tensor | None = None,
    key: torch.Tensor,
    value: torch.Tensor,
    **other,
) -> None:
    """ATB PagedCacheLoad (ND caches, with sequence starts), as vllm-ascend's MLA context chunks call it
    (0.13 ``_compute_prefill_context``, 0.18 ``DeviceOperator.mla_cache_load``): for request b, the cache tokens
    ``[seq_starts[b], seq_starts[b] + context_lens[b])`` -- token j in block ``block_table[b, j // block_size]`` at
    ``j % block_size`` -- copied from ``key_cache [blocks, block_size, 1, 512]`` / ``value_cache [..., 64]`` into
    ``key [tokens, 1, 512]`` / ``value [tokens, 1, 64]``, request after request, in place. Refused: NZ caches (any
    other cache layout), a call without ``seq_starts``, more than one KV head, output rows that are not the sum of
    the lengths, float32 and mixed dtypes."""
    op = "npu_paged_cache_load"
    only_defaults(op, other, {})
    dtypes(op, HALF, key_cache=key_cache, value_cache=value_cache, key=key, value=value)
    if seq_starts is None:
        raise unsupported(op, "a call without seq_starts")
    if key_cache.dim() != 4 or key_cache.shape[2] != 1 or value_cache.shape[:3] != key_cache.shape[:3]:
        raise unsupported(op, f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} (ND, one KV head)")
    block_size = key_cache.shape[1]
    lens, starts = context_lens.tolist(), seq_starts.tolist()
    if key.shape != (sum(lens), 1, key_cache.shape[3]) or value.shape != (sum(lens), 1, value_cache.shape[3]):
        raise unsupported(op, f"outputs {tuple(key.shape)} / {tuple(value.shape)} for lengths {lens}")
    CALLS[f"{op} ND seq_starts"] += 1
    rows = []
    for b, (length, start) in enumerate(zip(lens, starts)):
        j = torch.arange(start, start + length, device=block_table.device)
        rows.append(block_table[b, j // block_size].long() * block_size + j % block_size)
    slots = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long, device=key.device)
    key.copy_(key_cache.reshape(-1, 1, key_cache.shape[3])[slots])
    value.copy_(value_cache.reshape(-1, 1, value_cache.shape[3])[slots])


ATB_OPS = {"npu_ring_mla": npu_ring_mla, "npu_paged_cache_load": npu_paged_cache_load}
OPS = {
    "npu_interleave_rope": npu_interleave_rope,
    "npu_kv_rmsnorm_rope_cache": npu_kv_rmsnorm_rope_cache,
    "npu_fused_infer_attention_score_v2": npu_fused_infer_attention_score_v2,
    "npu_transpose_batchmatmul": npu_transpose_batchmatmul,
    "npu_format_cast": npu_format_cast,
    "npu_attention_update": npu_attention_update,
}


def atb_namespace() -> SimpleNamespace:
    """``torch_npu.atb``: the ATB ops torch_npu exposes there (op-plugin's atb ops)."""
    return SimpleNamespace(**ATB_OPS)
