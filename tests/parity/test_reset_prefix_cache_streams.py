"""``reset_prefix_cache(reset_running_requests=True)`` under async scheduling + spec decode (k = 3), judged by the
tokens: the output streams with a reset every 40 steps must equal those of the same workload without resets
(``reset_streams.py``: vLLM's real ``AsyncScheduler``, the self-test's simulated runner and fake model, whose tokens are
a function of the whole sequence). A token lost or emitted twice around a reset changes a stream. And by the
scheduler's counters: an output that arrives for a request marked to discard it must leave the request's
``num_computed_tokens`` / ``num_output_placeholders`` alone (vLLM #46066).

As released (every vLLM the adapters run on, up to vLLM #49620, open):

* vLLM 0.13 - 0.21 flag every preempted request: streams differ with a step in flight at the reset and after a drain
  (a drained request loses its resumed life's first token; #42117 is in 0.22.0).
* vLLM 0.22 - 0.25 count the outputs to drop in the request's placeholders (``1 + drafts`` for its one step in flight)
  and drop one output per unit: streams differ with a step in flight (the resumed life's first outputs are dropped),
  none after a drain.
* up to vLLM 0.24 the stale output's rejected drafts are subtracted from the resumed request (#46066, in 0.25.0), and
  they still are with the ``reset_prefix_cache`` wrapper alone: the update wrappers are what removes it.

With the engine part ``reset-prefix-cache-in-flight`` (adapters ascend-0.13, ascend-0.18, ascend-0.19-0.25) every stream
is kept and no marked request is changed.

One subprocess per set of patches (the self-test harness installs its own vLLM platform)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from zb_patch import detect

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here")

HERE = os.path.dirname(os.path.abspath(__file__))


VLLM = detect.package("vllm").release[:2]
FLAGS_EVERY_PREEMPTED = VLLM < (0, 22)  # #42117 in 0.22.0
LOOP_SUBTRACTS_STALE = VLLM < (0, 25)  # #46066 in 0.25.0


def _run(*args: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env.pop("ZB_PATCH", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "reset_streams.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_reset_prefix_cache_as_released():
    res = _run()
    flight, drained = res["runs"]["in-flight"], res["runs"]["drained"]
    assert res["applied"] == [] and res["requests"] > 0 and flight["resets"] > 0 and drained["resets"] > 0, res
    assert flight["differ"], res  # a stream lost or repeated a token
    assert bool(drained["differ"]) == FLAGS_EVERY_PREEMPTED, res
    assert bool(flight["marked_changed"]) == LOOP_SUBTRACTS_STALE, res


def test_reset_wrapper_alone_leaves_the_stale_subtraction():
    res = _run("--reset-wrapper-only", "--resets", "in-flight")
    flight = res["runs"]["in-flight"]
    assert flight["resets"] > 0, res
    assert bool(flight["marked_changed"]) == LOOP_SUBTRACTS_STALE, res  # #46066 until the release skips it


def test_reset_prefix_cache_with_the_fix_keeps_every_stream():
    res = _run("--fix")
    expected = ["reset-prefix-cache-in-flight"]
    if LOOP_SUBTRACTS_STALE:
        expected.append("reset-prefix-cache-in-flight-update")
    assert res["applied"] == expected, res
    for kind, run in res["runs"].items():
        assert run["resets"] > 0 and run["differ"] == [] and run["marked_changed"] == 0, (kind, res)
