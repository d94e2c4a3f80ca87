"""One engine configuration in this process: vLLM's offline ``LLM`` (eager, uni-process executor, EngineCore in
this process) on the installed platform, the tiny target + draft of :mod:`.model`, the greedy workload of
:mod:`.workload`; writes the run's result as JSON.

    python -m zb_patch.check.engine.child --models DIR --out result.json [--async] [--workload JSON]
    python -m zb_patch.check.engine.child --check-device

``ZB_PATCH=1`` in the environment makes the zb-patch plugin apply its adapter (vLLM loads it as a general plugin).
Per-request drafted / accepted counts and preemptions are read where vLLM's scheduler counts them
(``make_spec_decoding_stats`` per request, ``_preempt_request``), without changing what it does.

The tests start this through a launcher that first installs the NPU emulation (tests/engine/run_engine.py): it
calls :func:`main` with ``llm_overrides`` (its worker class), ``after_build`` (planted mistakes) and ``device``.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import sys
from collections.abc import Callable
from typing import Any


def npu_device() -> dict:
    """Whether this process sees an NPU (torch_npu importable and a device visible), with the reason if not."""
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError as exc:
        return {"available": False, "reason": f"torch_npu cannot be imported ({exc})"}
    if not torch.npu.is_available():
        return {"available": False, "reason": "torch.npu.is_available() is False: no NPU visible to this process"}
    return {"available": True, "name": torch.npu.get_device_name(0), "count": torch.npu.device_count()}


def main(
    argv: list[str],
    *,
    llm_overrides: dict[str, Any] | None = None,
    after_build: Callable[[], dict] | None = None,
    device: Callable[[], dict] = npu_device,
) -> int:
    """``after_build`` runs once ``LLM(...)`` is built (zb-patch's patches are in place by then) and before any
    request; what it returns is merged into the result (the tests' planted mistakes report their hits)."""
    ap = argparse.ArgumentParser(prog="python -m zb_patch.check.engine.child")
    ap.add_argument(
        "--check-device", action="store_true", help="print whether an NPU is usable, as JSON; exit 3 if not"
    )
    ap.add_argument("--models", help="directory written by zb_patch.check.engine.model.write_models")
    ap.add_argument("--out", help="result JSON path")
    ap.add_argument("--async", dest="async_scheduling", action="store_true")
    ap.add_argument("--workload", default="{}", help="Workload fields as JSON")
    args = ap.parse_args(argv)
    if args.check_device:
        report = device()
        print(json.dumps(report))
        return 0 if report["available"] else 3
    if not (args.models and args.out):
        ap.error("--models and --out are required")

    # EngineCore in this process: its scheduler is what _observe_scheduler counts, and the tests' emulation
    # exists only in the process that installed it (their launcher sets this before it imports vLLM).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from .model import VOCAB
    from .workload import Workload

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
        speculative_config={"method": "eagle", "model": draft, "num_speculative_tokens": wl.num_speculative_tokens},
        **(llm_overrides or {}),
    )
    if llm.llm_engine.vllm_config.parallel_config.world_size != 1 or _engine_core_elsewhere(llm):
        raise RuntimeError("the engine self-test needs the EngineCore in this process (one worker)")
    extra = after_build() if after_build else {}
    reqs = wl.requests(VOCAB)
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
        **extra,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


def _engine_core_elsewhere(llm) -> bool:
    """True when vLLM runs the EngineCore in another process (VLLM_ENABLE_V1_MULTIPROCESSING was read as 1)."""
    return type(llm.llm_engine.engine_core).__name__ != "InprocClient"


def _zb_patch_status() -> dict:
    from zb_patch import plugin

    return json.loads(json.dumps(plugin.status(), default=str))


def _observe_scheduler() -> dict:
    """Count per request what vLLM's scheduler counts (drafted / accepted per step, preemptions)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    counts: dict[str, collections.Counter] = {k: collections.Counter() for k in ("drafted", "accepted", "preemptions")}
    make_stats, preempt = Scheduler.make_spec_decoding_stats, Scheduler._preempt_request
    signature = inspect.signature(make_stats)

    def make_spec_decoding_stats(self, *args, **kwargs):
        a = signature.bind(self, *args, **kwargs).arguments
        request_id = a["request_id"]
        invalid = (a.get("num_invalid_spec_tokens") or {}).get(request_id, 0)
        counts["drafted"][request_id] += a["num_draft_tokens"] - invalid
        counts["accepted"][request_id] += a["num_accepted_tokens"]
        return make_stats(self, *args, **kwargs)

    def _preempt_request(self, request, timestamp):
        counts["preemptions"][request.request_id] += 1
        return preempt(self, request, timestamp)

    Scheduler.make_spec_decoding_stats = make_spec_decoding_stats
    Scheduler._preempt_request = _preempt_request
    return counts


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
