"""One engine configuration in this process: vLLM's offline ``LLM`` on the vllm-ascend platform (CPU emulation,
tests/support/npu_engine), the tiny target + EAGLE head, the workload; writes the run's result as JSON.

    python tests/engine/run_engine.py --models DIR --out result.json [--async] [--workload JSON] [--plant NAME]

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
    args = ap.parse_args(argv)

    import npu_engine

    npu_engine.install()
    import tiny_model
    from workload import Workload

    wl = Workload(**json.loads(args.workload))
    counts = _observe_scheduler()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    target, draft = os.path.join(args.models, "target"), os.path.join(args.models, "eagle")
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
        speculative_config={"method": "eagle", "model": draft, "num_speculative_tokens": wl.num_speculative_tokens},
    )
    _take_drafts_in_process(llm)
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
        "async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
        "zb_patch": os.environ.get("ZB_PATCH", ""),
        "zb_patch_status": _zb_patch_status(),
        "plant": args.plant or "",
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


def _take_drafts_in_process(llm) -> None:
    """vLLM before #30319 (0.13.x): the in-process client's ``get_output`` runs the engine core's ``step_fn`` but not
    its ``post_step`` (the sync path's ``take_draft_token_ids``), so the scheduler never receives a draft and sync
    runs verify none. Follow each step with ``post_step``, as the engine core's busy loop does."""
    from vllm.v1.engine.core_client import InprocClient

    client = llm.llm_engine.engine_core
    if not isinstance(client, InprocClient) or "post_step" in InprocClient.get_output.__code__.co_names:
        return
    core, step_fn = client.engine_core, client.engine_core.step_fn

    def step_then_post_step():
        outputs, model_executed = step_fn()
        core.post_step(model_executed)
        return outputs, model_executed

    core.step_fn = step_then_post_step


def _observe_scheduler() -> dict:
    """Count per request what vLLM's scheduler counts (drafted / accepted per step, preemptions), and apart the
    drafts it verified in a step that was not a pure decode step (it also computed prompt tokens, or recomputed
    tokens): vLLM 0.13's sync scheduler keeps the drafts proposed after a partial prefill chunk and verifies them
    with the last chunk."""
    from vllm.v1.core.sched.scheduler import Scheduler

    fields = ("drafted", "accepted", "preemptions", "drafted_in_prefill", "accepted_in_prefill")
    counts = {k: collections.Counter() for k in fields}
    make_stats, preempt = Scheduler.make_spec_decoding_stats, Scheduler._preempt_request
    update = Scheduler.update_from_output
    step = {}

    def update_from_output(self, scheduler_output, model_runner_output):
        cached = scheduler_output.scheduled_cached_reqs
        step["computed"] = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        step["computed"].update(zip(cached.req_ids, cached.num_computed_tokens))  # before the step
        step["scheduled"] = scheduler_output.num_scheduled_tokens
        return update(self, scheduler_output, model_runner_output)

    def make_spec_decoding_stats(self, stats, *, num_draft_tokens, num_accepted_tokens, **rest):
        # vLLM 0.18 passes the request id and the request's invalid (padding) drafts; 0.13 passes neither: its one
        # caller, update_from_output's per-request loop, holds the id as req_id
        request_id = rest["request_id"] if "request_id" in rest else sys._getframe(1).f_locals["req_id"]
        invalid = (rest.get("num_invalid_spec_tokens") or {}).get(request_id, 0)
        counts["drafted"][request_id] += num_draft_tokens - invalid
        counts["accepted"][request_id] += num_accepted_tokens
        # a pure decode step starts past the prompt and computes the last sampled token and the drafts
        past_prompt = step["computed"][request_id] >= self.requests[request_id].num_prompt_tokens
        if not (past_prompt and step["scheduled"][request_id] == num_draft_tokens + 1):
            counts["drafted_in_prefill"][request_id] += num_draft_tokens - invalid
            counts["accepted_in_prefill"][request_id] += num_accepted_tokens
        return make_stats(
            self, stats, num_draft_tokens=num_draft_tokens, num_accepted_tokens=num_accepted_tokens, **rest
        )

    def _preempt_request(self, request, timestamp):
        counts["preemptions"][request.request_id] += 1
        return preempt(self, request, timestamp)

    Scheduler.update_from_output = update_from_output
    Scheduler.make_spec_decoding_stats = make_spec_decoding_stats
    Scheduler._preempt_request = _preempt_request
    return counts


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
