"""Helpers for tests/e2e (a module of its own: `conftest` is not importable unambiguously)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

_TEXT_REPORTS: list[tuple[str, str]] = []


def base_env(**extra: str) -> dict:
    """This environment without any ZB_PATCH* variable, plus ``extra``; tests/e2e on PYTHONPATH (so the
    probe's front end can import a hook from here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZB_PATCH")}
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def artifacts_dir() -> Path:
    d = Path(os.environ.get("E2E_ARTIFACTS_DIR") or os.path.join(tempfile.gettempdir(), "zb-patch-e2e"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def save(name: str, report: dict, text: str) -> None:
    d = artifacts_dir()
    (d / f"{name}.json").write_text(json.dumps(report, indent=1, sort_keys=True, default=str))
    (d / f"{name}.txt").write_text(text)
    log = report.get("log")
    if log:
        (d / f"{name}.log").write_text("\n".join(log) + "\n")
    _TEXT_REPORTS.append((name, text))


def zb_patch_cli(*args: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run the installed `zb-patch` console script."""
    exe = os.path.join(sysconfig.get_path("scripts"), "zb-patch")
    cmd = [exe, *args] if os.path.exists(exe) else [sys.executable, "-m", "zb_patch.cli", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
