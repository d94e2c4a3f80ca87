"""vllm-ascend 0.13.0's part of the runner-parity harness (:mod:`runner_harness`): the mirror of its
``execute_model`` up to the forward.

0.13's ``NPUModelRunner._prepare_inputs(scheduler_output, intermediate_tensors)`` is **monolithic** and runs for
real, end to end: positions, slot mapping, seq_lens, input ids (host gather + the device scatter of last step's
sampled and draft tokens), discard indices, DP sync (a world of one), ACL-graph dispatch, spec-decode metadata **and
the per-KV-group attention-metadata loop** that builds ``AscendCommonAttentionMetadata``. Only the attention
*builder* is replaced (:class:`RecordingBuilder`): it records the common metadata the release hands it at
``builder.build`` time -- the CPU ``seq_lens_cpu`` (what Ascend FIA / paged attention reads),
``num_computed_tokens_cpu``, the slot mapping, the block table -- and the fake model reads those. The release calls
``_init_model_kwargs`` once the step's positions / seq_lens / slot mapping / input ids are queued and before it
builds the attention metadata: from there on the driver is in phase ``prepare_inputs:after``. There is no
``synchronize_input_prep`` in the release; the padded drafter's ``prepare_next_token_ids_padded`` reads the
backup index from the common metadata's ``seq_lens_cpu``.

With the MLA target (``method="mtp"``, :mod:`mla_harness`) the builder is the release's real
``AscendMLAMetadataBuilder`` (wrapped to record what it is handed and what it builds); the runner runs as in an
engine with FULL_DECODE_ONLY graphs (its own ``compilation_config`` copy says so, the dispatcher is
:class:`mla_harness.FullDecodeDispatcher`), so the release's metadata loop pads uniform-decode batches itself, and
on a FULL step ``update_mla_attn_params`` runs against :class:`mla_harness.GraphUpdateRecorder`. The drafter is the
release's ``MtpProposer``: ``propose_draft_token_ids`` -> ``_propose`` runs for real, its model replaced by
:class:`DraftModelRecorder`, which records the metadata of every draft step as the model reads it.
"""

from __future__ import annotations

import copy
from typing import Any

import mla_harness as M
import runner_harness as H

from zb_patch.versions.ascend_0_13 import ADAPTER, ZERO_BUBBLE  # noqa: F401  (the release table)

FAMILY = "0.13"
LAYER = "model.layers.0.self_attn.attn"


class RecordingBuilder:
    """Stands in for the Ascend attention metadata builder of the one KV-cache group: records what the release
    hands ``builder.build`` (CPU values as the builder reads them at build time)."""

    def __init__(self) -> None:
        self.calls = 0
        self.last: dict | None = None

    def build(self, common_prefix_len: int, common_attn_metadata: Any, **kwargs: Any) -> Any:
        cm = common_attn_metadata
        n = cm.num_reqs
        self.calls += 1
        self.last = dict(
            num_reqs=n,
            seq_lens_cpu=[int(x) for x in cm.seq_lens_cpu[:n]],
            num_computed_cpu=[int(x) for x in cm.num_computed_tokens_cpu[:n]],
            seq_lens_gpu=[int(x) for x in cm.seq_lens[:n]],
            metadata=cm,
        )
        return ("zb-runner013-attn", self.calls)


class _AttnGroup:
    def __init__(self, builder: Any, layer_names: list[str]) -> None:
        self.builder = builder
        self.layer_names = layer_names

    def get_metadata_builder(self, ubatch_id: int = 0) -> RecordingBuilder:
        return self.builder


class Driver(H.Driver):
    """UNFILLED drafts: vLLM 0.13's async scheduler can schedule draft placeholders for a request that was not in the
    previous batch (unscheduled for a step, then scheduled again); the runner has no draft ids for it and the host
    gather reads its token table at the draft positions. That table's content there is junk in both modes, and it
    differs: the optimistic placeholders make vLLM 0.13's ``_update_states`` take its output-trimming branch, which
    moves ``num_tokens_no_spec`` (where the async bookkeeping writes its ``-1`` placeholders) to the true length,
    while the classic path leaves it behind. Those input ids are recorded as ``UNFILLED`` (their count is
    reported); every other input id, and everything the junk feeds into (acceptance, tokens), is compared. With the
    adapter's ``stale-draft-placeholders`` fix applied (both runs of :func:`runner_harness.parity` by default) those
    ids are the request's own drafts and are compared too."""

    inputs_queued = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_init_model_kwargs")

    def __init__(self, runner: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(runner, *args, **kwargs)
        self.mla = runner.model_config.use_mla
        self.builder = MLARecordingBuilder(self, runner) if self.mla else RecordingBuilder()
        runner.attn_groups = [[_AttnGroup(self.builder, list(M.TARGET_LAYERS) if self.mla else [LAYER])]]
        if self.mla:
            self._install_mla(runner)

    def prepare_step(self, runner: Any, so: Any) -> H.StepInputs | None:
        with self.in_phase("update_states"):
            runner._update_states(so)
        if not so.total_num_scheduled_tokens:
            return None
        self.builder.last = None
        with self.in_phase("prepare_inputs:release"):
            (
                attn_metadata,
                positions_t,
                _,
                num_input_tokens,
                _,
                padded_tokens,
                _,
                spec_meta,
                input_ids_t,
                _,
                _,
                _,
                _,
                _,
            ) = runner._prepare_inputs(so, None)
        meta = self.builder.last
        if self.mla:
            self._after_prepare_mla(runner, so, attn_metadata, positions_t, num_input_tokens, padded_tokens)
        if meta is None:
            raise AssertionError("the release built no attention metadata")
        n = runner.input_batch.num_reqs
        total = so.total_num_scheduled_tokens
        cm = meta["metadata"]
        # the forward: what the release handed the model and the attention builder
        return H.StepInputs(
            spec_meta=spec_meta,
            query_start_loc=cm.query_start_loc[: n + 1].numpy().copy(),
            # input_ids_t is None where the release hands the model embeddings (multimodal, prompt embeds)
            input_ids=runner.input_ids.gpu[:total].numpy().copy()
            if input_ids_t is None
            else input_ids_t[:total].numpy().copy(),
            positions=positions_t[:total].numpy().copy(),
            slots=cm.slot_mapping[:total].numpy().copy(),
            block_table=cm.block_table_tensor[:n].numpy(),
            seq_lens_cpu=meta["seq_lens_cpu"][:n],
            seq_lens_gpu=meta["seq_lens_gpu"],
            num_computed_cpu=meta["num_computed_cpu"],
        )

    def spec_common_metadata(self, runner: Any) -> Any:
        return runner.spec_decode_common_attn_metadata

    # -- the MLA group (mla_harness) ---------------------------------------------------------------------------
    def _install_mla(self, runner: Any) -> None:
        """What a FULL_DECODE_ONLY engine sets up for a DeepSeek-V3 target with its MTP layer, without a model: the
        runner's own compilation config in FULL_DECODE_ONLY mode (a copy: the session's config is shared), its
        capture sizes, the dispatcher stand-in; the MTP proposer's draft layer and its model recorder."""
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import BatchDescriptor

        runner.compilation_config = copy.copy(runner.compilation_config)
        runner.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
        dispatcher = M.FullDecodeDispatcher(runner.uniform_decode_query_len, runner.max_num_reqs, BatchDescriptor)
        runner.cudagraph_dispatcher = dispatcher
        runner.cudagraph_batch_sizes = [s * dispatcher.q for s in dispatcher.sizes]
        drafter = runner.drafter
        drafter.attn_layer_names = [M.DRAFT_LAYER]
        drafter.model = DraftModelRecorder(self, runner.model_config.get_vocab_size())
        if not hasattr(runner, "model"):  # the proposer hands the builder runner.get_model() (unused by MLA)
            import torch

            runner.model = torch.nn.Module()
        M.triton_core_counts()
        self.graph_updates = M.GraphUpdateRecorder("npu_fused_infer_attention_score", 16)
        self._attn_metadata: Any = None

    def _after_prepare_mla(
        self, runner: Any, so: Any, attn_metadata: Any, positions: Any, num_input_tokens: int, padded_tokens: int
    ) -> None:
        """Records the target's metadata; then execute_model's dispatch and, on a FULL step, the forward's parameter
        update (``_generate_process_reqs_hidden_states`` -> ``update_mla_attn_params``)."""
        import torch
        import vllm_ascend.compilation.acl_graph as acl_graph
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import get_forward_context
        from vllm_ascend.ascend_forward_context import set_ascend_forward_context

        metas = {id(attn_metadata[layer]) for layer in M.TARGET_LAYERS}
        assert len(metas) == 1 and set(attn_metadata) == set(M.TARGET_LAYERS), sorted(attn_metadata)
        self._attn_metadata = attn_metadata
        record: dict[str, Any] = {"target": M.flatten(attn_metadata[M.TARGET_LAYERS[0]])}
        n = runner.input_batch.num_reqs
        max_q = max(so.num_scheduled_tokens.values())
        uniform = max_q == runner.uniform_decode_query_len and so.total_num_scheduled_tokens == n * max_q
        mode, desc = runner.cudagraph_dispatcher.dispatch(num_tokens=num_input_tokens, uniform_decode=uniform)
        if mode == CUDAGraphMode.FULL:
            graph_params = self.graph_updates.graph_params(padded_tokens, list(attn_metadata))
            self.graph_updates.calls = []
            saved = acl_graph.get_graph_params
            acl_graph.get_graph_params = lambda: graph_params
            try:
                with (
                    set_ascend_forward_context(
                        attn_metadata,
                        runner.vllm_config,
                        num_tokens=desc.num_tokens,
                        aclgraph_runtime_mode=mode,
                        batch_descriptor=desc,
                    ),
                    self.graph_updates.recording(),
                ):
                    acl_graph.update_mla_attn_params(
                        torch.npu.current_stream(),  # runner.update_stream exists once graphs are captured
                        get_forward_context(),
                        padded_tokens,
                        runner.speculative_config,
                    )
            finally:
                acl_graph.get_graph_params = saved
            record["graph_update"] = list(self.graph_updates.calls)
        self.mla_records[self.step] = record

    def run_drafter(self, runner: Any, st: H.StepState, sampler_output: Any) -> tuple[Any, Any]:
        """The release's ``propose_draft_token_ids`` (``MtpProposer``): ``prepare_next_token_ids_padded`` (its results
        kept for the fake drafts), the valid counts' copy, ``prepare_inputs_padded``, ``_propose`` with the model
        recorder."""
        if not self.mla:
            return super().run_drafter(runner, st, sampler_output)
        import torch

        drafter = runner.drafter
        prepare = type(drafter).prepare_next_token_ids_padded
        kept: list = []

        def prepare_kept(*args: Any, **kwargs: Any) -> Any:
            kept.append(prepare(drafter, *args, **kwargs))
            return kept[-1]

        drafter.prepare_next_token_ids_padded = prepare_kept
        record = self.mla_records[self.step]
        record["draft"], record["draft_built"] = [], []
        try:
            runner.propose_draft_token_ids(
                sampler_output.sampled_token_ids,
                runner.input_batch.sampling_metadata,
                st.so,
                st.spec_meta,
                runner.positions.gpu[: st.total],
                st.total,
                torch.zeros(st.total, runner.model_config.get_hidden_size()),
                self._attn_metadata,
            )
        finally:
            del drafter.prepare_next_token_ids_padded
        return kept[0]

    def draft_ids_unfilled(self, rid: str, num_drafts: int) -> bool:
        # re-added this step with draft placeholders: the device scatter covers rows of the previous batch only; the
        # adapter's stale-draft-placeholders fix writes the request's own drafts there (compared like any id)
        if "stale-draft-placeholders" in self.applied:
            return False
        return rid not in (self.runner.input_batch.prev_req_id_to_index or {})


class MLARecordingBuilder:
    """The release's ``AscendMLAMetadataBuilder`` (for the target's layers; 0.13's MTP proposer builds its first
    pass with the same builder), recording as :class:`RecordingBuilder` does what it is handed, and the metadata it
    builds while the proposer runs (``draft_built``)."""

    def __init__(self, driver: Driver, runner: Any) -> None:
        from vllm_ascend.attention.mla_v1 import AscendMLAMetadataBuilder

        self.driver = driver
        self.real = M.make_builder(
            AscendMLAMetadataBuilder, runner.vllm_config, runner.kv_cache_config, list(M.TARGET_LAYERS)
        )
        self.calls = 0
        self.last: dict | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def build(self, common_prefix_len: int, common_attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        meta = self.real.build(common_prefix_len, common_attn_metadata, *args, **kwargs)
        if self.driver.phase == "sample":
            self.driver.mla_records[self.driver.step]["draft_built"].append(M.flatten(meta))
            return meta
        cm = common_attn_metadata
        n = cm.num_reqs
        self.calls += 1
        self.last = dict(
            num_reqs=n,
            seq_lens_cpu=[int(x) for x in cm.seq_lens_cpu[:n]],
            num_computed_cpu=[int(x) for x in cm.num_computed_tokens_cpu[:n]],
            seq_lens_gpu=[int(x) for x in cm.seq_lens[:n]],
            metadata=cm,
        )
        return meta


class DraftModelRecorder:
    """Stands in for 0.13's MTP draft model: each call records the draft layer's metadata as the model would read it
    (the forward context's) and the positions it is handed, and returns the hidden states unchanged;
    ``compute_logits`` gives zeros (the drafts come from the fake model)."""

    def __init__(self, driver: Driver, vocab_size: int) -> None:
        self.driver, self.vocab_size = driver, vocab_size

    def __call__(self, input_ids: Any = None, positions: Any = None, hidden_states: Any = None, **kwargs: Any) -> Any:
        from vllm.forward_context import get_forward_context

        flat = M.flatten(get_forward_context().attn_metadata[M.DRAFT_LAYER])
        flat["model.positions"] = tuple(int(p) for p in positions.tolist())
        self.driver.mla_records[self.driver.step]["draft"].append(flat)
        return hidden_states

    def compute_logits(self, hidden_states: Any) -> Any:
        import torch

        return torch.zeros(hidden_states.shape[0], self.vocab_size)
