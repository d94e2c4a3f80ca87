"""vllm-ascend 0.13 / 0.18 EAGLE sample indices past the real batch, ``draft-sample-indices-past-batch`` (#9867 /
#10080, in 0.21.0rc1), through vLLM's real engine (tests/engine/defect_engine.py): recorded on the eager engine at each
draft-model call (the rows a padded FULL draft graph would sample; the out-of-bounds gather itself needs graphs: the
GPU machine's FULL_DECODE_ONLY runs). With the fix: 0 in every such row, as 0.23.0 gives natively."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm_ascend", reason="the engine tests need vllm-ascend (va013-e2e / va018-e2e envs)")

from defect_engine import RELEASE, applied, engine, show  # noqa: E402

from zb_patch.check.engine.run import run_all  # noqa: E402
from zb_patch.check.engine.workload import Workload, divergences  # noqa: E402

# prefill chunks of up to 64 tokens leave indices up to 63 in rows that preemption and finished requests then leave
# past the real batch (found by running it: 11 of 109 drafter calls on 0.18.0 hold an index past 4 * (1 + 2) = 12,
# every padded decode batch's tokens)
SAMPLE_INDICES = Workload(
    num_requests=12, max_prompt=120, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4, limit_every=0
)


@pytest.fixture(scope="module")
def sample_index_runs(defect_models, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sample-indices"))
    configs = [("sync", False, {})]
    if RELEASE != "0.23.0":  # 0.23.0 carries #9867 / #10080: nothing to fix
        configs += [("sync+fix", False, {"ZB_PATCH": "1"}), ("async+zb", True, {"ZB_PATCH": "1"})]
    jobs = [
        engine(defect_models, out, n, SAMPLE_INDICES, async_scheduling=a, env=e, record=("sample-indices",))
        for n, a, e in configs
    ]
    runs = run_all(jobs, parallel=2)
    show(runs)
    return {r.name: r for r in runs}


def test_without_the_fix_the_draft_graph_would_sample_past_its_batch(sample_index_runs):
    """The release's synchronous run: at the drafter's model calls, rows of the sample-index buffer past the real
    requests hold indices of earlier, larger batches, some past the tokens of every padded decode batch
    (``max_num_seqs * (1 + k)``): what a FULL draft graph, which samples the padded batch's rows, gathers out of bounds
    (docs/e2e.md, the big workload in FULL_DECODE_ONLY). vllm-ascend 0.23.0 carries #9867: zeros there."""
    run = sample_index_runs["sync"]
    assert run.result is not None, run.stderr[-3000:]
    seen = run.result["defects"]["sample-indices"]
    assert seen["after_wider"] > 0, seen  # calls whose rows past the batch an earlier, wider call wrote
    if RELEASE == "0.23.0":
        assert seen["stale_rows"] == 0, seen
    else:
        assert seen["past_every_batch"] > 0 and seen["largest"] >= seen["bound"], seen


@pytest.mark.skipif(RELEASE == "0.23.0", reason="0.23.0 carries #9867 / #10080 (the release's own run above)")
@pytest.mark.parametrize("name", ["sync+fix", "async+zb"])
def test_with_the_fix_rows_past_the_batch_sample_index_0(sample_index_runs, name):
    run = sample_index_runs[name]
    assert run.result is not None, run.stderr[-3000:]
    seen = run.result["defects"]["sample-indices"]
    assert seen["after_wider"] > 0 and seen["stale_rows"] == 0, seen
    assert "draft-sample-indices-past-batch" in applied(run.result)
    # eager: nothing reads the rows past the batch, so the fix changes no token (and in sync no count either)
    fields = ("tokens", "drafted", "accepted") if name == "sync+fix" else ("tokens",)
    assert divergences(sample_index_runs["sync"].result, run.result, fields) == []
