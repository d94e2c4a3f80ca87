"""ACL graphs with CUDA standing in (tests/support/npu_graphs_cuda.py): the capturable attention against a naive
reference (any device), and on a CUDA device the contract of task groups, updates and ExternalEvents, including the
hazard the release's host drain before a FULL replay guards against (vllm-ascend #4233), reproduced with real streams.

The CUDA tests run on the GPU machine (benchmarks/gpu_engine_suite.sh's ``standin`` part); without a CUDA device they
are skipped, and say so."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from test_npu_ops import BF16_TOL, HALF, MASK, _naive_attention, rnd

npu_graphs_cuda = pytest.importorskip("npu_graphs_cuda")
from npu_ops import attention  # noqa: E402

N, KVN, D, BS, NBLOCKS = 4, 2, 8, 4, 12


def _paged(device: str):
    kc = rnd(NBLOCKS, BS, KVN, D, dtype=HALF).to(device)
    vc = rnd(NBLOCKS, BS, KVN, D, dtype=HALF).to(device)
    table = torch.tensor([[7, 2, 0], [1, 9, 4], [5, 3, 11], [0, 0, 0]], dtype=torch.int32, device=device)
    return kc, vc, table


def _reference(q, kc, vc, table, q_ends, kv_lens, scale):
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for b, (end, kl) in enumerate(zip(q_ends, kv_lens)):
        if end > start:
            keys = torch.stack([kc[table[b, j // BS], j % BS] for j in range(kl)]).cpu()
            vals = torch.stack([vc[table[b, j // BS], j % BS] for j in range(kl)]).cpu()
            out[start:end] = _naive_attention(q[start:end].cpu(), keys, vals, scale, N, KVN)
        start = end
    return out


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_graph_attention_matches_the_naive_reference_with_padded_rows(device):
    """A FULL_DECODE_ONLY batch: 3 requests of 3 query tokens (k = 2), a padded request (no query, no KV) and padded
    query rows past the last end: the real rows match the loop, the padding is zero."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device: runs on the GPU machine")
    kc, vc, table = _paged(device)
    q_ends, kv_lens = [3, 6, 9, 9], [7, 10, 12, 0]
    q = rnd(12, N, D, dtype=HALF).to(device)
    out = npu_graphs_cuda.graph_attention(
        q,
        kc.view(NBLOCKS, BS, -1),
        vc.view(NBLOCKS, BS, -1),
        table,
        torch.tensor(q_ends, dtype=torch.int32, device=device),
        torch.tensor(kv_lens, dtype=torch.int32, device=device),
        block_size=BS,
        num_heads=N,
        num_key_value_heads=KVN,
        scale=0.25,
    )
    ref = _reference(q, kc, vc, table, q_ends, kv_lens, 0.25)
    torch.testing.assert_close(out[:9].double().cpu(), ref[:9], **BF16_TOL)
    assert out[9:].abs().sum() == 0


def test_graph_attention_equals_the_eager_emulation():
    kc, vc, table = _paged("cpu")
    q_ends, kv_lens = [3, 4, 7], [7, 10, 6]
    q = rnd(7, N, D, dtype=HALF)
    kw = dict(block_size=BS, num_heads=N, num_key_value_heads=KVN, scale=0.3)
    eager, _ = attention.npu_fused_infer_attention_score(
        q,
        kc.view(NBLOCKS, BS, -1),
        vc.view(NBLOCKS, BS, -1),
        atten_mask=MASK,
        block_table=table,
        input_layout="TND",
        actual_seq_lengths=q_ends,
        actual_seq_lengths_kv=kv_lens,
        sparse_mode=3,
        **kw,
    )
    graph = npu_graphs_cuda.graph_attention(
        q,
        kc.view(NBLOCKS, BS, -1),
        vc.view(NBLOCKS, BS, -1),
        table,
        torch.tensor(q_ends, dtype=torch.int32),
        torch.tensor(kv_lens, dtype=torch.int32),
        **kw,
    )
    torch.testing.assert_close(graph, eager, atol=2e-3, rtol=2e-3)


def test_graph_attention_mla_equals_the_eager_emulation_with_a_padded_request():
    """FIA v2's MLA mode as captured (graph_attention_mla) against the eager emulation (npu_ops/mla.py), for a
    FULL_DECODE_ONLY batch with MTP k = 2: 3 requests of 3 query rows over the paged latent / RoPE caches, and a padded
    request of 3 rows with KV length 0 (vllm-ascend's MTP update pads its lists so): the real rows equal the eager op,
    the padded ones are zero."""
    from npu_ops import mla

    heads, block = mla.FIA_MLA_HEADS[0], 16
    latent = rnd(10, 1, block, mla.LATENT, dtype=HALF)
    rope = rnd(10, 1, block, mla.ROPE, dtype=HALF)
    table = torch.tensor([[3, 7, 0], [1, 9, 4], [5, 2, 8], [0, 0, 0]], dtype=torch.int32)
    q_ends, kv_lens = [3, 6, 9, 12], [20, 35, 7, 0]
    q, q_rope = rnd(12, heads, mla.LATENT, dtype=HALF) * 0.1, rnd(12, heads, mla.ROPE, dtype=HALF) * 0.1
    eager, _ = mla.npu_fused_infer_attention_score_v2(
        q[:9],
        latent,
        latent,
        query_rope=q_rope[:9],
        key_rope=rope,
        num_query_heads=heads,
        num_key_value_heads=1,
        input_layout="TND_NTD",
        atten_mask=MASK,
        sparse_mode=3,
        softmax_scale=0.07,
        block_table=table,
        block_size=block,
        actual_seq_qlen=q_ends[:3],
        actual_seq_kvlen=kv_lens[:3],
    )
    graph = npu_graphs_cuda.graph_attention_mla(
        q,
        q_rope,
        latent,
        rope,
        table,
        torch.tensor(q_ends, dtype=torch.int32),
        torch.tensor(kv_lens, dtype=torch.int32),
        block_size=block,
        num_heads=heads,
        scale=0.07,
    )
    assert graph.shape == (heads, 12, mla.LATENT)
    torch.testing.assert_close(graph[:, :9], eager, atol=2e-2, rtol=2e-2)
    assert graph[:, 9:].abs().sum() == 0


def test_graph_attention_refuses_the_dtypes_the_npu_refuses():
    kc, vc, table = _paged("cpu")
    ends = torch.tensor([3], dtype=torch.int32)
    args = (kc.view(NBLOCKS, BS, -1), vc.view(NBLOCKS, BS, -1), table, ends, torch.tensor([7], dtype=torch.int32))
    kw = dict(block_size=BS, num_heads=N, num_key_value_heads=KVN, scale=0.3)
    with pytest.raises(NotImplementedError, match="npu_fused_infer_attention_score"):
        npu_graphs_cuda.graph_attention(rnd(3, N, D), *args, **kw)  # float32 query


def test_window_bounds_are_taken_only_where_they_bound_nothing():
    """vllm-ascend 0.23 passes pre_tokens / next_tokens: at 2147483647 (no sliding window) a graph takes them; a
    window it cannot compute is refused, naming the argument."""
    kw = dict(input_layout="TND", sparse_mode=3, block_table=torch.zeros(1, 1, dtype=torch.int32))
    npu_graphs_cuda.FusedInferAttentionScore._check_mode({**kw, "pre_tokens": 2147483647, "next_tokens": 2147483647})
    for window in ({"pre_tokens": 128, "next_tokens": 0}, {"pre_tokens": 2147483647, "next_tokens": 0}):
        with pytest.raises(NotImplementedError, match="next_tokens"):
            npu_graphs_cuda.FusedInferAttentionScore._check_mode({**kw, **window})


@pytest.mark.parametrize(
    "op", ["FusedInferAttentionScore", "FusedInferAttentionScoreV2", "FusedInferAttentionScoreMLA"]
)
def test_a_captured_right_down_causal_call_needs_its_mask(op):
    """Every ``.out`` form a task group takes refuses ``sparse_mode=3`` without the compressed mask, as the NPU op and
    the eager emulations do; with it the call's mode is taken."""
    cls = getattr(npu_graphs_cuda, op)
    cache = torch.zeros(1, 1, 16, 8)
    kwargs = dict(input_layout="TND", sparse_mode=3, block_table=torch.zeros(1, 1, dtype=torch.int32))
    if cls.MLA:
        kwargs.update(query=cache, key=cache, value=cache, query_rope=cache, key_rope=cache, input_layout="TND_NTD")
    kwargs.update({cls.Q_ENDS: [3], cls.KV_LENS: [7]})
    with pytest.raises(NotImplementedError, match=f"{cls.OP}.out with sparse_mode=3 without atten_mask"):
        cls(None)._check(kwargs)
    cls(None)._check({**kwargs, "atten_mask": MASK})


def test_block_table_rows_are_gathered_from_the_address_an_update_names():
    """The kernel a task group runs before its attention (compiled on a CUDA device, else Triton's CPU interpreter):
    the rows of the table at the address in the group's parameters, with their row stride, and zero rows past the
    source's, against a loop."""
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda"
    source = torch.randint(0, 1000, (4, 7), dtype=torch.int32, device=device)[:, :5]  # 4 rows of 5, row stride 7
    table = torch.full((6, 5), -7, dtype=torch.int32, device=device)
    address = torch.tensor([source.data_ptr()], dtype=torch.int64, device=device)
    shape = torch.tensor([source.shape[0], source.stride(0)], dtype=torch.int32, device=device)
    npu_graphs_cuda._gather_rows_kernel[(6,)](address, shape, table, 5, BLOCK=8)
    expected = [[int(source[r, c]) if r < 4 else 0 for c in range(5)] for r in range(6)]
    assert table.tolist() == expected


# ----------------------------------------------------------------------------------------------------
# CUDA: graphs, task groups, updates, ExternalEvents
# ----------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: runs on the GPU machine")


class Layer:
    """vllm-ascend's FULL capture of one attention layer (0.18 attention_v1.full_graph_fia), on static buffers."""

    def __init__(self):
        import torch_npu

        self.npu, self.torch_npu = torch.npu, torch_npu
        self.kc, self.vc, self.table = _paged("cuda")
        self.q = rnd(12, N, D, dtype=HALF).cuda()
        self.out = torch.zeros_like(self.q)
        self.graph = torch.npu.NPUGraph()
        self.event = self.handle = None

    def args(self, q_ends, kv_lens, table=None):
        return dict(
            query=self.q,
            key=self.kc.view(NBLOCKS, BS, -1),
            value=self.vc.view(NBLOCKS, BS, -1),
            block_table=self.table if table is None else table,
            atten_mask=MASK,
            input_layout="TND",
            block_size=BS,
            actual_seq_lengths=q_ends,
            actual_seq_lengths_kv=kv_lens,
            num_key_value_heads=KVN,
            num_heads=N,
            scale=0.25,
            sparse_mode=3,
        )

    def capture(self, q_ends, kv_lens, scratch: bool = False):
        with self.npu.graph(self.graph):
            stream = self.npu.current_stream()
            if scratch:  # a model's earlier intermediates: a block of the graph's pool, written, then freed
                tmp = torch.full((64,), 7, dtype=torch.int32, device="cuda")
                del tmp
            self.event = self.npu.ExternalEvent()
            self.event.wait(stream)
            self.event.reset(stream)
            self.npu.graph_task_group_begin(stream)
            self.torch_npu.npu_fused_infer_attention_score.out(
                **self.args(q_ends, kv_lens), workspace=None, out=[self.out, torch.empty(1)]
            )
            self.handle = self.npu.graph_task_group_end(stream)

    def update(self, stream, q_ends, kv_lens, table=None):
        with self.npu.stream(stream):
            self.npu.graph_task_update_begin(stream, self.handle)
            self.torch_npu.npu_fused_infer_attention_score.out(
                **self.args(q_ends, kv_lens, table), workspace=None, out=[self.out, torch.empty(1)]
            )
            self.npu.graph_task_update_end(stream)
            self.event.record(stream)

    def expected(self, q_ends, kv_lens, table=None):
        return _reference(self.q, self.kc, self.vc, self.table if table is None else table, q_ends, kv_lens, 0.25)


STEP1 = ([3, 6, 9, 9], [7, 10, 12, 0])
STEP2 = ([3, 6, 9, 9], [8, 11, 12, 0])  # every request one KV token longer but the last


@pytest.fixture
def standin():
    """The NPU stand-in on CUDA with the graph names bound (what npu_engine.install does for the engine)."""
    import npu_standin
    from npu_standin import runtime

    if runtime.device() != "cuda":
        pytest.skip("the NPU stand-in is on the CPU (NPU_STANDIN_DEVICE=cuda puts it on the CUDA device)")

    npu_standin.install()
    import torch_npu

    import npu_ops

    npu_ops.bind(torch_npu)
    npu_graphs_cuda.install()
    npu_graphs_cuda._timeouts().zero_()
    # cuBLAS's handle is created at its first use, which a capture cannot hold (the engine's warm-up makes that use)
    torch.ones(2, 2, device="cuda") @ torch.ones(2, 2, device="cuda")
    yield
    torch.cuda.synchronize()
    # the test's graphs freed now: a CUDA graph destroyed by a later collection during the next test's capture would
    # invalidate that capture
    gc.collect()


def _close(out, expected):
    torch.testing.assert_close(out[:9].double().cpu(), expected[:9], **BF16_TOL)


@cuda
def test_a_replay_waits_for_the_update_issued_after_it(standin):
    """The release's order: replay first, then the update and its record; the device is held back (a sleeping kernel)
    so the replay is queued long before the update is issued. The captured wait holds the attention until the
    record: each step reads its own lists."""
    layer, update_stream = Layer(), torch.npu.Stream()
    layer.capture(*STEP1)
    for step in (STEP1, STEP2, STEP1):
        torch.cuda.current_stream().synchronize()  # the release's drain before a FULL replay
        torch.cuda._sleep(50_000_000)
        layer.graph.replay()
        layer.update(update_stream, *step)
        torch.cuda.synchronize()
        _close(layer.out, layer.expected(*step))
    npu_graphs_cuda.check()


@cuda
def test_the_captured_wait_blocks_until_a_record_issued_later(standin):
    """The device reaches the captured wait first (idle device, replay queued at once), the host issues the update
    only 50 ms later: the attention must run with the update's lists, and no wait may time out."""
    import time

    layer, update_stream = Layer(), torch.npu.Stream()
    layer.capture(*STEP1)
    for step in (STEP2, STEP1, STEP2):
        torch.cuda.synchronize()
        layer.graph.replay()
        time.sleep(0.05)
        layer.update(update_stream, *step)
        torch.cuda.synchronize()
        _close(layer.out, layer.expected(*step))
    npu_graphs_cuda.check()


@cuda
def test_an_update_that_lands_before_the_graph_runs_is_kept(standin):
    """The device is held back, so the update's copy (on the idle update stream) lands before the replay's first
    kernel runs. A block the graph writes and frees before the attention (the model's earlier intermediates) must not
    be where the task group's parameters live: the graph's write would replace the update's lists."""
    layer, update_stream = Layer(), torch.npu.Stream()
    layer.capture(*STEP1, scratch=True)
    for step in (STEP2, STEP1):
        torch.cuda.current_stream().synchronize()
        torch.cuda._sleep(100_000_000)
        layer.graph.replay()
        layer.update(update_stream, *step)
        update_stream.synchronize()  # the lists are in place while the replay still waits behind the sleep
        torch.cuda.synchronize()
        _close(layer.out, layer.expected(*step))
    npu_graphs_cuda.check()


@cuda
def test_an_update_may_name_another_block_table_and_more_requests(standin):
    """vllm-ascend's merged EAGLE draft graph updates a later draft step with another block table and one request per
    query row (captured with the batch's request count). The graph reads that table's rows when it runs, as the NPU
    op does, not when the update is issued: here they are written on the device after the update was issued."""
    layer, update_stream = Layer(), torch.npu.Stream()
    layer.capture(*STEP1)
    q_ends, kv_lens = list(range(1, 10)), [3, 5, 7, 9, 11, 12, 4, 6, 8]
    rows = torch.tensor([[5, 3, 11], [1, 9, 4], [0, 2, 7], [8, 6, 10], [4, 4, 4], [11, 0, 1], [2, 2, 2], [9, 8, 7],
                         [3, 5, 6]], dtype=torch.int32)  # fmt: skip
    source, table = rows.cuda(), torch.zeros_like(rows, device="cuda")
    torch.cuda.current_stream().synchronize()
    torch.cuda._sleep(100_000_000)
    table.copy_(source)  # queued behind the sleep, before the replay
    layer.graph.replay()
    layer.update(update_stream, q_ends, kv_lens, table)
    update_stream.synchronize()
    assert not torch.cuda.current_stream().query()  # the update has run; the table is not written yet
    torch.cuda.synchronize()
    _close(layer.out, layer.expected(q_ends, kv_lens, rows))
    npu_graphs_cuda.check()


@cuda
def test_a_replay_without_its_update_is_named(standin):
    layer, update_stream = Layer(), torch.npu.Stream()
    layer.capture(*STEP1)
    layer.graph.replay()
    layer.update(update_stream, *STEP1)
    layer.graph.replay()  # no update issued for it
    with pytest.raises(npu_graphs_cuda.StaleTaskGroup, match=r"task group 0 of graph \d+ .*replay 2 .*without"):
        layer.graph.replay()
    layer.update(update_stream, *STEP1)  # let the waiting replay finish
    torch.cuda.synchronize()


@cuda
def test_an_update_must_name_the_captured_tensors(standin):
    layer = Layer()
    layer.capture(*STEP1)
    other = torch.zeros_like(layer.kc).view(NBLOCKS, BS, -1)
    with torch.npu.stream(torch.npu.Stream()):
        torch.npu.graph_task_update_begin(torch.npu.current_stream(), layer.handle)
        with pytest.raises(NotImplementedError, match="re-issued with other key"):
            torch_npu_out(layer, key=other)
    npu_graphs_cuda._STATE.updating = None


def torch_npu_out(layer, **changed):
    import torch_npu

    torch_npu.npu_fused_infer_attention_score.out(
        **{**layer.args(*STEP1), **changed}, workspace=None, out=[layer.out, torch.empty(1)]
    )


@cuda
def test_without_the_full_drain_the_next_update_overtakes_a_replay(standin):
    """vllm-ascend #4233's hazard on real streams: the device is busy (a sleeping kernel) when the host queues step
    1's replay and update, then, without the drain, step 2's replay and update. The idle update stream runs both
    updates at once: step 1's attention runs with step 2's lists (failure 1), and step 1's reset consumes step 2's
    record, so step 2's wait never sees one (failure 2: on the NPU a hang; here a timed-out wait)."""
    layer, update_stream = Layer(), torch.npu.Stream()
    layer.capture(*STEP1)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    layer.graph.replay()
    layer.update(update_stream, *STEP1)
    step1 = layer.out.clone()  # queued on the main stream behind step 1's replay
    layer.graph.replay()  # no drain before it
    layer.update(update_stream, *STEP2)
    torch.cuda.synchronize()
    wrong = layer.expected(*STEP2)
    torch.testing.assert_close(step1[:9].double().cpu(), wrong[:9], **BF16_TOL)  # step 2's lists in step 1
    assert not torch.allclose(step1[:9].double().cpu(), layer.expected(*STEP1)[:9], atol=1e-2)
    with pytest.raises(npu_graphs_cuda.DeviceHang, match="1 ExternalEvent waits never saw their record"):
        npu_graphs_cuda.check()


@cuda
def test_with_the_full_drain_a_busy_device_keeps_every_step_exact(standin):
    """The same sequence with the release's drain before each replay: each step reads its own lists."""
    layer, update_stream = Layer(), torch.npu.Stream()
    layer.capture(*STEP1)
    results = []
    for step in (STEP1, STEP2):
        torch.cuda.current_stream().synchronize()
        torch.cuda._sleep(200_000_000)
        layer.graph.replay()
        layer.update(update_stream, *step)
        results.append(layer.out.clone())
    torch.cuda.synchronize()
    for step, out in zip((STEP1, STEP2), results):
        _close(out, layer.expected(*step))
    npu_graphs_cuda.check()


@cuda
def test_with_the_full_ordering_on_the_device_a_busy_device_keeps_every_step_exact(standin):
    """full-replay-ordered-on-device on real streams: in place of each drain a boundary event on the replay's stream,
    and the update stream waits for it before the update. The host queues all three steps while the device is still
    busy (it never waits) and each step reads its own lists, every record seen."""
    from zb_patch.versions.fixes import graph_replay

    ordering = graph_replay.FullOrdering
    ordering.reset()
    layer, update_stream = Layer(), torch.npu.Stream()
    layer.capture(*STEP1)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    steps, results = (STEP1, STEP2, STEP1), []
    for step in steps:
        ordering.at_drain(torch, lambda: pytest.fail("a host drain"))
        layer.graph.replay()
        ordering.before_update(update_stream)
        layer.update(update_stream, *step)
        results.append(layer.out.clone())
    assert not torch.cuda.current_stream().query(), "the host queued every step while the device was busy"
    torch.cuda.synchronize()
    for step, out in zip(steps, results):
        _close(out, layer.expected(*step))
    npu_graphs_cuda.check()
    ordering.reset()


def _mla_call(version, q, q_rope, latent, rope, table, q_ends, kv_lens):
    """The FULL MLA decode call as each release family makes it: FIA v1 with positional query / key / value and v1's
    names (vllm-ascend 0.13 ``AscendMLAImpl._forward_decode``), or FIA v2 (0.18 / 0.23)."""
    import torch_npu

    common = dict(
        query_rope=q_rope,
        key_rope=rope,
        num_key_value_heads=1,
        input_layout="TND_NTD",
        atten_mask=MASK,
        sparse_mode=3,
        block_table=table,
        block_size=rope.shape[2],
    )
    if version == "v1":
        v1 = dict(num_heads=q.shape[1], scale=0.07, antiquant_mode=0, antiquant_scale=None)
        v1.update(actual_seq_lengths=q_ends, actual_seq_lengths_kv=kv_lens)
        return torch_npu.npu_fused_infer_attention_score, (q, latent, latent), {**common, **v1}
    v2 = dict(num_query_heads=q.shape[1], softmax_scale=0.07, actual_seq_qlen=q_ends, actual_seq_kvlen=kv_lens)
    return torch_npu.npu_fused_infer_attention_score_v2, (q, latent, latent), {**common, **v2}


@cuda
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_mla_task_group_replays_with_each_step_s_lists(standin, version):
    """FIA's MLA mode captured in a task group (v1: 0.13's ``.out`` with positional tensors; v2: 0.18 / 0.23), then
    two steps of replay + update (MTP k = 2: 3 requests of 3 rows and a padded one with KV length 0): each replay's
    real rows equal the eager emulation with that step's lists, the padded rows are zero."""
    from npu_ops import mla

    heads, block = mla.FIA_MLA_HEADS[0], 16
    latent = rnd(10, 1, block, mla.LATENT, dtype=HALF).cuda()
    rope = rnd(10, 1, block, mla.ROPE, dtype=HALF).cuda()
    table = torch.tensor([[3, 7, 0], [1, 9, 4], [5, 2, 8], [0, 0, 0]], dtype=torch.int32, device="cuda")
    q = (rnd(12, heads, mla.LATENT, dtype=HALF) * 0.1).cuda()
    q_rope = (rnd(12, heads, mla.ROPE, dtype=HALF) * 0.1).cuda()
    out = torch.zeros(heads, 12, mla.LATENT, dtype=HALF, device="cuda")
    lse = torch.empty(12, dtype=HALF, device="cuda")
    steps = (([3, 6, 9, 12], [20, 35, 7, 0]), ([3, 6, 9, 12], [23, 38, 10, 0]))
    graph, update_stream = torch.npu.NPUGraph(), torch.npu.Stream()
    with torch.npu.graph(graph):
        stream = torch.npu.current_stream()
        event = torch.npu.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        torch.npu.graph_task_group_begin(stream)
        op, args, kwargs = _mla_call(version, q, q_rope, latent, rope, table, *steps[0])
        op.out(*args, **kwargs, workspace=None, out=[out, lse])
        handle = torch.npu.graph_task_group_end(stream)
    for q_ends, kv_lens in steps:
        graph.replay()
        with torch.npu.stream(update_stream):
            torch.npu.graph_task_update_begin(update_stream, handle)
            op, args, kwargs = _mla_call(version, q, q_rope, latent, rope, table, q_ends, kv_lens)
            op.out(*args, **kwargs, workspace=None, out=[out, lse])
            torch.npu.graph_task_update_end(update_stream)
            event.record(update_stream)
        torch.cuda.synchronize()
        op, args, kwargs = _mla_call(version, q[:9], q_rope[:9], latent, rope, table, q_ends[:3], kv_lens[:3])
        eager, _ = op(*args, **kwargs)
        torch.testing.assert_close(out[:, :9].float(), eager.float(), atol=2e-2, rtol=2e-2)
        assert out[:, 9:].abs().sum() == 0
    npu_graphs_cuda.check()
