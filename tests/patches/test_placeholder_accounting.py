"""Output-placeholder accounting of the release's real vLLM ``AsyncScheduler`` under async scheduling + spec decode
+ KV-pressure preemption (vLLM #48245: ``assert request.num_output_placeholders >= 0`` in
``AsyncScheduler._update_request_with_output``; vllm-ascend #11313 / #11334: a preempted-then-resumed request whose
runner discard mask disagrees with the scheduler's ``is_prefill_chunk``), vllm-ascend 0.13 / 0.18, on the
runner-parity harness (tests/parity/runner_harness.py: the scheduler, its KV-cache manager and the runner's
``_update_states`` / ``_prepare_inputs`` / ``_bookkeeping_sync`` are the release's; the engine core's batch queue is
mirrored at the depth the release's executors give async scheduling).

:class:`Ledger` wraps the scheduler's ``schedule`` and ``update_from_output`` and checks, after every call, for every
unfinished request:

* ``num_output_placeholders >= 0``;
* ``num_output_placeholders`` equals what the steps still in flight added for it (each step's increment recorded
  when it was scheduled; a step leaves the flight once its output was processed): a preempted request keeps exactly
  its in-flight step's placeholders until that output is drained, and a resumed request starts from what is still
  in flight;
* a running request: ``0 <= num_computed_tokens - num_output_placeholders <= num_tokens - 1`` (the tokens whose KV
  is written and known, never past the last known token); a preempted one: ``num_computed_tokens == 0``;
* a resumed request has nothing of its life before the preemption in flight, and no such output changes it later;

and, per step, that the runner discarded a request's sampled tokens exactly when the scheduler gave it no
placeholders (the discard mask against ``is_prefill_chunk``, #11313 / #11334).

Three runs per release, EAGLE k = 3 on a small KV pool (many preemptions, among them preemptions of requests with a
step in flight, and their resumptions): the release's classic async without zb-patch, ZB_PATCH=1 with zero-bubble
disabled (the adapter's fixes only), ZB_PATCH=1 (zero-bubble). The planted run mirrors a batch queue of depth 3
(vLLM 0.18's engine core with async scheduling and pipeline parallelism >= 3: ``max_concurrent_batches`` is the PP
size, vllm/v1/executor/multiproc_executor.py:472): a request can be resumed while an output of its pre-preemption
life is still in flight, and the ledger must report #48245's divergence. The engine core's
``reset_prefix_cache(reset_running_requests=True)`` with a step in flight or after a drain broke the invariants in the
releases (vLLM #46066 / #42117, on vLLM's and vllm-ascend's recompute scheduler): fixed by
``reset-prefix-cache-in-flight``, reproduced with it disabled.

CI (va013 / va018): EAGLE, 600 iterations. ``E2E_BIG=1``: 2000 iterations, MTP on the MLA target, the classic reset
run.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest

from zb_patch.versions.fixes import reset_prefix_cache_in_flight

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
HARNESS = {"0.13": "runner013", "0.18": "runner018"}
FAMILY = npu_standin.detect_family()
if FAMILY not in HARNESS:
    pytest.skip(f"the runner harness covers vllm-ascend 0.13 / 0.18; this env has {FAMILY}", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parity"))

K, SEED = 3, 11
BIG = bool(os.environ.get("E2E_BIG"))
ITERATIONS = {"eagle": 2000 if BIG else 600, "mtp": 400}


def _shape(method="eagle"):
    from zb_patch.check.selftest.compat import EngineShape

    if method == "mtp":
        # the MLA target (tests/parity/mla_harness.py): 5 blocks of 128 for up to 4 requests of up to 512 tokens
        return EngineShape(num_spec_tokens=K, block_size=128, max_model_len=512, num_blocks=6, max_num_seqs=4)
    # 24 blocks of 16 for up to 8 requests of up to 192 tokens: KV pressure, preemption of decoding requests
    return EngineShape(num_spec_tokens=K, num_blocks=24)


class Ledger:
    """The scheduler's placeholder invariants, checked after every ``schedule`` / ``update_from_output``."""

    def __init__(self, sched) -> None:
        from vllm.v1.request import RequestStatus

        self.sched, self.RUNNING, self.PREEMPTED = sched, RequestStatus.RUNNING, RequestStatus.PREEMPTED
        self.step = 0
        self.flight: dict[int, dict[str, int]] = {}  # step -> {request: placeholders it added}, output not processed
        self.added: dict[int, dict[str, int]] = {}  # every step's increments
        self.step_of: dict[int, int] = {}  # id(scheduler output) -> step
        self.violations: list[str] = []
        self.resumed_at: dict[str, int] = {}  # request -> the step that last resumed it
        self.counts: Counter = Counter()
        self.reset_at: dict[str, tuple[int, list[int]]] = {}  # force-preempted -> (last step, its steps in flight)
        self._schedule, self._update = sched.schedule, sched.update_from_output
        self._reset = sched.reset_prefix_cache
        sched.schedule, sched.update_from_output = self.schedule, self.update_from_output
        sched.reset_prefix_cache = self.reset_prefix_cache

    def reset_prefix_cache(self, *args, **kwargs):
        """``reset_prefix_cache(reset_running_requests=True)`` (an engine-core utility call, between two steps):
        every running request is preempted and its in-flight output is to be dropped."""
        running = [r.request_id for r in self.sched.running]
        out = self._reset(*args, **kwargs)
        if kwargs.get("reset_running_requests", args[0] if args else False):
            kept = [r.request_id for r in self.sched.running]
            if kept:
                self.violations.append(f"reset after step {self.step}: {kept} still running")
        for rid in running:
            steps = [s for s, d in self.flight.items() if rid in d]
            self.reset_at[rid] = (self.step, steps)
            for s in steps:
                self.flight[s] = {k: v for k, v in self.flight[s].items() if k != rid}
            self.counts["force_preempted"] += 1
            self.counts["force_preempted_in_flight"] += bool(steps)
        self._check(f"reset after step {self.step}")
        return out

    def schedule(self, *args, **kwargs):
        before = {rid: r.num_output_placeholders for rid, r in self.sched.requests.items()}
        so = self._schedule(*args, **kwargs)
        self.step += 1
        added = {
            rid: self.sched.requests[rid].num_output_placeholders - before.get(rid, 0)
            for rid in so.num_scheduled_tokens
        }
        for rid in getattr(so, "preempted_req_ids", None) or ():
            self.counts["preempted"] += 1
            # #48245's precondition: preempted with an output still in flight
            self.counts["preempted_in_flight"] += self.sched.requests[rid].num_output_placeholders > 0
        for rid in so.scheduled_cached_reqs.resumed_req_ids:
            self.counts["resumed"] += 1
            self.resumed_at[rid] = self.step
            # what is in flight for a resumed request belongs to its life before the preemption: the release drains
            # it against the resumed request (#48245)
            stale = [s for s, d in self.flight.items() if rid in d]
            if stale or before.get(rid, 0):
                self.violations.append(
                    f"schedule {self.step}: {rid} resumed with {before.get(rid, 0)} placeholders, "
                    f"its steps {stale} in flight"
                )
        self.flight[self.step] = added
        self.added[self.step] = added
        self.step_of[id(so)] = self.step
        self._check(f"schedule {self.step}")
        return so

    def update_from_output(self, so, model_output):
        step = self.step_of.pop(id(so))
        # requests of this step resumed since: its output belongs to their life before the preemption
        stale = {
            rid: (r.num_computed_tokens, r.num_output_placeholders)
            for rid in self.flight[step]
            if self.resumed_at.get(rid, 0) > step and (r := self.sched.requests.get(rid)) is not None
        }
        # force-preempted requests: the output of a step scheduled before the reset must change nothing; the first
        # output of a step scheduled after it is the resumed request's own
        forced = {}
        for rid in self.added[step]:
            r = self.sched.requests.get(rid)
            if rid in self.reset_at and r is not None:
                forced[rid] = (r.num_computed_tokens, r.num_output_placeholders, r.num_output_tokens)
        try:
            if step % 2:  # the engine core passes it positionally; by keyword too, which the wrappers pass on
                return self._update(so, model_runner_output=model_output)
            return self._update(so, model_output)
        except AssertionError as e:  # the release's own assert (#48245)
            self.violations.append(f"update {step}: the scheduler raised AssertionError {e}")
            raise
        finally:
            del self.flight[step]
            for rid, (computed, placeholders, outputs) in forced.items():
                r = self.sched.requests.get(rid)
                if r is None or r.is_finished():
                    continue
                reset_step, steps = self.reset_at[rid]
                now = (r.num_computed_tokens, r.num_output_placeholders, r.num_output_tokens)
                if step in steps and now != (computed, placeholders, outputs):
                    self.violations.append(
                        f"update {step}: {rid}'s output of step {step}, in flight at reset_prefix_cache after step "
                        f"{reset_step}, changed (num_computed_tokens, num_output_placeholders, num_output_tokens) "
                        f"{(computed, placeholders, outputs)} -> {now}"
                    )
                elif step > reset_step and not steps and outputs == r.num_output_tokens and self.added[step][rid]:
                    self.violations.append(
                        f"update {step}: {rid}'s first output after reset_prefix_cache (after step {reset_step}, "
                        f"nothing in flight) dropped"
                    )
                if step > reset_step and self.added[step][rid]:
                    del self.reset_at[rid]
            for rid, (computed, placeholders) in stale.items():
                r = self.sched.requests.get(rid)
                if r is not None and (r.num_computed_tokens, r.num_output_placeholders) != (computed, placeholders):
                    self.violations.append(
                        f"update {step}: {rid}'s output of step {step} drained after its resume at step "
                        f"{self.resumed_at[rid]}: num_computed_tokens {computed} -> {r.num_computed_tokens}, "
                        f"num_output_placeholders {placeholders} -> {r.num_output_placeholders}"
                    )
            self._check(f"update {step}")

    def _check(self, where: str) -> None:
        for rid, r in self.sched.requests.items():
            if r.is_finished():
                continue
            p = r.num_output_placeholders
            want = sum(d.get(rid, 0) for d in self.flight.values())
            self.counts["checks"] += 1
            if p < 0:
                self.violations.append(f"{where}: {rid} num_output_placeholders {p} < 0")
            if p != want:
                self.violations.append(
                    f"{where}: {rid} num_output_placeholders {p}, in flight {want} ({r.status.name})"
                )
            if r.status == self.RUNNING:
                known = r.num_computed_tokens - p
                if not 0 <= known <= r.num_tokens - 1:
                    self.violations.append(
                        f"{where}: {rid} num_computed_tokens {r.num_computed_tokens} - placeholders {p} = {known} "
                        f"outside [0, num_tokens - 1 = {r.num_tokens - 1}]"
                    )
            elif r.status == self.PREEMPTED and r.num_computed_tokens != 0:
                self.violations.append(f"{where}: preempted {rid} num_computed_tokens {r.num_computed_tokens}")

    def discard_mismatches(self, records: dict) -> list[str]:
        """Rows whose runner discard decision disagrees with the scheduler's placeholders for that step."""
        out = []
        for step, rows in records.items():
            for rid, rec in rows.items():
                added = self.added.get(step, {}).get(rid)
                self.counts["rows"] += 1
                self.counts["discarded_rows"] += rec.discarded
                if added is None or rec.discarded != (added == 0):
                    out.append(f"step {step}: {rid} discarded={rec.discarded}, scheduler added {added} placeholders")
        return out


def _run(
    H,
    release,
    sess,
    monkeypatch,
    *,
    patched,
    disabled=(),
    depth=2,
    method="eagle",
    shape=None,
    reset_every=0,
    drain_before_reset=False,
    iterations=0,
):
    ledgers: list[Ledger] = []
    make_scheduler = H.make_scheduler

    def make(*args, **kwargs):
        sched = make_scheduler(*args, **kwargs)
        ledgers.append(Ledger(sched))
        return sched

    monkeypatch.setattr(H, "make_scheduler", make)
    if depth != 2:
        monkeypatch.setattr(H.Run, "iteration", _iteration_at_depth(H.Run.iteration, depth))
    if reset_every:
        monkeypatch.setattr(
            H.Run, "iteration", _iteration_with_resets(H.Run.iteration, reset_every, drain_before_reset)
        )
    shape = shape or _shape(method)
    iterations = iterations or ITERATIONS[method]
    specs = H.make_workload(SEED, shape, iterations)
    error = None
    try:
        with H.reference_kernels():
            res = H.run_mode(
                sess,
                shape,
                specs,
                iterations,
                release=release,
                seed=SEED,
                patched=patched,
                disabled=disabled,
                method=method,
            )
    except Exception as e:  # the release's assert or a later failure, or the harness's end checks (KV pool, requests)
        res, error = None, e
    finally:
        monkeypatch.undo()
    return res, ledgers[0], error


def _iteration_at_depth(iteration, depth):
    """``Run.iteration`` with a batch queue of ``depth`` (the harness's is 2, as vLLM's executors give async
    scheduling without pipeline parallelism): it returns without waiting for an output while the queue has room."""

    def it(run, abort_after):
        sched = run.scheduler
        if sched.has_requests() and len(run.queue) + 1 < depth:
            holding = {
                r.request_id: (len(r.spec_token_ids), r.num_computed_tokens) for r in sched.running if r.spec_token_ids
            }
            so = sched.schedule()
            run.step += 1
            run.preemptions += len(getattr(so, "preempted_req_ids", None) or ())
            run._count_edges(so, holding)
            executed = run.driver.execute_model(so, run.step)
            out = run.driver.sample_tokens(so) if executed else None
            run.queue.appendleft((out, so))
            return
        iteration(run, abort_after)

    return it


def _iteration_with_resets(iteration, every, drain):
    """``Run.iteration``, then, every ``every`` steps while a step is in flight and requests run, the engine core's
    utility call ``reset_prefix_cache(reset_running_requests=True)`` (what ``LLM.reset_prefix_cache`` / the
    ``/reset_prefix_cache`` endpoint, weight updates and ``sleep`` reach), as the busy loop makes it between two
    steps; with ``drain``, after the outputs in flight were processed, as ``EngineCoreProc.pause_scheduler(mode="keep",
    clear_cache=True)`` resets once the engine is idle (vLLM 0.18 ``core.py:1499-1538``): nothing is in flight."""
    last = [0]

    def it(run, abort_after):
        iteration(run, abort_after)
        if run.step - last[0] >= every and run.queue and run.scheduler.running:
            last[0] = run.step
            while drain and run.queue:
                run._finish_one(abort_after)
            if drain:  # by keyword, which the wrappers pass on
                run.scheduler.reset_prefix_cache(reset_running_requests=True)
            else:  # as the engine core passes it (vLLM 0.18 core.py:575, 0.13 :512)
                run.scheduler.reset_prefix_cache(True, False)

    return it


MODES = ("classic async, no zb-patch", "ZB_PATCH=1, zero-bubble disabled", "ZB_PATCH=1 (zero-bubble)")


@pytest.mark.parametrize(
    "method",
    ["eagle", pytest.param("mtp", marks=pytest.mark.skipif(not BIG, reason="E2E_BIG=1 (the MLA target: ~45 s)"))],
)
def test_placeholders_consistent_under_preemption(H, release, sess, monkeypatch, capsys, method):
    """The release's classic async, the adapter's fixes alone and zero-bubble: no invariant is ever broken, the
    runner discards exactly the rows the scheduler gave no placeholders, and the run preempts requests that have a
    step in flight and resumes them."""
    zb_ids = H.zero_bubble_and_fix_ids(release.ADAPTER)[0]
    runs = {
        MODES[0]: dict(patched=False),
        MODES[1]: dict(patched=True, disabled=zb_ids[:1]),
        MODES[2]: dict(patched=True),
    }
    lines, streams = [], {}
    for mode, kw in runs.items():
        res, ledger, error = _run(H, release, sess, monkeypatch, method=method, **kw)
        assert error is None, (mode, error, ledger.violations[:5])
        assert not ledger.violations, (mode, ledger.violations[:8])
        mismatches = ledger.discard_mismatches(res.records)
        assert not mismatches, (mode, mismatches[:8])
        c = ledger.counts
        assert bool(res.zb.get("active")) == (mode == MODES[2]), (mode, res.zb)
        assert res.spec_steps > 0 and 0 < res.accepted < res.drafted
        assert c["preempted_in_flight"] >= 5 and c["resumed"] >= 5, (mode, dict(c))
        assert c["discarded_rows"] > 0
        streams[mode] = res.streams
        lines.append(
            f"{mode}: {res.steps} steps, {c['preempted']} preemptions ({c['preempted_in_flight']} with a step in "
            f"flight), {c['resumed']} resumed, {c['checks']} request checks, {c['rows']} rows "
            f"({c['discarded_rows']} discarded), {res.seconds} s"
        )
    differ = {
        m: sorted(r for r in streams[m] if streams[m][r] != streams[MODES[1]].get(r)) for m in (MODES[0], MODES[2])
    }
    lines.append(f"requests whose tokens differ from the fixes-only run: {differ}")
    # zero-bubble changes no token of this workload
    assert streams[MODES[1]] == streams[MODES[2]]
    with capsys.disabled():
        print(f"\n{release.ADAPTER.id} {method} k={K}, batch queue 2:\n  " + "\n  ".join(lines))


def test_planted_batch_queue_depth_three_breaks_the_accounting(H, release, sess, monkeypatch, capsys):
    """Planted: a batch queue of depth 3 (vLLM 0.18's engine core with async scheduling and PP >= 3; not reachable
    on vLLM 0.13, whose executors give async scheduling 2 at any PP size) lets a request be resumed while an output of
    its pre-preemption life is in flight. The ledger must see #48245's divergence: the stale output is drained
    against the resumed request."""
    res, ledger, error = _run(H, release, sess, monkeypatch, patched=False, depth=3, iterations=240)
    with capsys.disabled():
        print(f"\n{release.ADAPTER.id} planted batch queue 3: {dict(ledger.counts)}; error: {error!r}")
        for v in ledger.violations[:6]:
            print("  ", v)
    resumed = [v for v in ledger.violations if " resumed with " in v and " resumed with 0 " not in v]
    drained = [v for v in ledger.violations if "drained after its resume" in v]
    assert resumed and drained, ledger.violations[:8]


RESET_FIX = reset_prefix_cache_in_flight.ID
RESETS = ("in-flight", "drained")


def _reset_run(H, release, sess, monkeypatch, *, reset, recompute=False, **kw):
    if recompute:  # vllm-ascend's AsyncRecomputeScheduler (the PD decode node's; here without a KV connector)
        from vllm_ascend.core.recompute_scheduler import AsyncRecomputeScheduler

        make = H.make_scheduler
        monkeypatch.setattr(H, "make_scheduler", lambda *a: make(*a, cls=AsyncRecomputeScheduler))
    return _run(
        H,
        release,
        sess,
        monkeypatch,
        reset_every=40,
        drain_before_reset=reset == "drained",
        iterations=ITERATIONS["eagle"] if BIG else 120,
        **kw,
    )


def _reset_violations(ledger) -> dict[str, list[str]]:
    v = ledger.violations
    return {
        # #46066: the output in flight at the reset changed the resumed request's counters
        "in flight changed": [x for x in v if "in flight at reset_prefix_cache" in x],
        "negative placeholders": [x for x in v if "num_output_placeholders -" in x and "< 0" in x],
        # #42117: nothing was in flight, and the resumed life's first output was discarded
        "first output dropped": [x for x in v if "first output after reset_prefix_cache" in x],
    }


@pytest.mark.parametrize("recompute", [False, True], ids=["Scheduler", "RecomputeScheduler"])
@pytest.mark.parametrize("reset", RESETS)
def test_reset_prefix_cache_keeps_the_accounting(H, release, sess, monkeypatch, capsys, reset, recompute):
    """``reset_prefix_cache(reset_running_requests=True)`` every 40 steps, ZB_PATCH=1: with a step in flight (the
    busy loop's utility call between two steps) and after the engine drained (``pause_scheduler(mode="keep",
    clear_cache=True)`` resets at idle), on vLLM's ``AsyncScheduler`` and on vllm-ascend's
    ``AsyncRecomputeScheduler``: every invariant holds, no output is lost, the force-preempted requests resume."""
    res, ledger, error = _reset_run(H, release, sess, monkeypatch, reset=reset, recompute=recompute, patched=True)
    c = ledger.counts
    with capsys.disabled():
        print(f"\n{release.ADAPTER.id} reset_prefix_cache ({reset}, {type(ledger.sched).__name__}): {dict(c)}")
    assert error is None and not ledger.violations, (error, ledger.violations[:8])
    assert c["force_preempted"] > 0 and c["resumed"] >= c["force_preempted"] / 2, dict(c)
    assert (c["force_preempted_in_flight"] > 0) == (reset == "in-flight"), dict(c)
    assert res.zb.get("active")
    # the scheduler's own update_from_output was the fix's (vllm-ascend's copy on the recompute scheduler)
    from zb_patch.registry import MARK_ID

    assert getattr(ledger._update.__func__, MARK_ID, None) == RESET_FIX + ("-recompute" if recompute else "-update")


@pytest.mark.parametrize("recompute", [False, True], ids=["Scheduler", "RecomputeScheduler"])
@pytest.mark.parametrize("reset", RESETS)
def test_reset_prefix_cache_without_the_fix_breaks_it(H, release, sess, monkeypatch, capsys, reset, recompute):
    """The release's own defect, reproduced with ``ZB_PATCH_DISABLE=reset-prefix-cache-in-flight``: with a step in
    flight, ``update_from_output`` subtracts the stale output's rejected drafts from the resumed request's counters
    before the discard (vLLM #46066: placeholders below 0); with nothing in flight, the discard flag drops the first
    output of the resumed life (vLLM #42117)."""
    res, ledger, error = _reset_run(
        H, release, sess, monkeypatch, reset=reset, recompute=recompute, patched=True, disabled=(RESET_FIX,)
    )
    found = _reset_violations(ledger)
    with capsys.disabled():
        print(
            f"\n{release.ADAPTER.id} without {RESET_FIX} ({reset}, {type(ledger.sched).__name__}): "
            f"{ {k: len(x) for k, x in found.items()} }; error {error!r}"
        )
    if reset == "in-flight":
        assert found["in flight changed"] and found["negative placeholders"], ledger.violations[:8]
    else:
        assert found["first output dropped"], ledger.violations[:8]
        assert not found["in flight changed"], found["in flight changed"][:4]


@pytest.mark.skipif(not BIG, reason="E2E_BIG=1")
def test_release_reset_prefix_cache_classic(H, release, sess, monkeypatch, capsys):
    """The same defect in the release's classic async without zb-patch (the scheduler is the release's)."""
    res, ledger, error = _reset_run(H, release, sess, monkeypatch, reset="in-flight", patched=False)
    found = _reset_violations(ledger)
    assert found["in flight changed"] and found["negative placeholders"], ledger.violations[:8]


def test_planted_discard_mask_ignores_resumed_rows(H, release, sess, monkeypatch, capsys):
    """Planted: the runner's discard mask leaves out the rows of requests resumed in the step (the class of vllm-ascend
    #11313 / #11334: the runner's prompt boundary of a resumed request disagrees with the scheduler's
    ``is_prefill_chunk``). A resumed request's partial prefill chunk then returns a token the scheduler gave no
    placeholder for: the ledger sees the discard mismatch and the release's own assert fires (#11296's
    ``num_output_placeholders >= 0``)."""
    import functools

    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    original = NPUModelRunner.__dict__["_prepare_inputs"]

    @functools.wraps(original)
    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        out = original(self, scheduler_output, *args, **kwargs)
        resumed = {self.input_batch.req_id_to_index[r] for r in scheduler_output.scheduled_cached_reqs.resumed_req_ids}
        kept = [int(i) for i in self.discard_request_indices.np[: self.num_discarded_requests] if int(i) not in resumed]
        self.discard_request_indices.np[: len(kept)] = kept
        self.num_discarded_requests = len(kept)
        return out

    monkeypatch.setattr(NPUModelRunner, "_prepare_inputs", _prepare_inputs)
    res, ledger, error = _run(H, release, sess, monkeypatch, patched=False)
    with capsys.disabled():
        print(f"\n{release.ADAPTER.id} planted discard mask: error {error!r}")
        for v in ledger.violations[:4]:
            print("  ", v)
    assert isinstance(error, AssertionError) and "num_output_placeholders" in "".join(ledger.violations)
    assert any("the scheduler raised AssertionError" in v for v in ledger.violations), ledger.violations[:8]


# -- exact-counts-after-early-output: already_exact on the release's real runner, request states and scheduler output,
# built for a step scheduled after the engine core processed the previous step's output. Only a request the previous
# step scheduled with drafts, at a row of the previous batch, whose count from the scheduler is below its count at that
# step's start plus the tokens that step scheduled, is exact (whole runs with outputs processed early:
# tests/patches/test_runner_parity.py; in the engine: tests/engine/test_engine.py)


def _cached_request(H, req_id, num_computed_tokens, drafts):
    """A request the runner holds, with the drafts the previous step scheduled for it."""
    state = H.request_state(req_id, list(range(1, 9)), num_computed_tokens)
    state.prev_num_draft_len = drafts
    return state


def test_only_rows_whose_count_already_lost_the_rejected_drafts(H, sess):
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    from zb_patch.check.selftest.compat import EngineShape
    from zb_patch.versions.fixes.exact_counts_after_early_output import already_exact

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
    runner.requests.update({rid: _cached_request(H, rid, start, drafts) for rid, (start, drafts, *_) in cases.items()})
    runner.input_batch.prev_req_id_to_index = {rid: c[2] for rid, c in cases.items() if c[2] is not None}
    prev_scheduled = {rid: c[3] for rid, c in cases.items() if c[3] is not None}
    so = SchedulerOutput.make_empty()
    so.scheduled_cached_reqs = CachedRequestData.make_empty()
    so.scheduled_cached_reqs.req_ids = list(cases)
    so.scheduled_cached_reqs.num_computed_tokens = [c[4] for c in cases.values()]

    assert already_exact(runner, so, prev_scheduled) == {4: 2, 5: 2}


def test_the_fix_marks_the_exact_rows_and_reports_their_drafts_accepted(H, sess):
    """The fix's two wrappers on the release's real runner: the worker's step notes what it scheduled, the next step
    marks the rows whose count is already exact (as already_exact finds them), and the release's
    _get_valid_sampled_token_count then reports every draft accepted there, the other rows as the release read them;
    a marked row past the release's counts (none to read: no previous sampled tokens) is left out."""
    import types

    import torch
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from zb_patch.check.selftest.compat import EngineShape
    from zb_patch.versions.fixes import exact_counts_after_early_output as exact_counts

    shape = EngineShape(num_spec_tokens=2)
    vc = H.build_config(sess, shape)
    runner = H.make_runner(vc, H.kv_cache_config(vc, shape))
    # (runner's count at step N's start, drafts step N scheduled, previous row, count now): step N scheduled 1 + 2
    cases = {"a": (20, 2, 0, 23), "b": (30, 2, 1, 31), "c": (40, 2, 2, 42)}
    runner.requests.update({rid: _cached_request(H, rid, c[0], c[1]) for rid, c in cases.items()})
    runner.input_batch.prev_req_id_to_index = {rid: c[2] for rid, c in cases.items()}

    steps = []

    def release_execute_model(worker, scheduler_output, *args, **kwargs):
        steps.append((worker, scheduler_output, args, kwargs, dict(runner.__dict__[exact_counts.EXACT_ROWS])))
        return f"output {len(steps)}"

    execute_model = exact_counts.make_worker_execute_model(release_execute_model)
    worker = types.SimpleNamespace(model_runner=runner)
    step_n = SchedulerOutput.make_empty()
    step_n.num_scheduled_tokens = {rid: 3 for rid in cases}
    step_next = SchedulerOutput.make_empty()
    step_next.scheduled_cached_reqs = CachedRequestData.make_empty()
    step_next.scheduled_cached_reqs.req_ids = list(cases)
    step_next.scheduled_cached_reqs.num_computed_tokens = [c[3] for c in cases.values()]
    step_next.num_scheduled_tokens = {rid: 3 for rid in cases}

    assert execute_model(worker, step_n) == "output 1"  # no step before it: nothing exact
    assert execute_model(worker, step_next) == "output 2"
    assert [(w, so, a, k, exact) for w, so, a, k, exact in steps] == [
        (worker, step_n, (), {}, {}),
        (worker, step_next, (), {}, {1: 2, 2: 2}),
    ]

    count = exact_counts.make_get_valid_sampled_token_count(GPUModelRunner._get_valid_sampled_token_count)
    runner.input_batch.prev_sampled_token_ids = torch.zeros(3, 1, dtype=torch.int64)
    runner.valid_sampled_token_count_event = types.SimpleNamespace(synchronize=lambda: None)  # the host copy is done
    runner.valid_sampled_token_count_cpu = torch.tensor([3, 1, 2, 7])
    assert count(runner) == [3, 3, 3]  # rows 1, 2: 1 + both drafts; row 0 the release's
    runner.input_batch.prev_sampled_token_ids = None
    runner.__dict__[exact_counts.EXACT_ROWS] = {0: 2}
    assert count(runner) == []
