"""The emulated NPU ops (tests/support/npu_ops) against naive loop references, and their refusals. The attention,
KV-cache and RoPE ops run in bfloat16 (what they take on the NPU and what the engine tests run); the references
compute in float64 from the same bfloat16 values."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from npu_ops import activation, attention, kv_cache, norm, rope
from npu_ops.triton_ascend import get_element

g = torch.Generator().manual_seed(0)


HALF = torch.bfloat16
BF16_TOL = {"rtol": 1e-2, "atol": 1e-2}  # an output rounded to bfloat16 (8 significant bits) vs a float64 loop


def rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def test_rms_norm_matches_loop():
    x, w = rnd(5, 8), rnd(8)
    y, rstd = norm.npu_rms_norm(x, w, 1e-5)
    for t in range(5):
        r = 1.0 / math.sqrt(sum(float(v) ** 2 for v in x[t]) / 8 + 1e-5)
        assert rstd[t, 0].item() == pytest.approx(r, rel=1e-5)
        for i in range(8):
            assert y[t, i].item() == pytest.approx(float(x[t, i]) * r * float(w[i]), rel=1e-4, abs=1e-6)


def test_add_rms_norm_returns_sum_as_residual():
    x1, x2, w = rnd(3, 8), rnd(3, 8), rnd(8)
    y, rstd, x = norm.npu_add_rms_norm(x1, x2, w, 1e-6)
    assert torch.equal(x, x1 + x2)
    y_ref, rstd_ref = norm.npu_rms_norm(x1 + x2, w, 1e-6)
    assert torch.equal(y, y_ref) and torch.equal(rstd, rstd_ref)


def test_rms_norm_refuses_mismatched_gamma():
    with pytest.raises(NotImplementedError, match="npu_rms_norm: gamma shape"):
        norm.npu_rms_norm(rnd(3, 8), rnd(4))


def test_swiglu_matches_loop():
    x = rnd(4, 6)
    out = activation.npu_swiglu(x)
    for t in range(4):
        for i in range(3):
            a, b = float(x[t, i]), float(x[t, i + 3])
            assert out[t, i].item() == pytest.approx(a / (1 + math.exp(-a)) * b, rel=1e-5, abs=1e-6)
    with pytest.raises(NotImplementedError, match="npu_swiglu: odd split"):
        activation.npu_swiglu(rnd(2, 5))


def test_reshape_and_cache_writes_slots_and_skips_padding():
    blocks, bs, kvh, d = 3, 4, 2, 2
    kc, vc = torch.full((blocks, bs, kvh, d), 7.0, dtype=HALF), torch.full((blocks, bs, kvh, d), 7.0, dtype=HALF)
    k, v = rnd(4, kvh, d, dtype=HALF), rnd(4, kvh, d, dtype=HALF)
    slots = torch.tensor([5, 0, -1, 11], dtype=torch.int32)
    kv_cache._npu_reshape_and_cache(key=k, value=v, key_cache=kc, value_cache=vc, slot_indices=slots)
    expected_k, expected_v = torch.full_like(kc, 7.0), torch.full_like(vc, 7.0)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected_k[s // bs, s % bs] = k[t]
            expected_v[s // bs, s % bs] = v[t]
    assert torch.equal(kc, expected_k) and torch.equal(vc, expected_v)
    with pytest.raises(NotImplementedError, match="_npu_reshape_and_cache: layout"):
        kv_cache._npu_reshape_and_cache(
            key=k.flatten(1), value=v.flatten(1), key_cache=kc, value_cache=vc, slot_indices=slots
        )


@pytest.mark.parametrize("checked", [False, True])
def test_reshape_and_cache_refuses_a_slot_past_the_cache(monkeypatch, checked):
    """One slot past the end (a block's last slot + 1 in the last block) raises, the checked mode naming it; the
    cache is left as it was."""
    monkeypatch.setenv("NPU_OPS_CHECK_SLOTS", "1" if checked else "0")
    kc, vc = torch.full((2, 4, 1, 2), 7.0, dtype=HALF), torch.full((2, 4, 1, 2), 7.0, dtype=HALF)
    slots = torch.tensor([3, 8], dtype=torch.int32)
    past = r"slots \[8\] of tokens \[1\] \(of 2\) are past the cache's 8 slots \(2 blocks of 4\)"
    caller = r"; called from test_npu_ops.py:\d+ test_reshape_and_cache_refuses_a_slot_past_the_cache"
    match = past + caller if checked else "index 8 is out of bounds for dimension 0 with size 8"
    with pytest.raises(IndexError, match=match):
        kv_cache._npu_reshape_and_cache(
            key=rnd(2, 1, 2, dtype=HALF),
            value=rnd(2, 1, 2, dtype=HALF),
            key_cache=kc,
            value_cache=vc,
            slot_indices=slots,
        )
    assert torch.equal(kc, torch.full_like(kc, 7.0)) and torch.equal(vc, torch.full_like(vc, 7.0))


def test_rotary_embedding_neox_matches_loop():
    """vLLM's RoPE (NeoX halves) from its definition: angle = position * base ** (-2 i / head_size)."""
    tokens, heads, kv_heads, d, base = 3, 2, 1, 8, 10000.0
    inv_freq = [base ** (-2 * i / d) for i in range(d // 2)]
    max_pos = 16
    angles = torch.tensor([[p * f for f in inv_freq] for p in range(max_pos)], dtype=torch.float64)
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(HALF)
    positions = torch.tensor([0, 5, 11])
    q, k = rnd(tokens, heads * d, dtype=HALF), rnd(tokens, kv_heads * d, dtype=HALF)
    q0, k0 = q.clone(), k.clone()
    assert rope._npu_rotary_embedding(positions, q, k, d, cache, True) is None  # in place
    for x, x0, n in ((q, q0, heads), (k, k0, kv_heads)):
        for t, p in enumerate(positions.tolist()):
            for h in range(n):
                for i in range(d // 2):
                    a, b = float(x0[t, h * d + i]), float(x0[t, h * d + i + d // 2])
                    c, s = float(cache[p, i]), float(cache[p, d // 2 + i])  # the cache as given, bfloat16
                    assert x[t, h * d + i].item() == pytest.approx(a * c - b * s, rel=1e-2, abs=1e-2)
                    assert x[t, h * d + i + d // 2].item() == pytest.approx(b * c + a * s, rel=1e-2, abs=1e-2)


def test_rotary_embedding_refuses_other_modes():
    positions, cache = torch.tensor([0, 1]), rnd(4, 8, dtype=HALF)
    with pytest.raises(NotImplementedError, match="_npu_rotary_embedding: is_neox_style=False"):
        rope._npu_rotary_embedding(positions, rnd(2, 8, dtype=HALF), rnd(2, 8, dtype=HALF), 8, cache, False)
    with pytest.raises(NotImplementedError, match="_npu_rotary_embedding: cos_sin_cache"):
        rope._npu_rotary_embedding(positions, rnd(2, 16, dtype=HALF), rnd(2, 16, dtype=HALF), 16, cache, True)
    with pytest.raises(NotImplementedError, match="_npu_rotary_embedding: query"):
        rope._npu_rotary_embedding(positions, rnd(2, 2, 8, dtype=HALF), rnd(2, 8, dtype=HALF), 8, cache, True)


def _naive_attention(q_rows, keys, values, scale, n_heads, kv_heads, causal=True):
    """q_rows [q, N, D]; keys/values [kv, KVN, D]; causal with the diagonal at the bottom right, or (``causal``
    False) every query row over every key."""
    q_len, kv_len = q_rows.shape[0], keys.shape[0]
    q_rows, keys, values = q_rows.double(), keys.double(), values.double()
    out = torch.zeros_like(q_rows)
    for i in range(q_len):
        for h in range(n_heads):
            kh = h // (n_heads // kv_heads)
            visible = range(kv_len - q_len + i + 1) if causal else range(kv_len)
            scores = [float(q_rows[i, h] @ keys[j, kh]) * scale for j in visible]
            m = max(scores)
            w = [math.exp(s - m) for s in scores]
            tot = sum(w)
            for j, wj in zip(visible, w):
                out[i, h] += values[j, kh] * (wj / tot)
    return out


MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


def test_fia_prefill_without_cache_matches_loop():
    n, kvn, d = 4, 2, 8
    lens = [3, 5]
    q, k, v = rnd(8, n, d, dtype=HALF), rnd(8, kvn, d, dtype=HALF), rnd(8, kvn, d, dtype=HALF)
    ends = [3, 8]
    out, lse = attention.npu_fused_infer_attention_score(
        q,
        k,
        v,
        atten_mask=MASK,
        actual_seq_lengths=ends,
        actual_seq_lengths_kv=ends,
        num_heads=n,
        num_key_value_heads=kvn,
        scale=0.3,
        input_layout="TND",
        sparse_mode=3,
    )
    start = 0
    for L in lens:
        ref = _naive_attention(q[start : start + L], k[start : start + L], v[start : start + L], 0.3, n, kvn)
        assert out.dtype == HALF
        torch.testing.assert_close(out[start : start + L].double(), ref, **BF16_TOL)
        start += L
    assert lse.shape == (8, n, 1)


def test_fia_paged_chunked_and_decode_match_loop():
    """Request 0: chunk of 3 new tokens over 7 cached+new KV; request 1: 1 decode token over 10 KV; request 2: a
    spec-decode verify of 3 tokens over 6 KV. KV lives in scattered blocks of a paged cache."""
    n, kvn, d, bs, nblocks = 4, 2, 8, 4, 10
    kc, vc = rnd(nblocks, bs, kvn, d, dtype=HALF), rnd(nblocks, bs, kvn, d, dtype=HALF)
    table = torch.tensor([[7, 2, 0], [1, 9, 4], [5, 3, 0]], dtype=torch.int32)
    q_lens, kv_lens = [3, 1, 3], [7, 10, 6]
    q = rnd(sum(q_lens), n, d, dtype=HALF)
    ends = [3, 4, 7]
    out, _ = attention.npu_fused_infer_attention_score(
        q,
        kc.view(nblocks, bs, -1),
        vc.view(nblocks, bs, -1),
        atten_mask=MASK,
        block_table=table,
        input_layout="TND",
        block_size=bs,
        actual_seq_lengths=ends,
        actual_seq_lengths_kv=kv_lens,
        num_key_value_heads=kvn,
        num_heads=n,
        scale=0.25,
        sparse_mode=3,
    )
    start = 0
    for b, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        keys = torch.stack([kc[table[b, j // bs], j % bs] for j in range(kl)])
        vals = torch.stack([vc[table[b, j // bs], j % bs] for j in range(kl)])
        ref = _naive_attention(q[start : start + ql], keys, vals, 0.25, n, kvn)
        torch.testing.assert_close(out[start : start + ql].double(), ref, **BF16_TOL)
        start += ql


def test_ops_stay_on_the_inputs_device_without_reading_values():
    """On the GPU machine the ops run on CUDA tensors (NPU_STANDIN_DEVICE=cuda). On the meta device a tensor the op
    creates on another device, or a value it reads back to the host (boolean indexing, .item(), .tolist(): a host wait
    on CUDA), raises; every output must come back on the inputs' device."""
    meta = torch.device("meta")
    n, kvn, d, bs, nblocks = 4, 2, 8, 4, 10
    kc, vc = (torch.empty(nblocks, bs, kvn, d, device=meta, dtype=HALF) for _ in range(2))
    k, v = (torch.empty(3, kvn, d, device=meta, dtype=HALF) for _ in range(2))
    slots = torch.empty(3, dtype=torch.int32, device=meta)
    kv_cache._npu_reshape_and_cache(key=k, value=v, key_cache=kc, value_cache=vc, slot_indices=slots)
    table = torch.empty(2, 3, dtype=torch.int32, device=meta)
    out, lse = attention.npu_fused_infer_attention_score(
        torch.empty(4, n, d, device=meta, dtype=HALF),
        kc.view(nblocks, bs, -1),
        vc.view(nblocks, bs, -1),
        atten_mask=MASK.to(meta),
        block_table=table,
        input_layout="TND",
        block_size=bs,
        actual_seq_lengths=[3, 4],
        actual_seq_lengths_kv=[7, 10],
        num_key_value_heads=kvn,
        num_heads=n,
        scale=0.25,
        sparse_mode=3,
    )
    x, w = torch.empty(3, 8, device=meta, dtype=HALF), torch.empty(8, device=meta, dtype=HALF)
    outputs = [out, lse, *norm.npu_rms_norm(x, w), *norm.npu_add_rms_norm(x, x, w), activation.npu_swiglu(x)]
    assert [t.device for t in outputs] == [meta] * len(outputs)


def test_fia_without_mask_attends_every_kv_token():
    """sparse_mode=0 without atten_mask (the releases/v0.18.0 head's DecodeOnly call, #10302): no mask. Request 0
    decodes 1 token over 10 KV (equal to right-down causal there); request 1's 3 query rows each see all 6 KV tokens,
    which right-down causal would not."""
    n, kvn, d, bs, nblocks = 4, 2, 8, 4, 10
    kc, vc = rnd(nblocks, bs, kvn, d, dtype=HALF), rnd(nblocks, bs, kvn, d, dtype=HALF)
    table = torch.tensor([[1, 9, 4], [5, 3, 0]], dtype=torch.int32)
    q_lens, kv_lens = [1, 3], [10, 6]
    q = rnd(sum(q_lens), n, d, dtype=HALF)
    args = dict(
        block_table=table,
        input_layout="TND",
        block_size=bs,
        actual_seq_lengths=[1, 4],
        actual_seq_lengths_kv=kv_lens,
        num_key_value_heads=kvn,
        num_heads=n,
        scale=0.25,
    )
    out, _ = attention.npu_fused_infer_attention_score(
        q, kc.view(nblocks, bs, -1), vc.view(nblocks, bs, -1), sparse_mode=0, **args
    )
    causal, _ = attention.npu_fused_infer_attention_score(
        q, kc.view(nblocks, bs, -1), vc.view(nblocks, bs, -1), sparse_mode=3, atten_mask=MASK, **args
    )
    start = 0
    for b, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        keys = torch.stack([kc[table[b, j // bs], j % bs] for j in range(kl)])
        vals = torch.stack([vc[table[b, j // bs], j % bs] for j in range(kl)])
        ref = _naive_attention(q[start : start + ql], keys, vals, 0.25, n, kvn, causal=False)
        torch.testing.assert_close(out[start : start + ql].double(), ref, **BF16_TOL)
        start += ql
    torch.testing.assert_close(out[:1], causal[:1])  # one query token: the same as right-down causal
    assert not torch.allclose(out[1:3], causal[1:3])  # earlier query rows see keys causal hides


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"input_layout": "BSH"}, "input_layout='BSH'"),
        ({"sparse_mode": 0}, "sparse_mode=0 with atten_mask"),
        ({"sparse_mode": 1}, "sparse_mode=1"),
        ({"atten_mask": None}, "without atten_mask"),
        ({"pre_tokens": 128}, "pre_tokens=128"),
        ({"antiquant_scale": torch.ones(1)}, "antiquant_scale"),
    ],
)
def test_fia_refuses_other_modes(kwargs, message):
    n, d = 2, 4
    args = dict(
        atten_mask=MASK,
        actual_seq_lengths=[2],
        actual_seq_lengths_kv=[2],
        num_heads=n,
        num_key_value_heads=n,
        scale=1.0,
        input_layout="TND",
        sparse_mode=3,
    )
    args.update(kwargs)
    with pytest.raises(NotImplementedError, match="npu_fused_infer_attention_score: .*" + message.replace("(", r"\(")):
        attention.npu_fused_infer_attention_score(
            rnd(2, n, d, dtype=HALF), rnd(2, n, d, dtype=HALF), rnd(2, n, d, dtype=HALF), **args
        )


FIA_ARGS = dict(atten_mask=MASK, actual_seq_lengths=[2], actual_seq_lengths_kv=[2], num_heads=2, input_layout="TND")


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda q, k, v: attention.npu_fused_infer_attention_score(q, k, v, **FIA_ARGS, sparse_mode=3),
            "npu_fused_infer_attention_score: query dtype float32",
        ),
        (
            lambda q, k, v: kv_cache._npu_reshape_and_cache(
                key=k,
                value=v,
                key_cache=torch.zeros(1, 4, 2, 4),
                value_cache=torch.zeros(1, 4, 2, 4),
                slot_indices=torch.tensor([0, 1], dtype=torch.int32),
            ),
            "_npu_reshape_and_cache: key dtype float32",
        ),
        (
            lambda q, k, v: rope._npu_rotary_embedding(
                torch.tensor([0, 1]), q.flatten(1), k.flatten(1), 4, rnd(4, 4), True
            ),
            "_npu_rotary_embedding: query dtype float32",
        ),
        (lambda q, k, v: norm.npu_rms_norm(q.double(), rnd(4).double()), "npu_rms_norm: x dtype float64"),
        (lambda q, k, v: activation.npu_swiglu(q.double()), "npu_swiglu: x dtype float64"),
    ],
    ids=["fia", "reshape_and_cache", "rotary_embedding", "rms_norm", "swiglu"],
)
def test_ops_refuse_the_dtypes_the_npu_refuses(call, message):
    """float32 attention / KV cache / RoPE (the NPU ops take float16 / bfloat16), float64 anywhere."""
    q, k, v = rnd(2, 2, 4), rnd(2, 2, 4), rnd(2, 2, 4)
    with pytest.raises(NotImplementedError, match=message):
        call(q, k, v)


def test_ops_refuse_mixed_dtypes():
    """One dtype for query / key / value, for the KV written and its cache, for x and gamma."""
    q, k = rnd(2, 2, 4, dtype=HALF), rnd(2, 2, 4, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="npu_fused_infer_attention_score: mixed dtypes"):
        attention.npu_fused_infer_attention_score(q, k, k, **FIA_ARGS, sparse_mode=3)
    with pytest.raises(NotImplementedError, match="_npu_reshape_and_cache: mixed dtypes"):
        kv_cache._npu_reshape_and_cache(
            key=q,
            value=q,
            key_cache=torch.zeros(1, 4, 2, 4, dtype=torch.float16),
            value_cache=torch.zeros(1, 4, 2, 4, dtype=HALF),
            slot_indices=torch.tensor([0, 1], dtype=torch.int32),
        )
    with pytest.raises(NotImplementedError, match="npu_rms_norm: mixed dtypes"):
        norm.npu_rms_norm(rnd(2, 4, dtype=HALF), rnd(4))


@triton.jit
def _reverse_by_get_element(src_ptr, out_ptr, N: tl.constexpr):
    block = tl.load(src_ptr + tl.arange(0, N))
    for i in range(N):
        tl.store(out_ptr + i, get_element(block, ((N - 1 - i),)))


def test_get_element_in_a_kernel():
    """triton-ascend's get_element, run inside a Triton kernel (TRITON_INTERPRET=1), against indexing."""
    pick = _reverse_by_get_element
    src = torch.tensor([3, -1, 40, 7, 0, 12, 5, 9], dtype=torch.int64)
    out = torch.empty_like(src)
    pick[(1,)](src, out, N=8)
    assert out.tolist() == src.flip(0).tolist()
    f = torch.tensor([0.5, -2.25, 1e-8, 3.0])
    fo = torch.empty_like(f)
    pick[(1,)](f, fo, N=4)
    assert fo.tolist() == f.flip(0).tolist()


def _mask_elements(flags_ptr, out_ptr, N: tl.constexpr):
    # the rejection kernel's use of a mask element: `if not rejected and is_greedy_mask1:`
    mask = tl.load(flags_ptr + tl.arange(0, N)) != 0
    for i in range(N):
        rejected = False
        if not rejected and get_element(mask, (i,)):
            tl.store(out_ptr + i, 1)
        else:
            tl.store(out_ptr + i, 0)


def test_get_element_of_a_boolean_block():
    flags = torch.tensor([0, 3, 0, 0, 1, 1, 0, -2], dtype=torch.int32)
    out = torch.full_like(flags, 7)
    triton.jit(_mask_elements)[(1,)](flags, out, N=8)
    assert out.tolist() == (flags != 0).int().tolist()


def test_get_element_compiles_for_cuda():
    """Compiled Triton (the GPU machine) types a boolean block's element as a boolean: `not rejected and <element>` then
    compiles. Needs no GPU: the NVIDIA backend compiles for a named target. In a fresh process without
    TRITON_INTERPRET, so that get_element is a compilable JITFunction."""
    probe = (
        "import triton, test_npu_ops\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "kernel = triton.jit(test_npu_ops._mask_elements)\n"
        "sig = {'flags_ptr': '*i32', 'out_ptr': '*i32', 'N': 'constexpr'}\n"
        "compiled = triton.compile(ASTSource(kernel, sig, constexprs={'N': 8}), target=GPUTarget('cuda', 90, 32))\n"
        "print(compiled.asm['ttir'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), *sys.path])
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tt.func" in proc.stdout
