"""reset-prefix-cache-in-flight (vLLM #42117, in 0.22.0; #46066, in 0.25.0): ``reset_prefix_cache(reset_running_requests=
True)`` under async scheduling preempts every running request and flags its next output for discard, but the release
subtracts that stale output's rejected drafts from the resumed request's counters before discarding it, and flags a
request with nothing in flight too, whose first token after the resume is then dropped. The EngineCore's scheduler
(role ``engine``). Adapters ascend-0.13 and ascend-0.18; spec: :func:`patches`.
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
    """Wrap ``Scheduler.reset_prefix_cache``: a request the release force-preempts keeps its discard flag
    (``discard_latest_async_tokens``) only if an output of it was in flight, as vLLM #42117 decides.

    Under async scheduling a running request's ``num_output_placeholders`` counts the tokens its steps in flight will
    return: above 0 exactly while one is in flight (the scheduler adds ``1 + drafts`` when it schedules a decode step
    and takes each returned token off). The release flags every preempted request; only an output that carries tokens
    consumes the flag (``AsyncScheduler._update_request_with_output``, called only with new tokens), so a request with
    nothing in flight kept it into its resumed life and lost that life's first token. Synchronous scheduling never
    reads the flag."""

    @functools.wraps(original)
    def reset_prefix_cache(scheduler, *args, **kwargs):
        idle = [r for r in scheduler.running if r.num_output_placeholders == 0]  # nothing in flight
        result = original(scheduler, *args, **kwargs)
        for request in idle:
            request.discard_latest_async_tokens = False
        return result

    return reset_prefix_cache


def make_update_from_output(original: Callable) -> Callable:
    """Wrap ``update_from_output(scheduler_output, model_runner_output)`` (vLLM's ``Scheduler``; vllm-ascend's
    ``RecomputeScheduler`` has its own copy of the loop): the output a force-preempted request still had in flight
    reaches the release's loop without that request's scheduled drafts, so the loop never subtracts its rejected
    drafts; the flag then discards its tokens, as before.

    The release's loop subtracts a returning output's rejected drafts from ``num_computed_tokens`` and
    ``num_output_placeholders`` whenever they are above 0, before ``_update_request_with_output`` discards the stale
    tokens; when the request was resumed before that output returned (async scheduling schedules the next step before
    it processes the last output), the counters are its resumed life's, and it recomputes too few tokens or ends
    with negative placeholders (#46066: ``assert request.num_output_placeholders >= 0``). The loop's other readers of
    the drafts are the spec-decoding statistics, which then leave out the stale output. The scheduler output is
    copied, never changed: it stays the one the runner was given."""

    @functools.wraps(original)
    def update_from_output(scheduler, scheduler_output, *args, **kwargs):
        drafts = scheduler_output.scheduled_spec_decode_tokens
        stale = [rid for rid in drafts if getattr(scheduler.requests.get(rid), "discard_latest_async_tokens", False)]
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
) -> tuple[Patch, Patch, Patch]:
    """The fix: ``Scheduler.reset_prefix_cache`` and ``Scheduler.update_from_output`` (vLLM), and vllm-ascend's
    ``RecomputeScheduler.update_from_output`` (``*_fingerprints``: of each; ``release_lines``: where the release
    flags and subtracts)."""
    rests_on = RestsOn(
        HOST,
        "the scheduler's own bookkeeping in the EngineCore process (which requests a stale output is discarded for, "
        "what the loop subtracts); no device op",
    )
    why = (
        "(vLLM #42117, in 0.22.0; #46066, in 0.25.0) reset_prefix_cache(reset_running_requests=True) (LLM.reset_prefix_cache, "
        "/reset_prefix_cache, pause_scheduler(clear_cache=True); weight updates, sleep) preempts every running "
        "request and flags its next output for discard. Async scheduling can resume a request before its output in "
        "flight returns; update_from_output then subtracts that output's rejected drafts from the resumed request's "
        "num_computed_tokens and num_output_placeholders before the flag discards its tokens: too few tokens "
        "recomputed, or placeholders below 0, which AsyncScheduler asserts against on a later output (#46066). A "
        "request with nothing in flight is flagged too, and loses the first token of its resumed life (#42117)."
    )
    how_update = (
        f"Wrapper ({__name__}). The release's loop gets a copy of the scheduler output without the drafts of the "
        "requests flagged for discard; the flag then discards their tokens as before. With the reset_prefix_cache "
        "wrapper (same group) only requests with an output in flight are flagged, so the flagged output is the stale one."
    )
    common: dict[str, Any] = dict(rests_on=rests_on, why=why, remove_when=remove_when, roles=("engine",), group=GROUP)
    return (
        Patch(
            id=ID,
            target="vllm.v1.core.sched.scheduler:Scheduler.reset_prefix_cache",
            make=make_reset_prefix_cache,
            fingerprints=reset_fingerprints,
            how=f"Wrapper ({__name__}; {release_lines}). After the release's body, the discard flag is cleared on the "
            "force-preempted requests that had no output placeholders (nothing in flight), as #42117 decides from "
            "them (vLLM 0.22.0 on keeps a count of the placeholders); at async scheduling's batch-queue depth 2 a "
            "request has at most one output in flight, which the release's flag carries.",
            upstream=("vllm#42117", "vllm#46066", "vllm#28827"),
            **common,
        ),
        Patch(
            id=ID + "-update",
            target="vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
            make=make_update_from_output,
            fingerprints=update_fingerprints,
            how=how_update,
            upstream=("vllm#46066", "vllm#42117"),
            **common,
        ),
        Patch(
            id=ID + "-recompute",
            target="vllm_ascend.core.recompute_scheduler:RecomputeScheduler.update_from_output",
            make=make_update_from_output,
            fingerprints=recompute_update_fingerprints,
            how=how_update + " vllm-ascend's RecomputeScheduler (the PD decode node's) has its own copy of the loop; "
            "its own part, applied once the module is imported.",
            upstream=("vllm#46066", "vllm#42117"),
            **common,
        ),
    )


def guard(fingerprints: Mapping[str, str]) -> Guard:
    """What the fix relies on: the release's discard (``fingerprints`` of ``AsyncScheduler._update_request_with_
    output``). vLLM imports its module only with async scheduling (``vllm/config/scheduler.py``), the only scheduling
    that reads the flag, and vllm-ascend's recompute scheduler with it: the fix's first part applies only then."""
    return Guard(
        "vllm.v1.core.sched.async_scheduler:AsyncScheduler._update_request_with_output",
        fingerprints,
        "drops the tokens of an output whose request is flagged (discard_latest_async_tokens) and clears the flag; "
        "update_from_output calls it only for outputs with tokens",
        roles=("engine",),
    )
