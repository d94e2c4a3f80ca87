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
    base: str = "previous",
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

    ``base="cpu"`` corrects from this step's CPU counts instead: ``cpu - (drafts + 1 - valid)`` on
    participating rows (the arithmetic of the deferred CPU correction and of vllm-ascend's CPU
    seq_lens correction).  Both bases agree whenever a row's previous step scheduled exactly
    ``1 + drafts`` tokens, which vLLM >= 0.18's scheduler guarantees; vLLM 0.13's async scheduler
    can schedule a resumed request's catch-up tokens *and* drafts in one step (``m + drafts``,
    ``m > 1``), where ``previous + valid`` is short by ``m - 1`` and only ``base="cpu"`` is right
    (found by ``zb-patch selftest`` on vLLM 0.13).
    """
    if (
        base == "cpu"
        and prev_positions is not None
        and valid_sampled_token_count is not None
        and prev_num_draft_tokens is not None
    ):
        cpu_exact = _subtract_rejected(
            cpu_num_computed_tokens[:num_reqs],
            num_accepted_tokens,
            prev_positions,
            valid_sampled_token_count,
            prev_num_draft_tokens,
            num_reqs,
            num_prev_reqs,
        )
        kernels.update_token_counts(
            num_computed_tokens,
            None,
            None,
            None,
            None,
            cpu_exact,
            num_scheduled_tokens,
            seq_lens,
            num_reqs=num_reqs,
            req_indices=req_indices,
            query_pos=query_pos,
            positions=positions,
            num_tokens=num_tokens,
            num_positions=num_positions,
        )
        return
    if base not in ("cpu", "previous"):
        raise ValueError(f"base must be 'previous' or 'cpu', not {base!r}")
    kernels.update_token_counts(
        num_computed_tokens,
        num_accepted_tokens,
        prev_positions,
        valid_sampled_token_count,
        prev_num_draft_tokens,
        cpu_num_computed_tokens,
        num_scheduled_tokens,
        seq_lens,
        num_reqs=num_reqs,
        req_indices=req_indices,
        query_pos=query_pos,
        positions=positions,
        num_tokens=num_tokens,
        num_positions=num_positions,
        num_prev_reqs=num_prev_reqs,
    )


def _subtract_rejected(
    cpu: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None,
    prev_positions: torch.Tensor,
    valid: torch.Tensor,
    prev_drafts: torch.Tensor,
    num_reqs: int,
    num_prev_reqs: int | None,
) -> torch.Tensor:
    """``cpu - (drafts + 1 - valid)`` on participating rows (torch ops on the tensors' device)."""
    bound = valid.numel() if num_prev_reqs is None else min(int(num_prev_reqs), valid.numel())
    bound = min(bound, prev_drafts.numel())
    prev = prev_positions[:num_reqs].to(torch.int64)
    in_range = (prev >= 0) & (prev < bound)
    gather = torch.where(in_range, prev, torch.zeros_like(prev))
    if bound > 0:
        drafts = prev_drafts[gather].to(torch.int64)
        counts = valid[gather].to(torch.int64)
    else:
        drafts = torch.zeros_like(prev)
        counts = torch.zeros_like(prev)
    part = in_range & (drafts > 0)
    rejected = torch.where(part, drafts + 1 - counts, torch.zeros_like(drafts))
    if num_accepted_tokens is not None:
        acc = num_accepted_tokens[:num_reqs]
        acc.copy_(torch.where(part, counts.to(acc.dtype), acc))
    return (cpu.to(torch.int64) - rejected).to(cpu.dtype)


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
    kernels.compute_slot_mapping(
        query_start_loc,
        positions,
        block_table,
        out,
        block_size=block_size,
        max_num_tokens=max_num_tokens,
        num_reqs=num_reqs,
        **config,
    )
