"""Test launcher of one data-parallel rank through vLLM's multiprocess engine core: the offline ``LLM`` with vLLM's
data-parallel environment (``VLLM_DP_RANK`` / ``VLLM_DP_SIZE`` / ``VLLM_DP_MASTER_*``) and
``VLLM_ENABLE_V1_MULTIPROCESSING=1`` starts its rank's engine core in a process of its own, a ``DPEngineCoreProc``
(the busy loop ``vllm serve --data-parallel-size N`` runs per rank: dummy batches while another rank has work, the
ranks' unfinished-request all-reduce). The NPU emulation and the worker double are installed here first and reach
the engine core by fork (``VLLM_WORKER_MULTIPROC_METHOD=fork``); what the engine core did is read there
(tests/engine/dp_engine_core.py, through ``collective_rpc``).

    python tests/engine/run_dp_engine_core.py --models DIR --out result.json [--async] [--workload JSON]

The DeepSeek-style target with its MTP layer (``--drafter deepseek-mtp`` of the engine child); ``ZB_PATCH=1`` in
the environment switches zb-patch on in the engine core (vLLM loads the plugin there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "support"))
sys.path.insert(0, HERE)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="run_dp_engine_core.py")
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--async", dest="async_scheduling", action="store_true")
    ap.add_argument("--workload", default="{}")
    args = ap.parse_args(argv)

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"  # the engine core inherits the emulation installed here
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc sends dp_engine_core.report by reference
    import npu_engine

    npu_engine.install()
    import dp_engine_core
    from vllm import LLM

    from zb_patch.check.engine import child
    from zb_patch.check.engine.workload import Workload

    dp_engine_core.observe_engine_core()
    wl = Workload(**json.loads(args.workload))
    llm = LLM(
        **child.llm_arguments(args.models, "deepseek-mtp", wl, "eager", args.async_scheduling),
        worker_cls=npu_engine.WORKER_CLS,
    )
    outs = child.generate(llm, wl)
    (engine_core,) = llm.collective_rpc(dp_engine_core.report)
    result = {
        "tokens": {o.request_id.split("-")[0]: list(o.outputs[0].token_ids) for o in outs},
        "client": type(llm.llm_engine.engine_core).__name__,
        "launcher_pid": os.getpid(),
        "engine_core": engine_core,
        "async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
