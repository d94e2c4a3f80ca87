"""mtp-draft-graph-k-replays (ascend-0.18): vllm-ascend 0.18.0's MTP drafter with synchronous scheduling, k = 2,
FULL_DECODE_ONLY, on the CPU graph double (tests/support/npu_graphs.py) in place of torch_npu's graphs, task groups,
external events and streams.

Real: ``NPUModelRunner`` and its ``AscendEagleProposer`` (method ``mtp``) built from a MiMo configuration (vLLM's
``SpeculativeConfig`` makes the MTP draft), the runner's graph-mode resolution (its dispatcher and the draft graph
parameters), the proposer's ``_maybe_share_lm_head`` (where it wraps the MTP module in ``ACLGraphWrapper``), its
``dummy_run`` (the capture, as the runner's capture calls it), ``_propose`` / ``_run_merged_draft`` / the update
(``update_full_graph_params`` -> ``AscendAttentionBackendImpl.update_graph_params``), the dense metadata builder and
``AscendAttentionBackendImpl`` (the FULL capture: external event wait + reset, FIA in a task group; eager FIA). The MTP
module is one attention layer of that impl between two plain-torch projections.

Asserted: the release captures the one-pass MTP graph, replays it k times per proposal and updates it once: the
double stops the first proposal (``StaleTaskGroup``); without its stale check a replay that runs does so with a later
proposal's step-0 lengths and the draft stream waits for a record no proposal issues (``DeviceHang``). With the fix
(ZB_PATCH=1 defaults, synchronous scheduling) the drafter drafts eagerly: nothing captured, no task group, no host
drain, the drafts of the release's own eager proposer (async scheduling) on the same inputs.
``ZB_PATCH_DISABLE=<id>``: the failure again.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
if npu_standin.detect_family() != "0.18":
    pytest.skip("mtp-draft-graph-k-replays is ascend-0.18's", allow_module_level=True)

import torch  # noqa: E402

import npu_graphs as G  # noqa: E402
from zb_patch import registry as R  # noqa: E402
from zb_patch.detect import detect  # noqa: E402
from zb_patch.versions import ascend_0_18  # noqa: E402
from zb_patch.versions.fixes import mtp_draft_graph_k_replays as fix  # noqa: E402

K, REQS = 2, 2
T = REQS * (K + 1)  # a uniform decode batch: the FULL_DECODE_ONLY capture size
LAYER = "model.mtp_layers.0.self_attn.attn"
N, KVN, D, BS, BLOCKS = 2, 1, 16, 16, 8  # heads, kv heads, head size, block size, blocks
TABLE = [[0, 1, 2, 3], [4, 5, 6, 7]]
PROPOSALS = ((9, 20), (11, 22), (13, 23))  # each request's KV length at the proposal


@pytest.fixture(scope="module")
def mtp_config(tiny_eagle_config, tmp_path_factory):
    """A MiMo target drafting with its own MTP layer, k = 2, synchronous scheduling, FULL_DECODE_ONLY graphs (vLLM's
    CPU platform turns graphs off in the config; they are set back as an NPU host has them) with one capture size."""
    from vllm import ModelRegistry
    from vllm.config import CompilationMode, CUDAGraphMode
    from vllm.model_executor.models.mimo import MiMoForCausalLM
    from vllm.model_executor.models.mimo_mtp import MiMoMTP

    from zb_patch.check.engine import model

    # inspected in this process (vLLM would start a subprocess per architecture, without the NPU stand-in)
    ModelRegistry.register_model("MiMoForCausalLM", MiMoForCausalLM)
    ModelRegistry.register_model("MiMoMTPModel", MiMoMTP)
    root = tmp_path_factory.mktemp("tiny-mtp")
    vc = tiny_eagle_config(
        root,
        model=model.write_mtp_model(str(root)),
        async_scheduling=False,
        speculative_config={"method": "mtp", "num_speculative_tokens": K},
    )
    cc = vc.compilation_config
    cc.mode, cc.cudagraph_mode = CompilationMode.VLLM_COMPILE, CUDAGraphMode.FULL_DECODE_ONLY
    cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = [T], T
    return vc


@pytest.fixture
def graph_state(mtp_config, monkeypatch):
    """The graph pool and graph params the release keeps per process, fresh for the test; host tensors pageable
    (the builder pins unconditionally); the attention-backend cache and the release's AttentionMaskBuilder singleton
    left as found (the runner's constructor asks vLLM's CPU platform for a backend; the builder's masks, made here in
    inference mode, would be inference tensors in the process's later tests)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention import selector
    from vllm_ascend.attention import attention_mask
    from vllm_ascend.compilation import acl_graph

    for platform in {type(current_platform), type(acl_graph.current_platform)}:
        monkeypatch.setattr(platform, "_global_graph_pool", G.GraphPool(), raising=False)
    monkeypatch.setattr(acl_graph, "_graph_params", None)
    monkeypatch.setattr(acl_graph, "_draft_graph_params", None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args, **kwargs: self)
    get_instance = attention_mask.AttentionMaskBuilder  # vllm_ascend.utils.singleton's closure over its instances
    instances = dict(zip(get_instance.__code__.co_freevars, get_instance.__closure__))["instances"].cell_contents
    saved = dict(instances)
    instances.clear()
    selector._cached_get_attn_backend.cache_clear()
    yield acl_graph
    selector._cached_get_attn_backend.cache_clear()
    instances.clear()
    instances.update(saved)
    mtp_config.scheduler_config.async_scheduling = False


@pytest.fixture
def patched(request):
    """``release``: nothing applied; ``fixed``: the adapter's defaults (ZB_PATCH=1); ``disabled``: the defaults with
    ``ZB_PATCH_DISABLE=mtp-draft-graph-k-replays``. Unpatched after the test."""
    ps = ascend_0_18.ADAPTER.patch_set
    if request.param != "release":
        report = ps.apply(detect(), disabled=(fix.ID,) if request.param == "disabled" else ())
        assert report.verdict == R.APPLIED, report.reason
        assert report.by_verdict(R.DISABLED if request.param == "disabled" else R.APPLIED).count(fix.ID) == 1
    yield request.param
    ps.unpatch()


class MtpLayer(torch.nn.Module):
    """The MTP module: the release's AscendAttentionBackendImpl (one layer, its own paged KV cache) between two plain
    projections, on static buffers; returns the hidden states (MTP's model returns no tuple)."""

    def __init__(self, vc, hidden: int) -> None:
        from vllm.config import set_current_vllm_config
        from vllm_ascend.attention.attention_v1 import AscendAttentionBackendImpl

        super().__init__()
        gen, bf16 = torch.Generator().manual_seed(3), torch.bfloat16
        with set_current_vllm_config(vc):
            self.impl = AscendAttentionBackendImpl(N, D, D**-0.5, KVN, None, None, "auto", None, "decoder", None)
        self.impl.key_cache = torch.randn(BLOCKS, BS, KVN, D, generator=gen).to(bf16)
        self.impl.value_cache = torch.randn(BLOCKS, BS, KVN, D, generator=gen).to(bf16)
        self.w_in = torch.randn(hidden, N * D, generator=gen) / hidden**0.5
        self.w_out = torch.randn(N * D, hidden, generator=gen) / (N * D) ** 0.5
        self.lm_head = torch.randn(hidden, 256, generator=gen)
        self.query, self.attn_out = torch.zeros(T, N, D, dtype=bf16), torch.zeros(T, N, D, dtype=bf16)
        self.hidden = torch.zeros(T, hidden)

    def forward(self, input_ids=None, positions=None, hidden_states=None, inputs_embeds=None, **kwargs):
        from vllm.forward_context import get_forward_context

        t = input_ids.shape[0]
        metadata = get_forward_context().attn_metadata
        self.query[:t].copy_((hidden_states @ self.w_in).view(t, N, D).to(torch.bfloat16))
        q = self.query[:t]
        if metadata is None:  # a dummy run without metadata (eager): the impl's forward leaves zeros
            self.attn_out[:t].zero_()
        else:
            self.impl.forward_fused_infer_attention(q, q, q, metadata[LAYER], self.attn_out[:t])
        self.hidden[:t].copy_(self.attn_out[:t].view(t, -1).float() @ self.w_out)
        return self.hidden[:t]

    def compute_logits(self, hidden_states):
        return hidden_states @ self.lm_head


def _drafter(vc):
    """A runner and its MTP proposer as ``initialize_kv_cache`` / ``load_model`` / ``capture_model`` leave them: the
    graph mode resolved (dispatcher, draft graph parameters), the draft attention group (the release's dense backend
    and builder), the MTP module handed to ``_maybe_share_lm_head`` (which wraps it where the release captures it), then
    the drafter's capture (``dummy_run`` in FULL, as the runner's capture calls it)."""
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.forward_context import BatchDescriptor
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.worker.utils import AttentionGroup
    from vllm_ascend.attention.attention_v1 import AscendAttentionBackend, AscendAttentionMetadataBuilder
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=KVN, head_size=D, dtype=torch.bfloat16)
    with set_current_vllm_config(vc):
        runner = NPUModelRunner(vc, torch.device("cpu"))
        runner._check_and_update_cudagraph_mode([{AscendAttentionBackend}], [KVCacheGroupSpec([LAYER], spec)])
        drafter = runner.drafter
        builder = AscendAttentionMetadataBuilder(spec, [LAYER], vc, torch.device("cpu"))
        drafter.draft_attn_groups = [AttentionGroup(AscendAttentionBackend, [LAYER], spec, 0, [builder])]
        runner.attn_groups = [drafter.draft_attn_groups]
        drafter.attn_layer_names, drafter.kernel_block_size = [LAYER], BS
        runner.model = torch.nn.Module()  # the target (the builder is handed runner.get_model(); unused)
        drafter.model = MtpLayer(vc, drafter.hidden_states.shape[1])
        drafter._maybe_share_lm_head(runner.model)
        _batch(runner, PROPOSALS[0])
        drafter.dummy_run(
            num_tokens=T,
            num_reqs=REQS,
            aclgraph_runtime_mode=CUDAGraphMode.FULL,
            batch_descriptor=BatchDescriptor(num_tokens=T, num_reqs=REQS, uniform=True),
            in_graph_capturing=True,
        )
    return runner, drafter


def _batch(runner, kv_lens):
    """The runner's buffers for a decode batch of REQS requests x (1 + k) tokens with these KV lengths."""
    runner.query_start_loc.cpu[: REQS + 1] = torch.arange(0, T + 1, K + 1)
    runner.query_start_loc.copy_to_gpu()
    runner.seq_lens.cpu[:REQS] = torch.tensor(kv_lens)
    runner.seq_lens.copy_to_gpu()
    runner.input_batch.block_table[0].block_table.gpu[:REQS, : len(TABLE[0])] = torch.tensor(TABLE)


def _propose(vc, runner, drafter, kv_lens, seed):
    """One proposal through the release's ``_propose`` after a verified decode step: the target's k + 1 tokens per
    request, their hidden states and the common metadata the runner hands the proposer; in inference mode, as the
    worker runs the step."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import BatchDescriptor
    from vllm_ascend.attention.attention_v1 import AscendAttentionState
    from vllm_ascend.attention.utils import AscendCommonAttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    _batch(runner, kv_lens)
    rows = [r for r in range(REQS) for _ in range(K + 1)]
    positions = torch.tensor([kv_lens[r] - (K + 1) + i for r in range(REQS) for i in range(K + 1)])
    slots = torch.tensor([TABLE[r][p // BS] * BS + p % BS for r, p in zip(rows, positions.tolist())], dtype=torch.int32)
    common = AscendCommonAttentionMetadata(
        query_start_loc=runner.query_start_loc.gpu[: REQS + 1],
        query_start_loc_cpu=runner.query_start_loc.cpu[: REQS + 1],
        seq_lens_cpu=runner.seq_lens.cpu[:REQS],
        seq_lens=runner.seq_lens.gpu[:REQS],
        num_reqs=REQS,
        num_actual_tokens=T,
        num_input_tokens=T,
        max_query_len=K + 1,
        num_computed_tokens_cpu=torch.tensor(kv_lens) - (K + 1),
        actual_seq_lengths_q=list(range(K + 1, T + 1, K + 1)),
        block_table_tensor=runner.input_batch.block_table[0].block_table.gpu[:REQS],
        slot_mapping=slots,
        positions=positions,
        attn_state=AscendAttentionState.SpecDecoding,
        decode_token_per_req=K + 1,
        max_seq_len=max(kv_lens),
    )
    with set_current_vllm_config(vc), torch.inference_mode():
        return drafter._propose(
            target_token_ids=torch.randint(0, 256, (T,), generator=gen, dtype=torch.int32),
            target_positions=positions,
            target_hidden_states=torch.randn(T, drafter.hidden_states.shape[1], generator=gen),
            next_token_ids=torch.randint(0, 256, (REQS,), generator=gen, dtype=torch.int32),
            token_indices_to_sample=None,
            common_attn_metadata=common,
            target_model_batch_desc=BatchDescriptor(num_tokens=T, num_reqs=REQS, uniform=True),
            sampling_metadata=None,
        )


def _draft_graph(drafter):
    """The NPUGraph the release captured for the MTP module (its one FULL entry)."""
    from vllm_ascend.compilation.acl_graph import ACLGraphWrapper

    assert isinstance(drafter.model, ACLGraphWrapper) and drafter.use_cuda_graph
    (entry,) = drafter.model.concrete_aclgraph_entries.values()
    return entry.aclgraph


@pytest.mark.parametrize("patched", ["release", "disabled"], indirect=True)
def test_the_release_replays_the_mtp_graph_k_times_per_update(mtp_config, graph_state, patched):
    """Synchronous scheduling, k = 2: the release captures the one-pass MTP graph (one task group, one external event
    wait) and its first proposal replays it twice with one update and one record: the double stops it."""
    with G.activate():
        runner, drafter = _drafter(mtp_config)
        graph = _draft_graph(drafter)
        assert len(graph_state.get_draft_graph_params().events[T]) == 1  # one layer: one wait per replay
        with pytest.raises(
            G.StaleTaskGroup,
            match=rf"task group 0 of graph {graph.id} .*full_graph_fia.* ran in replay \d+ of graph {graph.id} with "
            r"the parameters issued for replay \d+",
        ):
            _propose(mtp_config, runner, drafter, PROPOSALS[0], seed=0)


@pytest.mark.parametrize("patched", ["release"], indirect=True)
def test_without_the_stale_check_every_replay_runs_with_step_0s_lengths_and_the_drafter_waits(
    mtp_config, graph_state, patched
):
    """The same without the stale check: each proposal queues k replays and one update (draft step 0's KV lengths) with
    one record. A replay that runs does so with a later proposal's step-0 lengths (never a draft step 1's, which
    attends one more entry), one replay per proposal runs, and the draft stream ends waiting for a record no proposal
    issues (on an NPU: until the next proposal's)."""
    with G.activate(check_stale=False) as dev:
        runner, drafter = _drafter(mtp_config)
        graph = _draft_graph(drafter)
        captured = graph.replays  # the capture's own draft loop replays what it just captured
        for seed, kv_lens in enumerate(PROPOSALS):
            _propose(mtp_config, runner, drafter, kv_lens, seed)
        assert graph.replays - captured == K * len(PROPOSALS)
        # one record per proposal releases one waiting replay, which runs with that proposal's update (its step-0
        # lengths): the capture's loop replay with proposal 1's, proposal 1's first pass with proposal 2's, ...; the
        # other replays still wait
        runs = [(r.replay, r.params_for, r.calls[0].kwargs["actual_seq_lengths_kv"]) for r in dev.group_runs]
        assert runs == [(p + 1, captured + K * (p + 1), list(kv)) for p, kv in enumerate(PROPOSALS)], runs
        with pytest.raises(G.DeviceHang, match=r"ext\d+\.wait"):
            torch.npu.synchronize()


@pytest.mark.parametrize("patched", ["fixed"], indirect=True)
def test_with_the_fix_sync_mtp_drafts_eagerly_as_the_release_does_under_async(mtp_config, graph_state, patched):
    """ZB_PATCH=1, synchronous scheduling (zero-bubble inactive): the proposer drafts eagerly -- the capture captures
    nothing, no task group runs, no host drain -- and its drafts are those of the release's own proposer under async
    scheduling (where the release drafts MTP eagerly; the fix changes nothing there) on the same inputs."""
    from vllm.config import CUDAGraphMode

    with G.activate() as dev:
        runner, drafter = _drafter(mtp_config)
        assert not drafter.use_cuda_graph and isinstance(drafter.model, MtpLayer)
        assert graph_state.get_draft_graph_params().handles[T] == [] and dev.idle()
        fixed = [_propose(mtp_config, runner, drafter, kv_lens, seed) for seed, kv_lens in enumerate(PROPOSALS)]
        assert dev.group_runs == [] and dev.drains == [] and dev.idle()
    assert runner.cudagraph_dispatcher.dispatch(num_tokens=T, uniform_decode=True, has_lora=False)[0] == (
        CUDAGraphMode.FULL
    ), "the target's FULL graphs are left as they are"

    mtp_config.scheduler_config.async_scheduling = True
    graph_state._graph_params = graph_state._draft_graph_params = None  # a fresh process's
    with G.activate():
        runner, drafter = _drafter(mtp_config)
        assert not drafter.use_cuda_graph  # the release's own decision under async scheduling
        eager = [_propose(mtp_config, runner, drafter, kv_lens, seed) for seed, kv_lens in enumerate(PROPOSALS)]
    for got, want in zip(fixed, eager):
        assert got.shape == (REQS, K) and torch.equal(got, want)
    assert len({tuple(d.flatten().tolist()) for d in fixed}) > 1, "the drafts depend on the inputs"


def _decide(method="mtp", k=2, parallel=False, graphs=True, mode="FULL_DECODE_ONLY", sp=False):
    """The wrapper around a stand-in for the release's body, which sets what the release's __init__ sets; returns the
    proposer's use_cuda_graph and maybe_eager_context after it."""
    from vllm.config import CUDAGraphMode

    def released(proposer, vllm_config, *args, **kwargs):
        proposer.method, proposer.num_speculative_tokens, proposer.parallel_drafting = method, k, parallel
        proposer.use_cuda_graph, proposer.maybe_eager_context = graphs, "nullcontext"

    released.__module__ = "vllm_ascend.spec_decode.eagle_proposer"
    vc = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=getattr(CUDAGraphMode, mode)))
    proposer = SimpleNamespace()
    release = pytest.importorskip("vllm_ascend.spec_decode.eagle_proposer")
    with pytest.MonkeyPatch.context() as mp:
        # each called with the proposer's own config
        mp.setattr(release, "enable_sp", lambda config: config is vc and sp)
        mp.setattr(release, "_maybe_eager_context", lambda config: ("eager context", config is vc))
        fix.make_init(released)(proposer, vc, "device")
    return proposer.use_cuda_graph, proposer.maybe_eager_context


def test_only_sync_mtp_with_k_draft_passes_in_a_full_graph_is_changed():
    assert _decide() == (False, "nullcontext")
    assert _decide(sp=True)[1] == ("eager context", True)  # as the release sets it for a proposer without graphs
    assert _decide(mode="FULL_AND_PIECEWISE")[0] is False
    for unchanged in (
        dict(k=1),  # one replay per update
        dict(parallel=True),  # one draft pass per proposal
        dict(method="eagle"),  # its merged graph: one replay per update
        dict(graphs=False),  # async scheduling, enforce_eager, disable_padded_drafter_batch: the release drafts eagerly
        dict(mode="PIECEWISE"),  # no FULL draft graph, no task group
    ):
        assert _decide(**unchanged)[0] is unchanged.get("graphs", True), unchanged
