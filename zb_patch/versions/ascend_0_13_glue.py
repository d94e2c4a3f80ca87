"""Zero-bubble glue for adapter ascend-0.13 (vllm-ascend 0.13.0 + vLLM 0.13.0): the wrapped runner methods.

vllm-ascend 0.13.0 runs async scheduling (``--async-scheduling``; off by default in vLLM 0.13) + EAGLE / MTP in the
classic form: vLLM 0.13's ``GPUModelRunner._update_states`` (inherited) calls ``_get_valid_sampled_token_count()``
at its L865, i.e. the host waits for step N's accepted-draft counts before it prepares step N+1. Wrappers only (no
copy of an upstream method):

``_update_states``  (vLLM)        Waits on the input-preparation event of the previous step (vLLM's
                                  ``prepare_inputs_event``; vllm-ascend 0.13 never waits on it, because the
                                  classic accepted-count sync already ordered the reused host buffers), then, for
                                  the duration of the release's call, ``_get_valid_sampled_token_count`` answers
                                  from the host with *optimistic* counts (``prev_num_draft_len + 1`` at each
                                  previous row). The release keeps the scheduler's optimistic
                                  ``num_computed_tokens`` and appends ``prev_num_draft_len`` placeholders. The rows
                                  it looked up are this step's corrections (request, drafts, previous row).
``_prepare_inputs`` (vllm-ascend) Monolithic: it prepares the inputs *and* builds the attention metadata. The
                                  wrapper only opens the window in which the hook below acts, and records the
                                  input-preparation event once the release queued all of the step's copies.
``_init_model_kwargs`` (vLLM)     The hook. The release calls it exactly once per ``_prepare_inputs``, after the
                                  last host-to-device copy of positions / seq_lens / slot mapping / input ids and
                                  the discard indices (L743-770) and before the spec-decode metadata and the
                                  attention-metadata loop (L879-1107). There, on the device and without waiting:
                                  counts = this step's CPU counts (private snapshot) minus step N's rejected
                                  drafts (``zero_bubble.correct_counts(base="cpu")``: vLLM 0.13's scheduler can
                                  schedule a row more than ``1 + drafts`` tokens, so upstream's "previous device
                                  count + valid count" is wrong here; docs/selftest.md), then ``positions.gpu``,
                                  ``seq_lens.gpu`` and ``slot_mapping.gpu``. Then the host waits for step N's
                                  counts (``valid_sampled_token_count_event``, recorded before step N's drafter)
                                  and makes ``seq_lens.cpu`` and ``num_computed_tokens_cpu`` exact, so the Ascend
                                  metadata (FIA / paged attention ``seq_lens_cpu``), the FULL-graph pad copy and
                                  the drafter's backup index read exact values.
``execute_model``   (vllm-ascend) After the forward launch, the per-request correction of
                                  ``req_state.num_computed_tokens`` (vLLM 0.19's deferred closure).
``_copy_valid_sampled_token_count`` (vLLM) Keeps a reference to the device valid-count tensor of the step.
``prepare_next_token_ids_padded`` (vllm-ascend EagleProposer; MtpProposer inherits it) Alternates two backup-token
                                  staging buffers.

Activation (decided once per runner, at its first ``_update_states``): async scheduling + EAGLE / EAGLE3 / MTP with
the padded drafter, on the release's own ``NPUModelRunner`` class, without PP > 1, PCP / DCP > 1, M-RoPE /
XD-RoPE, hybrid (Mamba / GDN accepted-token) state, pooling or vllm-ascend's PD-decode ``_update_states``
replacement. Anything else runs the release's methods untouched (one WARNING per reason and process when async +
spec decode is on but the combination is unsupported).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .. import zero_bubble
from . import _npu_glue as _common

STATE_ATTR = "_zb_patch_013"          # per-runner state, in the runner's __dict__
_BACKUP_PAIR_ATTR = "_zb_patch_013_backup_pair"
_OVERRIDE = "_get_valid_sampled_token_count"

SUPPORTED_METHODS = _common.SUPPORTED_METHODS

logger = logging.getLogger("vllm.zb_patch.ascend_0_13")
_warned: set[str] = set()


# ------------------------------------------------------------------------------------------------
# Activation and per-runner state
# ------------------------------------------------------------------------------------------------


def unsupported_reason(runner: Any) -> tuple[bool, str]:
    """``(wanted, reason)``: ``reason == ""`` means zero-bubble can run on this runner (see _npu_glue), plus the
    0.13-only case of PD decode nodes with the recompute scheduler."""
    wanted, reason = _common.unsupported_reason(runner, "310P / torchair")
    if reason or not wanted:
        return wanted, reason
    ascend_config = getattr(runner, "ascend_config", None)
    if getattr(ascend_config, "recompute_scheduler_enable", False) and \
            getattr(runner.vllm_config, "kv_transfer_config", None) is not None:
        return True, ("PD decode node with the recompute scheduler (vllm-ascend 0.13 replaces "
                      "GPUModelRunner._update_states there: vllm_ascend.patch.worker.patch_model_runner)")
    return True, ""


@dataclass
class _Buffers:
    num_computed: Any           # device int32 [max_num_reqs]: exact counts of this step
    prev_positions: Any         # CpuGpuBuffer int64 [max_num_reqs]
    prev_drafts: Any            # CpuGpuBuffer int32 [max_num_reqs] (drafts of step N at step N's rows)
    cpu_counts: Any             # CpuGpuBuffer int32 [max_num_reqs]: private snapshot of num_computed_tokens_cpu
    num_scheduled: Any          # CpuGpuBuffer int32 [max_num_reqs]
    req_indices: Any            # CpuGpuBuffer int64 [max_num_tokens]
    query_pos: Any              # CpuGpuBuffer int64 [max_num_tokens]
    slot_mappers: dict = field(default_factory=dict)


@dataclass
class ZeroBubbleState:
    """What zero-bubble keeps per runner between its wrapped methods."""

    active: bool
    reason: str = ""
    buffers: _Buffers | None = None
    # this step: (req_id, drafts assumed accepted, previous row) per request the release looked up
    queue: list = field(default_factory=list)
    num_prev: int = 0
    valid_gpu: Any = None           # device valid counts of the last proposing step (consumed once)
    valid_host: list | None = None  # step N's counts once the host waited for them (this step)
    in_prepare: bool = False        # inside the patched _prepare_inputs, hook not yet run
    backup_flip: int = 0
    # diagnostics (tests, doctor-style reports)
    steps: int = 0
    corrected_steps: int = 0
    host_waits: int = 0
    fallback_uploads: int = 0
    hooks: int = 0


def state_of(runner: Any) -> ZeroBubbleState:
    """The runner's zero-bubble state, created (and activation decided) on first use."""
    st = runner.__dict__.get(STATE_ATTR)
    if st is None:
        wanted, reason = unsupported_reason(runner)
        st = ZeroBubbleState(active=wanted and not reason, reason=reason)
        if st.active:
            st.buffers = _allocate(runner)
            logger.info("zb-patch: zero-bubble async scheduling + spec decode active on this NPUModelRunner "
                        "(method %s, k=%d)", runner.speculative_config.method,
                        runner.speculative_config.num_speculative_tokens)
        elif wanted and reason not in _warned:
            _warned.add(reason)
            logger.warning("zb-patch: zero-bubble NOT active for async scheduling + speculative decoding: %s. "
                           "vllm-ascend 0.13's classic path runs (one blocking accepted-count sync per step).",
                           reason)
        runner.__dict__[STATE_ATTR] = st
    return st


def _allocate(runner: Any) -> _Buffers:
    import torch

    max_reqs = runner.max_num_reqs
    max_tokens = runner.positions.gpu.shape[0]
    mk = runner._make_buffer
    b = _Buffers(
        num_computed=torch.zeros(max_reqs, dtype=torch.int32, device=runner.device),
        prev_positions=mk(max_reqs, dtype=torch.int64),
        prev_drafts=mk(max_reqs, dtype=torch.int32),
        cpu_counts=mk(max_reqs, dtype=torch.int32),
        num_scheduled=mk(max_reqs, dtype=torch.int32),
        req_indices=mk(max_tokens, dtype=torch.int64),
        query_pos=mk(max_tokens, dtype=torch.int64),
    )
    b.prev_drafts.np.fill(0)
    b.prev_drafts.gpu.fill_(0)
    return b


def _active(runner: Any) -> ZeroBubbleState | None:
    st = runner.__dict__.get(STATE_ATTR)
    return st if st is not None and st.active else None


# ------------------------------------------------------------------------------------------------
# _update_states: optimistic counts instead of the blocking sync
# ------------------------------------------------------------------------------------------------


_OptimisticCounts = _common.OptimisticCounts


def make_update_states(original: Callable) -> Callable:
    def _update_states(self, scheduler_output):
        st = state_of(self)
        if not st.active:
            return original(self, scheduler_output)
        # vLLM's synchronize_input_prep wait: the previous step's host-to-device copies from the reused host
        # buffers (block table, positions, seq_lens, ...) have run before this step rewrites them
        event = getattr(self, "prepare_inputs_event", None)
        if event is not None:
            event.synchronize()
        st.queue = []
        st.valid_host = None
        st.steps += 1
        batch = self.input_batch
        prev_sampled = batch.prev_sampled_token_ids
        prev_map = batch.prev_req_id_to_index
        b = st.buffers
        b.prev_drafts.np.fill(0)
        if prev_sampled is None:
            st.num_prev = 0
            return original(self, scheduler_output)  # no previous step to wait for: no sync either way
        st.num_prev = int(prev_sampled.shape[0])
        values = [1] * st.num_prev
        row_req: dict[int, str] = {}
        for req_id, row in (prev_map or {}).items():
            req_state = self.requests.get(req_id)
            if req_state is not None and 0 <= row < st.num_prev:
                values[row] = req_state.prev_num_draft_len + 1
                row_req[row] = req_id
        counts = _OptimisticCounts(values)
        self.__dict__[_OVERRIDE] = lambda: counts
        try:
            result = original(self, scheduler_output)
        finally:
            self.__dict__.pop(_OVERRIDE, None)
        for row in counts.read:
            drafts = values[row] - 1
            if drafts > 0 and row in row_req:
                st.queue.append((row_req[row], drafts, row))
                b.prev_drafts.np[row] = drafts
        return result

    return _update_states


# ------------------------------------------------------------------------------------------------
# _prepare_inputs (window) + _init_model_kwargs (hook): device correction, then exact CPU counts
# ------------------------------------------------------------------------------------------------


def make_prepare_inputs(original: Callable) -> Callable:
    def _prepare_inputs(self, *args, **kwargs):
        st = _active(self)
        if st is None:
            return original(self, *args, **kwargs)
        st.in_prepare = True
        try:
            result = original(self, *args, **kwargs)
        finally:
            missed, st.in_prepare = st.in_prepare, False
        if missed and st.queue:  # unreachable while the guarded release calls the hook: never build on guesses
            raise RuntimeError("zb-patch ascend-0.13: _prepare_inputs returned without calling _init_model_kwargs; "
                               "the attention metadata was built from optimistic counts")
        # vLLM 0.13 can schedule draft placeholders for a row that was not in the previous batch; the release has
        # no draft ids for it and gathers its token table there, where the optimistic bookkeeping may have left a
        # -1 placeholder. Those positions are junk the rejection sampler rejects in both modes, but a -1 token id
        # must never reach the embedding: clamp on the device (no host work, no sync).
        total = getattr(args[0] if args else kwargs.get("scheduler_output"), "total_num_scheduled_tokens", 0)
        if total:
            self.input_ids.gpu[:total].clamp_(min=0)
        event = getattr(self, "prepare_inputs_event", None)
        if event is not None:
            event.record()
        return result

    return _prepare_inputs


def make_init_model_kwargs(original: Callable) -> Callable:
    def _init_model_kwargs(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        st = _active(self)
        if st is not None and st.in_prepare:
            st.in_prepare = False
            st.hooks += 1
            _device_correction(self, st)
            _exact_host_counts(self, st)
        return result

    return _init_model_kwargs


_computes_slot_mapping = _common.computes_slot_mapping


_slot_mapper = _common.slot_mapper


def _device_correction(runner: Any, st: ZeroBubbleState) -> None:
    import torch

    b = st.buffers
    batch = runner.input_batch
    n = batch.num_reqs
    valid_gpu, st.valid_gpu = st.valid_gpu, None
    if not st.queue:
        return  # exact host counts: the release's positions / seq_lens / slot mapping are right
    if valid_gpu is None:
        # The previous step's device counts are unknown (it did not go through the padded drafter's copy):
        # upload the host copy instead (this waits, as the classic path does; never seen in steady state).
        st.valid_host = runner._get_valid_sampled_token_count()
        st.host_waits += 1
        st.fallback_uploads += 1
        valid_gpu = torch.tensor(st.valid_host, dtype=torch.int64).to(runner.device, non_blocking=True)
    st.corrected_steps += 1
    qsl = runner.query_start_loc.np[: n + 1]
    counts = np.diff(qsl).astype(np.int64)
    total = int(qsl[n])
    # private snapshot: the host correction below changes num_computed_tokens_cpu in place right after
    b.cpu_counts.np[:n] = batch.num_computed_tokens_cpu[:n]
    b.cpu_counts.copy_to_gpu(n)
    b.num_scheduled.np[:n] = counts
    b.num_scheduled.copy_to_gpu(n)
    zero_bubble.compute_prev_positions(batch.req_ids, batch.prev_req_id_to_index, n, b.prev_positions.np)
    b.prev_positions.copy_to_gpu(n)
    b.prev_drafts.copy_to_gpu(st.num_prev)
    b.req_indices.np[:total] = np.repeat(np.arange(n, dtype=np.int64), counts)
    b.query_pos.np[:total] = np.arange(total, dtype=np.int64) - np.repeat(qsl[:n].astype(np.int64), counts)
    b.req_indices.copy_to_gpu(total)
    b.query_pos.copy_to_gpu(total)
    zero_bubble.correct_counts(
        b.num_computed, None, b.prev_positions.gpu[:n], valid_gpu, b.prev_drafts.gpu, b.cpu_counts.gpu[:n],
        b.num_scheduled.gpu[:n], runner.seq_lens.gpu, num_reqs=n, req_indices=b.req_indices.gpu,
        query_pos=b.query_pos.gpu, positions=runner.positions.gpu, num_tokens=total, num_positions=total,
        num_prev_reqs=st.num_prev, base="cpu")
    query_start_loc = runner.query_start_loc.gpu[: n + 1]
    positions = runner.positions.gpu[:total]
    for table in batch.block_table.block_tables:
        if _computes_slot_mapping(table):
            _slot_mapper(b, table)(n, query_start_loc, positions)


_exact_host_counts = _common.exact_host_counts


# ------------------------------------------------------------------------------------------------
# execute_model: per-request correction after the forward launch
# ------------------------------------------------------------------------------------------------


def apply_deferred(runner: Any) -> None:
    """Subtract the rejected drafts from ``req_state.num_computed_tokens`` after the forward launch."""
    _common.apply_deferred(runner, _active(runner))


def make_execute_model(original: Callable) -> Callable:
    return _common.make_execute_model(original, lambda runner: apply_deferred(runner))


# ------------------------------------------------------------------------------------------------
# sample_tokens side: device valid count, backup-token staging
# ------------------------------------------------------------------------------------------------


def make_copy_valid_sampled_token_count(original: Callable) -> Callable:
    return _common.make_copy_valid_sampled_token_count(original, _active)


def make_prepare_next_token_ids_padded(original: Callable) -> Callable:
    return _common.make_prepare_next_token_ids_padded(original, _active, _BACKUP_PAIR_ATTR)
