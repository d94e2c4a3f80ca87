"""What the engine-level reproductions of the release's own defects share (tests/engine/test_defect_<fix>.py): one
engine process per configuration through tests/engine/run_defect_engine.py (tests/engine/run_engine.py's launcher plus
recorders of the defects), on the installed vllm-ascend platform (CPU emulation of the NPU ops, tests/support).

Each defect: the release as it is shows it; ``ZB_PATCH=1`` (with zero-bubble, and where the defect is not
zero-bubble's business also with zero-bubble left out: ``ZB_PATCH_DISABLE=<a zero-bubble patch>`` disables its group,
"async with only the fixes", or in synchronous scheduling) fixes it; ``ZB_PATCH_DISABLE=<the fix>`` brings it back.
A test module imports this after ``pytest.importorskip("vllm_ascend")``; it skips releases other than 0.13.0 / 0.18.0
/ 0.23.0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import version

import pytest

from zb_patch.check.engine.workload import divergences, summarize, table

RELEASE = version("vllm-ascend")
if RELEASE not in ("0.13.0", "0.18.0", "0.23.0"):
    pytest.skip(
        f"release defects are reproduced on vllm-ascend 0.13.0 / 0.18.0 / 0.23.0; this env has {RELEASE}",
        allow_module_level=True,
    )
# the patch ZB_PATCH_DISABLE names to leave the release's classic async path with only the fixes: zero-bubble's group
# on 0.13 / 0.18; on 0.23 (zero-bubble is the release's own) the slot-mapping kernel, the one other patch there
NOT_A_FIX = {
    "0.13.0": "zb013-optimistic-update-states",
    "0.18.0": "zb018-optimistic-update-states",
    "0.23.0": "slot-mapping-kernel",
}[RELEASE]
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_defect_engine.py")
# the engine runs with everything of zb-patch on but the fix (``-without-fix``): E2E_BIG=1 only. CI shows each defect
# on the release as it is, and the fix's test in tests/patches shows on the runner that disabling it brings its defect
# back.
WITHOUT_FIX = bool(os.environ.get("E2E_BIG"))


@dataclass
class Engine:
    name: str
    returncode: int
    result: dict | None
    stderr: str


def engine(models, out_dir, name, wl, *, async_scheduling, env, drafter="eagle", record=()):
    """One engine process (a job for run_all)."""

    def job():
        out = os.path.join(out_dir, f"{name}.json")
        cmd = [sys.executable, LAUNCHER, "--record", ",".join(record), "--models", models, "--out", out]
        cmd += ["--workload", json.dumps(wl.to_json()), "--drafter", drafter]
        if async_scheduling:
            cmd.append("--async")
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("ZB_PATCH")}
        full_env.update(env)
        proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=3600)
        result = None
        if proc.returncode == 0:
            with open(out) as f:
                result = json.load(f)
        return Engine(name, proc.returncode, result, proc.stderr)

    return job


def applied(result):
    status = result["zb_patch_status"]
    return {i["id"] for i in status.get("report", {}).get("items", []) if i["verdict"] == "applied"}


def show(runs):
    done = {r.name: r.result for r in runs if r.result is not None}
    ref = next(iter(done.values()))
    print(
        "\n" + table([summarize(n, r) for n, r in done.items()], {n: len(divergences(ref, r)) for n, r in done.items()})
    )
    for r in runs:
        if r.result is None:
            print(f"{r.name}: exit {r.returncode}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}")
