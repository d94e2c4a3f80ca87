"""The verdict of ``zb-patch selftest --engine --model`` (an operator's model): plain data in (each run's result as
:func:`.child.run_model` writes it), ``(failures, notes)`` and figures out; no engine, no vLLM.

The runs are named by their configuration (:data:`.deploy.CONFIGS`); a configuration named twice gets ``#2`` on its
second run. The rules (docs/selftest.md, "On your model"):

1. **The tiny-model self-test** (the strict check, exact rules) passed on this hardware; when it was not run the
   verdict says so (``PASS-WITHOUT-STRICT-CHECK``, never ``PASS``).
2. **The noise floor**: ``async+fixes`` against ``async+fixes#2`` (one configuration twice): per request the first
   diverging output position, drafted / accepted, the acceptance rate, and the steps with identical schedules whose
   outputs differ. The floor is *exact* when none of these differ.
3. **Each zero-bubble run** (``async+zb``, ``async+zb+<opt-in id>``) against ``async+fixes``:

   - exact floor: every request's tokens, drafted and accepted identical; else FAIL naming the first diverging
     request and position;
   - floor not exact: at most the floor's diverging requests plus :data:`REQUEST_MARGIN` of the requests (rounded
     up) may diverge, and the acceptance rate may differ by the floor's difference plus :data:`ACCEPTANCE_MARGIN`;
     else FAIL naming the first diverging request and position;
   - identical schedules, identical outputs: over the steps whose schedule (each request's computed tokens,
     scheduled tokens and output tokens so far) is the same in both runs and whose requests have the same output
     tokens so far, the tokens each step sampled agree on their common length (the drafts themselves stay on the
     device: with different drafts one run may accept fewer). A step that breaks it is a FAIL where the floor has
     none; where the floor has some (kernels not deterministic here), a note.

4. **Each async run ran as configured** (:func:`.verdict.scheduling_failures`), zero-bubble active and correcting
   the steps that need it in the zero-bubble runs and not running in ``async+fixes``
   (:func:`.verdict.zero_bubble_failures`), each opt-in run's patch applied in the workers.
5. **Graph modes**: a run whose ``cudagraph_mode`` is not NONE captured graphs and replayed its decode steps in that
   mode (PIECEWISE, else FULL) while generating, and each graph patch applied in its workers counted its work
   (:func:`.verdict.graph_patch_failures`).

``sync`` and classic ``async`` (zb-patch off) are reported beside: token agreement and acceptance against
``async+fixes``, never judged (they schedule differently, and batch composition moves a real model's numerics).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from .verdict import REPLAY_MODE, graph_patch_failures, scheduling_failures, zero_bubble_failures

REFERENCE = "async+fixes"
FLOOR = "async+fixes#2"
ZB = "async+zb"
OPT_IN_PREFIX = "async+zb+"
BESIDE_RUNS = ("sync", "async")
# beyond the noise floor, when it is not exact: more diverging requests (a fraction of the requests, rounded up)
REQUEST_MARGIN = 0.05
# ... and acceptance-rate difference (absolute, 0..1)
ACCEPTANCE_MARGIN = 0.02


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first output position where ``a`` and ``b`` differ (the shorter one's length if one is a prefix of the
    other), None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def acceptance(res: dict) -> float:
    drafted = sum(res["drafted"].values())
    return sum(res["accepted"].values()) / drafted if drafted else 0.0


def schedule_mismatches(a: dict, b: dict) -> tuple[int, list[str]]:
    """(steps compared, mismatches) of rule 3's identical-schedule check between runs ``a`` and ``b``."""
    by_key = {_key(s): s for s in b.get("steps", [])}
    compared, bad = 0, []
    for step in a.get("steps", []):
        other = by_key.get(_key(step))
        if other is None:
            continue
        same_history = all(
            a["tokens"].get(r, [])[:n_out] == b["tokens"].get(r, [])[:n_out] for r, _, _, n_out in step["sched"]
        )
        if not same_history:
            continue
        compared += 1
        for r, computed, scheduled, n_out in step["sched"]:
            x, y = step["out"].get(r, []), other["out"].get(r, [])
            n = min(len(x), len(y))
            if x[:n] != y[:n]:
                bad.append(
                    f"request {r} at output position {n_out} (computed {computed}, scheduled {scheduled}): "
                    f"sampled {x} vs {y}"
                )
    return compared, bad


def _key(step: dict) -> tuple:
    return tuple(tuple(entry) for entry in step["sched"])


def pair(a: dict, b: dict) -> dict:
    """What differs between runs ``a`` and ``b``: per request the first diverging position, drafted / accepted
    differences, acceptance rates, the identical-schedule check."""
    reqs = sorted(set(a["tokens"]) | set(b["tokens"]), key=_order)
    diverged = {}
    for r in reqs:
        pos = first_divergence(a["tokens"].get(r, []), b["tokens"].get(r, []))
        if pos is not None:
            diverged[r] = pos
    counts = [
        r
        for r in reqs
        if a["drafted"].get(r, 0) != b["drafted"].get(r, 0) or a["accepted"].get(r, 0) != b["accepted"].get(r, 0)
    ]
    compared, mismatches = schedule_mismatches(a, b)
    rate_a, rate_b = acceptance(a), acceptance(b)
    return {
        "requests": len(reqs),
        "diverged": diverged,
        "counts_differ": counts,
        "acceptance": [round(rate_a, 4), round(rate_b, 4)],
        "acceptance_diff": round(abs(rate_a - rate_b), 4),
        "identical_schedule_steps": compared,
        "schedule_mismatches": mismatches,
        "exact": not diverged and not counts and not mismatches and rate_a == rate_b,
    }


def first_diverging(diverged: dict[str, int]) -> str:
    """'request R at output position P': the earliest divergence (ties: request order)."""
    r = min(diverged, key=lambda q: (diverged[q], _order(q)))
    return f"request {r} at output position {diverged[r]}"


def judge_against_floor(name: str, p: dict, floor: dict) -> tuple[list[str], list[str]]:
    """Rule 3 for run ``name`` (``p``: :func:`pair` of it against async+fixes) given the floor."""
    failures: list[str] = []
    notes: list[str] = []
    n = p["requests"]
    if floor["exact"]:
        if p["diverged"]:
            failures.append(
                f"{name} vs {REFERENCE}: {len(p['diverged'])} of {n} requests diverge, the noise floor is exact: "
                f"first at {first_diverging(p['diverged'])}"
            )
        if p["counts_differ"]:
            failures.append(
                f"{name} vs {REFERENCE}: drafted / accepted differ for requests {p['counts_differ'][:8]}, the noise "
                "floor is exact"
            )
    else:
        allowed = len(floor["diverged"]) + math.ceil(REQUEST_MARGIN * n)
        if len(p["diverged"]) > allowed:
            failures.append(
                f"{name} vs {REFERENCE}: {len(p['diverged'])} of {n} requests diverge, more than the noise floor's "
                f"{len(floor['diverged'])} + margin {allowed - len(floor['diverged'])}: first at "
                f"{first_diverging(p['diverged'])}"
            )
        elif p["diverged"]:
            notes.append(
                f"{name} vs {REFERENCE}: {len(p['diverged'])} of {n} requests diverge, within the noise floor's "
                f"{len(floor['diverged'])} + margin {allowed - len(floor['diverged'])} (first at "
                f"{first_diverging(p['diverged'])})"
            )
        bound = floor["acceptance_diff"] + ACCEPTANCE_MARGIN
        if p["acceptance_diff"] > bound:
            failures.append(
                f"{name} vs {REFERENCE}: acceptance rate {p['acceptance'][0]:.4f} vs {p['acceptance'][1]:.4f} "
                f"differs by {p['acceptance_diff']:.4f}, more than the noise floor's {floor['acceptance_diff']:.4f} "
                f"+ margin {ACCEPTANCE_MARGIN}"
            )
    if p["schedule_mismatches"]:
        what = (
            f"{name} vs {REFERENCE}: {len(p['schedule_mismatches'])} of {p['identical_schedule_steps']} steps with "
            f"identical schedules sampled different tokens, first: {p['schedule_mismatches'][0]}"
        )
        if floor["schedule_mismatches"]:
            notes.append(what + " (the noise floor has such steps too: kernels not deterministic here)")
        else:
            failures.append(what)
    return failures, notes


def graph_failures(name: str, res: dict) -> list[str]:
    """Rule 5 for one run."""
    mode = str(res.get("cudagraph_mode", "NONE")).rsplit(".", 1)[-1]
    if mode == "NONE":
        return []
    asked = "piecewise" if mode == "PIECEWISE" else "full_decode_only"
    replay = REPLAY_MODE[asked]
    if not res.get("graphs_captured"):
        return [f"{name}: cudagraph_mode {mode} captured no graph"]
    if not res.get("graph_replays", {}).get(replay):
        return [
            f"{name}: cudagraph_mode {mode} replayed no {replay} graph while generating "
            f"(graph_replays {res.get('graph_replays', {})})"
        ]
    worker_view = {**res, "zb_patch_status": res.get("worker_zb_patch_status", res.get("zb_patch_status"))}
    return graph_patch_failures(name, worker_view, asked)


def applied_ids(res: dict) -> set[str]:
    status = res.get("worker_zb_patch_status") or res.get("zb_patch_status") or {}
    items = (status.get("report") or {}).get("items", [])
    return {i["id"] for i in items if i.get("verdict") in ("applied", "already-applied")}


def judge(runs: dict[str, dict], tiny: dict | None) -> dict:
    """The whole verdict: ``runs`` by name (:data:`REFERENCE` and :data:`FLOOR` required), ``tiny`` the tiny-model
    self-test's report (None: not run). Returns ``{verdict, failures, notes, floor, pairs, opt_in}``."""
    failures: list[str] = []
    notes: list[str] = []
    if tiny is None:
        notes.append("tiny-model strict check: not run (--skip-tiny-check): this verdict rests on the rules below only")
    elif tiny.get("verdict") != "PASS":
        failures += [f"tiny-model strict check: {f}" for f in tiny.get("failures", [])] or [
            f"tiny-model strict check: {tiny.get('verdict')}"
        ]
    ref = runs[REFERENCE]
    floor = pair(ref, runs[FLOOR])
    floor_notes = []
    if not floor["exact"]:
        floor_notes.append(
            f"noise floor not exact: {len(floor['diverged'])} of {floor['requests']} requests diverge between two "
            f"{REFERENCE} runs"
            + (f" (first at {first_diverging(floor['diverged'])})" if floor["diverged"] else "")
            + f", acceptance {floor['acceptance'][0]:.4f} vs {floor['acceptance'][1]:.4f}, "
            f"{len(floor['schedule_mismatches'])} identical-schedule steps with different outputs"
        )
    notes += floor_notes
    async_runs = {n: r for n, r in runs.items() if n != "sync" and n not in BESIDE_RUNS}
    failures += scheduling_failures(async_runs)
    if "sync" in runs:
        failures += scheduling_failures({"sync": runs["sync"]})
    pairs: dict[str, Any] = {}
    opt_in: dict[str, dict] = {}
    for name in [n for n in runs if n == ZB or n.startswith(OPT_IN_PREFIX)]:
        res = runs[name]
        own: list[str] = []
        own_notes: list[str] = []
        p = pair(res, ref)
        pairs[name] = p
        f, n = judge_against_floor(name, p, floor)
        own += f
        own_notes += n
        zb_view = {"async+zb": res, "async+fixes": ref}
        own += [x.replace("async+zb:", f"{name}:", 1) for x in zero_bubble_failures(zb_view)]
        if name.startswith(OPT_IN_PREFIX):
            patch_id = name[len(OPT_IN_PREFIX) :]
            if patch_id not in applied_ids(res):
                own.append(f"{name}: opt-in patch {patch_id} was not applied in the run's workers")
            opt_in[patch_id] = {"verdict": "FAIL" if own else "PASS", "failures": own}
        failures += own
        notes += own_notes
    if "async" in runs:  # zb-patch off in the classic run
        plain = runs["async"].get("zb_patch_status", {})
        if plain.get("state") != "off":
            failures.append(f"async: zb-patch should be off, is {plain.get('state')!r}")
    if runs[REFERENCE]["zero_bubble"].get("kind") == "zb-patch" or runs[FLOOR]["zero_bubble"].get("kind") == "zb-patch":
        failures.append(f"{REFERENCE}: zb-patch's zero-bubble ran (ZB_PATCH_DISABLE should have left it out)")
    for name, res in runs.items():
        failures += graph_failures(name, res) if name not in BESIDE_RUNS else []
    for name in BESIDE_RUNS:
        if name in runs:
            p = pair(runs[name], ref)
            pairs[name] = p
            notes.append(
                f"{name} (reported, not judged) vs {REFERENCE}: {p['requests'] - len(p['diverged'])} of "
                f"{p['requests']} requests identical"
                + (f", first divergence at {first_diverging(p['diverged'])}" if p["diverged"] else "")
                + f"; acceptance {p['acceptance'][0]:.4f} vs {p['acceptance'][1]:.4f}"
            )
    if failures:
        verdict = "FAIL"
    elif tiny is None:
        verdict = "PASS-WITHOUT-STRICT-CHECK"
    else:
        verdict = "PASS"
    return {"verdict": verdict, "failures": failures, "notes": notes, "floor": floor, "pairs": pairs, "opt_in": opt_in}


# -- speed: TPOT / ITL / output throughput per run -----------------------------------------------------------------


def speed(res: dict) -> dict:
    """One run's figures, in milliseconds and tokens per second: TPOT per request from the engine's own timestamps
    (``(last_token_ts - first_token_ts) / (generated - 1)``, vLLM's RequestStateStats), ITL as the time between a
    request's consecutive steps that produced tokens (the engine core processing each step's result), output tokens
    per second over the ``generate`` call."""
    tpot = []
    for m in res.get("metrics", {}).values():
        n = m.get("num_generation_tokens", 0)
        if n > 1 and m.get("last_token_ts", 0) > m.get("first_token_ts", 0):
            tpot.append(1000.0 * (m["last_token_ts"] - m["first_token_ts"]) / (n - 1))
    last: dict[str, float] = {}
    itl = []
    for step in res.get("steps", []):
        for r, out in step["out"].items():
            if not out:
                continue
            if r in last:
                itl.append(1000.0 * (step["t"] - last[r]))
            last[r] = step["t"]
    generated = sum(len(t) for t in res["tokens"].values())
    secs = res.get("generate_seconds") or 0.0
    return {
        "tpot_ms_median": _median(tpot),
        "itl_ms_median": _median(itl),
        "itl_ms_p90": _quantile(itl, 0.9),
        "output_tokens": generated,
        "output_tokens_per_s": round(generated / secs, 2) if secs else None,
        "acceptance": round(acceptance(res), 4),
    }


def speed_over_repeats(figures: list[dict]) -> dict:
    """Median and spread (min, max) of each figure over a configuration's repeats."""
    out: dict[str, Any] = {"repeats": len(figures)}
    for key in ("tpot_ms_median", "itl_ms_median", "output_tokens_per_s"):
        values = [f[key] for f in figures if f.get(key) is not None]
        out[key] = round(statistics.median(values), 3) if values else None
        out[key + "_spread"] = [round(min(values), 3), round(max(values), 3)] if values else None
    return out


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def _order(req: str):
    return (0, int(req), "") if req.isdigit() else (1, 0, req)
