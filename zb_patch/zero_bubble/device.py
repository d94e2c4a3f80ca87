"""Device-side half of zero-bubble: corrected counts, positions, seq_lens and slot mapping on the device.

Thin, documented entry points over :mod:`zb_patch.kernels` (which owns the Triton kernels and their
pure-torch twins, and dispatches between them by tensor device).  Nothing here syncs the host: every
input is either already on the device or a non-blocking host-to-device copy the caller enqueued.

Order within one step (vLLM 0.19 ``_prepare_inputs`` / vllm-ascend 0.23, one launch each here)::

    correct_counts(...)   # num_computed_tokens (+ num_accepted_tokens), positions, seq_lens
    slot_mapping(...)     # from the corrected positions and the committed block table
"""

from __future__ import annotations

from typing import Any

import torch

from .. import kernels

__all__ = ["correct_counts", "slot_mapping"]


def correct_counts(
    num_computed_tokens: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None,
    prev_positions: torch.Tensor | None,
    valid_sampled_token_count: torch.Tensor | None,
    prev_num_draft_tokens: torch.Tensor | None,
    cpu_num_computed_tokens: torch.Tensor,
    num_scheduled_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_reqs: int,
    req_indices: torch.Tensor,
    query_pos: torch.Tensor,
    positions: torch.Tensor,
    num_tokens: int,
    num_positions: int | None = None,
    num_prev_reqs: int | None = None,
) -> None:
    """Correct the device token counts for last step's rejected drafts, then derive positions / seq_lens.

    Semantics (vLLM 0.19-0.23 ``update_num_computed_tokens_for_batch_change`` + the later bounds
    hardening, fused with the positions / seq_lens ops of ``_prepare_inputs``)::

        part[r] = 0 <= prev_positions[r] < num_prev and prev_num_draft_tokens[prev_positions[r]] > 0
        num_computed_tokens[r] = old[prev_positions[r]] + valid[prev_positions[r]] if part[r]
                                 else cpu_num_computed_tokens[r]
        num_accepted_tokens[r] = valid[prev_positions[r]] if part[r]             (else unchanged)
        positions[t] = num_computed_tokens[req_indices[t]] + query_pos[t]
        seq_lens[r]  = num_computed_tokens[r] + num_scheduled_tokens[r]; seq_lens[num_reqs:] = 0

    ``prev_positions`` / ``valid_sampled_token_count`` ``None``: no correction (first step, or the
    previous step had no spec decode) — the CPU counts are exact and simply copied.
    ``num_computed_tokens`` must hold last step's *device* values in last step's row order (it is
    read at previous rows and written at current rows; the kernel handles the aliasing).
    """
    kernels.update_token_counts(
        num_computed_tokens, num_accepted_tokens, prev_positions, valid_sampled_token_count,
        prev_num_draft_tokens, cpu_num_computed_tokens, num_scheduled_tokens, seq_lens,
        num_reqs=num_reqs, req_indices=req_indices, query_pos=query_pos, positions=positions,
        num_tokens=num_tokens, num_positions=num_positions, num_prev_reqs=num_prev_reqs)


def slot_mapping(
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    out: torch.Tensor,
    *,
    block_size: int,
    max_num_tokens: int,
    num_reqs: int,
    **config: Any,
) -> None:
    """Slot of every scheduled token from device positions: ``block_table[r, p // bs] * bs + p % bs``.

    ``out[num_tokens:max_num_tokens]`` is padded with ``PAD_SLOT_ID``.  ``config``: context-parallel
    and hybrid-block options of :func:`zb_patch.kernels.slot_mapper`.
    """
    kernels.compute_slot_mapping(query_start_loc, positions, block_table, out, block_size=block_size,
                                 max_num_tokens=max_num_tokens, num_reqs=num_reqs, **config)
