"""Zero-bubble async scheduling + speculative decoding: the device-agnostic bookkeeping.

Functions on numpy arrays / torch tensors and two launch objects bound to a runner's buffers — no
runner objects, no vLLM imports, no release knowledge. One copy, two callers: the product's
zero-bubble wrappers (:mod:`zb_patch.versions.npu_runner`, vllm-ascend 0.13 / 0.18) and the
self-test's runner (:mod:`zb_patch.check.selftest.runner`), which proves them against vLLM's real
scheduler. Each function names the upstream code it mirrors.

One decode step N+1 under zero-bubble (vLLM 0.19 #32951 / vllm-ascend 0.23 data flow)::

    host  _update_states   optimistic_advance()              no wait on step N's accepted counts
    host  _prepare_inputs  compute_prev_positions()          batch-change map
                           optimistic_seq_lens(), discard_request_mask()
    dev                    CountCorrection()                 counts, positions, seq_lens on device
    dev                    slot_mapper()
    host  (Ascend only)    wait step N's counts; correct_seq_lens_cpu()  exact CPU seq_lens
    dev   forward launch
    host  deferred         wait step N's counts (hidden behind the forward);
                           deferred_cpu_corrections() + apply_cpu_corrections()
    host  sample_tokens    backup_next_token_ids()           drafter fallback for discarded rows
"""

from __future__ import annotations

from .batch import compute_prev_positions, remap_accepted_counts, snapshot_rows
from .counts import (
    apply_cpu_corrections,
    backup_next_token_ids,
    backup_token_indices,
    correct_seq_lens_cpu,
    deferred_cpu_corrections,
    discard_request_mask,
    optimistic_advance,
    optimistic_seq_lens,
    rejected_tokens,
)
from .device import BASES, CountCorrection, slot_mapper

__all__ = [
    "BASES",
    "CountCorrection",
    "apply_cpu_corrections",
    "backup_next_token_ids",
    "backup_token_indices",
    "compute_prev_positions",
    "correct_seq_lens_cpu",
    "deferred_cpu_corrections",
    "discard_request_mask",
    "optimistic_advance",
    "optimistic_seq_lens",
    "rejected_tokens",
    "remap_accepted_counts",
    "slot_mapper",
    "snapshot_rows",
]
