"""piecewise-replay-without-host-drain's stand-in ``torch`` (zb_patch/versions/graph_replay.py) without torch: the two
host drains do nothing and are counted, every other name is the real module's, and the wrapper leaves non-PIECEWISE
wrappers and other configurations to the release unchanged. Its behaviour on the release's ACLGraphWrapper is tested
in tests/patches/test_graph_modes.py."""

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
    before = GR.Drains.skipped
    proxy.npu.synchronize()
    proxy.npu.current_stream().synchronize()
    assert calls == [] and GR.Drains.skipped - before == 2
    assert proxy.Tensor == "tensor class" and proxy.npu.NPUGraph == "graph class"
    assert proxy.npu.current_stream().query() is True


def _config(async_scheduling, spec):
    scheduler = SimpleNamespace(async_scheduling=async_scheduling)
    return SimpleNamespace(scheduler_config=scheduler, speculative_config=object() if spec else None)


def test_wants_no_drain_only_with_async_scheduling_and_spec_decode():
    assert GR.wants_no_drain(_config(True, True))
    assert not GR.wants_no_drain(_config(True, False))
    assert not GR.wants_no_drain(_config(False, True))


def test_other_wrappers_run_the_release_unchanged():
    seen = []

    def original(wrapper, *args, **kwargs):
        seen.append((wrapper, args, kwargs))
        return "out"

    call = GR.make_call(original)
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
