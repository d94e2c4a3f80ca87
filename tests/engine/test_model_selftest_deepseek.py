"""``zb-patch selftest --engine --model`` on a DeepSeek-V3-style target saved by transformers
(operator_model.write_deepseek_mtp: ``DeepseekV3ForCausalLM`` with random weights, MLA, a dense MLP, the word-level
tokenizer; its MTP layer added to the checkpoint at ``model.layers.{num_hidden_layers}``, where vLLM's DeepSeek MTP
reads it), drafting with that MTP layer (``method: mtp``, k = 2), text prompts through the checkpoint's tokenizer,
eager. E2E_BIG=1 only (about a minute on two cores, which CI time has no room for); the tiny-model strict check left
out (``--skip-tiny-check``: PASS-WITHOUT-STRICT-CHECK; the MLA + MTP strict check is test_engine_mla.py's).
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
    pytest.skip("the --model self-test, DeepSeek-V3 checkpoint: vllm-ascend 0.18.0, E2E_BIG=1", allow_module_level=True)

import operator_model  # noqa: E402
from test_engine import emulated_child  # noqa: E402, F401 (a module-wide fixture: the tests' launcher)

K = 2
MAX_TOKENS = 16
PROMPTS = [
    "w5 w9 w17 w33 w65 w100 w3 w44",
    " ".join(f"w{3 + (7 * i) % 120}" for i in range(40)),  # prefilled in two chunks (32 tokens a step)
    "w120 w121 w122",
]
ENGINE_ARGS = [
    "--max-model-len", "256",
    "--max-num-seqs", "4",
    "--max-num-batched-tokens", "32",
    "--enforce-eager",
    "--dtype", "bfloat16",
    "--seed", "0",
    "--num-gpu-blocks-override", "16",  # the emulated cache writes scan the whole cache (test_model_selftest.py)
]  # fmt: skip


def test_deepseek_v3_checkpoint_drafting_with_its_mtp_layer(tmp_path):
    target = operator_model.write_deepseek_mtp(str(tmp_path / "models"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    report_dir = str(tmp_path / "report")
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": K})
    cmd = [sys.executable, "-m", "zb_patch.cli", "selftest", "--engine", "--json", "--model", target]
    cmd += ["--speculative-config", spec, "--prompts", str(prompts), "--max-tokens", str(MAX_TOKENS)]
    cmd += ["--skip-tiny-check", "--report", report_dir, "--", *ENGINE_ARGS]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    print("\n" + proc.stderr[-3000:])
    report = json.loads(proc.stdout)
    with open(os.path.join(report_dir, "report.md")) as f:
        print(f.read())
    assert (report["verdict"], proc.returncode) == ("PASS-WITHOUT-STRICT-CHECK", 0), report["failures"]
    assert report["floor"]["exact"] and report["pairs"]["async+zb"]["exact"]
    zb = report["runs"]["async+zb"]["summary"]
    assert zb["tokens"] == len(PROMPTS) * MAX_TOKENS
    assert zb["zero_bubble"]["active"] and zb["zero_bubble"]["corrected_steps"] > 0
    assert 0 < zb["accepted"] < zb["drafted"]  # the MTP layer's weights were read: its drafts are partly right
    with open(os.path.join(report_dir, "runs", "async+zb.json")) as f:
        res = json.load(f)
    assert {w["draft_model"] for w in res["workers"]} == {"AscendDeepSeekMTP"}  # vllm-ascend's DeepSeekMTP
    assert res["prompt_tokens"] == {"0": 8, "1": 40, "2": 3}
