"""``zb-patch selftest --engine``: generate tokens through the installed stack with and without zb-patch.

Writes the tiny target + draft of :mod:`.model` (EAGLE head, or with ``drafter="mtp"`` a MiMo target with its own
MTP layer), then runs the workload of :mod:`.workload` once per
configuration, each in its own process (:mod:`.child`): synchronous scheduling, async scheduling without zb-patch
and async scheduling with ``ZB_PATCH=1``. PASS when every run finishes, the token ids of every request are
identical in all three, the zb-patch run equals classic async in drafted and accepted counts per request, both
equal sync's counts (except where vLLM's own sync and async scheduling differ, see :func:`compare`), and the
zb-patch process reports its adapter applied (or the stack's zero-bubble native). docs/e2e.md has the details.

Needs an NPU: the children check first (``child --check-device``) and the command exits 2 without running an
engine when there is none. The tests run it through the CPU emulation of the NPU ops by naming their launcher in
``ZB_SELFTEST_ENGINE_CHILD`` (a Python script run instead of ``-m zb_patch.check.engine.child``).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TextIO

from zb_patch.detect import package

from .model import VOCAB, write_models, write_mtp_model
from .workload import Workload, divergences, summarize, table

SCHEMA = "zb-patch-selftest-engine/1"
# not "ZB_PATCH_*": zb-patch refuses to activate when it sees a ZB_PATCH_* variable it does not know
CHILD_ENV = "ZB_SELFTEST_ENGINE_CHILD"
# name -> (child flags, environment): the three configurations compared
CONFIGS: dict[str, tuple[list[str], dict[str, str]]] = {
    "sync": ([], {}),
    "async": (["--async"], {}),
    "async+zb": (["--async"], {"ZB_PATCH": "1"}),
}
# the process states of zb-patch that mean "zero-bubble is in effect" (zb_patch.plugin)
IN_EFFECT = ("applied", "native")


def child_command() -> list[str]:
    script = os.environ.get(CHILD_ENV)
    return [sys.executable, script] if script else [sys.executable, "-m", "zb_patch.check.engine.child"]


def check_device(timeout: float = 300.0) -> dict:
    """What a child process says about the NPU ({"available": bool, "reason" | "name": ...})."""
    proc = subprocess.run([*child_command(), "--check-device"], capture_output=True, text=True, timeout=timeout)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"available": False, "reason": f"device check failed (rc {proc.returncode}): {proc.stderr[-2000:]}"}


@dataclass
class Run:
    """One finished (or failed) engine process."""

    name: str
    tag: str
    result: dict | None
    seconds: float
    returncode: int
    stderr: str


def run_config(
    name: str,
    models: str,
    out_dir: str,
    wl: Workload,
    extra_args: Sequence[str] = (),
    timeout: float = 3600.0,
) -> Run:
    """One engine process of configuration ``name`` (:data:`CONFIGS`)."""
    flags, extra_env = CONFIGS[name]
    suffix = "-".join(a.lstrip("-").replace(",", "+") for a in extra_args) or "plain"
    tag = f"{name}-k{wl.num_speculative_tokens}-{suffix}"
    out = os.path.join(out_dir, f"{tag}.json")
    env = {k: v for k, v in os.environ.items() if k not in ("ZB_PATCH", CHILD_ENV)}
    env.update(extra_env)
    cmd = [*child_command(), "--models", models, "--out", out, "--workload", json.dumps(wl.to_json()), *flags]
    start = time.monotonic()
    proc = subprocess.run([*cmd, *extra_args], env=env, capture_output=True, text=True, timeout=timeout)
    secs = time.monotonic() - start
    result = None
    if proc.returncode == 0:
        with open(out) as f:
            result = json.load(f)
    return Run(name, tag, result, secs, proc.returncode, proc.stderr)


def run_all(jobs: Sequence[Callable[[], Run]], parallel: int) -> list[Run]:
    """Run engine processes ``parallel`` at a time, results in the order of ``jobs``."""
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return list(pool.map(lambda job: job(), jobs))


def compare(runs: dict[str, dict], wl: Workload) -> tuple[list[str], list[str]]:
    """(failures, notes) of the three configurations' results.

    Counts are compared with sync's over the drafts verified in decode steps, except for requests that end at
    ``max_model_len`` and requests preempted in either run; those are notes, where vLLM's own sync and async
    scheduling differ with and without zb-patch alike (docs/e2e.md, "Findings"): at ``max_model_len`` the sync
    scheduler verifies one draft more; async scheduling reserves KV blocks for the optimistic tokens and schedules
    before the step in flight has returned, so it preempts at other moments (or other requests) than sync, and a
    preempted request recomputes its tokens and verifies other drafts afterwards. vLLM 0.13's sync scheduler verifies
    drafts together with a request's last prompt chunk, which async scheduling never does: those are counted apart,
    and a request that has them in either run is a note too (the draft sync accepted with its prompt, async accepts
    in a decode step). Tokens must be equal everywhere, and zb-patch must equal classic async in every field.
    """
    failures: list[str] = []
    notes: list[str] = []
    sync = runs["sync"]
    if sum(sync["drafted"].values()) == 0:
        failures.append("sync: no draft token was verified (speculative decoding did not run)")
    at_limit = wl.reaches_max_model_len(VOCAB)
    for name, res in runs.items():
        with_prefill = sum(res.get("drafted_in_prefill", {}).values())
        if with_prefill:
            notes.append(f"{name}: {with_prefill} drafts verified together with prompt tokens (not compared)")
    for name in ("async", "async+zb"):
        failures += [f"{name} vs sync: {d}" for d in divergences(sync, runs[name], fields=("tokens",))]
        preempted = _preempted(sync, runs[name])
        with_prompt = _drafts_with_prompt(sync, runs[name])
        for d in divergences(decode_counts(sync), decode_counts(runs[name]), fields=("drafted", "accepted")):
            request = d.split()[0]
            if request in preempted:
                notes.append(f"{name} vs sync: {d} (preempted {preempted[request]})")
            elif request in with_prompt:
                notes.append(f"{name} vs sync: {d} (drafts verified with prompt tokens: {with_prompt[request]})")
            else:
                (notes if request in at_limit else failures).append(f"{name} vs sync: {d}")
    failures += [f"async+zb vs async: {d}" for d in divergences(runs["async"], runs["async+zb"])]
    zb = runs["async+zb"].get("zb_patch_status", {})
    if zb.get("state") not in IN_EFFECT:
        failures.append(
            f"async+zb: zb-patch is {zb.get('state')!r}, not in effect ({zb.get('reason', 'no reason given')})"
        )
    plain = runs["async"].get("zb_patch_status", {})
    if plain.get("state") != "off":
        failures.append(f"async: zb-patch should be off, is {plain.get('state')!r}")
    return failures, notes


def _preempted(sync: dict, other: dict) -> dict[str, str]:
    """Requests preempted in ``sync`` or in ``other``: {request: "a vs b times"}."""
    return {r: f"{pair} times" for r, pair in _in_either(sync, other, "preemptions").items()}


def _drafts_with_prompt(sync: dict, other: dict) -> dict[str, str]:
    """Requests with drafts verified together with prompt tokens in ``sync`` or ``other`` (vLLM 0.13's sync
    scheduler: a draft it verifies with the last prompt chunk, async scheduling verifies in a decode step):
    {request: "a vs b"}."""
    return _in_either(sync, other, "drafted_in_prefill")


def _in_either(sync: dict, other: dict, field: str) -> dict[str, str]:
    """Requests with a non-zero per-request ``field`` in either result: {request: "a vs b"}."""
    a, b = sync.get(field, {}), other.get(field, {})
    return {r: f"{a.get(r, 0)} vs {b.get(r, 0)}" for r in sorted(set(a) | set(b)) if a.get(r, 0) or b.get(r, 0)}


def decode_counts(result: dict) -> dict:
    """``result`` with drafted / accepted counting only the drafts verified in decode steps (the child counts the
    ones verified together with prompt tokens apart: ``drafted_in_prefill`` / ``accepted_in_prefill``)."""
    out = dict(result)
    for field in ("drafted", "accepted"):
        apart = result.get(f"{field}_in_prefill", {})
        out[field] = {r: n - apart.get(r, 0) for r, n in result[field].items() if n - apart.get(r, 0)}
    return out


def run_engine_selftest(
    wl: Workload,
    ks: Sequence[int],
    parallel: int = 1,
    keep: str | None = None,
    log: TextIO | None = None,
    drafter: str = "eagle",
) -> dict:
    """The whole comparison for each k in ``ks``; returns the report (see :data:`SCHEMA`)."""
    log = log or sys.stderr
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "versions": _versions(),
        "workload": wl.to_json(),
        "drafter": drafter,
        "k": {},
    }
    device = check_device()
    report["device"] = device
    if not device["available"]:
        report.update(verdict="NO-DEVICE", failures=[f"no NPU: {device.get('reason', '')}"])
        return report
    root = keep or tempfile.mkdtemp(prefix="zb-patch-engine-")
    os.makedirs(root, exist_ok=True)
    models = os.path.join(root, "models")
    if drafter == "mtp":
        write_mtp_model(models)
        extra_args: tuple[str, ...] = ("--drafter", "mtp")  # in the run's tag too: results "<config>-k<k>-drafter-mtp"
    else:
        write_models(models)
        extra_args = ()
    failures: list[str] = []
    for k in ks:
        wk = replace(wl, num_speculative_tokens=k)
        print(f"zb-patch selftest --engine: k = {k}: {len(CONFIGS)} engine runs, {parallel} at a time", file=log)
        runs = run_all([functools.partial(run_config, n, models, root, wk, extra_args) for n in CONFIGS], parallel)
        entry: dict[str, Any] = {"seconds": {r.tag: round(r.seconds, 1) for r in runs}}
        crashed = [r for r in runs if r.result is None]
        if crashed:
            entry["failures"] = [
                f"{r.tag}: engine process failed (rc {r.returncode}): {_tail(r.stderr)}" for r in crashed
            ]
        else:
            results = {r.name: r.result for r in runs if r.result is not None}
            entry["failures"], entry["notes"] = compare(results, wk)
            entry["rows"] = [summarize(n, res) for n, res in results.items()]
            entry["divergences"] = {n: len(divergences(results["sync"], res)) for n, res in results.items()}
        for r in runs:
            print(f"  {r.tag}: {r.seconds:.0f} s, rc {r.returncode}", file=log)
        report["k"][str(k)] = entry
        failures += [f"k={k}: {f}" for f in entry["failures"]]
    report["failures"] = failures
    report["verdict"] = "FAIL" if failures else "PASS"
    report["results"] = root if keep else None
    return report


def render(report: dict) -> str:
    """The human-readable report: one table per k, failures, notes, verdict."""
    lines = [f"versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items())}"]
    lines.append(f"drafter: {report['drafter']}")
    lines.append(f"device: {report['device'].get('name') or report['device'].get('reason')}")
    wl = report["workload"]
    lines.append(
        f"workload: {wl['num_requests']} requests, prompts {wl['min_prompt']}..{wl['max_prompt']} tokens, "
        f"max_model_len {wl['max_model_len']}, max_num_batched_tokens {wl['max_num_batched_tokens']}, "
        f"{wl['num_gpu_blocks']} KV blocks, greedy"
    )
    for k, entry in report["k"].items():
        lines.append(f"\nk = {k}")
        if "rows" in entry:
            lines.append(table(entry["rows"], entry["divergences"]))
        lines += [f"  FAIL {f}" for f in entry["failures"]]
        lines += [f"  note {n}" for n in entry.get("notes", [])]
    if report["verdict"] == "NO-DEVICE":
        lines += [f"FAIL {f}" for f in report["failures"]]
    lines.append(f"\nVerdict: {report['verdict']}")
    return "\n".join(lines)


def run_cli(args) -> int:
    """``zb-patch selftest --engine``: the report goes to ``args.out`` (stdout); progress to stderr."""
    wl = Workload(**json.loads(args.workload)) if args.workload else Workload()
    ks = [int(k) for k in args.k.split(",")]
    report = run_engine_selftest(wl, ks, parallel=args.jobs, keep=args.keep, log=sys.stderr, drafter=args.drafter)
    print(json.dumps(report, indent=2) if args.json else render(report), file=args.out)
    return {"PASS": 0, "FAIL": 1}.get(report["verdict"], 2)


def _versions() -> dict[str, str]:
    return {name: package(name).raw or "not installed" for name in ("vllm", "vllm_ascend", "torch", "torch_npu")}


def _tail(text: str, n: int = 1500) -> str:
    return text[-n:].strip().replace("\n", " | ")
