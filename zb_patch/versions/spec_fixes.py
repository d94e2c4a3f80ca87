"""Fixes of upstream speculative-decoding defects (most of them async-scheduling ones), shared by the adapters of the
releases that have them (written once, declared by each adapter with its own fingerprints).

These are *fixes*, not zero-bubble: each applies whenever its defect can bite (speculative decoding on, with async
scheduling where the defect needs it, whatever zero-bubble decides for the runner), and each is its own patch id,
so ``ZB_PATCH=1 ZB_PATCH_DISABLE=<the zero-bubble patches>`` gives the release's classic async path with only the
fixes.

Every fix here is worker-side: zb-patch applies an adapter's patch set in a process once all of its target modules
are imported, and the scheduler (EngineCore process) and the runner (worker processes, with the multiprocess or Ray
executors) live in different processes, so a fix that needed both would never apply.

Nothing heavy is imported at module level: torch only inside the functions a patched method calls.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

from ..registry import HOST, ONE_STREAM, Patch, RestsOn

# What the shared fixes rest on (their specs' rests_on).
STALE_DRAFTS_ONE_STREAM = RestsOn(
    ONE_STREAM,
    "device clones and copies of draft ids, queued on the stream of the step's input preparation before the forward "
    "and the rejection sampler read them (program order); no host wait",
)
DRAFT_LENGTHS_ONE_STREAM = RestsOn(
    ONE_STREAM,
    "device ops on the common metadata's device seq_lens, queued on the drafter's stream before the draft forward "
    "reads them, and host ops on its host copy; no host wait",
)

# ----------------------------------------------------------------------------------------------------------------
# vLLM #37159: a request that holds "-1" draft placeholders and skips a step gets them back as its input ids
# ----------------------------------------------------------------------------------------------------------------

SAVED_DRAFTS_ATTR = "_zb_patch_saved_drafts"  # per-runner state, in the runner's __dict__
LEFT_ROWS_ATTR = "_zb_patch_left_rows"  # per-batch: req_id -> its row in the previous step, for requests removed since


@dataclasses.dataclass
class SavedDrafts:
    """The drafts the runner proposed for requests that then left the batch (skipped a step or were preempted)
    while the scheduler holds their ``-1`` placeholders; consumed when the request is back with scheduled drafts."""

    drafts: dict = dataclasses.field(default_factory=dict)  # req_id -> device tensor [num_spec_tokens]
    # diagnostics (tests, reports)
    saved: int = 0  # drafts kept for a request that left the batch
    filled: int = 0  # rows whose draft input ids were replaced by the kept drafts
    filled_tokens: int = 0
    unknown: int = 0  # rows back with scheduled drafts but no kept drafts (the release's ids stay)


def saved_drafts(runner: Any) -> SavedDrafts:
    st = runner.__dict__.get(SAVED_DRAFTS_ATTR)
    if st is None:
        st = runner.__dict__[SAVED_DRAFTS_ATTR] = SavedDrafts()
    return st


def make_prepare_input_ids(original: Callable) -> Callable:
    """Wrap ``GPUModelRunner._prepare_input_ids`` (vLLM 0.13 / 0.18: ``(scheduler_output, total_num_scheduled_tokens,
    cu_num_tokens)``; vLLM 0.19+: ``(scheduler_output, num_reqs, total_num_scheduled_tokens, cu_num_tokens)``).

    Under async scheduling the scheduler gives every scheduled decode request ``[-1] * k`` draft placeholders, and
    the runner's ``_prepare_input_ids`` replaces them on the device with the drafts it proposed in the previous step
    -- but only for rows of the previous step's batch. A request that left the batch for a step (the scheduler
    skipped it, or preempted it) comes back with the same placeholders (vLLM's async scheduler keeps them; vLLM
    0.13 also keeps them over a preemption) and nothing replaces them: ``-1`` ids reach the embedding (vLLM #37159).

    The wrapper keeps, on the device, the drafts proposed for each request that leaves the batch (read from the
    previous step's draft tensor at the request's previous row, which :func:`make_remove_request` records, before
    the release's body runs: vLLM 0.13 clears that tensor there), and after the release's body writes them over the draft input ids of a row that is back
    with scheduled drafts and was not in the previous step's batch. Those are the drafts the request would have
    been verified with had it not skipped the step -- the ones synchronous scheduling verifies -- so the tokens
    and the acceptance are the sync run's. No host wait: slicing, cloning and copying device tensors only.
    """
    try:
        cu_index = list(inspect.signature(original).parameters).index("cu_num_tokens")
    except ValueError:
        cu_index = -1

    @functools.wraps(original)
    def _prepare_input_ids(runner, scheduler_output, *args, **kwargs):
        if not (getattr(runner, "use_async_scheduling", False) and getattr(runner, "num_spec_tokens", 0)):
            runner.input_batch.__dict__.pop(LEFT_ROWS_ATTR, None)  # async without drafts: nothing to keep
            return original(runner, scheduler_output, *args, **kwargs)
        st = saved_drafts(runner)
        keep_leaving_drafts(runner, st)  # before the body: vLLM 0.13's body sets _draft_token_ids to None
        result = original(runner, scheduler_output, *args, **kwargs)
        if "cu_num_tokens" in kwargs:
            cu_num_tokens = kwargs["cu_num_tokens"]
        else:
            cu_num_tokens = args[cu_index - 2] if cu_index >= 2 else args[-1]  # positional (self, scheduler_output)
        fill_returning_drafts(runner, st, scheduler_output, cu_num_tokens)
        return result

    return _prepare_input_ids


def keep_leaving_drafts(runner: Any, st: SavedDrafts) -> None:
    """Keep the drafts proposed in the last proposing step for every request that was sampled there and has left the
    batch since (it may be back already) (recorded by the ``InputBatch.remove_request`` wrapper; finished requests are no longer in
    ``runner.requests``). Runs before the release's body, so ``_draft_token_ids`` is still the proposal of the step
    whose rows were recorded: between a removal and the next input preparation no step proposes (an empty step
    returns before both)."""
    import torch

    batch = runner.input_batch
    left = batch.__dict__.pop(LEFT_ROWS_ATTR, None)
    drafts = runner._draft_token_ids
    if not left or not isinstance(drafts, torch.Tensor):
        return
    # drafts per row of that proposal (vLLM 0.24+ keeps it as prev_num_spec_tokens = _draft_token_ids.shape[1])
    width = drafts.shape[1] if drafts.dim() == 2 else runner.num_spec_tokens
    flat = drafts.reshape(-1)
    for req_id, row in left.items():
        # still alive: skipped, preempted, or already back in this step's batch (the step it was skipped in had no
        # tokens at all, so this is the first input preparation since it left)
        if req_id not in runner.requests:
            continue
        st.drafts[req_id] = flat[row * width : (row + 1) * width].clone()  # device copy: the tensor may be reused
        st.saved += 1


def make_remove_request(original: Callable) -> Callable:
    """Wrap ``InputBatch.remove_request``: it drops the request from ``prev_req_id_to_index`` (the previous step's
    sampled rows), which is the only record of where the request's drafts are in the runner's last proposal. Its
    row there is recorded on the batch first (read once by the ``_prepare_input_ids`` wrapper); nothing else
    changes."""

    @functools.wraps(original)
    def remove_request(batch, req_id, *args, **kwargs):
        prev = batch.prev_req_id_to_index
        row = prev.get(req_id) if prev else None
        result = original(batch, req_id, *args, **kwargs)
        if row is not None:
            left = batch.__dict__.get(LEFT_ROWS_ATTR)
            if left is None:
                left = batch.__dict__[LEFT_ROWS_ATTR] = {}
            left[req_id] = row
        return result

    return remove_request


def stale_draft_rows(fingerprints: dict[str, str], remove_when: str, forms: str = "") -> Patch:
    """``stale-draft-placeholders-rows``, the ``InputBatch.remove_request`` half of the #37159 fix, for an adapter
    whose vLLM forms are ``fingerprints`` (``forms``: how those forms differ, where they do)."""
    return Patch(
        id="stale-draft-placeholders-rows",
        rests_on=RestsOn(HOST, "a host record of the removed request's previous row, kept on the input batch"),
        group="stale-draft-placeholders",
        target="vllm.v1.worker.gpu_input_batch:InputBatch.remove_request",
        make=make_remove_request,
        fingerprints=fingerprints,
        why="Half of stale-draft-placeholders (same group): removing a request from the persistent batch also drops "
        "it from prev_req_id_to_index, the only record of its row in the runner's last draft proposal, which the "
        "_prepare_input_ids wrapper needs to keep the request's drafts.",
        how="Wrapper (zb_patch.versions.spec_fixes). Records the removed request's previous row on the batch before "
        "the release's body drops it; the _prepare_input_ids wrapper reads the record once (every input "
        "preparation) and keeps the drafts of the requests that are still alive." + (f" {forms}" if forms else ""),
        upstream=("vllm#37159",),
        remove_when=remove_when,
    )


def fill_returning_drafts(runner: Any, st: SavedDrafts, scheduler_output: Any, cu_num_tokens: Any) -> None:
    """Write the kept drafts over the draft input ids of each row that has scheduled drafts and was not in the
    previous step's batch; forget the kept drafts of requests that were sampled again (they have fresher ones) or
    finished."""
    batch = runner.input_batch
    prev = batch.prev_req_id_to_index
    spec = scheduler_output.scheduled_spec_decode_tokens
    kept = st.drafts
    if not kept and not spec:
        return
    input_ids = runner.input_ids.gpu
    for req_id, index in batch.req_id_to_index.items():
        if prev is not None and req_id in prev:
            if kept:
                kept.pop(req_id, None)  # sampled last step: the release scatters its fresh drafts
            continue
        num_drafts = len(spec.get(req_id, ()))
        if not num_drafts:
            continue  # e.g. a chunk of a recomputed prompt: its drafts wait for the last chunk
        drafts = kept.pop(req_id, None)
        if drafts is None:
            st.unknown += 1
            continue
        end = int(cu_num_tokens[index])
        input_ids[end - num_drafts : end].copy_(drafts[:num_drafts], non_blocking=True)
        st.filled += 1
        st.filled_tokens += num_drafts
    if kept:
        for req_id in [r for r in kept if r not in runner.requests]:
            del kept[req_id]


# ----------------------------------------------------------------------------------------------------------------
# vLLM 0.13 (fixed by vLLM #31944 in 0.14): a request re-added to the persistent batch (skipped for a step, or
# preempted and resumed) is scheduled with drafts its row never receives
# ----------------------------------------------------------------------------------------------------------------


def make_may_reorder_batch(original: Callable) -> Callable:
    """Wrap ``GPUModelRunner._may_reorder_batch(scheduler_output)`` (vLLM 0.13), which ``_update_states`` calls right
    after it re-added the requests that were not in the persistent batch: first give each re-added row its scheduled
    drafts, as vLLM 0.14+ does there with ``InputBatch.update_req_spec_token_ids`` (#31944).

    vLLM 0.13's ``_update_states`` writes a request's scheduled draft ids into ``token_ids_cpu`` (and
    ``spec_token_ids``, ``num_tokens``) only on the path of rows that stayed in the batch; a re-added row keeps
    whatever its slot held before (``add_request`` empties its ``spec_token_ids``), so the model and the rejection
    sampler get another request's tokens or a ``-1`` as its drafts. Re-added rows with drafts are exactly the rows
    whose ``spec_token_ids`` is empty while the scheduler scheduled drafts for them (the other path always fills it).
    Synchronous scheduling: those are the request's real drafts (the scheduler keeps them over a preemption until
    vLLM 0.14, #31944, and over a skipped step). Async scheduling: the scheduler's ``-1`` placeholders, which the
    ``stale-draft-placeholders`` fix replaces with the request's drafts on the device. Host work only.
    """

    @functools.wraps(original)
    def _may_reorder_batch(runner, scheduler_output, *args, **kwargs):
        write_readded_drafts(runner, scheduler_output)
        return original(runner, scheduler_output, *args, **kwargs)

    return _may_reorder_batch


READDED_ATTR = "_zb_patch_readded_drafts"  # per-runner count of re-added rows given their drafts (diagnostics)


def write_readded_drafts(runner: Any, scheduler_output: Any) -> None:
    spec = scheduler_output.scheduled_spec_decode_tokens
    if not spec:
        return
    batch = runner.input_batch
    written = 0
    for req_id, drafts in spec.items():
        index = batch.req_id_to_index.get(req_id)
        if index is None or not drafts or batch.spec_token_ids[index]:
            continue  # not in the batch, no drafts, or a row that stayed (its drafts were written)
        start = batch.num_tokens_no_spec[index]
        batch.token_ids_cpu[index, start : start + len(drafts)] = drafts
        batch.num_tokens[index] = start + len(drafts)  # vLLM 0.13: num_tokens may include spec tokens
        batch.spec_token_ids[index].extend(drafts)
        written += 1
    if written:
        runner.__dict__[READDED_ATTR] = runner.__dict__.get(READDED_ATTR, 0) + written


# ----------------------------------------------------------------------------------------------------------------
# vllm-ascend 0.18.0 / 0.19.1rc1 / 0.20.2rc1 (fixed by #10112 on releases/v0.18.0, #10147 in 0.21.0rc1): the drafter's
# sequence lengths of a request at max_model_len, masked differently on the device and on the host
# ----------------------------------------------------------------------------------------------------------------


def make_attn_update_stack_num_spec_norm(original: Callable) -> Callable:
    """Wrap ``SpecDecodeBaseProposer.attn_update_stack_num_spec_norm`` (draft steps 1 .. k-1 of the EAGLE / MTP
    proposer): the attention metadata of a draft step is built from sequence lengths masked as vllm-ascend #10112 /
    #10147 mask them.

    The release adds 1 to the draft rows' sequence lengths, then sets those of requests past ``max_model_len`` to 1:
    on the device by the *position* (``>= max_model_len``, the step's input position), on the host by the sequence
    length (``>= max_model_len``). The two disagree: a length that reaches ``max_model_len`` keeps it on the device and
    gets 1 on the host -- also for a row whose position is still below the limit, because the padded drafter's
    lengths count the step's rejected drafts, so that row's draft attends to one KV entry -- and a request masked in
    one step gets 1 again on the device but 2, 3, ... on the host in the next ones (the masked length is the next
    step's base). Ascend attention takes its lengths from the host copy and other kernels from the device one.
    #10112 masks both by ``seq_lens > max_model_len``.

    The release's own body runs; the metadata builder it is handed (``attn_group``) is a stand-in whose
    ``build_for_drafting`` first rewrites the draft rows' lengths of the step's common metadata to ``previous + 1``,
    set to 1 where that exceeds ``max_model_len`` (device ``seq_lens``, host ``seq_lens_cpu`` and, where the class has
    it, ``_seq_lens_cpu``), then builds. The previous lengths are those of the metadata the step was derived from,
    which the release clones before it adds (so they are unchanged) and which, from the second draft step on, is the
    previous step's corrected metadata. No host wait: the device rewrite is device ops, the host one host ops.
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def attn_update_stack_num_spec_norm(proposer, *args, **kwargs):
        bound = signature.bind(proposer, *args, **kwargs)
        group = bound.arguments.get("attn_group")
        if group is None:
            return original(proposer, *args, **kwargs)
        bound.arguments["attn_group"] = _MaskedLengthsGroup(
            group, bound.arguments["old_common_metadata"], bound.arguments["batch_size"], proposer.max_model_len
        )
        return original(*bound.args, **bound.kwargs)

    return attn_update_stack_num_spec_norm


class _MaskedLengthsGroup:
    """The attention group handed to one ``attn_update_stack_num_spec_norm`` call: its metadata builder masks the
    draft rows' lengths before building (see :func:`make_attn_update_stack_num_spec_norm`); everything else is the
    group's."""

    def __init__(self, group: Any, previous: Any, rows: int, max_model_len: int) -> None:
        self._zb_group, self._zb_previous, self._zb_rows, self._zb_max = group, previous, rows, max_model_len

    def __getattr__(self, name: str) -> Any:
        return getattr(self._zb_group, name)

    def get_metadata_builder(self, *args: Any, **kwargs: Any) -> Any:
        return _MaskedLengthsBuilder(self._zb_group.get_metadata_builder(*args, **kwargs), self)


class _MaskedLengthsBuilder:
    def __init__(self, builder: Any, group: _MaskedLengthsGroup) -> None:
        self._zb_builder, self._zb_group = builder, group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._zb_builder, name)

    def build_for_drafting(self, *args: Any, **kwargs: Any) -> Any:
        self._zb_mask(args, kwargs)
        return self._zb_builder.build_for_drafting(*args, **kwargs)

    def build(self, *args: Any, **kwargs: Any) -> Any:  # vllm-ascend 0.20.2rc1 builds draft steps with build()
        self._zb_mask(args, kwargs)
        return self._zb_builder.build(*args, **kwargs)

    def _zb_mask(self, args: tuple, kwargs: dict) -> None:
        common = kwargs.get("common_attn_metadata")
        if common is None:  # positional: (common, ...) or (draft_step / prefix length, common, ...)
            common = next(a for a in args if hasattr(a, "seq_lens_cpu"))
        group = self._zb_group
        mask_draft_lengths(common, group._zb_previous, group._zb_rows, group._zb_max)


def mask_draft_lengths(common: Any, previous: Any, rows: int, max_model_len: int) -> None:
    """``common``'s lengths ``[:rows]`` = ``previous``'s + 1, set to 1 past ``max_model_len`` (vllm-ascend #10112)."""
    import torch

    lengths = previous.seq_lens[:rows] + 1
    common.seq_lens[:rows] = torch.where(lengths > max_model_len, torch.ones_like(lengths), lengths)
    for name in ("seq_lens_cpu", "_seq_lens_cpu"):
        before = getattr(previous, name, None)
        after = getattr(common, name, None)
        if before is None or after is None:
            continue
        host = before[:rows] + 1
        after[:rows] = torch.where(host > max_model_len, torch.ones_like(host), host)


# ----------------------------------------------------------------------------------------------------------------
# vllm-ascend 0.18, MLA + MTP / EAGLE, k >= 2: every draft position's decode RoPE rows are views of one buffer
# ----------------------------------------------------------------------------------------------------------------

ROPE_ROWS_ATTR = "_zb_patch_rope_rows"  # per-proposer: [(cos rows, sin rows)] by draft position
_DRAFTING = threading.local()  # .call: the proposer call in progress on this thread (a _DraftCall) or None


@dataclasses.dataclass
class _DraftCall:
    rows: list  # the proposer's buffers, by draft position
    positions: int  # num_speculative_tokens: builds past that many keep the release's rows
    built: int = 0  # decode RoPE builds so far in this call


def make_drafting(original: Callable) -> Callable:
    """Wrap a proposer method that builds the metadata of its draft positions in order (``_propose`` at run time,
    ``dummy_run`` for FULL-graph capture): while it runs, the n-th decode RoPE build of this thread is draft
    position n's (:func:`make_get_cos_and_sin_mla`)."""

    @functools.wraps(original)
    def drafting(proposer, *args, **kwargs):
        outer = getattr(_DRAFTING, "call", None)
        rows = proposer.__dict__.setdefault(ROPE_ROWS_ATTR, [])
        _DRAFTING.call = _DraftCall(rows, proposer.num_speculative_tokens)
        try:
            return original(proposer, *args, **kwargs)
        finally:
            _DRAFTING.call = outer

    return drafting


def make_get_cos_and_sin_mla(original: Callable) -> Callable:
    """Wrap ``rotary_embedding.get_cos_and_sin_mla``: inside a proposer call (:func:`make_drafting`), the decode
    rows (``use_cache=True``) of draft position n are returned from a static buffer of position n's own.

    The release writes the rows into the one static buffer ``_cos_mla`` / ``_sin_mla`` and returns views of it; the
    proposer builds the metadata of every draft position before its model runs, so each later build rewrites the
    rows an earlier position reads. The wrapper lets the release write and then copies the rows it wrote into
    position n's buffer, allocated once like the shared one: every position keeps its rows, at the same address at
    every build, at capture and at run time (a captured FULL graph reads what the next build writes). Outside a
    proposer call (the target's builds), for rows of another layout, and past the k-th build of one call, the
    release's result is returned unchanged."""

    @functools.wraps(original)
    def get_cos_and_sin_mla(positions, use_cache=False):
        cos, sin = original(positions, use_cache)
        call = getattr(_DRAFTING, "call", None)
        if not use_cache or call is None:
            return cos, sin
        from vllm_ascend.ops import rotary_embedding as rope

        shared_cos, shared_sin = rope._cos_mla, rope._sin_mla
        if call.built >= call.positions or cos.untyped_storage().data_ptr() != shared_cos.untyped_storage().data_ptr():
            return cos, sin
        if call.built == len(call.rows):
            call.rows.append((shared_cos.new_empty(shared_cos.shape), shared_sin.new_empty(shared_sin.shape)))
        own_cos, own_sin = call.rows[call.built]
        call.built += 1
        n = cos.shape[0]
        own_cos[:n].copy_(cos)
        own_sin[:n].copy_(sin)
        return own_cos[:n], own_sin[:n]

    return get_cos_and_sin_mla


def mla_draft_rope_rows(
    proposer: str, rope_rows: dict[str, str], propose: dict[str, str], dummy_run: dict[str, str], remove_when: str
) -> tuple[Patch, Patch, Patch]:
    """The ``mla-draft-rope-rows`` group for an adapter: ``get_cos_and_sin_mla`` and the proposer class ``proposer``'s
    ``_propose`` / ``dummy_run``, with that adapter's fingerprints of each."""
    why = (
        "The MLA / SFA decode metadata's RoPE rows (decode.cos / decode.sin) are views of one static buffer "
        "(get_cos_and_sin_mla(positions, use_cache=True): `_cos_mla[:n] = rows`, returns `_cos_mla[:n]`). The EAGLE / "
        "MTP proposer builds the metadata of every draft position before its model runs (_propose: step 0, then "
        "attn_update_stack_num_spec_norm for steps 1 .. k-1; dummy_run the same for FULL capture), so from k = 2 on "
        "each later build rewrites the rows the earlier positions read: a draft pass applies another pass's rotary "
        "positions. The release's comment there notes that only slot_mapping gets memory per step. Tokens do not "
        "change (drafts are verified); acceptance does: at k = 3 the last draft position was never accepted on the "
        "MLA model of docs/e2e.md (vllm-ascend 0.18.0 and 0.23.0), and drafts differed between sync and async "
        "scheduling with the batch. No upstream issue or fix found. It arises from vllm-ascend #5940 (one merged graph "
        "for all draft passes: every position built first, slot_mapping given a buffer per step) over #5277 (the MLA "
        "builder's RoPE rows cached as views)."
    )
    upstream = ("vllm-ascend#5940", "vllm-ascend#5277")
    drafting_how = (
        "Wrapper (zb_patch.versions.spec_fixes.make_drafting): marks the call on its thread, so that the decode RoPE "
        "builds made inside it are numbered by draft position (mla-draft-rope-rows)."
    )
    rows = Patch(
        id="mla-draft-rope-rows",
        rests_on=RestsOn(
            ONE_STREAM,
            "one device copy per draft build into buffers owned by that draft position, queued on the drafter's stream before the position's forward or captured graph reads them (program order; fixed addresses, as the release's own shared buffer)",
        ),
        group="mla-draft-rope-rows",
        target="vllm_ascend.ops.rotary_embedding:get_cos_and_sin_mla",
        aliases=(
            "vllm_ascend.attention.mla_v1:get_cos_and_sin_mla",
            "vllm_ascend.attention.sfa_v1:get_cos_and_sin_mla",
        ),
        make=make_get_cos_and_sin_mla,
        fingerprints=rope_rows,
        why=why,
        how="Wrapper (zb_patch.versions.spec_fixes), with the two proposer wrappers of its group. While the proposer's "
        "_propose or dummy_run runs on a thread, its n-th decode RoPE build (n < k) gets the rows the release just "
        "wrote copied into draft position n's own static buffer (allocated once, like the shared one) and views of "
        "that copy: every position keeps its rows, at the same address at every build, at capture and at run time (a "
        "captured FULL graph reads what the next build writes). The target's builds, outside a proposer call, are the "
        "release's. One device copy per draft build, no host wait. Speculative decoding with an MLA / SFA target, "
        "sync or async. A batch without decode rows at draft position 0 (prefill only) makes k - 1 builds: they take "
        "the first buffers, still one each. With more than one draft attention group a call would make more than k "
        "builds, and those past the k-th keep the release's shared rows.",
        upstream=upstream,
        remove_when=remove_when,
    )

    def drafting(patch_id: str, method: str, fingerprints: dict[str, str], why: str) -> Patch:
        return Patch(
            id=patch_id,
            rests_on=rows.rests_on,
            group="mla-draft-rope-rows",
            target=f"{proposer}.{method}",
            make=make_drafting,
            fingerprints=fingerprints,
            why=why,
            how=drafting_how,
            upstream=("vllm-ascend#5940",),
            remove_when=remove_when,
        )

    return (
        rows,
        drafting(
            "mla-draft-rope-rows-propose",
            "_propose",
            propose,
            "Half of mla-draft-rope-rows (same group): the proposer's run-time call that builds the metadata of every "
            "draft position, in order, before the draft model runs.",
        ),
        drafting(
            "mla-draft-rope-rows-dummy-run",
            "dummy_run",
            dummy_run,
            "Third part of mla-draft-rope-rows (same group): the proposer's dummy run, which builds every draft "
            "position's metadata for a FULL-graph capture; the captured graph must read the buffers the run-time "
            "builds write.",
        ),
    )


# ----------------------------------------------------------------------------------------------------------------
# vllm-ascend 0.18, FULL decode graphs + EAGLE: the runner's capture sizes are not the dispatcher's after rounding
# ----------------------------------------------------------------------------------------------------------------


def make_check_and_update_cudagraph_mode(original: Callable) -> Callable:
    """Wrap ``NPUModelRunner._check_and_update_cudagraph_mode``: afterwards ``cudagraph_batch_sizes`` is the list the
    dispatcher was just initialised from.

    The runner sets ``cudagraph_batch_sizes`` from the configured capture sizes in its constructor; this method then
    lets vLLM resolve the graph mode and adjust the sizes (rounded up to multiples of 1 + k for FULL decode graphs
    with speculative decoding, capped for Mamba caches) before the dispatcher builds its padding table from them.
    The drafter pads ``num_tokens <= cudagraph_batch_sizes[-1]`` through that table, so a stale list larger than the
    table's last size indexes past it. The list is recomputed by the constructor's own rule from the adjusted
    configuration."""

    @functools.wraps(original)
    def _check_and_update_cudagraph_mode(runner, *args, **kwargs):
        result = original(runner, *args, **kwargs)
        from vllm.config import CUDAGraphMode

        config = runner.compilation_config
        sizes = config.cudagraph_capture_sizes
        runner.cudagraph_batch_sizes = sorted(sizes) if sizes and config.cudagraph_mode != CUDAGraphMode.NONE else []
        return result

    return _check_and_update_cudagraph_mode


# ----------------------------------------------------------------------------------------------------------------
# vllm-ascend 0.13 - 0.20.2rc1, FULL decode graphs + EAGLE: the draft graph samples stale indices past the batch
# ----------------------------------------------------------------------------------------------------------------


def make_propose_draft_token_ids(buffer: str) -> Callable[[Callable], Callable]:
    """``make`` for ``NPUModelRunner.propose_draft_token_ids``: afterwards the drafter's persistent sample-index buffer
    (attribute ``buffer``) is all zeros, so the next proposal (which writes its real rows only) and any dummy run before
    it hand a padded FULL draft graph index 0 in the rows past the real batch."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def propose_draft_token_ids(runner, *args, **kwargs):
            result = original(runner, *args, **kwargs)
            indices = getattr(runner.drafter, buffer, None)  # None: a drafter without the buffer (n-gram, suffix)
            if indices is not None:
                indices.zero_()  # queued after the proposal's graph replay on the same stream: no host wait
            return result

        return propose_draft_token_ids

    return make


def draft_sample_indices(
    fingerprints: dict[str, str],
    buffer: str,
    release_lines: str,
    remove_when: str,
    native_fingerprints: dict[str, str] | None = None,
) -> Patch:
    """The ``draft-sample-indices-past-batch`` patch for an adapter whose proposer keeps its sample indices in the
    persistent buffer ``buffer`` (``release_lines``: where the release writes it and where the graph reads it)."""
    return Patch(
        id="draft-sample-indices-past-batch",
        rests_on=RestsOn(
            ONE_STREAM,
            "one device fill of the drafter's buffer, queued after the proposal on its stream; every later reader (the next proposal, a dummy run) runs on that stream after it; vllm-ascend #9867 / #10080 (native from 0.21.0rc1) zero the same buffer on NPUs",
        ),
        target="vllm_ascend.worker.model_runner_v1:NPUModelRunner.propose_draft_token_ids",
        make=make_propose_draft_token_ids(buffer),
        fingerprints=fingerprints,
        native_fingerprints=native_fingerprints or {},
        why=f"(vllm-ascend #9867 / #10080, in 0.21.0rc1) The EAGLE drafter's FULL decode graph is captured for a padded "
        f"batch and samples the draft model's hidden states at the first `padded requests` rows of the persistent "
        f"buffer {buffer}, but each proposal writes only its real requests' rows ({release_lines}): the rows past "
        f"them keep indices of earlier, larger batches (a prefill chunk of 64 tokens leaves indices up to 63), past "
        f"the padded batch's tokens, and the graph's gather reads out of bounds (on the H200 stand-in a device-side "
        f"assert in every FULL_DECODE_ONLY EAGLE run of the 48-request workload, sync included, docs/e2e.md). A dummy "
        f"run's graph replay (data-parallel idle rank) reads the same stale rows (#10080).",
        how="Wrapper (zb_patch.versions.spec_fixes). After the release's body, the drafter's buffer is filled with "
        "0 (one device fill, queued after the proposal's replay; no host wait). The buffer starts as zeros and only "
        "a proposal writes it, so at every later proposal and dummy run the rows past the real batch read 0 (a valid "
        "token of any padded batch), what #9867 (zero the rest in _propose) and #10080 (zero all in dummy_run) give. "
        "Any graph mode, sync or async, every drafter that has the buffer; tokens do not change (the padded rows' drafts "
        "are discarded).",
        upstream=("vllm-ascend#9867", "vllm-ascend#10080"),
        remove_when=remove_when,
    )


# ----------------------------------------------------------------------------------------------------------------
# The rejection sampler must see a "-1" draft placeholder as -1, the forward never (vLLM #47029, vllm-ascend #10307)
# ----------------------------------------------------------------------------------------------------------------

IDS_BEFORE_CLAMP_ATTR = "_zb_patch_ids_before_clamp"  # per-runner, per input preparation: set, then consumed
PLACEHOLDER_DRAFTS_ATTR = "_zb_patch_placeholder_drafts"  # diagnostics: metadata whose drafts were re-read


def keep_ids_before_clamp(runner: Any, total: int) -> None:
    """Called by a wrapper that clamps the step's input ids before the spec-decode metadata is built (zero-bubble on
    vllm-ascend 0.13): keep a device copy of the ids as they were (no host wait), for
    :func:`make_calc_spec_decode_metadata` to read the drafts from."""
    runner.__dict__[IDS_BEFORE_CLAMP_ATTR] = runner.input_ids.gpu[:total].clone()


def drop_ids_before_clamp(runner: Any) -> None:
    runner.__dict__.pop(IDS_BEFORE_CLAMP_ATTR, None)


def make_calc_spec_decode_metadata(original: Callable) -> Callable:
    """Wrap ``NPUModelRunner._calc_spec_decode_metadata`` (``draft_token_ids = input_ids.gpu[logits_indices]
    [target_logits_indices + 1]``): when the step's input ids were clamped to >= 0 before it (kept by
    :func:`keep_ids_before_clamp`), the drafts are gathered again, with the same indices, from the ids as they were
    before the clamp, so a ``-1`` placeholder reaches the rejection sampler as ``-1`` (never accepted) instead of
    token 0 (accepted whenever the target's argmax is 0). Then the input ids are clamped to >= 0 for the forward
    (vllm-ascend #10307's order: metadata first, sanitised after). Device ops only; no host wait."""

    @functools.wraps(original)
    def _calc_spec_decode_metadata(runner, *args, **kwargs):
        metadata = original(runner, *args, **kwargs)
        before = runner.__dict__.pop(IDS_BEFORE_CLAMP_ATTR, None)
        # PCP replaces logits_indices after the gather (the release's pcp_size > 1 branch): leave it as it is there
        if before is not None and getattr(runner, "pcp_size", 1) == 1:
            metadata.draft_token_ids = before[metadata.logits_indices][metadata.target_logits_indices + 1]
            runner.__dict__[PLACEHOLDER_DRAFTS_ATTR] = runner.__dict__.get(PLACEHOLDER_DRAFTS_ATTR, 0) + 1
        # the drafts are in the metadata (a gather: a copy); from here on the input ids only feed the forward and the
        # drafter, where a -1 is an out-of-range embedding index (#10305): sanitised as #10307 does, over the whole
        # device buffer (the padded tail included); one device op, no host wait
        runner.input_ids.gpu.clamp_(min=0)
        return metadata

    return _calc_spec_decode_metadata


def draft_placeholders_after_metadata(
    fingerprints: dict[str, str], release_lines: str, remove_when: str, not_covered: str = ""
) -> Patch:
    """The ``draft-placeholders-after-metadata`` patch (``release_lines``: where the release's scheduler gives the
    placeholders and where its runner gathers the drafts and embeds the ids; ``not_covered``: what the adapter's
    release embeds before the metadata)."""
    return Patch(
        id="draft-placeholders-after-metadata",
        rests_on=RestsOn(
            ONE_STREAM,
            "device gathers and one clamp of the step's input ids, queued between the release's gather of the drafts "
            "and the forward on the stream of the input preparation (program order); vllm-ascend #10307 (0.21.0rc1) "
            "sanitises the same buffer at the same point on NPUs",
        ),
        target="vllm_ascend.worker.model_runner_v1:NPUModelRunner._calc_spec_decode_metadata",
        make=make_calc_spec_decode_metadata,
        fingerprints=fingerprints,
        why="(vllm-ascend #10305 / #10307, vLLM #47029) A draft the runner has no proposal for stays the scheduler's "
        "`-1` placeholder in the step's input ids: every request's first step on a PD decode node with MTP "
        "(RecomputeScheduler.add_request gives it `[-1] * k`) or a row the stale-draft fixes cannot fill. The "
        "release gathers the rejection sampler's drafts from the input ids and hands the same ids to the forward, "
        "whose embedding faults on `-1` (GatherV2 out of range on NPUs, #10305). On vllm-ascend 0.13 zero-bubble's "
        "clamp at 0 (zb013-corrections-before-metadata, in _init_model_kwargs) runs before that gather, so the "
        "sampler is handed token 0 (<｜begin▁of▁sentence｜> in DeepSeek vocabularies) and accepts it whenever the "
        f"target's argmax is 0. Here: {release_lines}.",
        how="Wrapper (zb_patch.versions.spec_fixes). After the release's body: where zero-bubble clamped the input "
        "ids before it (it keeps a device copy of them for this call), the drafts are gathered again from that copy "
        "with the metadata's own indices, so the sampler sees `-1` and rejects it (no PCP); then the whole device "
        "input-id buffer is clamped to >= 0 for the forward and the drafter (#10307's order: metadata first, "
        "sanitised after). Device ops, no host wait; any graph mode, with or without zero-bubble." + not_covered,
        upstream=("vllm-ascend#10305", "vllm-ascend#10307", "vllm-ascend#10043", "vllm#47029"),
        remove_when=remove_when,
    )
