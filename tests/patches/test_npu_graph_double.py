"""The CPU double of ACL graphs (tests/support/npu_graphs.py) against naive references: capture / replay against the
same code run eagerly, the task-group and update contract against the eager op with the same parameters, the
event flags against a table of the documented outcomes, the stream order against the issue order, and the uses the
NPU runtime refuses."""

from __future__ import annotations

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
if npu_standin.detect_family() is None:
    pytest.skip("the NPU stand-in needs vllm-ascend installed (a va env)", allow_module_level=True)

import torch  # noqa: E402

import npu_graphs as G  # noqa: E402
from npu_ops.attention import npu_fused_infer_attention_score as eager_fia  # noqa: E402


@pytest.fixture
def npu():
    import torch_npu

    with G.activate() as dev:
        yield torch_npu, dev


def _capture(torch_npu, fn, *args):
    g = torch_npu.npu.NPUGraph()
    with torch_npu.npu.graph(g, pool=torch_npu.npu.graph_pool_handle()):
        out = fn(*args)
    return g, out


# --------------------------------------------------------------------------------------------------------
# capture and replay of plain torch code
# --------------------------------------------------------------------------------------------------------


def _block(x, w, b, acc):
    y = torch.relu(x @ w + b)  # functional ops: outputs recorded
    acc.add_(y.sum(dim=0))  # in-place op on a static buffer
    return y[:, :2]  # a view of a captured output


def test_replay_equals_the_eager_code_on_the_static_buffers(npu):
    torch_npu, dev = npu
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(4, 3, generator=gen), torch.randn(3, 5, generator=gen), torch.randn(5, generator=gen)
    acc = torch.zeros(5)
    g, out = _capture(torch_npu, _block, x, w, b, acc)
    assert torch.equal(acc, torch.zeros(5)), "capture executes nothing"
    assert torch.isnan(out).all(), "a capture output is unwritten until a replay"
    ref_acc = torch.zeros(5)
    for step in range(3):
        x.copy_(torch.randn(4, 3, generator=gen))  # new contents of the static input
        g.replay()
        ref = _block(x, w, b, ref_acc)
        assert torch.allclose(out, ref) and torch.allclose(acc, ref_acc), step
    assert dev.idle()


def test_host_parameters_are_frozen_at_capture(npu):
    torch_npu, _ = npu
    lens = [2, 3]
    x = torch.arange(12.0).view(3, 4)

    def fn(x):
        return x[:, : lens[0]].sum(dim=1) * lens[1]  # a slice bound and a scalar from a host list

    g, out = _capture(torch_npu, fn, x)
    lens[:] = [4, 1]  # changed after the capture: the graph keeps [2, 3]
    g.replay()
    assert torch.equal(out, x[:, :2].sum(dim=1) * 3)


# --------------------------------------------------------------------------------------------------------
# task groups, updates and the external event
# --------------------------------------------------------------------------------------------------------

T, N, KVN, D, BS = 4, 2, 1, 16, 16  # tokens, heads, kv heads, head size, block size


def _fia_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, N, D, generator=gen).to(torch.bfloat16)
    cache = torch.randn(4, BS, KVN * D, generator=gen).to(torch.bfloat16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    mask = torch.ones(8, 8, dtype=torch.bool)
    return q, cache, table, mask


def _fia_kwargs(cache, table, mask, kv_lens):
    return dict(
        key=cache,
        value=cache,
        atten_mask=mask,
        block_table=table,
        input_layout="TND",
        block_size=BS,
        actual_seq_lengths=[2, 4],
        actual_seq_lengths_kv=list(kv_lens),
        num_key_value_heads=KVN,
        num_heads=N,
        scale=0.25,
        sparse_mode=3,
    )


def _capture_grouped_attention(torch_npu, q, cache, table, mask, kv_lens, out, *, with_event=True):
    """vllm-ascend's capture of one attention layer (attention_v1.full_graph_fia): the external event's wait and
    reset, then the op in a task group."""
    event = torch_npu.npu.ExternalEvent()
    g = torch_npu.npu.NPUGraph()
    with torch_npu.npu.graph(g):
        stream = torch_npu.npu.current_stream()
        if with_event:
            event.wait(stream)
            event.reset(stream)
        torch_npu.npu.graph_task_group_begin(stream)
        torch_npu.npu_fused_infer_attention_score.out(
            q, **_fia_kwargs(cache, table, mask, kv_lens), workspace=None, out=[out, torch.empty(1)]
        )
        handle = torch_npu.npu.graph_task_group_end(stream)
    return g, handle, event


def _update(torch_npu, update_stream, handle, event, q, cache, table, mask, kv_lens, out):
    """vllm-ascend's update of one layer (update_graph_params): re-issue the op on the update stream, then record."""
    with torch_npu.npu.stream(update_stream):
        torch_npu.npu.graph_task_update_begin(update_stream, handle)
        torch_npu.npu_fused_infer_attention_score.out(
            q, **_fia_kwargs(cache, table, mask, kv_lens), workspace=None, out=[out, torch.empty(1)]
        )
        torch_npu.npu.graph_task_update_end(update_stream)
        event.record(update_stream)


def _eager(q, cache, table, mask, kv_lens):
    return eager_fia(q, **_fia_kwargs(cache, table, mask, kv_lens))[0]


def test_a_grouped_op_keeps_its_captured_parameters_until_an_update(npu):
    torch_npu, dev = npu
    q, cache, table, mask = _fia_inputs()
    out = torch.zeros(T, N, D, dtype=torch.bfloat16)
    g, handle, event = _capture_grouped_attention(torch_npu, q, cache, table, mask, [5, 7], out)
    assert torch.equal(out, torch.zeros_like(out)), "capture executes nothing"
    update_stream = torch_npu.npu.Stream()
    for step, kv_lens in enumerate(([9, 20], [10, 21], [3, 32]), start=1):
        g.replay()  # waits on the event: nothing of the group ran yet
        assert not [r for r in dev.group_runs if r.replay == step]
        _update(torch_npu, update_stream, handle, event, q, cache, table, mask, kv_lens, out)
        torch_npu.npu.synchronize()
        run = dev.group_runs[-1]
        assert (run.replay, run.params_for, run.calls[0].kwargs["actual_seq_lengths_kv"]) == (step, step, kv_lens)
        assert torch.equal(out, _eager(q, cache, table, mask, kv_lens)), step


def test_a_replay_without_its_update_is_named(npu):
    torch_npu, dev = npu
    q, cache, table, mask = _fia_inputs()
    out = torch.zeros(T, N, D, dtype=torch.bfloat16)
    # without the event: the group runs at once with the captured parameters
    g, handle, _ = _capture_grouped_attention(torch_npu, q, cache, table, mask, [5, 7], out, with_event=False)
    with pytest.raises(
        G.StaleTaskGroup,
        match=r"task group 0 of graph \d+ \(npu_fused_infer_attention_score; "
        r"captured at .*test_npu_graph_double.py.*ran in replay 1 .* issued for the capture",
    ):
        g.replay()


def test_a_replay_whose_update_never_comes_hangs_naming_the_group(npu):
    torch_npu, _ = npu
    q, cache, table, mask = _fia_inputs()
    out = torch.zeros(T, N, D, dtype=torch.bfloat16)
    g, handle, event = _capture_grouped_attention(torch_npu, q, cache, table, mask, [5, 7], out)
    g.replay()
    with pytest.raises(G.DeviceHang, match=r"waits at ext\d+\.wait, before task group 0 of graph"):
        torch_npu.npu.synchronize()


def test_the_next_steps_update_overtaking_a_replay_is_stale():
    """Two replays queued before either ran, then their two updates; an update stream that runs at once applies the
    second update before the first replay's group: stale parameters (vllm-ascend #4233's race)."""
    import torch_npu

    q, cache, table, mask = _fia_inputs()
    out = torch.zeros(T, N, D, dtype=torch.bfloat16)
    with G.activate(run_ahead=True, schedule="side-streams-first") as dev:
        g, handle, event = _capture_grouped_attention(torch_npu, q, cache, table, mask, [5, 7], out)
        update_stream = torch_npu.npu.Stream()
        for kv_lens in ([9, 20], [10, 21]):
            g.replay()
            _update(torch_npu, update_stream, handle, event, q, cache, table, mask, kv_lens, out)
        with pytest.raises(G.StaleTaskGroup, match="ran in replay 1 .* issued for replay 2"):
            torch_npu.npu.synchronize()
    with G.activate(run_ahead=True, schedule="side-streams-first", check_stale=False) as dev:
        g, handle, event = _capture_grouped_attention(torch_npu, q, cache, table, mask, [5, 7], out)
        update_stream = torch_npu.npu.Stream()
        for kv_lens in ([9, 20], [10, 21]):
            g.replay()
            _update(torch_npu, update_stream, handle, event, q, cache, table, mask, kv_lens, out)
        # both records set the flag before replay 1 waited; replay 1's reset clears it: replay 2 waits forever
        with pytest.raises(G.DeviceHang, match="waits at ext"):
            torch_npu.npu.synchronize()
        assert [(r.replay, r.params_for) for r in dev.group_runs] == [(1, 2)]


# --------------------------------------------------------------------------------------------------------
# events and streams
# --------------------------------------------------------------------------------------------------------

# (host calls, outcome) per the torch_npu ExternalEvent contract: record sets the flag when it runs, wait blocks its
# stream until the flag is set, reset clears it; "s" = the default stream, "u" = a second stream
EXTERNAL_EVENT_CASES = [
    (["record u", "wait s", "reset s"], "ok"),
    (["wait s", "record u", "reset s"], "ok"),
    (["wait s"], "hang"),
    (["record u", "reset u", "wait s"], "hang"),
    (["record u", "record u", "wait s", "reset s", "wait s"], "hang"),  # the lost wake-up
    (["record u", "wait s", "reset s", "record u", "wait s", "reset s"], "ok"),
]


@pytest.mark.parametrize("calls,outcome", EXTERNAL_EVENT_CASES, ids=[" ".join(c) for c, _ in EXTERNAL_EVENT_CASES])
@pytest.mark.parametrize("run_ahead", [False, True])
def test_external_event_outcomes(calls, outcome, run_ahead):
    import torch_npu

    with G.activate(run_ahead=run_ahead):
        event, u = torch_npu.npu.ExternalEvent(), torch_npu.npu.Stream()
        streams = {"s": torch_npu.npu.current_stream(), "u": u}
        for call in calls:
            verb, where = call.split()
            getattr(event, verb)(streams[where])
        if outcome == "ok":
            torch_npu.npu.synchronize()
        else:
            with pytest.raises(G.DeviceHang):
                torch_npu.npu.synchronize()


@pytest.mark.parametrize("schedule", ["issue-order", "side-streams-first", "default-stream-first", "random:3"])
def test_event_orders_two_streams_under_every_schedule(schedule):
    import torch_npu

    with G.activate(run_ahead=True, schedule=schedule) as dev:
        s, u = torch_npu.npu.current_stream(), torch_npu.npu.Stream()
        dev.launch(lambda: None, stream=s, name="produce")
        ev = torch_npu.npu.Event()
        ev.record(s)
        ev.wait(u)
        dev.launch(lambda: None, stream=u, name="consume")
        dev.launch(lambda: None, stream=s, name="later")
        assert not ev.query() and dev.executed == [], "run-ahead: nothing ran before the host blocked"
        ev.synchronize()
        assert ev.query()
        torch_npu.npu.synchronize()
        order = [name.split(":")[1] for name in dev.executed]
        assert order.index("produce") < order.index("consume")
        assert [d.kind for d in dev.drains] == ["device"]


def test_the_device_follows_the_host_when_not_running_ahead(npu):
    _, dev = npu
    done = []
    dev.launch(lambda: done.append(1))
    assert done == [1]


# --------------------------------------------------------------------------------------------------------
# what the NPU runtime refuses
# --------------------------------------------------------------------------------------------------------


def test_refusals(npu):
    torch_npu, _ = npu
    x = torch.ones(2)
    g = torch_npu.npu.NPUGraph()
    with pytest.raises(G.GraphError, match="107027"), torch_npu.npu.graph(g):
        torch_npu.npu.synchronize()
    g = torch_npu.npu.NPUGraph()
    with pytest.raises(G.GraphError, match="item"), torch_npu.npu.graph(g):
        (x * 2).sum().item()
    with pytest.raises(G.GraphError, match="not capturing"):
        torch_npu.npu.graph_task_group_begin(torch_npu.npu.current_stream())
    g = torch_npu.npu.NPUGraph()
    with (
        pytest.raises(NotImplementedError, match="multi-stream capture"),
        torch_npu.npu.graph(g),
        torch_npu.npu.stream(torch_npu.npu.Stream()),
    ):
        pass
    with pytest.raises(G.GraphError, match="before it was captured"):
        torch_npu.npu.NPUGraph().replay()


def test_update_refusals(npu):
    torch_npu, _ = npu
    q, cache, table, mask = _fia_inputs()
    out = torch.zeros(T, N, D, dtype=torch.bfloat16)
    g, handle, event = _capture_grouped_attention(torch_npu, q, cache, table, mask, [5, 7], out)
    with pytest.raises(G.GraphError, match="must differ from the capture stream"):
        torch_npu.npu.graph_task_update_begin(g.capture_stream, handle)
    u1, u2 = torch_npu.npu.Stream(), torch_npu.npu.Stream()
    torch_npu.npu.graph_task_update_begin(u1, handle)
    with pytest.raises(G.GraphError, match="same number and kinds"):
        torch_npu.npu.graph_task_update_end(u1)
    _update(torch_npu, u1, handle, event, q, cache, table, mask, [5, 7], out)
    with pytest.raises(G.GraphError, match="two streams"):
        torch_npu.npu.graph_task_update_begin(u2, handle)
