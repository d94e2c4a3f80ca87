"""mtp-draft-slots (vllm-ascend 0.13 only; gone with MtpProposer in #7033, 0.16.0rc1): MtpProposer, k >= 2, moves
every later draft step's KV slot on with ``slot_mapping += 1``, which crosses into another request's block at a block
boundary. Adapter ascend-0.13; spec: :func:`patch`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping

from ...registry import ONE_STREAM, Patch, RestsOn

ID = "mtp-draft-slots"


class _SlotsFromBlockTable:
    """Stands for ``MtpProposer.model`` during one ``_propose`` call (see :func:`patch`): before every model call
    after the first (draft steps 1 .. k-1), rewrites the draft tokens' slots ``[:batch_size]`` of the forward
    context's attention metadata from their positions and the block table, as the release's EAGLE proposer computes
    them; slots the release set to the padding id (positions past max_model_len) stay so. Attribute reads go to the
    model."""

    def __init__(self, model, block_table, batch_size: int, block_size: int) -> None:
        self.__dict__.update(_zb_model=model, _zb_table=block_table, _zb_rows=batch_size, _zb_block=block_size)
        self.__dict__["_zb_calls"] = 0

    def __getattr__(self, name):
        return getattr(self.__dict__["_zb_model"], name)

    def __call__(self, *args, **kwargs):
        self.__dict__["_zb_calls"] += 1
        if self.__dict__["_zb_calls"] > 1:
            self._zb_rewrite(kwargs["positions"] if "positions" in kwargs else args[1])
        return self.__dict__["_zb_model"](*args, **kwargs)

    def _zb_rewrite(self, positions) -> None:
        import torch
        from vllm.forward_context import get_forward_context

        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, dict):
            metadata = next(iter(metadata.values()))
        slots = metadata.slot_mapping
        n, block_size = self.__dict__["_zb_rows"], self.__dict__["_zb_block"]
        pos = positions[:n].to(torch.int64)
        block_ids = self.__dict__["_zb_table"][:n].gather(1, (pos // block_size).view(-1, 1)).view(-1)
        computed = (block_ids.to(torch.int64) * block_size + pos % block_size).to(slots.dtype)
        current = slots[:n]
        current.copy_(torch.where(current < 0, current, computed))


def make_mtp_propose(original: Callable) -> Callable:
    """Wrap ``MtpProposer._propose``: for the duration of the call its ``model`` is a :class:`_SlotsFromBlockTable`
    over the real one (restored after), when the release computes later draft steps' slots with ``+= 1`` (k >= 2, no
    context parallelism, no shared-expert DP)."""

    signature = inspect.signature(original)

    @functools.wraps(original)
    def _propose(drafter, *args, **kwargs):
        if (
            drafter.num_speculative_tokens < 2
            or drafter.pcp_size * drafter.dcp_size > 1  # the release maps those slots from its own table
            or getattr(drafter, "enable_shared_expert_dp", False)  # positions are padded and reduced
            or "model" not in drafter.__dict__
        ):
            return original(drafter, *args, **kwargs)
        bound = signature.bind(drafter, *args, **kwargs)
        common = bound.arguments["common_attn_metadata"]
        batch_size = bound.arguments["next_token_ids"].shape[0]
        block_size = drafter.runner.input_batch.block_table.block_tables[0].block_size  # the table of the step-0 slots
        model = drafter.__dict__["model"]
        drafter.__dict__["model"] = _SlotsFromBlockTable(model, common.block_table_tensor, batch_size, block_size)
        try:
            return original(drafter, *args, **kwargs)
        finally:
            drafter.__dict__["model"] = model

    return _propose


def patch(fingerprints: Mapping[str, str], *, remove_when: str) -> Patch:
    """The fix for an adapter on vllm-ascend 0.13 (``fingerprints`` of ``MtpProposer._propose``)."""
    return Patch(
        id=ID,
        rests_on=RestsOn(
            ONE_STREAM,
            "device ops on the draft tokens' slot tensor, queued on the drafter's stream before each draft model call that reads it (program order); no host wait",
        ),
        target="vllm_ascend.spec_decode.mtp_proposer:MtpProposer._propose",
        make=make_mtp_propose,
        fingerprints={"vllm-ascend 0.13.0": "97cc12b8c7e3a7b1"},
        why="vllm-ascend 0.13's MtpProposer, k >= 2: after the first draft step it moves every draft token's KV slot on "
        "with `slot_mapping += 1` (spec_decode/mtp_proposer.py:504). A draft position that starts a new block gets the "
        "slot after the last one of its block: slot 0 of the next block *id*, which belongs to another request (its MTP "
        "layer's KV there is overwritten), or, after the cache's last block, one past the cache (an out-of-range write; "
        "the emulated op raises). In synchronous and async scheduling alike, with or without zb-patch. vllm-ascend "
        "#7033 (0.16.0rc1) deleted MtpProposer (MTP runs on the EAGLE proposer, which maps slots through the block "
        "table); never backported to 0.13.",
        how="Wrapper. For the duration of the release's _propose its `model` attribute is a thin stand-in "
        "(zb_patch.versions.fixes.mtp_draft_slots; attribute reads go to the model): before each model call after the first, "
        "it rewrites the draft tokens' slots in the forward context's attention metadata from their (clamped) "
        "positions and the common metadata's block table, `block_table[row, pos // block_size] * block_size + pos % "
        "block_size` with the block size of the table the first step's slots came from, as the release's EAGLE "
        "proposer does; padding slots (positions past max_model_len) stay padding. The scheduler allocates the draft "
        "positions' blocks ahead (lookahead tokens), so every row maps into its own blocks. Device ops only. Left to "
        "the release: k = 1 (no later step), PCP / DCP > 1 (its own slot table), shared-expert DP (padded positions), "
        "the torchair MTP proposer. Applies with or without async scheduling and zero-bubble.",
        upstream=("vllm-ascend#7033",),
        remove_when=remove_when,
    )
