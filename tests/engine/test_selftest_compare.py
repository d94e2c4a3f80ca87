"""The engine self-test's verdict (zb_patch.check.engine.verdict.compare, run.render) on hand-made results: each kind
of difference lands where it must (failure or note), with the request, field or position named."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("torch", reason="zb_patch.check.engine writes models with torch")

from zb_patch.check.engine.model import VOCAB  # noqa: E402
from zb_patch.check.engine.run import render  # noqa: E402
from zb_patch.check.engine.verdict import compare  # noqa: E402
from zb_patch.check.engine.workload import Workload  # noqa: E402

WL = Workload(num_requests=5)  # k = 2; request 4 runs into max_model_len 160 (Workload.requests: every fifth)
LIMIT_ZONE = WL.max_model_len - 2 * (WL.num_speculative_tokens + 1)  # 154
# every request's decode steps: [position, drafted, accepted, verified with prompt tokens]
CHAIN = [[10, 2, 1, False], [12, 2, 2, False], [15, 2, 0, False], [16, 2, 2, False]]
LIMIT_CHAIN = [[148, 2, 1, False], [150, 2, 2, False], [153, 2, 0, False], [154, 2, 1, False], [156, 2, 2, False]]


def _result(name: str) -> dict:
    reqs = WL.requests(VOCAB)
    verifications = {str(i): copy.deepcopy(LIMIT_CHAIN if i == 4 else CHAIN) for i in range(len(reqs))}
    result = {
        "tokens": {str(i): list(range(n)) for i, (_, n) in enumerate(reqs)},
        "preemptions": {},
        "preempted_at": {},
        "drafted_in_prefill": {},
        "accepted_in_prefill": {},
        "verifications": verifications,
        "drafted_per_pos": [16, 16],
        "accepted_per_pos": [10, 6],
        "async_scheduling": name != "sync",
        "scheduling": {
            "scheduler": "Scheduler" if name == "sync" else "AsyncScheduler",
            "steps": 40,
            "overlapped": 0 if name == "sync" else 38,
            "after_drafts": 20,
        },
        "zero_bubble": (
            {"kind": "zb-patch", "active": True, "reason": "", "steps": 40, "corrected_steps": 20, "host_waits": 20}
            if name == "async+zb"
            else {"kind": "none", "active": False}
        ),
        "zb_patch_status": {"state": "applied" if name in ("async+fixes", "async+zb") else "off"},
    }
    _recount(result)
    return result


def _recount(result: dict) -> None:
    """drafted / accepted per request from the verifications (what the child counts)."""
    for field, at in (("drafted", 1), ("accepted", 2)):
        result[field] = {r: sum(v[at] for v in recs) for r, recs in result["verifications"].items()}


def _runs() -> dict[str, dict]:
    return {name: _result(name) for name in ("sync", "async", "async+fixes", "async+zb")}


def _in_every_async(runs: dict, change) -> None:
    for name in ("async", "async+fixes", "async+zb"):
        change(runs[name])
        _recount(runs[name])


def _judged(notes: list[str]) -> list[str]:
    """The notes on the judged runs (classic async's, reported beside, left out)."""
    return [n for n in notes if not n.startswith(CLASSIC)]


CLASSIC = "async (classic, without zb-patch, not judged): "


def test_identical_runs_pass():
    assert WL.reaches_max_model_len(VOCAB) == {"4"}
    assert compare(_runs(), WL, VOCAB) == ([], [])


def test_a_token_difference_fails_naming_request_and_index():
    runs = _runs()
    runs["async+zb"]["tokens"]["2"][3] += 1
    failures, _ = compare(runs, WL, VOCAB)
    assert failures[0].startswith("async+zb vs sync: 2 tokens: first difference at output index 3")
    assert any(f.startswith("async+zb vs async+fixes: 2 tokens") for f in failures)


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            lambda r: r["verifications"]["1"][2].__setitem__(0, 14),
            "async+zb vs async+fixes: 1 verifications: first diff",
        ),
        (lambda r: r["preempted_at"].__setitem__("3", [40]), "async+zb vs async+fixes: 3 preempted_at: None vs [40]"),
        (lambda r: r.__setitem__("accepted_per_pos", [10, 5]), "async+zb vs async+fixes: accepted_per_pos: [10, 6] vs"),
        (lambda r: r["preemptions"].__setitem__("0", 1), "async+zb vs async+fixes: 0 preemptions: None vs 1"),
    ],
    ids=["verification position", "preemption position", "per-position acceptance", "preemptions"],
)
def test_zero_bubble_must_equal_classic_async_in_every_field(change, expected):
    runs = _runs()
    change(runs["async+zb"])
    failures, _ = compare(runs, WL, VOCAB)
    assert [f for f in failures if f.startswith(expected)], failures


def test_count_difference_in_the_max_model_len_clamp_is_a_note_elsewhere_a_failure():
    """Async scheduling clamps an optimistic count near max_model_len: one draft less at position 154 is a note for
    request 4; the same change at position 12 (outside the clamp zone, no other event) fails."""
    runs = _runs()
    _in_every_async(runs, lambda r: r["verifications"]["4"][3].__setitem__(1, 1))  # 1 of 2 drafts at 154
    failures, notes = compare(runs, WL, VOCAB)
    assert failures == []
    assert _judged(notes) == [
        f"{n} vs sync: 4 drafted 10 vs 9: from position {LIMIT_ZONE} (max_model_len clamp from position "
        f"{LIMIT_ZONE}); 0 verifications in one run only"
        for n in ("async+fixes", "async+zb")
    ]
    runs = _runs()
    _in_every_async(runs, lambda r: r["verifications"]["4"].__setitem__(0, [147, 2, 1, False]))  # before the zone
    failures, _ = compare(runs, WL, VOCAB)
    assert failures[0] == (
        "async+fixes vs sync: 4: verifications at positions [147, 148] in one run only, before the first explaining "
        f"event (max_model_len clamp from position {LIMIT_ZONE})"
    )


def test_unmatched_verifications_after_a_preemption_are_a_note_before_it_a_failure():
    """A request preempted at position 15 in the async runs recomputes and verifies from another position: what
    differs from position 12 on (one step in flight before the event, k + 1 = 3) is a note naming the preemption; a
    verification in one run only before that is a failure."""
    runs = _runs()

    def preempt_and_shift(r):
        r["preemptions"]["1"] = 1
        r["preempted_at"]["1"] = [15]
        r["verifications"]["1"][2:] = [[17, 2, 1, False], [19, 2, 2, False]]

    _in_every_async(runs, preempt_and_shift)
    failures, notes = compare(runs, WL, VOCAB)
    assert failures == []
    assert _judged(notes) == [
        f"{n} vs sync: 1 accepted 5 vs 6: from position 15 (preempted at 15 in {n}); 4 verifications in one run only"
        for n in ("async+fixes", "async+zb")
    ]
    _in_every_async(runs, lambda r: r["verifications"]["1"].__setitem__(0, [9, 2, 1, False]))
    failures, _ = compare(runs, WL, VOCAB)
    assert failures[0] == (
        "async+fixes vs sync: 1: verifications at positions [9, 10] in one run only, before the first explaining event "
        "(preempted at 15 in async+fixes)"
    )


def test_accepted_counts_at_a_common_position_must_agree_even_after_an_event():
    """The drafts from one position are the same drafts in every run: a lower accepted count there (a drafter-side
    mistake) fails even on a preempted request; fewer drafts accept the other run's count capped at their own."""
    runs = _runs()

    def preempt_then_accept_less(r):
        r["preempted_at"]["2"] = [11]
        r["preemptions"]["2"] = 1
        r["verifications"]["2"][1] = [12, 2, 1, False]

    _in_every_async(runs, preempt_then_accept_less)
    failures, _ = compare(runs, WL, VOCAB)
    assert failures == [
        f"{n} vs sync: 2 at position 12: 2 of 2 drafts accepted vs 1 of 2" for n in ("async+fixes", "async+zb")
    ]
    runs = _runs()
    _in_every_async(runs, lambda r: r["verifications"]["2"].__setitem__(1, [12, 1, 1, False]))  # token budget: 1 draft
    failures, notes = compare(runs, WL, VOCAB)
    assert failures == [] and len(_judged(notes)) == 2
    assert "from position 12 (1 of 2 drafts at 12 in async+fixes" in _judged(notes)[0]


def test_a_count_difference_without_an_event_fails():
    runs = _runs()
    _in_every_async(runs, lambda r: r["verifications"]["0"].append([20, 2, 1, False]))
    failures, _ = compare(runs, WL, VOCAB)
    assert (
        failures[0]
        == "async+fixes vs sync: 0: verifications at positions [20] in one run only, and no explaining event"
    )


def test_drafts_verified_with_prompt_tokens_are_an_event():
    """vLLM 0.13's sync scheduler verifies drafts with a request's last prompt chunk; async never does. Those
    verifications are not matched by position, and the difference they make is a note from that position on."""
    runs = _runs()
    runs["sync"]["verifications"]["3"].insert(0, [8, 2, 1, True])
    runs["sync"]["drafted_in_prefill"]["3"] = 2
    runs["sync"]["accepted_in_prefill"]["3"] = 1
    _recount(runs["sync"])
    failures, notes = compare(runs, WL, VOCAB)
    assert failures == []
    assert _judged(notes)[0] == (
        "async+fixes vs sync: 3 drafted 10 vs 8, accepted 6 vs 5: from position 8 (drafts verified with prompt tokens "
        "at 8 in sync); 0 verifications in one run only"
    )


def _one_pass_at_12(sync_accepts_at_12: int = 1, sync_passes_at_12: int = 1, async_passes_at_12: int = 2) -> dict:
    """Request 1's drafts verified at 12 came from ``sync_passes_at_12`` draft passes in sync and
    ``async_passes_at_12`` in every async run (the child's ``draft_passes``, vllm-ascend 0.13's MTP drafter); sync
    accepted ``sync_accepts_at_12`` of them, the async runs 2 of 2 (CHAIN), and the runs' positions part from there."""
    runs = _runs()
    sync = runs["sync"]
    sync["verifications"]["1"] = [[10, 2, 1, False], [12, 2, sync_accepts_at_12, False], [14, 2, 2, False]]
    _recount(sync)
    sync["draft_passes"] = {"1": {"10": [2, False], "12": [sync_passes_at_12, True], "14": [2, False]}}
    for name in ("async", "async+fixes", "async+zb"):
        runs[name]["draft_passes"] = {"1": {str(v[0]): [2, False] for v in CHAIN}}
        runs[name]["draft_passes"]["1"]["12"][0] = async_passes_at_12
    return runs


def test_drafts_from_one_pass_in_one_run_excuse_a_different_acceptance():
    """vllm-ascend 0.13's MTP drafter repeats its first draft when the batch holds a prefill (verdict rule 5): where one
    run's drafts came from one pass and the other's from one pass per draft, only the first draft is the same, so
    the accepted counts may differ there (the first draft accepted in both) and the positions part from there on."""
    failures, notes = compare(_one_pass_at_12(), WL, VOCAB)
    assert failures == []
    assert _judged(notes)[0] == (
        "async+fixes vs sync: 1 drafted 6 vs 8, accepted 4 vs 5: from position 12 (drafts from one draft pass at 12 in "
        "sync); 3 verifications in one run only; accepted counts differ at [12] (one pass)"
    )


@pytest.mark.parametrize(
    "planted",
    [
        # no record of the passes (any other drafter): the same difference is a drafter-side mistake
        lambda runs: [r.pop("draft_passes") for r in runs.values()],
        # one pass in both runs: the same drafts, so the same count
        lambda runs: runs["async+fixes"]["draft_passes"]["1"]["12"].__setitem__(0, 1),
    ],
    ids=["passes-not-recorded", "one-pass-in-both"],
)
def test_a_different_acceptance_needs_one_pass_in_exactly_one_run(planted):
    runs = _one_pass_at_12()
    planted(runs)
    failures, _ = compare(runs, WL, VOCAB)
    assert failures[0] == "async+fixes vs sync: 1 at position 12: 1 of 2 drafts accepted vs 2 of 2"


def test_the_first_draft_of_one_pass_must_be_accepted_as_in_the_other_run():
    """The one pass of one run is the first pass of the other: its draft is accepted in both or in neither."""
    failures, _ = compare(_one_pass_at_12(sync_accepts_at_12=0), WL, VOCAB)
    assert failures[0] == "async+fixes vs sync: 1 at position 12: 0 of 2 drafts accepted vs 2 of 2"


@pytest.mark.parametrize(
    "name, change, expected",
    [
        ("sync", lambda r: r["scheduling"].__setitem__("overlapped", 3), "sync: 3 steps scheduled while another"),
        ("async", lambda r: r["scheduling"].__setitem__("overlapped", 0), "async: no step was scheduled while"),
        ("async+zb", lambda r: r.__setitem__("async_scheduling", False), "async+zb: async_scheduling False"),
    ],
)
def test_each_run_must_have_scheduled_as_configured(name, change, expected):
    runs = _runs()
    change(runs[name])
    failures, _ = compare(runs, WL, VOCAB)
    assert [f for f in failures if f.startswith(expected)], failures


@pytest.mark.parametrize(
    "zero_bubble, expected",
    [
        (
            {"kind": "zb-patch", "active": False, "reason": "planted: switched off", "corrected_steps": 0},
            "async+zb: zero-bubble switched itself off at run time: planted: switched off",
        ),
        (
            {"kind": "zb-patch", "active": True, "reason": "", "corrected_steps": 19, "host_waits": 19},
            "async+zb: zero-bubble corrected 19 steps, 20 scheduled a request right after",
        ),
        (
            {"kind": "zb-patch", "active": True, "reason": "", "corrected_steps": 20, "host_waits": 21},
            "async+zb: 21 host waits for 20 corrected steps",
        ),
        ({"kind": "native", "active": False}, "async+zb: the release's own zero-bubble"),
        ({"kind": "none", "active": False}, "async+zb: zero-bubble did not run"),
    ],
    ids=["switched off at run time", "too few corrections", "extra host waits", "native off", "none"],
)
def test_zero_bubble_must_have_run(zero_bubble, expected):
    """A run where zero-bubble switched itself off equals classic async and would pass every token and count
    comparison: the runner's own report makes it FAIL."""
    runs = _runs()
    runs["async+zb"]["zero_bubble"] = zero_bubble
    failures, notes = compare(runs, WL, VOCAB)
    assert [f for f in failures if f.startswith(expected)] and notes == [], failures


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
    failures, _ = compare(runs, WL, VOCAB)
    assert [f for f in failures if f.startswith(expected)], failures


def test_native_zero_bubble_counts_as_in_effect():
    """A release whose zero-bubble is its own (0.19+): the zb-patch process may say "native", the runner reports the
    release's switch on."""
    runs = _runs()
    runs["async+zb"]["zb_patch_status"] = {"state": "native"}
    native = {"kind": "native", "active": True}
    runs["async+zb"]["zero_bubble"] = runs["async+fixes"]["zero_bubble"] = runs["async"]["zero_bubble"] = native
    assert compare(runs, WL, VOCAB) == ([], [])


def test_fixes_only_run_must_have_zb_patch_on_and_its_zero_bubble_off():
    """async+fixes is the release's own async path with zb-patch's fixes: zb-patch in effect, its zero-bubble not."""
    runs = _runs()
    runs["async+fixes"]["zero_bubble"] = dict(runs["async+zb"]["zero_bubble"])
    failures, _ = compare(runs, WL, VOCAB)
    assert failures == ["async+fixes: zb-patch's zero-bubble ran (ZB_PATCH_DISABLE should have left it out)"]
    runs = _runs()
    runs["async+fixes"]["zb_patch_status"] = {"state": "off"}
    failures, _ = compare(runs, WL, VOCAB)
    assert failures == ["async+fixes: zb-patch is 'off', not in effect (no reason)"]


def test_classic_async_is_reported_beside_not_judged():
    """Classic async without zb-patch can go wrong on the release's own defects (vLLM #37159 verifies stale drafts):
    every rule it breaks is a note naming it, never a failure; without it (it stopped) the verdict still stands on
    the judged runs."""
    runs = _runs()
    runs["async"]["tokens"]["2"][3] += 1
    runs["async"]["verifications"]["1"][1] = [12, 2, 0, False]
    _recount(runs["async"])
    failures, notes = compare(runs, WL, VOCAB)
    assert failures == [] and _judged(notes) == []
    assert notes[0].startswith(CLASSIC + "async vs sync: 2 tokens: first difference at output index 3")
    assert CLASSIC + "async vs sync: 1 at position 12: 2 of 2 drafts accepted vs 0 of 2" in notes
    assert any(n.startswith(CLASSIC + "async vs async+fixes: 1 accepted") for n in notes), notes
    del runs["async"]
    assert compare(runs, WL, VOCAB) == ([], [])


def test_no_verified_draft_fails():
    runs = _runs()
    for r in runs.values():
        r["verifications"] = {k: [] for k in r["verifications"]}
        _recount(r)
    failures, _ = compare(runs, WL, VOCAB)
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


def test_a_stopped_run_is_named_by_its_assertion_or_its_last_exception():
    """A classic async run that stops is reported by the line that says why, not by the tail of a stack dump."""
    from zb_patch.check.engine.run import stop_reason

    cuda = (
        "INFO start\n/pytorch/aten/src/ATen/native/cuda/Indexing.cu:1553: indexSelectLargeIndex: block: [0,0,0], "
        "thread: [0,0,0] Assertion `srcIndex < srcSelectDimSize` failed.\nRuntimeError: CUDA error: device-side "
        "assert triggered\n[rank0]: For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n frame #3: ..."
    )
    assert stop_reason(cuda).endswith("Assertion `srcIndex < srcSelectDimSize` failed.")
    cpu = "Traceback (most recent call last):\n  File x\nIndexError: index out of range in self\nEngineCore died\n"
    assert stop_reason(cpu) == "IndexError: index out of range in self"
    assert stop_reason("killed\n") == "killed"


@pytest.mark.parametrize(
    "graph_mode, ran, expected",
    [
        ("eager", {"cudagraph_mode": "CUDAGraphMode.NONE", "graphs_captured": 0}, []),
        (
            "full_decode_only",
            {"cudagraph_mode": "CUDAGraphMode.FULL_DECODE_ONLY", "graphs_captured": 6, "graph_replays": {"FULL": 30}},
            [],
        ),
        (
            "full_decode_only",
            {"cudagraph_mode": "CUDAGraphMode.FULL_DECODE_ONLY", "graphs_captured": 6, "graph_replays": {}},
            ["--graph-mode full_decode_only replayed no FULL graph while generating (graph_replays {})"],
        ),
        (
            "piecewise",
            {"cudagraph_mode": "CUDAGraphMode.PIECEWISE", "graphs_captured": 6, "graph_replays": {"FULL": 3}},
            ["--graph-mode piecewise replayed no PIECEWISE graph while generating (graph_replays {'FULL': 3})"],
        ),
        (
            "full_decode_only",
            {"cudagraph_mode": "CUDAGraphMode.PIECEWISE", "graphs_captured": 6},
            ["ran with cudagraph_mode PIECEWISE, not FULL_DECODE_ONLY (--graph-mode full_decode_only)"],
        ),
        (
            "piecewise",
            {"cudagraph_mode": "CUDAGraphMode.PIECEWISE", "graphs_captured": 0},
            ["--graph-mode piecewise captured no graph"],
        ),
        (
            "piecewise",
            {"cudagraph_mode": "CUDAGraphMode.NONE", "graphs_captured": 0},
            ["ran with cudagraph_mode NONE, not PIECEWISE (--graph-mode piecewise)"],
        ),
    ],
)
def test_a_graph_mode_verdict_needs_graphs_in_that_mode(graph_mode, ran, expected):
    """Rule 6: a release that falls back to eager (or to another cudagraph mode) must not pass as tested in the mode
    asked for; classic async, reported beside, is not checked."""
    runs = _runs()
    for res in runs.values():
        res.update(graph_mode=graph_mode, **ran)
    runs["async"].update(cudagraph_mode="CUDAGraphMode.NONE", graphs_captured=0)  # beside: never judged
    failures, _ = compare(runs, WL, VOCAB)
    assert failures == [f"{name}: {e}" for name in ("sync", "async+fixes", "async+zb") for e in expected]


def _graph_runs(graph_mode: str, applied: tuple[str, ...], **counted) -> dict[str, dict]:
    """Runs in ``graph_mode`` that replayed in it, zb-patch's ``applied`` patch ids in every judged run (sync too: the
    reference carries the fixes), and the child's counters ``counted`` (``host_drains``, ``task_group_updates``) in
    the judged async runs."""
    runs = _runs()
    items = [{"id": i, "verdict": "applied"} for i in applied] + [
        {"id": "piecewise-replay-without-host-drain", "verdict": "opt-in"}
    ]
    mode = {"piecewise": "PIECEWISE", "full_decode_only": "FULL_DECODE_ONLY"}[graph_mode]
    for name, res in runs.items():
        res.update(graph_mode=graph_mode, cudagraph_mode=f"CUDAGraphMode.{mode}", graphs_captured=6)
        res.update(graph_replays={"PIECEWISE" if graph_mode == "piecewise" else "FULL": 40})
        res.update(host_drains={}, task_group_updates={})
        if name != "async":
            res["zb_patch_status"] = {"state": "applied", "report": {"items": items}}
        if name in ("async+fixes", "async+zb"):
            res.update(copy.deepcopy(counted))
    return runs


ONCE, NO_DRAIN, FULL_ORDERING = (
    "piecewise-drain-once-per-step",
    "piecewise-replay-without-host-drain",
    "full-replay-ordered-on-device",
)


@pytest.mark.parametrize(
    "graph_mode, applied, counted",
    [
        ("piecewise", (ONCE,), {"host_drains": {"once": 40, "skipped": 400}}),
        ("piecewise", (ONCE,), {"host_drains": {"once": 40}}),  # no later piece, no drafter graph: nothing skipped
        ("piecewise", (NO_DRAIN,), {"host_drains": {"skipped": 440}}),
        ("piecewise", (ONCE, FULL_ORDERING), {"host_drains": {"once": 40, "skipped": 400}}),  # FULL: not in piecewise
        # the PIECEWISE patches act in PIECEWISE replays only: in FULL_DECODE_ONLY they count nothing
        ("full_decode_only", (ONCE,), {}),
        (
            "full_decode_only",
            (ONCE, FULL_ORDERING + "-mla-attn", FULL_ORDERING),
            {"host_drains": {"replaced": 40, "kept": 40}, "task_group_updates": {"update_attn_params": 40}},
        ),
    ],
    ids=["once", "once-nothing-skipped", "no-drain", "once+full-ordering", "full-default", "full-ordering"],
)
def test_graph_patches_that_counted_their_work_pass(graph_mode, applied, counted):
    assert compare(_graph_runs(graph_mode, applied, **counted), WL, VOCAB) == ([], [])


@pytest.mark.parametrize(
    "graph_mode, applied, counted, expected",
    [
        (
            "piecewise",
            (ONCE,),
            {"host_drains": {"skipped": 400}},
            f"{ONCE} applied, no host drain ran once per step (host_drains {{'skipped': 400}})",
        ),
        (
            "piecewise",
            (NO_DRAIN,),
            {"host_drains": {}},
            f"{NO_DRAIN} applied, host drains skipped 0 and run once per step 0 (want > 0 and 0; host_drains {{}})",
        ),
        (
            "piecewise",
            (NO_DRAIN,),
            {"host_drains": {"once": 40, "skipped": 400}},
            f"{NO_DRAIN} applied, host drains skipped 400 and run once per step 40 (want > 0 and 0; host_drains "
            "{'once': 40, 'skipped': 400})",
        ),
        (
            "full_decode_only",
            (ONCE, FULL_ORDERING),
            {"host_drains": {"kept": 40}, "task_group_updates": {"update_full_graph_params": 40}},
            f"{FULL_ORDERING} applied, host drains replaced 0 and task-group updates 40 (want both > 0; host_drains "
            "{'kept': 40}, task_group_updates {'update_full_graph_params': 40})",
        ),
        (
            "full_decode_only",
            (ONCE, FULL_ORDERING + "-mla-attn"),
            {"host_drains": {"replaced": 40}},
            f"{FULL_ORDERING} applied, host drains replaced 40 and task-group updates 0 (want both > 0; host_drains "
            "{'replaced': 40}, task_group_updates {})",
        ),
    ],
    ids=["once", "no-drain-nothing", "no-drain-drained", "full-ordering-no-boundary", "full-ordering-no-update"],
)
def test_an_applied_graph_patch_without_its_work_fails(graph_mode, applied, counted, expected):
    """Planted: the judged async runs report the patch applied and its counters short; the sync run (the patches act
    under async scheduling only) and classic async (beside, zb-patch off) are not held to them."""
    failures, _ = compare(_graph_runs(graph_mode, applied, **counted), WL, VOCAB)
    assert failures == [f"{name}: {expected}" for name in ("async+fixes", "async+zb")]


def test_a_graph_mode_run_without_replays_fails_before_its_patches_are_judged():
    """A run that replayed nothing in its mode fails on that alone (its patches had nothing to act on)."""
    runs = _graph_runs("piecewise", (ONCE,), host_drains={"once": 40})
    runs["async+zb"].update(graph_replays={}, host_drains={})
    runs["async"].update(graph_replays={})  # beside: not judged
    failures, _ = compare(runs, WL, VOCAB)
    assert failures == [
        "async+zb: --graph-mode piecewise replayed no PIECEWISE graph while generating (graph_replays {})"
    ]


def test_eager_runs_are_not_held_to_graph_counters():
    runs = _runs()
    for res in runs.values():
        res.update(graph_mode="eager", cudagraph_mode="CUDAGraphMode.NONE", graphs_captured=0, graph_replays={})
        res.update(host_drains={}, task_group_updates={})
        res["zb_patch_status"] = {"state": "applied", "report": {"items": [{"id": ONCE, "verdict": "applied"}]}}
    runs["async"]["zb_patch_status"] = {"state": "off"}
    assert compare(runs, WL, VOCAB) == ([], [])
