"""Adapter ascend-0.13: vllm-ascend 0.13.0 + vLLM 0.13.0 -> zero-bubble async scheduling + EAGLE/MTP spec decode.

Declarations (the zero-bubble specs, :mod:`.zero_bubble_classic`'s plus this release's input-preparation specs; the
fixes, each a factory of :mod:`.fixes` called with this release's fingerprints; the guards) and this release's
quirks; the wrappers are :class:`zb_patch.versions.npu_runner.ZeroBubble`'s, shared with ascend-0.18. The quirks
(:class:`ZeroBubble013`): the monolithic ``_prepare_inputs`` also builds the attention metadata, so the correction
runs inside it, at ``_init_model_kwargs``, where the input ids are also clamped to >= 0; the device counts are
corrected from this step's CPU counts (``count_base = "cpu"``); the release never waits on ``prepare_inputs_event``,
so the ``_update_states`` wrapper does; vllm-ascend's PD-decode ``_update_states`` replacement is not composed with.
docs/releases/ascend-0.13.md: what is verified and how.
"""

from __future__ import annotations

from ..registry import Guard, Patch, PatchSet
from . import npu_runner, zero_bubble_classic
from .adapter import ASCEND_RANGES, REFUSED_HERE, STILL_HOLDS, Adapter, Form, FormDecision
from .fixes import (
    draft_placeholders_after_metadata,
    draft_sample_indices_past_batch,
    exact_counts_after_early_output,
    graph_replay,
    mtp_draft_lengths,
    mtp_draft_slots,
    readded_request_drafts,
    rejection_negative_drafts,
    reset_prefix_cache_in_flight,
    stale_draft_placeholders,
)


class ZeroBubble013(npu_runner.ZeroBubble):
    """vllm-ascend 0.13's quirks (see the module docstring and the specs of PREPARE_INPUTS / INIT_MODEL_KWARGS)."""

    count_base = "cpu"
    waits_for_input_prep = True

    def unsupported_reason(self, runner):
        wanted, reason = super().unsupported_reason(runner)
        if reason or not wanted:
            return wanted, reason
        ascend_config = getattr(runner, "ascend_config", None)
        if (
            getattr(ascend_config, "recompute_scheduler_enable", False)
            and getattr(runner.vllm_config, "kv_transfer_config", None) is not None
        ):
            return True, (
                "PD decode node with the recompute scheduler (vllm-ascend 0.13 replaces "
                "GPUModelRunner._update_states there: vllm_ascend.patch.worker.patch_model_runner)"
            )
        return True, ""

    def make_prepare_inputs(self, original):
        def _prepare_inputs(runner, *args, **kwargs):
            st = self.active(runner)
            if st is None:
                return original(runner, *args, **kwargs)
            st.in_prepare = True
            try:
                result = original(runner, *args, **kwargs)
            finally:
                missed, st.in_prepare = st.in_prepare, False
                draft_placeholders_after_metadata.drop_ids_before_clamp(
                    runner
                )  # consumed by the metadata, or never to be read
            if missed and st.queue:  # unreachable while the guarded release calls the hook: never build on guesses
                raise RuntimeError(
                    "zb-patch ascend-0.13: _prepare_inputs returned without calling "
                    "_init_model_kwargs; the attention metadata was built from optimistic counts"
                )
            event = getattr(runner, "prepare_inputs_event", None)
            if event is not None:
                event.record()
            return result

        return _prepare_inputs

    def make_init_model_kwargs(self, original):
        def _init_model_kwargs(runner, *args, **kwargs):
            result = original(runner, *args, **kwargs)
            st = self.active(runner)
            if st is not None and st.in_prepare:  # once per patched _prepare_inputs: its inputs are queued here
                st.in_prepare = False
                n = runner.input_batch.num_reqs
                query_start_loc = runner.query_start_loc.np
                total = int(query_start_loc[n])
                # a row re-added with draft placeholders gets its host token table gathered there, where the
                # optimistic bookkeeping may have left a -1: junk the rejection sampler rejects, but never an
                # embedding index (the release embeds multimodal / prompt-embeds inputs right after this call);
                # the ids as they were are kept for the spec-decode metadata built after this call, so the
                # rejection sampler sees a -1 draft as -1 (patch draft-placeholders-after-metadata)
                draft_placeholders_after_metadata.keep_ids_before_clamp(runner, total)
                runner.input_ids.gpu[:total].clamp_(min=0)
                self.correct(runner, st, query_start_loc[1 : n + 1] - query_start_loc[:n], total)
            return result

        return _init_model_kwargs


ZERO_BUBBLE = ZeroBubble013("0.13", other_runners="310P / torchair")

_REMOVE_WHEN = (
    "vllm-ascend 0.13.x is no longer served (upgrade path: vllm-ascend >= 0.19.1rc1 ships zero-bubble "
    "natively, #7640 / #8461); this adapter covers vllm-ascend 0.13.0 only, so the patch goes with it"
)

# Upstream functions the patches rely on without replacing them (a change in any of them could break an
# assumption the wrappers make), with the fingerprints of the release sources they were read from
# (``zb-patch fingerprints`` recomputes them from any source tree).
GUARDS = (
    Guard(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__",
        {"vllm 0.13.0": "6e1ca3fff01ce8a8"},
        "creates valid_sampled_token_count_event / copy stream / int64 host buffer (async + spec) and "
        "prepare_inputs_event (async); positions and seq_lens are CpuGpuBuffers (kept: .gpu exact after the device "
        "correction, seq_lens.cpu exact after the host correction)",
    ),
    Guard(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_valid_sampled_token_count",
        {"vllm 0.13.0": "26d90667e22b8057"},
        "the wait itself (event.synchronize + host list); called by zero-bubble inside _prepare_inputs",
    ),
    Guard(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._make_buffer",
        {"vllm 0.13.0": "040013a8582667d5"},
        "zero-bubble allocates its pinned staging buffers with it",
    ),
    Guard(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.synchronize_input_prep",
        {"vllm 0.13.0": "7043b500f869d440"},
        "the semantics of prepare_inputs_event that zero-bubble reproduces (wait before _update_states, record after "
        "_prepare_inputs); vllm-ascend 0.13 never enters it",
    ),
    Guard(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_input_ids",
        {"vllm 0.13.0": "5932e601684fdc7a"},
        "decode input ids are scattered on the device from last step's sampled / draft tokens, independent "
        "of the (optimistic) CPU positions used for the host gather; called before the hook",
    ),
    Guard(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
        {"vllm 0.13.0": "71f7c9676bb77930"},
        "readded-request-drafts: calls _may_reorder_batch right after re-adding the requests that were not in the "
        "persistent batch, whose scheduled drafts it does not write (it does for rows that stayed)",
    ),
    Guard(
        "vllm.v1.worker.gpu_input_batch:InputBatch.update_async_output_token_ids",
        {"vllm 0.13.0": "2593129b2e22f2e9"},
        "not called on the NPU path (NPUModelRunner._sample does not), so the optimistic -1 placeholder "
        "tail of output_token_ids is never half-replaced",
    ),
    Guard(
        "vllm_ascend.worker.model_runner_v1:NPUModelRunner.__init__",
        {"vllm-ascend 0.13.0": "8d9ac47259e3fe63"},
        "positions / seq_lens / query_start_loc buffers zero-bubble reads and rewrites on the device",
    ),
    Guard(
        "vllm_ascend.worker.model_runner_v1:NPUModelRunner.sample_tokens",
        {"vllm-ascend 0.13.0": "4a7d6cf7b2fe1407"},
        "_bookkeeping_sync, then the padded drafter",
    ),
    Guard(
        "vllm_ascend.worker.model_runner_v1:NPUModelRunner.propose_draft_token_ids",
        {"vllm-ascend 0.13.0": "08a0f995a61d0d7d"},
        "prepare_next_token_ids_padded(spec_decode_common_attn_metadata, ...), then "
        "_copy_valid_sampled_token_count, then the drafter: the event the host waits on is recorded before the "
        "drafter runs",
    ),
    Guard(
        "vllm_ascend.worker.model_runner_v1:NPUModelRunner._sample",
        {"vllm-ascend 0.13.0": "0469f054c147bdcb"},
        "never calls InputBatch.update_async_output_token_ids",
    ),
    Guard(
        "vllm_ascend.worker.model_runner_v1:NPUModelRunner._bookkeeping_sync",
        {"vllm-ascend 0.13.0": "639238465517a728"},
        "prev_req_id_to_index (the rows the corrections are gathered from) and prev_sampled_token_ids",
    ),
    Guard(
        "vllm_ascend.spec_decode.eagle_proposer:EagleProposer.prepare_inputs_padded",
        {"vllm-ascend 0.13.0": "d6b4172b92252aa7"},
        "derives the draft metadata from the (exact) common metadata",
    ),
    Guard(
        "vllm_ascend.spec_decode.eagle_proposer:EagleProposer._propose",
        {"vllm-ascend 0.13.0": "f0ab0b1e0a8a7030"},
        "reads the common metadata's seq_lens_cpu (exact) and positions (device-corrected)",
    ),
    Guard(
        "vllm_ascend.spec_decode.eagle_proposer:EagleProposer.attn_update_stack_num_spec_norm",
        {"vllm-ascend 0.13.0": "75f8e995cd684ac4"},
        "per-draft-step +1 on the (exact) CPU seq_lens of the metadata",
    ),
    Guard(
        "vllm_ascend.spec_decode.mtp_proposer:MtpProposer._propose",
        {"vllm-ascend 0.13.0": "97cc12b8c7e3a7b1"},
        "MTP's own draft loop reads the same (exact) common metadata; MtpProposer inherits "
        "prepare_next_token_ids_padded; its later draft steps move the host seq_lens and query_start_loc on without "
        "the dense metadata's lists, which mtp-draft-lengths makes follow",
    ),
    Guard(
        "vllm_ascend.attention.utils:AscendCommonAttentionMetadata.unpadded",
        {"vllm-ascend 0.13.0": "45c4d912f875ffac"},
        "the proposer's unpadded metadata keeps seq_lens_cpu (exact after the hook)",
    ),
    Guard(
        "vllm_ascend.worker.model_runner_v1:NPUModelRunner._generate_process_reqs_hidden_states",
        {"vllm-ascend 0.13.0": "be6741c407147770"},
        "launches the graph replay first, then updates task-group parameters for FULL replays only: a PIECEWISE "
        "piece holds no task group (piecewise-drain-once-per-step); the FULL order is the one "
        "full-replay-ordered-on-device keeps on the device (docs/graph-modes.md)",
    ),
    Guard(
        "vllm_ascend.worker.block_table:BlockTable.__init__",
        {"vllm-ascend 0.13.0": "4597cd563ca28457"},
        "the device slot mapping reads block_table, slot_mapping, block_size, physical_block_size, "
        "max_num_batched_tokens, kernel_sizes",
    ),
    Guard(
        "vllm_ascend.worker.block_table:BlockTable.compute_slot_mapping",
        {"vllm-ascend 0.13.0": "ab181c2789fafa53"},
        "the device slot mapping reproduces its non-CP branch (computed only when block_size == "
        "kernel_sizes[0]) from corrected positions",
    ),
    Guard(
        "vllm_ascend.worker.block_table:BlockTable.commit_slot_mapping",
        {"vllm-ascend 0.13.0": "7ecb26d2b557ccfa"},
        "the H2D copy of the host result is queued before the device kernel overwrites it",
    ),
    Guard(
        "vllm_ascend.worker.block_table:MultiGroupBlockTable.compute_slot_mapping",
        {"vllm-ascend 0.13.0": "9b098020be5b986e"},
        "every KV-cache group's table is mapped (zero-bubble walks block_tables the same way)",
    ),
    reset_prefix_cache_in_flight.guard({"vllm 0.13.0": "7f6efa0565f00bd5"}),
)

_GROUP = "zero-bubble-0.13"

PREPARE_INPUTS = Patch(
    id="zb013-prepare-inputs-window",
    rests_on=npu_runner.ZERO_BUBBLE_BACKPORT,
    group=_GROUP,
    target="vllm_ascend.worker.model_runner_v1:NPUModelRunner._prepare_inputs",
    make=ZERO_BUBBLE.make_prepare_inputs,
    fingerprints={"vllm-ascend 0.13.0": "3f2160eb21592eb2"},
    why="vllm-ascend 0.13's _prepare_inputs is monolithic: the corrections must happen inside it (after the "
    "inputs are queued, before the attention metadata is built), and the input-preparation event must be "
    "recorded after all of its host-to-device copies.",
    how="Wrapper. Opens the window in which the _init_model_kwargs hook corrects (once per call), runs the "
    "release's body unchanged, refuses to return metadata built from optimistic counts if the hook did not "
    "run (unreachable under the guarded release), then records prepare_inputs_event.",
    upstream=zero_bubble_classic.UPSTREAM,
    remove_when=_REMOVE_WHEN,
)

INIT_MODEL_KWARGS = Patch(
    id="zb013-corrections-before-metadata",
    rests_on=npu_runner.ZERO_BUBBLE_BACKPORT,
    group=_GROUP,
    target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._init_model_kwargs",
    make=ZERO_BUBBLE.make_init_model_kwargs,
    fingerprints={"vllm 0.13.0": "252092b39911bd67"},
    why="With optimistic CPU counts the release's positions, seq_lens and slot mapping are too long by the "
    "rejected drafts of the previous step, and Ascend attention (FIA / paged attention) needs exact CPU "
    "seq_lens when its metadata is built. vllm-ascend 0.13's _prepare_inputs calls _init_model_kwargs exactly "
    "once, after its last host-to-device copy of positions / seq_lens / slot mapping / input ids and "
    "the discard indices, and before the spec-decode metadata and the attention-metadata loop: the narrowest "
    "point where both hold.",
    how="Wrapper; acts only inside the patched _prepare_inputs. After the release's body (an empty dict off "
    "pooling): the step's input ids are clamped on the device to >= 0 (a row re-added with draft placeholders "
    "has no draft ids and gets a host gather that may read a -1 placeholder: junk the rejection sampler rejects "
    "in both modes, but never an embedding index; the release embeds multimodal / prompt-embeds inputs right "
    "after this call; no host work, no sync); device counts = private snapshot of this step's CPU counts minus "
    "step N's rejected drafts (zero_bubble.CountCorrection base='cpu' -- vLLM 0.13's scheduler can schedule a "
    "row catch-up tokens and drafts in one step, so upstream's 'previous device count + valid count' is wrong "
    "here; docs/selftest.md), fused with positions.gpu / seq_lens.gpu, then zb-patch's slot-mapping kernel on "
    "every table the release maps. Then the host waits for step N's counts (valid_sampled_token_count_event, "
    "recorded before step N's drafter: vllm-ascend #10506's wait) and subtracts the rejected drafts from "
    "seq_lens.cpu and num_computed_tokens_cpu, so the metadata loop, its FULL-graph pad copy and the drafter's "
    "backup index read exact values.",
    upstream=zero_bubble_classic.UPSTREAM + ("vllm#38556",),
    remove_when=_REMOVE_WHEN,
)

ZERO_BUBBLE_PATCHES = zero_bubble_classic.patches(
    ZERO_BUBBLE,
    fingerprints={
        "_update_states": {"vllm 0.13.0": "71f7c9676bb77930"},
        "execute_model": {"vllm-ascend 0.13.0": "57d4b56dcef2d872"},
        "_copy_valid_sampled_token_count": {"vllm 0.13.0": "1defdf40921fa49a"},
        "prepare_next_token_ids_padded": {"vllm-ascend 0.13.0": "b04a2a09323e2c31"},
        "initialize_kv_cache": {"vllm-ascend 0.13.0": "293de2f60b4290d1"},
    },
    proposer="vllm_ascend.spec_decode.eagle_proposer:EagleProposer",
    input_preparation=(PREPARE_INPUTS, INIT_MODEL_KWARGS),
    remove_when=_REMOVE_WHEN,
)
EXACT_COUNTS = exact_counts_after_early_output.patches(
    {"vllm-ascend 0.13.0": "207f651e97972538"}, {"vllm 0.13.0": "26d90667e22b8057"}
)

# ----------------------------------------------------------------------------------------------------------------
# Fixes of the release's own async + speculative-decoding defects (with or without zero-bubble): not in the
# zero-bubble group, applied whenever their defect can bite, each with its own ZB_PATCH_DISABLE id.
# ----------------------------------------------------------------------------------------------------------------

STALE_DRAFT_PLACEHOLDERS, STALE_DRAFT_ROWS = stale_draft_placeholders.patches(
    {"vllm 0.13.0": "5932e601684fdc7a"},
    {"vllm 0.13.0": "cf5a63628bde6da9"},
    release="On vLLM 0.13 also #31944's preemption case: _preempt_request keeps spec_token_ids until vLLM 0.14, so a "
    "preempted and resumed request gets the stale placeholders with the last chunk of its recomputed prompt. vLLM 0.13 "
    "does not even write a re-added row's scheduled drafts into token_ids_cpu, so its draft input ids are whatever "
    "the row held before: a token of another request or a `-1`, which crashes the embedding (classic async, EAGLE "
    "k = 3, 4 on the big workload: docs/e2e.md). zero-bubble's clamp at 0 (zb013-corrections-before-metadata) only "
    "turns them into junk token 0 drafts.",
    not_covered="a runner that prepares input ids elsewhere (PCP)",
    also_upstream=("vllm#31944",),
    remove_when=_REMOVE_WHEN,
)
READDED_REQUEST_DRAFTS = readded_request_drafts.patch({"vllm 0.13.0": "5043e96df8f91dc5"}, remove_when=_REMOVE_WHEN)
MTP_DRAFT_SLOTS = mtp_draft_slots.patch({"vllm-ascend 0.13.0": "97cc12b8c7e3a7b1"}, remove_when=_REMOVE_WHEN)
MTP_DRAFT_LENGTHS = mtp_draft_lengths.patch({"vllm-ascend 0.13.0": "46d81270954ae85b"}, remove_when=_REMOVE_WHEN)
DRAFT_PLACEHOLDERS_AFTER_METADATA = draft_placeholders_after_metadata.patch(
    {"vllm-ascend 0.13.0": "c8889f0865f578a3"},
    release_lines="RecomputeScheduler.add_request, core/recompute_scheduler.py:110; the drafts gathered in "
    "_calc_spec_decode_metadata, model_runner_v1.py:1301, after _init_model_kwargs (:776)",
    remove_when=_REMOVE_WHEN,
    not_covered=" Not covered: a multimodal / prompt-embeds model without zero-bubble, which the release embeds "
    "inside _prepare_inputs before the metadata (model_runner_v1.py:779-830).",
)
REJECTION_NEGATIVE_DRAFTS = rejection_negative_drafts.patch(
    {"vllm-ascend 0.13.0": "88ae46cb6ebe543c"},
    release_lines="reject_sample.py:178-188, :274-282, :422-434; rejection_sampler.py:515",
    remove_when=_REMOVE_WHEN,
)
DRAFT_SAMPLE_INDICES = draft_sample_indices_past_batch.patch(
    {"vllm-ascend 0.13.0": "08a0f995a61d0d7d"},
    buffer="last_token_indices",
    release_lines="EagleProposer._propose, eagle_proposer.py:535-537; read by _run_merged_draft, :607",
    remove_when=_REMOVE_WHEN,
)
_ACL_GRAPH_CALL = {"vllm-ascend 0.13.0": "17c3291437858c29"}
PIECEWISE_ONCE_PER_STEP = graph_replay.piecewise_drain_once_per_step(_ACL_GRAPH_CALL)
PIECEWISE_NO_DRAIN = graph_replay.piecewise_replay_without_host_drain(_ACL_GRAPH_CALL)  # opt-in
# the four task-group update entry points (id suffix, name, fingerprint), each bound by name in the runner and proposer
FULL_ORDERED_ON_DEVICE = tuple(
    graph_replay.full_replay_ordered_on_device(
        suffix,
        f"vllm_ascend.compilation.acl_graph:{name}",
        {"vllm-ascend 0.13.0": fingerprint},
        aliases=(f"vllm_ascend.worker.model_runner_v1:{name}", f"vllm_ascend.spec_decode.eagle_proposer:{name}"),
        stream_arg=0,
    )
    for suffix, name, fingerprint in (
        ("", "update_attn_params", "1d8b09dcf1275bb1"),
        ("-mla-attn", "update_mla_attn_params", "2f17428cb1637d22"),
        ("-attn-dcp-pcp", "update_attn_dcp_pcp_params", "4015cc2d6c33f949"),
        ("-mla-attn-dcp-pcp", "update_mla_attn_dcp_pcp_params", "66535df4507a2c1d"),
    )
)
RESET_PREFIX_CACHE_IN_FLIGHT = reset_prefix_cache_in_flight.patches(
    {"vllm 0.13.0": "cc9382f6e9070ec6"},
    {"vllm 0.13.0": "de2f1710cb8e019d"},
    {"vllm-ascend 0.13.0": "a03d6673ece9e260"},
    release_lines="flags: vLLM 0.13.0 scheduler.py:1441-1447; subtracts: :1110-1127, vllm-ascend 0.13.0 "
    "core/recompute_scheduler.py:731-747; discards: async_scheduler.py:48-51",
    remove_when=_REMOVE_WHEN,
)

PATCHES: tuple = (
    *ZERO_BUBBLE_PATCHES,
    *EXACT_COUNTS,
    STALE_DRAFT_PLACEHOLDERS,
    STALE_DRAFT_ROWS,
    READDED_REQUEST_DRAFTS,
    MTP_DRAFT_SLOTS,
    MTP_DRAFT_LENGTHS,
    DRAFT_SAMPLE_INDICES,
    DRAFT_PLACEHOLDERS_AFTER_METADATA,
    REJECTION_NEGATIVE_DRAFTS,
    PIECEWISE_ONCE_PER_STEP,
    PIECEWISE_NO_DRAIN,
    *FULL_ORDERED_ON_DEVICE,
    *RESET_PREFIX_CACHE_IN_FLIGHT,
)

# ----------------------------------------------------------------------------------------------------------------
# Maintenance-branch commits checked against this adapter (docs/releases/ascend-0.13.md, "Commit forms"): every
# vllm-ascend target's fingerprint in the commit's tree, and a decision for each item whose target differs from
# v0.13.0's (tests/sources/test_commit_forms.py recomputes the fingerprints from the archived tree).
# ----------------------------------------------------------------------------------------------------------------

_RUNNER = "vllm_ascend.worker.model_runner_v1:NPUModelRunner"
_DSV4 = "DeepSeek-V4 (use_compress, #8648)"
_LEFT_WITH_GROUP = "; left out with its group (zb013-prepare-inputs-window is refused on this commit)"
_UPDATE_STATES = "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states"
# the tag imports vllm_ascend.patch.worker.patch_model_runner only for PD decode + MTP with the recompute scheduler
# (platform.py:340); the commit imports it from patch/worker/__init__.py, in every process
_REPLACED_AT_IMPORT = "vllm_ascend.patch.worker.patch_model_runner replaces it in every process"
COMMITS = (
    Form(
        ref="f92eadfca968666893715f0a295f036c7bc9d207",
        release="0.13.0",
        branch="releases/v0.13.0",
        past_tag=30,
        date="2026-07-16",
        env="va013-head",
        fingerprints={
            f"{_RUNNER}.__init__": "6ce9b379b1d01980",
            f"{_RUNNER}.sample_tokens": "4a7d6cf7b2fe1407",
            f"{_RUNNER}.propose_draft_token_ids": "08a0f995a61d0d7d",
            f"{_RUNNER}._sample": "0469f054c147bdcb",
            f"{_RUNNER}._bookkeeping_sync": "639238465517a728",
            "vllm_ascend.spec_decode.eagle_proposer:EagleProposer.prepare_inputs_padded": "3efd3c5cbce8d309",
            "vllm_ascend.spec_decode.eagle_proposer:EagleProposer._propose": "20081bfa89091579",
            "vllm_ascend.spec_decode.eagle_proposer:EagleProposer.attn_update_stack_num_spec_norm": "75f8e995cd684ac4",
            "vllm_ascend.spec_decode.mtp_proposer:MtpProposer._propose": "a85a8de4c20e2a48",
            "vllm_ascend.attention.utils:AscendCommonAttentionMetadata.unpadded": "f53fdaef0e914e15",
            f"{_RUNNER}._generate_process_reqs_hidden_states": "be6741c407147770",
            "vllm_ascend.worker.block_table:BlockTable.__init__": "acb2de4bd917d81f",
            "vllm_ascend.worker.block_table:BlockTable.compute_slot_mapping": "ab181c2789fafa53",
            "vllm_ascend.worker.block_table:BlockTable.commit_slot_mapping": "7ecb26d2b557ccfa",
            "vllm_ascend.worker.block_table:MultiGroupBlockTable.compute_slot_mapping": "0f8503e71d058d24",
            f"{_RUNNER}._prepare_inputs": "426a9095c59bc79b",
            f"{_RUNNER}._calc_spec_decode_metadata": "c8889f0865f578a3",
            f"{_RUNNER}.execute_model": "1fa926246f24c3fd",
            "vllm_ascend.spec_decode.eagle_proposer:EagleProposer.prepare_next_token_ids_padded": "b04a2a09323e2c31",
            f"{_RUNNER}.initialize_kv_cache": "5f7069af5b9c305f",
            "vllm_ascend.worker.worker:NPUWorker.execute_model": "207f651e97972538",
            "vllm_ascend.spec_decode.mtp_proposer:set_ascend_forward_context": "0f1ad8bfbf6aa80b",
            "vllm_ascend.compilation.acl_graph:ACLGraphWrapper.__call__": "17c3291437858c29",
            "vllm_ascend.compilation.acl_graph:update_attn_params": "1d8b09dcf1275bb1",
            "vllm_ascend.compilation.acl_graph:update_mla_attn_params": "2f17428cb1637d22",
            "vllm_ascend.compilation.acl_graph:update_attn_dcp_pcp_params": "4015cc2d6c33f949",
            "vllm_ascend.compilation.acl_graph:update_mla_attn_dcp_pcp_params": "66535df4507a2c1d",
            _UPDATE_STATES: "f73d43f8bb2ace70",
            "vllm_ascend.sample.rejection_sampler:rejection_sample": "88ae46cb6ebe543c",
            "vllm_ascend.core.recompute_scheduler:RecomputeScheduler.update_from_output": "a03d6673ece9e260",
        },
        replaced={_UPDATE_STATES: "vllm_ascend.patch.worker.patch_model_runner:_update_states"},
        decisions={
            f"guard:{_UPDATE_STATES}": FormDecision(
                STILL_HOLDS,
                f"{_REPLACED_AT_IMPORT}: vLLM 0.13.0's body plus, on a kv-consumer with async spec decode, "
                "prev_num_draft_len set for each added request; it still calls _may_reorder_batch right after "
                "re-adding requests and writes no drafts for re-added rows",
            ),
            "zb013-optimistic-update-states": FormDecision(
                REFUSED_HERE,
                f"{_REPLACED_AT_IMPORT} (vLLM 0.13.0's body plus a kv-consumer block); not wrapped on this commit, "
                "where its group is refused",
            ),
            f"guard:{_RUNNER}.__init__": FormDecision(
                STILL_HOLDS,
                f"the same positions / seq_lens / query_start_loc buffers; adds the {_DSV4} state",
            ),
            "guard:vllm_ascend.spec_decode.eagle_proposer:EagleProposer.prepare_inputs_padded": FormDecision(
                STILL_HOLDS,
                "draft metadata still from the common metadata (seq_lens_cpu); passes the DeepSeek-V4 fields on",
            ),
            "guard:vllm_ascend.spec_decode.eagle_proposer:EagleProposer._propose": FormDecision(
                STILL_HOLDS,
                "the same seq_lens_cpu and positions; one update_cos_sin call fewer",
            ),
            "guard:vllm_ascend.spec_decode.mtp_proposer:MtpProposer._propose": FormDecision(
                STILL_HOLDS,
                f"without {_DSV4} the draft loop is the tag's; adds DeepSeek-V4 branches and is_draft_model=True to "
                "the DP metadata sync",
            ),
            "guard:vllm_ascend.attention.utils:AscendCommonAttentionMetadata.unpadded": FormDecision(
                STILL_HOLDS, "keeps seq_lens_cpu; passes the DeepSeek-V4 fields on"
            ),
            "guard:vllm_ascend.worker.block_table:BlockTable.__init__": FormDecision(
                REFUSED_HERE,
                f"a compress_ratio group divides its block and token limits ({_DSV4}); only the zero-bubble-0.13 "
                "group relies on them",
            ),
            "guard:vllm_ascend.worker.block_table:MultiGroupBlockTable.compute_slot_mapping": FormDecision(
                REFUSED_HERE,
                f"maps a group from its compressed positions when given ({_DSV4}); zero-bubble's device slot mapping "
                "uses the uncompressed ones: only the zero-bubble-0.13 group relies on it",
            ),
            "zb013-prepare-inputs-window": FormDecision(
                REFUSED_HERE,
                f"adds {_DSV4}'s compressed and sliding-window slot mappings, computed on the host from the "
                "optimistic positions, which the device correction does not rewrite; no per-model switch, so the "
                "zero-bubble-0.13 group is refused on this commit",
            ),
            "zb013-deferred-correction": FormDecision(
                STILL_HOLDS, "only passes input_ids to set_ascend_forward_context" + _LEFT_WITH_GROUP
            ),
            "zb013-compile-kernels-at-start": FormDecision(
                STILL_HOLDS,
                "adds initialize_kv_state() and hands kv_states to the KV connector under use_compress"
                + _LEFT_WITH_GROUP,
            ),
            "mtp-draft-slots": FormDecision(
                REFUSED_HERE,
                f"adds {_DSV4} branches (swa_slot_mapping moved on beside slot_mapping); the wrapper rewrites "
                "slot_mapping alone and has no per-model switch",
            ),
            "mtp-draft-lengths": FormDecision(
                STILL_HOLDS,
                "gains an input_ids keyword; the wrapper passes every argument through and reads only "
                "is_draft_model / aclgraph_runtime_mode",
            ),
        },
    ),
)

ADAPTER = Adapter(
    id="ascend-0.13",
    title="vllm-ascend 0.13.0 + vLLM 0.13.x (zero-bubble async scheduling + EAGLE/MTP spec decode backport)",
    vllm_ascend=ASCEND_RANGES["ascend-0.13"],
    vllm=((0, 13, 0), (0, 14)),
    zero_bubble_ids=tuple(p.id for p in PATCHES if p.group == "zero-bubble-0.13"),
    patch_set=PatchSet("ascend-0.13", PATCHES, GUARDS),
    preload=("vllm_ascend.platform", "vllm_ascend.worker.worker"),
    releases=("0.13.0",),
    commits=COMMITS,
    notes="vllm-ascend 0.13.0 pins vLLM 0.13.0 (the only 0.13.x on PyPI); async scheduling is opt-in there "
    "(--async-scheduling).",
)
