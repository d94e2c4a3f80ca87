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
"""

from __future__ import annotations

from typing import Any

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
    def __init__(self, builder: RecordingBuilder) -> None:
        self.builder = builder
        self.layer_names = [LAYER]

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
        self.builder = RecordingBuilder()
        runner.attn_groups = [[_AttnGroup(self.builder)]]

    def prepare_step(self, runner: Any, so: Any) -> H.StepInputs | None:
        with self.in_phase("update_states"):
            runner._update_states(so)
        if not so.total_num_scheduled_tokens:
            return None
        self.builder.last = None
        with self.in_phase("prepare_inputs:release"):
            (_, positions_t, _, _, _, _, _, spec_meta, input_ids_t, _, _, _, _, _) = runner._prepare_inputs(so, None)
        meta = self.builder.last
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

    def draft_ids_unfilled(self, rid: str, num_drafts: int) -> bool:
        # re-added this step with draft placeholders: the device scatter covers rows of the previous batch only; the
        # adapter's stale-draft-placeholders fix writes the request's own drafts there (compared like any id)
        if "stale-draft-placeholders" in self.applied:
            return False
        return rid not in (self.runner.input_batch.prev_req_id_to_index or {})
