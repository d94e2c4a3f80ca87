"""Pure-torch reference twins of the zb-patch Triton kernels.

Every kernel in this package has a twin here with the same arguments and the same effect on its
output tensors.  The twins are

* the oracle of the kernel tests (kernel == reference, element for element, on every test batch);
* the implementation that :mod:`zb_patch.kernels` dispatches to for CPU tensors when
  ``TRITON_INTERPRET`` is not ``1`` (CPU harnesses, 310P-like set-ups without Triton).

They are written for clarity, not speed, and deliberately use a *different formulation* from the
kernels where one exists (``searchsorted`` instead of the kernels' tile search; vllm-ascend's
"virtual physical block" formula for context parallelism instead of the kernels' flat interleave
formula), so that a test that compares the two checks the algebra too.

Nothing here imports vLLM or Triton.
"""

from __future__ import annotations

import math

import torch

PAD_SLOT_ID = -1
INT32_MAX = 2**31 - 1


# ------------------------------------------------------------------------------------------------
# Slot mapping
# ------------------------------------------------------------------------------------------------
def slot_mapping_reference(
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    block_size: int,
    max_num_tokens: int,
    num_reqs: int | None = None,
    block_table_stride: int | None = None,
    physical_block_size: int | None = None,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_kv_cache_interleave_size: int = 1,
    pad_slot_id: int = PAD_SLOT_ID,
) -> None:
    """Reference for :func:`zb_patch.kernels.slot_mapping.compute_slot_mapping` (see there).

    Writes ``slot_mapping[:max(num_tokens, max_num_tokens)]`` where ``num_tokens = len(positions)``:

    * token ``t`` belongs to request ``r`` when ``query_start_loc[r] <= t < query_start_loc[r+1]``;
      tokens of no request (``t < qsl[0]`` or ``t >= qsl[num_reqs]``) get ``pad_slot_id``;
    * context parallelism (``cp_world_size`` W > 1, interleave I): with the "virtual block" of
      ``physical_block_size * W`` tokens (vllm-ascend's ``_compute_pcp_dcp_slot_mapping``), token
      position ``p`` is owned by rank ``(p % vbs) // I % W``; other ranks' tokens get the pad id;
    * the owned token's local offset is mapped through the block table, whose rows hold *kernel*
      (attention) block ids of ``block_size`` tokens; one physical block is
      ``physical_block_size // block_size`` consecutive kernel blocks (hybrid block sizes);
    * positions outside ``[0, 2**31)`` and block indices past the row (``>= block_table.shape[1]``)
      give the pad id instead of reading out of bounds;
    * ``[num_tokens, max_num_tokens)`` is filled with the pad id (CUDA/ACL graph padding).
    """
    device = slot_mapping.device
    num_tokens = positions.shape[0]
    if num_reqs is None:
        num_reqs = query_start_loc.shape[0] - 1
    stride = block_table.stride(0) if block_table_stride is None else block_table_stride
    max_blocks = block_table.shape[1]
    world, interleave = cp_world_size, cp_kv_cache_interleave_size
    if physical_block_size is None:
        physical_block_size = block_size * interleave // math.gcd(block_size, interleave)
    blocks_per_phys = physical_block_size // block_size

    t = torch.arange(num_tokens, dtype=torch.int64, device=device)
    qsl = query_start_loc[: num_reqs + 1].to(device=device, dtype=torch.int64)
    pos = positions.to(device=device, dtype=torch.int64)
    # req(t) = number of r in [1, num_reqs] with qsl[r] <= t  (qsl is non-decreasing)
    req = torch.searchsorted(qsl[1:].contiguous(), t, right=True)
    # positions past int32 pad, as in the kernel (its index math is int32; see its module docstring)
    in_range = (pos >= 0) & (pos <= INT32_MAX)
    valid = (req < num_reqs) & (t >= qsl[0]) & in_range if num_reqs > 0 else torch.zeros_like(t, dtype=torch.bool)

    virtual_block = physical_block_size * world
    vblock = torch.div(pos, virtual_block, rounding_mode="floor")
    voff = pos - vblock * virtual_block
    owned = torch.remainder(torch.div(voff, interleave, rounding_mode="floor"), world) == cp_rank
    local_phys_off = torch.div(voff, world * interleave, rounding_mode="floor") * interleave + torch.remainder(
        voff, interleave
    )
    block_idx = vblock * blocks_per_phys + torch.div(local_phys_off, block_size, rounding_mode="floor")
    block_off = torch.remainder(local_phys_off, block_size)
    valid = valid & (block_idx < max_blocks)

    if stride != block_table.stride(0):
        raise ValueError(f"block_table_stride {stride} != block_table.stride(0) {block_table.stride(0)}")
    req_c = torch.where(valid, req, 0)
    idx_c = torch.where(valid, block_idx, 0)
    block_numbers = block_table[req_c.to(block_table.device), idx_c.to(block_table.device)].to(device)
    slots = block_numbers.to(torch.int64) * block_size + block_off
    slots = torch.where(valid & owned, slots, torch.full_like(slots, pad_slot_id))

    slot_mapping[:num_tokens] = slots.to(slot_mapping.dtype)
    if max_num_tokens > num_tokens:
        slot_mapping[num_tokens:max_num_tokens] = pad_slot_id


def vllm_generic_slot_mapping(
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    block_size: int,
    max_num_tokens: int,
    num_reqs: int,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_kv_cache_interleave_size: int = 1,
    pad_slot_id: int = PAD_SLOT_ID,
) -> None:
    """Torch transcription of the arithmetic of vLLM 0.19-0.23's generic ``_compute_slot_mapping_kernel``.

    Test oracle only: its virtual block is ``block_size * W`` (kernel block size), which agrees with
    :func:`slot_mapping_reference` when the interleave size divides the kernel block size and
    disagrees otherwise (the bug vllm-ascend #10442 worked around for hybrid blocks with CP).
    Tokens of no request are left untouched, as upstream does.
    """
    qsl = query_start_loc.tolist()
    world, interleave = cp_world_size, cp_kv_cache_interleave_size
    vbs = block_size * world
    for r in range(num_reqs):
        for t in range(qsl[r], qsl[r + 1]):
            p = int(positions[t])
            bi = p // vbs
            off = p - bi * vbs
            local = (off // interleave) % world == cp_rank
            loff = off // (world * interleave) * interleave + off % interleave
            bn = int(block_table[r, bi])
            slot_mapping[t] = bn * block_size + loff if local else pad_slot_id
    if max_num_tokens > positions.shape[0]:
        slot_mapping[positions.shape[0] : max_num_tokens] = pad_slot_id


# ------------------------------------------------------------------------------------------------
# Token counts (device side of the async spec-decode correction, fused with positions / seq_lens)
# ------------------------------------------------------------------------------------------------
def token_counts_reference(
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
    req_indices: torch.Tensor | None = None,
    query_pos: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    num_tokens: int = 0,
    num_positions: int | None = None,
    num_prev_reqs: int | None = None,
    base: str = "previous",
) -> None:
    """Reference for :func:`zb_patch.kernels.update_token_counts` (semantics: :mod:`zb_patch.kernels.token_counts`).

    Step 1 is vLLM's ``update_num_computed_tokens_for_batch_change`` (0.19-0.23) with the later
    hardening: a row participates when ``0 <= prev < num_prev`` (``num_prev`` defaults to the length of
    ``valid_sampled_token_count``, capped by the lengths of ``prev_num_draft_tokens`` and
    ``num_computed_tokens``) and ``prev_num_draft_tokens[prev] > 0``; its new count is the previous
    device count plus the valid count (``base="previous"``) or its CPU count minus the rejected drafts,
    ``drafts + 1 - valid`` (``base="cpu"``).  Then, as vLLM's
    ``_prepare_inputs`` does with separate torch ops::

        positions[t] = num_computed_tokens[req_indices[t]] + query_pos[t]     t < num_tokens
                       (0 where req_indices[t] is outside [0, num_reqs))
        positions[num_tokens:num_positions] = 0
        seq_lens[r] = num_computed_tokens[r] + num_scheduled_tokens[r]        r < num_reqs
        seq_lens[num_reqs:] = 0
    """
    n = num_reqs
    cpu_vals = cpu_num_computed_tokens[:n].to(num_computed_tokens.dtype)
    correct = prev_positions is not None and valid_sampled_token_count is not None and prev_num_draft_tokens is not None
    if correct:
        bound = valid_sampled_token_count.numel() if num_prev_reqs is None else num_prev_reqs
        bound = min(
            bound, valid_sampled_token_count.numel(), prev_num_draft_tokens.numel(), num_computed_tokens.numel()
        )
        prev = prev_positions[:n].to(torch.int64)
        in_range = (prev >= 0) & (prev < bound)
        gather = torch.where(in_range, prev, 0)
        if bound > 0:
            valid_counts = valid_sampled_token_count[gather]
            prev_computed = num_computed_tokens[gather]
            prev_drafts = prev_num_draft_tokens[gather]
        else:  # nothing to gather from: nobody participates
            valid_counts = torch.zeros_like(prev)
            prev_computed = torch.zeros_like(cpu_vals)
            prev_drafts = torch.zeros_like(prev)
        participating = in_range & (prev_drafts > 0)
        if base == "previous":
            corrected = prev_computed + valid_counts.to(torch.int32)
        else:  # "cpu"
            corrected = cpu_vals - (prev_drafts + 1 - valid_counts)
        new_computed = torch.where(participating, corrected.to(num_computed_tokens.dtype), cpu_vals)
        if num_accepted_tokens is not None:
            acc = num_accepted_tokens[:n]
            acc.copy_(torch.where(participating, valid_counts.to(acc.dtype), acc))
    else:
        new_computed = cpu_vals
    num_computed_tokens[:n] = new_computed

    seq_lens[:n] = (num_computed_tokens[:n] + num_scheduled_tokens[:n].to(num_computed_tokens.dtype)).to(seq_lens.dtype)
    seq_lens[n:] = 0

    if positions is not None:
        if num_positions is None:
            num_positions = num_tokens
        if num_tokens > 0:
            req = req_indices[:num_tokens].to(torch.int64)
            known = (req >= 0) & (req < n)  # a token of no request gets position 0, like a padded one
            computed = num_computed_tokens[torch.where(known, req, 0)] if n > 0 else torch.zeros_like(req)
            pos = computed.to(positions.dtype) + query_pos[:num_tokens].to(positions.dtype)
            positions[:num_tokens] = torch.where(known, pos, torch.zeros_like(pos))
        if num_positions > num_tokens:
            positions[num_tokens:num_positions] = 0


def vllm_update_num_computed_tokens_for_batch_change(
    num_computed_tokens: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    prev_positions: torch.Tensor,
    valid_sampled_token_count: torch.Tensor,
    prev_num_draft_tokens: torch.Tensor,
    cpu_num_computed_tokens: torch.Tensor,
) -> None:
    """The unhardened vLLM 0.19-0.23 semantics, transcribed for the benchmarks and tests (no compile).

    IndexError on a previous position outside ``valid_sampled_token_count``, as upstream.
    """
    gather = prev_positions.clamp(min=0)
    valid_counts = valid_sampled_token_count[gather]
    prev_computed = num_computed_tokens[gather]
    prev_drafts = prev_num_draft_tokens[gather]
    participating = (prev_positions >= 0) & (prev_drafts > 0)
    corrected = prev_computed + valid_counts.int()
    n = prev_positions.shape[0]
    num_computed_tokens[:n].copy_(torch.where(participating, corrected, cpu_num_computed_tokens))
    num_accepted_tokens.copy_(torch.where(participating, valid_counts, num_accepted_tokens))
