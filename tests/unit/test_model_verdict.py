"""The verdict of ``zb-patch selftest --engine --model`` (zb_patch.check.engine.model_verdict) on hand-made run
results: the noise floor, exact where it is exact, judged by it where not, identical schedules with different
outputs, graph modes without replays, opt-in runs, the strict check left out; and the figures."""

from __future__ import annotations

import copy

from zb_patch.check.engine import model_verdict as mv

TOKENS = {"0": [5, 6, 7, 8, 9, 10], "1": [11, 12, 13, 14], "2": [20, 21, 22, 23, 24]}
APPLIED = {"state": "applied", "report": {"items": []}}


def _steps() -> list[dict]:
    # request 0: prompt 4, request 1: prompt 3, request 2: prompt 5; [request, computed, scheduled, outputs before]
    return [
        {"t": 1.0, "sched": [["0", 0, 4, 0], ["1", 0, 3, 0]], "out": {"0": [5], "1": [11]}},
        {
            "t": 2.0,
            "sched": [["0", 4, 3, 1], ["1", 3, 3, 1], ["2", 0, 5, 0]],
            "out": {"0": [6, 7, 8], "1": [12], "2": [20]},
        },
        {
            "t": 3.0,
            "sched": [["0", 7, 3, 4], ["1", 4, 3, 2], ["2", 5, 3, 1]],
            "out": {"0": [9, 10], "1": [13, 14], "2": [21, 22, 23]},
        },
    ]


def _run(name: str) -> dict:
    zb = name.startswith("async+zb")
    return {
        "tokens": copy.deepcopy(TOKENS),
        "drafted": {"0": 4, "1": 4, "2": 4},
        "accepted": {"0": 2, "1": 1, "2": 2},
        "preemptions": {},
        "steps": _steps(),
        "metrics": {
            r: {"num_generation_tokens": len(t), "first_token_ts": 1.0, "last_token_ts": 3.0} for r, t in TOKENS.items()
        },
        "generate_seconds": 3.0,
        "async_scheduling": name != "sync",
        "scheduling": {
            "scheduler": "Scheduler" if name == "sync" else "AsyncScheduler",
            "steps": 3,
            "overlapped": 0 if name == "sync" else 2,
            "after_drafts": 2,
        },
        "zero_bubble": (
            {"kind": "zb-patch", "active": True, "reason": "", "steps": 3, "corrected_steps": 2, "host_waits": 2}
            if zb
            else {"kind": "none", "active": False}
        ),
        "zb_patch_status": copy.deepcopy(APPLIED) if name != "async" else {"state": "off"},
        "worker_zb_patch_status": copy.deepcopy(APPLIED) if name != "async" else {"state": "off"},
        "cudagraph_mode": "CUDAGraphMode.NONE",
        "graphs_captured": 0,
        "graph_replays": {},
        "host_drains": {},
        "task_group_updates": {},
    }


def _runs(*extra: str) -> dict[str, dict]:
    return {n: _run(n) for n in ("async+fixes", "async+fixes#2", "async+zb", *extra)}


TINY_PASS = {"verdict": "PASS", "failures": []}


def test_identical_runs_pass_with_an_exact_floor():
    out = mv.judge(_runs(), TINY_PASS)
    assert (out["verdict"], out["failures"], out["notes"]) == ("PASS", [], [])
    assert out["floor"]["exact"] and out["floor"]["identical_schedule_steps"] == 3
    assert out["pairs"]["async+zb"]["exact"]


def test_without_the_strict_check_the_verdict_says_so():
    out = mv.judge(_runs(), None)
    assert out["verdict"] == "PASS-WITHOUT-STRICT-CHECK"
    assert out["notes"][0].startswith("tiny-model strict check: not run")
    failed = mv.judge(_runs(), {"verdict": "FAIL", "failures": ["k=2: async+zb vs sync: 1 tokens: ..."]})
    assert failed["verdict"] == "FAIL" and failed["failures"][0].startswith("tiny-model strict check: k=2:")


def test_exact_floor_any_divergence_fails_naming_first_request_and_position():
    runs = _runs()
    runs["async+zb"]["tokens"]["2"][3] = 99
    runs["async+zb"]["tokens"]["1"][2] = 98
    out = mv.judge(runs, TINY_PASS)
    assert out["verdict"] == "FAIL"
    assert out["failures"][0] == (
        "async+zb vs async+fixes: 2 of 3 requests diverge, the noise floor is exact: first at request 1 at output "
        "position 2"
    )


def test_exact_floor_count_difference_fails():
    runs = _runs()
    runs["async+zb"]["accepted"]["0"] = 1
    out = mv.judge(runs, TINY_PASS)
    assert any(
        f.startswith("async+zb vs async+fixes: drafted / accepted differ for requests ['0']") for f in out["failures"]
    )


def _perturbed_floor(runs: dict) -> None:
    """The second async+fixes run samples another token for request 0 at output position 4 (planted nondeterminism)."""
    runs["async+fixes#2"]["tokens"]["0"][4:] = [50, 51]
    runs["async+fixes#2"]["steps"][2]["out"]["0"] = [50, 51]


def test_floor_not_exact_judges_by_the_floor_plus_margin():
    runs = _runs()
    _perturbed_floor(runs)
    runs["async+zb"]["tokens"]["2"][4] = 77  # one request diverges: floor 1 + margin ceil(5 % of 3) = 2 allowed
    out = mv.judge(runs, TINY_PASS)
    assert out["verdict"] == "PASS", out["failures"]
    assert not out["floor"]["exact"] and out["floor"]["diverged"] == {"0": 4}
    assert out["notes"][0].startswith("noise floor not exact: 1 of 3 requests diverge between two async+fixes runs")
    assert "(first at request 0 at output position 4)" in out["notes"][0]
    # the floor's own step (identical schedule, different output) makes the zero-bubble run's such steps notes
    assert any("within the noise floor's 1 + margin 1" in n for n in out["notes"])


def test_floor_not_exact_beyond_the_margin_fails():
    runs = _runs()
    _perturbed_floor(runs)
    for r in ("0", "1", "2"):
        runs["async+zb"]["tokens"][r][1] = 66
    out = mv.judge(runs, TINY_PASS)
    assert out["failures"][0] == (
        "async+zb vs async+fixes: 3 of 3 requests diverge, more than the noise floor's 1 + margin 1: first at request "
        "0 at output position 1"
    )


def test_acceptance_beyond_the_floor_fails_when_the_floor_is_not_exact():
    runs = _runs()
    _perturbed_floor(runs)
    runs["async+zb"]["accepted"] = {"0": 4, "1": 4, "2": 4}
    out = mv.judge(runs, TINY_PASS)
    assert any(
        "acceptance rate" in f and "more than the noise floor's 0.0000 + margin 0.02" in f for f in out["failures"]
    )


def test_identical_schedule_different_output_fails_where_the_floor_has_none():
    runs = _runs()
    runs["async+zb"]["steps"][2]["out"]["1"] = [13, 99]  # same schedule and history, another sampled token
    out = mv.judge(runs, TINY_PASS)
    assert out["verdict"] == "FAIL"
    assert any(
        f.startswith(
            "async+zb vs async+fixes: 1 of 3 steps with identical schedules sampled different tokens, first: "
            "request 1 at output position 2"
        )
        for f in out["failures"]
    ), out["failures"]


def test_identical_schedule_steps_need_the_same_history():
    """A step whose request already had other tokens is not compared (its inputs differ)."""
    runs = _runs()
    runs["async+zb"]["tokens"]["0"][0] = 42
    compared, bad = mv.schedule_mismatches(runs["async+zb"], runs["async+fixes"])
    assert compared == 1 and bad == []  # steps 2 and 3 hold request 0 after its first token: left out


def test_a_shorter_sampled_run_agrees_on_the_common_length():
    runs = _runs()
    runs["async+zb"]["steps"][2]["out"]["2"] = [21]  # fewer drafts accepted: a prefix of the other's
    assert mv.schedule_mismatches(runs["async+zb"], runs["async+fixes"]) == (3, [])


def test_graph_mode_run_with_zero_replays_fails():
    runs = _runs()
    for res in runs.values():
        res["cudagraph_mode"] = "CUDAGraphMode.FULL_DECODE_ONLY"
        res["graphs_captured"] = 4
        res["graph_replays"] = {"FULL": 30}
    runs["async+zb"]["graph_replays"] = {}
    out = mv.judge(runs, TINY_PASS)
    assert out["failures"] == [
        "async+zb: cudagraph_mode FULL_DECODE_ONLY replayed no FULL graph while generating (graph_replays {})"
    ]
    runs["async+zb"]["graphs_captured"] = 0
    assert mv.graph_failures("async+zb", runs["async+zb"]) == [
        "async+zb: cudagraph_mode FULL_DECODE_ONLY captured no graph"
    ]


def test_graph_patch_applied_in_the_workers_must_count_its_work():
    runs = _runs()
    res = runs["async+zb"]
    res["cudagraph_mode"], res["graphs_captured"], res["graph_replays"] = "CUDAGraphMode.PIECEWISE", 3, {"PIECEWISE": 9}
    res["worker_zb_patch_status"]["report"]["items"] = [
        {"id": mv.graph_patch_failures.__globals__["ONCE_PER_STEP"], "verdict": "applied"}
    ]
    out = mv.judge(runs, TINY_PASS)
    assert any("no host drain ran once per step" in f for f in out["failures"]), out["failures"]


def test_zero_bubble_must_run_and_correct_in_the_zero_bubble_run_only():
    runs = _runs()
    runs["async+zb"]["zero_bubble"]["corrected_steps"] = 1
    runs["async+zb"]["zero_bubble"]["host_waits"] = 1
    out = mv.judge(runs, TINY_PASS)
    assert (
        "async+zb: zero-bubble corrected 1 steps, 2 scheduled a request right after a step that verified its drafts"
        in out["failures"]
    )
    runs = _runs()
    runs["async+fixes#2"]["zero_bubble"] = {"kind": "zb-patch", "active": True}
    assert (
        "async+fixes: zb-patch's zero-bubble ran (ZB_PATCH_DISABLE should have left it out)"
        in mv.judge(runs, TINY_PASS)["failures"]
    )


def test_opt_in_runs_are_judged_each_and_must_apply_their_patch():
    runs = _runs("async+zb+full-replay-ordered-on-device")
    out = mv.judge(runs, TINY_PASS)
    assert out["opt_in"]["full-replay-ordered-on-device"] == {
        "verdict": "FAIL",
        "failures": [
            "async+zb+full-replay-ordered-on-device: opt-in patch full-replay-ordered-on-device was not applied in the "
            "run's workers"
        ],
    }
    runs["async+zb+full-replay-ordered-on-device"]["worker_zb_patch_status"]["report"]["items"] = [
        {"id": "full-replay-ordered-on-device", "verdict": "applied"}
    ]
    out = mv.judge(runs, TINY_PASS)
    assert out["opt_in"]["full-replay-ordered-on-device"]["verdict"] == "PASS" and out["verdict"] == "PASS"


def test_sync_and_classic_async_are_reported_not_judged():
    runs = _runs("sync", "async")
    runs["sync"]["tokens"]["1"][0] = 3
    out = mv.judge(runs, TINY_PASS)
    assert out["verdict"] == "PASS", out["failures"]
    assert (
        "sync (reported, not judged) vs async+fixes: 2 of 3 requests identical, first divergence at request 1 at "
        "output position 0; acceptance 0.4167 vs 0.4167" in out["notes"]
    )


def test_speed_figures():
    res = _run("async+zb")
    s = mv.speed(res)
    # TPOT: (3 - 1) s over 5, 3 and 4 gaps; ITL: every request's steps 1 s apart
    assert s["tpot_ms_median"] == 500.0 and s["itl_ms_median"] == 1000.0 and s["output_tokens"] == 15
    assert s["output_tokens_per_s"] == 5.0
    over = mv.speed_over_repeats([s, {**s, "output_tokens_per_s": 7.0}])
    assert over["output_tokens_per_s"] == 6.0 and over["output_tokens_per_s_spread"] == [5.0, 7.0]
