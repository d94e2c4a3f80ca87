"""The engine self-test's verdict (zb_patch.check.engine.run.compare / render) on hand-made results: each kind of
difference lands where it must (failure or note), with the request and field named."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("torch", reason="zb_patch.check.engine writes models with torch")

from zb_patch.check.engine.model import VOCAB  # noqa: E402
from zb_patch.check.engine.run import compare, render  # noqa: E402
from zb_patch.check.engine.workload import Workload  # noqa: E402

WL = Workload(num_requests=5)  # request 4 runs into max_model_len (Workload.requests: every fifth)


def _result(state: str) -> dict:
    reqs = WL.requests(VOCAB)
    return {
        "tokens": {str(i): list(range(n)) for i, (_, n) in enumerate(reqs)},
        "drafted": {str(i): 10 for i in range(len(reqs))},
        "accepted": {str(i): 6 for i in range(len(reqs))},
        "preemptions": {},
        "zb_patch_status": {"state": state},
    }


def _runs() -> dict[str, dict]:
    return {"sync": _result("off"), "async": _result("off"), "async+zb": _result("applied")}


def test_identical_runs_pass():
    assert WL.reaches_max_model_len(VOCAB) == {"4"}
    assert compare(_runs(), WL) == ([], [])


def test_a_token_difference_fails_naming_request_and_index():
    runs = _runs()
    runs["async+zb"]["tokens"]["2"][3] += 1
    failures, _ = compare(runs, WL)
    assert failures[0].startswith("async+zb vs sync: 2 tokens: first difference at output index 3")
    assert any(f.startswith("async+zb vs async: 2 tokens") for f in failures)


def test_zero_bubble_must_equal_classic_async_counts():
    runs = _runs()
    runs["async+zb"]["accepted"]["1"] = 5
    failures, _ = compare(runs, WL)
    assert "async+zb vs async: 1 accepted: 6 vs 5" in failures


def test_count_difference_at_max_model_len_is_a_note_elsewhere_a_failure():
    runs = _runs()
    for name in ("async", "async+zb"):
        runs[name]["drafted"]["4"] = 9  # sync verified one draft more on the request that hits max_model_len
    assert compare(runs, WL) == ([], ["async vs sync: 4 drafted: 10 vs 9", "async+zb vs sync: 4 drafted: 10 vs 9"])
    for name in ("async", "async+zb"):
        runs[name]["drafted"]["0"] = 9
    failures, _ = compare(runs, WL)
    assert failures == ["async vs sync: 0 drafted: 10 vs 9", "async+zb vs sync: 0 drafted: 10 vs 9"]


def test_count_difference_of_a_request_preempted_only_in_async_is_a_note():
    """Seen on the GPU box (k = 1): async scheduling preempted a request once where sync did not, and the recomputed
    request verified one draft less; its tokens were equal. Another request's count difference still fails, and so
    does any difference between zb-patch and classic async."""
    runs = _runs()
    for name in ("async", "async+zb"):
        runs[name]["preemptions"] = {"1": 1}
        runs[name]["accepted"]["1"] = 5
    assert compare(runs, WL) == (
        [],
        [
            "async vs sync: 1 accepted: 6 vs 5 (preempted 0 vs 1 times)",
            "async+zb vs sync: 1 accepted: 6 vs 5 (preempted 0 vs 1 times)",
        ],
    )
    runs["async+zb"]["accepted"]["0"] = 5
    failures, _ = compare(runs, WL)
    assert failures == ["async+zb vs sync: 0 accepted: 6 vs 5", "async+zb vs async: 0 accepted: 6 vs 5"]


def test_count_difference_of_a_request_preempted_as_often_in_both_is_a_note():
    """The big workload on vLLM 0.18 (k = 1, CPU): request 13 was preempted once in sync and in async, and async
    verified one draft less; async scheduling decides before the step in flight returns, so it preempts at another
    moment. A request never preempted still fails."""
    runs = _runs()
    for name in runs:
        runs[name]["preemptions"] = {"1": 1}
    for name in ("async", "async+zb"):
        runs[name]["drafted"]["1"] = 9
    assert compare(runs, WL) == (
        [],
        [
            "async vs sync: 1 drafted: 10 vs 9 (preempted 1 vs 1 times)",
            "async+zb vs sync: 1 drafted: 10 vs 9 (preempted 1 vs 1 times)",
        ],
    )
    for name in ("async", "async+zb"):
        runs[name]["drafted"]["2"] = 9
    failures, _ = compare(runs, WL)
    assert failures == ["async vs sync: 2 drafted: 10 vs 9", "async+zb vs sync: 2 drafted: 10 vs 9"]


@pytest.mark.parametrize(
    ("run", "state", "expected"),
    [
        ("async+zb", "refused", "async+zb: zb-patch is 'refused', not in effect"),
        ("async+zb", "off", "async+zb: zb-patch is 'off', not in effect"),
        ("async", "applied", "async: zb-patch should be off, is 'applied'"),
    ],
)
def test_zb_patch_state_is_checked(run, state, expected):
    runs = _runs()
    runs[run]["zb_patch_status"] = {"state": state}
    failures, _ = compare(runs, WL)
    assert [f for f in failures if f.startswith(expected)], failures


def test_native_zero_bubble_counts_as_in_effect():
    runs = _runs()
    runs["async+zb"]["zb_patch_status"] = {"state": "native"}
    assert compare(runs, WL) == ([], [])


def test_no_verified_draft_fails():
    runs = copy.deepcopy(_runs())
    for r in runs.values():
        r["drafted"] = {k: 0 for k in r["drafted"]}
        r["accepted"] = {k: 0 for k in r["accepted"]}
    failures, _ = compare(runs, WL)
    assert failures == ["sync: no draft token was verified (speculative decoding did not run)"]


def test_render_no_device():
    report = {
        "versions": {"vllm": "0.18.0"},
        "device": {"available": False, "reason": "torch_npu cannot be imported (x)"},
        "workload": WL.to_json(),
        "drafter": "eagle",
        "k": {},
        "verdict": "NO-DEVICE",
        "failures": ["no NPU: torch_npu cannot be imported (x)"],
    }
    text = render(report)
    assert "FAIL no NPU: torch_npu cannot be imported (x)" in text and text.endswith("Verdict: NO-DEVICE")


def test_the_child_launcher_variable_leaves_zb_patch_on():
    """zb-patch stays off when it sees a ZB_PATCH_* variable it does not know; the launcher's must not be one."""
    from zb_patch.check.engine.run import CHILD_ENV
    from zb_patch.plugin import Settings

    settings = Settings({"ZB_PATCH": "1", CHILD_ENV: "tests/engine/run_engine.py"})
    assert settings.errors == [] and settings.enabled


def test_limit_every_picks_the_requests_that_run_into_max_model_len():
    assert Workload(num_requests=10).reaches_max_model_len(VOCAB) == {"4", "9"}
    assert Workload(num_requests=10, limit_every=0).reaches_max_model_len(VOCAB) == set()
    assert Workload(num_requests=10, limit_every=3).reaches_max_model_len(VOCAB) == {"2", "5", "8"}


def test_count_difference_of_a_request_with_drafts_verified_with_its_prompt_is_a_note():
    """vLLM 0.13, big workload, k = 2 (CPU and GPU box alike): sync verified 2 drafts of request 34 with its last
    prompt chunk and accepted 1 (counted apart); async accepted that draft in a decode step: decode-step accepted 12
    vs 13, totals equal. A note; the same difference on a request without such drafts still fails."""
    runs = _runs()
    runs["sync"]["drafted_in_prefill"] = {"1": 2}
    runs["sync"]["accepted_in_prefill"] = {"1": 1}
    runs["sync"]["drafted"]["1"] = 12  # 10 in decode steps, as async
    for name in ("async", "async+zb"):
        runs[name]["accepted"]["1"] = 6  # sync: 6 - 1 = 5 in decode steps
    failures, notes = compare(runs, WL)
    assert failures == []
    assert notes == [
        "sync: 2 drafts verified together with prompt tokens (not compared)",
        "async vs sync: 1 accepted: 5 vs 6 (drafts verified with prompt tokens: 2 vs 0)",
        "async+zb vs sync: 1 accepted: 5 vs 6 (drafts verified with prompt tokens: 2 vs 0)",
    ]
    for name in ("async", "async+zb"):
        runs[name]["accepted"]["2"] = 5
    failures, _ = compare(runs, WL)
    assert failures == ["async vs sync: 2 accepted: 6 vs 5", "async+zb vs sync: 2 accepted: 6 vs 5"]
