"""`zb-patch doctor --json | jq` on a host with vLLM installed: stdout is the JSON object and nothing else.

vLLM logs to stdout (its platform-plugin lines when it is imported, vllm-ascend's ``camem`` warning, ...);
the CLI sends all of it to stderr while the command runs. Run as a user runs it, with the NPU stand-in:
``python -m npu_standin zb_patch.cli doctor --json`` (the stand-in's launcher runs the CLI module as
``__main__``). ``zb-patch selftest --json`` is covered by tests/parity/test_selftest.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
if npu_standin.detect_family() is None:
    pytest.skip(
        "vllm-ascend is not installed in this env (lifecycle tests need a va0xx tox env)", allow_module_level=True
    )


def test_doctor_json_stdout_is_only_the_json_object():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZB_PATCH")}
    env["ZB_PATCH"] = "1"
    r = subprocess.run(
        [sys.executable, "-m", "npu_standin", "zb_patch.cli", "doctor", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    data = json.loads(r.stdout)  # the whole of stdout
    assert data["schema"] == "zb-patch-doctor/1"
    assert r.returncode == data["exit_code"], r.stderr[-3000:]
    assert data["verdict"] in ("apply", "native", "refused"), data["reason"]
    if data["adapters"]:  # doctor imported the upstream modules it verifies: vLLM's log lines went to stderr
        assert "import_errors" not in data, data["import_errors"]
        assert "Platform plugin ascend is activated" in r.stderr, r.stderr[-3000:]
    else:  # a refused release (0.11): decided from package metadata, vLLM never imported
        assert data["verdict"] == "refused" and "Platform plugin" not in r.stderr, r.stderr[-3000:]
