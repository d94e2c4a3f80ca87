"""Adapter ascend-0.18: vllm-ascend 0.18.0 + vLLM 0.18.x -> zero-bubble async scheduling + EAGLE/MTP spec decode.

Declarations: the zero-bubble specs (:mod:`.zero_bubble_classic`'s, shared with ascend-0.13, plus this release's
input-preparation spec), the fixes (each a factory of :mod:`.fixes` called with this release's fingerprints) and the
guards. The wrappers are :class:`zb_patch.versions.npu_runner.ZeroBubble`'s; this release's one quirk is where the
correction runs: after its split ``_prepare_inputs`` (the attention metadata is built afterwards).
docs/releases/ascend-0.18.md: what is verified and how.
"""

from __future__ import annotations

from ..registry import Guard, Patch, PatchSet
from . import npu_runner, zero_bubble_classic
from .adapter import ASCEND_RANGES, NATIVE_HERE, STILL_HOLDS, Adapter, Form, FormDecision
from .fixes import (
    async_penalty_output_tokens,
    cudagraph_batch_sizes_after_rounding,
    draft_placeholders_after_metadata,
    draft_sample_indices_past_batch,
    draft_seq_lens_max_model_len,
    exact_counts_after_early_output,
    graph_replay,
    mla_draft_rope_rows,
    mtp_draft_graph_k_replays,
    reset_prefix_cache_in_flight,
    stale_draft_placeholders,
)


class ZeroBubble018(npu_runner.ZeroBubble):
    """vllm-ascend 0.18: ``_prepare_inputs`` only prepares the inputs; the correction runs right after it."""

    def make_prepare_inputs(self, original):
        def _prepare_inputs(runner, scheduler_output, num_scheduled_tokens):
            result = original(runner, scheduler_output, num_scheduled_tokens)
            st = self.active(runner)
            if st is not None:
                self.correct(runner, st, num_scheduled_tokens, int(result[2]))  # result: (..., ..., total tokens)
            return result

        return _prepare_inputs


ZERO_BUBBLE = ZeroBubble018("0.18", other_runners="310P / xlite")

_REMOVE_WHEN = (
    "vllm-ascend >= 0.19.1rc1 ships zero-bubble natively (#7640 / #8461) and is served by adapter "
    "ascend-0.19-0.25; this adapter covers vllm-ascend 0.18.x only, so the patch goes with it"
)

# Upstream functions the patches rely on without replacing them (a change in any of them could break an
# assumption the wrappers make), with the fingerprints of the release sources they were read from
# (``zb-patch fingerprints`` recomputes them from any source tree).
GUARDS = (
    Guard(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__",
        {"vllm 0.18.0, 0.18.1": "5153d645b5659849"},
        "creates valid_sampled_token_count_event / copy stream / int64 host buffer (async + spec) and "
        "prepare_inputs_event; positions and seq_lens are CpuGpuBuffers (kept: .gpu exact after the device "
        "correction, seq_lens.cpu exact after the host correction)",
    ),
    Guard(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_valid_sampled_token_count",
        {"vllm 0.18.0, 0.18.1": "20784bf355208845"},
        "the wait itself (event.synchronize + host list); called by zero-bubble after input preparation",
    ),
    Guard(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._make_buffer",
        {"vllm 0.18.0, 0.18.1": "040013a8582667d5"},
        "zero-bubble allocates its pinned staging buffers with it",
    ),
    Guard(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.synchronize_input_prep",
        {"vllm 0.18.0, 0.18.1": "7043b500f869d440"},
        "waits on an event recorded after the previous step's input preparation: staging buffers (zero-bubble's, "
        "the alternating backup-token buffers) are never rewritten while a copy from them is queued",
    ),
    Guard(
        "vllm.v1.worker.gpu_input_batch:InputBatch.update_req_spec_token_ids",
        {"vllm 0.18.0, 0.18.1": "ac4e376692e05ae7"},
        "sets req_state.prev_num_draft_len to the drafts scheduled this step: the optimistic count is drafts + 1",
    ),
    Guard(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_input_ids",
        {"vllm 0.18.0, 0.18.1": "9485308c065f0754"},
        "decode input ids are scattered on the device from last step's sampled / draft tokens, independent "
        "of the (optimistic) CPU positions used for the host gather",
    ),
    Guard(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_positions",
        {"vllm 0.18.0, 0.18.1": "4030980b29de1f18"},
        "reads positions.gpu (device-corrected), not positions.np (optimistic)",
    ),
    Guard(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._init_model_kwargs",
        {"vllm 0.18.0, 0.18.1": "9aff01701dfef106"},
        "reads seq_lens.gpu (device-corrected)",
    ),
    Guard(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._preprocess",
        {"vllm 0.18.0, 0.18.1": "c1c70d453ceb51c9"},
        "reads positions.gpu (device-corrected)",
    ),
    Guard(
        "vllm_ascend.worker.model_runner_v1:NPUModelRunner.__init__",
        {"vllm-ascend 0.18.0": "0f3a79171e3bf24f"},
        "positions / seq_lens / query_start_loc buffers zero-bubble reads and rewrites on the device",
    ),
    Guard(
        "vllm_ascend.worker.model_runner_v1:NPUModelRunner._build_attn_state",
        {"vllm-ascend 0.18.0": "96514ebc0c149e64"},
        "runs inside _prepare_inputs on optimistic counts; its result only depends on counts being zero, which "
        "optimism does not change",
    ),
    Guard(
        "vllm_ascend.worker.model_runner_v1:NPUModelRunner._build_attention_metadata",
        {"vllm-ascend 0.18.0": "590425dd3212fbe8"},
        "reads seq_lens.np / seq_lens.cpu / num_computed_tokens_cpu (host-corrected) and positions.gpu / "
        "slot_mapping.gpu (device-corrected) after _prepare_inputs; hands seq_lens_cpu to the proposer",
    ),
    Guard(
        "vllm_ascend.worker.model_runner_v1:NPUModelRunner.sample_tokens",
        {"vllm-ascend 0.18.0": "f1284b38c8dc9ad2"},
        "bookkeeping before proposing; the padded drafter path copies the valid counts before the drafter",
    ),
    Guard(
        "vllm_ascend.worker.model_runner_v1:NPUModelRunner.propose_draft_token_ids",
        {"vllm-ascend 0.18.0": "08404fc38be7261e"},
        "prepare_next_token_ids_padded, then _copy_valid_sampled_token_count, then the drafter: the event the "
        "host waits on is recorded before the drafter runs",
    ),
    Guard(
        "vllm_ascend.worker.model_runner_v1:NPUModelRunner._bookkeeping_sync",
        {"vllm-ascend 0.18.0": "114f635988a911e6"},
        "prev_req_id_to_index (the rows the corrections are gathered from) excludes discarded rows",
    ),
    Guard(
        "vllm_ascend.worker.model_runner_v1:NPUModelRunner._sample",
        {"vllm-ascend 0.18.0": "294343dec903a9ab"},
        "changes no output_token_ids length (async-penalty-output-tokens writes the sampled ids over placeholders in "
        "place before it): zero-bubble's optimistic -1 tail stays a tail, trimmed by the next _update_states",
    ),
    Guard(
        "vllm.v1.worker.gpu_input_batch:InputBatch.set_async_sampled_token_ids",
        {"vllm 0.18.0": "a06128197f7ba1de"},
        "keeps the async output's host copy of the sampled ids and its event only when the batch needs output ids "
        "(async-penalty-output-tokens)",
    ),
    Guard(
        "vllm.v1.worker.gpu_input_batch:InputBatch.update_async_output_token_ids",
        {"vllm 0.18.0": "8806d04d65401d50"},
        "writes the previous step's sampled ids over a row's first placeholders in place, no more than it holds, "
        "after one wait on the copy's event (async-penalty-output-tokens)",
    ),
    Guard(
        "vllm.v1.worker.gpu_input_batch:InputBatch.update_async_spec_token_ids",
        {"vllm 0.18.0": "2292d5f0553c2eaa"},
        "writes the previous step's drafts, cut to the scheduled count, over a row's draft ids (async-penalty-output-"
        "tokens)",
    ),
    Guard(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._copy_draft_token_ids_to_cpu",
        {"vllm 0.18.0": "efddb04e205029e9"},
        "under async scheduling copies the drafts to the host (and sets _draft_token_req_ids) only when the batch "
        "needs output ids or structured output (async-penalty-output-tokens)",
    ),
    Guard(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_draft_token_ids_cpu",
        {"vllm 0.18.0": "3ae4f9787625e1de"},
        "one wait on draft_token_ids_event, then the host copy of the drafts (async-penalty-output-tokens)",
    ),
    Guard(
        "vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer.prepare_inputs_padded",
        {"vllm-ascend 0.18.0": "bec28bfc8a735b99"},
        "passes the metadata's (exact) seq_lens_cpu through to the draft steps",
    ),
    Guard(
        "vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer._propose",
        {"vllm-ascend 0.18.0": "d468b07a805b3f0d"},
        "FULL-graph pad branch reads runner.seq_lens.gpu / .cpu (both exact after the patches)",
    ),
    Guard(
        "vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer.attn_update_stack_num_spec_norm",
        {"vllm-ascend 0.18.0": "066043ae9710cf9f"},
        "per-draft-step +1 on the (exact) CPU seq_lens of the metadata",
    ),
    Guard(
        "vllm_ascend.worker.model_runner_v1:NPUModelRunner._model_forward",
        {"vllm-ascend 0.18.0": "6b004d8c5e422857"},
        "launches the graph replay first, then updates the FULL graph's task-group parameters (ENPU off): the order "
        "the opt-in full-replay-ordered-on-device keeps on the device (docs/graph-modes.md)",
    ),
    Guard(
        "vllm_ascend.worker.model_runner_v1:NPUModelRunner._update_full_graph_params_if_needed",
        {"vllm-ascend 0.18.0": "8b9170ff5b0e8829"},
        "task-group parameters are updated for FULL replays only: a PIECEWISE piece holds no task group, so a drain "
        "before it orders nothing the update stream does (piecewise-drain-once-per-step)",
    ),
    Guard(
        "vllm_ascend.worker.block_table:BlockTable.__init__",
        {"vllm-ascend 0.18.0": "ccce40b9beff96c6"},
        "the device slot mapping reads block_table, slot_mapping, block_size, physical_block_size, "
        "max_num_batched_tokens, kernel_sizes",
    ),
    Guard(
        "vllm_ascend.worker.block_table:BlockTable.compute_slot_mapping",
        {"vllm-ascend 0.18.0": "ab181c2789fafa53"},
        "the device slot mapping reproduces its non-CP branch (computed only when block_size == "
        "kernel_sizes[0]) from corrected positions",
    ),
    Guard(
        "vllm_ascend.worker.block_table:BlockTable.commit_slot_mapping",
        {"vllm-ascend 0.18.0": "7ecb26d2b557ccfa"},
        "the H2D copy of the host result is queued before the device kernel overwrites it",
    ),
    Guard(
        "vllm_ascend.worker.block_table:MultiGroupBlockTable.compute_slot_mapping",
        {"vllm-ascend 0.18.0": "9b098020be5b986e"},
        "every KV-cache group's table is mapped (zero-bubble walks block_tables the same way)",
    ),
    reset_prefix_cache_in_flight.guard({"vllm 0.18.0, 0.18.1": "7f6efa0565f00bd5"}),
)

PREPARE_INPUTS = Patch(
    id="zb018-device-corrected-inputs",
    rests_on=npu_runner.ZERO_BUBBLE_BACKPORT,
    group="zero-bubble-0.18",
    target="vllm_ascend.worker.model_runner_v1:NPUModelRunner._prepare_inputs",
    make=ZERO_BUBBLE.make_prepare_inputs,
    fingerprints={"vllm-ascend 0.18.0": "72f01a8e67691f0d"},
    why="With optimistic CPU counts the release's CPU positions, seq_lens and slot mapping are too long by the "
    "rejected drafts of the previous step.",
    how="Wrapper. After the release's body: one launch of zb-patch's fused token-count kernel corrects the "
    "device num_computed_tokens from the previous step's device valid counts and rewrites positions.gpu / "
    "seq_lens.gpu; zb-patch's slot-mapping kernel rewrites slot_mapping.gpu of every table the release maps. "
    "Then the host waits for the previous step's counts (valid_sampled_token_count_event, recorded before "
    "that step's drafter: vllm-ascend #10506's wait, chosen over #8461's D2H of seq_lens + event, which waits "
    "for everything queued) and subtracts the rejected drafts from seq_lens.cpu and num_computed_tokens_cpu, "
    "so Ascend attention, max_seq_len, cascade prefix lengths and the proposer's backup index read exact "
    "CPU values.",
    upstream=zero_bubble_classic.UPSTREAM + ("vllm#38556",),
    remove_when=_REMOVE_WHEN,
)

ZERO_BUBBLE_PATCHES = zero_bubble_classic.patches(
    ZERO_BUBBLE,
    fingerprints={
        "_update_states": {"vllm 0.18.0, 0.18.1": "6f40a2feaa48b4bd"},
        "execute_model": {"vllm-ascend 0.18.0": "9eca449f8a01d727"},
        "_copy_valid_sampled_token_count": {"vllm 0.18.0, 0.18.1": "b4e8438fae13f315"},
        "prepare_next_token_ids_padded": {"vllm-ascend 0.18.0": "b04a2a09323e2c31"},
        "initialize_kv_cache": {"vllm-ascend 0.18.0": "f334fd402b19077e"},
    },
    proposer="vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer",
    input_preparation=(PREPARE_INPUTS,),
    remove_when=_REMOVE_WHEN,
)
EXACT_COUNTS = exact_counts_after_early_output.patches(
    {"vllm-ascend 0.18.0": "441bd2275373ce7d"}, {"vllm 0.18.0, 0.18.1": "20784bf355208845"}
)

# ----------------------------------------------------------------------------------------------------------------
# Fixes of the release's own async + speculative-decoding defects (with or without zero-bubble): not in the
# zero-bubble group, applied whenever async scheduling + spec decode is on, each with its own ZB_PATCH_DISABLE id.
# ----------------------------------------------------------------------------------------------------------------

STALE_DRAFT_PLACEHOLDERS, STALE_DRAFT_ROWS = stale_draft_placeholders.patches(
    {"vllm 0.18.0, 0.18.1": "9485308c065f0754"},
    {"vllm 0.18.0, 0.18.1": "2fb92a95cc838fa7"},
    release="Seen with vLLM 0.18's max_model_len clamp, which leaves a request at the limit 0 tokens for a step (its "
    "count is optimistic), at k >= 2, in classic async and with zero-bubble alike (docs/e2e.md): IndexError in the "
    "embedding on CPU, an out-of-bounds gather on a device.",
    not_covered="a runner whose class overrides _prepare_input_ids (310P) or that prepares input ids elsewhere (PCP)",
    also_upstream=("vllm#44734",),
    remove_when="a vLLM release fixes #37159 (none does as of vLLM 0.33.0: gpu_model_runner `if prev_index < 0: "
    "continue`, no clearing of a skipped request's placeholders); this adapter covers vLLM 0.18.x only",
)
DRAFT_LENGTHS_AT_MAX_MODEL_LEN = draft_seq_lens_max_model_len.patch(
    "vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer",
    {"vllm-ascend 0.18.0": "066043ae9710cf9f"},
    remove_when=_REMOVE_WHEN,
)
MLA_DRAFT_ROPE_ROWS = mla_draft_rope_rows.patches(
    proposer="vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer",
    rope_rows={"vllm-ascend 0.18.0": "d2a862ac42765291"},
    propose={"vllm-ascend 0.18.0": "d468b07a805b3f0d"},
    dummy_run={"vllm-ascend 0.18.0": "57dbd331e0623e17"},
    remove_when="a vllm-ascend release gives each draft position RoPE rows of its own (none does as of 0.25.1rc1: "
    "spec_decode/llm_base_proposer.py builds every position first, mla_v1.py still returns views of _cos_mla); this "
    "adapter covers vllm-ascend 0.18.x only, so the patch goes with it",
)
CUDAGRAPH_SIZES_AFTER_ROUNDING = cudagraph_batch_sizes_after_rounding.patch(
    {"vllm-ascend 0.18.0": "5b1da76d6d0eed17"}, remove_when=_REMOVE_WHEN
)
DRAFT_PLACEHOLDERS_AFTER_METADATA = draft_placeholders_after_metadata.patch(
    {"vllm-ascend 0.18.0": "c8889f0865f578a3"},
    release_lines="RecomputeScheduler.add_request, core/recompute_scheduler.py:152; the drafts gathered in "
    "_calc_spec_decode_metadata, model_runner_v1.py:944, the ids embedded in vLLM's _preprocess after "
    "_prepare_inputs (model_runner_v1.py:1294)",
    remove_when=_REMOVE_WHEN,
)
DRAFT_SAMPLE_INDICES = draft_sample_indices_past_batch.patch(
    {"vllm-ascend 0.18.0": "08404fc38be7261e"},
    buffer="token_indices_to_sample",
    release_lines="SpecDecodeBaseProposer._propose, eagle_proposer.py:701-702; read by _run_merged_draft, :809",
    remove_when=_REMOVE_WHEN,
)
PENALTY_OUTPUT_TOKENS = async_penalty_output_tokens.patch(
    {"vllm-ascend 0.18.0": "f1284b38c8dc9ad2"},
    release_lines="sample_tokens / _sample (model_runner_v1.py:1602-1631) lack vLLM's repair "
    "(gpu_model_runner.py:3095, :3104-3106, :4097), also on the v0.18.0 branch head",
    remove_when=_REMOVE_WHEN,
)
MTP_DRAFT_GRAPH_K_REPLAYS = mtp_draft_graph_k_replays.patch(
    {"vllm-ascend 0.18.0": "08ef97ecd47d7788"}, remove_when=_REMOVE_WHEN
)
_ACL_GRAPH_CALL = {"vllm-ascend 0.18.0": "81c9fadfb87529dd"}
PIECEWISE_ONCE_PER_STEP = graph_replay.piecewise_drain_once_per_step(_ACL_GRAPH_CALL)
PIECEWISE_NO_DRAIN = graph_replay.piecewise_replay_without_host_drain(_ACL_GRAPH_CALL)  # opt-in
FULL_ORDERED_ON_DEVICE = graph_replay.full_replay_ordered_on_device(
    "",
    "vllm_ascend.compilation.acl_graph:update_full_graph_params",
    {"vllm-ascend 0.18.0": "3e71b000d42df215"},
    aliases=(
        "vllm_ascend.worker.model_runner_v1:update_full_graph_params",
        "vllm_ascend.spec_decode.eagle_proposer:update_full_graph_params",
        "vllm_ascend.worker.v2.aclgraph_utils:update_full_graph_params",
    ),
    stream_arg=1,
)
RESET_PREFIX_CACHE_IN_FLIGHT = reset_prefix_cache_in_flight.patches(
    {"vllm 0.18.0, 0.18.1": "cc9382f6e9070ec6"},
    {"vllm 0.18.0, 0.18.1": "9526727d6eeb37f5"},
    {"vllm-ascend 0.18.0": "8cddfc0d5a7e9b11"},
    release_lines="flags: vLLM 0.18.x scheduler.py:1853-1859; subtracts: :1339-1355, vllm-ascend 0.18.0 "
    "core/recompute_scheduler.py:867-882; discards: async_scheduler.py:40-44",
    remove_when=_REMOVE_WHEN,
)

PATCHES: tuple = (
    *ZERO_BUBBLE_PATCHES,
    *EXACT_COUNTS,
    STALE_DRAFT_PLACEHOLDERS,
    STALE_DRAFT_ROWS,
    DRAFT_LENGTHS_AT_MAX_MODEL_LEN,
    *MLA_DRAFT_ROPE_ROWS,
    CUDAGRAPH_SIZES_AFTER_ROUNDING,
    DRAFT_SAMPLE_INDICES,
    DRAFT_PLACEHOLDERS_AFTER_METADATA,
    PENALTY_OUTPUT_TOKENS,
    MTP_DRAFT_GRAPH_K_REPLAYS,
    PIECEWISE_ONCE_PER_STEP,
    PIECEWISE_NO_DRAIN,
    FULL_ORDERED_ON_DEVICE,
    *RESET_PREFIX_CACHE_IN_FLIGHT,
)

# ----------------------------------------------------------------------------------------------------------------
# Maintenance-branch commits checked against this adapter (docs/releases/ascend-0.18.md, "Commit forms"): every
# vllm-ascend target's fingerprint in the commit's tree, and a decision for each item whose target differs from
# v0.18.0's (tests/sources/test_commit_forms.py recomputes the fingerprints from the archived tree).
# ----------------------------------------------------------------------------------------------------------------

_SPEC_NORM = "vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer.attn_update_stack_num_spec_norm"
COMMITS = (
    Form(
        ref="35b0fdf7d57aee5bd93793e03506ae2d85959595",
        release="0.18.0",
        branch="releases/v0.18.0",
        past_tag=45,
        date="2026-08-07",
        env="va018-head",
        fingerprints={
            "vllm_ascend.worker.model_runner_v1:NPUModelRunner.__init__": "0f3a79171e3bf24f",
            "vllm_ascend.worker.model_runner_v1:NPUModelRunner._build_attn_state": "96514ebc0c149e64",
            "vllm_ascend.worker.model_runner_v1:NPUModelRunner._build_attention_metadata": "590425dd3212fbe8",
            "vllm_ascend.worker.model_runner_v1:NPUModelRunner.sample_tokens": "f1284b38c8dc9ad2",
            "vllm_ascend.worker.model_runner_v1:NPUModelRunner.propose_draft_token_ids": "08404fc38be7261e",
            "vllm_ascend.worker.model_runner_v1:NPUModelRunner._bookkeeping_sync": "114f635988a911e6",
            "vllm_ascend.worker.model_runner_v1:NPUModelRunner._sample": "294343dec903a9ab",
            "vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer.prepare_inputs_padded": "bec28bfc8a735b99",
            "vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer._propose": "d468b07a805b3f0d",
            _SPEC_NORM: "a33ff64447e5a581",
            "vllm_ascend.worker.model_runner_v1:NPUModelRunner._model_forward": "6b004d8c5e422857",
            "vllm_ascend.worker.model_runner_v1:NPUModelRunner._update_full_graph_params_if_needed": "8b9170ff5b0e8829",
            "vllm_ascend.worker.block_table:BlockTable.__init__": "ccce40b9beff96c6",
            "vllm_ascend.worker.block_table:BlockTable.compute_slot_mapping": "ab181c2789fafa53",
            "vllm_ascend.worker.block_table:BlockTable.commit_slot_mapping": "7ecb26d2b557ccfa",
            "vllm_ascend.worker.block_table:MultiGroupBlockTable.compute_slot_mapping": "9b098020be5b986e",
            "vllm_ascend.worker.model_runner_v1:NPUModelRunner._prepare_inputs": "72f01a8e67691f0d",
            "vllm_ascend.worker.model_runner_v1:NPUModelRunner._calc_spec_decode_metadata": "c8889f0865f578a3",
            "vllm_ascend.worker.model_runner_v1:NPUModelRunner.execute_model": "9eca449f8a01d727",
            "vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer.prepare_next_token_ids_padded": (
                "b04a2a09323e2c31"
            ),
            "vllm_ascend.worker.model_runner_v1:NPUModelRunner.initialize_kv_cache": "f334fd402b19077e",
            "vllm_ascend.worker.worker:NPUWorker.execute_model": "441bd2275373ce7d",
            "vllm_ascend.ops.rotary_embedding:get_cos_and_sin_mla": "d2a862ac42765291",
            "vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer.dummy_run": "57dbd331e0623e17",
            "vllm_ascend.worker.model_runner_v1:NPUModelRunner._check_and_update_cudagraph_mode": "5b1da76d6d0eed17",
            "vllm_ascend.compilation.acl_graph:ACLGraphWrapper.__call__": "81c9fadfb87529dd",
            "vllm_ascend.compilation.acl_graph:update_full_graph_params": "3e71b000d42df215",
            "vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer.__init__": "08ef97ecd47d7788",
            "vllm_ascend.core.recompute_scheduler:RecomputeScheduler.update_from_output": "8cddfc0d5a7e9b11",
        },
        decisions={
            "guard:" + _SPEC_NORM: FormDecision(
                STILL_HOLDS,
                "the per-draft-step +1 on the metadata's CPU seq_lens is unchanged; only the max_model_len masks "
                "changed (#10112)",
            ),
            "draft-seq-lens-max-model-len": FormDecision(
                NATIVE_HERE,
                "masks the device and the host lengths alike by seq_lens > max_model_len after the +1 (#10112, "
                "commit 36e15a2fdc), the masks the wrapper applies",
            ),
        },
    ),
)

ADAPTER = Adapter(
    id="ascend-0.18",
    title="vllm-ascend 0.18.0 + vLLM 0.18.x (zero-bubble async scheduling + EAGLE/MTP spec decode backport)",
    vllm_ascend=ASCEND_RANGES["ascend-0.18"],
    vllm=((0, 18, 0), (0, 19)),
    zero_bubble_ids=tuple(p.id for p in PATCHES if p.group == "zero-bubble-0.18"),
    patch_set=PatchSet("ascend-0.18", PATCHES, GUARDS),
    preload=("vllm_ascend.platform", "vllm_ascend.worker.worker"),
    releases=("0.18.0",),
    commits=COMMITS,
    notes="vllm-ascend 0.18.0 pins vLLM 0.18.0; vLLM 0.18.1 has identical targets.",
)
