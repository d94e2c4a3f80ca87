"""``zb-patch selftest --engine --model`` with ``--data-parallel-size 2`` after ``--`` on a DeepSeek-V3-style MLA
target drafting with its own MTP layer at k = 3 (zb_patch.check.engine.model.write_deepseek_model: MoE enough for
vLLM's offline data parallelism), generated token-id prompts (``--skip-tokenizer-init``): each run is two engine
processes with vLLM's offline data-parallel environment, their results merged. E2E_BIG=1 only (six engine
processes on CPU); the tiny-model strict check left out (``--skip-tiny-check``: PASS-WITHOUT-STRICT-CHECK).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version

import pytest

pytest.importorskip("vllm_ascend", reason="the engine tests need vllm-ascend (va0XX-e2e envs)")
if version("vllm-ascend") != "0.18.0" or not os.environ.get("E2E_BIG"):
    pytest.skip("the --model self-test with data parallelism: vllm-ascend 0.18.0, E2E_BIG=1", allow_module_level=True)

from test_engine import emulated_child  # noqa: E402, F401 (a module-wide fixture: the tests' launcher)

from zb_patch.check.engine import model as tiny_model  # noqa: E402


def test_data_parallel_two_ranks_mtp(tmp_path):
    target = tiny_model.write_deepseek_model(str(tmp_path / "models"))
    report_dir = str(tmp_path / "report")
    cmd = [sys.executable, "-m", "zb_patch.cli", "selftest", "--engine", "--json", "--model", target]
    cmd += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 3})]
    cmd += ["--num-prompts", "6", "--max-tokens", "24", "--skip-tiny-check", "--report", report_dir, "--"]
    cmd += ["--data-parallel-size", "2", "--distributed-executor-backend", "uni", "--skip-tokenizer-init"]
    cmd += ["--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--enforce-eager"]
    cmd += ["--dtype", "bfloat16", "--seed", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    print("\n" + proc.stderr[-3000:])
    report = json.loads(proc.stdout)
    with open(os.path.join(report_dir, "report.md")) as f:
        print(f.read())
    assert (report["verdict"], proc.returncode) == ("PASS-WITHOUT-STRICT-CHECK", 0), report["failures"]
    assert report["data_parallel_size"] == 2 and report["tiny"]["verdict"] == "NOT-RUN"
    for name in ("async+fixes", "async+fixes-2", "async+zb"):
        for rank in (0, 1):
            assert os.path.exists(os.path.join(report_dir, "runs", f"{name}-dp{rank}.json"))
    zb = report["runs"]["async+zb"]["summary"]
    assert zb["tokens"] == 6 * 24 and zb["zero_bubble"]["active"] and zb["zero_bubble"]["corrected_steps"] > 0
    assert report["floor"]["exact"] and report["pairs"]["async+zb"]["exact"]
