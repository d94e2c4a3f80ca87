"""The graph-replay patches (zb_patch/versions/fixes/graph_replay.py) without torch: the stand-in ``torch`` of the two
PIECEWISE patches (piecewise-drain-once-per-step: the first drain of a target forward runs, the rest and the drafter's
do nothing; piecewise-replay-without-host-drain: none runs; every other name is the real module's), the wrapper
leaving other wrappers and configurations to the release, and full-replay-ordered-on-device's bookkeeping
(where a drain becomes a boundary, which update waits for which boundary). Their behaviour on the release's
ACLGraphWrapper, runner and update functions is tested in tests/patches/test_graph_modes.py."""

import sys
from types import FunctionType, SimpleNamespace

import pytest

from zb_patch import registry as R
from zb_patch.versions.fixes import graph_replay as GR


def _fake_torch(calls):
    stream = SimpleNamespace(synchronize=lambda: calls.append("stream.synchronize"), query=lambda: True)
    npu = SimpleNamespace(
        synchronize=lambda device=None: calls.append("synchronize"),
        current_stream=lambda device=None: stream,
        NPUGraph="graph class",
    )
    return SimpleNamespace(npu=npu, Tensor="tensor class")


def test_no_drain_torch_skips_both_drains_and_forwards_the_rest():
    calls = []
    proxy = GR.NoDrainTorch(_fake_torch(calls))
    before = GR.DRAINS["skipped"]
    proxy.npu.synchronize()
    proxy.npu.current_stream().synchronize()
    assert calls == [] and GR.DRAINS["skipped"] - before == 2
    assert proxy.Tensor == "tensor class" and proxy.npu.NPUGraph == "graph class"
    assert proxy.npu.current_stream().query() is True


def _config(async_scheduling, spec):
    scheduler = SimpleNamespace(async_scheduling=async_scheduling)
    return SimpleNamespace(scheduler_config=scheduler, speculative_config=object() if spec else None)


def test_the_patches_act_only_with_async_scheduling_and_spec_decode():
    assert GR.async_spec_decode(_config(True, True))
    assert not GR.async_spec_decode(_config(True, False))
    assert not GR.async_spec_decode(_config(False, True))


@pytest.fixture
def forward_contexts(monkeypatch):
    """vllm.forward_context as the stand-in reads it: ``enter(is_draft_model)`` makes a new forward's context
    current."""
    current = {}
    module = SimpleNamespace(get_forward_context=lambda: current["context"])
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(forward_context=module))
    monkeypatch.setitem(sys.modules, "vllm.forward_context", module)
    monkeypatch.setattr(GR.OncePerForwardTorch, "drained_forward", None)

    def enter(is_draft_model=False):
        current["context"] = SimpleNamespace(is_draft_model=is_draft_model)

    return enter


def test_once_per_forward_torch_runs_the_first_drain_of_each_target_forward(forward_contexts):
    calls = []
    proxy = GR.OncePerForwardTorch(_fake_torch(calls))
    once, skipped = GR.DRAINS["once"], GR.DRAINS["skipped"]
    for _ in range(3):
        forward_contexts()  # target forward: 4 pieces, each drained by the release
        for _ in range(4):
            proxy.npu.current_stream().synchronize()
        for _ in range(2):  # the drafter's forwards (k = 2), 4 pieces each
            forward_contexts(is_draft_model=True)
            for _ in range(4):
                proxy.npu.synchronize()
    assert calls == ["stream.synchronize"] * 3
    assert GR.DRAINS["once"] - once == 3 and GR.DRAINS["skipped"] - skipped == 3 * 3 + 3 * 8
    assert proxy.Tensor == "tensor class" and proxy.npu.NPUGraph == "graph class"


def test_hooked_npu_passes_the_drains_and_streams_their_arguments(forward_contexts):
    """vllm-ascend 0.13.0 drains with ``torch.npu.synchronize()``: the first drain of a target forward runs the real
    one with the device it was given; ``current_stream``'s arguments reach ``torch.npu``'s."""
    calls = []
    torch = _fake_torch(calls)
    stream = torch.npu.current_stream()
    torch.npu.synchronize = lambda device=None: calls.append(("synchronize", device))
    torch.npu.current_stream = lambda *args, **kwargs: calls.append(("current_stream", args, kwargs)) or stream
    proxy = GR.OncePerForwardTorch(torch)
    forward_contexts()
    proxy.npu.synchronize("npu:1")
    proxy.npu.synchronize("npu:1")  # the same forward: skipped
    assert proxy.npu.current_stream(1, device="npu:1").query() is True
    assert calls == [("synchronize", "npu:1"), ("current_stream", (1,), {"device": "npu:1"})]


def _release_call(wrapper):  # ACLGraphWrapper.__call__'s drain as its module makes it (`torch`: the module's global)
    torch.npu.current_stream().synchronize()  # noqa: F821
    return torch  # noqa: F821


def test_piecewise_replay_runs_the_release_with_the_stand_in_torch(forward_contexts):
    calls = []
    torch = _fake_torch(calls)
    original = FunctionType(_release_call.__code__, {"torch": torch})
    call = GR.make_call(GR.OncePerForwardTorch)(original)
    wrapper = SimpleNamespace(runtime_mode=SimpleNamespace(name="PIECEWISE"), vllm_config=_config(True, True))
    forward_contexts()
    sys.modules["vllm.forward_context"].get_forward_context().cudagraph_runtime_mode = SimpleNamespace(name="PIECEWISE")
    seen = [call(wrapper), call(wrapper)]  # two pieces of one target forward
    assert all(type(t) is GR.OncePerForwardTorch for t in seen) and seen[0] is seen[1]
    assert calls == ["stream.synchronize"]  # the first piece's drain only
    assert original.__globals__["torch"] is torch  # restored after each call


class _Recorder:
    """Events and streams that log what the ordering asks of them."""

    def __init__(self):
        self.log = []
        recorder = self

        class Event:
            def __init__(self):
                self.name = f"e{sum(1 for entry in recorder.log if entry[0] == 'record') + 1}"

            def record(self, stream):
                recorder.log.append(("record", self.name, stream.name))

        class Stream:
            def __init__(self, name):
                self.name = name

            def synchronize(self):
                recorder.log.append(("drain", self.name))

            def wait_event(self, event):
                recorder.log.append(("wait", self.name, event.name))

        self.Stream = Stream
        self.replay_stream = Stream("replay")
        self.torch = SimpleNamespace(npu=SimpleNamespace(Event=Event, current_stream=lambda: self.replay_stream))


def test_full_ordering_turns_drains_into_boundaries_and_updates_into_waits():
    GR.FullOrdering.reset()
    rec = _Recorder()
    runner_stream, drafter_stream = rec.Stream("runner-update"), rec.Stream("drafter-update")

    def drain():
        GR.FullOrdering.at_drain(rec.torch, rec.replay_stream.synchronize)

    drain()  # target replay, step 1
    GR.FullOrdering.before_update(runner_stream)
    GR.FullOrdering.before_update(drafter_stream)  # a drafter graph the release replays without a drain
    GR.FullOrdering.before_update(drafter_stream)  # the same boundary is waited for once per stream
    drain()  # step 2
    GR.FullOrdering.before_update(runner_stream)
    drain()  # a replay no update came after ...
    drain()  # ... so the next one drains as released
    GR.FullOrdering.before_update(runner_stream)
    drain()  # paired again: a boundary
    assert rec.log == [
        ("record", "e1", "replay"),
        ("wait", "runner-update", "e1"),
        ("wait", "drafter-update", "e1"),
        ("record", "e2", "replay"),
        ("wait", "runner-update", "e2"),
        ("record", "e3", "replay"),
        ("drain", "replay"),
        ("wait", "runner-update", "e3"),
        ("record", "e4", "replay"),
    ]
    GR.FullOrdering.reset()


def test_updates_wait_for_nothing_before_the_first_boundary():
    GR.FullOrdering.reset()
    rec = _Recorder()
    GR.FullOrdering.before_update(rec.Stream("runner-update"))
    assert rec.log == []


def test_ordered_update_finds_its_stream_by_position_or_name():
    GR.FullOrdering.reset()
    rec = _Recorder()
    GR.FullOrdering.at_drain(rec.torch, rec.replay_stream.synchronize)
    calls = []
    update = GR.make_ordered_update(1)(lambda *a, **k: calls.append((a, k)) or "done")
    first, second = rec.Stream("s1"), rec.Stream("s2")
    assert update("backend", first, "ctx") == "done"
    assert update("backend", update_stream=second) == "done"
    assert [entry for entry in rec.log if entry[0] == "wait"] == [("wait", "s1", "e1"), ("wait", "s2", "e1")]
    assert calls == [(("backend", first, "ctx"), {}), (("backend",), {"update_stream": second})]
    GR.FullOrdering.reset()


def test_other_wrappers_run_the_release_unchanged():
    seen = []

    def original(wrapper, *args, **kwargs):
        seen.append((wrapper, args, kwargs))
        return "out"

    call = GR.make_call(GR.OncePerForwardTorch)(original)
    # FULL while full-replay-ordered-on-device is not applied (the original's module has no ordered update)
    full = SimpleNamespace(runtime_mode=SimpleNamespace(name="FULL"), vllm_config=_config(True, True))
    piecewise_sync = SimpleNamespace(runtime_mode=SimpleNamespace(name="PIECEWISE"), vllm_config=_config(False, True))
    assert call(full, 1, a=2) == "out" and call(piecewise_sync) == "out"
    assert seen == [(full, (1,), {"a": 2}), (piecewise_sync, (), {})]
    assert "torch" not in original.__globals__ or not isinstance(original.__globals__["torch"], GR.HookedTorch)


def test_piecewise_specs_the_default_from_upstream_the_no_drain_variant_opt_in():
    fingerprints = {"vllm-ascend 0.18.0": "81c9fadfb87529dd"}
    once = GR.piecewise_drain_once_per_step(fingerprints)
    no_drain = GR.piecewise_replay_without_host_drain(fingerprints)
    assert once.id == once.group == "piecewise-drain-once-per-step"
    assert no_drain.id == no_drain.group == "piecewise-replay-without-host-drain"
    assert once.target == no_drain.target == "vllm_ascend.compilation.acl_graph:ACLGraphWrapper.__call__"
    assert once.rests_on.kind == R.UPSTREAM and not once.opt_in
    assert "vllm-ascend#14081" in once.upstream and "vllm-ascend#9025" in once.upstream
    assert no_drain.rests_on.kind == R.NPU_CONTRACT and no_drain.opt_in and no_drain.supersedes == (once.id,)
    assert once.roles == no_drain.roles == ("worker",)


def test_full_ordering_is_installed_only_by_its_own_patch():
    marked = SimpleNamespace(**{GR.MARK_ID: "full-replay-ordered-on-device-mla-attn"})
    other = SimpleNamespace(**{GR.MARK_ID: "piecewise-drain-once-per-step"})
    assert GR.full_ordering_installed({"update_attn_params": marked})
    assert not GR.full_ordering_installed({"update_attn_params": other, "update_full_graph_params": lambda: None})
    assert not GR.full_ordering_installed({})


def test_full_spec_is_opt_in_and_requires_the_wrapper_it_acts_through():
    patch = GR.full_replay_ordered_on_device(
        "-mla-attn",
        "vllm_ascend.compilation.acl_graph:update_mla_attn_params",
        {"x": "0" * 16},
        aliases=(),
        stream_arg=0,
    )
    assert patch.id == "full-replay-ordered-on-device-mla-attn" and patch.group == "full-replay-ordered-on-device"
    assert patch.requires == ("piecewise-drain-once-per-step",) and patch.roles == ("worker",)
    assert patch.opt_in and "vllm-ascend#11915" in patch.upstream and "#11915" in patch.rests_on.evidence


def _release_call_with_arguments(wrapper, *args, **kwargs):  # what the release's body is handed, and its `torch`
    return wrapper, args, kwargs, torch  # noqa: F821


def test_the_release_gets_the_call_s_arguments_on_every_path(forward_contexts):
    """The model's arguments reach the release's body as they were passed, whether the wrapper leaves the call alone
    (a synchronous configuration; a forward of another graph mode than the wrapper's: the release then runs the
    piece eagerly, with its own ``torch``) or replays it with the stand-in ``torch``."""
    torch = _fake_torch([])
    original = FunctionType(_release_call_with_arguments.__code__, {"torch": torch})
    call = GR.make_call(GR.OncePerForwardTorch)(original)
    piecewise = SimpleNamespace(runtime_mode=SimpleNamespace(name="PIECEWISE"), vllm_config=_config(True, True))
    piecewise_sync = SimpleNamespace(runtime_mode=SimpleNamespace(name="PIECEWISE"), vllm_config=_config(False, True))
    assert call(piecewise_sync, 1, a=2) == (piecewise_sync, (1,), {"a": 2}, torch)
    forward_contexts()
    context = sys.modules["vllm.forward_context"].get_forward_context()
    context.cudagraph_runtime_mode = SimpleNamespace(name="NONE")  # an eager forward (profile run, too large a batch)
    assert call(piecewise, 1, a=2) == (piecewise, (1,), {"a": 2}, torch)
    context.cudagraph_runtime_mode = SimpleNamespace(name="PIECEWISE")
    wrapper, args, kwargs, stand_in = call(piecewise, 3, b=4)
    assert (wrapper, args, kwargs) == (piecewise, (3,), {"b": 4}) and type(stand_in) is GR.OncePerForwardTorch
    assert original.__globals__["torch"] is torch
    # a piece replayed while the stand-in is in place (the module's torch already hooked): the release's as it is
    original.__globals__["torch"] = stand_in
    assert call(piecewise, 5, c=6) == (piecewise, (5,), {"c": 6}, stand_in)
    assert original.__globals__["torch"] is stand_in
