"""``reset_prefix_cache(reset_running_requests=True)`` under async scheduling + spec decode (k = 3), judged by the
tokens: the output streams with a reset every 40 steps must equal those of the same workload without resets
(``reset_streams.py``: vLLM's real ``AsyncScheduler``, the self-test's simulated runner and fake model, whose tokens are
a function of the whole sequence). A token lost or emitted twice around a reset changes a stream.

* vLLM 0.13 / 0.18 (adapters ascend-0.13 / ascend-0.18): as released, streams differ, with a step in flight at the
  reset (vLLM #46066) and after a drain (#42117); with the engine part ``reset-prefix-cache-in-flight`` none do.
* vLLM 0.23 (adapter ascend-0.19-0.25, no fix carried): the drained reset keeps every stream (#42117 is in the
  release); with a step in flight streams differ: the release's discard counter is the request's output placeholders
  (``1 + drafts`` for its one step in flight, ``scheduler.py:1970``) and drops one output per unit
  (``async_scheduler.py:46-50``), so the first outputs of the resumed request are dropped too (with the counter set to
  the outputs in flight instead, every stream is kept; vLLM #49620 is open). Asserted as the release's defect, so
  that a release that fixes it fails this test.

One subprocess per run (the self-test harness installs its own vLLM platform)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here")

HERE = os.path.dirname(os.path.abspath(__file__))


def _family() -> str | None:
    try:
        import npu_standin
    except ImportError:
        return None
    return npu_standin.detect_family()


FAMILY = _family()
FIXED = FAMILY in ("0.13", "0.18")


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


@pytest.mark.skipif(FAMILY not in ("0.13", "0.18", "0.23"), reason="vllm-ascend 0.13 / 0.18 / 0.23 envs")
@pytest.mark.parametrize("reset", ["in-flight", "drained"])
def test_reset_prefix_cache_as_released(reset):
    res = _run(*(["--drained"] if reset == "drained" else []))
    assert res["applied"] == [] and res["resets"] > 0 and res["requests"] > 0
    if FIXED or reset == "in-flight":
        assert res["differ"], res  # the release's defect: some stream lost or repeated a token
    else:
        assert res["differ"] == [], res  # vLLM 0.23 with nothing in flight: #42117


@pytest.mark.skipif(not FIXED, reason="the fix is carried by adapters ascend-0.13 / ascend-0.18")
@pytest.mark.parametrize("reset", ["in-flight", "drained"])
def test_reset_prefix_cache_with_the_fix_keeps_every_stream(reset):
    res = _run("--fix", *(["--drained"] if reset == "drained" else []))
    assert res["applied"] == ["reset-prefix-cache-in-flight", "reset-prefix-cache-in-flight-update"], res
    assert res["resets"] > 0 and res["differ"] == [], res
