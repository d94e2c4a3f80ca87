"""``zb-patch selftest --engine``: generate tokens through the installed stack with and without zb-patch.

Writes the tiny target + draft of :mod:`.model` (EAGLE head, or with ``drafter="mtp"`` a MiMo target with its own
MTP layer), then runs the workload of :mod:`.workload` once per configuration, each in its own process
(:mod:`.child`): synchronous scheduling and async scheduling with zb-patch's fixes of the release's own defects only
(``sync``, ``async+fixes``: zero-bubble left out through ``ZB_PATCH_DISABLE``); async scheduling with ``ZB_PATCH=1``;
and classic async without zb-patch, reported beside (it can stop on those defects). PASS when the three judged runs
finish and :func:`.verdict.compare` finds nothing: each run scheduled as configured, zero-bubble ran (only) where it
should and corrected the steps that needed it, the token ids of every request are identical, the zb-patch run
equals ``async+fixes`` in every field the child records, and both async runs equal sync's counts except from an
explaining event on (docs/e2e.md, "Verdict").

Needs an NPU: the children check first (``child --check-device``) and the command exits 2 without running an
engine when there is none. The tests run it through the CPU emulation of the NPU ops by naming their launcher in
``ZB_SELFTEST_ENGINE_CHILD`` (a Python script run instead of ``-m zb_patch.check.engine.child``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from zb_patch.detect import package
from zb_patch.versions import adapters

from .model import VOCAB, write_deepseek_model, write_models, write_mtp_model
from .verdict import BESIDE, compare
from .workload import Workload, divergences, summarize, table

SCHEMA = "zb-patch-selftest-engine/1"
# progress lines: a child of vLLM's logger, as zb-patch's own (plugin.LOGGER_NAME); the CLI writes it to stderr
LOGGER = logging.getLogger("vllm.zb_patch.selftest")
# not "ZB_PATCH_*": zb-patch refuses to activate when it sees a ZB_PATCH_* variable it does not know
CHILD_ENV = "ZB_SELFTEST_ENGINE_CHILD"
# ZB_PATCH_DISABLE of every adapter's zero-bubble / kernel patches: zb-patch applies only its fixes of the release
FIXES_ONLY = ",".join(sorted({i for a in adapters() for i in a.zero_bubble_ids}))
# name -> (child flags, environment): the configurations run (verdict.JUDGED, and verdict.BESIDE reported beside)
CONFIGS: dict[str, tuple[list[str], dict[str, str]]] = {
    # the reference: the release's synchronous path with the fixes of its defects (0.13's MTP slots write other
    # requests' KV in sync too); zero-bubble never runs without async scheduling
    "sync": ([], {"ZB_PATCH": "1", "ZB_PATCH_DISABLE": FIXES_ONLY}),
    "async": (["--async"], {}),
    "async+fixes": (["--async"], {"ZB_PATCH": "1", "ZB_PATCH_DISABLE": FIXES_ONLY}),
    "async+zb": (["--async"], {"ZB_PATCH": "1"}),
}


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
    log: str  # the engine process's output, stdout and stderr together (vLLM logs to stdout)


def run_config(
    name: str,
    models: str,
    out_dir: str,
    wl: Workload,
    extra_args: Sequence[str] = (),
    timeout: float = 3600.0,
    env_overrides: dict[str, str] | None = None,
) -> Run:
    """One engine process of configuration ``name`` (:data:`CONFIGS`); ``env_overrides`` are set in its environment
    after the configuration's own."""
    flags, extra_env = CONFIGS[name]
    suffix = "-".join(a.lstrip("-").replace(",", "+") for a in extra_args) or "plain"
    tag = f"{name}-k{wl.num_speculative_tokens}-{suffix}"
    out = os.path.join(out_dir, f"{tag}.json")
    env = {k: v for k, v in os.environ.items() if k not in ("ZB_PATCH", "ZB_PATCH_DISABLE", CHILD_ENV)}
    env.update(extra_env)
    env.update(env_overrides or {})
    cmd = [*child_command(), "--models", models, "--out", out, "--workload", json.dumps(wl.to_json()), *flags]
    start = time.monotonic()
    proc = subprocess.run(
        [*cmd, *extra_args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    secs = time.monotonic() - start
    result = None
    if proc.returncode == 0:
        with open(out) as f:
            result = json.load(f)
    return Run(name, tag, result, secs, proc.returncode, proc.stdout)


def run_all(jobs: Sequence[Callable[[], Run]], parallel: int) -> list[Run]:
    """Run engine processes ``parallel`` at a time, results in the order of ``jobs``."""
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return list(pool.map(lambda job: job(), jobs))


def run_engine_selftest(
    wl: Workload,
    ks: Sequence[int],
    parallel: int = 1,
    keep: str | None = None,
    log: logging.Logger = LOGGER,
    drafter: str = "eagle",
    classic: bool = True,
    graph_mode: str = "eager",
) -> dict:
    """The whole comparison for each k in ``ks``; returns the report (see :data:`SCHEMA`). ``classic=False`` leaves
    out the classic async run (reported beside, never judged). ``graph_mode``: the child's ``--graph-mode`` (the
    verdict's rule 6 checks that each judged run captured and replayed graphs in it, and the applied graph patches'
    counted work). Progress lines go to ``log``."""
    names = [n for n in CONFIGS if classic or n != BESIDE]
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "versions": _versions(),
        "workload": wl.to_json(),
        "drafter": drafter,
        "graph_mode": graph_mode,
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
    if drafter in ("mtp", "deepseek-mtp"):
        (write_mtp_model if drafter == "mtp" else write_deepseek_model)(models)
        # in the run's tag too: results "<config>-k<k>-drafter-<drafter>"
        extra_args: tuple[str, ...] = ("--drafter", drafter)
    else:
        write_models(models)
        extra_args = ()
    if graph_mode != "eager":
        extra_args += ("--graph-mode", graph_mode)
    failures: list[str] = []
    for k in ks:
        wk = replace(wl, num_speculative_tokens=k)
        log.info("zb-patch selftest --engine: k = %d: %d engine runs, %d at a time", k, len(names), parallel)
        runs = run_all([functools.partial(run_config, n, models, root, wk, extra_args) for n in names], parallel)
        entry: dict[str, Any] = {"seconds": {r.tag: round(r.seconds, 1) for r in runs}}
        crashed = [r for r in runs if r.result is None and r.name != BESIDE]
        stopped = [
            f"{r.tag} (classic async, not judged) stopped (rc {r.returncode}): {stop_reason(r.log)}"
            for r in runs
            if r.result is None and r.name == BESIDE
        ]
        if crashed:
            entry["failures"] = [f"{r.tag}: engine process failed (rc {r.returncode}): {_tail(r.log)}" for r in crashed]
            entry["notes"] = stopped
        else:
            results = {r.name: r.result for r in runs if r.result is not None}
            entry["failures"], notes = compare(results, wk, VOCAB)
            entry["notes"] = stopped + notes
            entry["rows"] = [summarize(n, res) for n, res in results.items()]
            entry["divergences"] = {n: len(divergences(results["sync"], res)) for n, res in results.items()}
        for r in runs:
            log.info("zb-patch selftest --engine: run %s: %.0f s, rc %d", r.tag, r.seconds, r.returncode)
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
    lines.append(f"graph mode: {report.get('graph_mode', 'eager')}")
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
    """``zb-patch selftest --engine``: the report goes to ``args.out`` (stdout); progress through :data:`LOGGER`
    (stderr)."""
    wl = Workload(**json.loads(args.workload)) if args.workload else Workload()
    ks = [int(k) for k in args.k.split(",")]
    report = run_engine_selftest(
        wl,
        ks,
        parallel=args.jobs,
        keep=args.keep,
        drafter=args.drafter,
        classic=not args.no_classic,
        graph_mode=args.graph_mode,
    )
    print(json.dumps(report, indent=2) if args.json else render(report), file=args.out)
    return {"PASS": 0, "FAIL": 1}.get(report["verdict"], 2)


def _versions() -> dict[str, str]:
    return {name: package(name).raw or "not installed" for name in ("vllm", "vllm_ascend", "torch", "torch_npu")}


def stop_reason(log: str) -> str:
    """The line of an engine's log that says why it stopped: a device-side assertion, else the last exception line,
    else the log's tail."""
    lines = [line.strip() for line in log.splitlines()]
    for pattern in (re.compile(r"Assertion .* failed"), re.compile(r"\b\w+(Error|Exception): ")):
        found = [line for line in lines if pattern.search(line)]
        if found:
            return found[-1][-400:]
    return _tail(log, 400)


def _tail(text: str, n: int = 1500) -> str:
    return text[-n:].strip().replace("\n", " | ")
