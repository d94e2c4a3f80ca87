"""The engine self-test's verdict on the results of its runs (:mod:`.child`): what must be equal, what may differ and
only with which mechanism, checked; plain data in, ``(failures, notes)`` out.

The runs: ``sync``; ``async+fixes`` (async scheduling, zb-patch on with its zero-bubble left out: the release's own
async path carrying only zb-patch's fixes of the release's defects); ``async+zb`` (``ZB_PATCH=1``); and, reported
beside and not judged, ``async`` (classic async without zb-patch, which can stop on those very defects). The rules
(docs/e2e.md, "Verdict"):

1. **Each run ran as configured.** Sync: vLLM's ``Scheduler``, no step scheduled while another's result was
   outstanding. Async runs: ``AsyncScheduler`` and steps scheduled while the previous one was in flight.
2. **Zero-bubble ran where it should, and only there.** The ``async+zb`` runner reports zb-patch's zero-bubble active
   and at least one corrected step per step that scheduled a request whose drafts the step before verified (or, on a
   release whose zero-bubble is native, the release's own switched on), with at most one host wait per corrected
   step; its process reports zb-patch in effect. ``async+fixes``: zb-patch in effect, its zero-bubble not running.
   Classic ``async``: zb-patch off.
3. **Tokens**: identical in the judged runs, for every request.
4. **zb-patch vs the same release with only the fixes: strict** on every field the child records (tokens, counts,
   every verification's position / drafted / accepted, preemptions and where, per-position acceptance).
5. **Each judged async run vs sync: bounded excuses.** At every position both runs verified drafts, the accepted
   counts agree (the drafts from one position are the same drafts: the one with fewer drafts accepts the other's
   accepted count capped at its own) -- unless the drafts came from one draft pass in one run and from one pass
   per draft in the other (vllm-ascend 0.13's MTP drafter in a batch with a prefill repeats its first draft; the
   child's ``draft_passes``), and the first draft, made by the same pass in both, is accepted in both or neither. A
   verification that only one run made is allowed only from the first event that explains a different draft
   schedule on, one step in flight before it: a preemption in either run (recomputed tokens, drafts dropped), a
   verification with fewer than k drafts (the token budget), drafts verified together with prompt tokens (vLLM
   0.13's sync scheduler), drafts from one pass in one run only, or the ``max_model_len`` clamp (async scheduling
   clamps an optimistic count: from ``max_model_len - 2 (k + 1)`` on). A count difference is then a note naming
   that event; without one it is a failure.

6. **The graph mode asked for ran**, with replays in that mode, and each applied graph patch counted its work
   (:func:`graph_mode_failures`).

Classic ``async`` is held to rules 3-5 too, but what it breaks becomes notes: its differences are the release's.
"""

from __future__ import annotations

import math

from zb_patch.versions.fixes.graph_replay import FULL_ORDERING_ID, NO_DRAIN_ID, ONCE_PER_STEP_ID

from .workload import Workload, divergences

# every per-request / per-run field the child records that must be identical between zb-patch and classic async
STRICT_FIELDS = (
    "tokens",
    "drafted",
    "accepted",
    "preemptions",
    "preempted_at",
    "drafted_in_prefill",
    "accepted_in_prefill",
    "verifications",
    "drafted_per_pos",
    "accepted_per_pos",
)
# the process states of zb-patch that mean "zero-bubble is in effect" (zb_patch.plugin)
IN_EFFECT = ("applied", "native")


# the runs the verdict rests on, and the one reported beside them (classic async without zb-patch)
JUDGED = ("sync", "async+fixes", "async+zb")
BESIDE = "async"
# classic async's findings listed in the notes at most (then a count of the rest)
BESIDE_NOTES = 8


def compare(runs: dict[str, dict], wl: Workload, vocab: int) -> tuple[list[str], list[str]]:
    """(failures, notes) of the runs ``sync``, ``async+fixes``, ``async+zb`` and, if it finished, ``async``."""
    failures: list[str] = []
    notes: list[str] = []
    sync = runs["sync"]
    if sum(sync["drafted"].values()) == 0:
        failures.append("sync: no draft token was verified (speculative decoding did not run)")
    failures += scheduling_failures(runs)
    failures += zero_bubble_failures(runs)
    failures += graph_mode_failures(runs)
    for name in ("async+fixes", "async+zb"):
        f, n = async_vs_sync(sync, runs[name], wl, vocab, name)
        failures += f
        notes += n
    failures += [
        f"async+zb vs async+fixes: {d}" for d in divergences(runs["async+fixes"], runs["async+zb"], STRICT_FIELDS)
    ]
    if BESIDE in runs:
        notes += classic_async_notes(runs, wl, vocab)
    return failures, notes


def graph_mode_failures(runs: dict[str, dict]) -> list[str]:
    """Rule 6: each judged run ran in the graph mode it was asked for (``graph_mode``, the child's ``--graph-mode``):
    that ``cudagraph_mode``, and outside eager at least one captured graph and replays in that mode while generating
    (``graph_replays``); then the work of each graph patch applied in the run (:func:`graph_patch_failures`). A
    release that falls back to another mode, or a patch that never acted, must not pass as tested in this one."""
    failures = []
    for name in JUDGED:
        res = runs[name]
        if "cudagraph_mode" not in res:
            continue
        asked = res.get("graph_mode", "eager")
        want = "NONE" if asked == "eager" else asked.upper()
        mode = res["cudagraph_mode"].rsplit(".", 1)[-1]
        if mode != want:
            failures.append(f"{name}: ran with cudagraph_mode {mode}, not {want} (--graph-mode {asked})")
        elif asked == "eager":
            continue
        elif not res.get("graphs_captured"):
            failures.append(f"{name}: --graph-mode {asked} captured no graph")
        elif not res.get("graph_replays", {}).get(REPLAY_MODE[asked]):
            uncounted = ", ".join(res.get("graph_replays_uncounted", []))
            uncounted = f"; uncounted: {uncounted}" if uncounted else ""
            failures.append(
                f"{name}: --graph-mode {asked} replayed no {REPLAY_MODE[asked]} graph while generating "
                f"(graph_replays {res.get('graph_replays', {})}{uncounted})"
            )
        else:
            failures += graph_patch_failures(name, res, asked)
    return failures


# the runtime mode of the replays that show a graph mode ran: its decode steps' (ACLGraphWrapper.runtime_mode)
REPLAY_MODE = {"piecewise": "PIECEWISE", "full_decode_only": "FULL"}
# zb-patch's graph patches; full-replay-ordered-on-device: every id of its group (one per update entry point on 0.13)
ONCE_PER_STEP, NO_DRAIN, FULL_ORDERING = ONCE_PER_STEP_ID, NO_DRAIN_ID, FULL_ORDERING_ID


def graph_patch_failures(name: str, res: dict, asked: str) -> list[str]:
    """Rule 6, each graph patch applied in an async run (the patches act under async scheduling with speculative
    decoding only) counted its work in the asked mode: ``piecewise-drain-once-per-step`` in piecewise a drain run
    once per target forward (``host_drains`` ``once`` > 0; ``skipped`` may be 0); ``piecewise-replay-without-host-
    drain`` in piecewise drains left out and none run (``skipped`` > 0, ``once`` 0); ``full-replay-ordered-on-device``
    in full_decode_only drains replaced by a device boundary (``replaced`` > 0) and task-group updates
    (``task_group_updates`` > 0)."""
    if not res.get("async_scheduling"):
        return []
    items = (res.get("zb_patch_status") or {}).get("report") or {}
    applied = {i["id"] for i in items.get("items", []) if i.get("verdict") in ("applied", "already-applied")}
    drains = res.get("host_drains", {})
    once, skipped, replaced = (drains.get(k, 0) for k in ("once", "skipped", "replaced"))
    updates = sum(res.get("task_group_updates", {}).values())
    failures = []
    if asked == "piecewise" and ONCE_PER_STEP in applied and once == 0:
        failures.append(f"{name}: {ONCE_PER_STEP} applied, no host drain ran once per step (host_drains {drains})")
    if asked == "piecewise" and NO_DRAIN in applied and (skipped == 0 or once):
        failures.append(
            f"{name}: {NO_DRAIN} applied, host drains skipped {skipped} and run once per step {once} "
            f"(want > 0 and 0; host_drains {drains})"
        )
    if asked == "full_decode_only" and any(i.startswith(FULL_ORDERING) for i in applied) and not (replaced and updates):
        failures.append(
            f"{name}: {FULL_ORDERING} applied, host drains replaced {replaced} and task-group updates {updates} "
            f"(want both > 0; host_drains {drains}, task_group_updates {res.get('task_group_updates', {})})"
        )
    return failures


def async_vs_sync(sync: dict, other: dict, wl: Workload, vocab: int, name: str) -> tuple[list[str], list[str]]:
    """Rules 3 and 5 for one async run: (failures, notes)."""
    failures = [f"{name} vs sync: {d}" for d in divergences(sync, other, fields=("tokens",))]
    f, notes = counts_vs_sync(sync, other, wl, vocab, name)
    return failures + f, notes


def classic_async_notes(runs: dict[str, dict], wl: Workload, vocab: int) -> list[str]:
    """Classic async held to rules 3-5, as notes: what the release does without zb-patch."""
    f, n = async_vs_sync(runs["sync"], runs[BESIDE], wl, vocab, BESIDE)
    found = f + n
    found += [f"async vs async+fixes: {d}" for d in divergences(runs["async+fixes"], runs[BESIDE], STRICT_FIELDS)]
    shown = [f"async (classic, without zb-patch, not judged): {x}" for x in found[:BESIDE_NOTES]]
    if len(found) > BESIDE_NOTES:
        shown.append(f"async (classic, without zb-patch, not judged): {len(found) - BESIDE_NOTES} more differences")
    return shown


def scheduling_failures(runs: dict[str, dict]) -> list[str]:
    """Rule 1: sync ran synchronously, the async runs asynchronously (steps scheduled while one was in flight)."""
    out = []
    for name, res in runs.items():
        sched = res["scheduling"]
        want_async = name != "sync"
        if res["async_scheduling"] != want_async or (sched["scheduler"] == "AsyncScheduler") != want_async:
            out.append(f"{name}: async_scheduling {res['async_scheduling']}, scheduler {sched['scheduler']}")
        if want_async and not sched["overlapped"]:
            out.append(f"{name}: no step was scheduled while another was in flight (async scheduling did not run)")
        if not want_async and sched["overlapped"]:
            out.append(f"{name}: {sched['overlapped']} steps scheduled while another was in flight")
    return out


def zero_bubble_failures(runs: dict[str, dict]) -> list[str]:
    """Rule 2: the zb-patch run's zero-bubble ran and corrected the steps that needed it; async+fixes with zb-patch in
    effect but not its zero-bubble; classic async without zb-patch."""
    out = []
    zb_run = runs["async+zb"]
    for name in ("async+zb", "async+fixes"):
        status = runs[name].get("zb_patch_status", {})
        if status.get("state") not in IN_EFFECT:
            out.append(
                f"{name}: zb-patch is {status.get('state')!r}, not in effect ({status.get('reason', 'no reason')})"
            )
    if runs["async+fixes"]["zero_bubble"]["kind"] == "zb-patch":
        out.append("async+fixes: zb-patch's zero-bubble ran (ZB_PATCH_DISABLE should have left it out)")
    if BESIDE in runs:
        plain = runs[BESIDE].get("zb_patch_status", {})
        if plain.get("state") != "off":
            out.append(f"async: zb-patch should be off, is {plain.get('state')!r}")
        if runs[BESIDE]["zero_bubble"]["kind"] == "zb-patch":
            out.append("async: zb-patch's zero-bubble ran in the classic async run")
    zb = zb_run["zero_bubble"]
    need = zb_run["scheduling"]["after_drafts"]
    if zb["kind"] == "native":
        if not zb["active"]:
            out.append("async+zb: the release's own zero-bubble (use_async_spec_decode) is off")
    elif zb["kind"] != "zb-patch":
        out.append("async+zb: zero-bubble did not run (neither zb-patch's backport nor the release's own)")
    elif not zb["active"]:
        out.append(f"async+zb: zero-bubble switched itself off at run time: {zb['reason'] or 'no reason given'}")
    else:
        if need == 0 and sum(zb_run["drafted"].values()):
            out.append("async+zb: drafts were verified, but no step scheduled a request right after its drafts")
        if zb["corrected_steps"] < need:
            out.append(
                f"async+zb: zero-bubble corrected {zb['corrected_steps']} steps, {need} scheduled a request right "
                "after a step that verified its drafts"
            )
        if zb["host_waits"] > zb["corrected_steps"]:
            out.append(f"async+zb: {zb['host_waits']} host waits for {zb['corrected_steps']} corrected steps")
    return out


def counts_vs_sync(sync: dict, other: dict, wl: Workload, vocab: int, name: str) -> tuple[list[str], list[str]]:
    """Rule 5 for one async run: (failures, notes)."""
    failures: list[str] = []
    notes: list[str] = []
    k = wl.num_speculative_tokens
    limit_zone = wl.max_model_len - 2 * (k + 1)
    at_limit = wl.reaches_max_model_len(vocab)
    requests = sorted(set(sync["verifications"]) | set(other["verifications"]), key=_order)
    for r in requests:
        recs = {"sync": sync["verifications"].get(r, []), name: other["verifications"].get(r, [])}
        mine, theirs = _by_position(recs["sync"]), _by_position(recs[name])
        one_pass = []  # (position, run) where the counts differ because that run's drafts came from one pass
        for pos in sorted(set(mine) & set(theirs)):
            for d1, a1 in mine[pos]:
                for d2, a2 in theirs[pos]:
                    if min(a1, d2) == min(a2, d1):
                        continue
                    if _one_pass_in_one_run(sync, other, r, pos) and min(a1, 1) == min(a2, 1):
                        one_pass.append((pos, "sync" if _passes(sync, r, pos) == 1 else name))
                        continue
                    failures.append(
                        f"{name} vs sync: {r} at position {pos}: {a1} of {d1} drafts accepted vs {a2} of {d2}"
                    )
        events = _events(r, {"sync": sync, name: other}, k, limit_zone if r in at_limit else None, one_pass)
        first = min(events) if events else (math.inf, "")
        unmatched = sorted(set(mine) ^ set(theirs))
        early = [p for p in unmatched if p < first[0] - (k + 1)]
        if early:
            failures.append(
                f"{name} vs sync: {r}: verifications at positions {early[:6]} in one run only, "
                + (f"before the first explaining event ({first[1]})" if events else "and no explaining event")
            )
        diff = [f"{f} {_sum(sync, f, r)} vs {_sum(other, f, r)}" for f in ("drafted", "accepted")]
        diff = [d for d, f in zip(diff, ("drafted", "accepted")) if _sum(sync, f, r) != _sum(other, f, r)]
        if (diff or one_pass) and not early:
            if events:
                excused = f"; accepted counts differ at {[p for p, _ in one_pass]} (one pass)" if one_pass else ""
                notes.append(
                    f"{name} vs sync: {r} {', '.join(diff) or 'same totals'}: from position {first[0]} "
                    f"({first[1]}); {len(unmatched)} verifications in one run only{excused}"
                )
            else:  # different draft counts at the same positions without any event: cannot happen, say so
                failures.append(f"{name} vs sync: {r} {', '.join(diff)} without an explaining event")
    return failures, notes


def _events(
    r: str, runs: dict[str, dict], k: int, limit_zone: int | None, one_pass: list[tuple[int, str]]
) -> list[tuple[int, str]]:
    """(position, what) of every event of request ``r`` that explains a different draft schedule; ``one_pass``: the
    (position, run) where the accepted counts differ because that run's drafts came from one pass."""
    events = [(pos, f"drafts from one draft pass at {pos} in {run}") for pos, run in one_pass]
    for run, res in runs.items():
        events += [(pos, f"preempted at {pos} in {run}") for pos in res["preempted_at"].get(r, [])]
        for pos, drafted, _, with_prompt in res["verifications"].get(r, []):
            if with_prompt:
                events.append((pos, f"drafts verified with prompt tokens at {pos} in {run}"))
            elif drafted < k and (limit_zone is None or pos < limit_zone):
                events.append((pos, f"{drafted} of {k} drafts at {pos} in {run} (token budget)"))
    if limit_zone is not None:
        events.append((limit_zone, f"max_model_len clamp from position {limit_zone}"))
    return events


def _passes(result: dict, r: str, pos: int) -> int | None:
    """How many draft passes made the drafts of request ``r`` verified at ``pos`` (the child's ``draft_passes``:
    vllm-ascend 0.13's MTP drafter only), or None where not recorded."""
    record = result.get("draft_passes", {}).get(r, {}).get(str(pos))
    return None if record is None else record[0]


def _one_pass_in_one_run(first: dict, second: dict, r: str, pos: int) -> bool:
    """Both runs recorded the passes of the drafts verified at ``pos``, and exactly one made them in one pass while
    the other ran more (its first draft repeated vs one pass per draft: only the first draft is the same)."""
    passes = (_passes(first, r, pos), _passes(second, r, pos))
    return None not in passes and min(passes) == 1 < max(passes)


def _by_position(records: list) -> dict[int, list[tuple[int, int]]]:
    """Decode-step verifications by position: {position: [(drafted, accepted), ...]}."""
    out: dict[int, list[tuple[int, int]]] = {}
    for pos, drafted, accepted, with_prompt in records:
        if not with_prompt:
            out.setdefault(pos, []).append((drafted, accepted))
    return out


def _sum(result: dict, field: str, r: str) -> int:
    return result[field].get(r, 0)


def _order(req: str):
    return int(req) if req.isdigit() else req
