"""Test launcher of one engine configuration: installs the NPU emulation (tests/support/npu_engine) and runs the
product's engine child (zb_patch.check.engine.child) with the worker double, optionally with planted mistakes.

    python tests/engine/run_engine.py --models DIR --out result.json [--async] [--workload JSON] [--plant NAMES]
    python tests/engine/run_engine.py --check-device

``zb-patch selftest --engine`` uses it as its child when ``ZB_SELFTEST_ENGINE_CHILD`` names this file (the tests).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "support"))
sys.path.insert(0, HERE)

ON = "CUDA" if os.environ.get("NPU_STANDIN_DEVICE") == "cuda" else "CPU"  # tests/support/npu_engine
EMULATED_DEVICE = {"available": True, "name": f"{ON} emulation of the NPU ops (tests/support/npu_ops)", "count": 1}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # "--out" is the child's, not "--output-..."
    ap.add_argument("--plant", help="planted mistakes of tests/engine/plants.py (comma-separated)")
    ap.add_argument(
        "--output-ready-early",
        action="store_true",
        help="every step's output is ready when the engine core first asks (vLLM 0.13 / 0.18: the executor's "
        "async-output thread is removed, so the output is made inline): the engine core then processes each step's "
        "output before it schedules the next -- the side of the race the async-output thread wins now and then",
    )
    ap.add_argument(
        "--perturb-logits",
        type=int,
        default=0,
        metavar="N",
        help="planted nondeterminism (zb-patch selftest --engine --model's noise floor): at the target's N-th "
        "compute_logits call, row 0's greedy choice loses to its runner-up",
    )
    args, rest = ap.parse_known_args(argv)

    # before install() imports vLLM: the child needs the EngineCore in this process (the emulation lives here)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import npu_engine

    npu_engine.install()
    if args.output_ready_early:
        _output_ready_early()
    from zb_patch.check.engine import child

    def after_build() -> dict:
        import plants

        from npu_ops import mla

        # zb-patch's kernels compiled while the engine started (ZeroBubble.compile_kernels), before any request
        zb = plants.applied_zero_bubble()
        started = {"zb_compile_seconds": list(zb.compile_seconds)} if zb is not None else {}
        # the emulated MLA ops' calls by mode while generating (a live Counter; empty for a dense model)
        mla.CALLS.clear()
        started["mla_op_calls"] = mla.CALLS
        started["dummy_batches"] = _count_dummy_batches()
        # host drains before graph replays that zb-patch's graph-replay fixes left out or replaced (a live Counter)
        from zb_patch.versions.fixes import graph_replay

        graph_replay.DRAINS.clear()
        started["host_drains_left_out"] = graph_replay.DRAINS
        if ON == "CUDA":  # FULL graphs: the task groups replayed with their update, by capture site (a live Counter)
            import npu_graphs_cuda

            npu_graphs_cuda.REPLAYED_GROUPS.clear()
            started["graph_task_groups_replayed"] = npu_graphs_cuda.REPLAYED_GROUPS
        if args.perturb_logits:
            started["perturbed"] = _perturb_logits(args.perturb_logits)
        if not args.plant:
            return {"plant": "", "plant_hits": {}, **started}
        plants.install(args.plant)
        return {"plant": args.plant, "plant_hits": plants.HITS, **started}  # a live Counter: filled while generating

    rc = child.main(
        rest,
        llm_overrides=npu_engine.llm_overrides(rest),
        after_build=after_build,
        device=lambda: EMULATED_DEVICE,
    )
    if ON == "CUDA":
        import npu_graphs_cuda

        npu_graphs_cuda.check()  # an ExternalEvent wait that never saw its record: a hang on the NPU
    return rc


def _perturb_logits(n: int) -> dict:
    """At the target's ``n``-th ``compute_logits`` call (Llama targets; the EAGLE head, a subclass, is left alone),
    row 0's best logit is pushed below every other: that row samples its runner-up. A live record of the hit."""
    from vllm.model_executor.models.llama import LlamaForCausalLM

    record = {"calls": 0, "hit": False}
    original = LlamaForCausalLM.compute_logits

    def compute_logits(self, *args, **kwargs):
        logits = original(self, *args, **kwargs)
        if type(self) is LlamaForCausalLM and logits is not None:
            record["calls"] += 1
            if record["calls"] == n:
                logits[0, logits[0].argmax()] = logits[0].min() - 1.0
                record["hit"] = True
        return logits

    LlamaForCausalLM.compute_logits = compute_logits
    return record


def _count_dummy_batches() -> dict:
    """A live count of the engine core's dummy batches while generating (data parallelism: a rank without work
    runs one whenever another rank still steps)."""
    from vllm.v1.engine.core import EngineCore

    count = {"calls": 0}
    original = EngineCore.execute_dummy_batch

    def execute_dummy_batch(self, *args, **kwargs):
        count["calls"] += 1
        return original(self, *args, **kwargs)

    EngineCore.execute_dummy_batch = execute_dummy_batch
    return count


def _output_ready_early() -> None:
    """vLLM 0.13 / 0.18's uni-process executor hands an async step's output to a one-thread pool and returns its
    future; without the pool it makes the output inline and returns a done future. (vLLM 0.19+ makes the output
    when the future is waited on, and its engine core no longer asks whether it is done: no effect there.)"""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    init = UniProcExecutor._init_executor

    def _init_executor(self):
        init(self)
        self.async_output_thread = None

    UniProcExecutor._init_executor = _init_executor


if __name__ == "__main__":
    import engine_zygote

    engine_zygote.delegate(__file__)  # forked from the tests' pre-imported interpreter when one serves
    sys.exit(main(sys.argv[1:]))
