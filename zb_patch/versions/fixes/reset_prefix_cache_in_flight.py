"""reset-prefix-cache-in-flight (vLLM #42117, in 0.22.0; #46066, in 0.25.0; #49620, open): ``reset_prefix_cache(
reset_running_requests=True)`` under async scheduling preempts every running request and marks it to discard what it
still had in flight, but the release subtracts that stale output's rejected drafts from the resumed request's counters
before discarding it (to 0.24), and marks more than was in flight: up to vLLM 0.21 a request with nothing in flight,
whose first token after the resume is then dropped; from 0.22 one output per draft too. The EngineCore's scheduler (role
``engine``). Adapters ascend-0.13, ascend-0.18, ascend-0.19-0.25; spec: :func:`patches`.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from typing import Any

from ...registry import HOST, Guard, Patch, RestsOn

ID = "reset-prefix-cache-in-flight"
GROUP = ID


def make_reset_prefix_cache(original: Callable) -> Callable:
    """Wrap ``Scheduler.reset_prefix_cache``: each request the release force-preempts is marked to discard exactly the
    output it had in flight, or nothing.

    Under async scheduling a running request's ``num_output_placeholders`` counts the tokens its steps in flight will
    return (the scheduler adds ``1 + drafts`` when it schedules a decode step and takes each returned token off): above
    0 exactly while an output is in flight, and with one pipeline stage (the engine core's batch queue of depth 2) at
    most one is. The release's mark: up to vLLM 0.21 a flag (``discard_latest_async_tokens``) on every preempted
    request, so one with nothing in flight lost the first token of its resumed life (#42117); from 0.22 a count
    (``async_tokens_to_discard``) set to the placeholders, while ``AsyncScheduler._update_request_with_output`` drops
    one output per unit, so an output in flight with k drafts took the resumed life's first k outputs with it (#49620).
    After the release's body: the flag = an output in flight; the count = 1 where an output is in flight and there is
    one pipeline stage (with more, several outputs can be in flight: the count is left as released). Requests the
    call did not preempt (``reset_running_requests=False``) are left alone. Synchronous scheduling has no
    placeholders and never reads the mark."""

    @functools.wraps(original)
    def reset_prefix_cache(scheduler, *args, **kwargs):
        before = [(request, request.num_output_placeholders > 0) for request in scheduler.running]
        result = original(scheduler, *args, **kwargs)
        still_running = {id(request) for request in scheduler.running}
        one_stage = scheduler.parallel_config.pipeline_parallel_size == 1
        for request, in_flight in before:
            if id(request) in still_running:
                continue
            if hasattr(request, "async_tokens_to_discard"):  # vLLM 0.22+: a count of outputs to drop
                if in_flight and one_stage:
                    request.async_tokens_to_discard = 1
            else:  # up to vLLM 0.21: a flag
                request.discard_latest_async_tokens = in_flight
        return result

    return reset_prefix_cache


def make_update_from_output(original: Callable) -> Callable:
    """Wrap ``update_from_output(scheduler_output, model_runner_output)`` (vLLM's ``Scheduler``; vllm-ascend's
    ``RecomputeScheduler`` has its own copy of the loop): the output a force-preempted request still had in flight
    reaches the release's loop without that request's scheduled drafts, so the loop never subtracts its rejected
    drafts; the release's mark then discards its tokens, as before.

    The release's loop (to vLLM 0.24; 0.25 skips a marked request there, #46066) subtracts a returning output's
    rejected drafts from ``num_computed_tokens`` and ``num_output_placeholders`` whenever they are above 0, before
    ``_update_request_with_output`` discards the stale tokens; when the request was resumed before that output returned
    (async scheduling schedules the next step before it processes the last output), the counters are its resumed
    life's, and it recomputes too few tokens or ends with negative placeholders (#46066: ``assert
    request.num_output_placeholders >= 0``). The loop's other readers of the drafts are the spec-decoding statistics,
    which then leave out the stale output. The scheduler output is copied, never changed: it stays the one the runner
    was given."""

    @functools.wraps(original)
    def update_from_output(scheduler, scheduler_output, *args, **kwargs):
        drafts = scheduler_output.scheduled_spec_decode_tokens
        get = scheduler.requests.get
        # marked for discard: vLLM <= 0.21's flag, 0.22+'s count (None: a request no longer held); inline, every step
        stale = [
            rid
            for rid in drafts
            if getattr(r := get(rid), "discard_latest_async_tokens", False)
            or getattr(r, "async_tokens_to_discard", 0) > 0
        ]
        if stale:
            scheduler_output = copy.copy(scheduler_output)
            scheduler_output.scheduled_spec_decode_tokens = {k: v for k, v in drafts.items() if k not in stale}
        return original(scheduler, scheduler_output, *args, **kwargs)

    return update_from_output


def patches(
    reset_fingerprints: Mapping[str, str],
    update_fingerprints: Mapping[str, str],
    recompute_update_fingerprints: Mapping[str, str],
    *,
    release_lines: str,
    remove_when: str,
    update_native: Mapping[str, str] | None = None,
    recompute_update_native: Mapping[str, str] | None = None,
) -> tuple[Patch, Patch, Patch]:
    """The fix: ``Scheduler.reset_prefix_cache`` and ``Scheduler.update_from_output`` (vLLM), and vllm-ascend's
    ``RecomputeScheduler.update_from_output`` (``*_fingerprints``: of each; ``*_native``: the loops that already skip
    a marked request, #46066; ``release_lines``: where the release marks and subtracts)."""
    rests_on = RestsOn(
        HOST,
        "the scheduler's own bookkeeping in the EngineCore process (which requests a stale output is discarded for, "
        "what the loop subtracts); no device op",
    )
    why = (
        "(vLLM #42117, in 0.22.0; #46066, in 0.25.0; #49620, open) reset_prefix_cache(reset_running_requests=True) "
        "(LLM.reset_prefix_cache, /reset_prefix_cache, pause_scheduler(clear_cache=True); weight updates, sleep) "
        "preempts every running request and marks it to discard its output in flight. Async scheduling can resume a "
        "request before that output returns; update_from_output then subtracts the output's rejected drafts from the "
        "resumed request's num_computed_tokens and num_output_placeholders before the mark discards its tokens: too "
        "few tokens recomputed, or placeholders below 0, which AsyncScheduler asserts against on a later output "
        "(#46066). And the mark covers more than was in flight: up to vLLM 0.21 a request with nothing in flight is "
        "flagged too and loses the first token of its resumed life (#42117); from 0.22 the count of outputs to drop "
        "is the request's placeholders, 1 + drafts for its one output in flight, so its resumed life's first outputs "
        "are dropped too (#49620)."
    )
    how_update = (
        f"Wrapper ({__name__}). The release's loop gets a copy of the scheduler output without the drafts of the "
        "requests marked for discard; the mark then discards their tokens as before. With the reset_prefix_cache "
        "wrapper (same group) only requests with an output in flight are marked, so the marked output is the stale one."
    )
    common: dict[str, Any] = dict(rests_on=rests_on, why=why, remove_when=remove_when, roles=("engine",), group=GROUP)
    return (
        Patch(
            id=ID,
            target="vllm.v1.core.sched.scheduler:Scheduler.reset_prefix_cache",
            make=make_reset_prefix_cache,
            fingerprints=reset_fingerprints,
            how=f"Wrapper ({__name__}; {release_lines}). After the release's body, each request it preempted is "
            "marked for exactly the output it had in flight (output placeholders > 0): vLLM's flag (to 0.21) set to "
            "that, vLLM's count (from 0.22) set to 1 where an output is in flight; at async scheduling's batch-queue "
            "depth 2 (one pipeline stage) a request has at most one. Not covered: pipeline parallelism with more than "
            "one stage on vLLM 0.22+ (several outputs in flight; the release's count is kept).",
            upstream=("vllm#42117", "vllm#46066", "vllm#49620", "vllm#28827"),
            **common,
        ),
        Patch(
            id=ID + "-update",
            target="vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
            make=make_update_from_output,
            fingerprints=update_fingerprints,
            native_fingerprints=update_native or {},
            how=how_update,
            upstream=("vllm#46066", "vllm#42117"),
            **common,
        ),
        Patch(
            id=ID + "-recompute",
            target="vllm_ascend.core.recompute_scheduler:RecomputeScheduler.update_from_output",
            make=make_update_from_output,
            fingerprints=recompute_update_fingerprints,
            native_fingerprints=recompute_update_native or {},
            how=how_update + " vllm-ascend's RecomputeScheduler (the PD decode node's) has its own copy of the loop; "
            "its own part, applied once the module is imported.",
            upstream=("vllm#46066", "vllm#42117"),
            **common,
        ),
    )


def guard(fingerprints: Mapping[str, str]) -> Guard:
    """What the fix relies on: the release's discard (``fingerprints`` of ``AsyncScheduler._update_request_with_
    output``). vLLM imports its module only with async scheduling (``vllm/config/scheduler.py``), the only scheduling
    that reads the mark, and vllm-ascend's recompute scheduler with it: the fix's first part applies only then."""
    return Guard(
        "vllm.v1.core.sched.async_scheduler:AsyncScheduler._update_request_with_output",
        fingerprints,
        "drops the tokens of an output whose request is marked (discard_latest_async_tokens to vLLM 0.21, "
        "async_tokens_to_discard from 0.22) and takes the mark off; update_from_output calls it only for outputs "
        "with tokens",
        roles=("engine",),
    )
