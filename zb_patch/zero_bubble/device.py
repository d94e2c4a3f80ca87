"""Device-side half of zero-bubble: corrected counts, positions, seq_lens and slot mapping on the device.

The one route from the zero-bubble runner code (the product's :mod:`zb_patch.versions.npu_runner` and the self-test's
runner) to :mod:`zb_patch.kernels`, which owns the Triton kernels and their pure-torch twins and dispatches between
them by tensor device. Both objects here are bound to a runner's persistent buffers once and called per step with
what changes. Nothing here syncs the host: every input is either already on the device or a non-blocking
host-to-device copy the caller enqueued.

Order within one step (vLLM 0.19 ``_prepare_inputs`` / vllm-ascend 0.23, one launch each here)::

    CountCorrection(...)(num_reqs, cpu_counts, valid, ...)  # num_computed_tokens (+ num_accepted), positions, seq_lens
    slot_mapper(...)(num_reqs, query_start_loc, positions)  # from the corrected positions and the block table
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels import TOKEN_COUNT_BASES as BASES
from ..kernels import slot_mapper

__all__ = ["BASES", "CountCorrection", "slot_mapper"]


class CountCorrection:
    """The device token-count correction bound to one runner's persistent buffers (built once, called per step).

    Buffers (device tensors, full length; a call passes the row and token counts): ``num_computed_tokens`` (last
    step's device values in last step's row order, this step's after the call), ``seq_lens``,
    ``num_scheduled_tokens``, ``prev_positions`` (each row's index in the previous batch, -1: new),
    ``prev_num_draft_tokens`` (step N's drafts at step N's rows), ``req_indices`` / ``query_pos`` / ``positions``
    (per token), optionally ``num_accepted_tokens``. A call::

        correction(num_reqs, cpu_num_computed_tokens, valid_sampled_token_count,   # None: no correction
                   num_tokens=..., num_positions=..., num_prev_reqs=...)

    Semantics (vLLM 0.19-0.23 ``update_num_computed_tokens_for_batch_change`` + the later bounds hardening, fused
    with the positions / seq_lens ops of ``_prepare_inputs``)::

        part[r] = 0 <= prev_positions[r] < num_prev and prev_num_draft_tokens[prev_positions[r]] > 0
        num_computed_tokens[r] = old[prev_positions[r]] + valid[prev_positions[r]] if part[r]
                                 else cpu_num_computed_tokens[r]
        num_accepted_tokens[r] = valid[prev_positions[r]] if part[r]             (else unchanged)
        positions[t] = num_computed_tokens[req_indices[t]] + query_pos[t]
        seq_lens[r]  = num_computed_tokens[r] + num_scheduled_tokens[r]; seq_lens[num_reqs:] = 0

    ``valid_sampled_token_count`` ``None``: no correction (first step, or the previous step had no spec decode) --
    the CPU counts are exact and simply copied.

    ``base="cpu"`` corrects from this step's CPU counts instead: ``cpu - (drafts + 1 - valid)`` on participating
    rows (the arithmetic of the deferred CPU correction and of vllm-ascend's CPU seq_lens correction). Both bases
    agree whenever a row's previous step scheduled exactly ``1 + drafts`` tokens, which vLLM >= 0.18's scheduler
    guarantees; vLLM 0.13's async scheduler can schedule a resumed request's catch-up tokens *and* drafts in one step
    (``m + drafts``, ``m > 1``), where ``previous + valid`` is short by ``m - 1`` and only ``base="cpu"`` is right
    (found by ``zb-patch selftest`` on vLLM 0.13).
    """

    def __init__(
        self,
        *,
        num_computed_tokens: torch.Tensor,
        seq_lens: torch.Tensor,
        num_scheduled_tokens: torch.Tensor,
        prev_positions: torch.Tensor,
        prev_num_draft_tokens: torch.Tensor,
        req_indices: torch.Tensor,
        query_pos: torch.Tensor,
        positions: torch.Tensor,
        num_accepted_tokens: torch.Tensor | None = None,
        base: str = "previous",
    ) -> None:
        self.launch = kernels.token_counts_launcher(
            num_computed_tokens=num_computed_tokens,
            seq_lens=seq_lens,
            num_scheduled_tokens=num_scheduled_tokens,
            prev_positions=prev_positions,
            prev_num_draft_tokens=prev_num_draft_tokens,
            num_accepted_tokens=num_accepted_tokens,
            req_indices=req_indices,
            query_pos=query_pos,
            positions=positions,
            base=base,
        )

    def __call__(
        self,
        num_reqs: int,
        cpu_num_computed_tokens: torch.Tensor,
        valid_sampled_token_count: torch.Tensor | None = None,
        *,
        num_tokens: int = 0,
        num_positions: int | None = None,
        num_prev_reqs: int | None = None,
    ) -> None:
        self.launch(
            num_reqs,
            cpu_num_computed_tokens,
            valid_sampled_token_count,
            num_tokens=num_tokens,
            num_positions=num_positions,
            num_prev_reqs=num_prev_reqs,
        )
