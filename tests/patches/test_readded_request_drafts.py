"""``readded-request-drafts`` (vLLM #31944's runner half, vLLM 0.13) on the release's real vLLM AsyncScheduler +
vllm-ascend NPUModelRunner (the runner-parity harness), with the workload of ``stale-draft-placeholders``'s test."""

from __future__ import annotations

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
HARNESS = {"0.13": "runner013", "0.18": "runner018"}
FAMILY = npu_standin.detect_family()
if FAMILY not in HARNESS:
    pytest.skip(
        f"the runner harness covers vllm-ascend {' / '.join(HARNESS)}; this env has {FAMILY}", allow_module_level=True
    )

from returning_rows import run, zero_bubble_ids  # noqa: E402


def test_readded_rows_get_their_scheduled_drafts_on_013(H, release, sess, monkeypatch):
    """vLLM 0.13 (patch ``readded-request-drafts``, vLLM #31944's runner half): a row re-added with scheduled drafts
    (a request skipped for a step, or preempted and resumed with the stale spec tokens vLLM 0.13's scheduler keeps)
    never gets them written: its draft input ids are what the row's slot held before (another request's tokens, or
    a ``-1``). With only that fix (zero-bubble and stale-draft-placeholders left out) they are the scheduled ids:
    under async scheduling the ``-1`` placeholders (which stale-draft-placeholders replaces), under synchronous
    scheduling the request's real drafts."""
    if FAMILY != "0.13":
        pytest.skip("vLLM 0.18 writes a re-added row's drafts itself (InputBatch.update_req_spec_token_ids, #31944)")
    bare, rec = run(H, release, sess, monkeypatch, patched=False)
    assert any(r["ids"] != r["scheduled"] for r in rec.returns), rec.returns  # junk from the slot's previous owner
    # draft-placeholders-after-metadata left out too: it clamps the forward's ids after the drafts are gathered
    disabled = (
        zero_bubble_ids(H, release)[0],
        "stale-draft-placeholders",
        "mtp-draft-slots",
        "draft-placeholders-after-metadata",
    )
    res, rec = run(H, release, sess, monkeypatch, patched=True, disabled=disabled)
    assert rec.returns and all(r["ids"] == r["scheduled"] for r in rec.returns), rec.returns
    readded = sum(r["readded"] for r in rec.returns)
    assert readded > 0 and res.runner.__dict__.get("_zb_patch_readded_drafts", 0) == readded, rec.returns
