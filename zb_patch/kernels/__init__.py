"""zb-patch kernels: Triton kernels, their pure-torch reference twins, and the dispatch between them.

Public API (all leaves: no vLLM, no release knowledge)

* :func:`slot_mapper` / :func:`compute_slot_mapping` — slot mapping from ``query_start_loc``,
  ``positions`` and the block table, with context parallelism and hybrid block sizes
  (:mod:`zb_patch.kernels.slot_mapping` documents semantics, the expected call from a patched
  ``BlockTable.compute_slot_mapping`` and the Ascend shape).
* :func:`token_counts_launcher` / :func:`update_token_counts` — device-side async-spec-decode
  correction of ``num_computed_tokens`` / ``num_accepted_tokens`` fused with ``positions`` and
  ``seq_lens`` (:mod:`zb_patch.kernels.token_counts`).
* :func:`correct_optimistic_seq_lens_cpu` — the CPU twin of vllm-ascend's exact-seq_lens
  correction (numpy; :mod:`zb_patch.kernels.seq_lens_cpu`).

Bad inputs raise one ``ValueError`` naming the argument, its value and what is allowed, on both
paths alike (:mod:`zb_patch.kernels._checks`: buffers once when a launcher is built, per call only
attribute and integer tests).

Dispatch: Triton for tensors on an accelerator (CUDA, NPU, ...); the reference twins in
:mod:`zb_patch.kernels.reference` for CPU tensors, unless ``TRITON_INTERPRET=1`` (then Triton's
interpreter runs the kernels on CPU tensors — that is how CI tests them).  Triton is imported only
when a Triton path is taken, so this package imports with torch alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._checks import (
    TOKEN_COUNT_BASES,
    SlotMappingLimits,
    TokenCountsLimits,
    check_slot_mapping_call,
    check_slot_mapping_config,
    check_token_count_base,
    check_token_counts_buffers,
    check_token_counts_call,
)
from ._launch import interpret_mode
from .reference import PAD_SLOT_ID, slot_mapping_reference, token_counts_reference
from .seq_lens_cpu import correct_optimistic_seq_lens_cpu

__all__ = [
    "PAD_SLOT_ID",
    "TOKEN_COUNT_BASES",
    "compute_slot_mapping",
    "correct_optimistic_seq_lens_cpu",
    "slot_mapper",
    "token_counts_launcher",
    "update_token_counts",
    "uses_triton",
]


def uses_triton(device: torch.device | str) -> bool:
    """Whether tensors on ``device`` go to the Triton kernels (else: the torch reference)."""
    device_type = device if isinstance(device, str) else device.type
    return device_type != "cpu" or interpret_mode()


class _ReferenceSlotMapper:
    """CPU-tensor stand-in for :class:`~zb_patch.kernels.slot_mapping.SlotMappingLauncher`."""

    def __init__(
        self, block_table: torch.Tensor, slot_mapping: torch.Tensor, limits: SlotMappingLimits, **cfg: Any
    ) -> None:
        self.block_table, self.slot_mapping, self.limits, self.cfg = block_table, slot_mapping, limits, cfg

    def __call__(self, num_reqs: int, query_start_loc: torch.Tensor, positions: torch.Tensor) -> None:
        num_reqs, _ = check_slot_mapping_call(self.limits, num_reqs, query_start_loc, positions)
        slot_mapping_reference(
            query_start_loc, positions, self.block_table, self.slot_mapping, num_reqs=num_reqs, **self.cfg
        )


def slot_mapper(
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    block_size: int,
    max_num_tokens: int,
    block_table_stride: int | None = None,
    physical_block_size: int | None = None,
    pcp_world_size: int = 1,
    pcp_rank: int = 0,
    dcp_world_size: int = 1,
    dcp_rank: int = 0,
    cp_kv_cache_interleave_size: int = 1,
    pad_slot_id: int = PAD_SLOT_ID,
    **launch_shape: Any,
) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
    """A callable ``(num_reqs, query_start_loc, positions) -> None`` that writes ``slot_mapping``.

    Build it once per block table (see :mod:`zb_patch.kernels.slot_mapping` for the expected call).
    ``launch_shape`` (``tile``, ``max_programs``, ``windowed``) is for tests and benchmarks.
    Bad arguments raise ``ValueError`` naming the argument (:mod:`zb_patch.kernels._checks`): the
    buffers' layout here, the per-step arguments at each call, identically on both paths.
    """
    config: dict[str, Any] = dict(
        block_size=block_size,
        max_num_tokens=max_num_tokens,
        block_table_stride=block_table_stride,
        physical_block_size=physical_block_size,
        pcp_world_size=pcp_world_size,
        pcp_rank=pcp_rank,
        dcp_world_size=dcp_world_size,
        dcp_rank=dcp_rank,
        cp_kv_cache_interleave_size=cp_kv_cache_interleave_size,
        pad_slot_id=pad_slot_id,
    )
    limits = check_slot_mapping_config(block_table, slot_mapping, **config)
    if uses_triton(limits.device):
        from .slot_mapping import SlotMappingLauncher

        return SlotMappingLauncher(block_table, slot_mapping, **config, **launch_shape)
    return _ReferenceSlotMapper(
        block_table,
        slot_mapping,
        limits,
        block_size=block_size,
        max_num_tokens=max_num_tokens,
        physical_block_size=physical_block_size,
        cp_world_size=limits.cp_world_size,
        cp_rank=limits.cp_rank,
        cp_kv_cache_interleave_size=cp_kv_cache_interleave_size,
        pad_slot_id=pad_slot_id,
    )


_MAPPERS: dict[tuple, Callable[[int, torch.Tensor, torch.Tensor], None]] = {}


def compute_slot_mapping(
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    block_size: int,
    max_num_tokens: int,
    num_reqs: int | None = None,
    **config: Any,
) -> None:
    """One-shot slot mapping (mappers cached per configuration; hot paths keep a :func:`slot_mapper`).

    ``config``: the keyword arguments of :func:`slot_mapper`.  ``num_reqs`` defaults to
    ``len(query_start_loc) - 1``.
    """
    if num_reqs is None:  # a query_start_loc that is no 1-D tensor is reported by the mapper
        ok = isinstance(query_start_loc, torch.Tensor) and query_start_loc.ndim == 1
        num_reqs = max(query_start_loc.shape[0] - 1, 0) if ok else 0
    key = None
    if isinstance(block_table, torch.Tensor) and isinstance(slot_mapping, torch.Tensor):
        # the layout (strides) is part of the key: a mapper vouches only for the buffers it was built with
        key = (
            block_table.data_ptr(),
            tuple(block_table.shape),
            block_table.stride(),
            block_table.device,
            slot_mapping.data_ptr(),
            slot_mapping.dtype,
            tuple(slot_mapping.shape),
            slot_mapping.stride(),
            block_size,
            max_num_tokens,
            tuple(sorted(config.items())),
            uses_triton(block_table.device),
        )
    mapper = _MAPPERS.get(key)
    if mapper is None:
        mapper = slot_mapper(block_table, slot_mapping, block_size=block_size, max_num_tokens=max_num_tokens, **config)
        if len(_MAPPERS) >= 64:
            _MAPPERS.clear()
        _MAPPERS[key] = mapper
    mapper(num_reqs, query_start_loc, positions)


_triton_update_token_counts: Callable[..., None] | None = None  # imported on the first Triton launch


def update_token_counts(
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
    **launch_shape: Any,
) -> None:
    """Async spec-decode token-count correction + positions + seq_lens (one launch on device).

    Semantics (``base``: ``"previous"`` or ``"cpu"``) and the expected call: :mod:`zb_patch.kernels.token_counts`.
    Every tensor and count is checked on each call (``ValueError`` naming the argument); hot paths bind their
    buffers once with :func:`token_counts_launcher` instead.
    """
    check_token_count_base(base)
    limits = check_token_counts_buffers(
        num_computed_tokens=num_computed_tokens,
        seq_lens=seq_lens,
        num_scheduled_tokens=num_scheduled_tokens,
        prev_positions=prev_positions,
        prev_num_draft_tokens=prev_num_draft_tokens,
        num_accepted_tokens=num_accepted_tokens,
        req_indices=req_indices,
        query_pos=query_pos,
        positions=positions,
        num_reqs=num_reqs,
    )
    num_reqs, num_tokens, num_positions = check_token_counts_call(
        limits, num_reqs, cpu_num_computed_tokens, valid_sampled_token_count, num_tokens, num_positions, num_prev_reqs
    )
    args = (
        num_computed_tokens,
        num_accepted_tokens,
        prev_positions,
        valid_sampled_token_count,
        prev_num_draft_tokens,
        cpu_num_computed_tokens,
        num_scheduled_tokens,
        seq_lens,
    )
    counts = dict(
        num_reqs=num_reqs,
        req_indices=req_indices,
        query_pos=query_pos,
        positions=positions,
        num_tokens=num_tokens,
        num_positions=num_positions,
        num_prev_reqs=num_prev_reqs,
        base=base,
    )
    if uses_triton(limits.device):
        global _triton_update_token_counts
        if _triton_update_token_counts is None:
            from .token_counts import launch_token_counts as _triton_update_token_counts
        _triton_update_token_counts(*args, **counts, **launch_shape)
    else:
        token_counts_reference(*args, **counts)


class _ReferenceTokenCounts:
    """CPU-tensor stand-in for :class:`~zb_patch.kernels.token_counts.TokenCountsLauncher`."""

    def __init__(self, limits: TokenCountsLimits, base: str, **buffers: Any) -> None:
        self.limits, self.base, self.buffers = limits, base, buffers

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
        num_reqs, num_tokens, num_positions = check_token_counts_call(
            self.limits,
            num_reqs,
            cpu_num_computed_tokens,
            valid_sampled_token_count,
            num_tokens,
            num_positions,
            num_prev_reqs,
        )
        b = self.buffers
        token_counts_reference(
            b["num_computed_tokens"],
            b["num_accepted_tokens"],
            b["prev_positions"],
            valid_sampled_token_count,
            b["prev_num_draft_tokens"],
            cpu_num_computed_tokens,
            b["num_scheduled_tokens"],
            b["seq_lens"],
            num_reqs=num_reqs,
            req_indices=b["req_indices"],
            query_pos=b["query_pos"],
            positions=b["positions"],
            num_tokens=num_tokens,
            num_positions=num_positions,
            num_prev_reqs=num_prev_reqs,
            base=self.base,
        )


def token_counts_launcher(
    *,
    num_computed_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    num_scheduled_tokens: torch.Tensor,
    prev_positions: torch.Tensor | None = None,
    prev_num_draft_tokens: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    req_indices: torch.Tensor | None = None,
    query_pos: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    base: str = "previous",
    **launch_shape: Any,
) -> Callable[..., None]:
    """The fused correction bound to persistent buffers: ``f(num_reqs, cpu_num_computed_tokens,
    valid_sampled_token_count=None, *, num_tokens=0, num_positions=None, num_prev_reqs=None)``, correcting from
    ``base`` (``"previous"``: the previous device counts, ``"cpu"``: this step's CPU counts).

    Triton on device tensors, the torch reference on CPU tensors; see
    :class:`zb_patch.kernels.token_counts.TokenCountsLauncher` for the expected call.  The buffers
    are checked here, once; a call checks only its own arguments (``ValueError`` naming the argument).
    """
    buffers = dict(
        num_computed_tokens=num_computed_tokens,
        seq_lens=seq_lens,
        num_scheduled_tokens=num_scheduled_tokens,
        prev_positions=prev_positions,
        prev_num_draft_tokens=prev_num_draft_tokens,
        num_accepted_tokens=num_accepted_tokens,
        req_indices=req_indices,
        query_pos=query_pos,
        positions=positions,
    )
    limits = check_token_counts_buffers(**buffers)
    check_token_count_base(base)
    if uses_triton(limits.device):
        from .token_counts import TokenCountsLauncher

        return TokenCountsLauncher(**buffers, base=base, **launch_shape)
    return _ReferenceTokenCounts(limits, base, **buffers)


def __getattr__(name: str) -> Any:  # lazy: importing Triton only when asked for
    if name == "SlotMappingLauncher":
        from .slot_mapping import SlotMappingLauncher

        return SlotMappingLauncher
    if name == "TokenCountsLauncher":
        from .token_counts import TokenCountsLauncher

        return TokenCountsLauncher
    raise AttributeError(name)
