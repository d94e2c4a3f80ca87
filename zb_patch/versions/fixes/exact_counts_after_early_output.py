"""Token counts the scheduler has already corrected: the fix ``exact-counts-after-early-output`` (adapters ascend-0.13 /
ascend-0.18; its specs, :func:`patches`, say why and how) and the test zero-bubble shares with it.

With async scheduling + speculative decoding, the count the scheduler sends for a request that step N scheduled with
drafts is, as a rule, optimistic: step N's drafts counted as accepted. When the engine core has processed step N's
output before scheduling step N+1, the scheduler has already subtracted step N's rejected drafts, and the count is
exact. :func:`already_exact` tells the two apart from what the runner knows: the request's count when step N started
(exact by then) plus the tokens step N scheduled is the optimistic count; anything less is an exact one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ...registry import HOST, Patch, RestsOn

_HOST_ONLY = RestsOn(
    HOST,
    "host bookkeeping only: rows whose counts are already exact, from the scheduler's output and the runner's host "
    "state; no device op, no wait",
)

# runner.__dict__ keys: this step's rows whose counts are exact {previous row: drafts}, and the previous step's
# scheduled tokens per request
EXACT_ROWS = "_zb_patch_exact_rows"
PREV_SCHEDULED = "_zb_patch_prev_scheduled"


def already_exact(runner: Any, scheduler_output: Any, prev_scheduled: Mapping[str, int]) -> dict[int, int]:
    """``{previous row: drafts}`` of the requests scheduled now whose count from the scheduler already has step N's
    rejected drafts subtracted: those the release (and zero-bubble) would otherwise correct a second time. Call it
    before ``_update_states`` has updated the runner's requests."""
    prev_rows = runner.input_batch.prev_req_id_to_index or {}
    cached = scheduler_output.scheduled_cached_reqs
    exact: dict[int, int] = {}
    for req_id, count in zip(cached.req_ids, cached.num_computed_tokens):
        req_state = runner.requests.get(req_id)
        drafts = getattr(req_state, "prev_num_draft_len", 0)
        row = prev_rows.get(req_id)
        if not drafts or row is None or req_id not in prev_scheduled:
            continue
        if count < req_state.num_computed_tokens + prev_scheduled[req_id]:
            exact[row] = drafts
    return exact


def make_worker_execute_model(original: Callable) -> Callable:
    """``NPUWorker.execute_model``: note this step's exact rows on the runner before the runner's step runs."""

    def execute_model(worker, scheduler_output, *args, **kwargs):
        runner = worker.model_runner
        prev = runner.__dict__.get(PREV_SCHEDULED, {})
        runner.__dict__[EXACT_ROWS] = already_exact(runner, scheduler_output, prev) if prev else {}
        runner.__dict__[PREV_SCHEDULED] = dict(scheduler_output.num_scheduled_tokens)
        return original(worker, scheduler_output, *args, **kwargs)

    return execute_model


def make_get_valid_sampled_token_count(original: Callable) -> Callable:
    """``_get_valid_sampled_token_count``: at a row whose count is already exact, every draft counted as accepted, so
    ``_update_states`` subtracts nothing there."""

    def _get_valid_sampled_token_count(runner):
        counts = original(runner)
        for row, drafts in runner.__dict__.get(EXACT_ROWS, {}).items():
            if row < len(counts):
                counts[row] = drafts + 1
        return counts

    return _get_valid_sampled_token_count


def patches(worker_fingerprints: Mapping[str, str], count_fingerprints: Mapping[str, str]) -> tuple[Patch, Patch]:
    """The fix's two patches for a release whose engine core can process a step's output before scheduling the next
    (vLLM 0.13 / 0.18)."""
    why = (
        "vLLM 0.13 / 0.18's engine core (step_with_batch_queue) processes a step's output before scheduling the next "
        "whenever the step's output future is already done when it checks -- a race with the executor's async-output "
        "thread, won on host-bound steps. The scheduler then sends counts that already have that step's rejected "
        "drafts subtracted, and the runner's _update_states, which assumes optimistic counts, subtracts them again: "
        "positions, seq_lens and slots fall short and the step reads and writes the wrong KV entries (wrong tokens; "
        "reproduced by forcing the early path, docs/e2e.md). vLLM 0.23 no longer processes an output early."
    )
    upstream = ("vllm 0.23 step_with_batch_queue (no done() check)",)
    remove_when = "the adapter's releases are retired (zero-bubble is native from vllm-ascend 0.19.1rc1 on)"
    group = "exact-counts-after-early-output"
    return (
        Patch(
            id="exact-counts-after-early-output",
            rests_on=_HOST_ONLY,
            group=group,
            target="vllm_ascend.worker.worker:NPUWorker.execute_model",
            make=make_worker_execute_model,
            fingerprints=worker_fingerprints,
            why=why,
            how="Wrapper. Before the runner's step, marks the rows whose count from the scheduler is already exact: "
            "a request step N scheduled with drafts whose count is below its count at step N's start plus the tokens "
            "step N scheduled (the optimistic count). Host-only, no wait. Applies whether or not zero-bubble is "
            "active; zero-bubble makes the same test itself and does not correct those rows either.",
            upstream=upstream,
            remove_when=remove_when,
        ),
        Patch(
            id="exact-counts-report-accepted",
            rests_on=_HOST_ONLY,
            group=group,
            target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_valid_sampled_token_count",
            make=make_get_valid_sampled_token_count,
            fingerprints=count_fingerprints,
            why=why,
            how="Wrapper. After the release's wait, reports every draft accepted at the marked rows, so the "
            "release's _update_states subtracts nothing from their already exact counts (its later alignment of the "
            "output placeholders to the scheduler's output count is unchanged). Zero-bubble leaves those rows out of "
            "its corrections, so the values it reads there do not matter to it.",
            upstream=upstream,
            remove_when=remove_when,
        ),
    )
