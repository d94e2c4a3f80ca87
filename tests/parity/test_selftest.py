"""The engine-loop parity harness (``zb-patch selftest``) against the installed vLLM's real scheduler.

One subprocess (a fresh interpreter, as ``zb-patch selftest`` always runs: the harness installs its
own vLLM platform and must not inherit the NPU stand-in or a platform another test resolved) runs:

* a clean self-test over k = 1..4 with the plain-scheduler oracle: no divergence, and the sync
  counts the design promises (classic: one blocking accepted-count sync before input prep per step;
  zero-bubble: none before input prep; Ascend: one before attention metadata instead);
* a short run with the device ops on the Triton kernels (Triton's CPU interpreter), where Triton is
  installed;
* ``zb-patch selftest --steps 40 --json --quiet`` through the real CLI entry point, in a process of its
  own: its whole stdout must be the JSON report (vLLM's log lines go to stderr);
* every planted bug (``zb_patch.check.selftest.runner.PLANTS``) alone: each must make the harness report
  divergences.  These are the harness's expected failures, asserted as passing tests;
* the upstream form of the device correction (``--correction previous``).

Skipped where vLLM is not installed (the ``unit`` / ``kernels`` envs).  Cost: one vLLM import plus
~1 minute of CPU on the CI box.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here")

PLANT_RUNS = {  # plant -> (steps, k): the smallest runs that hit the bug in vLLM 0.18 and 0.23 (seed 0)
    "backup-from-seq-lens": (200, 2),
    "no-input-prep-wait": (200, 2),
    "accepted-counts-by-row": (200, 2),
    "uncorrected-cpu-seq-lens": (200, 2),
    "backup-staging-reuse": (200, 4),  # rare by nature: a discarded row whose backup changes between steps
    "deferred-without-wait": (200, 2),
    "live-cpu-values": (200, 2),
}

_SUITE = r"""
import importlib.util, json, sys
from zb_patch.check.selftest import run_many

plants = json.loads(sys.argv[1])
runs = [dict(steps=400, seed=0, ks=(1, 2, 3, 4), plain=True)]
runs += [dict(steps=s, seed=0, ks=(k,), plain=False, plants=(p,)) for p, (s, k) in plants.items()]
runs += [dict(steps=400, seed=2, ks=(1, 2, 3, 4), plain=False, correction="previous")]
reports = [r.as_dict() for r in run_many(runs)]
triton = None
if importlib.util.find_spec("triton") is not None:  # the device ops through the Triton kernels (interpreter)
    triton = run_many([dict(steps=160, seed=5, ks=(1, 2, 3, 4), plain=False)], triton=True)[0].as_dict()
print(json.dumps({"reports": reports, "triton": triton}))
"""


def _env() -> dict:
    env = dict(os.environ)
    env.pop("ZB_PATCH", None)  # the harness must not depend on the plugin being active
    env["TRITON_INTERPRET"] = "1"  # decided when Triton is imported; the reference runs switch it off
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


@pytest.fixture(scope="module")
def suite():
    proc = subprocess.run(
        [sys.executable, "-c", _SUITE, json.dumps(PLANT_RUNS)], capture_output=True, text=True, env=_env(), timeout=1200
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    return data


def test_plants_cover_every_planted_bug():
    from zb_patch.check.selftest.runner import PLANTS

    assert set(PLANT_RUNS) == set(PLANTS)


def test_clean_run_has_no_divergence(suite):
    rep = suite["reports"][0]
    assert rep["ok"], json.dumps(rep["examples"], indent=1)[:3000]
    assert rep["divergences"] == 0
    assert set(rep["modes"]) == {"sync", "zero-bubble", "zero-bubble-ascend", "plain"}
    ref = rep["modes"]["sync"]
    for mode in ("zero-bubble", "zero-bubble-ascend"):
        m = rep["modes"][mode]
        for key in ("steps", "tokens", "drafted", "accepted", "finished", "aborted", "preemptions"):
            assert m[key] == ref[key], (mode, key)
    assert rep["modes"]["plain"]["tokens"] == ref["tokens"]


def test_clean_run_exercises_the_hard_cases(suite):
    ref = suite["reports"][0]["modes"]["sync"]
    cov = ref["coverage"]
    assert ref["preemptions"] > 0 and cov["resumed"] > 0
    assert cov["partial_prefill_rows"] > 0  # chunked prefill
    assert cov["condense_moves"] > 0 and cov["row_swaps"] > 0
    assert cov.get("max_model_len_reached", 0) > 0
    assert ref["aborted"] > 0 and ref["finish_reasons"].get("stop", 0) > 0
    assert 0 < ref["accepted"] < ref["drafted"]  # partial acceptance (all / none / partial per position)


def test_sync_counts_per_step(suite):
    modes = suite["reports"][0]["modes"]
    sync = modes["sync"]["blocking_accepted_count_syncs_per_step"]
    zb = modes["zero-bubble"]["blocking_accepted_count_syncs_per_step"]
    asc = modes["zero-bubble-ascend"]["blocking_accepted_count_syncs_per_step"]
    assert sync["before_input_prep"] >= 0.95
    assert zb["before_input_prep"] == 0 and zb["before_attention_metadata"] == 0
    assert asc["before_input_prep"] == 0 and asc["before_attention_metadata"] > 0.9
    assert modes["zero-bubble"]["accepted_count_syncs_per_step"]["deferred_after_launch"] > 0.9


def test_cli_selftest_json():
    proc = subprocess.run(
        [sys.executable, "-m", "zb_patch.cli", "selftest", "--steps", "40", "--seed", "3", "--json", "--quiet"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rep = json.loads(proc.stdout)  # the whole of stdout
    assert rep["schema"] == "zb-patch-selftest/1"
    assert rep["ok"] is True and rep["divergences"] == 0
    assert rep["num_spec_tokens"] == [1, 2, 3, 4]
    assert rep["modes"]["sync"]["steps"] > 0


@pytest.mark.parametrize("plant", sorted(PLANT_RUNS))
def test_planted_bug_makes_the_harness_fail(suite, plant):
    """Expected failure of the harness, asserted: the planted bug must be reported as divergences."""
    rep = next(r for r in suite["reports"][1:-1] if r["planted_bugs"] == [plant])
    assert not rep["ok"]
    assert rep["divergences"] > 0
    assert rep["modes"]["sync"]["crashed"] == []  # the reference itself never runs planted code


def test_triton_kernels_in_the_loop(suite):
    rep = suite["triton"]
    if rep is None:
        pytest.skip("Triton is not installed here")
    assert rep["ok"], json.dumps(rep["examples"], indent=1)[:3000]
    assert rep["modes"]["zero-bubble"]["steps"] > 100


def test_upstream_correction_formula(suite):
    """vLLM 0.19's device correction (last step's device counts + valid counts) is right under the
    vLLM >= 0.18 schedulers, and short by the catch-up tokens under vLLM 0.13's async scheduler."""
    from importlib.metadata import version

    from packaging.version import Version

    rep = suite["reports"][-1]
    assert rep["device_correction"] == "previous"
    if Version(version("vllm")).release[:2] >= (0, 18):
        assert rep["ok"], json.dumps(rep["examples"], indent=1)[:3000]
    else:
        assert not rep["ok"]


# `zb-patch selftest` (the CLI command, in a fresh process) with every zero_bubble entry point the product's runner
# wrappers use counted: names looked up at call time on the package and on the module defining them (a function of
# zero_bubble calling another), the class's calls through its __call__.
_PRODUCT_CODE = r"""
import json, sys
from zb_patch import cli
from zb_patch import zero_bubble as zb
from zb_patch.zero_bubble import batch, counts, device

names, out = json.loads(sys.argv[1]), sys.argv[2]
called = set()

def counted(name, fn):
    def wrapper(*args, **kwargs):
        called.add(name)
        return fn(*args, **kwargs)
    return wrapper

for name in names:
    obj = getattr(zb, name)
    if isinstance(obj, type):
        obj.__call__ = counted(name, obj.__call__)
        continue
    wrapped = counted(name, obj)
    for module in (zb, batch, counts, device):
        if getattr(module, name, None) is obj:
            setattr(module, name, wrapped)
code = cli.main(["selftest", "--steps", "60", "--seed", "3", "--quiet"])
with open(out, "w") as fh:
    json.dump({"code": code, "called": sorted(called)}, fh)
"""


def _product_zero_bubble_names() -> set[str]:
    """Every ``zero_bubble.<name>`` the product's zero-bubble code (the runner wrappers of vllm-ascend 0.13 / 0.18 and
    their release hooks) uses, read from the source."""
    import ast

    import zb_patch.versions as V

    names = set()
    root = os.path.dirname(V.__file__)
    for module in ("npu_runner.py", "ascend_0_13.py", "ascend_0_18.py"):
        with open(os.path.join(root, module), encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "zero_bubble":
                names.add(node.attr)
    return names


def test_selftest_runs_the_product_zero_bubble_code(tmp_path):
    """`zb-patch selftest` runs the zero-bubble arithmetic vLLM runs: every zero_bubble entry point the product's
    runner wrappers call (optimistic counts, batch-change map, device correction and slot mapping, exact CPU
    seq_lens, the deferred correction's rejected drafts) is called by the self-test -- one copy, no inline twin on
    either side."""
    names = _product_zero_bubble_names()
    assert names >= {
        "optimistic_advance",
        "compute_prev_positions",
        "CountCorrection",
        "slot_mapper",
        "correct_seq_lens_cpu",
        "rejected_tokens",
    }, names
    out = tmp_path / "called.json"
    proc = subprocess.run(
        [sys.executable, "-c", _PRODUCT_CODE, json.dumps(sorted(names)), str(out)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["code"] == 0
    assert set(result["called"]) == names
