"""The emulated MLA ops (tests/support/npu_ops/mla.py) against independent naive references, and their refusals.

The strongest check is the attention: FIA's MLA mode attends over the latent cache with the query absorbed into it
(``q_nope @ W_UK``) and the value projected afterwards (``npu_transpose_batchmatmul`` with ``W_UV``); the reference
decompresses the cache into per-head keys and values (``K = c_kv @ W_UK``, ``V = c_kv @ W_UV``) and runs plain softmax
attention in float64, request by request. Ring MLA (first ring + context chunks merged through the LSE) is checked
against one softmax over context and new tokens. RoPE against complex rotation of the interleaved pairs. Inputs in
bfloat16 (what the ops take); references in float64 from the same bfloat16 values.
"""

from __future__ import annotations

import math

import pytest
import torch

from npu_ops import attention, mla

g = torch.Generator().manual_seed(0)
HALF = torch.bfloat16
TOL = {"rtol": 2e-2, "atol": 2e-2}
N, NOPE, V, LATENT, ROPE = 32, mla.NOPE, mla.V_HEAD, mla.LATENT, mla.ROPE
MASK = torch.ones(2048, 2048, dtype=torch.int8).triu(1)


def rnd(*shape, scale=1.0, dtype=HALF):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def cos_sin(positions, theta=10000.0):
    """vllm-ascend's MLA rows: cat(cos, cos) / cat(sin, sin) of the 32 frequencies at each position [T, 64]."""
    freqs = theta ** (-torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
    angles = torch.tensor(positions, dtype=torch.float64)[:, None] * freqs[None, :]
    return torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)


def rope_ref(x, positions):
    """Interleaved pairs (x[2i], x[2i + 1]) rotated as complex numbers by position * theta_i; returned in the half
    layout (all rotated real parts, then all imaginary parts). x [T, ..., 64] float64."""
    freqs = 10000.0 ** (-torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE)
    angle = torch.tensor(positions, dtype=torch.float64)[:, None] * freqs[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (ROPE // 2,)
    z = torch.complex(x[..., 0::2], x[..., 1::2]) * torch.polar(torch.ones_like(angle), angle).view(shape)
    return torch.cat([z.real, z.imag], -1)


def test_interleave_rope_rotates_interleaved_pairs():
    positions = [0, 3, 17, 130, 1000]
    x = rnd(5, N, 1, ROPE)
    c, s = cos_sin(positions)
    out = mla.npu_interleave_rope(x, c.to(HALF).view(5, 1, 1, ROPE), s.to(HALF).view(5, 1, 1, ROPE))
    assert out.dtype == HALF and out.shape == x.shape
    torch.testing.assert_close(out.double(), rope_ref(x.double(), positions), **TOL)


def test_kv_rmsnorm_rope_cache_writes_slots_and_skips_padding():
    positions, slots = [5, 6, 7, 40], torch.tensor([133, 5, -1, 260], dtype=torch.int64)
    kv, gamma = rnd(4, 1, 1, LATENT + ROPE), rnd(LATENT, scale=0.5) + 1
    c, s = cos_sin(positions)
    k_cache, ckv_cache = rnd(3, 128, 1, ROPE), rnd(3, 128, 1, LATENT)
    before_k, before_c = k_cache.clone(), ckv_cache.clone()
    out = mla.npu_kv_rmsnorm_rope_cache(
        kv,
        gamma,
        c.to(HALF).view(4, 1, 1, ROPE),
        s.to(HALF).view(4, 1, 1, ROPE),
        slots,
        k_cache,
        ckv_cache,
        epsilon=1e-6,
        cache_mode="PA",
        is_output_kv=True,
    )
    assert out[0] is k_cache and out[1] is ckv_cache
    x = kv.double().view(4, LATENT + ROPE)
    c_ref = x[:, :LATENT] / torch.sqrt(x[:, :LATENT].pow(2).mean(-1, keepdim=True) + 1e-6) * gamma.double()
    k_ref = rope_ref(x[:, LATENT:], positions)
    torch.testing.assert_close(out[2].double().view(4, ROPE), k_ref, **TOL)
    torch.testing.assert_close(out[3].double().view(4, LATENT), c_ref, **TOL)
    written = {}
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            written[slot] = t
            blk, off = divmod(slot, 128)
            torch.testing.assert_close(k_cache[blk, off, 0].double(), k_ref[t], **TOL)
            torch.testing.assert_close(ckv_cache[blk, off, 0].double(), c_ref[t], **TOL)
    for slot in range(3 * 128):  # every other slot untouched, the padding token's included
        if slot not in written:
            blk, off = divmod(slot, 128)
            assert torch.equal(k_cache[blk, off], before_k[blk, off]) and torch.equal(
                ckv_cache[blk, off], before_c[blk, off]
            )


def _paged(latent, rope_part, block_size, blocks_total, g_perm):
    """Requests' [L_b, 512] / [L_b, 64] rows laid into paged caches [blocks, 1, block_size, D] under a shuffled block
    table; returns (latent cache, rope cache, block table)."""
    per_req = [-(-x.shape[0] // block_size) for x in latent]
    order = torch.randperm(blocks_total, generator=g_perm)
    table = torch.zeros(len(latent), max(per_req), dtype=torch.int32)
    c_cache = rnd(blocks_total, 1, block_size, LATENT)  # stale content everywhere else
    r_cache = rnd(blocks_total, 1, block_size, ROPE)
    used = 0
    for b, (cl, rl) in enumerate(zip(latent, rope_part)):
        for i in range(per_req[b]):
            blk = int(order[used])
            used += 1
            table[b, i] = blk
            rows = slice(i * block_size, min((i + 1) * block_size, cl.shape[0]))
            n = rows.stop - rows.start
            c_cache[blk, 0, :n] = cl[rows]
            r_cache[blk, 0, :n] = rl[rows]
    return c_cache, r_cache, table


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_fia_mla_with_v_up_projection_matches_decompressed_attention(version):
    """Decode / spec-verify queries (1..4 per request) over paged latent caches of 1..300 tokens: absorbed attention
    (the op) then W_UV (npu_transpose_batchmatmul) vs attention over the decompressed per-head keys and values."""
    q_lens, kv_lens, block_size = [1, 4, 3, 2], [1, 300, 129, 17], 128
    case = _decompressed_case(q_lens, kv_lens, block_size, seed=1)
    w_uk, w_uv, latent, rope_part, c_cache, r_cache, table, q_nope, q_rope, scale, q_abs = case
    t = sum(q_lens)
    ends = torch.tensor(q_lens).cumsum(0).tolist()
    common = dict(atten_mask=MASK, sparse_mode=3, input_layout="TND_NTD", block_table=table, block_size=block_size)
    if version == "v2":
        out, _ = mla.npu_fused_infer_attention_score_v2(
            q_abs,
            c_cache,
            c_cache,
            query_rope=q_rope,
            key_rope=r_cache,
            num_query_heads=N,
            num_key_value_heads=1,
            softmax_scale=scale,
            actual_seq_qlen=ends,
            actual_seq_kvlen=kv_lens,
            **common,
        )
    else:
        out, _ = attention.npu_fused_infer_attention_score(
            q_abs,
            c_cache,
            c_cache,
            query_rope=q_rope,
            key_rope=r_cache,
            num_heads=N,
            num_key_value_heads=1,
            scale=scale,
            antiquant_mode=0,
            antiquant_scale=None,
            actual_seq_lengths=ends,
            actual_seq_lengths_kv=kv_lens,
            **common,
        )
    assert out.shape == (N, t, LATENT)
    got = mla.npu_transpose_batchmatmul(out, w_uv, perm_y=(1, 0, 2))  # [T, N, V]
    _assert_decompressed(got, q_lens, kv_lens, latent, rope_part, w_uk, w_uv, q_nope, q_rope, scale)


def test_fia_mla_bnsd_one_token_per_request_matches_decompressed_attention():
    """vllm-ascend 0.13's decode of a batch of new requests (one-token prompts: attn_state PrefillNoCache):
    ``BNSD_NBSD``, one query token per batch entry, ``sparse_mode=0`` without mask, no query lengths; output
    ``[N, B, 1, 512]``. Against attention over the decompressed keys and values (every key visible)."""
    kv_lens, block_size = [1, 300, 17], 128
    b = len(kv_lens)
    case = _decompressed_case([1] * b, kv_lens, block_size, seed=2)
    w_uk, w_uv, latent, rope_part, c_cache, r_cache, table, q_nope, q_rope, scale, q_abs = case
    out, _ = attention.npu_fused_infer_attention_score(
        q_abs[:, :, None],
        c_cache,
        c_cache,
        query_rope=q_rope[:, :, None],
        key_rope=r_cache,
        num_heads=N,
        num_key_value_heads=1,
        input_layout="BNSD_NBSD",
        atten_mask=None,
        sparse_mode=0,
        scale=scale,
        antiquant_mode=0,
        antiquant_scale=None,
        block_table=table,
        block_size=block_size,
        actual_seq_lengths=None,
        actual_seq_lengths_kv=kv_lens,
    )
    assert out.shape == (N, b, 1, LATENT)
    got = mla.npu_transpose_batchmatmul(out[:, :, 0], w_uv, perm_y=(1, 0, 2))
    _assert_decompressed(got, [1] * b, kv_lens, latent, rope_part, w_uk, w_uv, q_nope, q_rope, scale)


def _decompressed_case(q_lens, kv_lens, block_size, seed):
    """Per-head up-projections, each request's latent / RoPE keys and their paged caches, and queries (absorbed as
    the release's _q_proj_and_k_up_proj does): (w_uk, w_uv, latent, rope_part, c_cache, r_cache, table, q_nope,
    q_rope, scale, q_abs)."""
    w_uk, w_uv = rnd(N, NOPE, LATENT, scale=0.05), rnd(N, LATENT, V, scale=0.05)
    latent = [rnd(n, LATENT) for n in kv_lens]
    rope_part = [rnd(n, ROPE) for n in kv_lens]
    c_cache, r_cache, table = _paged(latent, rope_part, block_size, 8, torch.Generator().manual_seed(seed))
    q_nope, q_rope = rnd(sum(q_lens), N, NOPE), rnd(sum(q_lens), N, ROPE)
    scale = 1 / math.sqrt(NOPE + ROPE)
    q_abs = torch.einsum("thp,hpl->thl", q_nope.double(), w_uk.double()).to(HALF)
    return w_uk, w_uv, latent, rope_part, c_cache, r_cache, table, q_nope, q_rope, scale, q_abs


def _assert_decompressed(got, q_lens, kv_lens, latent, rope_part, w_uk, w_uv, q_nope, q_rope, scale):
    """``got [T, N, V]`` equals float64 attention over each request's decompressed per-head keys / values, its query
    rows right-down causal."""
    start = 0
    for b, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        c, r = latent[b].double(), rope_part[b].double()
        for h in range(N):
            k = c @ w_uk[h].double().T  # [kv, 128]
            v = c @ w_uv[h].double()  # [kv, 128]
            for i in range(ql):
                visible = kl - ql + i + 1
                score = (
                    k[:visible] @ q_nope[start + i, h].double() + r[:visible] @ q_rope[start + i, h].double()
                ) * scale
                ref = torch.softmax(score, 0) @ v[:visible]
                torch.testing.assert_close(got[start + i, h].double(), ref, **TOL)
        start += ql


def _prefill_with_context():
    """Two prefill requests with context in two chunks (request 1 has no key in the second): (query lengths, context
    lengths per request and chunk, q_nope, q_rope, the new tokens' key / RoPE key (one head) / value, the chunks'
    per-request (key, RoPE key, value), scale)."""
    q_lens, ctx = [3, 5], [[4, 2], [6, 0]]
    t = sum(q_lens)
    q_nope, q_rope = rnd(t, N, NOPE), rnd(t, N, ROPE)
    k_new, r_new, v_new = rnd(t, N, NOPE), rnd(t, 1, ROPE), rnd(t, N, V)
    chunks = [[(rnd(n, N, NOPE), rnd(n, 1, ROPE), rnd(n, N, V)) for n in per_req] for per_req in zip(*ctx)]
    return q_lens, ctx, q_nope, q_rope, k_new, r_new, v_new, chunks, 0.1


def _one_softmax(case):
    """(query row, head, output, LSE) of one float64 softmax over each request's context + its new tokens, causal."""
    q_lens, ctx, q_nope, q_rope, k_new, r_new, v_new, chunks, scale = case
    start = 0
    for b, ql in enumerate(q_lens):
        keys = [c[b][0] for c in chunks] + [k_new[start : start + ql]]
        ropes = [c[b][1] for c in chunks] + [r_new[start : start + ql]]
        values = [c[b][2] for c in chunks] + [v_new[start : start + ql]]
        k, r, v = (torch.cat(x).double() for x in (keys, ropes, values))
        context = sum(ctx[b])
        for h in range(N):
            for i in range(ql):
                visible = context + i + 1
                score = k[:visible, h] @ q_nope[start + i, h].double() + r[:visible, 0] @ q_rope[start + i, h].double()
                score = score * scale
                yield start + i, h, torch.softmax(score, 0) @ v[:visible, h], torch.logsumexp(score, 0).item()
        start += ql


def test_ring_mla_first_ring_and_context_chunks_match_one_softmax():
    """Two prefill requests: new tokens causal (first ring), their context loaded in two chunks (no mask), merged
    through the LSE; vs one softmax over context + causal new tokens per head."""
    case = _prefill_with_context()
    q_lens, ctx, q_nope, q_rope, k_new, r_new, v_new, chunks, scale = case
    t = sum(q_lens)
    out = torch.empty(t, N, V, dtype=HALF)
    lse = torch.empty(N, t, dtype=torch.float32)
    ring = dict(
        head_num=N,
        kv_head_num=N,
        qk_scale=scale,
        kernel_type="kernel_type_high_precision",
        input_layout="type_bsnd",
        output=out,
        softmax_lse=lse,
    )
    mla.npu_ring_mla(
        q_nope=q_nope,
        q_rope=q_rope,
        k_nope=k_new,
        k_rope=r_new.expand(-1, N, -1),
        value=v_new,
        mask=MASK[:512, :512],
        seqlen=torch.tensor(q_lens, dtype=torch.int32),
        pre_out=None,
        prev_lse=None,
        mask_type="mask_type_triu",
        calc_type="calc_type_first_ring",
        **ring,
    )
    for chunk, kv_lens in zip(chunks, zip(*ctx)):
        k = torch.cat([c[0] for c in chunk])
        r = torch.cat([c[1] for c in chunk]).expand(-1, N, -1)
        v = torch.cat([c[2] for c in chunk])
        mla.npu_ring_mla(
            q_nope=q_nope,
            q_rope=q_rope,
            k_nope=k,
            k_rope=r,
            value=v,
            mask=MASK[:512, :512],
            seqlen=torch.tensor([q_lens, list(kv_lens)], dtype=torch.int32),
            pre_out=out,
            prev_lse=lse,
            mask_type="no_mask",
            calc_type="calc_type_default",
            **ring,
        )
    for row, h, ref, ref_lse in _one_softmax(case):
        torch.testing.assert_close(out[row, h].double(), ref, **TOL)
        assert lse[h, row].item() == pytest.approx(ref_lse, abs=2e-2)


def test_paged_cache_load_gathers_context_ranges():
    key_cache, value_cache = rnd(6, 128, 1, LATENT), rnd(6, 128, 1, ROPE)
    table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    lens, starts = [130, 40], [0, 200]
    key, value = torch.empty(170, 1, LATENT, dtype=HALF), torch.empty(170, 1, ROPE, dtype=HALF)
    mla.npu_paged_cache_load(
        key_cache,
        value_cache,
        table,
        torch.tensor(lens, dtype=torch.int32),
        seq_starts=torch.tensor(starts, dtype=torch.int32),
        key=key,
        value=value,
    )
    row = 0
    for b, (n, s) in enumerate(zip(lens, starts)):
        for j in range(s, s + n):
            blk, off = int(table[b, j // 128]), j % 128
            assert torch.equal(key[row], key_cache[blk, off]) and torch.equal(value[row], value_cache[blk, off])
            row += 1


def test_transpose_batchmatmul_matches_per_batch_products():
    x, w = rnd(4, 3, 512), rnd(4, 512, 128, scale=0.05)
    y = mla.npu_transpose_batchmatmul(x, w, perm_y=(1, 0, 2))
    assert y.shape == (3, 4, 128)
    for b in range(4):
        torch.testing.assert_close(y[:, b].double(), x[b].double() @ w[b].double(), **TOL)


def test_format_cast_nd_is_the_tensor_itself():
    t = rnd(4, 4)
    assert mla.npu_format_cast(t, 2) is t


def _fia_v2_args(**over):
    args = dict(
        query_rope=rnd(2, N, ROPE),
        key_rope=rnd(2, 1, 128, ROPE),
        num_query_heads=N,
        num_key_value_heads=1,
        input_layout="TND_NTD",
        atten_mask=MASK,
        sparse_mode=3,
        softmax_scale=1.0,
        block_table=torch.zeros(1, 1, dtype=torch.int32),
        block_size=128,
        actual_seq_qlen=[2],
        actual_seq_kvlen=[5],
    )
    args.update(over)
    return args


def _fia_v2(query=None, **over):
    cache = rnd(2, 1, 128, LATENT)
    q = rnd(2, N, LATENT) if query is None else query
    return mla.npu_fused_infer_attention_score_v2(q, cache, cache, **_fia_v2_args(**over))


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: mla.npu_interleave_rope(rnd(2, 4, 1, 128), rnd(2, 1, 1, 128), rnd(2, 1, 1, 128)),
            r"x \(2, 4, 1, 128\)",
        ),
        (
            lambda: mla.npu_interleave_rope(
                rnd(2, 4, 1, 64).float(), rnd(2, 1, 1, 64).float(), rnd(2, 1, 1, 64).float()
            ),
            "x dtype float32",
        ),
        (lambda: mla.npu_kv_rmsnorm_rope_cache(*_kv_args(), cache_mode="PA_NZ"), "cache_mode='PA_NZ'"),
        (lambda: mla.npu_kv_rmsnorm_rope_cache(*_kv_args(), cache_mode="PA", c_kv_scale=torch.ones(1)), "c_kv_scale"),
        (lambda: _fia_v2(num_query_heads=16, query=rnd(2, 16, LATENT), query_rope=rnd(2, 16, ROPE)), "16 query"),
        (lambda: _fia_v2(query_rope=None), "without query_rope"),
        (lambda: _fia_v2(input_layout="BSND_NBSD"), "input_layout='BSND_NBSD'"),
        (lambda: _fia_v2(input_layout="BNSD_NBSD"), "BNSD_NBSD with a mask"),
        (
            lambda: _fia_v2(
                query=rnd(1, N, 2, LATENT),
                query_rope=rnd(1, N, 2, ROPE),
                input_layout="BNSD_NBSD",
                atten_mask=None,
                sparse_mode=0,
                actual_seq_qlen=None,
            ),
            "only one query token per batch entry",
        ),
        (lambda: _fia_v2(actual_seq_qlen=[1]), "query ends"),
        (lambda: _fia_v2(block_size=64), "block_size=64"),
        (
            lambda: _fia_v2(
                query=rnd(17, N, LATENT), query_rope=rnd(17, N, ROPE), actual_seq_qlen=[17], actual_seq_kvlen=[20]
            ),
            "17 query tokens",
        ),
        (lambda: _fia_v2(query=rnd(2, N, LATENT).float()), "query dtype float32"),
        (lambda: _fia_v2(query=rnd(2, N, 256)), r"query \(2, 32, 256\)"),  # kv_lora_rank 256
        (lambda: _fia_v2(query_rope=rnd(2, N, 32)), r"query_rope \(2, 32, 32\)"),  # rope dim 32
        (lambda: _fia_v2(num_key_value_heads=2), "2 KV heads"),
        (lambda: _fia_v2(sparse_mode=0), "sparse_mode=0"),
        (lambda: mla.npu_kv_rmsnorm_rope_cache(*_kv_args(dtype=torch.float32), cache_mode="PA"), "dtype float32"),
        (lambda: mla.npu_kv_rmsnorm_rope_cache(*_kv_args(latent=256), cache_mode="PA"), r"kv \(2, 1, 1, 320\)"),
        (lambda: mla.npu_transpose_batchmatmul(rnd(2, 3, 512), rnd(2, 512, 128)), "perm_y=None"),
        (lambda: mla.npu_transpose_batchmatmul(rnd(2, 3, 500), rnd(2, 500, 128), perm_y=(1, 0, 2)), "K=500"),
        (lambda: mla.npu_format_cast(rnd(2, 2), 29), "acl_format=29"),
        (lambda: _ring(kernel_type="kernel_type_default"), "kernel_type='kernel_type_default'"),
        (lambda: _ring(calc_type="calc_type_default"), "default calc type with a mask"),
        (lambda: _ring(nope=64), r"query \(3, 32, 64\)"),
        (lambda: _ring(dtype=torch.float32), "dtype float32"),
        (
            lambda: mla.npu_paged_cache_load(
                rnd(2, 128, 1, LATENT),
                rnd(2, 128, 1, ROPE),
                torch.zeros(1, 1, dtype=torch.int32),
                torch.tensor([3], dtype=torch.int32),
                key=rnd(3, 1, LATENT),
                value=rnd(3, 1, ROPE),
            ),
            "without seq_starts",
        ),
    ],
    ids=[
        "rope-d128",
        "rope-fp32",
        "kv-nz",
        "kv-quant",
        "fia-16-heads",
        "fia-no-rope",
        "fia-layout",
        "fia-bnsd-mask",
        "fia-bnsd-2-queries",
        "fia-tnd-end",
        "fia-block-64",
        "fia-17-queries",
        "fia-fp32",
        "fia-latent-256",
        "fia-rope-32",
        "fia-2-kv-heads",
        "fia-sparse-0",
        "kv-fp32",
        "kv-latent-256",
        "tbmm-perm",
        "tbmm-k",
        "format-nz",
        "ring-kernel",
        "ring-mode",
        "ring-nope-64",
        "ring-fp32",
        "cache-load-starts",
    ],
)
def test_mla_ops_refuse_what_the_npu_refuses(call, message):
    with pytest.raises(NotImplementedError, match=message):
        call()


def _kv_args(dtype=HALF, latent=LATENT):
    c = rnd(2, 1, 1, ROPE, dtype=dtype)
    return (
        rnd(2, 1, 1, latent + ROPE, dtype=dtype),
        rnd(latent, dtype=dtype),
        c,
        c,
        torch.tensor([0, 1]),
        rnd(1, 128, 1, ROPE, dtype=dtype),
        rnd(1, 128, 1, latent, dtype=dtype),
    )


def _ring(nope=NOPE, dtype=HALF, **over):
    args = dict(
        q_nope=rnd(3, N, nope, dtype=dtype),
        q_rope=rnd(3, N, ROPE, dtype=dtype),
        k_nope=rnd(3, N, nope, dtype=dtype),
        k_rope=rnd(3, N, ROPE, dtype=dtype),
        value=rnd(3, N, V, dtype=dtype),
        mask=MASK[:512, :512],
        seqlen=torch.tensor([3], dtype=torch.int32),
        head_num=N,
        kv_head_num=N,
        pre_out=None,
        prev_lse=None,
        qk_scale=1.0,
        kernel_type="kernel_type_high_precision",
        mask_type="mask_type_triu",
        input_layout="type_bsnd",
        calc_type="calc_type_first_ring",
        output=torch.empty(3, N, V, dtype=dtype),
        softmax_lse=torch.empty(N, 3),
    )
    args.update(over)
    return mla.npu_ring_mla(**args)


@pytest.mark.parametrize("heads", [64, 128])
def test_fia_mla_takes_64_and_128_query_heads(heads):
    """FIA's MLA mode takes 32, 64 and 128 query heads; heads are independent: the first 32 of a wider call equal a
    32-head call on the same rows."""
    q, qr = rnd(2, heads, LATENT), rnd(2, heads, ROPE)
    cache = rnd(2, 1, 128, LATENT)
    wide = _fia_v2_args(query_rope=qr, num_query_heads=heads)
    narrow = _fia_v2_args(query_rope=qr[:, :N].contiguous(), key_rope=wide["key_rope"])
    out_w, lse_w = mla.npu_fused_infer_attention_score_v2(q, cache, cache, **wide)
    out_n, lse_n = mla.npu_fused_infer_attention_score_v2(q[:, :N].contiguous(), cache, cache, **narrow)
    assert out_w.shape == (heads, 2, LATENT) and lse_w.shape == (2, heads, 1)
    torch.testing.assert_close(out_w[:N], out_n)
    torch.testing.assert_close(lse_w[:, :N], lse_n)


# -- vllm-ascend 0.23.0's MLA prefill: FIA's RoPE-split TND mode, context chunks merged by npu_attention_update -------


def _rope_split(query, query_rope, key, key_rope, value, q_ends, kv_ends, causal, lse=True, **over):
    args = dict(
        query_rope=query_rope,
        key_rope=key_rope,
        num_heads=N,
        num_key_value_heads=N,
        input_layout="TND",
        atten_mask=MASK if causal else None,
        sparse_mode=3 if causal else 0,
        scale=0.1,
        antiquant_mode=0,
        antiquant_scale=None,
        softmax_lse_flag=lse,
        actual_seq_lengths=q_ends,
        actual_seq_lengths_kv=kv_ends,
    )
    args.update(over)
    # through the dispatcher the release calls: torch_npu.npu_fused_infer_attention_score with query_rope
    return attention.npu_fused_infer_attention_score(query, key, value, **args)


def test_fia_rope_split_prefill_and_context_chunks_merged_match_one_softmax():
    """vllm-ascend 0.23.0's MLA prefill of two requests: the new tokens causal (sparse_mode 3), their context in two
    chunks (sparse_mode 0; request 1 has no key in the second chunk: output 0, LSE -inf), every part's LSE, merged by
    npu_attention_update over rows = tokens x heads; vs one float64 softmax over context + causal new tokens per head
    and query row."""
    case = _prefill_with_context()
    q_lens, ctx, q_nope, q_rope, k_new, r_new, v_new, chunks, scale = case
    t = sum(q_lens)
    q_ends = torch.tensor(q_lens).cumsum(0).tolist()
    new = (k_new, r_new.expand(-1, N, -1).contiguous(), v_new)
    out, lse = _rope_split(q_nope, q_rope, *new, q_ends, q_ends, True, scale=scale)
    assert out.shape == (t, N, V) and out.dtype == HALF and lse.shape == (t, N, 1) and lse.dtype == torch.float32
    outs, lses = [out.float().reshape(t * N, V)], [lse.reshape(t * N)]
    for chunk, kv_lens in zip(chunks, zip(*ctx)):
        k, r, v = (torch.cat([c[i] for c in chunk]) for i in range(3))
        kv_ends = torch.tensor(kv_lens).cumsum(0).tolist()
        c_out, c_lse = _rope_split(
            q_nope, q_rope, k, r.expand(-1, N, -1).contiguous(), v, q_ends, kv_ends, False, scale=scale
        )
        outs.append(c_out.float().reshape(t * N, V))
        lses.append(c_lse.reshape(t * N))
    # request 1 (rows 3..7) has no key in the second chunk
    assert torch.all(outs[2].view(t, N, V)[3:] == 0) and torch.all(lses[2].view(t, N)[3:] == -math.inf)
    merged, no_lse = mla.npu_attention_update(tuple(lses), tuple(outs), 0)
    assert no_lse is None and merged.dtype == torch.float32
    merged = merged.view(t, N, V)
    for row, h, ref, _ in _one_softmax(case):
        torch.testing.assert_close(merged[row, h].double(), ref, **TOL)


def test_fia_rope_split_without_the_lse_flag_returns_the_ops_zero():
    q_nope, q_rope, k, r, v = rnd(4, N, NOPE), rnd(4, N, ROPE), rnd(4, N, NOPE), rnd(4, N, ROPE), rnd(4, N, V)
    out, lse = _rope_split(q_nope, q_rope, k, r, v, [4], [4], True, lse=False)
    out_lse, _ = _rope_split(q_nope, q_rope, k, r, v, [4], [4], True)
    assert lse.shape == (1,) and lse.item() == 0.0
    torch.testing.assert_close(out, out_lse)


def test_attention_update_merges_parts_of_one_softmax():
    """Keys split into three parts (the middle one empty for some rows: LSE -inf); each part's naive attention and
    LSE, merged by the op, equal one softmax over all keys (float64 reference), in the parts' dtype."""
    rows, d, keys = 6, 16, 9
    scores = torch.randn(rows, keys, generator=g, dtype=torch.float64) * 3
    values = torch.randn(keys, d, generator=g, dtype=torch.float64)
    bounds = [(0, 4), (4, 6), (6, 9)]
    outs, lses = [], []
    for lo, hi in bounds:
        s = scores[:, lo:hi].clone()
        if (lo, hi) == (4, 6):
            s[:2] = -math.inf  # rows 0, 1: no key in this part
        lse = torch.logsumexp(s, -1)
        out = torch.nan_to_num(torch.softmax(s, -1), nan=0.0) @ values[lo:hi]
        lses.append(lse.float())
        outs.append(out.to(HALF))
    merged, _ = mla.npu_attention_update(lses, outs, 0)
    full = scores.clone()
    full[:2, 4:6] = -math.inf
    assert merged.dtype == HALF and merged.shape == (rows, d)
    torch.testing.assert_close(merged.double(), torch.softmax(full, -1) @ values, **TOL)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: _split(dtype=torch.float16), "query dtype float16"),
        (lambda: _split(input_layout="NTD_TND"), "input_layout='NTD_TND'"),
        (lambda: _split(block_table=torch.zeros(1, 1, dtype=torch.int32), block_size=128), "page attention"),
        (lambda: _split(causal=False, atten_mask=MASK), "sparse_mode=0 with atten_mask given"),
        (lambda: _split(kv_ends=[2]), "lists ending at 4 / 2"),
        (lambda: _split(q_ends=[4], kv_ends=[4], keys=4, causal=True, q_rows=4, kv_split=[1, 3]), "query / 2 kv"),
        (lambda: _split(nope=192), r"query \(4, 32, 192\)"),
        (lambda: _split(num_key_value_heads=1), "32 / 1 heads"),
        (lambda: _split(pse_shift=rnd(1, N, 4, 4)), "pse_shift"),
        (lambda: _split(q_ends=[1, 4], kv_ends=[2, 4], causal=True), "request 1: 3 query rows > 2 keys"),
        (lambda: mla.npu_attention_update([torch.zeros(4)], [torch.zeros(4, 16)], 1), "update_type=1"),
        (lambda: mla.npu_attention_update([torch.zeros(4)] * 17, [torch.zeros(4, 16)] * 17, 0), "17 LSEs"),
        (lambda: mla.npu_attention_update([torch.zeros(4)], [torch.zeros(4, 4)], 0), "D=4"),
        (lambda: mla.npu_attention_update([torch.zeros(4, dtype=HALF)], [torch.zeros(4, 16)], 0), r"lse\[0\] dtype"),
        (lambda: mla.npu_attention_update([torch.zeros(4)], [torch.zeros(16, 4).t()], 0), "non-contiguous"),
        (
            lambda: mla.npu_attention_update(
                [torch.zeros(4)] * 2, [torch.zeros(4, 16), torch.zeros(4, 16, dtype=HALF)], 0
            ),
            "mixed dtypes",
        ),
    ],
    ids=[
        "fia-split-fp16",
        "fia-split-layout",
        "fia-split-paged",
        "fia-split-sparse0-mask",
        "fia-split-kv-end",
        "fia-split-list-count",
        "fia-split-d192",
        "fia-split-kv-heads",
        "fia-split-pse",
        "fia-split-q-over-kv",
        "update-type-1",
        "update-17-parts",
        "update-d4",
        "update-lse-half",
        "update-non-contiguous",
        "update-mixed",
    ],
)
def test_rope_split_and_attention_update_refuse_what_the_npu_refuses(call, message):
    with pytest.raises(NotImplementedError, match=message):
        call()


def _split(dtype=HALF, nope=NOPE, q_ends=(4,), kv_ends=(4,), causal=True, keys=4, q_rows=4, kv_split=None, **over):
    kv = list(kv_split) if kv_split else list(kv_ends)
    return _rope_split(
        rnd(q_rows, N, nope, dtype=dtype),
        rnd(q_rows, N, ROPE, dtype=dtype),
        rnd(keys, N, nope, dtype=dtype),
        rnd(keys, N, ROPE, dtype=dtype),
        rnd(keys, N, V, dtype=dtype),
        list(q_ends),
        kv,
        causal,
        **over,
    )
