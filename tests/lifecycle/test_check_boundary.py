"""The diagnostics boundary in real processes of this tox env (real vLLM + vllm-ascend, NPU stand-in):

* activation (``register()`` with ``ZB_PATCH=1`` after the worker's runner modules are imported) leaves
  no ``zb_patch.check`` module behind;
* ``zb-patch doctor`` without ``--probe`` imports neither the diagnostics nor torch (``--no-import``: only
  zb-patch's own code runs; without it, the upstream modules it verifies import torch themselves).

tests/unit/test_check_boundary.py checks the same on the import graph of the source.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
if npu_standin.detect_family() is None:
    pytest.skip(
        "vllm-ascend is not installed in this env (lifecycle tests need a va0xx tox env)", allow_module_level=True
    )

ACTIVATE = """
import sys
import npu_standin
npu_standin.install()
from npu_standin.ascend_imports import import_worker_modules
import_worker_modules()
from zb_patch import plugin
plugin.register()
print("STATE", plugin.status()["state"])
print("MODULES", sorted(m for m in sys.modules if m.startswith("zb_patch")))
"""

DOCTOR = """
import sys
from zb_patch import cli
code = cli.main(["doctor", "--no-import"])
print("MODULES", sorted(m for m in sys.modules
                        if m.partition(".")[0] in ("torch", "vllm", "vllm_ascend") or m.startswith("zb_patch")),
      file=sys.stderr)
sys.exit(code)
"""


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZB_PATCH")}
    env.update(extra)
    return env


def _modules(text: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith("MODULES "))
    return eval(line.split(" ", 1)[1])  # noqa: S307 - our own printed list literal


def test_activation_after_the_runner_modules_imports_no_diagnostics():
    r = subprocess.run(
        [sys.executable, "-c", ACTIVATE], env=_env(ZB_PATCH="1"), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    state = next(line for line in r.stdout.splitlines() if line.startswith("STATE ")).split()[1]
    assert state in ("applied", "native", "refused"), r.stdout  # activation ran to a decision
    modules = _modules(r.stdout)
    assert "zb_patch.plugin" in modules and "zb_patch.registry" in modules
    assert [m for m in modules if m == "zb_patch.check" or m.startswith("zb_patch.check.")] == []


def test_doctor_without_probe_imports_no_diagnostics_and_no_torch():
    r = subprocess.run([sys.executable, "-c", DOCTOR], env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Verdict:" in r.stdout
    modules = _modules(r.stderr)
    assert "zb_patch.versions" in modules
    assert [m for m in modules if m.startswith(("zb_patch.check", "torch", "vllm"))] == [], modules
