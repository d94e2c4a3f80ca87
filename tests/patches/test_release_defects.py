"""The release's own async + speculative-decoding defects that zb-patch fixes, reproduced on the release's real
vLLM AsyncScheduler + vllm-ascend NPUModelRunner (the runner-parity harness: tests/parity/runner_harness.py), in the
release family of this env (vllm-ascend 0.13 / 0.18). The engine-level reproductions (tokens and acceptance against
synchronous scheduling, the MTP defects) are in tests/engine/test_release_defects.py.

vLLM #37159, stale ``-1`` draft placeholders (patch ``stale-draft-placeholders``): a request that holds placeholders
and is not in the previous step's batch (the scheduler skipped it for a step: vLLM's max_model_len clamp on an
optimistic count; on vLLM 0.13 also a preempted and resumed request, #31944) comes back with scheduled drafts the
runner does not replace. Shown here: without the fix the model is handed ``-1`` ids (0.18) or the row's stale token
ids (0.13, which does not write a re-added row's drafts; some are ``-1``); with the fix, in classic async (zero-bubble
disabled) and with zero-bubble, exactly the drafts the drafter proposed for that request when it was last sampled.
"""

from __future__ import annotations

import os
import sys

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
HARNESS = {"0.13": "runner013", "0.18": "runner018"}
FAMILY = npu_standin.detect_family()
if FAMILY not in HARNESS:
    pytest.skip(
        f"the runner harness covers vllm-ascend {' / '.join(HARNESS)}; this env has {FAMILY}", allow_module_level=True
    )

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parity"))

FIX = "stale-draft-placeholders"
# k = 4, seed 4: requests at max_model_len skip a step with placeholders (both releases), and preempted requests
# resume with stale placeholders (0.13); found by running the workload, ~40 s per run on 2 cores
K, SEED, ITERATIONS = 4, 4, 1100


class Recorder:
    """Per step: the drafts proposed for each request sampled in that step (what the scheduler's placeholders stand
    for), and every row handed to the model with scheduled drafts while not in the previous step's batch."""

    def __init__(self, release):
        self.proposed: dict[str, list[int]] = {}  # req_id -> drafts proposed when it was last sampled
        self.returns: list[dict] = []  # rows back with scheduled drafts
        self.release = release

    def install(self, monkeypatch):
        driver_cls = self.release.Driver
        prepare_step, sample_tokens = driver_cls.prepare_step, driver_cls.sample_tokens
        rec = self

        def prepare(driver, runner, so):
            in_batch = set(runner.input_batch.req_id_to_index)  # the persistent batch before this step's update
            inputs = prepare_step(driver, runner, so)
            if inputs is None:
                return inputs
            prev = runner.input_batch.prev_req_id_to_index or {}
            spec = so.scheduled_spec_decode_tokens
            for r, rid in enumerate(runner.input_batch.req_ids):
                d = len(spec.get(rid, ()))
                if d and rid not in prev:
                    end = int(inputs.query_start_loc[r + 1])
                    rec.returns.append(
                        dict(
                            step=driver.step,
                            req=rid,
                            scheduled=list(spec[rid]),
                            ids=inputs.input_ids[end - d : end].tolist(),
                            expected=rec.proposed.get(rid, [None] * d)[:d],
                            readded=rid not in in_batch,  # else the row stayed and the release wrote its drafts
                        )
                    )
            return inputs

        def sample(driver, so):
            out = sample_tokens(driver, so)
            runner = driver.runner
            drafts = runner._draft_token_ids
            for rid, row in (runner.input_batch.prev_req_id_to_index or {}).items():  # sampled rows only
                rec.proposed[rid] = [int(x) for x in drafts[row].tolist()]
            return out

        monkeypatch.setattr(driver_cls, "prepare_step", prepare)
        monkeypatch.setattr(driver_cls, "sample_tokens", sample)


def _run(H, release, sess, monkeypatch, *, patched, disabled=()):
    from zb_patch.check.selftest.compat import EngineShape
    from zb_patch.check.selftest.workload import make_workload

    rec = Recorder(release)
    rec.install(monkeypatch)
    shape = EngineShape(num_spec_tokens=K)
    specs = make_workload(SEED, shape, ITERATIONS)
    with H.reference_kernels():
        res = H.run_mode(sess, shape, specs, ITERATIONS, release=release, seed=SEED, patched=patched, disabled=disabled)
    monkeypatch.undo()
    return res, rec


def _zb_ids(H, release):
    return H.zero_bubble_and_fix_ids(release.ADAPTER)[0]


def test_stale_placeholders_reach_the_model_without_the_fix(H, release, sess, monkeypatch, capsys):
    """The release as it is: rows back with scheduled drafts get ids that are not the request's drafts."""
    res, rec = _run(H, release, sess, monkeypatch, patched=False)
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
    disabled = _zb_ids(H, release)[:1] if mode == "fix-only" else ()
    res, rec = _run(H, release, sess, monkeypatch, patched=True, disabled=disabled)
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
    res, rec = _run(H, release, sess, monkeypatch, patched=True, disabled=(FIX,))
    assert rec.returns and all(r["ids"] != r["expected"] for r in rec.returns)
    assert res.zb.get("active")
    assert "_zb_patch_saved_drafts" not in res.runner.__dict__


def test_readded_rows_get_their_scheduled_drafts_on_013(H, release, sess, monkeypatch):
    """vLLM 0.13 (patch ``readded-request-drafts``, vLLM #31944's runner half): a row re-added with scheduled drafts
    (a request skipped for a step, or preempted and resumed with the stale spec tokens vLLM 0.13's scheduler keeps)
    never gets them written: its draft input ids are what the row's slot held before (another request's tokens, or
    a ``-1``). With only that fix (zero-bubble and stale-draft-placeholders left out) they are the scheduled ids:
    under async scheduling the ``-1`` placeholders (which stale-draft-placeholders replaces), under synchronous
    scheduling the request's real drafts."""
    if FAMILY != "0.13":
        pytest.skip("vLLM 0.18 writes a re-added row's drafts itself (InputBatch.update_req_spec_token_ids, #31944)")
    bare, rec = _run(H, release, sess, monkeypatch, patched=False)
    assert any(r["ids"] != r["scheduled"] for r in rec.returns), rec.returns  # junk from the slot's previous owner
    # draft-placeholders-after-metadata left out too: it clamps the forward's ids after the drafts are gathered
    disabled = (_zb_ids(H, release)[0], FIX, "mtp-draft-slots", "draft-placeholders-after-metadata")
    res, rec = _run(H, release, sess, monkeypatch, patched=True, disabled=disabled)
    assert rec.returns and all(r["ids"] == r["scheduled"] for r in rec.returns), rec.returns
    readded = sum(r["readded"] for r in rec.returns)
    assert readded > 0 and res.runner.__dict__.get("_zb_patch_readded_drafts", 0) == readded, rec.returns
