"""The tier sweep in one command, for one carried stack: benchmarks/bench_engine_gpu.py once per cell (graph mode x
device ms x drafter x k), each cell running the tiers interleaved ``--repeats`` times (bench_engine_gpu's
``--configs`` and ``--repeats``).

    OUT=/some/dir python3 benchmarks/bench_tiers.py --stack .gpu-stack --models .gpu-models.tar.xz --quick
    OUT=/some/dir python3 benchmarks/bench_tiers.py --stack STACK --models ARCHIVE [--modes piecewise] [--tiers
        async,async+zb,opt-in] [--device-ms 2,20] [--drafters eagle] [--ks 3] [--repeats 3] [--plan] [--dry-run]

Tiers (``--tiers``, comma-separated): ``async`` (classic async scheduling, no zb-patch), ``async+fixes`` (ZB_PATCH=1,
zero-bubble left out), ``async+zb`` (ZB_PATCH=1, defaults), ``opt-in`` (``async+zb`` with the mode's opt-in graph
patch: ``piecewise-replay-without-host-drain`` in piecewise, ``full-replay-ordered-on-device`` in full_decode_only,
none in eager); any other bench_engine_gpu configuration name (``NAME~ID``, ``NAME@ID``) is passed as it is. On a
stack with native zero-bubble (vllm-ascend 0.19+) only ``async`` and ``async+zb`` run: zb-patch applies no backport
there and the opt-in ids do not exist.

``--quick``: modes piecewise, full_decode_only; EAGLE, k = 3; device ms 20, 2; tiers async, async+zb, opt-in;
3 repeats (every option given explicitly overrides it).

Cells run device ms first (every mode at the first device ms, then the next). Each cell writes its own report under
``$OUT/cells/<cell>/``; after every cell ``$OUT/bench_tiers.json`` and ``$OUT/bench_tiers.md`` are rewritten (one
table per mode: rows tier x device ms, TPOT median [min..max] over the repeats, ITL, output tokens / s, device idle
per step median / p90, host ms per step), so a run cut off leaves every finished cell. Tokens: within a mode (one
drafter and k), every tier at every device ms must generate the first run's tokens (greedy); each divergence is listed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # zb_patch from this repository (the GPU host has it on no other path)
from zb_patch import versions as V  # noqa: E402
from zb_patch.versions.fixes.graph_replay import FULL_ORDERING_ID, NO_DRAIN_ID  # noqa: E402

BENCH = os.path.join(HERE, "bench_engine_gpu.py")
MODES = ("eager", "piecewise", "full_decode_only")
OPT_IN = {"eager": None, "piecewise": f"async+zb@{NO_DRAIN_ID}", "full_decode_only": f"async+zb@{FULL_ORDERING_ID}"}
NATIVE_TIERS = ("async", "async+zb")
FULL = {
    "modes": "eager,piecewise,full_decode_only",
    "tiers": "async,async+fixes,async+zb,opt-in",
    "device_ms": "2,5,20",
    "drafters": "eagle,mtp",
    "ks": "1,3",
    "repeats": 3,
}
QUICK = {
    "modes": "piecewise,full_decode_only",
    "tiers": "async,async+zb,opt-in",
    "device_ms": "20,2",
    "drafters": "eagle",
    "ks": "3",
    "repeats": 3,
}
# seconds per engine run (one engine process, the default workload) for --plan's estimate, measured on an H200
# (docs/results.md, "Tiers per graph mode": 9-run graph-mode cells in 354-449 s, eager 432 s); measured figures are
# in every cell's report (bench_tiers.json "cells"[...]["seconds"]); the first cell of a mode adds a warm-up run
RUN_SECONDS = {"eager": 48.0, "piecewise": 38.0, "full_decode_only": 38.0}
CELL_OVERHEAD_S = 10.0  # the cell's device check and model unpacking


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/zb-bench-tiers"))
    ap.add_argument("--stack", default=os.path.join(os.path.dirname(HERE), ".gpu-stack"), help="carried stack folder")
    ap.add_argument("--models", help="the models archive (bench_engine_gpu.py --write-models)")
    ap.add_argument("--quick", action="store_true", help="the short preset (module docstring)")
    ap.add_argument("--modes", help=f"graph modes, comma-separated (default {FULL['modes']})")
    ap.add_argument("--tiers", help=f"tiers, comma-separated (default {FULL['tiers']})")
    ap.add_argument("--device-ms", help=f"device ms added per forward, comma-separated (default {FULL['device_ms']})")
    ap.add_argument("--drafters", help=f"eagle, mtp, deepseek-mtp; comma-separated (default {FULL['drafters']})")
    ap.add_argument("--ks", help=f"num_speculative_tokens, comma-separated (default {FULL['ks']})")
    ap.add_argument(
        "--repeats", type=int, help=f"engine runs per tier and cell, interleaved (default {FULL['repeats']})"
    )
    ap.add_argument("--reference", action="store_true", help="transformers' greedy reference in each mode's first cell")
    ap.add_argument("--keep-traces", action="store_true", help="keep each run's device trace (.json.gz)")
    ap.add_argument("--workload", help="bench_engine_gpu.py's --workload (Workload fields as JSON)")
    ap.add_argument(
        "--bench-args",
        default="",
        help="more bench_engine_gpu.py arguments, split as a shell would (e.g. --timeout 200)",
    )
    ap.add_argument(
        "--budget", type=float, default=3600.0, help="seconds for the whole sweep; cells past it do not run"
    )
    ap.add_argument("--plan", action="store_true", help="print the cells and the estimated duration, run nothing")
    ap.add_argument("--dry-run", action="store_true", help="bench_engine_gpu's --dry-run (a CPU machine)")
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    started = time.monotonic()
    args.out, args.stack = os.path.abspath(args.out), os.path.abspath(args.stack)
    args.models = os.path.abspath(args.models) if args.models else None
    release = _release(args.stack)
    native = not backports_zero_bubble(release)
    modes = _split(args.modes)
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad} (choose from {', '.join(MODES)})")
    cells = [
        {"mode": m, "device_ms": float(d), "drafter": dr, "k": int(k)}
        for d in _split(args.device_ms)
        for m in modes
        for dr in _split(args.drafters)
        for k in _split(args.ks)
    ]
    notes: list[str] = []
    for cell in cells:
        cell["tiers"], dropped = tiers_for(_split(args.tiers), cell["mode"], native)
        for t in dropped:
            note = f"{t}: not run in {cell['mode']} on vllm-ascend {release}"
            if note not in notes:
                notes.append(note)
    plan_s = estimate(cells, args.repeats)
    report: dict = {
        "schema": "zb-patch-bench-tiers/1",
        "argv": argv,
        "stack": {"dir": args.stack, "release": release, "native": native},
        "repeats": args.repeats,
        "estimate_s": round(plan_s),
        "notes": notes,
        "cells": [],
    }
    print(
        f"vllm-ascend {release}: {len(cells)} cells, {sum(len(c['tiers']) for c in cells) * args.repeats} engine "
        f"runs, estimated {plan_s / 60:.1f} min",
        flush=True,
    )
    for cell in cells:
        print(f"  {name_of(cell)}: {', '.join(cell['tiers'])}", flush=True)
    if args.plan:
        return 0
    os.makedirs(args.out, exist_ok=True)
    warmed: set[tuple] = set()
    referenced: set[str] = set()
    for cell in cells:
        left = started + args.budget - time.monotonic()
        entry = dict(cell, name=name_of(cell))
        report["cells"].append(entry)
        if not cell["tiers"]:
            entry["status"] = "no tier applies"
            continue
        if left < 60:
            entry["status"] = f"not run: {left:.0f} s of the budget left"
            write(args.out, report)
            continue
        out = os.path.join(args.out, "cells", entry["name"])
        os.makedirs(out, exist_ok=True)
        key = (cell["mode"], cell["drafter"], cell["k"])
        cmd = [
            sys.executable,
            BENCH,
            "--stack",
            args.stack,
            "--out",
            out,
            "--graph-mode",
            cell["mode"],
            "--drafter",
            cell["drafter"],
            "--k",
            str(cell["k"]),
            "--device-ms",
            f"{cell['device_ms']:g}",
            "--configs",
            ",".join(cell["tiers"]),
            "--repeats",
            str(args.repeats),
            "--budget",
            f"{left - 5:.0f}",
            *(["--models", args.models] if args.models else []),
            *([] if key not in warmed else ["--no-warmup"]),  # Triton's and vLLM's compile caches persist
            *([] if args.reference and cell["mode"] not in referenced else ["--no-reference"]),
            *(["--dry-run"] if args.dry_run else []),
            *(["--workload", args.workload] if args.workload else []),
            *shlex.split(args.bench_args),
        ]
        warmed.add(key)
        referenced.add(cell["mode"])
        entry["command"] = shlex.join(cmd[1:])
        t = time.monotonic()
        with open(os.path.join(out, "stdout.txt"), "w") as so, open(os.path.join(out, "stderr.txt"), "w") as se:
            rc = subprocess.run(cmd, stdout=so, stderr=se).returncode
        entry["seconds"] = round(time.monotonic() - t, 1)
        entry["rc"] = rc
        entry.update(collect(out, cell["tiers"], args.keep_traces))
        entry["status"] = "ran"
        print(f"{entry['name']}: rc {rc}, {entry['seconds']:.0f} s, verdict {entry.get('verdict')}", flush=True)
        compare_tokens(report)
        write(args.out, report)
    report["seconds"] = round(time.monotonic() - started, 1)
    compare_tokens(report)
    text = write(args.out, report)
    print(text)
    failed = [c for c in report["cells"] if c.get("rc") not in (0, None) or c.get("token_divergences")]
    return 1 if failed or report.get("token_divergences") else 0


def backports_zero_bubble(release: str) -> bool:
    """Whether zb-patch's adapter for this release carries the zero-bubble backport (and with it the opt-in graph
    patches), as the adapter table says; a native release (0.19+) has zero-bubble of its own."""
    adapter = V.release_verdict(release).adapter
    return adapter is not None and any(p.group.startswith("zero-bubble") for p in V.by_id(adapter).patch_set.patches)


def tiers_for(wanted: list[str], mode: str, native: bool) -> tuple[list[str], list[str]]:
    """The bench configurations of ``wanted`` tiers in ``mode``, and the tiers dropped there."""
    out, dropped = [], []
    for t in wanted:
        config = OPT_IN[mode] if t == "opt-in" else t
        if config is None or (native and t not in NATIVE_TIERS):
            dropped.append(t)
        elif config not in out:
            out.append(config)
    return out, dropped


def name_of(cell: dict) -> str:
    return f"{cell['mode']}-{cell['drafter']}-k{cell['k']}-dms{cell['device_ms']:g}"


def estimate(cells: list[dict], repeats: int) -> float:
    seconds, warmed = 0.0, set()
    for c in cells:
        if not c["tiers"]:
            continue
        runs = len(c["tiers"]) * repeats + ((c["mode"], c["drafter"], c["k"]) not in warmed)
        warmed.add((c["mode"], c["drafter"], c["k"]))
        seconds += CELL_OVERHEAD_S + runs * (RUN_SECONDS[c["mode"]] + c["device_ms"] / 1000.0 * 120)  # ~120 steps
    return seconds


def collect(out: str, tiers: list[str], keep_traces: bool) -> dict:
    """The cell's bench report: per tier the repeats' figures, failures, the first repeat's tokens (the cell's unpacked
    models and, unless ``keep_traces``, its device traces removed)."""
    path = os.path.join(out, "bench_engine_gpu.json")
    shutil.rmtree(os.path.join(out, "models"), ignore_errors=True)  # unpacked from the archive (tens of MiB)
    if not keep_traces:
        for root, _, files in os.walk(out):
            for f in files:
                if f.endswith("-trace.json.gz") or f.endswith("-trace.json"):
                    os.remove(os.path.join(root, f))
    if not os.path.isfile(path):
        return {"verdict": "NO REPORT", "failures": ["bench_engine_gpu.py wrote no report (see stderr.txt)"]}
    with open(path) as fh:
        bench = json.load(fh)
    return {
        "verdict": bench.get("verdict"),
        "failures": [f[:1500] for f in bench.get("failures", [])],
        "device": (bench.get("device") or {}).get("name"),
        "repeats": {t: bench.get("repeats", {}).get(t) for t in tiers},
        "tokens": bench.get("tokens", {}),
    }


def compare_tokens(report: dict) -> None:
    """Within each (mode, drafter, k): every tier at every device ms against the first run that finished there. Across
    modes (same drafter and k), informational: each mode's first run against the first mode's."""
    first: dict[tuple, tuple[str, dict]] = {}
    across: dict[tuple, tuple[str, str, dict]] = {}
    report["token_divergences"] = []
    report["token_notes"] = []
    for c in report["cells"]:
        c["token_divergences"] = []
        for tier, tokens in (c.get("tokens") or {}).items():
            if not tokens:
                continue
            label = f"{c['name']} {tier}"
            key = (c["mode"], c["drafter"], c["k"])
            if key not in first:
                first[key] = (label, tokens)
                mode0, label0, tokens0 = across.setdefault((c["drafter"], c["k"]), (c["mode"], label, tokens))
                if mode0 != c["mode"]:
                    found = diff(tokens0, tokens)
                    report["token_notes"].append(
                        f"{label} vs {label0} (another graph mode, informational): {len(found)} requests differ"
                        + (f" (first: {found[0]})" if found else "")
                    )
                continue
            c["token_divergences"] += [f"{label} vs {first[key][0]}: {d}" for d in diff(first[key][1], tokens)]
        report["token_divergences"] += c["token_divergences"]


def diff(a: dict, b: dict) -> list[str]:
    out = []
    for req in sorted(set(a) | set(b), key=lambda r: (len(r), r)):
        x, y = a.get(req), b.get(req)
        if x == y:
            continue
        if x is None or y is None:
            out.append(f"request {req} missing in one run")
            continue
        i = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        out.append(f"request {req}: first difference at output {i} ({len(x)} vs {len(y)} tokens)")
    return out


def write(out: str, report: dict) -> str:
    slim = {**report, "cells": [{k: v for k, v in c.items() if k != "tokens"} for c in report["cells"]]}
    with open(os.path.join(out, "bench_tiers.json"), "w") as fh:
        json.dump(slim, fh, indent=1, default=str)
    text = render(report)
    with open(os.path.join(out, "bench_tiers.md"), "w") as fh:
        fh.write(text + "\n")
    return text


def _spread(v: dict | None, digits: int = 2) -> str:
    if not v:
        return "-"
    return f"{v['median']:.{digits}f} [{v['min']:.{digits}f}..{v['max']:.{digits}f}]"


def render(report: dict) -> str:
    stack = report["stack"]
    cells = report["cells"]
    device = next((c.get("device") for c in cells if c.get("device")), "-")
    lines = [
        f"# Tier sweep: vllm-ascend {stack['release']}{' (native)' if stack['native'] else ''} "
        "(benchmarks/bench_tiers.py)",
        "",
        f"device: {device}; {report['repeats']} repeats per tier and cell, interleaved; each figure: median of the "
        "runs' figures [min..max]. TPOT: per request (last token - first token) / (tokens - 1), median over the "
        "requests; ITL: gap between a request's successive outputs, median; output tok / s over the generate call; "
        "device idle per pure decode step (torch.profiler, the profiled steps without a prompt chunk), median and "
        "p90 of each run; host ms / step: median step period.",
    ]
    for mode in MODES:
        rows = [c for c in cells if c["mode"] == mode]
        if not rows:
            continue
        lines += ["", f"## {mode}", ""]
        lines.append(
            "| drafter, k | device ms | tier | runs | TPOT ms | ITL ms | output tok / s | device idle us / decode "
            "step, median | device idle us / decode step, p90 | host ms / step | tokens vs the mode's first run |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for c in rows:
            head = f"| {c['drafter']}, {c['k']} | {c['device_ms']:g} |"
            if c.get("status") != "ran":
                lines.append(f"{head} {', '.join(c['tiers']) or '-'} | {c.get('status', 'pending')} |")
                continue
            for tier in c["tiers"]:
                a = (c.get("repeats") or {}).get(tier)
                divs = [d for d in c.get("token_divergences", []) if d.startswith(f"{c['name']} {tier} vs")]
                same = "-" if not (c.get("tokens") or {}).get(tier) else (f"{len(divs)} differ" if divs else "same")
                if not a:
                    lines.append(f"{head} {tier} | 0 | no finished run (rc {c.get('rc')}) |")
                    continue
                lines.append(
                    f"{head} {tier} | {a['repeats']} | {_spread(a.get('tpot_ms_median'))} | "
                    f"{_spread(a.get('itl_ms_median'))} | {_spread(a.get('output_tok_s'), 0)} | "
                    f"{_spread(a.get('idle_us_median_decode'), 0)} | {_spread(a.get('idle_us_p90_decode'), 0)} | "
                    f"{_spread(a.get('host_period_ms_median'))} | {same} |"
                )
    lines += [""]
    lines += [f"- note: {n}" for n in report.get("notes", [])]
    lines += [f"- tokens: {n}" for n in report.get("token_notes", [])]
    lines += [f"- TOKEN DIVERGENCE {d}" for d in report.get("token_divergences", [])]
    for c in cells:
        if c.get("status") == "ran":
            lines.append(f"- {c['name']}: {c['seconds']:.0f} s, rc {c['rc']}, bench verdict {c.get('verdict')}")
            lines += [f"  - FAIL {f[:600]}" for f in c.get("failures", [])]
    if "seconds" in report:
        lines.append(f"- sweep: {report['seconds']:.0f} s (estimated {report['estimate_s']} s)")
    return "\n".join(lines)


def _split(value: str) -> list[str]:
    return [v.strip() for v in str(value).split(",") if v.strip()]


def _release(stack: str) -> str:
    sys.path.insert(0, HERE)
    import gpu_stack

    return str(gpu_stack.read_manifest(stack)["release"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
