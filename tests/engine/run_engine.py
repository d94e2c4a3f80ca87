"""One engine configuration in this process: vLLM's offline ``LLM`` on the vllm-ascend platform (CPU emulation,
tests/support/npu_engine), the tiny target + EAGLE head, the workload; writes the run's result as JSON.

    python tests/engine/run_engine.py --models DIR --out result.json [--async] [--workload JSON] [--plant NAME]
        [--drafter eagle|mtp]

ZB_PATCH=1 in the environment makes the zb-patch plugin apply its adapter (vLLM loads it as a general plugin).
Per-request drafted / accepted counts and preemptions are read where vLLM's scheduler counts them
(``make_spec_decoding_stats`` per request, ``_preempt_request``), without changing what it does.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # EngineCore in this process (uni-process executor)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "support"))
sys.path.insert(0, HERE)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--async", dest="async_scheduling", action="store_true")
    ap.add_argument("--workload", default="{}")
    ap.add_argument(
        "--plant", help="planted mistakes of tests/engine/plants.py (comma-separated), installed before generating"
    )
    ap.add_argument(
        "--drafter",
        choices=("eagle", "mtp"),
        default="eagle",
        help="eagle: Llama target + EAGLE head; mtp: MiMo target, its own MTP layer drafts (write_mtp_model)",
    )
    args = ap.parse_args(argv)

    import npu_engine

    npu_engine.install()
    import tiny_model
    from workload import Workload

    wl = Workload(**json.loads(args.workload))
    per_pos = _observe_draft_positions()  # first: it binds the arguments by upstream's own signature
    counts = _observe_scheduler()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    k = wl.num_speculative_tokens
    if args.drafter == "mtp":  # the draft is the target checkpoint's own MTP layer
        target, speculative_config = os.path.join(args.models, "mimo"), {"method": "mtp", "num_speculative_tokens": k}
    else:
        target = os.path.join(args.models, "target")
        speculative_config = {
            "method": "eagle",
            "model": os.path.join(args.models, "eagle"),
            "num_speculative_tokens": k,
        }
    llm = LLM(
        model=target,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=wl.max_model_len,
        max_num_seqs=wl.max_num_seqs,
        max_num_batched_tokens=wl.max_num_batched_tokens,
        enable_chunked_prefill=True,
        num_gpu_blocks_override=wl.num_gpu_blocks,
        enable_prefix_caching=False,
        async_scheduling=args.async_scheduling,
        distributed_executor_backend="uni",
        worker_cls=npu_engine.WORKER_CLS,
        speculative_config=speculative_config,
    )
    if args.plant:
        import plants

        plants.install(args.plant)
    reqs = wl.requests(tiny_model.VOCAB)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False) for _, n in reqs]
    outs = llm.generate(prompts, params, use_tqdm=False)
    # LLM numbers requests in submission order ("0", "1", ...); the engine core's ids add "-<random suffix>"
    result = {
        "tokens": {o.request_id: list(o.outputs[0].token_ids) for o in outs},
        **{field: {rid.split("-")[0]: n for rid, n in c.items()} for field, c in counts.items()},
        **{field: [c[i] for i in range(k)] for field, c in per_pos.items()},
        "async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
        "zb_patch": os.environ.get("ZB_PATCH", ""),
        "zb_patch_status": _zb_patch_status(),
        "plant": args.plant or "",
        "drafter": args.drafter,
        "draft_model": type(
            llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter.get_model()
        ).__name__,
        "plant_hits": _plant_hits(args.plant),
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


def _plant_hits(plant: str | None) -> dict:
    if not plant:
        return {}
    import plants

    return dict(plants.HITS)


def _zb_patch_status() -> dict:
    from zb_patch import plugin

    return json.loads(json.dumps(plugin.status(), default=str))


def _observe_draft_positions() -> dict:
    """Drafted / accepted per draft position over all requests, as vLLM's ``SpecDecodingStats.observe_draft`` counts
    them (accepted n: positions 0..n-1), read from the scheduler's per-request ``make_spec_decoding_stats`` call."""
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler

    per_pos = {k: collections.Counter() for k in ("drafted_per_pos", "accepted_per_pos")}
    make_stats = Scheduler.make_spec_decoding_stats
    signature = inspect.signature(make_stats)

    def make_spec_decoding_stats(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs).arguments
        invalid = (call.get("num_invalid_spec_tokens") or {}).get(call.get("request_id"), 0)
        per_pos["drafted_per_pos"].update(range(call["num_draft_tokens"] - invalid))
        per_pos["accepted_per_pos"].update(range(call["num_accepted_tokens"]))
        return make_stats(self, *args, **kwargs)

    Scheduler.make_spec_decoding_stats = make_spec_decoding_stats
    return per_pos


def _observe_scheduler() -> dict:
    """Count per request what vLLM's scheduler counts (drafted / accepted per step, preemptions)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    counts = {k: collections.Counter() for k in ("drafted", "accepted", "preemptions")}
    make_stats, preempt = Scheduler.make_spec_decoding_stats, Scheduler._preempt_request

    def make_spec_decoding_stats(
        self, stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens, request_id
    ):
        invalid = (num_invalid_spec_tokens or {}).get(request_id, 0)
        counts["drafted"][request_id] += num_draft_tokens - invalid
        counts["accepted"][request_id] += num_accepted_tokens
        return make_stats(self, stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens, request_id)

    def _preempt_request(self, request, timestamp):
        counts["preemptions"][request.request_id] += 1
        return preempt(self, request, timestamp)

    Scheduler.make_spec_decoding_stats = make_spec_decoding_stats
    Scheduler._preempt_request = _preempt_request
    return counts


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
