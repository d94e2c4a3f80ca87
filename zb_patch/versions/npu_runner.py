"""Zero-bubble async scheduling + EAGLE / MTP speculative decoding on vllm-ascend's V1 ``NPUModelRunner``, written
once for the releases that run it in the classic form (vllm-ascend 0.13 and 0.18).

There, the inherited vLLM ``GPUModelRunner._update_states`` waits for step N's accepted-draft counts before the host
can prepare step N+1. :class:`ZeroBubble` removes that wait with wrappers of the release's methods (no copy of an
upstream method), per step:

1. ``_update_states``: optimistic counts (every draft accepted) instead of the wait; the rows the release looked
   up are this step's corrections (:meth:`ZeroBubble.make_update_states`).
2. Once the release has queued the step's inputs (where exactly is the release's hook): :meth:`ZeroBubble.correct`
   -- on the device and without waiting, the token counts, ``positions.gpu``, ``seq_lens.gpu`` and every slot
   mapping the release computes; then the one host wait for step N's counts, which makes ``seq_lens.cpu`` and
   ``num_computed_tokens_cpu`` exact (Ascend attention reads CPU seq_lens).
3. ``execute_model``: after the forward launch, exact ``req_state.num_computed_tokens`` and ``output_token_ids`` (the
   rejected drafts' placeholders trimmed, the min-tokens processor told: :meth:`ZeroBubble.trim_placeholders`).
4. ``_copy_valid_sampled_token_count``: keeps the device counts for the next step's device correction.
5. ``prepare_next_token_ids_padded``: alternating backup-token staging buffers.

Once, at ``initialize_kv_cache``: the kernels of step 2 are launched on no request, so Triton compiles them while the
engine starts (:meth:`ZeroBubble.compile_kernels`).

A release module subclasses :class:`ZeroBubble` for what differs (the ``_prepare_inputs`` hook of step 2,
``count_base``, ``waits_for_input_prep``, extra activation checks); the specs of the wrappers both releases share
are :func:`zb_patch.versions.zero_bubble_classic.patches`'s, each with its why / how / upstream / remove-when.

This module is imported when an adapter is selected, so numpy, torch and zb-patch's kernels are imported inside the
functions that use them: only once a patch is applied. On the per-step path nothing copies device->host or calls
``.item()`` / ``.tolist()`` on a device tensor; the host waits only where a docstring says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..registry import BACKPORT, ONE_STREAM, RestsOn
from .fixes.exact_counts_after_early_output import already_exact

# What the zero-bubble patches of ascend-0.13 / ascend-0.18 rest on (their specs' rests_on).
ZERO_BUBBLE_BACKPORT = RestsOn(
    BACKPORT,
    "vLLM #32951 (vLLM 0.19) and vllm-ascend #7640 / #8461 / #10506 (native on NPUs from 0.19.1rc1): the host assumes "
    "every draft accepted, the device corrects its own counts; the port verified on the stand-ins (runner parity with "
    "vLLM's scheduler on the CPU, tokens through the release's engine on the CPU and on CUDA, eager and graph modes)",
)
BACKUP_STAGING_ONE_STREAM = RestsOn(
    ONE_STREAM,
    "the backup tokens' host-to-device copy and the input-preparation event the host waits on before that buffer is "
    "written again are queued on one stream, the copy first, so the event completes after the copy; the wait is the "
    "release's own event.synchronize(), the contract every pinned staging buffer of vLLM's input preparation rests on",
)

SUPPORTED_METHODS = ("eagle", "eagle3", "mtp")


_ZERO_BUBBLE: Any = None


def _zero_bubble() -> Any:
    """``zb_patch.zero_bubble`` (numpy, torch, the kernels), imported on first use: the adapters import this module on
    the activation path, where torch is not imported yet; kept, because a ``from .. import`` in a per-step hook costs
    more than the hook's own host arithmetic."""
    global _ZERO_BUBBLE
    if _ZERO_BUBBLE is None:
        from .. import zero_bubble

        _ZERO_BUBBLE = zero_bubble
    return _ZERO_BUBBLE


@dataclass
class Section:
    """Elements of the staging buffer: the same range as a host (pinned numpy) and a device view."""

    np: Any
    gpu: Any


@dataclass
class Buffers:
    """Device buffers and the pinned staging buffer of one runner (allocated once, at activation).

    The staging buffer is one int32 ``CpuGpuBuffer`` in sections, in this order, so that a step uploads what it
    reads with one host-to-device copy of a prefix: ``cpu_counts`` first (an exact step reads only it), the
    per-request sections next, ``query_pos`` last (a corrected step's prefix ends at its ``total``-th token)."""

    num_computed: Any  # device int32 [max_num_reqs]: this step's exact counts (next step: previous rows)
    staging: Any  # CpuGpuBuffer int32: the sections below, in this order
    cpu_counts: Section  # [max_num_reqs]: private snapshot of num_computed_tokens_cpu
    num_scheduled: Section  # [max_num_reqs]
    prev_positions: Section  # [max_num_reqs]: each row's index in the previous batch
    prev_drafts: Section  # [max_num_reqs]: drafts of step N at step N's rows
    req_indices: Section  # [max_num_tokens]
    query_pos: Section  # [max_num_tokens], at offset query_pos_at
    query_pos_at: int
    counts: Any = None  # zero_bubble.CountCorrection bound to these buffers and the runner's (count_base: its base)
    slot_mappers: dict = field(default_factory=dict)  # id(block table) -> (table, launcher)


@dataclass
class State:
    """What zero-bubble keeps per runner between its wrapped methods."""

    active: bool
    reason: str = ""
    buffers: Buffers = None  # type: ignore[assignment]  # set at activation; None only on inactive states
    # this step: (req_id, drafts assumed accepted, previous row) per request the release looked up
    queue: list = field(default_factory=list)
    out_lens: dict = field(default_factory=dict)  # this step: req_id -> len(output_token_ids) before the placeholders
    num_prev: int = 0
    valid_gpu: Any = None  # device valid counts of the last proposing step (consumed once)
    valid_host: list | None = None  # step N's counts once the host waited for them (this step)
    in_prepare: bool = False  # inside a release's _prepare_inputs window, correction not yet made
    backup_flip: int = 0
    prev_scheduled: dict = field(default_factory=dict)  # the previous step's scheduled tokens per request
    # diagnostics (tests, doctor-style reports)
    steps: int = 0
    corrected_steps: int = 0
    host_waits: int = 0
    fallback_uploads: int = 0


def runner_report(runner: Any) -> dict | None:
    """zb-patch's zero-bubble state of ``runner`` (active or the reason, steps, corrected steps, host waits, fallback
    uploads), or None when no wrapper of this module ever saw the runner (nothing applied, or native zero-bubble)."""
    for value in vars(runner).values():
        if isinstance(value, State):
            keys = ("active", "reason", "steps", "corrected_steps", "host_waits", "fallback_uploads")
            return {key: getattr(value, key) for key in keys}
    return None


class OptimisticCounts(list):
    """What ``_get_valid_sampled_token_count()`` returns while the release's ``_update_states`` runs:
    ``drafts + 1`` at every previous row (all drafts accepted). Records the rows the release reads -- exactly the
    requests it would have corrected in the classic form."""

    def __init__(self, values: list[int]) -> None:
        super().__init__(values)
        self.read: list[int] = []

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int):
            self.read.append(index)
        return super().__getitem__(index)


def computes_slot_mapping(block_table: Any) -> bool:
    """Whether the release's numpy ``BlockTable.compute_slot_mapping`` writes this table's slot mapping (non-CP
    branch: only when the kernel block size is the first of ``kernel_sizes``)."""
    sizes = getattr(block_table, "kernel_sizes", None)
    return sizes is not None and len(sizes) > 0 and block_table.block_size == sizes[0]


def slot_mapper(buffers: Buffers, block_table: Any) -> Callable:
    """The slot-mapping launcher of ``block_table`` (built once, kept in ``buffers.slot_mappers``)."""
    key = id(block_table)
    entry = buffers.slot_mappers.get(key)
    if entry is None or entry[0] is not block_table:
        from .. import zero_bubble

        mapper = zero_bubble.slot_mapper(
            block_table.block_table.gpu,
            block_table.slot_mapping.gpu,
            block_size=block_table.block_size,
            max_num_tokens=block_table.max_num_batched_tokens,
            physical_block_size=block_table.physical_block_size,
        )
        entry = buffers.slot_mappers[key] = (block_table, mapper)
    return entry[1]


class ZeroBubble:
    """The zero-bubble wrappers of one release's ``NPUModelRunner`` and the per-runner state they share.

    Release hooks (class attributes / methods a release module overrides):

    * ``count_base``: how the device counts are corrected (the ``base`` of
      :class:`zb_patch.zero_bubble.CountCorrection`): ``"previous"`` (previous device counts + valid counts) or
      ``"cpu"`` (this step's CPU counts minus the rejected drafts).
    * ``waits_for_input_prep``: the ``_update_states`` wrapper first waits on ``prepare_inputs_event`` (for a
      release whose ``execute_model`` does not enter ``synchronize_input_prep``).
    * ``valid_count_dtype``: the dtype of the drafter's device valid counts (the kernels are compiled for it).
    * :meth:`unsupported_reason`: extra activation checks.
    * a ``_prepare_inputs`` wrapper that calls :meth:`correct` once the step's inputs are queued.
    """

    count_base = "previous"
    waits_for_input_prep = False
    # dtype of the device valid counts the drafter hands over (vllm-ascend 0.13 / 0.18 eagle_proposer
    # prepare_next_token_ids_padded: valid_mask.sum(dim=1)); the kernels are compiled for it at start-up
    valid_count_dtype = "int64"

    def __init__(self, release: str, *, other_runners: str) -> None:
        tag = release.replace(".", "")
        self.release = release
        self.other_runners = other_runners  # the release's other runner classes, for the unsupported message
        self.state_attr = f"_zb_patch_{tag}"  # per-runner state, in the runner's __dict__
        self.backup_pair_attr = f"_zb_patch_{tag}_backup_pair"  # in the drafter's __dict__
        self.logger = logging.getLogger(f"vllm.zb_patch.ascend_{release.replace('.', '_')}")
        self.warned: set[str] = set()  # reasons already logged in this process
        self.compile_seconds: list[float] = []  # per runner of this process: compile_kernels' time at start-up

    # -- activation and per-runner state -------------------------------------------------------------------

    def unsupported_reason(self, runner: Any) -> tuple[bool, str]:
        """``(wanted, reason)``: ``reason == ""`` means zero-bubble can run on this runner. ``wanted`` is False when
        async scheduling + spec decode is simply off (nothing to do, no warning)."""
        spec = getattr(runner, "speculative_config", None)
        if (
            not getattr(runner, "use_async_scheduling", False)
            or spec is None
            or not getattr(spec, "num_speculative_tokens", 0)
        ):
            return False, "async scheduling with speculative decoding is off"
        method = getattr(spec, "method", None)
        if method not in SUPPORTED_METHODS:
            return True, f"speculative method {method!r} (zero-bubble supports {', '.join(SUPPORTED_METHODS)})"
        if getattr(spec, "disable_padded_drafter_batch", False):
            return True, "disable_padded_drafter_batch=True (zero-bubble needs the padded drafter)"
        from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

        if type(runner) is not NPUModelRunner:
            return True, (
                f"runner class {type(runner).__module__}.{type(runner).__qualname__} (only the release's "
                f"NPUModelRunner is verified; {self.other_runners} runners keep the classic path)"
            )
        if getattr(runner, "valid_sampled_token_count_event", None) is None:
            return True, "the runner has no valid_sampled_token_count_event"
        if runner.parallel_config.pipeline_parallel_size > 1:
            return True, "pipeline parallelism > 1"
        if getattr(runner, "pcp_size", 1) * getattr(runner, "dcp_size", 1) > 1:
            return True, "prefill / decode context parallelism > 1"
        if getattr(runner, "uses_mrope", False) or getattr(runner, "uses_xdrope_dim", 0) > 0:
            return True, "M-RoPE / XD-RoPE positions (computed on the host from the token counts)"
        if (
            getattr(runner, "need_accepted_tokens", False)
            or getattr(runner.cache_config, "mamba_cache_mode", None) == "align"
        ):
            return True, "hybrid model (Mamba / GDN accepted-token state)"
        if getattr(runner, "is_pooling_model", False):
            return True, "pooling model"
        return True, ""

    def state_of(self, runner: Any) -> State:
        """The runner's zero-bubble state, created (and activation decided) on first use."""
        st = runner.__dict__.get(self.state_attr)
        if st is None:
            wanted, reason = self.unsupported_reason(runner)
            st = State(active=wanted and not reason, reason=reason)
            if st.active:
                st.buffers = self._allocate(runner)
                self.logger.info(
                    "zb-patch: zero-bubble async scheduling + spec decode active on this NPUModelRunner "
                    "(method %s, k=%d)",
                    runner.speculative_config.method,
                    runner.speculative_config.num_speculative_tokens,
                )
            elif wanted and reason not in self.warned:
                self.warned.add(reason)
                self.logger.warning(
                    "zb-patch: zero-bubble NOT active for async scheduling + speculative decoding: "
                    "%s. vllm-ascend %s's classic path runs (one blocking accepted-count sync per "
                    "step).",
                    reason,
                    self.release,
                )
            runner.__dict__[self.state_attr] = st
        return st

    def active(self, runner: Any) -> State | None:
        """The runner's state when zero-bubble is active on it, else None."""
        st = runner.__dict__.get(self.state_attr)
        return st if st is not None and st.active else None

    def _allocate(self, runner: Any) -> Buffers:
        import torch

        max_reqs = runner.max_num_reqs
        max_tokens = runner.positions.gpu.shape[0]
        # every section starts 64-byte aligned, as a buffer of its own would
        rows, tokens = (-(-n // 16) * 16 for n in (max_reqs, max_tokens))
        staging = runner._make_buffer(4 * rows + tokens + max_tokens, dtype=torch.int32)

        def section(start: int, length: int) -> Section:
            return Section(staging.np[start : start + length], staging.gpu[start : start + length])

        b = Buffers(
            num_computed=torch.zeros(max_reqs, dtype=torch.int32, device=runner.device),
            staging=staging,
            cpu_counts=section(0, max_reqs),
            num_scheduled=section(rows, max_reqs),
            prev_positions=section(2 * rows, max_reqs),
            prev_drafts=section(3 * rows, max_reqs),
            req_indices=section(4 * rows, max_tokens),
            query_pos=section(4 * rows + tokens, max_tokens),
            query_pos_at=4 * rows + tokens,
        )
        from .. import zero_bubble

        b.counts = zero_bubble.CountCorrection(
            num_computed_tokens=b.num_computed,
            seq_lens=runner.seq_lens.gpu,
            num_scheduled_tokens=b.num_scheduled.gpu,
            prev_positions=b.prev_positions.gpu,
            prev_num_draft_tokens=b.prev_drafts.gpu,
            req_indices=b.req_indices.gpu,
            query_pos=b.query_pos.gpu,
            positions=runner.positions.gpu,
            base=self.count_base,
        )
        return b

    # -- _update_states: optimistic counts instead of the blocking sync -----------------------------------

    def make_update_states(self, original: Callable) -> Callable:
        def _update_states(runner, scheduler_output):
            st = self.state_of(runner)
            if not st.active:
                return original(runner, scheduler_output)
            if self.waits_for_input_prep:
                # vLLM's synchronize_input_prep wait: the previous step's host-to-device copies from the reused
                # host buffers have run before this step rewrites them
                event = getattr(runner, "prepare_inputs_event", None)
                if event is not None:
                    event.synchronize()
            st.queue = []
            st.valid_host = None
            st.steps += 1
            # rows whose scheduler count already has step N's rejections subtracted (the engine core processed
            # step N's output before scheduling this step): nothing to correct there
            exact = already_exact(runner, scheduler_output, st.prev_scheduled) if st.prev_scheduled else {}
            st.prev_scheduled = dict(scheduler_output.num_scheduled_tokens)
            batch = runner.input_batch
            prev_sampled = batch.prev_sampled_token_ids
            b = st.buffers
            zero_bubble = _zero_bubble()
            if prev_sampled is None or runner.valid_sampled_token_count_event is None:
                st.num_prev = 0
                zero_bubble.optimistic_advance((), (), b.prev_drafts.np)  # no drafts to carry: the buffer is cleared
                return original(runner, scheduler_output)  # no previous step to wait for: no sync either way
            st.num_prev = int(prev_sampled.shape[0])
            values = [1] * st.num_prev
            row_req: dict[int, str] = {}
            out_lens = st.out_lens = {}
            for req_id, row in (batch.prev_req_id_to_index or {}).items():
                req_state = runner.requests.get(req_id)
                if req_state is not None and 0 <= row < st.num_prev:
                    values[row] = req_state.prev_num_draft_len + 1
                    row_req[row] = req_id
                    out_lens[req_id] = len(req_state.output_token_ids)
            counts = OptimisticCounts(values)
            runner.__dict__["_get_valid_sampled_token_count"] = lambda: counts
            try:
                result = original(runner, scheduler_output)
            finally:
                runner.__dict__.pop("_get_valid_sampled_token_count", None)
            rows, num_drafts = [], []
            for row in counts.read:
                drafts = values[row] - 1
                if drafts > 0 and row in row_req and row not in exact:
                    st.queue.append((row_req[row], drafts, row))
                    rows.append(row)
                    num_drafts.append(drafts)
            # prev_num_draft_tokens: cleared, then step N's drafts at step N's rows of the queued requests
            zero_bubble.optimistic_advance(rows, num_drafts, b.prev_drafts.np)
            return result

        return _update_states

    # -- after the step's inputs are queued: device correction, then exact CPU counts ---------------------

    def correct(self, runner: Any, st: State, num_scheduled: Any, total: int) -> None:
        """Called by the release's ``_prepare_inputs`` hook once the step's inputs are queued. ``num_scheduled``:
        the host array of this step's scheduled tokens per row; ``total``: their sum."""
        self.device_correction(runner, st, num_scheduled, total)
        self.exact_host_counts(runner, st)

    def device_correction(self, runner: Any, st: State, num_scheduled: Any, total: int) -> None:
        """Device counts, ``positions.gpu``, ``seq_lens.gpu`` and the slot mappings, from this step's CPU counts
        and step N's device valid counts (no wait, except the fallback below)."""
        import numpy as np

        zero_bubble = _zero_bubble()
        b = st.buffers
        batch = runner.input_batch
        n = batch.num_reqs
        valid_gpu, st.valid_gpu = st.valid_gpu, None
        correct = bool(st.queue)
        if correct and valid_gpu is None:
            # The previous step's device counts are unknown (it did not go through the padded drafter's copy):
            # upload the host copy instead (this waits, as the classic path does; never seen in steady state).
            import torch

            st.valid_host = runner._get_valid_sampled_token_count()
            st.host_waits += 1
            st.fallback_uploads += 1
            valid_gpu = torch.tensor(st.valid_host, dtype=torch.int64).to(runner.device, non_blocking=True)
        # private snapshot: the host correction changes num_computed_tokens_cpu in place right after
        b.cpu_counts.np[:n] = batch.num_computed_tokens_cpu[:n]
        if not correct:
            # Exact host counts: the release's positions / seq_lens / slot mapping are right; only keep the device
            # counts current for the next step.
            b.staging.copy_to_gpu(n)  # cpu_counts[:n]
            b.num_computed[:n].copy_(b.cpu_counts.gpu[:n])
            return
        st.corrected_steps += 1
        b.num_scheduled.np[:n] = num_scheduled[:n]
        zero_bubble.compute_prev_positions(batch.req_ids, batch.prev_req_id_to_index, n, b.prev_positions.np)
        counts = np.asarray(num_scheduled[:n], dtype=np.int32)
        starts = np.cumsum(counts) - counts
        b.req_indices.np[:total] = np.repeat(np.arange(n, dtype=np.int32), counts)
        b.query_pos.np[:total] = np.arange(total, dtype=np.int32) - np.repeat(starts, counts)
        b.staging.copy_to_gpu(b.query_pos_at + total)  # every section this step reads, prev_drafts included
        self._launch_corrections(runner, b, n, total, valid_gpu, st.num_prev)

    def _launch_corrections(self, runner: Any, b: Buffers, n: int, total: int, valid_gpu: Any, num_prev: int) -> None:
        """The device correction's launches (zb-patch's token-count and slot-mapping kernels) for ``n`` rows and
        ``total`` tokens whose inputs are queued in ``b``."""
        b.counts(n, b.cpu_counts.gpu, valid_gpu, num_tokens=total, num_positions=total, num_prev_reqs=num_prev)
        query_start_loc = runner.query_start_loc.gpu[: n + 1]
        positions = runner.positions.gpu[:total]
        for table in runner.input_batch.block_table.block_tables:
            if computes_slot_mapping(table):
                slot_mapper(b, table)(n, query_start_loc, positions)

    # -- initialize_kv_cache: compile the kernels while the engine starts ---------------------------------

    def make_initialize_kv_cache(self, original: Callable) -> Callable:
        def initialize_kv_cache(runner, *args, **kwargs):
            result = original(runner, *args, **kwargs)  # the block tables are final from here on
            st = self.state_of(runner)
            if st.active:
                self.compile_kernels(runner, st)
            return result

        return initialize_kv_cache

    def compile_kernels(self, runner: Any, st: State) -> None:
        """The device correction's launches on no request, so that Triton compiles zb-patch's kernels (the same
        launchers, constants and argument types as a corrected step) before the first request instead of inside
        its first corrected step. They write only padding: seq_lens.gpu past row 0 and slot_mapping.gpu, which
        every step rewrites before reading."""
        import time

        import torch

        started = time.perf_counter()
        valid = torch.zeros(runner.max_num_reqs, dtype=getattr(torch, self.valid_count_dtype), device=runner.device)
        self._launch_corrections(runner, st.buffers, 0, 0, valid, 0)
        self.compile_seconds.append(time.perf_counter() - started)
        self.logger.info(
            "zb-patch: zero-bubble kernels compiled for this NPUModelRunner in %.2f s (at KV-cache initialisation)",
            self.compile_seconds[-1],
        )

    def exact_host_counts(self, runner: Any, st: State) -> None:
        """Wait for step N's counts (recorded before step N's drafter; this step's device inputs are already
        queued) and make ``seq_lens.cpu`` and ``num_computed_tokens_cpu`` exact (the one host wait per corrected
        step)."""
        if not st.queue:
            return
        import numpy as np

        zero_bubble = _zero_bubble()
        if st.valid_host is None:
            st.valid_host = runner._get_valid_sampled_token_count()
            st.host_waits += 1
        b = st.buffers
        n = runner.input_batch.num_reqs
        valid = np.asarray(st.valid_host, dtype=np.int64)
        for host in (runner.seq_lens.np, runner.input_batch.num_computed_tokens_cpu):
            zero_bubble.correct_seq_lens_cpu(
                host, b.prev_positions.np, b.prev_drafts.np, valid, n, num_prev=st.num_prev
            )

    # -- execute_model: per-request correction after the forward launch -----------------------------------

    def apply_deferred(self, runner: Any) -> None:
        """Subtract the rejected drafts from ``req_state.num_computed_tokens`` (vLLM 0.19's deferred closure) and trim
        their placeholders off ``output_token_ids`` (:meth:`trim_placeholders`)."""
        st = self.active(runner)
        if st is None or not st.queue:
            return
        valid = st.valid_host
        if valid is None:  # input preparation did not run this step (early return): wait here
            valid = runner._get_valid_sampled_token_count()
            st.host_waits += 1
        if valid:
            zero_bubble = _zero_bubble()
            rejected = zero_bubble.rejected_tokens
            requests = runner.requests
            trimmed = []
            for req_id, drafts, row in st.queue:
                req_state = requests.get(req_id)
                if req_state is not None and row < len(valid):
                    num_rejected = rejected(drafts, int(valid[row]))
                    req_state.num_computed_tokens -= num_rejected
                    if num_rejected > 0:
                        trimmed.append((req_id, req_state, drafts - num_rejected))
            self.trim_placeholders(runner, st, trimmed)
        st.queue = []
        st.valid_host = None

    def trim_placeholders(self, runner: Any, st: State, rejected: list) -> None:
        """``output_token_ids`` as classic async has them: ``_update_states`` appended one ``-1`` per draft (all
        assumed accepted), so until the release's next ``_update_states`` trims them the list would count the
        rejected drafts as output -- vLLM's ``MinTokensLogitsProcessor`` reads ``len(output_token_ids)``
        (``builtin.py:196``, ``:209``, ``:258`` in vLLM 0.18) and would release the stop-token mask up to k tokens
        early. ``rejected``: ``(req_id, req_state, accepted drafts)`` of each request with rejected drafts.

        The list becomes its length before the placeholders plus the accepted drafts (never longer than the release
        left it, as classic async's ``_update_states`` would have). Where the longer list had reached ``min_tokens``
        and the exact one has not, the release's ``refresh_metadata`` has already dropped the request from the
        processor: it is added again through the processor's interface (``update_state`` with a ``BatchUpdate`` that
        adds the request at its row, with the same list object, as the input batch does), so it masks the stop
        tokens as classic async's does. Host only, with the counts the host already waited for; no wait."""
        if not rejected:
            return
        out_lens = st.out_lens
        readd = []
        for req_id, req_state, accepted in rejected:
            out = req_state.output_token_ids
            exact = out_lens[req_id] + accepted  # queued rows are recorded rows (make_update_states)
            if len(out) > exact:
                optimistic = len(out)
                del out[exact:]
                min_tokens = req_state.sampling_params.min_tokens  # drafts: a sampling request
                if min_tokens and exact < min_tokens <= optimistic:
                    readd.append(req_state)
        if readd:
            self.readd_min_tokens(runner, readd)

    def readd_min_tokens(self, runner: Any, req_states: list) -> None:
        """Add ``req_states`` again to the batch's ``MinTokensLogitsProcessor`` at their rows (a ``BatchUpdate`` with
        them as added requests; the processor keeps a request while ``len(output_token_ids) < min_tokens``)."""
        from vllm.v1.sample.logits_processor import BatchUpdate, MinTokensLogitsProcessor

        batch = runner.input_batch
        procs = [p for p in batch.logitsprocs.all if isinstance(p, MinTokensLogitsProcessor)]
        if not procs:  # vLLM 0.13 builds no logits processor with a speculative config
            return
        index = batch.req_id_to_index
        added = [
            (index[rs.req_id], rs.sampling_params, rs.prompt_token_ids, rs.output_token_ids)
            for rs in req_states
            if rs.req_id in index
        ]
        if added:
            update = BatchUpdate(batch_size=batch.num_reqs, removed=(), added=added, moved=())
            for proc in procs:
                proc.update_state(update)

    def make_execute_model(self, original: Callable) -> Callable:
        def execute_model(runner, *args, **kwargs):
            output = original(runner, *args, **kwargs)  # launches the forward
            self.apply_deferred(runner)
            return output

        return execute_model

    # -- sample_tokens side: device valid count, backup-token staging -------------------------------------

    def make_copy_valid_sampled_token_count(self, original: Callable) -> Callable:
        def _copy_valid_sampled_token_count(runner, next_token_ids, valid_sampled_tokens_count):
            original(runner, next_token_ids, valid_sampled_tokens_count)
            st = self.active(runner)
            if st is not None and runner.valid_sampled_token_count_event is not None:
                st.valid_gpu = valid_sampled_tokens_count

        return _copy_valid_sampled_token_count

    def make_prepare_next_token_ids_padded(self, original: Callable) -> Callable:
        def prepare_next_token_ids_padded(drafter, *args, **kwargs):
            runner = getattr(drafter, "runner", None)
            st = self.active(runner) if runner is not None else None
            if runner is not None and st is not None:
                # without the classic per-step wait the next step could rewrite the pinned buffer while this
                # step's host-to-device copy of it is still queued
                pair = drafter.__dict__.get(self.backup_pair_attr)
                if pair is None:
                    first = drafter.backup_next_token_ids
                    second = runner._make_buffer(first.gpu.shape[0], dtype=first.gpu.dtype)
                    pair = drafter.__dict__[self.backup_pair_attr] = (first, second)
                drafter.backup_next_token_ids = pair[st.backup_flip]
                st.backup_flip ^= 1
            return original(drafter, *args, **kwargs)

        return prepare_next_token_ids_padded
