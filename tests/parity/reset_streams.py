"""One process of ``test_reset_prefix_cache_streams.py``: vLLM's real ``AsyncScheduler`` driven by the self-test's
simulated runner and fake model (``zb_patch.check.selftest``: the next token is a function of the whole sequence, so
a request recomputed after a preemption continues exactly as before), once without and once with
``reset_prefix_cache(reset_running_requests=True)`` every ``--every`` steps, either between two steps with a step in
flight (the engine core's utility call) or after the outputs in flight were processed (``--drained``:
``pause_scheduler(mode="keep", clear_cache=True)`` resets once the engine is idle). Prints one JSON object: the
requests whose output streams differ between the two runs.

``--fix``: first apply the engine part of vLLM's scheduler of the adapter the installed release selects
(``PatchSet.parts``: ``reset-prefix-cache-in-flight``)."""

from __future__ import annotations

import argparse
import json

from zb_patch.check.selftest import compat
from zb_patch.check.selftest.engine import ModeRun
from zb_patch.check.selftest.runner import SYNC, Runner
from zb_patch.check.selftest.workload import make_workload


def streams(session, shape, specs, iterations: int, every: int, drained: bool) -> tuple[dict, int]:
    vc = compat.build_vllm_config(session, shape, async_scheduling=True)
    run = ModeRun(SYNC, compat.make_scheduler(vc, shape, async_scheduling=True), Runner(SYNC, shape, seed=0), shape)
    arrivals: dict[int, list] = {}
    for s in specs:
        arrivals.setdefault(s.arrival, []).append(s)
    it = last = resets = 0
    while it < 6 * iterations:
        if it < iterations:
            run.add(arrivals.get(it, []))
        run.step_with_batch_queue({})
        if every and run.step - last >= every and run.queue and run.scheduler.running:
            last = run.step
            while drained and run.queue:
                run._finish_one({})
            run.scheduler.reset_prefix_cache(reset_running_requests=True)
            resets += 1
        it += 1
        if it >= iterations and run.idle():
            break
    run.drain({})
    return run.streams, resets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=40)
    parser.add_argument("--drained", action="store_true")
    parser.add_argument("--fix", action="store_true")
    args = parser.parse_args()
    vocab = compat.EngineShape(num_spec_tokens=1).vocab_size
    with compat.kernel_backend(False), compat.quiet_vllm_logs(), compat.vllm_session(vocab_size=vocab) as session:
        shape = compat.EngineShape(num_spec_tokens=args.k)
        applied: list[str] = []
        if args.fix:
            import vllm.v1.core.sched.async_scheduler  # noqa: F401  (the engine part's guard module)

            from zb_patch import detect, versions

            part = versions.select(detect.detect()).adapter.patch_set.parts()[1]
            report = part.apply()
            applied = report.by_verdict("applied")
        specs = make_workload(0, shape, args.steps)
        base, _ = streams(session, shape, specs, args.steps, 0, False)
        got, resets = streams(session, shape, specs, args.steps, args.every, args.drained)
    differ = sorted(r for r in base if base[r] != got.get(r))
    print(json.dumps({"applied": applied, "resets": resets, "requests": len(base), "differ": differ}))


if __name__ == "__main__":
    main()
