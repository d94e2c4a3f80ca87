"""Fix exact-counts-after-early-output (adapters ascend-0.13 / ascend-0.18): :func:`already_exact` on the release's
real NPUModelRunner (its InputBatch), CachedRequestState and SchedulerOutput, built for a step scheduled after the
engine core processed the previous step's output. Only a request the previous step scheduled with drafts, at a row of
the previous batch, whose count from the scheduler is below its count at that step's start plus the tokens that step
scheduled, is exact. The fix and zero-bubble on whole runs with outputs processed early:
tests/patches/test_runner_parity.py; in the engine: tests/engine/test_engine.py.
"""

from __future__ import annotations

import os
import sys

import pytest

from zb_patch.versions.fixes.exact_counts_after_early_output import already_exact

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
if npu_standin.detect_family() not in ("0.13", "0.18"):
    pytest.skip("the fix serves vllm-ascend 0.13 / 0.18 (the runner harness)", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parity"))


def _request(req_id, num_computed_tokens, drafts):
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    state = CachedRequestState(
        req_id=req_id,
        prompt_token_ids=list(range(1, 9)),
        mm_features=[],
        sampling_params=None,
        generator=None,
        block_ids=([0],),
        num_computed_tokens=num_computed_tokens,
        output_token_ids=[],
    )
    state.prev_num_draft_len = drafts
    return state


def test_only_rows_whose_count_already_lost_the_rejected_drafts(H, sess):
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    from zb_patch.check.selftest.compat import EngineShape

    shape = EngineShape(num_spec_tokens=2)
    vc = H.build_config(sess, shape)
    runner = H.make_runner(vc, H.kv_cache_config(vc, shape))
    # (runner's count at step N's start, drafts step N scheduled, previous row, tokens step N scheduled, count now);
    # step N scheduled 1 + 2 drafts, so the optimistic count is the start count + 3
    cases = {
        "no drafts": (20, 0, 0, 1, 20),  # below the start count + 1, yet nothing to correct
        "not in the previous batch": (20, 2, None, 3, 21),
        "not scheduled last step": (20, 2, 2, None, 21),
        "count not reduced": (20, 2, 3, 3, 23),  # optimistic: the release corrects it
        "rejected both drafts": (30, 2, 4, 3, 31),
        "rejected one draft": (40, 2, 5, 3, 42),
    }
    runner.requests.update({rid: _request(rid, start, drafts) for rid, (start, drafts, *_) in cases.items()})
    runner.input_batch.prev_req_id_to_index = {rid: c[2] for rid, c in cases.items() if c[2] is not None}
    prev_scheduled = {rid: c[3] for rid, c in cases.items() if c[3] is not None}
    so = SchedulerOutput.make_empty()
    so.scheduled_cached_reqs = CachedRequestData.make_empty()
    so.scheduled_cached_reqs.req_ids = list(cases)
    so.scheduled_cached_reqs.num_computed_tokens = [c[4] for c in cases.values()]

    assert already_exact(runner, so, prev_scheduled) == {4: 2, 5: 2}
