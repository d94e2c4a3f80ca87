"""Engine loops around vLLM's real scheduler, and the step-by-step comparison of the modes.

The async modes run in lock-step, one engine iteration each per round, with vLLM's
``EngineCore.step_with_batch_queue`` order (batch queue of 2): schedule step N+1 and launch it,
*then* wait for step N's output and feed it to ``scheduler.update_from_output`` — so the runner of
step N+1 never has step N's accepted counts unless it waits for them.  Aborts are applied right
before ``update_from_output`` (``_process_aborts_queue``).  The ``plain`` mode runs
``EngineCore.step``: schedule, execute, sample, update, hand the drafts back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import compat
from .runner import ASYNC_MODES, COMPARED_FIELDS, PLAIN, SYNC, RowRec, Runner
from .workload import RequestSpec


@dataclass
class Divergence:
    k: int
    mode: str
    step: int
    req_id: str
    field: str
    want: Any
    got: Any

    def as_dict(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "mode": self.mode,
            "step": self.step,
            "request": self.req_id,
            "field": self.field,
            "want": _short(self.want),
            "got": _short(self.got),
        }


def _short(v: Any) -> Any:
    if isinstance(v, tuple) and len(v) > 12:
        return list(v[:12]) + ["..."]
    if isinstance(v, tuple):
        return list(v)
    return v


@dataclass
class ModeRun:
    mode: str
    scheduler: Any
    runner: Runner
    shape: compat.EngineShape
    queue: deque = field(default_factory=deque)
    step: int = 0  # schedule() calls
    completed_step: int = 0  # highest step whose output the host has received
    iterations: int = 0
    streams: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    pending_aborts: list[str] = field(default_factory=list)
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    preemptions: int = 0
    crashed: str | None = None

    # -- one EngineCore iteration ------------------------------------------------------------------
    def add(self, specs: list[RequestSpec]) -> None:
        for s in specs:
            self.scheduler.add_request(
                compat.make_request(
                    s.req_id,
                    list(s.prompt),
                    max_tokens=s.max_tokens,
                    stop_token_ids=list(s.stop_token_ids),
                    arrival_time=float(s.arrival),
                    block_size=self.shape.block_size,
                )
            )
            self.streams[s.req_id] = []

    def step_with_batch_queue(self, abort_after: dict[str, int]) -> None:
        self.iterations += 1
        sched, runner = self.scheduler, self.runner
        if sched.has_requests():
            so = sched.schedule()
            self.step += 1
            self.preemptions += compat.preempted_count(so)
            executed = runner.execute_model(so, self.step)
            out = runner.sample_tokens(so) if executed else None
            self.queue.appendleft((out, so, self.step))
            if len(self.queue) < 2 and (executed or sched.has_requests()):
                return
        elif not self.queue:
            return
        self._finish_one(abort_after)

    def step_sync(self, abort_after: dict[str, int]) -> None:
        """``EngineCore.step`` (non-async scheduling), for the plain mode."""
        self.iterations += 1
        sched, runner = self.scheduler, self.runner
        if not sched.has_requests():
            return
        so = sched.schedule()
        self.step += 1
        self.preemptions += compat.preempted_count(so)
        executed = runner.execute_model(so, self.step)
        out = runner.sample_tokens(so) if executed else None
        self.queue.appendleft((out, so, self.step))
        self._finish_one(abort_after)
        drafts = runner.take_draft_token_ids()
        if drafts is not None:
            sched.update_draft_token_ids(drafts)

    def drain(self, abort_after: dict[str, int]) -> None:
        while self.queue:
            self._finish_one(abort_after)

    def _finish_one(self, abort_after: dict[str, int]) -> None:
        out, so, step = self.queue.pop()
        model_output = out.get_output() if out is not None else compat.empty_model_runner_output()
        if self.pending_aborts:
            live = [r for r in self.pending_aborts if r in self.scheduler.requests]
            if live:
                compat.abort_requests(self.scheduler, live)
                self.aborted.update(live)
            self.pending_aborts.clear()
        eco = self.scheduler.update_from_output(so, model_output)
        self.completed_step = step
        d, t, a = compat.spec_stats(eco)
        self.drafts += d
        self.draft_tokens += t
        self.accepted += a
        for rid, toks, fin in compat.iter_outputs(eco):
            stream = self.streams.setdefault(rid, [])
            stream.extend(toks)
            if fin is not None:
                self.finish[rid] = fin
            else:
                lim = abort_after.get(rid)
                if lim is not None and len(stream) >= lim and rid not in self.aborted:
                    self.pending_aborts.append(rid)

    def idle(self) -> bool:
        return not self.queue and not self.scheduler.has_requests()


def compare_records(k: int, ref: ModeRun, other: ModeRun, upto: int, out: list[Divergence], limit: int) -> int:
    """Compare the per-step row records of ``other`` with ``ref`` for steps <= upto; drop them."""
    n = 0
    rr, orr = ref.runner.records, other.runner.records
    for step in sorted(s for s in orr if s <= upto):
        a = rr.get(step, {})
        b = orr.pop(step)
        for rid in sorted(set(a) | set(b)):
            ra, rb = a.get(rid), b.get(rid)
            if ra is None or rb is None:
                n += 1
                if len(out) < limit:
                    out.append(Divergence(k, other.mode, step, rid, "scheduled", ra is not None, rb is not None))
                continue
            for f in COMPARED_FIELDS:
                va, vb = getattr(ra, f), getattr(rb, f)
                if va != vb:
                    n += 1
                    if len(out) < limit:
                        out.append(Divergence(k, other.mode, step, rid, f, va, vb))
            for name, (want, got) in rb.checks.items():
                n += 1
                if len(out) < limit:
                    out.append(Divergence(k, other.mode, step, rid, name, want, got))
    return n


def prune(run: ModeRun, upto: int) -> None:
    for s in [s for s in run.runner.records if s <= upto]:
        del run.runner.records[s]


@dataclass
class KResult:
    k: int
    runs: dict[str, ModeRun]
    divergences: int
    examples: list[Divergence]
    stream_mismatches: int
    invariant_failures: list[str]


def run_k(
    session: compat.Session,
    shape: compat.EngineShape,
    specs: list[RequestSpec],
    iterations: int,
    *,
    seed: int,
    modes: tuple[str, ...],
    plants: frozenset[str],
    plain: bool,
    progress: Callable[[int], None] | None = None,
    limit: int = 20,
    correction: str = "cpu",
) -> KResult:
    vc_async = compat.build_vllm_config(session, shape, async_scheduling=True)
    runs = {
        m: ModeRun(
            m,
            compat.make_scheduler(vc_async, shape, async_scheduling=True),
            Runner(m, shape, seed=seed, plants=plants if m != SYNC else frozenset(), count_base=correction),
            shape,
        )
        for m in modes
    }
    by_arrival: dict[int, list[RequestSpec]] = {}
    for s in specs:
        by_arrival.setdefault(s.arrival, []).append(s)
    abort_after = {s.req_id: s.abort_after for s in specs if s.abort_after is not None}
    examples: list[Divergence] = []
    divergences = 0
    ref = runs[SYNC]
    others = [runs[m] for m in modes if m != SYNC]
    max_iters = iterations + 4 * iterations + 2000
    it = 0
    while it < max_iters:
        arrivals = by_arrival.get(it, []) if it < iterations else []
        live = [r for r in runs.values() if r.crashed is None]
        for r in live:
            try:
                r.add(arrivals)
                r.step_with_batch_queue(abort_after)
            except Exception as e:  # a mode that crashes diverged
                r.crashed = f"iteration {it}: {type(e).__name__}: {e}"
                divergences += 1
                if len(examples) < limit:
                    examples.append(
                        Divergence(shape.num_spec_tokens, r.mode, r.step, "-", "crash", "no crash", r.crashed)
                    )
                if r is ref:
                    raise
        upto = min(r.completed_step for r in runs.values() if r.crashed is None)
        for o in others:
            if o.crashed is None:
                divergences += compare_records(shape.num_spec_tokens, ref, o, upto, examples, limit)
        prune(ref, upto)
        it += 1
        if progress is not None and it <= iterations:
            progress(1)
        if it >= iterations and all(r.idle() for r in runs.values() if r.crashed is None):
            break
    for r in runs.values():
        if r.crashed is None:
            r.drain(abort_after)

    if plain:
        vc_sync = compat.build_vllm_config(session, shape, async_scheduling=False)
        p = ModeRun(
            PLAIN, compat.make_scheduler(vc_sync, shape, async_scheduling=False), Runner(PLAIN, shape, seed=seed), shape
        )
        it = 0
        while it < max_iters:
            if it < iterations:
                p.add(by_arrival.get(it, []))
            p.step_sync(abort_after)
            p.runner.records.clear()
            it += 1
            if progress is not None and it <= iterations:
                progress(1)
            if it >= iterations and p.idle():
                break
        runs[PLAIN] = p

    stream_mismatches, inv = _check_streams(shape.num_spec_tokens, runs, specs, examples, limit)
    for r in runs.values():
        free = r.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        if r.crashed is None and r.idle() and free != shape.num_blocks - 1:
            inv.append(f"k={shape.num_spec_tokens} {r.mode}: KV pool not returned ({free}/{shape.num_blocks - 1} free)")
        if r.crashed is None and not r.idle():
            inv.append(f"k={shape.num_spec_tokens} {r.mode}: requests left after the drain")
    return KResult(shape.num_spec_tokens, runs, divergences, examples, stream_mismatches, inv)


def _check_streams(
    k: int, runs: dict[str, ModeRun], specs: list[RequestSpec], examples: list[Divergence], limit: int
) -> tuple[int, list[str]]:
    ref = runs[SYNC]
    bad = 0
    inv: list[str] = []
    for s in specs:
        want = ref.streams.get(s.req_id, [])
        for m, r in runs.items():
            if m == SYNC or r.crashed is not None:
                continue
            got = r.streams.get(s.req_id, [])
            if m == PLAIN and (s.req_id in ref.aborted or s.req_id in r.aborted):
                n = min(len(want), len(got))
                same = want[:n] == got[:n]
            else:
                same = want == got and ref.finish.get(s.req_id) == r.finish.get(s.req_id)
            if not same:
                bad += 1
                if len(examples) < limit:
                    examples.append(
                        Divergence(
                            k,
                            m,
                            -1,
                            s.req_id,
                            "token stream",
                            (tuple(want), ref.finish.get(s.req_id)),
                            (tuple(got), r.finish.get(s.req_id)),
                        )
                    )
    return bad, inv


__all__ = ["ASYNC_MODES", "Divergence", "KResult", "ModeRun", "RowRec", "run_k"]
