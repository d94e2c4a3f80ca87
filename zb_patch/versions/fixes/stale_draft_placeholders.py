"""stale-draft-placeholders (vLLM #37159, unfixed upstream): under async scheduling a request that skipped a step (or,
on vLLM 0.13, was preempted) comes back with ``-1`` draft placeholders nothing replaces. Two patches, one group:
``_prepare_input_ids`` keeps and restores the request's drafts, ``InputBatch.remove_request`` records its row.
Adapters ascend-0.13, ascend-0.18, ascend-0.19-0.25; specs: :func:`patches`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

from ...registry import HOST, ONE_STREAM, Patch, RestsOn

ID = "stale-draft-placeholders"
ROWS_ID = "stale-draft-placeholders-rows"

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

    @functools.wraps(original)
    def _prepare_input_ids(runner, scheduler_output, *args, **kwargs):
        if not (runner.use_async_scheduling and runner.num_spec_tokens):  # both set by GPUModelRunner.__init__
            runner.input_batch.__dict__.pop(LEFT_ROWS_ATTR, None)  # async without drafts: nothing to keep
            return original(runner, scheduler_output, *args, **kwargs)
        st = saved_drafts(runner)
        keep_leaving_drafts(runner, st)  # before the body: vLLM 0.13's body sets _draft_token_ids to None
        result = original(runner, scheduler_output, *args, **kwargs)
        # the last parameter of every fingerprinted signature (above)
        cu_num_tokens = kwargs["cu_num_tokens"] if "cu_num_tokens" in kwargs else args[-1]
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
    def remove_request(batch, req_id):  # (self, req_id) in every fingerprinted release
        prev = batch.prev_req_id_to_index
        row = prev.get(req_id) if prev else None
        result = original(batch, req_id)
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


def patches(
    fingerprints: Mapping[str, str],
    rows_fingerprints: Mapping[str, str],
    *,
    release: str,
    not_covered: str,
    remove_when: str,
    also_upstream: tuple[str, ...] = (),
    forms: str = "",
) -> tuple[Patch, Patch]:
    """The fix for an adapter: ``fingerprints`` of ``GPUModelRunner._prepare_input_ids``, ``rows_fingerprints`` of
    ``InputBatch.remove_request``; ``release``: how the defect shows on the adapter's releases; ``not_covered``: the
    runners the wrapper does not reach there; ``forms``: how the remove_request forms differ, where they do."""
    upstream = ("vllm#37159", *also_upstream, "vllm#36906", "vllm#43434")
    placeholders = Patch(
        id=ID,
        rests_on=RestsOn(
            ONE_STREAM,
            "device clones and copies of draft ids, queued on the stream of the step's input preparation before the "
            "forward and the rejection sampler read them (program order); no host wait",
        ),
        group=ID,
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_input_ids",
        make=make_prepare_input_ids,
        fingerprints=fingerprints,
        why="(vLLM #37159) Async scheduling gives every scheduled decode request `[-1] * k` draft placeholders, which "
        "_prepare_input_ids replaces on the device with the previous step's drafts, but only for rows of the previous "
        "step's batch (`if prev_index < 0: continue`). A request that skipped a step comes back with the same "
        "placeholders (the scheduler keeps them while the request is not scheduled; "
        "InputBatch.update_req_spec_token_ids writes them into token_ids_cpu) and the `-1` reaches the model. Every "
        f"upstream fix proposed (#37629, #40768, #43434, #46899) was closed unmerged. {release}",
        how="Wrapper (zb_patch.versions.fixes.stale_draft_placeholders). Before the release's body: the drafts proposed "
        "in the last proposing step for each request that was sampled there and has left the batch since are kept (a "
        "device clone of its row of _draft_token_ids, row width _draft_token_ids.shape[1]). After the body: a row that "
        "has scheduled drafts and was not in the previous batch gets its kept drafts written over its draft input ids "
        "(device copy; the rejection sampler reads the drafts from the same input ids). Those are the drafts the "
        "request would have been verified with without the skip, the ones synchronous scheduling verifies: tokens and "
        "acceptance are sync's, not only crash-free. No host wait. Applies with async scheduling + spec decode whether "
        f"or not zero-bubble is active. Not covered: {not_covered}.",
        upstream=upstream,
        remove_when=remove_when,
    )
    rows = Patch(
        id=ROWS_ID,
        rests_on=RestsOn(HOST, "a host record of the removed request's previous row, kept on the input batch"),
        group=ID,
        target="vllm.v1.worker.gpu_input_batch:InputBatch.remove_request",
        make=make_remove_request,
        fingerprints=rows_fingerprints,
        why="Half of stale-draft-placeholders (same group): removing a request from the persistent batch also drops "
        "it from prev_req_id_to_index, the only record of its row in the runner's last draft proposal, which the "
        "_prepare_input_ids wrapper needs to keep the request's drafts.",
        how="Wrapper (zb_patch.versions.fixes.stale_draft_placeholders). Records the removed request's previous row on "
        "the batch before the release's body drops it; the _prepare_input_ids wrapper reads the record once (every "
        "input preparation) and keeps the drafts of the requests that are still alive."
        + (f" {forms}" if forms else ""),
        upstream=("vllm#37159",),
        remove_when=remove_when,
    )
    return placeholders, rows
