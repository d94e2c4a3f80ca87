"""Adapter ascend-0.18: vllm-ascend 0.18.0 + vLLM 0.18.x -> zero-bubble async scheduling + EAGLE/MTP spec decode.

Declarations only: the patch specs (each with its why / how / upstream / remove-when) and the guards. The wrappers
are :class:`zb_patch.versions.npu_runner.ZeroBubble`'s, shared with ascend-0.13; this release's one quirk is where
the correction runs: after its split ``_prepare_inputs`` (the attention metadata is built afterwards).
docs/releases/ascend-0.18.md: what is verified and how.
"""

from __future__ import annotations

from ..registry import HOST, Guard, Patch, PatchSet, RestsOn
from . import early_output, graph_replay, npu_runner, spec_fixes
from .adapter import NATIVE_HERE, STILL_HOLDS, Adapter, Form, FormDecision


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
_UPSTREAM = ("vllm#32951", "vllm-ascend#7640", "vllm-ascend#8461", "vllm-ascend#10506")

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
        "never calls InputBatch.update_async_output_token_ids: the optimistic -1 placeholder tail of "
        "output_token_ids is not read by logits processors (vLLM 0.18's version would leave it behind)",
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
)

UPDATE_STATES = Patch(
    id="zb018-optimistic-update-states",
    rests_on=npu_runner.ZERO_BUBBLE_BACKPORT,
    group="zero-bubble-0.18",
    target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
    make=ZERO_BUBBLE.make_update_states,
    fingerprints={"vllm 0.18.0, 0.18.1": "6f40a2feaa48b4bd"},
    why="vLLM 0.18's _update_states calls _get_valid_sampled_token_count() in its middle: the host blocks on step "
    "N's accepted-draft counts (event.synchronize) before it can prepare step N+1, so the NPU idles while the "
    "host prepares every step.",
    how="Wrapper. For the duration of the release's call, _get_valid_sampled_token_count answers from the host "
    "with optimistic counts (drafts + 1 at every previous row): the release keeps the scheduler's optimistic "
    "num_computed_tokens and appends one output placeholder per draft, as vLLM 0.19 does. The rows it looks "
    "up are recorded as this step's corrections (request, drafts, previous row). Falls through unchanged "
    "when zero-bubble is not active on the runner.",
    upstream=_UPSTREAM,
    remove_when=_REMOVE_WHEN,
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
    upstream=_UPSTREAM + ("vllm#38556",),
    remove_when=_REMOVE_WHEN,
)

EXECUTE_MODEL = Patch(
    id="zb018-deferred-correction",
    rests_on=npu_runner.ZERO_BUBBLE_BACKPORT,
    group="zero-bubble-0.18",
    target="vllm_ascend.worker.model_runner_v1:NPUModelRunner.execute_model",
    make=ZERO_BUBBLE.make_execute_model,
    fingerprints={"vllm-ascend 0.18.0": "9eca449f8a01d727"},
    why="req_state.num_computed_tokens stays optimistic after _update_states; it must be exact before "
    "sample_tokens and the next step.",
    how="Wrapper. After the release's execute_model returned (the forward is launched), subtract the rejected "
    "drafts from each corrected request's num_computed_tokens, with the counts the host already waited for "
    "in _prepare_inputs (vLLM 0.19's deferred correct_spec_decode_token_counts closure).",
    upstream=("vllm#32951",),
    remove_when=_REMOVE_WHEN,
)

COPY_VALID_COUNT = Patch(
    id="zb018-device-valid-count",
    rests_on=npu_runner.ZERO_BUBBLE_BACKPORT,
    group="zero-bubble-0.18",
    target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._copy_valid_sampled_token_count",
    make=ZERO_BUBBLE.make_copy_valid_sampled_token_count,
    fingerprints={"vllm 0.18.0, 0.18.1": "b4e8438fae13f315"},
    why="The device correction of the next step needs this step's valid sampled counts on the device; 0.18 only "
    "copies them to the host.",
    how="Wrapper. After the release's copy (side stream, event), keep a reference to the device count tensor "
    "(int64 on Ascend; the host buffer stays int64 too, so the D2H copy has no dtype cast). Consumed once by "
    "the next _prepare_inputs.",
    upstream=("vllm#32951", "vllm-ascend#8766", "vllm-ascend#10205"),
    remove_when=_REMOVE_WHEN,
)

BACKUP_STAGING = Patch(
    id="zb018-backup-token-staging",
    rests_on=npu_runner.BACKUP_STAGING_ONE_STREAM,
    group="zero-bubble-0.18",
    target="vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer.prepare_next_token_ids_padded",
    make=ZERO_BUBBLE.make_prepare_next_token_ids_padded,
    fingerprints={"vllm-ascend 0.18.0": "b04a2a09323e2c31"},
    why="The drafter's backup tokens are written to a reused pinned buffer and copied to the device "
    "non-blocking. The classic path waited every step on an event recorded after that copy; without that wait "
    "the next step can rewrite the buffer while this step's copy is still queued (found by zb-patch's "
    "engine-loop harness; docs/selftest.md).",
    how="Wrapper. Alternate two backup buffers between calls; a buffer is rewritten two steps later, after "
    "synchronize_input_prep has waited on an event recorded behind its copy. The backup index itself is "
    "unchanged: it reads the proposer metadata's seq_lens_cpu, which the _prepare_inputs patch makes exact "
    "(vLLM #38098 cannot occur).",
    upstream=("vllm#38098", "vllm#38556"),
    remove_when=_REMOVE_WHEN,
)

COMPILE_KERNELS = Patch(
    id="zb018-compile-kernels-at-start",
    rests_on=npu_runner.ZERO_BUBBLE_BACKPORT,
    group="zero-bubble-0.18",
    target="vllm_ascend.worker.model_runner_v1:NPUModelRunner.initialize_kv_cache",
    make=ZERO_BUBBLE.make_initialize_kv_cache,
    fingerprints={"vllm-ascend 0.18.0": "f334fd402b19077e"},
    why="Triton compiles zb-patch's token-count and slot-mapping kernels at their first launch, which is inside "
    "the first corrected step of the first request: a stall of that request (triton-ascend compiles far slower "
    "than Triton on CUDA), and again in every process whose Triton cache is empty (a fresh container).",
    how="Wrapper. After the release's initialize_kv_cache (the block tables are final), decide zero-bubble's "
    "activation on the runner and, when active, launch the device correction's kernels once on no request: the "
    "same launchers, constants and argument types as a corrected step, so the first step finds them compiled. "
    "The launches write only padding (seq_lens.gpu, slot_mapping.gpu), which every step rewrites first.",
    upstream=("vllm#32951",),
    remove_when=_REMOVE_WHEN,
)

EXACT_COUNTS = early_output.patches(
    {"vllm-ascend 0.18.0": "441bd2275373ce7d"}, {"vllm 0.18.0, 0.18.1": "20784bf355208845"}
)

# ----------------------------------------------------------------------------------------------------------------
# Fixes of the release's own async + speculative-decoding defects (with or without zero-bubble): not in the
# zero-bubble group, applied whenever async scheduling + spec decode is on, each with its own ZB_PATCH_DISABLE id.
# ----------------------------------------------------------------------------------------------------------------

STALE_DRAFT_PLACEHOLDERS = Patch(
    id="stale-draft-placeholders",
    rests_on=spec_fixes.STALE_DRAFTS_ONE_STREAM,
    group="stale-draft-placeholders",
    target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_input_ids",
    make=spec_fixes.make_prepare_input_ids,
    fingerprints={"vllm 0.18.0, 0.18.1": "9485308c065f0754"},
    why="(vLLM #37159) Async scheduling gives every scheduled decode request `[-1] * k` draft placeholders, which "
    "_prepare_input_ids replaces on the device with the previous step's drafts, but only for rows of the previous "
    "step's batch. A request that skipped a step comes back with the same placeholders "
    "(AsyncScheduler._update_after_schedule set them, the scheduler keeps them while the request is not scheduled, "
    "InputBatch.update_req_spec_token_ids writes them into token_ids_cpu) and the `-1` reaches the model: "
    "IndexError in the embedding on CPU, an out-of-bounds gather on a device. Seen with vLLM 0.18's max_model_len "
    "clamp, which leaves a request at the limit 0 tokens for a step (its count is optimistic), at k >= 2, in "
    "classic async and with zero-bubble alike (docs/e2e.md). Every upstream fix proposed (#37629, #40768, "
    "#43434, #46899) was closed unmerged.",
    how="Wrapper (zb_patch.versions.spec_fixes). Before the release's body: the drafts proposed in the previous "
    "step for each request that was sampled there and is not in this step's batch are kept (a device clone of its "
    "row of _draft_token_ids). After the body: a row that has scheduled drafts and was not in the previous batch "
    "gets its kept drafts written over its draft input ids (device copy; the rejection sampler reads the drafts "
    "from the same input ids). Those are the drafts the request would have been verified with without the skip, "
    "the ones synchronous scheduling verifies: tokens and acceptance are sync's, not only crash-free. No host "
    "wait. Applies with async scheduling + spec decode whether or not zero-bubble is active (its preconditions do "
    "not matter here); a runner whose class overrides _prepare_input_ids (310P) or that prepares input ids "
    "elsewhere (PCP) is not covered.",
    upstream=("vllm#37159", "vllm#36906", "vllm#44734", "vllm#43434"),
    remove_when="a vLLM release fixes #37159 (none does as of vLLM 0.33.0: gpu_model_runner `if prev_index < 0: "
    "continue`, no clearing of a skipped request's placeholders); this adapter covers vLLM 0.18.x only",
)

STALE_DRAFT_ROWS = spec_fixes.stale_draft_rows(
    {"vllm 0.18.0, 0.18.1": "2fb92a95cc838fa7"}, STALE_DRAFT_PLACEHOLDERS.remove_when
)

DRAFT_LENGTHS_AT_MAX_MODEL_LEN = Patch(
    id="draft-seq-lens-max-model-len",
    rests_on=spec_fixes.DRAFT_LENGTHS_ONE_STREAM,
    target="vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer.attn_update_stack_num_spec_norm",
    make=spec_fixes.make_attn_update_stack_num_spec_norm,
    fingerprints={"vllm-ascend 0.18.0": "066043ae9710cf9f"},
    why="(vllm-ascend #9221 / #9235 'MTP tokens out-of-range', fixed on releases/v0.18.0 by #10112, unreleased) For "
    "draft steps 1 .. k-1 the proposer adds 1 to each draft row's sequence length and sets it to 1 for requests past "
    "max_model_len: on the device by the step's position (>= max_model_len), on the host by the new length "
    "(>= max_model_len). They disagree: a length reaching max_model_len gets it on the device and 1 on the host, also "
    "for a row whose position is still below the limit (the lengths count the step's rejected drafts), so its draft "
    "attends to one KV entry; a row masked once gets 1 on the device and 2, 3, ... on the host next. Ascend "
    "attention reads the host lengths (FIA actual_seq_lengths_kv), other kernels the device ones: the out-of-range "
    "errors #9221 fixed near max_model_len with MTP. #9235's input_fits_in_drafter (skip the drafter) was reverted "
    "on the branch by #10112 because it diverged across DP ranks and hung MoE models (vLLM #44185).",
    how="Wrapper (zb_patch.versions.spec_fixes). The release's body runs with a stand-in for its attn_group whose "
    "metadata builder, before build_for_drafting, rewrites the draft rows' lengths of the step's common metadata to "
    "the previous step's + 1, set to 1 where that exceeds max_model_len, on the device (seq_lens) and the host "
    "(seq_lens_cpu): #10112's masks. The previous lengths are the metadata the step was derived from, which the "
    "release clones before adding. Device ops on the device tensor, host ops on the host one: no wait. EAGLE and MTP, "
    "with or without async scheduling and zero-bubble. Tokens do not change (drafts are verified); drafts do: the "
    "draft rows' lengths count the step's rejected drafts, so the host mask also hit rows whose position is below "
    "the limit, and their draft attended to one KV entry (docs/e2e.md: one more draft accepted with the fix).",
    upstream=("vllm-ascend#10112", "vllm-ascend#9221", "vllm-ascend#9235", "vllm-ascend#10147", "vllm#44185"),
    remove_when=_REMOVE_WHEN,
)
MLA_DRAFT_ROPE_ROWS = spec_fixes.mla_draft_rope_rows(
    proposer="vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer",
    rope_rows={"vllm-ascend 0.18.0": "d2a862ac42765291"},
    propose={"vllm-ascend 0.18.0": "d468b07a805b3f0d"},
    dummy_run={"vllm-ascend 0.18.0": "57dbd331e0623e17"},
    remove_when="a vllm-ascend release gives each draft position RoPE rows of its own (none does as of 0.25.1rc1: "
    "spec_decode/llm_base_proposer.py builds every position first, mla_v1.py still returns views of _cos_mla); this "
    "adapter covers vllm-ascend 0.18.x only, so the patch goes with it",
)
CUDAGRAPH_SIZES_AFTER_ROUNDING = Patch(
    id="cudagraph-batch-sizes-after-rounding",
    rests_on=RestsOn(
        HOST,
        "a host list (cudagraph_batch_sizes) recomputed at start-up from the configuration the dispatcher was initialised from",
    ),
    target="vllm_ascend.worker.model_runner_v1:NPUModelRunner._check_and_update_cudagraph_mode",
    make=spec_fixes.make_check_and_update_cudagraph_mode,
    fingerprints={"vllm-ascend 0.18.0": "5b1da76d6d0eed17"},
    why="(vllm-ascend #6860, in 0.19.1rc1) NPUModelRunner.__init__ sets cudagraph_batch_sizes from the configured "
    "capture sizes; _check_and_update_cudagraph_mode then lets vLLM round them up to multiples of 1 + k for FULL "
    "decode graphs with speculative decoding (CompilationConfig.adjust_cudagraph_sizes_for_spec_decode: [1, 2, 4, 8, "
    "16] -> [3, 6, 9] at k = 2) and builds the dispatcher's padding table from the rounded list, but the runner's "
    "list is never refreshed. The EAGLE proposer pads `num_tokens <= cudagraph_batch_sizes[-1]` through that table "
    "(eagle_proposer.py:533-534): a draft batch of 10-16 tokens indexes past it, IndexError (sync) or a device-side "
    "assert (async), whenever the largest capture size is not a multiple of 1 + k (EAGLE k = 2 with the default "
    "sizes; MTP under async scheduling runs its drafter without graphs and is not affected).",
    how="Wrapper (zb_patch.versions.spec_fixes). After the release's body, cudagraph_batch_sizes is recomputed by "
    "the constructor's own rule (sorted capture sizes unless the mode is NONE) from the configuration the "
    "dispatcher was just initialised from, so the drafter's lookup stays within the table and sizes past the largest "
    "graph run without padding, as the dispatcher itself decides for them. cudagraph_batch_sizes has no other reader "
    "in vLLM 0.18 or vllm-ascend 0.18.0. Any graph mode, with or without speculative decoding (unchanged where nothing was adjusted). "
    "#6860 instead replaced the lookup with the dispatcher's dispatch (with its merged MTP graph).",
    upstream=("vllm-ascend#6860",),
    remove_when=_REMOVE_WHEN,
)
DRAFT_PLACEHOLDERS_AFTER_METADATA = spec_fixes.draft_placeholders_after_metadata(
    {"vllm-ascend 0.18.0": "c8889f0865f578a3"},
    release_lines="RecomputeScheduler.add_request, core/recompute_scheduler.py:152; the drafts gathered in "
    "_calc_spec_decode_metadata, model_runner_v1.py:944, the ids embedded in vLLM's _preprocess after "
    "_prepare_inputs (model_runner_v1.py:1294)",
    remove_when=_REMOVE_WHEN,
)
DRAFT_SAMPLE_INDICES = spec_fixes.draft_sample_indices(
    {"vllm-ascend 0.18.0": "08404fc38be7261e"},
    buffer="token_indices_to_sample",
    release_lines="SpecDecodeBaseProposer._propose, eagle_proposer.py:701-702; read by _run_merged_draft, :809",
    remove_when=_REMOVE_WHEN,
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

PATCHES: tuple = (
    UPDATE_STATES,
    PREPARE_INPUTS,
    EXECUTE_MODEL,
    COPY_VALID_COUNT,
    BACKUP_STAGING,
    COMPILE_KERNELS,
    *EXACT_COUNTS,
    STALE_DRAFT_PLACEHOLDERS,
    STALE_DRAFT_ROWS,
    DRAFT_LENGTHS_AT_MAX_MODEL_LEN,
    *MLA_DRAFT_ROPE_ROWS,
    CUDAGRAPH_SIZES_AFTER_ROUNDING,
    DRAFT_SAMPLE_INDICES,
    DRAFT_PLACEHOLDERS_AFTER_METADATA,
    PIECEWISE_ONCE_PER_STEP,
    PIECEWISE_NO_DRAIN,
    FULL_ORDERED_ON_DEVICE,
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
    vllm_ascend=((0, 18, 0), (0, 19)),
    vllm=((0, 18, 0), (0, 19)),
    zero_bubble_ids=tuple(p.id for p in PATCHES if p.group == "zero-bubble-0.18"),
    patch_set=PatchSet("ascend-0.18", PATCHES, GUARDS),
    preload=("vllm_ascend.platform", "vllm_ascend.worker.worker"),
    releases=("0.18.0",),
    commits=COMMITS,
    notes="vllm-ascend 0.18.0 pins vLLM 0.18.0; vLLM 0.18.1 has identical targets.",
)
