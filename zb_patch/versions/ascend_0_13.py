"""Adapter ascend-0.13: vllm-ascend 0.13.0 + vLLM 0.13.0 -> zero-bubble async scheduling + EAGLE/MTP spec decode.

Declarations (the patch specs, each with its why / how / upstream / remove-when, and the guards) and this release's
quirks; the wrappers are :class:`zb_patch.versions.npu_runner.ZeroBubble`'s, shared with ascend-0.18. The quirks
(:class:`ZeroBubble013`): the monolithic ``_prepare_inputs`` also builds the attention metadata, so the correction
runs inside it, at ``_init_model_kwargs``, where the input ids are also clamped to >= 0; the device counts are
corrected from this step's CPU counts (``count_base = "cpu"``); the release never waits on ``prepare_inputs_event``,
so the ``_update_states`` wrapper does; vllm-ascend's PD-decode ``_update_states`` replacement is not composed with.
docs/releases/ascend-0.13.md: what is verified and how.
"""

from __future__ import annotations

from ..registry import HOST, ONE_STREAM, Guard, Patch, PatchSet, RestsOn
from . import early_output, graph_replay, npu_runner, spec_fixes
from .adapter import REFUSED_HERE, STILL_HOLDS, Adapter, Form, FormDecision


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
                spec_fixes.drop_ids_before_clamp(runner)  # consumed by the metadata, or never to be read
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
                spec_fixes.keep_ids_before_clamp(runner, total)
                runner.input_ids.gpu[:total].clamp_(min=0)
                self.correct(runner, st, query_start_loc[1 : n + 1] - query_start_loc[:n], total)
            return result

        return _init_model_kwargs


class _SlotsFromBlockTable:
    """Stands for ``MtpProposer.model`` during one ``_propose`` call (see MTP_DRAFT_SLOTS): before every model call
    after the first (draft steps 1 .. k-1), rewrites the draft tokens' slots ``[:batch_size]`` of the forward
    context's attention metadata from their positions and the block table, as the release's EAGLE proposer computes
    them; slots the release set to the padding id (positions past max_model_len) stay so. Attribute reads go to the
    model."""

    def __init__(self, model, block_table, batch_size: int, block_size: int) -> None:
        self.__dict__.update(_zb_model=model, _zb_table=block_table, _zb_rows=batch_size, _zb_block=block_size)
        self.__dict__["_zb_calls"] = 0

    def __getattr__(self, name):
        return getattr(self.__dict__["_zb_model"], name)

    def __call__(self, *args, **kwargs):
        self.__dict__["_zb_calls"] += 1
        if self.__dict__["_zb_calls"] > 1:
            self._zb_rewrite(kwargs["positions"] if "positions" in kwargs else args[1])
        return self.__dict__["_zb_model"](*args, **kwargs)

    def _zb_rewrite(self, positions) -> None:
        import torch
        from vllm.forward_context import get_forward_context

        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, dict):
            metadata = next(iter(metadata.values()))
        slots = metadata.slot_mapping
        n, block_size = self.__dict__["_zb_rows"], self.__dict__["_zb_block"]
        pos = positions[:n].to(torch.int64)
        block_ids = self.__dict__["_zb_table"][:n].gather(1, (pos // block_size).view(-1, 1)).view(-1)
        computed = (block_ids.to(torch.int64) * block_size + pos % block_size).to(slots.dtype)
        current = slots[:n]
        current.copy_(torch.where(current < 0, current, computed))


def make_mtp_propose(original):
    """Wrap ``MtpProposer._propose``: for the duration of the call its ``model`` is a :class:`_SlotsFromBlockTable`
    over the real one (restored after), when the release computes later draft steps' slots with ``+= 1`` (k >= 2, no
    context parallelism, no shared-expert DP)."""
    import functools
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def _propose(drafter, *args, **kwargs):
        if (
            drafter.num_speculative_tokens < 2
            or drafter.pcp_size * drafter.dcp_size > 1  # the release maps those slots from its own table
            or getattr(drafter, "enable_shared_expert_dp", False)  # positions are padded and reduced
            or "model" not in drafter.__dict__
        ):
            return original(drafter, *args, **kwargs)
        bound = signature.bind(drafter, *args, **kwargs)
        common = bound.arguments["common_attn_metadata"]
        batch_size = bound.arguments["next_token_ids"].shape[0]
        block_size = drafter.runner.input_batch.block_table.block_tables[0].block_size  # the table of the step-0 slots
        model = drafter.__dict__["model"]
        drafter.__dict__["model"] = _SlotsFromBlockTable(model, common.block_table_tensor, batch_size, block_size)
        try:
            return original(drafter, *args, **kwargs)
        finally:
            drafter.__dict__["model"] = model

    return _propose


def make_mtp_draft_forward_context(original):
    """Wrap the ``set_ascend_forward_context`` bound in 0.13's ``mtp_proposer`` module (the context the proposer enters
    before each draft model call): for a draft model's call outside a FULL graph, dense attention metadata whose
    host ``seq_lens`` the release moved on past its lists gets lists that follow them (see MTP_DRAFT_LENGTHS)."""
    import functools

    @functools.wraps(original)
    def set_ascend_forward_context(attn_metadata, *args, **kwargs):
        mode = getattr(kwargs.get("aclgraph_runtime_mode"), "name", "")
        if kwargs.get("is_draft_model") and isinstance(attn_metadata, dict) and mode != "FULL":
            for metadata in {id(m): m for m in attn_metadata.values()}.values():
                _follow_draft_seq_lens(metadata)
        return original(attn_metadata, *args, **kwargs)

    return set_ascend_forward_context


def _follow_draft_seq_lens(metadata) -> None:
    """Dense metadata (``attention_v1.AscendMetadata``: host ``seq_lens``, ``seq_lens_list``,
    ``actual_seq_lengths_q``) whose ``seq_lens`` differ from ``seq_lens_list`` is a later draft step's (the first
    step's are built equal; each later step adds one to ``seq_lens`` only): it gets one query token per request and
    the moved-on ``seq_lens`` as its lengths. Called once per draft pass: no import, no device read."""
    cls = type(metadata)
    if (cls.__name__, cls.__module__) != ("AscendMetadata", "vllm_ascend.attention.attention_v1"):
        return  # MLA metadata (the release updates its decode part), context-parallel metadata
    seq_lens = metadata.seq_lens
    if getattr(getattr(seq_lens, "device", None), "type", None) != "cpu":
        return  # lengths on the device (cross-attention metadata): reading them would wait for it
    lens = seq_lens.tolist()
    if lens != metadata.seq_lens_list:
        metadata.seq_lens_list = lens
        metadata.actual_seq_lengths_q = list(range(1, len(lens) + 1))


ZERO_BUBBLE = ZeroBubble013("0.13", other_runners="310P / torchair")

_REMOVE_WHEN = (
    "vllm-ascend 0.13.x is no longer served (upgrade path: vllm-ascend >= 0.19.1rc1 ships zero-bubble "
    "natively, #7640 / #8461); this adapter covers vllm-ascend 0.13.0 only, so the patch goes with it"
)
_UPSTREAM = ("vllm#32951", "vllm-ascend#7640", "vllm-ascend#8461", "vllm-ascend#10506")

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
)

_GROUP = "zero-bubble-0.13"

UPDATE_STATES = Patch(
    id="zb013-optimistic-update-states",
    rests_on=npu_runner.ZERO_BUBBLE_BACKPORT,
    group=_GROUP,
    target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
    make=ZERO_BUBBLE.make_update_states,
    fingerprints={"vllm 0.13.0": "71f7c9676bb77930"},
    why="vLLM 0.13's _update_states calls _get_valid_sampled_token_count() in its middle: the host blocks on step N's "
    "accepted-draft counts (event.synchronize) before it can prepare step N+1, so the NPU idles while the host "
    "prepares every step.",
    how="Wrapper. First waits on prepare_inputs_event (vLLM's synchronize_input_prep wait, which vllm-ascend 0.13 "
    "never makes: the classic sync ordered the reused host buffers). Then, for the duration of the release's "
    "call, _get_valid_sampled_token_count answers from the host with optimistic counts (prev_num_draft_len + 1 "
    "at every previous row): the release keeps the scheduler's optimistic num_computed_tokens and appends one "
    "output placeholder per draft. The rows it looks up are recorded as this step's corrections (request, "
    "drafts, previous row). Falls through unchanged when zero-bubble is not active on the runner.",
    upstream=_UPSTREAM,
    remove_when=_REMOVE_WHEN,
)

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
    upstream=_UPSTREAM,
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
    upstream=_UPSTREAM + ("vllm#38556",),
    remove_when=_REMOVE_WHEN,
)

EXECUTE_MODEL = Patch(
    id="zb013-deferred-correction",
    rests_on=npu_runner.ZERO_BUBBLE_BACKPORT,
    group=_GROUP,
    target="vllm_ascend.worker.model_runner_v1:NPUModelRunner.execute_model",
    make=ZERO_BUBBLE.make_execute_model,
    fingerprints={"vllm-ascend 0.13.0": "57d4b56dcef2d872"},
    why="req_state.num_computed_tokens stays optimistic after _update_states; it must be exact before "
    "sample_tokens and the next step.",
    how="Wrapper. After the release's execute_model returned (the forward is launched; also after its early "
    "returns), subtract the rejected drafts from each corrected request's num_computed_tokens, with the counts "
    "the host already waited for inside _prepare_inputs (vLLM 0.19's deferred correct_spec_decode_token_counts "
    "closure).",
    upstream=("vllm#32951",),
    remove_when=_REMOVE_WHEN,
)

COPY_VALID_COUNT = Patch(
    id="zb013-device-valid-count",
    rests_on=npu_runner.ZERO_BUBBLE_BACKPORT,
    group=_GROUP,
    target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._copy_valid_sampled_token_count",
    make=ZERO_BUBBLE.make_copy_valid_sampled_token_count,
    fingerprints={"vllm 0.13.0": "1defdf40921fa49a"},
    why="The device correction of the next step needs this step's valid sampled counts on the device; 0.13 only "
    "copies them to the host.",
    how="Wrapper. After the release's copy (side stream, event; the default stream is captured before the "
    "side-stream context, so the copy waits for the sampler: vllm-ascend #9482's bug is absent), keep a "
    "reference to the device count tensor (int64 from the Ascend proposer; the host buffer is int64 too: no "
    "dtype cast). Consumed once by the next hook.",
    upstream=("vllm#32951", "vllm-ascend#8766", "vllm-ascend#10205"),
    remove_when=_REMOVE_WHEN,
)

BACKUP_STAGING = Patch(
    id="zb013-backup-token-staging",
    rests_on=npu_runner.BACKUP_STAGING_ONE_STREAM,
    group=_GROUP,
    target="vllm_ascend.spec_decode.eagle_proposer:EagleProposer.prepare_next_token_ids_padded",
    make=ZERO_BUBBLE.make_prepare_next_token_ids_padded,
    fingerprints={"vllm-ascend 0.13.0": "b04a2a09323e2c31"},
    why="The drafter's backup tokens are written to a reused pinned buffer and copied to the device "
    "non-blocking. The classic path waited every step on an event recorded after that copy; without that wait "
    "the next step can rewrite the buffer while this step's copy is still queued.",
    how="Wrapper (MtpProposer inherits the method). Alternate two backup buffers between calls; a buffer is "
    "rewritten two steps later, after the _update_states wrapper waited on an input-preparation event recorded "
    "behind its copy. The backup index itself is unchanged: it reads the metadata's seq_lens_cpu, which the "
    "hook makes exact (vLLM #38098 cannot occur).",
    upstream=("vllm#38098", "vllm#38556"),
    remove_when=_REMOVE_WHEN,
)

COMPILE_KERNELS = Patch(
    id="zb013-compile-kernels-at-start",
    rests_on=npu_runner.ZERO_BUBBLE_BACKPORT,
    group=_GROUP,
    target="vllm_ascend.worker.model_runner_v1:NPUModelRunner.initialize_kv_cache",
    make=ZERO_BUBBLE.make_initialize_kv_cache,
    fingerprints={"vllm-ascend 0.13.0": "293de2f60b4290d1"},
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

EXACT_COUNTS = early_output.patches({"vllm-ascend 0.13.0": "207f651e97972538"}, {"vllm 0.13.0": "26d90667e22b8057"})
# ----------------------------------------------------------------------------------------------------------------
# Fixes of the release's own async + speculative-decoding defects (with or without zero-bubble): not in the
# zero-bubble group, applied whenever their defect can bite, each with its own ZB_PATCH_DISABLE id.
# ----------------------------------------------------------------------------------------------------------------

STALE_DRAFT_PLACEHOLDERS = Patch(
    id="stale-draft-placeholders",
    rests_on=spec_fixes.STALE_DRAFTS_ONE_STREAM,
    group="stale-draft-placeholders",
    target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_input_ids",
    make=spec_fixes.make_prepare_input_ids,
    fingerprints={"vllm 0.13.0": "5932e601684fdc7a"},
    why="(vLLM #37159; on vLLM 0.13 also #31944's preemption case) Async scheduling gives every scheduled decode "
    "request `[-1] * k` draft placeholders, which _prepare_input_ids replaces on the device with the previous "
    "step's drafts, but only for rows of the previous step's batch. A request that was not in that batch comes "
    "back with drafts nothing replaces: one the scheduler skipped for a step (it keeps the placeholders), and on "
    "vLLM 0.13 one that was preempted and resumed (_preempt_request keeps spec_token_ids until vLLM 0.14, #31944: "
    "the stale placeholders are scheduled with the last chunk of the recomputed prompt). vLLM 0.13 does not even "
    "write a re-added row's scheduled drafts into token_ids_cpu, so its draft input ids are whatever the row held "
    "before: a token of another request or a `-1`, which crashes the embedding (classic async, EAGLE k = 3, 4 on "
    "the big workload: docs/e2e.md). zero-bubble's clamp at 0 (zb013-corrections-before-metadata) only turns "
    "them into junk token 0 drafts.",
    how="Wrapper (zb_patch.versions.spec_fixes). Before the release's body (which sets _draft_token_ids to None on "
    "vLLM 0.13): the drafts proposed in the previous step for each request that was sampled there and is not in "
    "this step's batch are kept (a device clone of its row of _draft_token_ids). After the body: a row that has "
    "scheduled drafts and was not in the previous batch gets its kept drafts written over its draft input ids "
    "(device copy; the rejection sampler reads the drafts from the same input ids): the drafts it would have "
    "been verified with without the skip or the preemption. No host wait. Applies with async scheduling + spec "
    "decode whether or not zero-bubble is active; a runner that prepares input ids elsewhere (PCP) is not "
    "covered.",
    upstream=("vllm#37159", "vllm#31944", "vllm#36906", "vllm#43434"),
    remove_when=_REMOVE_WHEN,
)

STALE_DRAFT_ROWS = spec_fixes.stale_draft_rows({"vllm 0.13.0": "cf5a63628bde6da9"}, _REMOVE_WHEN)

READDED_REQUEST_DRAFTS = Patch(
    id="readded-request-drafts",
    rests_on=RestsOn(
        HOST,
        "host writes to the persistent batch (token_ids_cpu, num_tokens, spec_token_ids) before the step's inputs are built from it; no device op",
    ),
    target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._may_reorder_batch",
    make=spec_fixes.make_may_reorder_batch,
    fingerprints={"vllm 0.13.0": "5043e96df8f91dc5"},
    why="(vLLM #31944, in vLLM 0.14.0) vLLM 0.13's scheduler keeps a preempted request's spec_token_ids, and any "
    "request's over a step it was not scheduled in, and schedules them again with the request: a resumed request "
    "gets them with the last chunk of its recomputed prompt. Its runner writes a request's scheduled drafts into "
    "the persistent batch (token_ids_cpu, spec_token_ids, num_tokens) only for rows that stayed in the batch; a "
    "row re-added for a skipped or preempted request keeps what its slot held before, so the model and the "
    "rejection sampler get another request's tokens (or a -1) as its drafts. Synchronous scheduling verifies junk "
    "there (no crash, lost acceptance); under async scheduling it is where stale-draft-placeholders writes the "
    "request's real drafts. #31944 writes them (InputBatch.update_req_spec_token_ids on the re-added rows) and also "
    "clears spec_token_ids at preemption in the scheduler; zb-patch patches worker processes only (the scheduler "
    "runs in the EngineCore process), so the kept drafts are verified with the recomputed prompt, as vLLM 0.13's "
    "sync scheduling meant to: they are the request's drafts for the position it resumes at.",
    how="Wrapper (zb_patch.versions.spec_fixes). _update_states calls _may_reorder_batch right after re-adding the "
    "requests that were not in the batch (guarded); first, each row whose spec_token_ids is empty while drafts are "
    "scheduled for it (the re-added ones: the other path always fills the list) gets them written into "
    "token_ids_cpu after its tokens, num_tokens and spec_token_ids, as vLLM 0.14's update_req_spec_token_ids does. "
    "Host work only, no device op. Synchronous and async scheduling alike, zero-bubble active or not.",
    upstream=("vllm#31944", "vllm#30916"),
    remove_when=_REMOVE_WHEN,
)

MTP_DRAFT_SLOTS = Patch(
    id="mtp-draft-slots",
    rests_on=RestsOn(
        ONE_STREAM,
        "device ops on the draft tokens' slot tensor, queued on the drafter's stream before each draft model call that reads it (program order); no host wait",
    ),
    target="vllm_ascend.spec_decode.mtp_proposer:MtpProposer._propose",
    make=make_mtp_propose,
    fingerprints={"vllm-ascend 0.13.0": "97cc12b8c7e3a7b1"},
    why="vllm-ascend 0.13's MtpProposer, k >= 2: after the first draft step it moves every draft token's KV slot on "
    "with `slot_mapping += 1` (spec_decode/mtp_proposer.py:504). A draft position that starts a new block gets the "
    "slot after the last one of its block: slot 0 of the next block *id*, which belongs to another request (its MTP "
    "layer's KV there is overwritten), or, after the cache's last block, one past the cache (an out-of-range write; "
    "the emulated op raises). In synchronous and async scheduling alike, with or without zb-patch. vllm-ascend "
    "#7033 (0.16.0rc1) deleted MtpProposer (MTP runs on the EAGLE proposer, which maps slots through the block "
    "table); never backported to 0.13.",
    how="Wrapper. For the duration of the release's _propose its `model` attribute is a thin stand-in "
    "(ascend_0_13._SlotsFromBlockTable; attribute reads go to the model): before each model call after the first, "
    "it rewrites the draft tokens' slots in the forward context's attention metadata from their (clamped) "
    "positions and the common metadata's block table, `block_table[row, pos // block_size] * block_size + pos % "
    "block_size` with the block size of the table the first step's slots came from, as the release's EAGLE "
    "proposer does; padding slots (positions past max_model_len) stay padding. The scheduler allocates the draft "
    "positions' blocks ahead (lookahead tokens), so every row maps into its own blocks. Device ops only. Left to "
    "the release: k = 1 (no later step), PCP / DCP > 1 (its own slot table), shared-expert DP (padded positions), "
    "the torchair MTP proposer. Applies with or without async scheduling and zero-bubble.",
    upstream=("vllm-ascend#7033",),
    remove_when=_REMOVE_WHEN,
)
MTP_DRAFT_LENGTHS = Patch(
    id="mtp-draft-lengths",
    rests_on=RestsOn(
        HOST,
        "the attention metadata's host lists only (seq_lens_list, actual_seq_lengths_q), set before the draft model call that reads them",
    ),
    target="vllm_ascend.spec_decode.mtp_proposer:set_ascend_forward_context",
    make=make_mtp_draft_forward_context,
    fingerprints={"vllm-ascend 0.13.0": "46d81270954ae85b"},
    why="vllm-ascend 0.13's MtpProposer, k >= 2, dense attention (attention_v1: a target without MLA, MiMo here): "
    "after the first draft step it moves the host seq_lens on by one per step and sets query_start_loc to one token "
    "per request, but updates seq_lens_list and actual_seq_lengths_q only in MLA metadata's decode part "
    "(spec_decode/mtp_proposer.py:412, :495; the MLA part :470, :550). The dense backend hands FIA the top-level lists "
    "(attention_v1.py _get_fia_params, forward_fused_infer_attention), so every later draft step attends with the "
    "first step's lengths: its own newest KV entry is not seen, and the first step's cumulative query ends (k + 1 "
    "tokens per decode request) assign the one-token rows to the wrong requests, so a later draft reads another "
    "request's KV and depends on what else is in the batch. On the test model every draft after the first is "
    "rejected (docs/e2e.md), and which ones are accepted by chance differs between sync and async "
    "scheduling. With or without async scheduling and zero-bubble. vllm-ascend #7033 (0.16.0rc1) deleted "
    "MtpProposer; never backported to 0.13.",
    how="Wrapper of the set_ascend_forward_context binding in vllm_ascend.spec_decode.mtp_proposer (the proposer enters "
    "it before each draft model call). For a draft model's call outside a FULL graph, each attention_v1.AscendMetadata "
    "whose host seq_lens differ from its seq_lens_list (the first step's are built equal; a later step is the only "
    "one that moves seq_lens alone) gets seq_lens_list = seq_lens and actual_seq_lengths_q = 1 .. batch size, what "
    "the release gives its MLA decode metadata at the same step. Host lists only, no device op or wait. Left as "
    "released: MLA metadata, FULL graph replays of the draft model (not shown with the change), context parallelism "
    "(other metadata classes).",
    upstream=("vllm-ascend#7033",),
    remove_when=_REMOVE_WHEN,
)
DRAFT_PLACEHOLDERS_AFTER_METADATA = spec_fixes.draft_placeholders_after_metadata(
    {"vllm-ascend 0.13.0": "c8889f0865f578a3"},
    release_lines="RecomputeScheduler.add_request, core/recompute_scheduler.py:110; the drafts gathered in "
    "_calc_spec_decode_metadata, model_runner_v1.py:1301, after _init_model_kwargs (:776)",
    remove_when=_REMOVE_WHEN,
    not_covered=" Not covered: a multimodal / prompt-embeds model without zero-bubble, which the release embeds "
    "inside _prepare_inputs before the metadata (model_runner_v1.py:779-830).",
)
DRAFT_SAMPLE_INDICES = spec_fixes.draft_sample_indices(
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

PATCHES: tuple = (
    UPDATE_STATES,
    PREPARE_INPUTS,
    INIT_MODEL_KWARGS,
    EXECUTE_MODEL,
    COPY_VALID_COUNT,
    BACKUP_STAGING,
    COMPILE_KERNELS,
    *EXACT_COUNTS,
    STALE_DRAFT_PLACEHOLDERS,
    STALE_DRAFT_ROWS,
    READDED_REQUEST_DRAFTS,
    MTP_DRAFT_SLOTS,
    MTP_DRAFT_LENGTHS,
    DRAFT_SAMPLE_INDICES,
    DRAFT_PLACEHOLDERS_AFTER_METADATA,
    PIECEWISE_ONCE_PER_STEP,
    PIECEWISE_NO_DRAIN,
    *FULL_ORDERED_ON_DEVICE,
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
                "positions / seq_lens / query_start_loc are the same CpuGpuBuffers; added: the "
                f"{_DSV4} state (swa / state block-table buffers, swa_metadata_builder)",
            ),
            "guard:vllm_ascend.spec_decode.eagle_proposer:EagleProposer.prepare_inputs_padded": FormDecision(
                STILL_HOLDS,
                "still derives the draft metadata from the common metadata (seq_lens_cpu as before); passes "
                "positions_cpu and the DeepSeek-V4 state / swa fields on as well",
            ),
            "guard:vllm_ascend.spec_decode.eagle_proposer:EagleProposer._propose": FormDecision(
                STILL_HOLDS,
                "reads the same seq_lens_cpu and positions; only the update_cos_sin call after the first build is gone",
            ),
            "guard:vllm_ascend.spec_decode.mtp_proposer:MtpProposer._propose": FormDecision(
                STILL_HOLDS,
                f"without {_DSV4} the draft loop is as at the tag (later steps move the host seq_lens on without the "
                "dense lists, which mtp-draft-lengths follows); added: the DeepSeek-V4 branches and "
                "is_draft_model=True to the DP metadata sync",
            ),
            "guard:vllm_ascend.attention.utils:AscendCommonAttentionMetadata.unpadded": FormDecision(
                STILL_HOLDS, "keeps seq_lens_cpu; passes positions_cpu and the DeepSeek-V4 state / swa fields on"
            ),
            "guard:vllm_ascend.worker.block_table:BlockTable.__init__": FormDecision(
                REFUSED_HERE,
                "a KV-cache group with compress_ratio divides max_num_blocks_per_req and max_num_batched_tokens by it "
                f"({_DSV4}); only the zero-bubble-0.13 group's device slot mapping relies on them, refused here",
            ),
            "guard:vllm_ascend.worker.block_table:MultiGroupBlockTable.compute_slot_mapping": FormDecision(
                REFUSED_HERE,
                f"maps each KV-cache group from its own compressed positions and request indices when given ({_DSV4}); "
                "zero-bubble's device slot mapping maps every group from the uncompressed positions: only the "
                "zero-bubble-0.13 group relies on it, refused here",
            ),
            "zb013-prepare-inputs-window": FormDecision(
                REFUSED_HERE,
                f"adds {_DSV4}'s compressed slot mapping (get_compressed_pos_and_indices) and the sliding-window slot "
                "mapping and block tables, computed on the host from the optimistic positions, which the device "
                "correction does not rewrite; the wrapper has no per-model switch, so the zero-bubble-0.13 group is "
                "refused on this commit",
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
                f"adds {_DSV4} branches (swa_metadata_builder, DSA decode metadata, swa_slot_mapping moved on with "
                "+= 1 beside slot_mapping); the wrapper rewrites slot_mapping alone from the first table's block size "
                "and has no per-model switch",
            ),
            "mtp-draft-lengths": FormDecision(
                STILL_HOLDS,
                "set_ascend_forward_context (re-exported from ascend_forward_context) gains an input_ids keyword "
                "stored on the forward context; the wrapper passes every argument through and reads only "
                "is_draft_model / aclgraph_runtime_mode",
            ),
        },
    ),
)

ADAPTER = Adapter(
    id="ascend-0.13",
    title="vllm-ascend 0.13.0 + vLLM 0.13.x (zero-bubble async scheduling + EAGLE/MTP spec decode backport)",
    vllm_ascend=((0, 13, 0), (0, 14)),
    vllm=((0, 13, 0), (0, 14)),
    zero_bubble_ids=tuple(p.id for p in PATCHES if p.group == "zero-bubble-0.13"),
    patch_set=PatchSet("ascend-0.13", PATCHES, GUARDS),
    preload=("vllm_ascend.platform", "vllm_ascend.worker.worker"),
    releases=("0.13.0",),
    commits=COMMITS,
    notes="vllm-ascend 0.13.0 pins vLLM 0.13.0 (the only 0.13.x on PyPI); async scheduling is opt-in there "
    "(--async-scheduling).",
)
