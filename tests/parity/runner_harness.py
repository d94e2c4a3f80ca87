"""Runner-level parity harness for the NPU-runner zero-bubble adapters (ascend-0.13, ascend-0.18): the release's
real vLLM ``AsyncScheduler`` drives the release's real vllm-ascend ``NPUModelRunner`` on CPU tensors (NPU runtime
stand-in), unpatched vs patched. This module is release-independent; ``runner013`` / ``runner018`` each add their
release's :class:`Driver` (the mirror of its ``execute_model`` up to the forward) and nothing else.

What is real and what is not
----------------------------
Real (the installed release's code): ``AsyncScheduler`` with its KV-cache manager (small pool: preemption and
resumption happen), ``NPUModelRunner`` construction, ``_update_states`` (with the batch changes: add / remove /
condense / decode-first reorder), ``_prepare_inputs`` (positions, seq_lens, slot mapping, input ids incl. the
device-side scatter of last step's sampled and draft tokens, spec-decode metadata, discard indices),
``_bookkeeping_sync``, the Ascend proposer's ``prepare_next_token_ids_padded``, vLLM's
``_copy_valid_sampled_token_count`` / ``_get_valid_sampled_token_count``.

Not real (there is no model, no attention math, no NPU): the bodies of ``execute_model`` and ``sample_tokens`` are
mirrored step by step (the release's :meth:`Driver.prepare_step`, then :meth:`Driver.execute_model_body` /
:meth:`Driver.sample_tokens`, in the release's order) with the forward, the rejection sampler and the drafter
replaced by :mod:`zb_patch.check.selftest.fakemodel`: a hash chain over a simulated KV cache that reads the committed
**block table**, the **CPU seq_lens** (what Ascend FIA / paged attention reads), **positions**, **slot mapping** and
**input ids** where the release hands them to attention and the model, so any wrong value changes every later
token of the request. Acceptance is seeded per (request, position): none / all / partial. Also compared: what is
read after the forward launch -- ``num_computed_tokens_cpu`` when the drafter runs (its attention metadata reads
it) and the device and host ``seq_lens`` rows past ``num_reqs`` up to ``max_num_reqs`` (what padded attention
metadata, a FULL graph's task-group update and the drafter's FULL-graph pad branch read, up to the padded count).

In patched mode the adapter's patches are applied to the live classes with the registry; the adapter's
``execute_model`` patch is applied to ``Driver.execute_model_body`` through the patch's own factory (the harness
never calls the release's ``execute_model``).

The accepted-count copy is adversarial: :class:`LazyCountEvent` replaces the runner's
``valid_sampled_token_count_event``; when the copy is recorded the host buffer is poisoned, and it only receives the
counts when someone waits on the event. A read without a wait sees poison. Every wait is counted by phase:
``update_states`` (before input preparation: the classic blocking sync), ``prepare_inputs:release`` (inside the
release's input preparation, before its inputs are queued), ``prepare_inputs:after`` (once the release queued this
step's inputs: the Ascend exact-seq_lens wait; :attr:`Driver.inputs_queued` says where that is), ``forward`` (after
the forward launch: deferred correction), ``sample``. A count read without a wait surfaces as
:class:`PoisonedCounts` once it reaches what attention reads. Waits on ``prepare_inputs_event`` (the release's own
and any a patch adds) are counted too (:class:`InputPrepEvent`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import tempfile
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import mla_harness
import numpy as np

from zb_patch.check.selftest import compat, fakemodel
from zb_patch.check.selftest.compat import EngineShape
from zb_patch.check.selftest.workload import RequestSpec, make_workload

ARCH = "ZbRunnerParityForCausalLM"
EAGLE_ARCH = "EagleZbRunnerParityForCausalLM"
MTP_ARCH = "DeepSeekMTPModel"  # what vLLM makes of a deepseek_v3 target's MTP layer

# The scheduler / batch edge cases a run counts (RunResult.edges; the zero-bubble bookkeeping is wrong in a different
# way in each): a request given fewer drafts than it held, by the token budget or near max_model_len; a request that
# held drafts and was left out of a step (not preempted), then scheduled again; preempted, then resumed; a request
# whose last step had drafts at another row (condense or reorder); rows swapped by the decode-first reorder.
EDGE_CASES = (
    "drafts_cut_token_budget",
    "drafts_cut_max_model_len",
    "skipped_holding_drafts",
    "rescheduled_after_skip",
    "preempted",
    "resumed_after_preemption",
    "rows_moved_with_drafts",
    "rows_swapped",
)


# ------------------------------------------------------------------------------------------------
# Process set-up (test platform; tiny model configs). The CPU distributed state comes from
# tests/support/cpu_worker.py (tests/patches/conftest.py's `cpu_worker` fixture).
# ------------------------------------------------------------------------------------------------


@dataclass
class Session:
    model_dir: str
    draft_dir: str
    mla_dir: str  # a DeepSeek-V3-style target (MLA) with one MTP layer (mla_harness)
    configs: dict = field(default_factory=dict)


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


@contextlib.contextmanager
def session(vocab_size: int = 512) -> Iterator[Session]:
    """Process-global state for the run, restored on exit: the current platform (device "cpu", Ascend attention
    backends), ``plugins_loaded`` (config creation must not load general plugins), two config-only model
    architectures, the prefix-cache root hash, and ``torch.Tensor.pin_memory`` (vllm-ascend 0.18's
    ``_calc_spec_decode_metadata`` pins unconditionally; there is no accelerator to pin for). The MLA target's MTP
    draft resolves to vLLM's ``DeepSeekMTPModel`` (``SpeculativeConfig.hf_config_override``): for the duration that
    name is served by the config-only EAGLE architecture's entry (no model-inspection subprocess, nothing loaded),
    and ``Tensor.npu()`` (vllm-ascend's MLA builder moves context-chunk lengths with it) is ``.to("cpu")``."""
    import torch
    import vllm.platforms as platforms
    import vllm.plugins as plugins
    import vllm.v1.core.kv_cache_utils as kv_utils
    from torch import nn
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.platforms.interface import UnspecifiedPlatform
    from vllm.utils.hashing import sha256
    from vllm_ascend.platform import NPUPlatform

    class RunnerPlatform(UnspecifiedPlatform):
        device_type = "cpu"
        device_name = "cpu"
        dispatch_key = "CPU"
        get_attn_backend_cls = NPUPlatform.get_attn_backend_cls

        @classmethod
        def is_pin_memory_available(cls) -> bool:
            return False

        @classmethod
        def num_compute_units(cls, device_id: int = 0) -> int:
            return 2

    class _Base(nn.Module):
        def __init__(self, *, vllm_config: Any = None, prefix: str = "") -> None:
            super().__init__()

        def embed_input_ids(self, input_ids: Any) -> Any:
            raise NotImplementedError

        def forward(
            self, input_ids: Any, positions: Any, intermediate_tensors: Any = None, inputs_embeds: Any = None
        ) -> Any:
            raise NotImplementedError

        def compute_logits(self, hidden_states: Any) -> Any:
            raise NotImplementedError

    saved = (
        platforms._current_platform,
        plugins.plugins_loaded,
        getattr(kv_utils, "NONE_HASH", None),
        torch.Tensor.pin_memory,
        ModelRegistry.models.get(MTP_ARCH),
        torch.Tensor.__dict__.get("npu"),
    )
    registered = []
    tmp = tempfile.TemporaryDirectory(prefix="zb-runner-parity-")
    try:
        platforms._current_platform = RunnerPlatform()
        plugins.plugins_loaded = True
        torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]
        torch.Tensor.npu = lambda self, *a, **k: self.to("cpu")  # type: ignore[attr-defined]
        for name in (ARCH, EAGLE_ARCH):
            if name not in ModelRegistry.get_supported_archs():
                ModelRegistry.register_model(name, type(name, (_Base,), {}))
                registered.append(name)
        ModelRegistry.models[MTP_ARCH] = ModelRegistry.models[EAGLE_ARCH]
        kv_utils.init_none_hash(sha256)
        model_dir, draft_dir = os.path.join(tmp.name, "target"), os.path.join(tmp.name, "eagle")
        _write_model_dir(model_dir, ARCH, 2, vocab_size)
        _write_model_dir(draft_dir, EAGLE_ARCH, 1, vocab_size)
        mla_dir = os.path.join(tmp.name, "mla")
        os.makedirs(mla_dir)
        with open(os.path.join(mla_dir, "config.json"), "w") as f:
            json.dump(mla_harness.model_config(ARCH, vocab_size), f)
        yield Session(model_dir, draft_dir, mla_dir)
    finally:
        for name in registered:
            ModelRegistry.models.pop(name, None)
        platforms._current_platform, plugins.plugins_loaded = saved[0], saved[1]
        if saved[2] is not None:
            kv_utils.NONE_HASH = saved[2]
        torch.Tensor.pin_memory = saved[3]  # type: ignore[method-assign]
        if saved[4] is None:
            ModelRegistry.models.pop(MTP_ARCH, None)
        else:
            ModelRegistry.models[MTP_ARCH] = saved[4]
        if saved[5] is None:
            del torch.Tensor.npu  # type: ignore[attr-defined]
        else:
            torch.Tensor.npu = saved[5]  # type: ignore[attr-defined]
        tmp.cleanup()


def build_config(
    sess: Session, shape: EngineShape, *, async_scheduling: bool = True, method: str = "eagle", **spec_extra: Any
) -> Any:
    """``method="mtp"``: the MLA target (``sess.mla_dir``) with its own MTP layer as the draft."""
    key = (shape, async_scheduling, method, tuple(sorted(spec_extra.items())))
    if key in sess.configs:
        return sess.configs[key]
    from vllm.engine.arg_utils import EngineArgs

    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": shape.num_spec_tokens, **spec_extra}
    if method in ("eagle", "eagle3"):
        spec["model"] = sess.draft_dir
    args = EngineArgs(
        model=sess.mla_dir if method == "mtp" else sess.model_dir,
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
        speculative_config=spec,
    )
    vc = args.create_engine_config()
    # vLLM 0.13 leaves the capture sizes unset with enforce_eager (the Ascend platform's config hook, not run
    # here, would fill them); the EAGLE proposer sorts them at construction
    if vc.compilation_config.cudagraph_capture_sizes is None:
        vc.compilation_config.cudagraph_capture_sizes = []
    sess.configs[key] = vc
    return vc


def kv_cache_config(vllm_config: Any, shape: EngineShape) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    if vllm_config.model_config.use_mla:
        return mla_harness.kv_cache_config(vllm_config, shape)
    spec = FullAttentionSpec(block_size=shape.block_size, num_kv_heads=2, head_size=16, dtype=torch.float32)
    vllm_config.cache_config.num_gpu_blocks = shape.num_blocks
    return KVCacheConfig(
        num_blocks=shape.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )


def make_scheduler(vllm_config: Any, kvc: Any, shape: EngineShape, cls: Any = None) -> Any:
    """vLLM's ``AsyncScheduler``, or ``cls`` (a subclass taking its arguments: vllm-ascend's recompute scheduler)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.structured_output import StructuredOutputManager

    return (cls or AsyncScheduler)(
        vllm_config=vllm_config,
        kv_cache_config=kvc,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=shape.block_size,
        log_stats=True,
    )


def request_state(
    req_id: str, prompt_token_ids: list[int], num_computed_tokens: int, sampling_params: Any = None
) -> Any:
    """vLLM's ``CachedRequestState`` of a request the runner holds: its prompt, one KV block, no output yet."""
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=prompt_token_ids,
        mm_features=[],
        sampling_params=sampling_params,
        generator=None,
        block_ids=([0],),
        num_computed_tokens=num_computed_tokens,
        output_token_ids=[],
    )


def make_runner(vllm_config: Any, kvc: Any, *, reorder: bool = True) -> Any:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm_ascend.ascend_config import init_ascend_config
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    init_ascend_config(vllm_config)
    with set_current_vllm_config(vllm_config):
        runner = NPUModelRunner(vllm_config, torch.device("cpu"))
    runner.kv_cache_config = kvc
    if reorder:  # decode-first reordering of the persistent batch (what Ascend's MLA / spec builders ask for)
        runner.reorder_batch_threshold = runner.decode_threshold
    return runner


# ------------------------------------------------------------------------------------------------
# The adversarial accepted-count copy and the wait counter
# ------------------------------------------------------------------------------------------------

POISON = -777


class LazyCountEvent:
    """Replaces ``runner.valid_sampled_token_count_event``.

    ``record()`` (end of the D2H copy of the valid counts, vLLM ``_copy_valid_sampled_token_count``) keeps the
    counts aside and poisons the host buffer; ``synchronize()`` delivers them. So the host buffer holds the counts
    only after a wait, as on a device that has not reached the copy yet. Waits are counted by the driver's phase;
    ``blocking`` = the copy was still pending."""

    def __init__(self, host_buffer: Any, driver: Driver) -> None:
        self.host, self.driver = host_buffer, driver
        self.pending: Any = None

    def record(self, stream: Any = None) -> None:
        self.pending = self.host.clone()
        self.host.fill_(POISON)

    def synchronize(self) -> None:
        blocking = self.pending is not None
        if blocking:
            self.host.copy_(self.pending)
            self.pending = None
        self.driver.count_wait(blocking)

    def query(self) -> bool:
        return self.pending is None

    def wait(self, stream: Any = None) -> None:
        pass


class InputPrepEvent:
    """Wraps ``runner.prepare_inputs_event`` (vLLM's input-preparation event) and counts the host's waits on it:
    the release's own (``synchronize_input_prep``) and any a patch adds."""

    def __init__(self, event: Any, driver: Driver) -> None:
        self.event, self.driver = event, driver

    def record(self, stream: Any = None) -> None:
        self.driver.input_prep_records += 1
        self.event.record() if stream is None else self.event.record(stream)

    def synchronize(self) -> None:
        self.driver.input_prep_waits += 1
        self.event.synchronize()

    def query(self) -> bool:
        return self.event.query()

    def wait(self, stream: Any = None) -> None:
        self.event.wait() if stream is None else self.event.wait(stream)


class PoisonedCounts(AssertionError):
    """A value derived from the poisoned accepted-count buffer reached what the model or attention reads: a count
    was read without waiting on ``valid_sampled_token_count_event``."""


# ------------------------------------------------------------------------------------------------
# The driver: the release's execute_model / sample_tokens with the model replaced
# ------------------------------------------------------------------------------------------------


@dataclass
class RowRecord:
    """What the forward of one step saw for one request, plus what the step produced."""

    positions: tuple
    slots: tuple
    input_ids: tuple
    seq_len_cpu: int
    seq_len_gpu: int
    num_computed_cpu: int
    max_seq_len: int
    discarded: bool
    sampled: tuple
    drafted: int
    accepted: int
    next_token: int
    req_num_computed: int  # req_state.num_computed_tokens after execute_model returned (deferred correction)
    num_computed_cpu_drafter: int  # num_computed_tokens_cpu when the drafter runs (its metadata reads it)

    FIELDS = (
        "positions",
        "slots",
        "input_ids",
        "seq_len_cpu",
        "seq_len_gpu",
        "num_computed_cpu",
        "max_seq_len",
        "discarded",
        "sampled",
        "drafted",
        "accepted",
        "next_token",
        "req_num_computed",
        "num_computed_cpu_drafter",
    )


@dataclass
class StepInputs:
    """What the release handed attention and the model for one step (host copies, taken where it hands them)."""

    spec_meta: Any
    query_start_loc: np.ndarray  # [n + 1]
    input_ids: np.ndarray  # [total]
    positions: np.ndarray  # [total]
    slots: np.ndarray  # [total]
    block_table: np.ndarray  # [n, max_blocks]
    seq_lens_cpu: list  # [n]: what Ascend attention reads
    seq_lens_gpu: list  # [n]
    num_computed_cpu: list  # [n]


@dataclass
class StepState:
    so: Any
    n: int
    req_ids: list
    qsl: np.ndarray
    input_ids: np.ndarray
    num_drafts: list
    seq_lens_cpu: list
    target: np.ndarray
    hidden: np.ndarray
    spec_meta: Any
    total: int
    rows: dict


class PendingOutput:
    """The step's output as the engine core receives it. Like vLLM's ``AsyncGPUModelRunnerOutput``, it carries the
    host copy of the sampled ids (``sampled_token_ids_cpu``) and the copy's event (``async_copy_ready_event``)."""

    def __init__(self, output: Any, sampled_token_ids_cpu: Any = None, async_copy_ready_event: Any = None) -> None:
        self.output = output
        self.sampled_token_ids_cpu = sampled_token_ids_cpu
        self.async_copy_ready_event = async_copy_ready_event

    def get_output(self) -> Any:
        return self.output


class CopyEvent:
    """The event of a device-to-host copy (the sampled ids' ``async_copy_ready_event``, the runner's
    ``draft_token_ids_event``): each host wait on it is counted in ``driver.copy_waits[(name, phase)]``."""

    def __init__(self, driver: Driver, name: str, event: Any = None) -> None:
        self.driver, self.name, self.event = driver, name, event

    def record(self, stream: Any = None) -> None:
        if self.event is not None:
            self.event.record() if stream is None else self.event.record(stream)

    def synchronize(self) -> None:
        self.driver.copy_waits[(self.name, self.driver.phase)] += 1
        if self.event is not None:
            self.event.synchronize()

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        pass


UNFILLED = "unfilled-draft"  # stands for a draft input id the release cannot fill (Driver.draft_ids_unfilled)


class Driver:
    """One runner + its fake model. ``execute_model(so)`` / ``sample_tokens()`` as the engine core calls them.

    A release subclass defines :meth:`prepare_step` (its ``execute_model`` up to the forward),
    :meth:`spec_common_metadata` and :attr:`inputs_queued`."""

    # (module, class, method) of the release method after which the step's inputs are queued
    inputs_queued: tuple[str, str, str]

    unfilled_drafts = 0  # draft input ids the release cannot fill (not compared; see runner013.Driver)
    # the release's own ``_sample`` is called (its sampler answering with the fake model's result) and its draft
    # copy made (``_copy_draft_token_ids_to_cpu``), as its ``sample_tokens`` does; what the sampler is handed is
    # recorded in ``sampler_inputs`` (runner018)
    release_sample = False
    applied: set = frozenset()  # ids of the adapter's patches applied in this run (run_mode sets it)
    negative_input_ids = 0  # token ids < 0 handed to the model (a -1 would index the embedding out of range)

    def __init__(
        self, runner: Any, shape: EngineShape, *, seed: int, execute_patch: Any = None, sample_patch: Any = None
    ) -> None:
        self.runner, self.shape, self.k = runner, shape, shape.num_spec_tokens
        self.pattern = fakemodel.AcceptancePattern(seed, self.k)
        self.kv = np.zeros(shape.num_blocks * shape.block_size, dtype=np.int64)
        self.phase = "other"
        self.step = 0
        self.waits: dict[str, int] = defaultdict(int)
        self.blocking_waits: dict[str, int] = defaultdict(int)
        self.step_waits: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.spec_steps = 0
        self.spec_step_ids: set[int] = set()
        self.records: dict[int, dict[str, RowRecord]] = {}
        # per step: device and host seq_lens of the rows past num_reqs (what padded attention metadata, the FULL
        # graph's task-group update (seq_lens_list) and the drafter's FULL-graph pad branch read, up to the padded
        # count <= max_num_reqs)
        self.padded_seq_lens: dict[int, tuple] = {}
        # per step, with an MLA group: what the MLA builders built (mla_harness: "target", "draft", "graph_update")
        self.mla_records: dict[int, dict[str, Any]] = {}
        self.input_prep_waits = 0
        self.input_prep_records = 0
        # per step, with output ids in the sampling metadata (penalties, bad words): per request, the output ids and
        # the draft ids the release's _sample handed its sampler
        self.sampler_inputs: dict[int, dict[str, tuple[list, list]]] = {}
        self.copy_waits: dict[tuple[str, str], int] = defaultdict(int)
        self.state: StepState | None = None
        # scheduler / batch edge cases the run went through (EDGE_CASES; the same in both modes)
        self.edges: dict[str, int] = defaultdict(int)
        batch = runner.input_batch
        swap = batch.swap_states

        def swap_states(i1: int, i2: int) -> None:  # the decode-first reorder swaps rows through this method
            self.edges["rows_swapped"] += 1
            swap(i1, i2)

        batch.swap_states = swap_states
        runner.valid_sampled_token_count_event = LazyCountEvent(runner.valid_sampled_token_count_cpu, self)
        if getattr(runner, "prepare_inputs_event", None) is not None:
            runner.prepare_inputs_event = InputPrepEvent(runner.prepare_inputs_event, self)
        if self.release_sample and getattr(runner, "draft_token_ids_event", None) is not None:
            runner.draft_token_ids_event = CopyEvent(self, "draft_ids", runner.draft_token_ids_event)
        body = self.execute_model_body
        # the adapter's execute_model / sample_tokens patches wrap these mirrors of the release's bodies, through
        # their own factories
        self._execute = execute_patch.make(body) if execute_patch is not None else body

        def sample_body(runner: Any, so: Any) -> PendingOutput | None:
            if runner is not self.runner:  # the release's body is a method of the runner it is called on
                raise RuntimeError(f"sample_tokens called on {runner!r}, not the driver's runner")
            return self.sample_tokens_body(so)

        self._sample_tokens = sample_patch.make(sample_body) if sample_patch is not None else sample_body

    # -- wait accounting ---------------------------------------------------------------------------
    def count_wait(self, blocking: bool) -> None:
        self.waits[self.phase] += 1
        self.step_waits[self.step][self.phase] += 1
        if blocking:
            self.blocking_waits[self.phase] += 1

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        saved, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = saved

    # -- release hooks -----------------------------------------------------------------------------
    def prepare_step(self, runner: Any, so: Any) -> StepInputs | None:
        """The release's ``execute_model`` up to the forward (``_update_states``, input preparation, attention
        metadata); None where it returns early (nothing scheduled)."""
        raise NotImplementedError

    def spec_common_metadata(self, runner: Any) -> Any:
        """The common attention metadata the release hands ``prepare_next_token_ids_padded``."""
        raise NotImplementedError

    def draft_ids_unfilled(self, rid: str, num_drafts: int) -> bool:
        """Whether the release cannot fill this row's draft input ids (they are then not compared)."""
        return False

    def run_drafter(self, runner: Any, st: StepState, sampler_output: Any) -> tuple[Any, Any]:
        """The release's ``propose_draft_token_ids`` up to the draft model: the proposer's next-token ids and valid
        counts (``prepare_next_token_ids_padded``), the valid counts' copy. Returns (next token ids, valid counts);
        the drafts themselves come from the fake model. A release driver with an MLA group runs the release's
        proposer further (its attention metadata per draft position)."""
        next_ids, valid = runner.drafter.prepare_next_token_ids_padded(
            self.spec_common_metadata(runner),
            sampler_output.sampled_token_ids,
            runner.requests,
            runner.input_batch,
            runner.discard_request_indices.gpu,
            runner.num_discarded_requests,
        )
        runner._copy_valid_sampled_token_count(next_ids, valid)
        return next_ids, valid

    # -- execute_model -----------------------------------------------------------------------------
    def execute_model(self, so: Any, step: int) -> bool:
        self.step = step
        self.state = None
        self._execute(self.runner, so)
        return self.state is not None

    def execute_model_body(self, runner: Any, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        """The release's ``execute_model`` on the supported paths, the forward being the fake model."""
        so = scheduler_output
        if runner.execute_model_state is not None:
            raise RuntimeError("sample_tokens() must be called after execute_model() returns None")
        inputs = self.prepare_step(runner, so)
        if inputs is None:
            return None
        n = runner.input_batch.num_reqs
        total = so.total_num_scheduled_tokens
        qsl, input_ids, positions, slots = inputs.query_start_loc, inputs.input_ids, inputs.positions, inputs.slots
        seq_lens_cpu = inputs.seq_lens_cpu
        if min(seq_lens_cpu + inputs.num_computed_cpu, default=0) <= POISON // 2:  # no real count is that low
            raise PoisonedCounts(
                f"step {self.step}: CPU seq_lens / num_computed_tokens handed to attention derive "
                f"from the poisoned count buffer ({seq_lens_cpu}, {inputs.num_computed_cpu})"
            )
        # device and host rows (a padded FULL batch hands the host rows to the task-group update as seq_lens_list)
        self.padded_seq_lens[self.step] = (
            tuple(runner.seq_lens.gpu[n : runner.max_num_reqs].tolist()),
            tuple(runner.seq_lens.cpu[n : runner.max_num_reqs].tolist()),
        )
        self.negative_input_ids += int((input_ids < 0).sum())
        with self.in_phase("forward"):
            target, hidden = fakemodel.forward(
                self.kv,
                input_ids,
                positions,
                slots,
                qsl,
                seq_lens_cpu,
                inputs.block_table,
                n,
                self.shape.block_size,
                self.shape.vocab_size,
            )
        req_ids = list(runner.input_batch.req_ids)
        spec = so.scheduled_spec_decode_tokens
        num_drafts = [len(spec.get(r, ())) for r in req_ids]
        # a request whose last step had drafts sits at another row now (condense, decode-first reorder): its
        # previous-step values must be read at its previous row
        prev_rows = runner.input_batch.prev_req_id_to_index or {}
        prev_records = self.records.get(self.step - 1, {})
        for r, rid in enumerate(req_ids):
            was = prev_records.get(rid)
            if was is not None and was.drafted and prev_rows.get(rid, r) != r:
                self.edges["rows_moved_with_drafts"] += 1
        discarded = set(int(i) for i in runner.discard_request_indices.np[: runner.num_discarded_requests])
        max_seq_len = max(seq_lens_cpu) if seq_lens_cpu else 0
        rows = {}
        for r, rid in enumerate(req_ids):
            s, e = int(qsl[r]), int(qsl[r + 1])
            ids = input_ids[s:e].tolist()
            if num_drafts[r] and self.draft_ids_unfilled(rid, num_drafts[r]):
                self.unfilled_drafts += num_drafts[r]
                ids[len(ids) - num_drafts[r] :] = [UNFILLED] * num_drafts[r]
            rows[rid] = dict(
                positions=tuple(positions[s:e].tolist()),
                slots=tuple(slots[s:e].tolist()),
                input_ids=tuple(ids),
                seq_len_cpu=seq_lens_cpu[r],
                seq_len_gpu=inputs.seq_lens_gpu[r],
                num_computed_cpu=inputs.num_computed_cpu[r],
                max_seq_len=max_seq_len,
                discarded=r in discarded,
                drafted=num_drafts[r],
            )
        self.state = StepState(
            so, n, req_ids, qsl, input_ids, num_drafts, seq_lens_cpu, target, hidden, inputs.spec_meta, total, rows
        )
        if inputs.spec_meta is not None:
            self.spec_steps += 1
            self.spec_step_ids.add(self.step)
        runner.execute_model_state = ("zb-runner-parity", so)
        self.phase = "forward"  # the patch's work after this body returns happens after the forward launch
        return None

    # -- sample_tokens -----------------------------------------------------------------------------
    def sample_tokens(self, so: Any) -> PendingOutput | None:
        self.phase = "sample"
        return self._sample_tokens(self.runner, so)

    def release_sampler(self, runner: Any, spec_meta: Any, sampler_output: Any) -> None:
        """The release's ``_sample`` with its sampler and rejection sampler answering ``sampler_output`` (the fake
        model's); records the output ids and draft ids the sampler is handed, where the batch needs output ids."""
        step = self.step

        def sampler(*args: Any, **kwargs: Any) -> Any:
            md = kwargs["sampling_metadata"] if "sampling_metadata" in kwargs else args[3]
            if md.output_token_ids:
                spec = md.spec_token_ids or []
                self.sampler_inputs[step] = {
                    rid: (list(md.output_token_ids[r]), list(spec[r]) if r < len(spec) else [])
                    for r, rid in enumerate(runner.input_batch.req_ids)
                }
            return sampler_output

        saved = runner.sampler, runner.rejection_sampler
        runner.sampler = runner.rejection_sampler = sampler
        try:
            runner._sample(None, spec_meta)
        finally:
            runner.sampler, runner.rejection_sampler = saved

    def sample_tokens_body(self, so: Any) -> PendingOutput | None:
        """The release's ``sample_tokens``, padded EAGLE / MTP path: ``_sample`` (:meth:`release_sampler`, where
        :attr:`release_sample`), bookkeeping, then ``propose_draft_token_ids`` (``prepare_next_token_ids_padded``,
        ``_copy_valid_sampled_token_count``, the drafter) and the drafts' host copy."""
        import torch
        from vllm.v1.outputs import SamplerOutput

        self.phase = "sample"
        runner, st = self.runner, self.state
        self.state = None
        runner.execute_model_state = None
        n = st.n
        for rid in st.req_ids:
            st.rows[rid]["req_num_computed"] = int(runner.requests[rid].num_computed_tokens)
        sampled, accepted = fakemodel.rejection_sample(st.target, st.input_ids, st.qsl, st.num_drafts, n, self.k)
        if st.spec_meta is None:
            sampled = sampled[:, :1]
        sampler_output = SamplerOutput(
            sampled_token_ids=torch.tensor(sampled, dtype=torch.int32), logprobs_tensors=None
        )
        if self.release_sample:
            self.release_sampler(runner, st.spec_meta, sampler_output)
        hidden_t = torch.zeros((st.total, 1))
        (_, _, _, req_ids_copy, req_id_to_index_copy, invalid) = runner._bookkeeping_sync(
            st.so, sampler_output, None, hidden_t, st.total, st.spec_meta
        )
        num_computed_drafter = runner.input_batch.num_computed_tokens_cpu[:n].tolist()
        next_ids, valid = self.run_drafter(runner, st, sampler_output)
        nxt, valid_np = next_ids.numpy().astype(np.int64), valid.numpy().astype(np.int64)
        drafts = fakemodel.propose(
            st.hidden,
            nxt,
            valid_np,
            st.qsl,
            st.num_drafts,
            st.seq_lens_cpu,
            [fakemodel.req_key(r) for r in st.req_ids],
            n,
            self.k,
            self.shape.vocab_size,
            self.pattern,
        )
        runner._draft_token_ids = torch.tensor(drafts[:, : self.k], dtype=torch.int64)
        if self.release_sample:
            runner._copy_draft_token_ids_to_cpu(st.so)
        invalid_set = set(int(i) for i in invalid)
        out_tokens = []
        recs = {}
        for r, rid in enumerate(st.req_ids):
            toks = [] if r in invalid_set else [int(t) for t in sampled[r, : int(accepted[r]) + 1]]
            out_tokens.append(toks)
            row = st.rows[rid]
            recs[rid] = RowRecord(
                sampled=tuple(toks),
                accepted=int(accepted[r]) if toks else 0,
                next_token=int(nxt[r]),
                num_computed_cpu_drafter=int(num_computed_drafter[r]),
                **row,
            )
        self.records[self.step] = recs
        self.phase = "other"
        return PendingOutput(
            compat.model_runner_output(req_ids_copy, req_id_to_index_copy, out_tokens),
            sampler_output.sampled_token_ids.clone(),
            CopyEvent(self, "sampled_ids"),
        )


# ------------------------------------------------------------------------------------------------
# The engine loop (EngineCore.step_with_batch_queue, queue depth 2)
# ------------------------------------------------------------------------------------------------


@dataclass
class Run:
    scheduler: Any
    driver: Driver
    shape: EngineShape
    queue: deque = field(default_factory=deque)
    step: int = 0
    streams: dict = field(default_factory=dict)
    finish: dict = field(default_factory=dict)
    aborted: set = field(default_factory=set)
    pending_aborts: list = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    preemptions: int = 0
    requests: int = 0
    preempted_ids: set = field(default_factory=set)  # preempted, not yet scheduled again
    skipped: set = field(default_factory=set)  # left out of a step while holding drafts, not yet scheduled again
    # every `early`-th step's output is processed before the next step is scheduled (0: never), as vLLM 0.13 / 0.18's
    # engine core does when the step's output is already there when it asks: the next step's counts are then exact
    early: int = 0

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
            self.requests += 1

    def iteration(self, abort_after: dict[str, int]) -> None:
        sched = self.scheduler
        if sched.has_requests():
            # running requests that hold drafts (async: k draft placeholders) and their computed counts
            holding = {
                r.request_id: (len(r.spec_token_ids), r.num_computed_tokens) for r in sched.running if r.spec_token_ids
            }
            so = sched.schedule()
            self.step += 1
            self.preemptions += len(getattr(so, "preempted_req_ids", None) or ())
            self._count_edges(so, holding)
            executed = self.driver.execute_model(so, self.step)
            out = self.driver.sample_tokens(so) if executed else None
            self.queue.appendleft((out, so))
            if self.early and self.step % self.early == 0:
                while self.queue:
                    self._finish_one(abort_after)
                return
            if len(self.queue) < 2:
                return
        elif not self.queue:
            return
        self._finish_one(abort_after)

    def _count_edges(self, so: Any, holding: dict[str, tuple[int, int]]) -> None:
        """The scheduler's edge cases of this step (:data:`EDGE_CASES`), into ``driver.edges``."""
        edges = self.driver.edges
        scheduled = so.num_scheduled_tokens
        spec = so.scheduled_spec_decode_tokens
        preempted = set(getattr(so, "preempted_req_ids", None) or ())
        for rid, (held, computed) in holding.items():
            if rid not in scheduled:
                if rid not in preempted:
                    edges["skipped_holding_drafts"] += 1
                    self.skipped.add(rid)
                continue
            if len(spec.get(rid, ())) < held:
                # scheduler: min(budget left, max_model_len - 1 - num_computed_tokens) tokens, drafts cut to fit
                cause = "max_model_len" if computed + scheduled[rid] >= self.shape.max_model_len - 1 else "token_budget"
                edges[f"drafts_cut_{cause}"] += 1
        for rid in scheduled:
            if rid in self.preempted_ids:
                edges["resumed_after_preemption"] += 1
                self.preempted_ids.discard(rid)
            if rid in self.skipped:
                edges["rescheduled_after_skip"] += 1
                self.skipped.discard(rid)
        edges["preempted"] += len(preempted)
        self.preempted_ids |= preempted

    def _finish_one(self, abort_after: dict[str, int]) -> None:
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
        from vllm.v1.request import RequestStatus

        out, so = self.queue.pop()
        model_output = out.get_output() if out is not None else EMPTY_MODEL_RUNNER_OUTPUT
        if self.pending_aborts:
            live = [r for r in self.pending_aborts if r in self.scheduler.requests]
            if live:
                self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
                self.aborted.update(live)
            self.pending_aborts.clear()
        eco = self.scheduler.update_from_output(so, model_output)
        for e in (eco or {}).values():
            sds = getattr(getattr(e, "scheduler_stats", None), "spec_decoding_stats", None)
            if sds is not None:
                self.drafted += sds.num_draft_tokens
                self.accepted += sds.num_accepted_tokens
            for o in e.outputs:
                stream = self.streams.setdefault(o.request_id, [])
                stream.extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finish[o.request_id] = str(o.finish_reason)
                else:
                    lim = abort_after.get(o.request_id)
                    if lim is not None and len(stream) >= lim and o.request_id not in self.aborted:
                        self.pending_aborts.append(o.request_id)

    def idle(self) -> bool:
        return not self.queue and not self.scheduler.has_requests()


def drive(run: Run, specs: list[RequestSpec], iterations: int) -> None:
    by_arrival: dict[int, list[RequestSpec]] = defaultdict(list)
    for s in specs:
        by_arrival[s.arrival].append(s)
    abort_after = {s.req_id: s.abort_after for s in specs if s.abort_after is not None}
    it = 0
    limit = iterations * 5 + 2000
    while it < limit:
        if it < iterations:
            run.add(by_arrival.get(it, []))
        run.iteration(abort_after)
        it += 1
        if it >= iterations and run.idle():
            break
    while run.queue:
        run._finish_one(abort_after)


# ------------------------------------------------------------------------------------------------
# Unpatched vs patched
# ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def phase_spy(driver_cls: type[Driver], driver_ref: list) -> Iterator[None]:
    """A ``functools.wraps`` spy on the release method named by ``driver_cls.inputs_queued`` (below any patch:
    fingerprints see through it) that moves the driver from phase ``prepare_inputs:release`` to
    ``prepare_inputs:after`` once that method returned (the step's inputs are queued)."""
    module, cls_name, name = driver_cls.inputs_queued
    cls = getattr(importlib.import_module(module), cls_name)
    original = cls.__dict__[name]

    @functools.wraps(original)
    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if driver_ref and driver_ref[0].phase == "prepare_inputs:release":
            driver_ref[0].phase = "prepare_inputs:after"
        return result

    setattr(cls, name, spy)
    try:
        yield
    finally:
        setattr(cls, name, original)


@contextlib.contextmanager
def reference_kernels() -> Iterator[None]:
    """Run zb-patch's device ops on their pure-torch twins for the duration (the Triton kernels are proved against
    the twins by tests/kernels; under TRITON_INTERPRET=1 every launch would go through Triton's interpreter)."""
    from zb_patch.kernels import _launch

    saved = _launch._interpret
    _launch._interpret = False
    try:
        yield
    finally:
        _launch._interpret = saved


@dataclass
class RunResult:
    mode: str
    steps: int
    spec_steps: int
    requests: int
    finished: int
    aborted: int
    preemptions: int
    tokens: int
    drafted: int
    accepted: int
    waits: dict
    blocking_waits: dict
    before_prep_per_spec_step: float
    min_before_prep_per_spec_step: int
    max_before_prep_per_step: int
    max_waits_per_step: int
    unfilled_drafts: int
    negative_input_ids: int
    input_prep_waits: int  # host waits on prepare_inputs_event (the release's own plus any a patch adds)
    input_prep_records: int  # records of prepare_inputs_event (the release's own plus any a patch adds)
    prepared_steps: int  # steps whose inputs were prepared (something was scheduled)
    seconds: float
    padded_seq_lens: dict
    mla_records: dict
    edges: dict
    streams: dict
    finish: dict
    records: dict
    zb: dict
    sampler_inputs: dict = field(default_factory=dict)  # Driver.sampler_inputs
    copy_waits: dict = field(default_factory=dict)  # Driver.copy_waits
    runner: Any = None

    def summary(self) -> dict:
        keys = (
            "mode",
            "steps",
            "spec_steps",
            "requests",
            "finished",
            "aborted",
            "preemptions",
            "tokens",
            "drafted",
            "accepted",
            "waits",
            "blocking_waits",
            "before_prep_per_spec_step",
            "min_before_prep_per_spec_step",
            "max_before_prep_per_step",
            "max_waits_per_step",
            "unfilled_drafts",
            "negative_input_ids",
            "input_prep_waits",
            "input_prep_records",
            "prepared_steps",
            "seconds",
            "edges",
            "zb",
        )
        return {k: getattr(self, k) for k in keys}


@dataclass
class WorkerOf:
    """The worker as a wrapper of ``NPUWorker.execute_model`` reads it: its model runner."""

    model_runner: Any


def _route_through_worker(driver: Driver, worker_patch: Any) -> None:
    """The driver's step through ``worker_patch``'s wrapper of ``NPUWorker.execute_model``, around the runner's."""
    step = driver._execute
    worker = WorkerOf(driver.runner)
    wrapped = worker_patch.make(lambda w, so: step(w.model_runner, so))
    driver._execute = lambda runner, so: wrapped(worker, so)


def run_mode(
    sess: Session,
    shape: EngineShape,
    specs: list[RequestSpec],
    iterations: int,
    *,
    release: Any,
    seed: int,
    patched: bool,
    reorder: bool = True,
    method: str = "eagle",
    runner_hook: Any = None,
    disabled: tuple[str, ...] = (),
    early: int = 0,
) -> RunResult:
    """One run. ``release``: the release's harness module (``Driver``, ``ADAPTER``, ``ZERO_BUBBLE``). ``patched``:
    the adapter is applied, less the patch ids in ``disabled`` (as ``ZB_PATCH_DISABLE`` does: a disabled member
    of a group disables its group). ``early``: :attr:`Run.early`. An applied patch of ``NPUWorker.execute_model``
    (it reads the worker's runner only) wraps the driver's step, as the worker's call wraps the runner's."""
    from zb_patch import registry as R

    adapter = release.ADAPTER
    vc = build_config(sess, shape, method=method)
    kvc = kv_cache_config(vc, shape)
    driver_ref: list = []
    t0 = time.time()
    mla = vc.model_config.use_mla
    rope = mla_harness.mla_session(vc) if mla else contextlib.nullcontext()
    with phase_spy(release.Driver, driver_ref), rope:
        execute_patch = sample_patch = worker_patch = None
        applied: set[str] = set()
        if patched:
            report = adapter.patch_set.apply(disabled=disabled)
            if report.verdict != R.APPLIED:
                raise RuntimeError(f"adapter did not apply: {report.reason}")
            applied = set(report.by_verdict(R.APPLIED))
            live = [p for p in adapter.patch_set.patches if p.id in applied]
            execute_patch, sample_patch = (
                next((p for p in live if p.target.endswith(f"NPUModelRunner.{m}")), None)
                for m in ("execute_model", "sample_tokens")
            )
            worker_patch = next((p for p in live if p.target.endswith("NPUWorker.execute_model")), None)
        try:
            runner = make_runner(vc, kvc, reorder=reorder)
            if runner_hook is not None:
                runner_hook(runner)
            driver = release.Driver(runner, shape, seed=seed, execute_patch=execute_patch, sample_patch=sample_patch)
            driver.applied = applied
            if worker_patch is not None:
                _route_through_worker(driver, worker_patch)
            driver_ref.append(driver)
            run = Run(make_scheduler(vc, kvc, shape), driver, shape, early=early)
            drive(run, specs, iterations)
        finally:
            if patched:
                adapter.patch_set.unpatch()
    free = run.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    if free != shape.num_blocks - 1:
        raise AssertionError(f"KV pool not returned: {free}/{shape.num_blocks - 1} free")
    if runner.requests:
        raise AssertionError(f"runner still holds requests: {sorted(runner.requests)[:5]}")
    before = [driver.step_waits[s].get("update_states", 0) for s in driver.spec_step_ids]
    zb_state = runner.__dict__.get(release.ZERO_BUBBLE.state_attr)
    zb = (
        {}
        if zb_state is None
        else {
            "active": zb_state.active,
            "reason": zb_state.reason,
            "steps": zb_state.steps,
            "corrected_steps": zb_state.corrected_steps,
            "host_waits": zb_state.host_waits,
            "fallback_uploads": zb_state.fallback_uploads,
            "in_prepare": zb_state.in_prepare,
        }
    )
    all_before = [driver.step_waits[s].get("update_states", 0) for s in range(1, run.step + 1)]
    return RunResult(
        mode="patched" if patched else "unpatched",
        steps=run.step,
        spec_steps=driver.spec_steps,
        requests=run.requests,
        finished=len(run.finish),
        aborted=len(run.aborted),
        preemptions=run.preemptions,
        tokens=sum(len(s) for s in run.streams.values()),
        drafted=run.drafted,
        accepted=run.accepted,
        waits=dict(driver.waits),
        blocking_waits=dict(driver.blocking_waits),
        before_prep_per_spec_step=(sum(before) / len(before)) if before else 0.0,
        min_before_prep_per_spec_step=min(before) if before else 0,
        max_before_prep_per_step=max(all_before) if all_before else 0,
        max_waits_per_step=max((sum(w.values()) for w in driver.step_waits.values()), default=0),
        unfilled_drafts=driver.unfilled_drafts,
        negative_input_ids=driver.negative_input_ids,
        input_prep_waits=driver.input_prep_waits,
        input_prep_records=driver.input_prep_records,
        prepared_steps=len(driver.records),
        padded_seq_lens=driver.padded_seq_lens,
        mla_records=driver.mla_records,
        edges=dict(driver.edges),
        seconds=round(time.time() - t0, 2),
        streams=run.streams,
        finish=run.finish,
        records=driver.records,
        zb=zb,
        sampler_inputs=driver.sampler_inputs,
        copy_waits=dict(driver.copy_waits),
        runner=runner,
    )


def compare(
    ref: RunResult, got: RunResult, limit: int = 20, kinds: dict[str, int] | None = None
) -> tuple[int, list[str], str | None]:
    """Per-step comparison of everything the forward, the padded attention metadata and the drafter saw and
    produced (per request, plus the padded device seq_lens rows; with an MLA group every field of what its builders
    built, mla_harness), then the token streams. Returns the number of divergences, up to ``limit`` examples, and
    what diverged first (a RowRecord field, ``"padded_seq_lens"``, ``"mla target"``, ...); ``kinds`` (if given)
    receives the count per kind."""
    diffs = 0
    examples: list[str] = []
    first: str | None = None

    def note(what: str, msg: str) -> None:
        nonlocal diffs, first
        diffs += 1
        first = first or what
        if kinds is not None:
            kinds[what] = kinds.get(what, 0) + 1
        if len(examples) < limit:
            examples.append(msg)

    for step in sorted(set(ref.records) | set(got.records)):
        a, b = ref.records.get(step, {}), got.records.get(step, {})
        for rid in sorted(set(a) | set(b)):
            ra, rb = a.get(rid), b.get(rid)
            if ra is None or rb is None:
                note("scheduled", f"step {step} {rid}: scheduled {ra is not None} vs {rb is not None}")
                continue
            for f in RowRecord.FIELDS:
                va, vb = getattr(ra, f), getattr(rb, f)
                if va != vb:
                    note(f, f"step {step} {rid} {f}: {va} vs {vb}")
        pa, pb = ref.padded_seq_lens.get(step), got.padded_seq_lens.get(step)
        if pa != pb:
            note("padded_seq_lens", f"step {step} padded seq_lens rows: {pa} vs {pb}")
        ma, mb = ref.mla_records.get(step, {}), got.mla_records.get(step, {})
        for part in sorted(set(ma) | set(mb)):
            for key, va, vb in mla_fields(ma.get(part), mb.get(part)):
                if va != vb:
                    note(f"mla {part}", f"step {step} MLA {part} {key}: {_short(va)} vs {_short(vb)}")
    if ref.steps != got.steps:
        note("steps", f"steps: {ref.steps} vs {got.steps}")
    for rid in sorted(set(ref.streams) | set(got.streams)):
        if ref.streams.get(rid) != got.streams.get(rid) or ref.finish.get(rid) != got.finish.get(rid):
            note("streams", f"{rid}: token stream / finish differ ({ref.finish.get(rid)} vs {got.finish.get(rid)})")
    for attr in ("drafted", "accepted", "tokens", "finished", "aborted", "preemptions"):
        if getattr(ref, attr) != getattr(got, attr):
            note(attr, f"{attr}: {getattr(ref, attr)} vs {getattr(got, attr)}")
    return diffs, examples, first


def mla_fields(a: Any, b: Any) -> Iterator[tuple[str, Any, Any]]:
    """(field, unpatched value, patched value) of one recorded MLA part: a flattened metadata dict, a list of them
    (one per draft position / per layer update), or None when the step did not build it."""
    if isinstance(a, list) or isinstance(b, list):
        a, b = a or [], b or []
        for i in range(max(len(a), len(b))):
            for key, va, vb in mla_fields(a[i] if i < len(a) else None, b[i] if i < len(b) else None):
                yield f"[{i}].{key}", va, vb
        return
    a, b = a or {}, b or {}
    for key in sorted(set(a) | set(b)):
        yield key, a.get(key, "<absent>"), b.get(key, "<absent>")


def mla_coverage(res: RunResult) -> dict[str, Any]:
    """What a run's MLA records cover: per part, the steps that recorded it, the distinct fields and the values
    compared; the steps whose prefill loaded its context in chunks (and in two or more), the FULL steps whose batch
    was padded (a 0 kv length in the graph update), the most draft positions recorded in a step."""
    import re

    steps: dict[str, int] = defaultdict(int)
    names: dict[str, set] = defaultdict(set)
    values: dict[str, int] = defaultdict(int)
    chunked = multi_chunk = padded_full = max_drafts = 0
    for rec in res.mla_records.values():
        for part, v in rec.items():
            steps[part] += 1
            for key, _, _ in mla_fields(v, v):
                names[part].add(re.sub(r"^\[\d+\]\.", "", key))
                values[part] += 1
        chunks = rec["target"].get("prefill.chunked_context.seq_tot") or ()
        chunked += bool(chunks)
        multi_chunk += len(chunks) >= 2
        for call in rec.get("graph_update", [])[:1]:
            kv = call.get("actual_seq_kvlen", call.get("actual_seq_lengths_kv")) or (1,)
            padded_full += kv[-1] == 0
        max_drafts = max(max_drafts, len(rec.get("draft", ())))
    return {
        "steps": dict(steps),
        "fields": {p: len(n) for p, n in names.items()},
        "values": dict(values),
        "context_chunk_steps": chunked,
        "multi_chunk_steps": multi_chunk,
        "padded_full_steps": padded_full,
        "max_draft_positions": max_drafts,
    }


def _short(v: Any, width: int = 160) -> str:
    text = repr(v)
    return text if len(text) <= width else text[: width - 3] + "..."


def zero_bubble_and_fix_ids(adapter: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The adapter's zero-bubble patch ids (its ``zero-bubble-*`` group) and the ids of its other patches (fixes of
    the release's own defects)."""
    patches = adapter.patch_set.patches
    zb = tuple(p.id for p in patches if p.group.startswith("zero-bubble"))
    return zb, tuple(p.id for p in patches if p.id not in zb)


def parity(
    sess: Session,
    shape: EngineShape,
    iterations: int,
    *,
    seed: int,
    release: Any,
    reorder: bool = True,
    triton: bool = False,
    method: str = "eagle",
    runner_hook: Any = None,
    fixes: bool = True,
    early: int = 0,
) -> dict:
    """The same seeded workload in the release's classic async form ("unpatched"), then with zero-bubble
    ("patched"); ``runner_hook`` runs on the patched run's runner only. ``fixes``: both runs carry the adapter's
    fixes of the release's own defects (the unpatched run applies only those: ``ZB_PATCH_DISABLE=<the zero-bubble
    group>``), so zero-bubble is held to classic async with the same fixes; False: the unpatched run is the bare
    release and the patched run leaves the fixes out. ``early``: :attr:`Run.early`, both runs."""
    specs = make_workload(seed, shape, iterations)
    zb_ids, fix_ids = zero_bubble_and_fix_ids(release.ADAPTER)
    ctx = contextlib.nullcontext() if triton else reference_kernels()
    with ctx:
        ref = run_mode(
            sess,
            shape,
            specs,
            iterations,
            release=release,
            seed=seed,
            patched=bool(fixes and fix_ids),
            disabled=zb_ids[:1],
            reorder=reorder,
            method=method,
            early=early,
        )
        got = run_mode(
            sess,
            shape,
            specs,
            iterations,
            release=release,
            seed=seed,
            patched=True,
            disabled=() if fixes else fix_ids,
            reorder=reorder,
            method=method,
            runner_hook=runner_hook,
            early=early,
        )
    kinds: dict[str, int] = {}
    diffs, examples, first = compare(ref, got, kinds=kinds)
    return {
        "k": shape.num_spec_tokens,
        "iterations": iterations,
        "divergences": diffs,
        "examples": examples,
        "first_divergence": first,
        "divergence_kinds": kinds,
        "waits_for_input_prep": release.ZERO_BUBBLE.waits_for_input_prep,
        "unpatched": ref.summary(),
        "patched": got.summary(),
        "mla": mla_coverage(ref),
        "mla_records": (ref.mla_records, got.mla_records),
        "runners": (ref.runner, got.runner),
    }
