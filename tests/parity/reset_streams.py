"""One process of ``test_reset_prefix_cache_streams.py``: vLLM's real ``AsyncScheduler`` driven by the self-test's
simulated runner and fake model (``zb_patch.check.selftest``: the next token is a function of the whole sequence, so
a request recomputed after a preemption continues exactly as before), once without and then with
``reset_prefix_cache(reset_running_requests=True)`` every ``--every`` steps, for each of ``--resets``: ``in-flight``
(between two steps with a step in flight: the engine core's utility call) and ``drained`` (after the outputs in flight
were processed: ``pause_scheduler(mode="keep", clear_cache=True)`` resets once the engine is idle). Prints one JSON
object; per kind of reset, the requests whose output streams differ from the run without resets, and how many outputs
changed the ``num_computed_tokens`` / ``num_output_placeholders`` of a request the release had marked to discard that
output (vLLM #46066: a stale output's rejected drafts subtracted from the resumed request; as released also a resumed
life's own outputs, which the mark drops).

``--fix``: first apply the engine part of vLLM's scheduler of the adapter the installed release selects
(``PatchSet.parts``: ``reset-prefix-cache-in-flight``). ``--reset-wrapper-only``: only that part's
``reset_prefix_cache`` wrapper (the marks exact, the release's loop as it is)."""

from __future__ import annotations

import argparse
import json

import npu_standin

npu_standin.install()  # vLLM 0.25's import resolves the platform: vllm-ascend's, which imports torch_npu

from zb_patch.check.selftest import compat  # noqa: E402
from zb_patch.check.selftest.engine import ModeRun  # noqa: E402
from zb_patch.check.selftest.runner import SYNC, Runner  # noqa: E402
from zb_patch.check.selftest.workload import make_workload  # noqa: E402


def _marked(request) -> bool:
    """Whether the release will drop the request's next output: vLLM <= 0.21's flag, 0.22+'s count (#42117)."""
    flag = getattr(request, "discard_latest_async_tokens", False)
    return bool(flag or getattr(request, "async_tokens_to_discard", 0))


def watch_marked(scheduler) -> list[int]:
    """Wrap the scheduler's ``update_from_output`` (on the instance): counts the outputs that changed a request marked
    for discard when the output arrived."""
    changed = [0]
    update = scheduler.update_from_output

    def update_from_output(scheduler_output, model_runner_output):
        requests = [scheduler.requests.get(rid) for rid in scheduler_output.num_scheduled_tokens]
        marked = [(r, r.num_computed_tokens, r.num_output_placeholders) for r in requests if r and _marked(r)]
        result = update(scheduler_output, model_runner_output)
        changed[0] += sum((r.num_computed_tokens, r.num_output_placeholders) != (c, p) for r, c, p in marked)
        return result

    scheduler.update_from_output = update_from_output
    return changed


def streams(session, shape, specs, iterations: int, every: int, drained: bool) -> tuple[dict, int, int]:
    vc = compat.build_vllm_config(session, shape, async_scheduling=True)
    run = ModeRun(SYNC, compat.make_scheduler(vc, shape, async_scheduling=True), Runner(SYNC, shape, seed=0), shape)
    changed = watch_marked(run.scheduler)
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
    return run.streams, resets, changed[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=40)
    parser.add_argument("--resets", default="in-flight,drained", help="comma-separated: in-flight, drained")
    parser.add_argument("--fix", action="store_true")
    parser.add_argument("--reset-wrapper-only", action="store_true")
    args = parser.parse_args()
    vocab = compat.EngineShape(num_spec_tokens=1).vocab_size
    with compat.kernel_backend(False), compat.quiet_vllm_logs(), compat.vllm_session(vocab_size=vocab) as session:
        shape = compat.EngineShape(num_spec_tokens=args.k)
        applied: list[str] = []
        if args.fix:
            import vllm.v1.core.sched.async_scheduler  # noqa: F401  (the engine part's guard module)

            from zb_patch import detect, versions

            part = versions.select(detect.detect()).adapter.patch_set.parts()[1]
            applied = part.apply().by_verdict("applied")
        elif args.reset_wrapper_only:
            from vllm.v1.core.sched.scheduler import Scheduler

            from zb_patch.versions.fixes import reset_prefix_cache_in_flight

            Scheduler.reset_prefix_cache = reset_prefix_cache_in_flight.make_reset_prefix_cache(
                Scheduler.reset_prefix_cache
            )
        specs = make_workload(0, shape, args.steps)
        base, _, _ = streams(session, shape, specs, args.steps, 0, False)
        runs = {}
        for kind in args.resets.split(","):
            got, resets, changed = streams(session, shape, specs, args.steps, args.every, kind == "drained")
            differ = sorted(r for r in base if base[r] != got.get(r))
            runs[kind] = {"resets": resets, "differ": differ, "marked_changed": changed}
    print(json.dumps({"applied": applied, "requests": len(base), "runs": runs}))


if __name__ == "__main__":
    main()
