"""vLLM #37159, ``stale-draft-placeholders`` (vllm-ascend 0.13 / 0.18 / 0.23), through vLLM's real engine
(tests/engine/defect_engine.py): requests that run into max_model_len skip a step with their ``-1`` draft placeholders
(vLLM's max_model_len clamp on an optimistic count) and come back with draft input ids that are not their drafts: on
0.18 the ``-1`` reaches the target's embedding (``IndexError``); on 0.23 the same ``-1`` (its embedding masks it: a
rejected draft), on 0.13 the row's stale ids are verified. With the fix: every such row gets the drafts proposed for
its request, the tokens are synchronous scheduling's, zb-patch equals the release's async with only the fix in every
field. The runner-level test: tests/patches/test_stale_draft_placeholders.py."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm_ascend", reason="the engine tests need vllm-ascend (va013-e2e / va018-e2e envs)")

from defect_engine import NOT_A_FIX, RELEASE, WITHOUT_FIX, applied, engine, show  # noqa: E402

from zb_patch.check.engine import model as tiny_model  # noqa: E402
from zb_patch.check.engine.run import run_all  # noqa: E402
from zb_patch.check.engine.workload import Workload, divergences  # noqa: E402

EMBEDDING_ERROR = "IndexError: index out of range in self"
# every request runs into max_model_len (64) at k = 4; the max_model_len clamp on the optimistic count leaves a request
# 0 tokens for a step, and it comes back with its placeholders (found by running it: classic async stops in the
# target's embedding on 0.13 and 0.18)
STALE = Workload(
    num_requests=6,
    max_prompt=20,
    num_speculative_tokens=4,
    max_model_len=64,
    limit_every=1,
    num_gpu_blocks=3,
    max_num_seqs=6,
)


@pytest.fixture(scope="module")
def stale_runs(defect_models, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("stale"))
    on = {"ZB_PATCH": "1"}
    configs = [
        ("sync", False, {}),
        ("async", True, {}),
        ("async+fixes", True, {**on, "ZB_PATCH_DISABLE": NOT_A_FIX}),
        ("async+zb", True, on),
    ]
    if WITHOUT_FIX:
        configs.append(("async+zb-without-fix", True, {**on, "ZB_PATCH_DISABLE": "stale-draft-placeholders"}))
    record = ("saved-drafts", "returning-rows")
    jobs = [engine(defect_models, out, n, STALE, async_scheduling=a, env=e, record=record) for n, a, e in configs]
    runs = run_all(jobs, parallel=2)
    show(runs)
    return {r.name: r for r in runs}


@pytest.mark.parametrize("name", ["async", "async+zb-without-fix"] if WITHOUT_FIX else ["async"])
def test_without_the_fix_returning_rows_get_wrong_drafts(stale_runs, name):
    """The release's classic async (on 0.23: its own zero-bubble), and zb-patch without the fix: a row back with
    scheduled drafts is not handed its request's drafts. vllm-ascend 0.18 (vLLM 0.18 writes the -1 placeholders into
    the re-added row): the -1 indexes the target's embedding out of range and the run stops. vllm-ascend 0.23: the
    same -1, which vLLM 0.23's embedding masks to a zero vector on this path (no crash; a draft that is rejected).
    vllm-ascend 0.13 (vLLM 0.13 writes nothing there): whatever the row's slot held before (zero-bubble's clamp turns
    a -1 into 0)."""
    run = stale_runs[name]
    if RELEASE == "0.18.0":
        assert run.returncode != 0 and EMBEDDING_ERROR in run.stderr, run.stderr[-3000:]
        assert "embed_input_ids" in run.stderr  # the target model's embedding (vllm/model_executor/models/llama.py)
        return
    assert run.result is not None, run.stderr[-3000:]
    rows = run.result["defects"]["returning-rows"]["rows"]
    assert rows and all(r["ids"] != r["proposed"] for r in rows), rows
    if RELEASE == "0.23.0":
        assert all(r["ids"] == r["scheduled"] == [-1] * len(r["ids"]) for r in rows), rows


@pytest.mark.parametrize("name", ["async+fixes", "async+zb"])
def test_with_the_fix_returning_rows_get_the_request_s_drafts(stale_runs, name):
    """Every row back with scheduled drafts is handed the drafts proposed for that request when it was last
    sampled (what it would have been verified with without the skip)."""
    run = stale_runs[name]
    assert run.result is not None, run.stderr[-3000:]
    rows = run.result["defects"]["returning-rows"]["rows"]
    assert rows and all(r["ids"] == r["proposed"] and None not in r["proposed"] for r in rows), rows
    counters = run.result["defects"]["saved-drafts"]
    assert counters["filled"] == len(rows) and counters["unknown"] == 0, counters


def test_with_the_fix_tokens_are_sync_s(stale_runs):
    runs = {n: stale_runs[n].result for n in ("sync", "async+fixes", "async+zb")}
    for name, result in runs.items():
        assert result is not None, (name, stale_runs[name].stderr[-3000:])
    assert runs["async+fixes"]["tokens"] == runs["sync"]["tokens"]
    assert runs["async+zb"]["tokens"] == runs["sync"]["tokens"]
    reqs = STALE.requests(tiny_model.VOCAB)
    assert all(len(runs["sync"]["tokens"][str(i)]) == n for i, (_, n) in enumerate(reqs))


def test_zero_bubble_equals_classic_async_with_the_fix(stale_runs):
    fixes, zb = stale_runs["async+fixes"].result, stale_runs["async+zb"].result
    assert divergences(fixes, zb) == []
    assert "stale-draft-placeholders" in applied(fixes) and NOT_A_FIX not in applied(fixes)
    assert {"stale-draft-placeholders", NOT_A_FIX} <= applied(zb)


def test_acceptance_with_the_fix_is_sync_s_up_to_the_max_model_len_clamp(stale_runs):
    """Every request of this workload ends at max_model_len, where vLLM's sync and async schedulers verify different
    numbers of drafts (docs/e2e.md, "The max_model_len clamp"); the acceptance rate stays sync's within 2 points (the
    drafts fed are the request's own: tests/patches/test_stale_draft_placeholders.py checks them one by one on the
    runner)."""
    sync, fixes = stale_runs["sync"].result, stale_runs["async+fixes"].result

    def rate(r):
        return sum(r["accepted"].values()) / sum(r["drafted"].values())

    assert abs(rate(sync) - rate(fixes)) < 0.02, (rate(sync), rate(fixes))
