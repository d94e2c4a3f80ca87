"""ACL graph modes on the release's own code (vllm-ascend 0.13.0 / 0.18.0, whichever this env has), with the CPU
graph double (tests/support/npu_graphs.py) in place of torch_npu's graphs, task groups, external events and streams.

Real: ``ACLGraphWrapper`` (capture, replay, its host drain), ``AscendAttentionBackendImpl`` (the FULL capture:
external event wait + reset, the FIA op in a task group; the eager path used as the reference), the runner's own
forward step (0.18 ``NPUModelRunner._model_forward``, 0.13 ``_generate_process_reqs_hidden_states``: replay, then the
task-group update) and the release's update functions (0.18 ``update_full_graph_params`` ->
``AscendAttentionBackendImpl.update_graph_params``, 0.13 ``update_attn_params``), on a real ``NPUModelRunner``
(async scheduling + EAGLE). The "model" is two attention layers of that impl with a plain-torch op between them.

Asserted (docs/graph-modes.md):

* PIECEWISE: the release drains the device from the host before every piece replay, the target's and the drafter's;
  with the adapter's defaults (piecewise-drain-once-per-step) once per target forward, before its first piece, and
  never in the drafter's; with the opt-in piecewise-replay-without-host-drain never (async + spec decode); both
  leave other configurations to the release. FULL replays are drained unless full-replay-ordered-on-device is
  enabled. Replays equal the eager code on the static buffers.
* FULL_DECODE_ONLY: every replay's task groups run with the host lists of their own step (the update the runner
  issues after the replay), and the result equals the eager attention with those lists -- on a device that keeps up
  and on one the host runs ahead of, under several schedules, with the release's drain in place.
* The hazard the FULL drain guards against (vllm-ascend #4233), reproduced: the drain removed and nothing in its
  place, a host that runs ahead and an update stream that runs at once: the next step's update overtakes a queued
  replay (StaleTaskGroup) and, with the stale check off, a lost record hangs the device (DeviceHang).
* The engine self-test's counters (zb_patch.check.engine.child.count_graph_work) see every replay by mode, the drains
  as the patch decided and every task-group update, add no drain and leave full-replay-ordered-on-device in effect.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
FAMILY = npu_standin.detect_family()
if FAMILY not in ("0.13", "0.18"):
    pytest.skip(f"adapters ascend-0.13 / ascend-0.18 only; this env has {FAMILY}", allow_module_level=True)

import torch  # noqa: E402

import npu_graphs as G  # noqa: E402
from zb_patch import registry as R  # noqa: E402
from zb_patch.check.selftest.compat import EngineShape  # noqa: E402
from zb_patch.detect import detect  # noqa: E402
from zb_patch.versions.fixes import graph_replay  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parity"))

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
T, N, KVN, D, BS, BLOCKS = 4, 2, 1, 16, 16, 8  # tokens (2 requests x 1 + 1 draft), heads, kv heads, head size
ACL_GRAPH = "compilation/acl_graph.py"


@pytest.fixture(scope="module")
def env(cpu_worker):
    import runner_harness as H

    with H.session() as sess:
        shape = EngineShape(num_spec_tokens=1)
        yield H, sess, shape


def _adapter():
    import importlib

    return importlib.import_module(
        "zb_patch.versions.ascend_0_13" if FAMILY == "0.13" else "zb_patch.versions.ascend_0_18"
    )


# what the ``patched`` fixture applies: nothing, the adapter's defaults (ZB_PATCH=1), or the defaults and opt-in patches
VARIANTS = {
    "release": None,
    "default": (),
    "no-drain": ("piecewise-replay-without-host-drain",),
    "full-ordering": ("full-replay-ordered-on-device",),
    "every-opt-in": ("*",),
}


@pytest.fixture
def patched(request):
    """The adapter applied as :data:`VARIANTS` ``[request.param]`` says; unpatched after the test."""
    import importlib

    ps = _adapter().ADAPTER.patch_set
    graph_replay.FullOrdering.reset()
    graph_replay.OncePerForwardTorch.drained_forward = None
    enabled = VARIANTS[request.param]
    if enabled is not None:
        for module in ps.modules():  # the engine-core target's module too (a worker process has it imported)
            importlib.import_module(module)
        report = ps.apply(detect(), enabled=enabled)
        assert report.verdict == R.APPLIED, report.reason
        opt_in = {p.id for p in ps.patches if p.opt_in}
        assert set(report.by_verdict(R.APPLIED)) & opt_in == set(ps.opted_in(enabled))
    yield request.param
    ps.unpatch()


@pytest.fixture
def graph_state(env, monkeypatch):
    """The graph pool and graph params the release keeps per process, fresh for the test."""
    from vllm.platforms import current_platform
    from vllm_ascend.compilation import acl_graph

    for platform in {type(current_platform), type(acl_graph.current_platform)}:
        monkeypatch.setattr(platform, "_global_graph_pool", G.GraphPool())
    monkeypatch.setattr(acl_graph, "_graph_params", None)
    acl_graph.set_graph_params([T])
    return acl_graph


def _runner(env, *, async_scheduling=True):
    H, sess, shape = env
    vc = H.build_config(sess, shape, async_scheduling=async_scheduling)
    return vc, H.make_runner(vc, H.kv_cache_config(vc, shape))


@contextlib.contextmanager
def _step(vc, mode, metadata=None, *, drafter=False):
    """The forward context of one step as vllm-ascend's set_ascend_forward_context leaves it for these paths."""
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.forward_context import BatchDescriptor, get_forward_context, set_forward_context

    with (
        set_current_vllm_config(vc),
        set_forward_context(
            metadata,
            vc,
            cudagraph_runtime_mode=getattr(CUDAGraphMode, mode),
            batch_descriptor=BatchDescriptor(num_tokens=T),
        ),
    ):
        ctx = get_forward_context()
        for name in ("capturing", "flash_comm_v1_enabled", "sp_enabled"):
            setattr(ctx, name, False)
        ctx.is_draft_model = drafter  # set_ascend_forward_context(is_draft_model=True) in the proposers
        yield ctx


def _host_drains(dev):
    """The host drains before replays: the release's, and those full-replay-ordered-on-device runs as released."""
    return [d for d in dev.drains if ACL_GRAPH in d.site or "versions/fixes/graph_replay.py" in d.site]


# --------------------------------------------------------------------------------------------------------
# PIECEWISE
# --------------------------------------------------------------------------------------------------------


class Piece:
    """A piece of a piecewise-compiled model: plain torch ops on static buffers."""

    def __init__(self, seed=1):
        gen = torch.Generator().manual_seed(seed)
        self.x, self.w = torch.randn(T, 8, generator=gen), torch.randn(8, 8, generator=gen)
        self.out = torch.zeros(T, 8)

    def __call__(self, *args, **kwargs):
        self.out.copy_(torch.tanh(self.x @ self.w))
        return self.out


PIECES, DRAFTS = 3, 2  # pieces of each model; drafter forwards per step (k)


@pytest.mark.parametrize(
    "patched,async_scheduling,target_drains,drafter_drains",
    [
        ("release", True, PIECES, PIECES),  # a host drain before every piece replay, the drafter's included
        ("default", True, 1, 0),  # once per target forward, before its first piece; none in the drafter's
        ("no-drain", True, 0, 0),  # opt-in: none
        ("every-opt-in", True, 0, 0),
        ("default", False, PIECES, PIECES),  # other configurations are the release's
        ("no-drain", False, PIECES, PIECES),
    ],
    indirect=["patched"],
)
def test_piecewise_host_drains_per_forward(env, graph_state, patched, async_scheduling, target_drains, drafter_drains):
    """Each step: the target's forward over its pieces, then the drafter's k forwards over its own, every forward in
    a forward context of its own (as the runner and the proposer set them). Drains counted per forward; every replay
    equals the eager computation on that step's inputs."""
    from vllm.config import CUDAGraphMode
    from vllm_ascend.compilation.acl_graph import ACLGraphWrapper

    vc, _ = _runner(env, async_scheduling=async_scheduling)
    target, drafter = [Piece(seed) for seed in range(PIECES)], [Piece(10 + seed) for seed in range(PIECES)]
    once, skipped = graph_replay.DRAINS["once"], graph_replay.DRAINS["skipped"]
    with G.activate() as dev:
        wrap = [ACLGraphWrapper(p, vc, runtime_mode=CUDAGraphMode.PIECEWISE) for p in target + drafter]
        gen = torch.Generator().manual_seed(2)
        for step in range(4):
            for piece in target + drafter:
                piece.x.copy_(torch.randn(T, 8, generator=gen))
            before = len(_host_drains(dev))
            with _step(vc, "PIECEWISE"):
                outs = [w() for w in wrap[:PIECES]]
            after_target = len(_host_drains(dev))
            for _ in range(DRAFTS):
                with _step(vc, "PIECEWISE", drafter=True):
                    outs += [w() for w in wrap[PIECES:]]
            drains = (after_target - before, len(_host_drains(dev)) - after_target)
            # each wrapper's first call captures (no drain), the later ones replay: step 0's target forward and first
            # drafter forward capture
            drafter_replays = DRAFTS if step else DRAFTS - 1
            assert drains == ((target_drains if step else 0), drafter_replays * drafter_drains), (step, dev.drains)
            for piece, out in zip(target + drafter * DRAFTS, outs):
                assert not step or torch.equal(out, torch.tanh(piece.x @ piece.w)), step  # a capture runs nothing
        assert dev.idle()
    replays = PIECES * (3 + 4 * DRAFTS - 1)
    ran = 3 * target_drains + (4 * DRAFTS - 1) * drafter_drains
    counted = graph_replay.DRAINS["once"] - once, graph_replay.DRAINS["skipped"] - skipped
    assert counted == ((3 if target_drains == 1 else 0, replays - ran) if async_scheduling else (0, 0))


@pytest.mark.parametrize(
    "patched,async_scheduling,drains",
    [
        ("release", True, 3),
        ("default", True, 3),  # the release's drain before every FULL replay
        # FULL, ordered on the device (opt-in): the first replay's drain becomes a boundary; the later ones follow a
        # replay no update came after (this graph holds no task group), so they drain as released
        ("full-ordering", True, 2),
        ("every-opt-in", True, 2),
        ("full-ordering", False, 3),
    ],
    indirect=["patched"],
)
def test_host_drain_before_full_replay(env, graph_state, patched, async_scheduling, drains):
    from vllm.config import CUDAGraphMode
    from vllm_ascend.compilation.acl_graph import ACLGraphWrapper

    vc, _ = _runner(env, async_scheduling=async_scheduling)
    piece = Piece()
    replaced = graph_replay.DRAINS["replaced"]
    with G.activate() as dev:
        wrapper = ACLGraphWrapper(piece, vc, runtime_mode=CUDAGraphMode.FULL)
        gen = torch.Generator().manual_seed(2)
        for step in range(4):
            piece.x.copy_(torch.randn(T, 8, generator=gen))
            with _step(vc, "FULL"):
                out = wrapper()
            if step:  # the first call captured; the others replay
                assert torch.allclose(out, torch.tanh(piece.x @ piece.w)), step
        assert len(_host_drains(dev)) == drains, dev.drains
        assert graph_replay.DRAINS["replaced"] - replaced == 3 - drains
        assert dev.idle()


# --------------------------------------------------------------------------------------------------------
# FULL_DECODE_ONLY
# --------------------------------------------------------------------------------------------------------


class TwoAttentionLayers:
    """Two attention layers of the release's AscendAttentionBackendImpl with a plain-torch op between them (the
    second layer's query is derived from the first layer's output), on static buffers and a paged KV cache."""

    def __init__(self, vc):
        from vllm.config import set_current_vllm_config
        from vllm_ascend.attention.attention_v1 import AscendAttentionBackendImpl

        gen = torch.Generator().manual_seed(3)
        bf16 = torch.bfloat16
        with set_current_vllm_config(vc):
            self.impls = [
                AscendAttentionBackendImpl(N, D, D**-0.5, KVN, None, None, "auto", None, "decoder", None)
                for _ in LAYERS
            ]
        for impl in self.impls:
            impl.key_cache = torch.randn(BLOCKS, BS, KVN, D, generator=gen).to(bf16)
            impl.value_cache = torch.randn(BLOCKS, BS, KVN, D, generator=gen).to(bf16)
        self.query = torch.randn(T, N, D, generator=gen).to(bf16)
        self.bias = torch.randn(T, N, D, generator=gen).to(bf16)
        self.q1 = torch.zeros(T, N, D, dtype=bf16)
        self.outputs = [torch.zeros(T, N, D, dtype=bf16) for _ in LAYERS]

    def __call__(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        from vllm.forward_context import get_forward_context

        metadata = get_forward_context().attn_metadata
        queries = (self.query, self.q1)
        for i, (name, impl) in enumerate(zip(LAYERS, self.impls)):
            if i:
                self.q1.copy_(self.outputs[0] * 0.5 + self.bias)
            impl.forward_fused_infer_attention(queries[i], queries[i], queries[i], metadata[name], self.outputs[i])
        return self.outputs[-1]


def _metadata(kv_lens):
    """The decode metadata of 2 requests x 2 query tokens (one draft each), as the builder hands it to the update."""
    from vllm_ascend.attention.attention_v1 import AscendAttentionState, AscendMetadata

    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    return {
        name: AscendMetadata(
            attn_mask=torch.ones(8, 8, dtype=torch.bool),
            attn_state=AscendAttentionState.DecodeOnly,
            num_actual_tokens=T,
            seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
            seq_lens_list=list(kv_lens),
            actual_seq_lengths_q=[2, 4],
            block_tables=table,
            max_query_len=2,
        )
        for name in LAYERS
    }


CAPTURE_LENS = (2, 2)
STEPS = ((9, 20), (11, 22), (13, 23), (14, 25), (3, 40))


def _forward(runner, positions):
    """The runner's own forward step of this release: replay, then the task-group update (FULL)."""
    if FAMILY == "0.18":
        return runner._model_forward(T, input_ids=None, positions=positions)
    return runner._generate_process_reqs_hidden_states(T, None, positions, None, None, {})


def _captured_full_runner(env, graph_state):
    """A runner whose model is the two layers captured in a FULL graph: (config, runner, model, positions)."""
    from vllm.config import CUDAGraphMode
    from vllm_ascend.compilation.acl_graph import ACLGraphWrapper

    vc, runner = _runner(env)
    model = TwoAttentionLayers(vc)
    runner.model = ACLGraphWrapper(model, vc, runtime_mode=CUDAGraphMode.FULL)
    runner.update_stream = torch.npu.Stream()
    positions = torch.arange(T)
    with _step(vc, "FULL", _metadata(CAPTURE_LENS)):
        runner.model(input_ids=None, positions=positions)  # capture (the wrapper sets capturing itself)
    assert len(graph_state.get_graph_params().handles[T]) == len(LAYERS)
    return vc, runner, model, positions


def _run_full_steps(env, graph_state, dev, *, steps=STEPS):
    """Capture the two layers in a FULL graph, then run ``steps`` through the runner's forward step. Returns the
    model (its static buffers) and each step's graph output (None while the device is behind)."""
    vc, runner, model, positions = _captured_full_runner(env, graph_state)
    outputs = []
    for kv_lens in steps:
        with _step(vc, "FULL", _metadata(kv_lens)):
            _forward(runner, positions)
        outputs.append(model.outputs[-1].clone() if dev.idle() else None)
    return vc, model, outputs


def _eager(vc, model, kv_lens):
    with _step(vc, "NONE", _metadata(kv_lens)):
        return model().clone()


def _assert_each_replay_read_its_own_step(dev, steps=STEPS):
    runs = [(r.replay, r.group.index, r.params_for, r.calls[0].kwargs["actual_seq_lengths_kv"]) for r in dev.group_runs]
    expected = [(s, layer, s, list(steps[s - 1])) for s in range(1, len(steps) + 1) for layer in range(len(LAYERS))]
    assert runs == expected


@pytest.mark.parametrize("patched", ["release", "default", "full-ordering"], indirect=True)
def test_full_steps_read_their_own_host_lists(env, graph_state, patched):
    with G.activate() as dev:
        vc, model, outputs = _run_full_steps(env, graph_state, dev)
        _assert_each_replay_read_its_own_step(dev)
        assert len(_host_drains(dev)) == (0 if patched == "full-ordering" else len(STEPS))
        assert all(out.isfinite().all() and out.abs().sum() > 0 for out in outputs)
        assert not torch.equal(outputs[0], outputs[1]), "each step's lists change the result"
        for kv_lens, out in zip(STEPS, outputs):
            assert torch.equal(out, _eager(vc, model, kv_lens)), kv_lens


SCHEDULES = ["issue-order", "side-streams-first", "default-stream-first", "random:1", "random:2"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_full_drain_keeps_a_host_that_runs_ahead_exact(env, graph_state, schedule):
    """The host queues every step without waiting (the device is behind); the release's drain before each replay is
    the only host block: every replay still reads its own step's lists."""
    with G.activate(run_ahead=True, schedule=schedule) as dev:
        vc, model, _ = _run_full_steps(env, graph_state, dev)
        torch.npu.synchronize()
        _assert_each_replay_read_its_own_step(dev)
        assert torch.equal(model.outputs[-1].clone(), _eager(vc, model, STEPS[-1]))


@contextlib.contextmanager
def _without_the_drain(acl_graph):
    """The release's __call__ with both of its host drains doing nothing, in every mode, and nothing in their place."""
    real = acl_graph.__dict__["torch"]
    acl_graph.torch = graph_replay.NoDrainTorch(real)
    try:
        yield
    finally:
        acl_graph.torch = real


def test_without_the_full_drain_a_later_update_overtakes_a_replay(env, graph_state):
    """vllm-ascend #4233's hazard, reproduced: drain removed, host ahead of the device, update stream idle (runs its
    tasks at once): step 2's update rewrites the task group before step 1's replay reached it."""
    with G.activate(run_ahead=True, schedule="side-streams-first") as dev, _without_the_drain(graph_state):
        _run_full_steps(env, graph_state, dev, steps=STEPS[:2])
        assert _host_drains(dev) == [] and dev.executed == []
        with pytest.raises(
            G.StaleTaskGroup, match=r"task group 0 of graph \d+ .* ran in replay 1 .* issued for replay 2"
        ):
            torch.npu.synchronize()


def test_without_the_full_drain_a_lost_record_hangs_the_device(env, graph_state):
    """The same race without the stale check: step 1's replay runs with step 2's lists, then its reset clears the
    record step 2's replay waits for -- the device hang #4233 reports."""
    with (
        G.activate(run_ahead=True, schedule="side-streams-first", check_stale=False) as dev,
        _without_the_drain(graph_state),
    ):
        _run_full_steps(env, graph_state, dev, steps=STEPS[:2])
        with pytest.raises(G.DeviceHang, match=r"waits at ext\d+\.wait, before task group 0 of graph"):
            torch.npu.synchronize()
        assert [(r.replay, r.params_for) for r in dev.group_runs][:1] == [(1, 2)]


def test_without_the_full_drain_an_orderly_device_hides_the_race(env, graph_state):
    """Why the race needs a host ahead of the device: when the device keeps up, the same code without the drain
    runs every replay with its own lists -- a test that does not run the host ahead cannot see the hazard."""
    with G.activate() as dev, _without_the_drain(graph_state):
        _run_full_steps(env, graph_state, dev)
        _assert_each_replay_read_its_own_step(dev)


@pytest.mark.parametrize("patched", ["full-ordering"], indirect=True)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_full_ordering_on_the_device_keeps_a_host_that_runs_ahead_exact(env, graph_state, patched, schedule):
    """full-replay-ordered-on-device: no host drain before a FULL replay; each update waits on its stream for the
    boundary recorded where the drain was. The race of the two tests above, same host and schedules: every replay
    runs with its own step's lists and no record is lost."""
    with G.activate(run_ahead=True, schedule=schedule) as dev:
        replaced = graph_replay.DRAINS["replaced"]
        vc, model, outputs = _run_full_steps(env, graph_state, dev)
        assert _host_drains(dev) == [] and graph_replay.DRAINS["replaced"] - replaced == len(STEPS)
        assert outputs == [None] * len(STEPS), "the host ran ahead of the device at every step"
        torch.npu.synchronize()
        _assert_each_replay_read_its_own_step(dev)
        assert torch.equal(model.outputs[-1].clone(), _eager(vc, model, STEPS[-1]))


@pytest.fixture
def ordering_without_waits(monkeypatch):
    """Planted mistake: the boundary is recorded and the update counted, the update stream never waits for it."""

    def before_update(cls, update_stream):
        cls.replays_without_update = 0

    monkeypatch.setattr(graph_replay.FullOrdering, "before_update", classmethod(before_update))


@pytest.mark.parametrize("patched", ["full-ordering"], indirect=True)
def test_a_boundary_nobody_waits_for_lets_the_update_overtake(env, graph_state, patched, ordering_without_waits):
    """What the stream wait does: without it, the patched path reproduces failure 1."""
    with G.activate(run_ahead=True, schedule="side-streams-first") as dev:
        _run_full_steps(env, graph_state, dev, steps=STEPS[:2])
        assert _host_drains(dev) == []
        with pytest.raises(G.StaleTaskGroup, match=r"ran in replay 1 .* issued for replay 2"):
            torch.npu.synchronize()


@pytest.mark.parametrize("patched", ["full-ordering"], indirect=True)
def test_a_replay_without_its_update_drains_the_next_one(env, graph_state, patched):
    """A FULL replay no update came after (the MTP drafter's k replays per update): the next replay drains as
    released, and the pairing resumes after the next update."""
    with G.activate(run_ahead=True, schedule="side-streams-first") as dev:
        vc, runner, _, positions = _captured_full_runner(env, graph_state)
        kept, replaced = graph_replay.DRAINS["kept"], graph_replay.DRAINS["replaced"]
        with _step(vc, "FULL", _metadata(STEPS[0])):
            _forward(runner, positions)  # replay + update: boundary
        drains_before = len(_host_drains(dev))
        with _step(vc, "FULL", _metadata(STEPS[1])):
            runner.model(input_ids=None, positions=positions)  # replay, no update: boundary
        assert graph_replay.DRAINS["replaced"] - replaced == 2 and len(_host_drains(dev)) == drains_before
        with _step(vc, "FULL", _metadata(STEPS[1])), pytest.raises(G.DeviceHang):
            _forward(runner, positions)  # follows a replay without update: the release's drain, which hangs here
        assert graph_replay.DRAINS["kept"] - kept == 1 and len(_host_drains(dev)) == drains_before + 1


# --------------------------------------------------------------------------------------------------------
# The engine self-test's counters (zb_patch.check.engine.child.count_graph_work) on the release's own wrapper
# --------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _graph_work_counted():
    """The engine child's counters of ACL graph work installed for one block (its ``report``); every name they wrap
    (the release's ``ACLGraphWrapper.__call__``, the double's ``NPUGraph.replay``, the update entry points' bindings)
    is restored after it, before the ``patched`` fixture unpatches."""
    from vllm_ascend.compilation import acl_graph

    from zb_patch.check.engine import child

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(acl_graph.ACLGraphWrapper, "__call__", acl_graph.ACLGraphWrapper.__dict__["__call__"])
        mp.setattr(G.NPUGraph, "replay", G.NPUGraph.__dict__["replay"])
        for name in child.TASK_GROUP_UPDATES:
            for module_name, module in list(sys.modules.items()):
                if module_name.startswith("vllm_ascend.") and name in getattr(module, "__dict__", {}):
                    mp.setattr(module, name, module.__dict__[name])
        yield child.count_graph_work()


@pytest.mark.parametrize(
    "patched,drains",
    [
        ("release", {}),
        ("default", {"once": 3, "skipped": PIECES * (3 + 4 * DRAFTS - 1) - 3}),
        ("no-drain", {"skipped": PIECES * (3 + 4 * DRAFTS - 1)}),
    ],
    indirect=["patched"],
)
def test_the_engine_child_counts_piecewise_replays_and_drains(env, graph_state, patched, drains):
    """The child's counters on the release's ACLGraphWrapper (async + EAGLE, PIECEWISE): every piece replay, the
    target's and the drafter's, counted under PIECEWISE; the drains as the patch decided (``DRAINS``, copied); no
    update; and no host drain of their own (the device's drains are the release's / the patch's, as uncounted)."""
    from vllm.config import CUDAGraphMode
    from vllm_ascend.compilation.acl_graph import ACLGraphWrapper

    vc, _ = _runner(env)
    target, drafter = [Piece(seed) for seed in range(PIECES)], [Piece(10 + seed) for seed in range(PIECES)]
    with G.activate() as dev, _graph_work_counted() as report:
        wrap = [ACLGraphWrapper(p, vc, runtime_mode=CUDAGraphMode.PIECEWISE) for p in target + drafter]
        for _ in range(4):  # step 0 captures every piece (its first drafter forward too), then replays
            with _step(vc, "PIECEWISE"):
                [w() for w in wrap[:PIECES]]
            for _ in range(DRAFTS):
                with _step(vc, "PIECEWISE", drafter=True):
                    [w() for w in wrap[PIECES:]]
        replays = PIECES * (3 + 4 * DRAFTS - 1)
        assert sum(e.aclgraph.replays for w in wrap for e in w.concrete_aclgraph_entries.values()) == replays
        assert report() == {"graph_replays": {"PIECEWISE": replays}, "host_drains": drains, "task_group_updates": {}}
        released = {"release": replays, "default": 3, "no-drain": 0}[patched]
        assert len(_host_drains(dev)) == released and len(dev.drains) == released, dev.drains


@pytest.mark.parametrize(
    "patched,drains",
    [("release", {}), ("default", {}), ("full-ordering", {"replaced": len(STEPS)})],
    indirect=["patched"],
)
def test_the_engine_child_counts_full_replays_and_task_group_updates(env, graph_state, patched, drains):
    """FULL_DECODE_ONLY through the runner's own forward step (replay, then the update through the runner's binding of
    the release's entry point): one FULL replay and one task-group update per step; with full-replay-ordered-on-device
    every drain replaced by a boundary -- the counters' wrappers leave the patch in effect (no host drain) and every
    replay still reads its own step's lists."""
    name = "update_full_graph_params" if FAMILY == "0.18" else "update_attn_params"
    with G.activate() as dev, _graph_work_counted() as report:
        _run_full_steps(env, graph_state, dev)
        assert report() == {
            "graph_replays": {"FULL": len(STEPS)},
            "host_drains": drains,
            "task_group_updates": {name: len(STEPS)},
        }
        assert len(_host_drains(dev)) == (0 if patched == "full-ordering" else len(STEPS))
        _assert_each_replay_read_its_own_step(dev)
