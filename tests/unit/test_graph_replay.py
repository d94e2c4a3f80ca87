"""The graph-replay fixes (zb_patch/versions/graph_replay.py) without torch: piecewise-replay-without-host-drain's
stand-in ``torch`` (the two host drains do nothing and are counted, every other name is the real module's), the
wrapper leaving other wrappers and configurations to the release, and full-replay-ordered-on-device's bookkeeping
(where a drain becomes a boundary, which update waits for which boundary). Their behaviour on the release's
ACLGraphWrapper, runner and update functions is tested in tests/patches/test_graph_modes.py."""

from types import SimpleNamespace

from zb_patch.versions import graph_replay as GR


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


def test_wants_no_drain_only_with_async_scheduling_and_spec_decode():
    assert GR.wants_no_drain(_config(True, True))
    assert not GR.wants_no_drain(_config(True, False))
    assert not GR.wants_no_drain(_config(False, True))


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

    call = GR.make_call(original)
    # FULL while full-replay-ordered-on-device is not applied (the original's module has no ordered update)
    full = SimpleNamespace(runtime_mode=SimpleNamespace(name="FULL"), vllm_config=_config(True, True))
    piecewise_sync = SimpleNamespace(runtime_mode=SimpleNamespace(name="PIECEWISE"), vllm_config=_config(False, True))
    assert call(full, 1, a=2) == "out" and call(piecewise_sync) == "out"
    assert seen == [(full, (1,), {"a": 2}), (piecewise_sync, (), {})]
    assert "torch" not in original.__globals__ or not isinstance(original.__globals__["torch"], GR.NoDrainTorch)


def test_spec_names_its_target_and_fingerprints():
    patch = GR.piecewise_replay_without_host_drain({"vllm-ascend 0.18.0": "81c9fadfb87529dd"})
    assert patch.id == patch.group == "piecewise-replay-without-host-drain"
    assert patch.target == "vllm_ascend.compilation.acl_graph:ACLGraphWrapper.__call__"
    assert patch.roles == ("worker",) and "vllm-ascend#9025" in patch.upstream


def test_full_ordering_is_installed_only_by_its_own_patch():
    marked = SimpleNamespace(**{GR.MARK_ID: "full-replay-ordered-on-device-mla-attn"})
    other = SimpleNamespace(**{GR.MARK_ID: "piecewise-replay-without-host-drain"})
    assert GR.full_ordering_installed({"update_attn_params": marked})
    assert not GR.full_ordering_installed({"update_attn_params": other, "update_full_graph_params": lambda: None})
    assert not GR.full_ordering_installed({})


def test_full_spec_requires_the_wrapper_it_acts_through():
    patch = GR.full_replay_ordered_on_device(
        "-mla-attn",
        "vllm_ascend.compilation.acl_graph:update_mla_attn_params",
        {"x": "0" * 16},
        aliases=(),
        stream_arg=0,
    )
    assert patch.id == "full-replay-ordered-on-device-mla-attn" and patch.group == "full-replay-ordered-on-device"
    assert patch.requires == ("piecewise-replay-without-host-drain",) and patch.roles == ("worker",)
