"""Zero-bubble glue for adapter ascend-0.18 (vllm-ascend 0.18.0 + vLLM 0.18.x): the wrapped runner methods.

vllm-ascend 0.18.0 runs async scheduling + EAGLE/MTP in the classic form: ``_update_states`` (inherited from
vLLM 0.18's ``GPUModelRunner``) calls ``_get_valid_sampled_token_count()`` in its middle, i.e. the host waits for
step N's accepted-draft counts before it can prepare step N+1. This module turns that into zero-bubble with
*wrappers only* (no copy of an upstream method):

``_update_states``  (vLLM)        For the duration of the call, ``_get_valid_sampled_token_count`` answers from
                                  the host with *optimistic* counts (every draft accepted: ``d + 1`` at each
                                  previous row). The release then keeps the scheduler's optimistic
                                  ``num_computed_tokens`` and appends ``d`` output placeholders -- exactly what
                                  vLLM 0.19 (#32951) does. The rows the release looked up are recorded: they are
                                  the rows to correct (request, drafts, previous row).
``_prepare_inputs`` (vllm-ascend) The release prepares inputs from the optimistic CPU counts (CPU positions,
                                  seq_lens, slot mapping, input-id gather, H2D copies). Then, on the device and
                                  without waiting: the fused zb-patch kernel corrects the device token counts
                                  from step N's device ``valid_sampled_token_count`` and rewrites
                                  ``positions.gpu`` / ``seq_lens.gpu``; the slot-mapping kernel rewrites
                                  ``slot_mapping.gpu`` from them. Only then does the host wait for step N's counts
                                  (``valid_sampled_token_count_event``, recorded before step N's drafter) and
                                  subtract the rejected drafts from ``seq_lens.cpu`` and
                                  ``num_computed_tokens_cpu`` (vllm-ascend #10506's form: Ascend FIA / paged
                                  attention needs exact CPU seq_lens).
``execute_model``   (vllm-ascend) After the forward has been launched, the per-request correction of
                                  ``req_state.num_computed_tokens`` (vLLM 0.19's deferred closure).
``_copy_valid_sampled_token_count`` (vLLM) Keeps a reference to the device valid-count tensor of the step.
``prepare_next_token_ids_padded`` (vllm-ascend proposer) Alternates two backup-token staging buffers: without
                                  the classic per-step wait the next step could rewrite the pinned buffer while
                                  this step's host-to-device copy of it is still queued.

``positions`` and ``seq_lens`` stay ``CpuGpuBuffer``s: ``.gpu`` is authoritative and exact after the device
correction, ``seq_lens.cpu`` / ``.np`` are exact after the host correction, ``positions.cpu`` / ``.np`` stay
optimistic (no reader after ``_prepare_inputs`` on the supported paths: guarded in the adapter). Every reader the
release has therefore sees what the classic path gave it, so none of them needs a patch.

Activation (decided once per runner, at its first ``_update_states``): async scheduling + EAGLE / EAGLE3 / MTP with
the padded drafter, on the release's own ``NPUModelRunner`` class, without PP > 1, PCP / DCP > 1, M-RoPE /
XD-RoPE, hybrid (Mamba / GDN accepted-token) state or pooling. Anything else runs the release's methods untouched
(one WARNING per reason and process when async + spec decode is on but the combination is unsupported).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .. import kernels, zero_bubble
from . import _npu_glue as _common

STATE_ATTR = "_zb_patch_018"          # per-runner state, in the runner's __dict__
_BACKUP_PAIR_ATTR = "_zb_patch_018_backup_pair"
_OVERRIDE = "_get_valid_sampled_token_count"

SUPPORTED_METHODS = _common.SUPPORTED_METHODS

logger = logging.getLogger("vllm.zb_patch.ascend_0_18")
_warned: set[str] = set()


# ------------------------------------------------------------------------------------------------
# Activation and per-runner state
# ------------------------------------------------------------------------------------------------


def unsupported_reason(runner: Any) -> tuple[bool, str]:
    """``(wanted, reason)``: ``reason == ""`` means zero-bubble can run on this runner (see _npu_glue)."""
    return _common.unsupported_reason(runner, "310P / xlite")


@dataclass
class _Buffers:
    num_computed: Any           # device int32 [max_num_reqs]: exact counts, in the last step's row order
    prev_positions: Any         # CpuGpuBuffer int64 [max_num_reqs]
    prev_drafts: Any            # CpuGpuBuffer int32 [max_num_reqs] (drafts of step N at step N's rows)
    cpu_counts: Any             # CpuGpuBuffer int32 [max_num_reqs] (staging of num_computed_tokens_cpu)
    num_scheduled: Any          # CpuGpuBuffer int32 [max_num_reqs]
    req_indices: Any            # CpuGpuBuffer int64 [max_num_tokens]
    query_pos: Any              # CpuGpuBuffer int64 [max_num_tokens]
    token_counts: Callable[..., None]
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
    backup_flip: int = 0
    # diagnostics (tests, doctor-style reports)
    steps: int = 0
    corrected_steps: int = 0
    host_waits: int = 0
    fallback_uploads: int = 0


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
                           "vllm-ascend 0.18's classic path runs (one blocking accepted-count sync per step).",
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
        token_counts=None,  # type: ignore[arg-type]
    )
    b.prev_drafts.np.fill(0)
    b.prev_drafts.gpu.fill_(0)
    b.token_counts = kernels.token_counts_launcher(
        num_computed_tokens=b.num_computed, seq_lens=runner.seq_lens.gpu,
        num_scheduled_tokens=b.num_scheduled.gpu, prev_positions=b.prev_positions.gpu,
        prev_num_draft_tokens=b.prev_drafts.gpu, num_accepted_tokens=None,
        req_indices=b.req_indices.gpu, query_pos=b.query_pos.gpu, positions=runner.positions.gpu)
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
        st.queue = []
        st.valid_host = None
        st.steps += 1
        batch = self.input_batch
        prev_sampled = batch.prev_sampled_token_ids
        prev_map = batch.prev_req_id_to_index
        b = st.buffers
        b.prev_drafts.np.fill(0)
        if prev_sampled is None or self.valid_sampled_token_count_event is None:
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
# _prepare_inputs: device correction, then exact CPU seq_lens for Ascend attention
# ------------------------------------------------------------------------------------------------


_computes_slot_mapping = _common.computes_slot_mapping


_slot_mapper = _common.slot_mapper


def make_prepare_inputs(original: Callable) -> Callable:
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        st = _active(self)
        if st is None:
            return original(self, scheduler_output, num_scheduled_tokens)
        result = original(self, scheduler_output, num_scheduled_tokens)
        _device_correction(self, st, num_scheduled_tokens, int(result[2]))
        _exact_host_counts(self, st)
        return result

    return _prepare_inputs


def _device_correction(runner: Any, st: ZeroBubbleState, num_scheduled_tokens: np.ndarray, total: int) -> None:
    import torch

    b = st.buffers
    batch = runner.input_batch
    n = batch.num_reqs
    valid_gpu, st.valid_gpu = st.valid_gpu, None
    correct = bool(st.queue)
    if correct and valid_gpu is None:
        # The previous step's device counts are unknown (it did not go through the padded drafter's copy):
        # upload the host copy instead (this waits, as the classic path does; never seen in steady state).
        st.valid_host = runner._get_valid_sampled_token_count()
        st.host_waits += 1
        st.fallback_uploads += 1
        valid_gpu = torch.tensor(st.valid_host, dtype=torch.int64).to(runner.device, non_blocking=True)
    b.cpu_counts.np[:n] = batch.num_computed_tokens_cpu[:n]
    b.cpu_counts.copy_to_gpu(n)
    b.num_scheduled.np[:n] = num_scheduled_tokens[:n]
    b.num_scheduled.copy_to_gpu(n)
    if not correct:
        # Exact host counts: the release's positions / seq_lens / slot mapping are right; only keep the device
        # counts current for the next step.
        b.num_computed[:n].copy_(b.cpu_counts.gpu[:n])
        return
    st.corrected_steps += 1
    zero_bubble.compute_prev_positions(batch.req_ids, batch.prev_req_id_to_index, n, b.prev_positions.np)
    b.prev_positions.copy_to_gpu(n)
    b.prev_drafts.copy_to_gpu(st.num_prev)
    counts = num_scheduled_tokens[:n]
    ends = np.cumsum(counts)
    b.req_indices.np[:total] = np.repeat(np.arange(n, dtype=np.int64), counts)
    b.query_pos.np[:total] = np.arange(total, dtype=np.int64) - np.repeat(ends - counts, counts)
    b.req_indices.copy_to_gpu(total)
    b.query_pos.copy_to_gpu(total)
    b.token_counts(n, b.cpu_counts.gpu[:n], valid_gpu, num_tokens=total, num_positions=total,
                   num_prev_reqs=st.num_prev)
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
