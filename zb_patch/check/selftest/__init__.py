"""``zb-patch selftest``: prove zero-bubble bookkeeping against the installed vLLM's real scheduler.

The same seeded workload is driven through vLLM's real ``AsyncScheduler`` (with its real KV-cache
manager) four times, by four runners on a simulated device (see :mod:`.runner`): the classic
synchronous-count runner (reference), zero-bubble, zero-bubble with Ascend's exact CPU seq_lens,
and — for the final token streams only — vLLM's non-async ``Scheduler``.  Every step the zero-bubble
runners must produce the reference's counts, positions, seq_lens, slot mapping, input ids, sampled
tokens, drafted / accepted counts and backup tokens; every request the same token stream.  Any
difference is a divergence and the exit status is 1.  docs/selftest.md describes it in full.

Entry points: :func:`run_cli` (``zb-patch selftest``), :func:`run_selftest` (library / tests), and
``python -m zb_patch.check.selftest`` (adds developer options: modes, k values, planted bugs).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from zb_patch.detect import package

SCHEMA = "zb-patch-selftest/1"
DEFAULT_KS = (1, 2, 3, 4)


@dataclass
class ModeSummary:
    mode: str
    steps: int = 0
    iterations: int = 0
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    preemptions: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    coverage: dict[str, int] = field(default_factory=dict)
    waits: dict[str, int] = field(default_factory=dict)
    blocking_waits: dict[str, int] = field(default_factory=dict)
    crashed: list[str] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def per_step(self, kind: str, blocking: bool = False) -> float:
        src = self.blocking_waits if blocking else self.waits
        return src.get(kind, 0) / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "iterations": self.iterations,
            "requests": self.requests,
            "finished": self.finished,
            "aborted": self.aborted,
            "tokens": self.tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 6),
            "preemptions": self.preemptions,
            "finish_reasons": dict(sorted(self.finish_reasons.items())),
            "coverage": dict(sorted(self.coverage.items())),
            "accepted_count_syncs_per_step": {
                "before_input_prep": round(self.per_step("accepted:before-prep"), 4),
                "before_attention_metadata": round(self.per_step("accepted:cpu-seq-lens"), 4),
                "deferred_after_launch": round(self.per_step("accepted:deferred"), 4),
            },
            "blocking_accepted_count_syncs_per_step": {
                "before_input_prep": round(self.per_step("accepted:before-prep", True), 4),
                "before_attention_metadata": round(self.per_step("accepted:cpu-seq-lens", True), 4),
                "deferred_after_launch": round(self.per_step("accepted:deferred", True), 4),
            },
            "waits": dict(sorted(self.waits.items())),
            "crashed": self.crashed,
        }


@dataclass
class Report:
    vllm: str
    vllm_ascend: str | None
    seed: int
    steps: int
    ks: tuple[int, ...]
    plants: tuple[str, ...]
    modes: dict[str, ModeSummary]
    divergences: int
    stream_mismatches: int
    invariant_failures: list[str]
    examples: list[dict[str, Any]]
    notes: list[str]
    seconds: float
    correction: str = "cpu"

    @property
    def total_divergences(self) -> int:
        return self.divergences + self.stream_mismatches + len(self.invariant_failures)

    @property
    def ok(self) -> bool:
        return self.total_divergences == 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "ok": self.ok,
            "vllm": self.vllm,
            "vllm_ascend": self.vllm_ascend,
            "seed": self.seed,
            "steps_requested": self.steps,
            "num_spec_tokens": list(self.ks),
            "planted_bugs": list(self.plants),
            "device_correction": self.correction,
            "modes": {m: s.as_dict() for m, s in self.modes.items()},
            "divergences": self.total_divergences,
            "divergences_detail": {
                "per_step_fields": self.divergences,
                "token_streams": self.stream_mismatches,
                "invariants": self.invariant_failures,
            },
            "examples": self.examples,
            "notes": self.notes,
            "seconds": round(self.seconds, 2),
        }


class _Progress:
    """A one-line progress bar on stderr (only on a terminal, never with --quiet)."""

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.total, self.enabled, self.done = max(total, 1), enabled, 0
        self.stream = stream or sys.stderr
        self._last = -1.0

    def __call__(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.2 and self.done < self.total:
            return
        self._last = now
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        self.stream.write(f"\rzb-patch selftest [{bar:<30}] {frac * 100:5.1f}%")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def run_selftest(
    *,
    steps: int = 2000,
    seed: int = 0,
    ks: tuple[int, ...] = DEFAULT_KS,
    modes: tuple[str, ...] | None = None,
    plants: tuple[str, ...] = (),
    plain: bool = True,
    correction: str = "cpu",
    triton: bool = False,
    progress: bool = False,
) -> Report:
    """Run the harness in this process (it installs and removes process-global vLLM state: see
    :mod:`.compat`; prefer a fresh process).  ``steps`` engine iterations of arrivals in total,
    split over the ``ks`` values; each run then drains its requests."""
    return run_many(
        [dict(steps=steps, seed=seed, ks=ks, modes=modes, plants=plants, plain=plain, correction=correction)],
        triton=triton,
        progress=progress,
    )[0]


def run_many(runs: list[dict[str, Any]], *, triton: bool = False, progress: bool = False) -> list[Report]:
    """Several self-test runs (keyword sets of :func:`run_selftest`) in one vLLM session (configs are
    built once per engine shape) — what the test suite uses to keep its cost down."""
    from . import compat

    reports: list[Report] = []
    vocab_size = compat.EngineShape(num_spec_tokens=1).vocab_size
    with (
        compat.kernel_backend(triton),
        compat.stdout_to_stderr(),
        compat.quiet_vllm_logs(),
        compat.vllm_session(vocab_size=vocab_size) as session,
    ):
        for kw in runs:
            reports.append(_run_in_session(session, progress=progress, **kw))
    return reports


def _run_in_session(
    session: Any,
    *,
    steps: int = 2000,
    seed: int = 0,
    ks: tuple[int, ...] = DEFAULT_KS,
    modes: tuple[str, ...] | None = None,
    plants: tuple[str, ...] = (),
    plain: bool = True,
    correction: str = "cpu",
    progress: bool = False,
) -> Report:
    from . import compat
    from .engine import run_k
    from .runner import ASYNC_MODES, PLANTS, SYNC, ZB, ZB_ASCEND
    from .workload import make_workload

    unknown = [p for p in plants if p not in PLANTS]
    if unknown:
        raise ValueError(f"unknown planted bug(s) {unknown}; known: {sorted(PLANTS)}")
    modes = tuple(modes or ASYNC_MODES)
    if SYNC not in modes:
        modes = (SYNC, *modes)
    bad = [m for m in modes if m not in ASYNC_MODES]
    if bad:
        raise ValueError(f"unknown mode(s) {bad}; known: {list(ASYNC_MODES)} (plain runs with plain=True)")
    if not ks:
        raise ValueError("no num_spec_tokens values")
    t0 = time.monotonic()
    per_k = max(1, steps // len(ks))
    bar = _Progress(per_k * len(ks) * (2 if plain else 1), progress)
    summaries: dict[str, ModeSummary] = {}
    divergences = stream_mismatches = 0
    invariants: list[str] = []
    examples: list[dict[str, Any]] = []
    notes: list[str] = list(session.notes)
    for k in ks:
        shape = compat.EngineShape(num_spec_tokens=k)
        specs = make_workload(seed, shape, per_k, tag=f"k{k}-")
        prompt_len = {s.req_id: len(s.prompt) for s in specs}
        res = run_k(
            session,
            shape,
            specs,
            per_k,
            seed=seed,
            modes=modes,
            plants=frozenset(plants),
            plain=plain,
            progress=bar,
            correction=correction,
        )
        divergences += res.divergences
        stream_mismatches += res.stream_mismatches
        invariants.extend(res.invariant_failures)
        examples.extend(d.as_dict() for d in res.examples[: max(0, 20 - len(examples))])
        for m, r in res.runs.items():
            s = summaries.setdefault(m, ModeSummary(m))
            s.steps += r.runner.steps_executed
            s.iterations += r.iterations
            s.requests += len(specs)
            s.finished += len(r.finish)
            s.aborted += len(r.aborted)
            s.tokens += sum(len(v) for v in r.streams.values())
            s.drafted += r.draft_tokens
            s.accepted += r.accepted
            s.preemptions += r.preemptions
            for rid, fin in r.finish.items():
                s.finish_reasons[fin] = s.finish_reasons.get(fin, 0) + 1
                if fin == "length" and prompt_len[rid] + len(r.streams.get(rid, ())) >= shape.max_model_len:
                    s.coverage["max_model_len_reached"] = s.coverage.get("max_model_len_reached", 0) + 1
            for key, c in r.runner.coverage.items():
                s.coverage[key] = s.coverage.get(key, 0) + c
            for kind, c in r.runner.dev.waits.items():
                s.waits[kind] = s.waits.get(kind, 0) + c
            for kind, c in r.runner.dev.blocking_waits.items():
                s.blocking_waits[kind] = s.blocking_waits.get(kind, 0) + c
            if r.crashed:
                s.crashed.append(f"k={k}: {r.crashed}")
    bar.close()
    order = [m for m in (SYNC, ZB, ZB_ASCEND, "plain") if m in summaries]
    return Report(
        vllm=session.vllm_version,
        vllm_ascend=package("vllm_ascend").raw,
        seed=seed,
        steps=steps,
        ks=tuple(ks),
        plants=tuple(plants),
        modes={m: summaries[m] for m in order},
        divergences=divergences,
        stream_mismatches=stream_mismatches,
        invariant_failures=invariants,
        examples=examples,
        notes=notes,
        seconds=time.monotonic() - t0,
        correction=correction,
    )


def format_report(rep: Report) -> str:
    modes = list(rep.modes.values())
    w = 14
    lines = []
    asc = f", vllm-ascend {rep.vllm_ascend} installed" if rep.vllm_ascend else ""
    lines.append(
        f"zb-patch selftest — vLLM {rep.vllm}{asc}; seed {rep.seed}; k = "
        f"{', '.join(map(str, rep.ks))}; device correction from {rep.correction} counts; "
        f"{rep.seconds:.1f} s"
    )
    if rep.plants:
        lines.append(f"PLANTED BUGS: {', '.join(rep.plants)}")
    lines.append(f"{'':<34}" + "".join(f"{m.mode:>{w + 6}}" for m in modes))

    def row(label: str, fn: Any) -> None:
        lines.append(f"{label:<34}" + "".join(f"{fn(m):>{w + 6}}" for m in modes))

    row("engine steps (forward launches)", lambda m: m.steps)
    row("requests (finished + aborted)", lambda m: f"{m.requests} ({m.finished}+{m.aborted})")
    row("output tokens", lambda m: m.tokens)
    row("drafted tokens", lambda m: m.drafted)
    row("accepted tokens", lambda m: m.accepted)
    row("acceptance rate", lambda m: f"{m.acceptance_rate:.4f}")
    row("preemptions", lambda m: m.preemptions)
    ref = modes[0] if modes else None
    if ref is not None and ref.coverage:
        c = ref.coverage
        lines.append(
            f"workload ({ref.mode}): {c.get('partial_prefill_rows', 0)} partial-prefill rows, "
            f"{c.get('prefix_cache_hits', 0)} prefix-cache hits, {c.get('resumed', 0)} resumptions, "
            f"{c.get('max_model_len_reached', 0)} max_model_len finishes, "
            f"{ref.finish_reasons.get('stop', 0)} stop-token finishes, {ref.aborted} aborts, "
            f"{c.get('condense_moves', 0)} condense moves, {c.get('row_swaps', 0)} row swaps"
        )
    lines.append("accepted-count syncs / step (blocking):")

    def sync_cell(kind: str) -> Any:
        def f(m: ModeSummary) -> str:
            if m.mode == "plain":
                return "n/a"
            return f"{m.per_step(kind):.2f} ({m.per_step(kind, True):.2f})"

        return f

    row("  before input prep", sync_cell("accepted:before-prep"))
    row("  before attention metadata", sync_cell("accepted:cpu-seq-lens"))
    row("  deferred, after forward launch", sync_cell("accepted:deferred"))
    lines.append(
        f"divergences: {rep.total_divergences} (per-step fields {rep.divergences}, token streams "
        f"{rep.stream_mismatches}, invariants {len(rep.invariant_failures)})"
    )
    for inv in rep.invariant_failures[:5]:
        lines.append(f"  invariant: {inv}")
    for ex in rep.examples[:8]:
        lines.append(
            f"  k={ex['k']} {ex['mode']} step {ex['step']} {ex['request']} {ex['field']}: "
            f"want {ex['want']} got {ex['got']}"
        )
    for m in modes:
        for crash in m.crashed:
            lines.append(f"  {m.mode} crashed: {crash}")
    for note in rep.notes:
        lines.append(f"note: {note}")
    lines.append("RESULT: PASS" if rep.ok else "RESULT: FAIL")
    return "\n".join(lines)


def run_cli(args: Any) -> int:
    """``zb-patch selftest --steps N --seed S [--json] [--quiet]``: the report goes to ``args.out`` (stdout;
    the CLI's --json keeps it clean). 0 = no divergence, 1 = divergence, 2 = the harness could not run here."""
    steps = int(getattr(args, "steps", 2000))
    seed = int(getattr(args, "seed", 0))
    as_json = bool(getattr(args, "json", False))
    quiet = bool(getattr(args, "quiet", False))
    ks = tuple(getattr(args, "ks", None) or DEFAULT_KS)
    plants = tuple(getattr(args, "plant", None) or ())
    modes = getattr(args, "modes", None)
    plain = not bool(getattr(args, "no_plain", False))
    triton = bool(getattr(args, "triton", False))
    correction = str(getattr(args, "correction", None) or "cpu")
    if steps < 1:
        sys.stderr.write("zb-patch selftest: --steps must be >= 1\n")
        return 2
    out = args.out
    try:
        rep = run_selftest(
            steps=steps,
            seed=seed,
            ks=ks,
            modes=tuple(modes) if modes else None,
            plants=plants,
            plain=plain,
            correction=correction,
            triton=triton,
            progress=(not quiet and sys.stderr.isatty()),
        )
    except ImportError as e:
        sys.stderr.write(f"zb-patch selftest: cannot import what the harness needs: {e}\n")
        return 2
    if as_json:
        json.dump(rep.as_dict(), out, indent=2, sort_keys=True)
        out.write("\n")
    else:
        out.write(format_report(rep) + "\n")
    out.flush()
    return 0 if rep.ok else 1
