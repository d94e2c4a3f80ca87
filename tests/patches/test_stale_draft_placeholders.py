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

from zb_patch.check.selftest.compat import EngineShape  # noqa: E402

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


# seed 3: several rows back with drafts of different lengths in one run (0.18: 5 rows, 7 draft tokens; 0.13: 10, 25)
MANY_RETURNS_SEED = 3


def test_every_returning_row_is_filled_and_counted(H, release, sess, monkeypatch):
    """Several rows back in one run: each gets its request's drafts, and the fix's counters say so exactly (rows,
    draft tokens, none without kept drafts); at least one kept set per filled row, and at the end none kept for a
    request that finished."""
    res, rec = run(H, release, sess, monkeypatch, patched=True, seed=MANY_RETURNS_SEED)
    assert len(rec.returns) >= 2 and len({len(r["scheduled"]) for r in rec.returns}) >= 2, rec.returns
    assert [r for r in rec.returns if r["ids"] != r["expected"]] == []
    st = res.runner.__dict__["_zb_patch_saved_drafts"]
    assert (st.filled, st.filled_tokens, st.unknown) == (
        len(rec.returns),
        sum(len(r["scheduled"]) for r in rec.returns),
        0,
    )
    assert st.saved >= st.filled
    assert set(st.drafts) <= set(res.runner.requests)


def _wrapped(signature):
    """The fix's ``_prepare_input_ids`` wrapper around a release body of this signature, which records its call."""
    from zb_patch.versions.fixes import stale_draft_placeholders as fix

    calls = []
    bodies = {
        "0.13-0.18": lambda self, scheduler_output, total_num_scheduled_tokens, cu_num_tokens: calls.append(
            (self, scheduler_output, total_num_scheduled_tokens, cu_num_tokens)
        ),
        "0.19+": lambda self, scheduler_output, num_reqs, total_num_scheduled_tokens, cu_num_tokens: calls.append(
            (self, scheduler_output, num_reqs, total_num_scheduled_tokens, cu_num_tokens)
        ),
        "unnamed": lambda self, scheduler_output, *rest: calls.append((self, scheduler_output, *rest)),
    }
    return fix.make_prepare_input_ids(bodies[signature]), calls


@pytest.mark.parametrize(
    "signature,args,kwargs,cu_num_tokens",
    [
        ("0.13-0.18", (9, "cu"), {}, "cu"),
        ("0.13-0.18", (9,), {"cu_num_tokens": "cu"}, "cu"),
        ("0.19+", (2, 9, "cu"), {}, "cu"),
        ("0.19+", (2, 9), {"cu_num_tokens": "cu"}, "cu"),
        ("unnamed", (2, 9, "cu"), {}, "cu"),  # no parameter of that name: the last positional argument
    ],
)
def test_the_wrapper_hands_the_call_on_and_finds_cu_num_tokens(
    H, sess, monkeypatch, signature, args, kwargs, cu_num_tokens
):
    """Under async scheduling with drafts: the drafts of leaving rows are kept before the release's body, which gets
    the call unchanged, and the returning rows are filled with this step's ``cu_num_tokens``, wherever the release's
    signature puts it."""
    from zb_patch.versions.fixes import stale_draft_placeholders as fix

    shape = EngineShape(num_spec_tokens=2)
    vc = H.build_config(sess, shape)
    runner = H.make_runner(vc, H.kv_cache_config(vc, shape))
    seen = []
    monkeypatch.setattr(fix, "keep_leaving_drafts", lambda r, st: seen.append(("keep", r, st)))
    monkeypatch.setattr(fix, "fill_returning_drafts", lambda r, st, so, cu: seen.append(("fill", r, st, so, cu)))
    wrapper, calls = _wrapped(signature)
    assert wrapper(runner, "so", *args, **kwargs) is None
    assert calls == [(runner, "so", *args, *kwargs.values())]
    st = runner.__dict__[fix.SAVED_DRAFTS_ATTR]
    assert seen == [("keep", runner, st), ("fill", runner, st, "so", cu_num_tokens)]


@pytest.mark.parametrize("async_scheduling,num_spec_tokens", [(False, 2), (True, 0)])
def test_the_wrapper_leaves_other_configurations_to_the_release(
    H, sess, monkeypatch, async_scheduling, num_spec_tokens
):
    """Without async scheduling or without drafts the release's body runs alone: nothing kept or filled, and a
    leaving-rows record of the batch is dropped (nothing would read it)."""
    from zb_patch.versions.fixes import stale_draft_placeholders as fix

    shape = EngineShape(num_spec_tokens=2)
    vc = H.build_config(sess, shape, async_scheduling=async_scheduling)
    runner = H.make_runner(vc, H.kv_cache_config(vc, shape))
    runner.num_spec_tokens = num_spec_tokens
    monkeypatch.setattr(fix, "keep_leaving_drafts", lambda *a: pytest.fail("kept drafts"))
    monkeypatch.setattr(fix, "fill_returning_drafts", lambda *a: pytest.fail("filled rows"))
    wrapper, calls = _wrapped("0.13-0.18")
    runner.input_batch.__dict__[fix.LEFT_ROWS_ATTR] = {"r": 0}
    assert wrapper(runner, "so", 9, cu_num_tokens="cu") is None
    assert calls == [(runner, "so", 9, "cu")]
    assert fix.LEFT_ROWS_ATTR not in runner.input_batch.__dict__ and fix.SAVED_DRAFTS_ATTR not in runner.__dict__
    assert wrapper(runner, "so", 9, "cu") is None  # no record: nothing to drop
    assert calls[-1] == (runner, "so", 9, "cu")


def test_rows_back_without_kept_drafts_keep_the_release_s_ids_and_are_counted(H, release, sess, monkeypatch):
    """Nothing kept (the keeping step left out): every row back with drafts keeps the ids the release wrote and is
    counted as unknown; none is filled."""
    from zb_patch.versions.fixes import stale_draft_placeholders as fix

    monkeypatch.setattr(fix, "keep_leaving_drafts", lambda runner, st: None)
    res, rec = run(H, release, sess, monkeypatch, patched=True, seed=MANY_RETURNS_SEED)
    _, bare_rec = run(H, release, sess, monkeypatch, patched=True, seed=MANY_RETURNS_SEED, disabled=(FIX,))
    assert len(rec.returns) >= 2
    assert [r["ids"] for r in rec.returns] == [r["ids"] for r in bare_rec.returns]
    st = res.runner.__dict__["_zb_patch_saved_drafts"]
    assert (st.unknown, st.filled, st.filled_tokens, st.drafts) == (len(rec.returns), 0, 0, {})


def test_remove_request_records_the_row_of_a_sampled_request(H, sess):
    """The ``InputBatch.remove_request`` wrapper records the previous-step row of each removed request that was
    sampled there (several per step), nothing for one that was not or before any step was sampled; the release's
    body runs and its result is returned."""
    from zb_patch.versions.fixes import stale_draft_placeholders as fix

    shape = EngineShape(num_spec_tokens=2)
    vc = H.build_config(sess, shape)
    batch = H.make_runner(vc, H.kv_cache_config(vc, shape)).input_batch
    removed = []

    def body(b, req_id):
        removed.append((b, req_id))
        return len(removed)

    remove = fix.make_remove_request(body)
    batch.prev_req_id_to_index = None  # no step sampled yet
    assert remove(batch, "a") == 1 and fix.LEFT_ROWS_ATTR not in batch.__dict__
    batch.prev_req_id_to_index = {"a": 3, "b": 0}
    assert remove(batch, "a") == 2 and remove(batch, "c") == 3 and remove(batch, "b") == 4
    assert batch.__dict__[fix.LEFT_ROWS_ATTR] == {"a": 3, "b": 0}
    assert removed == [(batch, "a"), (batch, "a"), (batch, "c"), (batch, "b")]


def _runner_with_requests(H, sess, req_ids, num_spec_tokens=2):
    """A real runner whose persistent batch holds ``req_ids`` (rows in that order), each a real
    ``CachedRequestState`` in ``runner.requests``."""
    from vllm import SamplingParams

    shape = EngineShape(num_spec_tokens=num_spec_tokens)
    vc = H.build_config(sess, shape)
    runner = H.make_runner(vc, H.kv_cache_config(vc, shape))
    for req_id in req_ids:
        state = H.request_state(req_id, [1, 2, 3], 3, SamplingParams(temperature=0.0))
        runner.requests[req_id] = state
        runner.input_batch.add_request(state)
    assert list(runner.input_batch.req_id_to_index) == list(req_ids)
    return runner


def test_leaving_drafts_are_kept_for_live_requests_at_the_proposal_s_row_width(H, sess):
    """Before the release's body: each recorded leaving row whose request is still alive gets its row of the last
    proposal kept, a finished one (listed first) nothing; the row width is the proposal's own, which vLLM 0.24+
    lets differ from num_spec_tokens (it reads prev_num_spec_tokens = _draft_token_ids.shape[1])."""
    import torch

    from zb_patch.versions.fixes import stale_draft_placeholders as fix

    runner = _runner_with_requests(H, sess, ["alive"], num_spec_tokens=3)
    runner._draft_token_ids = torch.tensor([[10, 11], [20, 21], [30, 31]], dtype=torch.int32)  # width 2 < 3
    runner.input_batch.__dict__[fix.LEFT_ROWS_ATTR] = {"finished": 0, "alive": 2}
    st = fix.SavedDrafts()
    fix.keep_leaving_drafts(runner, st)
    assert {r: d.tolist() for r, d in st.drafts.items()} == {"alive": [30, 31]}
    assert st.saved == 1
    assert fix.LEFT_ROWS_ATTR not in runner.input_batch.__dict__  # read once
    runner._draft_token_ids[2] = -5  # a copy: the runner reuses its draft tensor
    assert st.drafts["alive"].tolist() == [30, 31]


def test_returning_rows_are_filled_and_the_kept_drafts_forgotten(H, sess):
    """After the release's body: a row back with scheduled drafts gets its kept drafts, also behind a new request
    without drafts and a row back with none kept (counted, its ids left as they are); the kept drafts of a request
    sampled last step (fresher ones were scattered) and of a finished one are forgotten, also in a step that
    schedules no drafts at all."""
    import numpy as np
    import torch
    from vllm.v1.core.sched.output import SchedulerOutput

    from zb_patch.versions.fixes import stale_draft_placeholders as fix

    runner = _runner_with_requests(H, sess, ["new", "lost", "back", "stay"])
    batch = runner.input_batch
    batch.prev_req_id_to_index = {"stay": 0}
    so = SchedulerOutput.make_empty()
    so.scheduled_spec_decode_tokens = {"lost": [-1, -1], "back": [-1, -1], "stay": [-1, -1]}
    cu_num_tokens = np.array([5, 8, 11, 14], dtype=np.int32)  # new: a 5-token prompt, the others 1 + 2 drafts
    ids = runner.input_ids.gpu
    ids[:14] = torch.tensor([1, 2, 3, 4, 5, 6, -1, -1, 6, -1, -1, 9, 44, 45], dtype=ids.dtype)
    st = fix.SavedDrafts(drafts={n: torch.tensor(v) for n, v in (("back", [7, 8]), ("stay", [0, 0]), ("gone", [3, 3]))})
    fix.fill_returning_drafts(runner, st, so, cu_num_tokens)
    assert ids[:14].tolist() == [1, 2, 3, 4, 5, 6, -1, -1, 6, 7, 8, 9, 44, 45]
    assert (st.filled, st.filled_tokens, st.unknown, st.drafts) == (1, 2, 1, {})

    # a step of prompts only (no drafts scheduled): kept drafts of a sampled or finished request still go
    so.scheduled_spec_decode_tokens = {}
    st = fix.SavedDrafts(drafts={"stay": torch.tensor([0, 0]), "gone": torch.tensor([3, 3])})
    fix.fill_returning_drafts(runner, st, so, cu_num_tokens)
    assert ids[:14].tolist() == [1, 2, 3, 4, 5, 6, -1, -1, 6, 7, 8, 9, 44, 45]
    assert (st.filled, st.unknown, st.drafts) == (0, 0, {})
