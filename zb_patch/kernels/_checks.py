"""Argument checks of the public kernel API, shared by the Triton launchers and the torch reference path.

Both paths call the functions here, so they reject exactly the same inputs, with the same message.
Every rejection is a ``ValueError`` whose message starts with the argument's name and value, then
says what is allowed: ``"seq_lens=tensor(shape=(2,), ...): needs >= 4 elements (num_reqs=4)"``.

Where the checks run (the hot paths are called every engine step):

* when a launcher is built (``slot_mapper``, ``token_counts_launcher``): everything about the bound
  buffers — type, dtype, shape, contiguity, device, capacities;
* per call: only attribute and integer checks on the per-step arguments (``0 <= num_reqs <= rows``,
  ``num_tokens <= capacity``, a per-step tensor's dtype / shape / contiguity / device) — no tensor
  ops, no ``.item()``, nothing that waits for the device.  The launchers run a one-expression
  version of these checks first and call the functions here only to explain a failure (or on their
  slow path), so the explanation and the verdict cannot drift apart.

Only lengths and layouts are checked: tensor *contents* (positions, request indices, ...) are data,
handled inside the kernels (out-of-range values map to padding) identically on both paths.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple, NoReturn

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
INT32_ONLY = (torch.int32,)
INT32_LIMIT = 2**31 - 1  # int32 index math: every index and count the kernels compute stays <= this


def describe(value: Any) -> str:
    """A short, loggable form of an argument value (tensors by layout, never by content)."""
    if isinstance(value, torch.Tensor):
        return (
            f"tensor(shape={tuple(value.shape)}, stride={tuple(value.stride())}, dtype={value.dtype}, "
            f"device={value.device})"
        )
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def reject(name: str, value: Any, allowed: str) -> NoReturn:
    raise ValueError(f"{name}={describe(value)}: {allowed}")


def check_int(name: str, value: Any, lo: int, hi: int | None = None, hi_why: str = "") -> int:
    """``value`` as an ``int`` with ``lo <= value (<= hi)``; Python / numpy integers only (no bool, no float)."""
    if isinstance(value, bool):
        reject(name, value, "must be an integer, not a bool")
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if number is None:
        reject(name, value, "must be an integer")
    if number < lo or (hi is not None and number > hi):
        bound = f"{lo} <= {name}" + (f" <= {hi}" if hi is not None else "")
        reject(name, value, f"allowed: {bound}" + (f" ({hi_why})" if hi_why and hi is not None else ""))
    return number


def check_vector(
    name: str,
    value: Any,
    *,
    device: torch.device,
    dtypes: tuple = INDEX_DTYPES,
    min_len: int = 0,
    min_len_why: str = "",
) -> int:
    """A 1-D contiguous tensor of one of ``dtypes`` on ``device`` with at least ``min_len`` elements;
    returns its length.  Contiguity matters: the kernels address ``ptr + i``."""
    if not isinstance(value, torch.Tensor):
        reject(name, value, "must be a torch.Tensor")
    if value.dtype not in dtypes:
        reject(name, value, "dtype must be " + " or ".join(str(d) for d in dtypes))
    if value.ndim != 1:
        reject(name, value, "must be 1-D")
    if not value.is_contiguous():
        reject(name, value, "must be contiguous (the kernels address element i at ptr + i)")
    if value.device != device:
        reject(name, value, f"must be on {device} (where the launcher's buffers are)")
    length = value.shape[0]
    if length < min_len:
        reject(name, value, f"needs >= {min_len} elements" + (f" ({min_len_why})" if min_len_why else ""))
    return length


# ------------------------------------------------------------------------------------------------
# Slot mapping
# ------------------------------------------------------------------------------------------------
class SlotMappingLimits(NamedTuple):
    rows: int  # block-table rows: num_reqs <= rows
    capacity: int  # slot_mapping elements: num_tokens <= capacity
    device: torch.device
    row_stride: int
    cp_world_size: int  # pcp * dcp
    cp_rank: int  # pcp_rank * dcp + dcp_rank


def check_slot_mapping_config(
    block_table: Any,
    slot_mapping: Any,
    *,
    block_size: Any,
    max_num_tokens: Any,
    block_table_stride: Any,
    physical_block_size: Any,
    pcp_world_size: Any,
    pcp_rank: Any,
    dcp_world_size: Any,
    dcp_rank: Any,
    cp_kv_cache_interleave_size: Any,
    pad_slot_id: Any,
) -> SlotMappingLimits:
    """Check a slot-mapping configuration once, when a mapper is built."""
    if not isinstance(block_table, torch.Tensor):
        reject("block_table", block_table, "must be a torch.Tensor")
    if block_table.dtype != torch.int32 or block_table.ndim != 2 or block_table.stride(1) != 1:
        reject("block_table", block_table, "must be a 2-D int32 tensor with unit column stride")
    device = block_table.device
    capacity = check_vector("slot_mapping", slot_mapping, device=device)
    row_stride = block_table.stride(0)
    if block_table_stride is not None and check_int("block_table_stride", block_table_stride, 0) != row_stride:
        reject("block_table_stride", block_table_stride, f"must equal block_table.stride(0) = {row_stride}")
    block_size = check_int("block_size", block_size, 1)
    max_num_tokens = check_int(
        "max_num_tokens", max_num_tokens, 0, min(capacity, INT32_LIMIT), "slot_mapping elements, int32 index math"
    )
    check_int("pad_slot_id", pad_slot_id, -(2**31), INT32_LIMIT, "an int32 value")
    pcp_world_size = check_int("pcp_world_size", pcp_world_size, 1)
    pcp_rank = check_int("pcp_rank", pcp_rank, 0, pcp_world_size - 1, "a rank of pcp_world_size")
    dcp_world_size = check_int("dcp_world_size", dcp_world_size, 1)
    dcp_rank = check_int("dcp_rank", dcp_rank, 0, dcp_world_size - 1, "a rank of dcp_world_size")
    cp_world_size = pcp_world_size * dcp_world_size
    interleave = check_int("cp_kv_cache_interleave_size", cp_kv_cache_interleave_size, 1)
    if physical_block_size is not None:
        physical = check_int("physical_block_size", physical_block_size, 1)
        if physical % block_size:
            reject(
                "physical_block_size",
                physical_block_size,
                f"the kernel block size {block_size} must divide the physical block size",
            )
        if cp_world_size > 1 and physical % interleave:
            reject(
                "cp_kv_cache_interleave_size",
                cp_kv_cache_interleave_size,
                f"must divide the physical block size {physical}",
            )
    if block_table.numel() > INT32_LIMIT or row_stride * block_table.shape[0] > INT32_LIMIT:
        reject("block_table", block_table, "must have fewer than 2**31 elements (int32 index math)")
    return SlotMappingLimits(
        block_table.shape[0],
        min(capacity, INT32_LIMIT),
        device,
        row_stride,
        cp_world_size,
        pcp_rank * dcp_world_size + dcp_rank,
    )


def check_slot_mapping_call(
    limits: SlotMappingLimits, num_reqs: Any, query_start_loc: Any, positions: Any
) -> tuple[int, int]:
    """Per-step arguments of a slot mapper; returns ``(num_reqs, num_tokens)``."""
    num_reqs = check_int("num_reqs", num_reqs, 0, limits.rows, "the block table's rows")
    check_vector(
        "query_start_loc",
        query_start_loc,
        device=limits.device,
        min_len=num_reqs + 1,
        min_len_why=f"num_reqs + 1 = {num_reqs + 1}",
    )
    num_tokens = check_vector("positions", positions, device=limits.device)
    if num_tokens > limits.capacity:
        reject("positions", positions, f"at most {limits.capacity} tokens (the elements of slot_mapping)")
    return num_reqs, num_tokens


# ------------------------------------------------------------------------------------------------
# Token counts
# ------------------------------------------------------------------------------------------------
class TokenCountsLimits(NamedTuple):
    device: torch.device
    rows: int  # num_reqs <= rows
    rows_of: str  # the shortest per-request buffer (for messages)
    tokens: int  # num_tokens <= tokens (req_indices / query_pos); -1: no positions
    tokens_of: str
    positions: int  # num_positions <= positions


def check_token_counts_buffers(
    *,
    num_computed_tokens: Any,
    seq_lens: Any,
    num_scheduled_tokens: Any,
    prev_positions: Any,
    prev_num_draft_tokens: Any,
    num_accepted_tokens: Any,
    req_indices: Any,
    query_pos: Any,
    positions: Any,
    num_reqs: Any = None,
) -> TokenCountsLimits:
    """Check the buffers of the token-count correction once (bound in a launcher), or per functional
    call — then with that call's ``num_reqs``, so that a too-short buffer is named itself."""
    if not isinstance(num_computed_tokens, torch.Tensor):
        reject("num_computed_tokens", num_computed_tokens, "must be a torch.Tensor")
    device = num_computed_tokens.device
    min_rows = 0 if num_reqs is None else check_int("num_reqs", num_reqs, 0, INT32_LIMIT)
    per_request = {
        "num_computed_tokens": (num_computed_tokens, INT32_ONLY),
        "seq_lens": (seq_lens, INT32_ONLY),
        "num_scheduled_tokens": (num_scheduled_tokens, INDEX_DTYPES),
        "prev_positions": (prev_positions, INDEX_DTYPES),
        "num_accepted_tokens": (num_accepted_tokens, INDEX_DTYPES),
    }
    rows, rows_of = INT32_LIMIT, ""
    for name, (tensor, dtypes) in per_request.items():
        if tensor is None and name in ("prev_positions", "num_accepted_tokens"):
            continue
        length = check_vector(
            name, tensor, device=device, dtypes=dtypes, min_len=min_rows, min_len_why=f"num_reqs={min_rows}"
        )
        if length < rows:
            rows, rows_of = length, name
    if prev_num_draft_tokens is not None:
        check_vector("prev_num_draft_tokens", prev_num_draft_tokens, device=device)
    given = {"positions": positions, "req_indices": req_indices, "query_pos": query_pos}
    if positions is None:
        for name, tensor in given.items():
            if tensor is not None:
                reject(name, tensor, "positions, req_indices and query_pos go together (all or none)")
        return TokenCountsLimits(device, rows, rows_of, -1, "", 0)
    for name, tensor in given.items():
        if tensor is None:
            reject(name, tensor, "positions, req_indices and query_pos go together (all or none)")
    num_positions = min(check_vector("positions", positions, device=device), INT32_LIMIT)
    tokens, tokens_of = min(
        (check_vector(name, given[name], device=device), name) for name in ("req_indices", "query_pos")
    )
    return TokenCountsLimits(device, rows, rows_of, min(tokens, INT32_LIMIT), tokens_of, num_positions)


TOKEN_COUNT_BASES = ("previous", "cpu")


def check_token_count_base(base: Any) -> None:
    """The correction's ``base``: ``"previous"`` or ``"cpu"`` (:mod:`zb_patch.kernels.token_counts`)."""
    if not isinstance(base, str) or base not in TOKEN_COUNT_BASES:
        reject("base", base, "'previous' or 'cpu'")


def check_token_counts_call(
    limits: TokenCountsLimits,
    num_reqs: Any,
    cpu_num_computed_tokens: Any,
    valid_sampled_token_count: Any,
    num_tokens: Any,
    num_positions: Any,
    num_prev_reqs: Any,
) -> tuple[int, int, int]:
    """Per-step arguments of the correction; returns ``(num_reqs, num_tokens, num_positions)``
    (both 0 when no positions buffer is bound: they are ignored then)."""
    num_reqs = check_int("num_reqs", num_reqs, 0, limits.rows, f"the length of {limits.rows_of}")
    check_vector(
        "cpu_num_computed_tokens",
        cpu_num_computed_tokens,
        device=limits.device,
        min_len=num_reqs,
        min_len_why=f"num_reqs={num_reqs}",
    )
    if valid_sampled_token_count is not None:
        check_vector("valid_sampled_token_count", valid_sampled_token_count, device=limits.device)
    if num_prev_reqs is not None:
        check_int("num_prev_reqs", num_prev_reqs, 0)
    if limits.tokens < 0:
        return num_reqs, 0, 0
    num_tokens = check_int("num_tokens", num_tokens, 0, limits.tokens, f"the length of {limits.tokens_of}")
    if num_positions is None:  # defaults to num_tokens
        num_tokens = check_int(
            "num_tokens",
            num_tokens,
            0,
            limits.positions,
            "the length of positions; num_positions defaults to num_tokens",
        )
        return num_reqs, num_tokens, num_tokens
    num_positions = check_int(
        "num_positions",
        num_positions,
        num_tokens,
        limits.positions,
        "num_tokens <= num_positions <= the length of positions",
    )
    return num_reqs, num_tokens, num_positions
