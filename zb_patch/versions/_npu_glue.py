"""Zero-bubble glue shared by the adapters that wrap vllm-ascend's V1 ``NPUModelRunner`` (ascend-0.13, ascend-0.18).

What differs per release (activation rules, buffers, where the device correction hooks into ``_prepare_inputs``)
stays in ``ascend_0_13_glue`` / ``ascend_0_18_glue``; what both releases do the same way lives here. The release
modules bind these functions to their own per-runner state (``active(runner) -> state | None``), so a test can
still replace a release module's name (``apply_deferred``, ``_exact_host_counts``, ...) and be seen.

Every function here runs on the per-step path: no device->host copy, no ``.item()`` / ``.tolist()`` on device
tensors; host waits happen only where the docstring says so.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from .. import kernels, zero_bubble

Active = Callable[[Any], Optional[Any]]


SUPPORTED_METHODS = ("eagle", "eagle3", "mtp")


def unsupported_reason(runner: Any, other_runners: str) -> tuple[bool, str]:
    """``(wanted, reason)`` for the combinations neither 0.13 nor 0.18 supports; ``reason == ""`` means this check
    passes (a release module may add its own). ``wanted`` is False when async scheduling + spec decode is simply
    off (nothing to do, no warning). ``other_runners`` names the release's other runner classes for the message."""
    spec = getattr(runner, "speculative_config", None)
    if not getattr(runner, "use_async_scheduling", False) or spec is None \
            or not getattr(spec, "num_speculative_tokens", 0):
        return False, "async scheduling with speculative decoding is off"
    method = getattr(spec, "method", None)
    if method not in SUPPORTED_METHODS:
        return True, f"speculative method {method!r} (zero-bubble supports {', '.join(SUPPORTED_METHODS)})"
    if getattr(spec, "disable_padded_drafter_batch", False):
        return True, "disable_padded_drafter_batch=True (zero-bubble needs the padded drafter)"
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    if type(runner) is not NPUModelRunner:
        return True, (f"runner class {type(runner).__module__}.{type(runner).__qualname__} (only the release's "
                      f"NPUModelRunner is verified; {other_runners} runners keep the classic path)")
    if getattr(runner, "valid_sampled_token_count_event", None) is None:
        return True, "the runner has no valid_sampled_token_count_event"
    if runner.parallel_config.pipeline_parallel_size > 1:
        return True, "pipeline parallelism > 1"
    if getattr(runner, "pcp_size", 1) * getattr(runner, "dcp_size", 1) > 1:
        return True, "prefill / decode context parallelism > 1"
    if getattr(runner, "uses_mrope", False) or getattr(runner, "uses_xdrope_dim", 0) > 0:
        return True, "M-RoPE / XD-RoPE positions (computed on the host from the token counts)"
    if getattr(runner, "need_accepted_tokens", False) or \
            getattr(runner.cache_config, "mamba_cache_mode", None) == "align":
        return True, "hybrid model (Mamba / GDN accepted-token state)"
    if getattr(runner, "is_pooling_model", False):
        return True, "pooling model"
    return True, ""


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
    """Whether the release's numpy ``BlockTable.compute_slot_mapping`` (vllm-ascend 0.13 / 0.18) writes this
    table's slot mapping (non-CP branch: only when the kernel block size is the first of ``kernel_sizes``)."""
    sizes = getattr(block_table, "kernel_sizes", None)
    return bool(sizes) and block_table.block_size == sizes[0]


def slot_mapper(buffers: Any, block_table: Any) -> Callable:
    """The slot-mapping launcher of ``block_table`` (built once, kept in ``buffers.slot_mappers``)."""
    key = id(block_table)
    entry = buffers.slot_mappers.get(key)
    if entry is None or entry[0] is not block_table:
        mapper = kernels.slot_mapper(
            block_table.block_table.gpu, block_table.slot_mapping.gpu, block_size=block_table.block_size,
            max_num_tokens=block_table.max_num_batched_tokens,
            block_table_stride=block_table.block_table.gpu.stride(0),
            physical_block_size=block_table.physical_block_size)
        entry = buffers.slot_mappers[key] = (block_table, mapper)
    return entry[1]


def exact_host_counts(runner: Any, st: Any) -> None:
    """Wait for step N's counts (recorded before step N's drafter; this step's device inputs are already queued)
    and make ``seq_lens.cpu`` and ``num_computed_tokens_cpu`` exact (the one host wait per corrected step)."""
    if not st.queue:
        return
    if st.valid_host is None:
        st.valid_host = runner._get_valid_sampled_token_count()
        st.host_waits += 1
    b = st.buffers
    n = runner.input_batch.num_reqs
    valid = np.asarray(st.valid_host, dtype=np.int64)
    for host in (runner.seq_lens.np, runner.input_batch.num_computed_tokens_cpu):
        zero_bubble.correct_seq_lens_cpu(host, b.prev_positions.np, b.prev_drafts.np, valid, n,
                                         num_prev=st.num_prev)


def apply_deferred(runner: Any, st: Any) -> None:
    """Subtract the rejected drafts from ``req_state.num_computed_tokens`` (vLLM 0.19's deferred closure)."""
    if st is None or not st.queue:
        return
    valid = st.valid_host
    if valid is None:  # input preparation did not run this step (early return): wait here
        valid = runner._get_valid_sampled_token_count()
        st.host_waits += 1
    if valid:
        requests = runner.requests
        for req_id, drafts, row in st.queue:
            req_state = requests.get(req_id)
            if req_state is not None and row < len(valid):
                req_state.num_computed_tokens -= drafts - (int(valid[row]) - 1)
    st.queue = []
    st.valid_host = None


def make_execute_model(original: Callable, deferred: Callable[[Any], None]) -> Callable:
    """``execute_model`` wrapper: the release's method (which launches the forward), then ``deferred(runner)``."""

    def execute_model(self, *args, **kwargs):
        output = original(self, *args, **kwargs)
        deferred(self)
        return output

    return execute_model


def make_copy_valid_sampled_token_count(original: Callable, active: Active) -> Callable:
    """Keeps a reference to the step's device valid-count tensor for the next step's device correction."""

    def _copy_valid_sampled_token_count(self, next_token_ids, valid_sampled_tokens_count):
        original(self, next_token_ids, valid_sampled_tokens_count)
        st = active(self)
        if st is not None and self.valid_sampled_token_count_event is not None:
            st.valid_gpu = valid_sampled_tokens_count

    return _copy_valid_sampled_token_count


def make_prepare_next_token_ids_padded(original: Callable, active: Active, pair_attr: str) -> Callable:
    """Alternates two backup-token staging buffers: without the classic per-step wait the next step could
    rewrite the pinned buffer while this step's host-to-device copy of it is still queued."""

    def prepare_next_token_ids_padded(self, *args, **kwargs):
        runner = getattr(self, "runner", None)
        st = active(runner) if runner is not None else None
        if st is not None:
            pair = self.__dict__.get(pair_attr)
            if pair is None:
                first = self.backup_next_token_ids
                second = runner._make_buffer(first.gpu.shape[0], dtype=first.gpu.dtype)
                pair = self.__dict__[pair_attr] = (first, second)
            self.backup_next_token_ids = pair[st.backup_flip]
            st.backup_flip ^= 1
        return original(self, *args, **kwargs)

    return prepare_next_token_ids_padded
