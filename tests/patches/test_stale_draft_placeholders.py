"""``stale-draft-placeholders`` (vLLM #37159) on the release's real vLLM AsyncScheduler + vllm-ascend NPUModelRunner
(the runner-parity harness), in the release family of this env (vllm-ascend 0.13 / 0.18). Its engine-level
reproduction (tokens and acceptance against synchronous scheduling):
tests/engine/test_defect_stale_draft_placeholders.py.

A request that holds ``-1`` draft placeholders and is not in the previous step's batch (the scheduler skipped it for a
step: vLLM's max_model_len clamp on an optimistic count; on vLLM 0.13 also a preempted and resumed request, #31944)
comes back with scheduled drafts the runner does not replace. Shown here: without the fix the model is handed ``-1``
ids (0.18) or the row's stale token ids (0.13, which does not write a re-added row's drafts; some are ``-1``); with the
fix, in classic async (zero-bubble disabled) and with zero-bubble, exactly the drafts the drafter proposed for that
request when it was last sampled.
"""

from __future__ import annotations

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
HARNESS = {"0.13": "runner013", "0.18": "runner018"}
FAMILY = npu_standin.detect_family()
if FAMILY not in HARNESS:
    pytest.skip(
        f"the runner harness covers vllm-ascend {' / '.join(HARNESS)}; this env has {FAMILY}", allow_module_level=True
    )

from returning_rows import K, run, zero_bubble_ids  # noqa: E402

FIX = "stale-draft-placeholders"


def test_stale_placeholders_reach_the_model_without_the_fix(H, release, sess, monkeypatch, capsys):
    """The release as it is: rows back with scheduled drafts get ids that are not the request's drafts."""
    res, rec = run(H, release, sess, monkeypatch, patched=False)
    wrong = [r for r in rec.returns if r["ids"] != r["expected"]]
    with capsys.disabled():
        print(
            f"\n{release.ADAPTER.id} bare release, k={K}: {len(rec.returns)} rows back with drafts, e.g. "
            f"{rec.returns[:3]}; {res.negative_input_ids} negative ids handed to the model"
        )
    assert rec.returns and len(wrong) == len(rec.returns)
    assert all(r["scheduled"] == [-1] * len(r["scheduled"]) for r in rec.returns)  # the scheduler's placeholders
    assert res.negative_input_ids > 0  # a -1 reaches the embedding (an IndexError with a real model)
    if FAMILY == "0.18":
        assert all(r["ids"] == r["scheduled"] for r in rec.returns)  # update_req_spec_token_ids wrote the -1s


@pytest.mark.parametrize("mode", ["fix-only", "fix+zero-bubble"])
def test_the_fix_feeds_the_drafts_proposed_for_the_request(H, release, sess, monkeypatch, mode):
    """With the fix (classic async with only the fixes, and with zero-bubble): every row back with scheduled drafts
    is handed the drafts the drafter proposed for that request when it was last sampled; no negative id."""
    disabled = zero_bubble_ids(H, release)[:1] if mode == "fix-only" else ()
    res, rec = run(H, release, sess, monkeypatch, patched=True, disabled=disabled)
    assert rec.returns, "the workload no longer brings a request back with placeholders"
    assert [r for r in rec.returns if r["ids"] != r["expected"]] == []
    assert all(None not in r["expected"] for r in rec.returns)
    assert res.negative_input_ids == 0
    st = res.runner.__dict__["_zb_patch_saved_drafts"]
    assert st.filled == len(rec.returns) and st.unknown == 0, (st.filled, st.unknown, len(rec.returns))
    zb = res.zb
    assert bool(zb.get("active")) == (mode == "fix+zero-bubble")


def test_disabling_the_fix_brings_the_defect_back(H, release, sess, monkeypatch):
    """ZB_PATCH_DISABLE=stale-draft-placeholders: zero-bubble alone reproduces the release's defect (on 0.13 its
    clamp turns the -1s into token 0: still not the request's drafts)."""
    res, rec = run(H, release, sess, monkeypatch, patched=True, disabled=(FIX,))
    assert rec.returns and all(r["ids"] != r["expected"] for r in rec.returns)
    assert res.zb.get("active")
    assert "_zb_patch_saved_drafts" not in res.runner.__dict__
