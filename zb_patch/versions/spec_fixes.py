"""Fixes of upstream async-scheduling + speculative-decoding defects, shared by the adapters of the releases that have
them (written once, declared by each adapter with its own fingerprints).

These are *fixes*, not zero-bubble: each applies whenever its defect can bite (async scheduling with speculative
decoding on, whatever zero-bubble decides for the runner), and each is its own patch id, so ``ZB_PATCH=1
ZB_PATCH_DISABLE=<the zero-bubble patches>`` gives the release's classic async path with only the fixes.

Every fix here is worker-side: zb-patch applies an adapter's patch set in a process once all of its target modules
are imported, and the scheduler (EngineCore process) and the runner (worker processes, with the multiprocess or Ray
executors) live in different processes, so a fix that needed both would never apply.

Nothing heavy is imported at module level: torch only inside the functions a patched method calls.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

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
    k = runner.num_spec_tokens
    flat = drafts.reshape(-1)
    for req_id, row in left.items():
        # still alive: skipped, preempted, or already back in this step's batch (the step it was skipped in had no
        # tokens at all, so this is the first input preparation since it left)
        if req_id not in runner.requests:
            continue
        st.drafts[req_id] = flat[row * k : (row + 1) * k].clone()  # device copy: the tensor may be reused
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
