"""Slot mapping on the device, in one Triton launch shaped for Ascend NPUs (and fine on CUDA).

What it computes
----------------
For the tokens of the current batch (``positions[t]``, request ``r`` owning ``t`` when
``query_start_loc[r] <= t < query_start_loc[r+1]``)::

    slot_mapping[t] = block_table[r, local(p) // B] * B + local(p) % B     if this CP rank owns p
                    = PAD_SLOT_ID (-1)                                        otherwise
    slot_mapping[num_tokens:max_num_tokens] = PAD_SLOT_ID                     (graph padding)

with ``B`` the *kernel* (attention) block size, i.e. ``BlockTable.block_size``.  Context parallelism
(total world ``W = pcp * dcp``, rank ``pcp_rank * dcp + dcp_rank``, interleave ``I``) spreads the
token stream over ranks in runs of ``I`` tokens: rank ``(p // I) % W`` owns position ``p`` and stores
it at local offset ``local(p) = (p // (I*W)) * I + p % I``.  Without CP, ``local(p) = p``.

Hybrid block sizes: vLLM and vllm-ascend (0.19-0.23) keep the block table in *kernel* blocks — one
physical KV block of ``physical_block_size`` tokens is written as ``k = physical // B`` consecutive
kernel block ids when the row is appended (``map_to_kernel_blocks`` /
``_convert_physical_to_logical_blocks``), and the row stride is ``max_blocks * k``.  The formula
above is then exact for every configuration vLLM accepts (``I`` divides the physical block size):
it equals vllm-ascend's CP formula (virtual block of ``physical * W`` tokens, #10442) and vLLM's
generic kernel whenever ``I`` divides ``B``.  (vLLM's generic kernel uses a virtual block of
``B * W`` and is wrong when ``B < I``, e.g. 16-token kernel blocks in 128-token pages with
interleave 128 — the case #10442 worked around.)  ``physical_block_size`` is therefore only
validated, not used in the arithmetic.

Hardening over upstream: tokens outside every request, positions outside ``[0, 2**31)`` and block
indices past the row's end map to PAD_SLOT_ID instead of reading outside the block table.

Contract on inputs (both paths; :mod:`zb_patch.kernels._checks`, ``ValueError`` naming the argument):

* built once: ``block_table`` a 2-D int32 tensor with unit column stride and fewer than 2**31
  elements; ``slot_mapping`` a 1-D contiguous int32 / int64 tensor on the same device with
  ``>= max_num_tokens`` elements; block size, CP ranks and interleave as vLLM accepts them;
* per call: ``0 <= num_reqs <= block_table.shape[0]``; ``query_start_loc`` and ``positions``
  1-D, contiguous, int32 / int64, on the block table's device; ``len(query_start_loc) >
  num_reqs``; ``len(positions) <= len(slot_mapping)``.
* positions are int64 data but the index math is int32 (Ascend's vector units emulate int64): a
  position ``p`` with ``p < 0`` or ``p >= 2**31`` gets PAD_SLOT_ID — on the reference too, which
  could compute it, so that the paths agree; no sequence vLLM schedules comes near 2**31 tokens.
  ``query_start_loc`` must be non-decreasing (data: not checked; tokens it assigns to no request pad).

Expected call (patch of vllm-ascend 0.19.1rc1-0.23.x ``BlockTable.compute_slot_mapping``)
-----------------------------------------------------------------------------------------
Build one mapper per ``BlockTable`` (its buffers live as long as it does) with
:func:`zb_patch.kernels.slot_mapper` — Triton on device tensors, the torch reference on CPU tensors —
and call it with the method's own arguments::

    from zb_patch import kernels

    def compute_slot_mapping(self, num_reqs, query_start_loc, positions):
        mapper = self.__dict__.get("_zb_slot_mapper")
        if mapper is None:
            mapper = self._zb_slot_mapper = kernels.slot_mapper(
                self.block_table.gpu,              # [max_num_reqs * dup, max_blocks * k] int32
                self.slot_mapping.gpu,             # int32 on Ascend, int64 in vLLM
                block_size=self.block_size,        # kernel block size (logical_block_size)
                max_num_tokens=self.max_num_batched_tokens,
                physical_block_size=self.physical_block_size,   # vLLM: block_size * blocks_per_kv_block
                pcp_world_size=self.pcp_world_size, pcp_rank=self.pcp_rank,
                dcp_world_size=self.dcp_world_size, dcp_rank=self.dcp_rank,
                cp_kv_cache_interleave_size=self.cp_kv_cache_interleave_size,
            )
        mapper(num_reqs, query_start_loc, positions)

``block_table_stride`` may be omitted (it must equal ``block_table.stride(0)``).  One-shot callers
can use :func:`zb_patch.kernels.compute_slot_mapping`, which caches mappers by configuration.
vllm-ascend's CP branch (``_compute_pcp_dcp_slot_mapping``) writes only ``[:num_tokens]``; this
kernel also pads the tail, as the non-CP branch does — a superset.

Why it is shaped this way (Ascend)
----------------------------------
vllm-ascend measured vLLM's generic kernel at 173 us (4 tokens) and 1039 us (8192 tokens) per step
on an Atlas A2 against 3.0 / 21.2 us for its own kernel (#13048).  The generic kernel runs one
program per request plus one padding program, in 1024-wide int64 vectors, with the block size,
``num_tokens`` and friends as runtime values.  On an NPU every program is a vector core's serial
task (no latency hiding across thousands of threads), so this kernel:

* launches once with **few programs** — ``min(#tiles, #cores)`` — each looping over **token tiles**
  of ``TILE`` tokens (persistent grid), instead of one program per request;
* does its index arithmetic in **int32** vectors (int64 vector math is emulated on the vector unit),
  with ``B``, ``W``, ``I`` and the CP rank as **constexprs** so divisions become shifts and masks,
  and the **CP-off fast path** is a constexpr branch with no ownership arithmetic at all;
* first **guesses** each token's request and verifies the guess with two loads of
  ``query_start_loc`` (``qsl[g] <= t < qsl[g+1]``): on NPU the guess is ``g = t`` (decode batches;
  two *contiguous* loads), on CUDA ``g = t // (tokens per request)`` (decode and uniform spec-decode
  batches, gathers being cheap there).  Only when a guess fails does a tile count request starts:
  one **contiguous** load of ``query_start_loc`` (count of starts ``<= t``, a vector compare +
  max-reduction) — a tile inside one request (prefill chunks) needs no per-token search at all;
* on NPU (``windowed=True``, the default there) reads the block table of such a tile as one
  **contiguous window** and selects each token's block id with a one-hot compare + max-reduction,
  instead of per-token gathers (which the Ascend compiler scalarises); the window is what
  #13048 loads too, but its ``tl.gather`` is avoided because the Triton 3.2 interpreter (CI) lacks it
  and triton-ascend 3.2.0 does not document it;
* avoids ``tl.num_programs`` (a slow scalar path on 910B per #13048) — the program count is an
  argument — and lists every runtime integer in ``do_not_specialize`` so a step never recompiles.

Only Triton 3.2 language features are used (triton-ascend follows Triton 3.2): no ``tl.gather``,
no Ascend-only ``extract_slice``/``insert_slice``, no ``tl.range`` options, no ``tl.sum`` over
integers (the triton-ascend 3.2 interpreter returns int64 data labelled int32 from it, and a store
of that data overwrites the neighbouring element — seen while writing this).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ._checks import INDEX_DTYPES, check_slot_mapping_call, check_slot_mapping_config
from ._launch import FastLauncher, interpret_mode, multiprocessor_count, next_power_of_2

PAD_SLOT_ID = -1
_INT32_MAX = tl.constexpr(2**31 - 1)

# Launch shape per device type: tokens per tile, programs cap, qsl chunk for mixed tiles, warps.
# CUDA: 128-token tiles keep the per-lane request search at <= 32 compares per lane and chunk and
# give 64 programs for 8192 tokens (one tile each).  NPU: larger tiles amortise the scalar work of a
# vector core; untuned (no NPU measurement yet).
_CUDA_TILE, _NPU_TILE, _INTERP_TILE = 128, 256, 64
_CUDA_WARPS = 4
_REQ_CHUNK = 32


@triton.jit(do_not_specialize=["num_reqs", "num_tokens"])
def _slot_mapping_kernel(
    query_start_loc_ptr,  # [num_reqs + 1] int32, non-decreasing
    positions_ptr,  # [num_tokens] int64 (or int32)
    block_table_ptr,  # [rows, BT_STRIDE] int32, kernel block ids
    slot_mapping_ptr,  # [>= max(num_tokens, MAX_NUM_TOKENS)] int32 or int64
    num_reqs,  # requests in the batch
    num_tokens,  # tokens in the batch (len(positions))
    MAX_NUM_TOKENS: tl.constexpr,  # [num_tokens, MAX_NUM_TOKENS) is padding
    MAX_BLOCKS: tl.constexpr,  # valid columns of a block-table row
    BT_STRIDE: tl.constexpr,  # elements between block-table rows
    NUM_PROGRAMS: tl.constexpr,  # grid size (a constant: no tl.num_programs, slow on Ascend)
    BLOCK_SIZE: tl.constexpr,  # kernel (attention) block size
    CP_WORLD: tl.constexpr,  # pcp * dcp
    CP_RANK: tl.constexpr,  # pcp_rank * dcp + dcp_rank
    CP_INTERLEAVE: tl.constexpr,  # cp_kv_cache_interleave_size
    PAD_ID: tl.constexpr,
    TILE: tl.constexpr,  # tokens per tile (power of 2)
    REQ_PAD: tl.constexpr,  # power of 2 > max num_reqs: width of the query_start_loc load
    REQ_CHUNK: tl.constexpr,  # starts compared per step in a tile that spans several requests
    WINDOWED: tl.constexpr,  # single-request tiles read a contiguous block-table window
    WINDOW: tl.constexpr,  # window width (power of 2 >= TILE // local-tokens-per-block + 2)
    UNIFORM_GUESS: tl.constexpr,  # guess owners as t // (tokens per request) (gathers) instead of t
):
    """Grid ``(NUM_PROGRAMS,)``; program ``p`` handles tiles ``p, p + NUM_PROGRAMS, ...``.

    Everything that is fixed for a block table (its shape, the padding length, CP rank, block size,
    grid) is a constexpr, so a step passes six arguments.  See the module docstring for the
    semantics; all index math is int32.
    """
    pid = tl.program_id(0)
    out_ty = slot_mapping_ptr.dtype.element_ty
    lanes = tl.arange(0, TILE)
    req_lanes = tl.arange(0, REQ_PAD)
    num_slots = tl.maximum(num_tokens, MAX_NUM_TOKENS)
    num_tiles = (num_slots + TILE - 1) // TILE
    for tile in range(pid, num_tiles, NUM_PROGRAMS):
        t0 = tile * TILE
        offs = t0 + lanes
        if t0 < num_tokens:
            in_batch = offs < num_tokens
            # all independent loads first: positions, query_start_loc[1..num_reqs] (one contiguous
            # load, cached after the first tile) and the decode guess below
            pos_in = tl.load(positions_ptr + offs, mask=in_batch, other=0)
            # int32 index math: a position outside [0, 2**31) pads (as in the reference); tested before
            # the cast so that a huge int64 position cannot wrap into range
            pos = tl.where((pos_in >= 0) & (pos_in <= _INT32_MAX), pos_in, -1).to(tl.int32)
            starts = tl.load(query_start_loc_ptr + 1 + req_lanes, mask=req_lanes < num_reqs, other=_INT32_MAX)
            first_start = tl.load(query_start_loc_ptr)
            t_last = tl.minimum(t0 + TILE, num_tokens) - 1
            # Guess the owner of each token and verify the guess: qsl[g] <= t < qsl[g+1] means
            # req(t) = g, whatever the other rows hold.  UNIFORM_GUESS (CUDA): g = t // (tokens per
            # request), exact for decode and spec-decode batches (every request k tokens); else
            # (NPU) g = t, exact for decode batches and read with contiguous loads only.
            if UNIFORM_GUESS:
                per_req = tl.maximum(num_tokens // tl.maximum(num_reqs, 1), 1)
                guess = offs // per_req
                guess_lo = t0 // per_req
                guess_hi = t_last // per_req
            else:
                guess = offs
                guess_lo = t0
                guess_hi = t_last
            guess_ok = in_batch & (guess < num_reqs)
            own_start = tl.load(query_start_loc_ptr + guess, mask=guess_ok, other=_INT32_MAX)
            own_end = tl.load(query_start_loc_ptr + 1 + guess, mask=guess_ok, other=0)
            miss = in_batch & ((own_start > offs) | (own_end <= offs))
            if tl.max(miss.to(tl.int32), axis=0) == 0:
                req = guess
                req_lo = guess_lo
                req_hi = guess_hi
            else:
                # number of starts <= t (starts are sorted: the largest such index + 1)
                req_lo = tl.max(tl.where(starts <= t0, req_lanes + 1, 0), axis=0)
                req_hi = tl.max(tl.where(starts <= t_last, req_lanes + 1, 0), axis=0)
                req = tl.zeros([TILE], dtype=tl.int32) + req_lo
                if req_lo != req_hi:
                    # this tile spans several requests: per-lane count over starts[req_lo .. req_hi)
                    for r in range(req_lo, req_hi, REQ_CHUNK):
                        idx = r + tl.arange(0, REQ_CHUNK)
                        s = tl.load(query_start_loc_ptr + 1 + idx, mask=idx < req_hi, other=_INT32_MAX)
                        hit = tl.where(s[None, :] <= offs[:, None], idx[None, :] + 1, 0)
                        req = tl.maximum(req, tl.max(hit, axis=1))
            valid = in_batch & (req < num_reqs) & (offs >= first_start) & (pos >= 0)
            if CP_WORLD == 1:
                local = pos
                owned = valid
            else:
                owned = valid & ((pos // CP_INTERLEAVE) % CP_WORLD == CP_RANK)
                local = (pos // (CP_INTERLEAVE * CP_WORLD)) * CP_INTERLEAVE + pos % CP_INTERLEAVE
            block_idx = local // BLOCK_SIZE
            block_off = local % BLOCK_SIZE
            owned = owned & (block_idx < MAX_BLOCKS)
            row = req * BT_STRIDE
            if WINDOWED:
                if req_lo == req_hi:
                    # one request: its block ids form a short contiguous run of the row
                    base = tl.minimum(tl.min(tl.where(owned, block_idx, _INT32_MAX), axis=0), MAX_BLOCKS)
                    cols = base + tl.arange(0, WINDOW)
                    window = tl.load(block_table_ptr + req_lo * BT_STRIDE + cols, mask=cols < MAX_BLOCKS, other=0)
                    rel = block_idx - base
                    fits = owned & (rel < WINDOW)
                    pick = tl.where(rel[:, None] == tl.arange(0, WINDOW)[None, :], window[None, :], -_INT32_MAX)
                    from_window = tl.max(pick, axis=1)
                    gathered = tl.load(block_table_ptr + row + block_idx, mask=owned & (rel >= WINDOW), other=0)
                    block_num = tl.where(fits, from_window, gathered)
                else:
                    block_num = tl.load(block_table_ptr + row + block_idx, mask=owned, other=0)
            else:
                block_num = tl.load(block_table_ptr + row + block_idx, mask=owned, other=0)
            slot = block_num.to(out_ty) * BLOCK_SIZE + block_off.to(out_ty)
            slot = tl.where(owned, slot, PAD_ID)
            tl.store(slot_mapping_ptr + offs, slot.to(out_ty), mask=offs < num_slots)
        else:
            tl.store(slot_mapping_ptr + offs, tl.full([TILE], PAD_ID, out_ty), mask=offs < num_slots)


class SlotMappingLauncher:
    """Slot mapping for one block table and one output buffer (see the module docstring).

    Construct once per ``BlockTable``; call with ``(num_reqs, query_start_loc, positions)`` each
    step.  Always Triton (CPU tensors need ``TRITON_INTERPRET=1``); :func:`zb_patch.kernels.slot_mapper`
    picks between this and the torch reference.

    ``tile``, ``max_programs``, ``windowed``, ``uniform_guess`` and ``num_warps`` (CUDA) override the
    per-device launch shape (tests use them to force several tiles and programs and both block-lookup paths);
    ``direct_launch=False`` keeps Triton's normal launch path (benchmarks compare the two).
    """

    def __init__(
        self,
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
        tile: int | None = None,
        max_programs: int | None = None,
        windowed: bool | None = None,
        uniform_guess: bool | None = None,
        direct_launch: bool | None = None,
        num_warps: int | None = None,
    ) -> None:
        limits = check_slot_mapping_config(
            block_table,
            slot_mapping,
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
        self._limits = limits
        world, rank, stride = limits.cp_world_size, limits.cp_rank, limits.row_stride

        self.block_table = block_table
        self.slot_mapping = slot_mapping
        self.block_size = int(block_size)
        self.max_num_tokens = int(max_num_tokens)
        self.max_blocks = block_table.shape[1]
        self.max_num_reqs = block_table.shape[0]
        self.cp_world_size, self.cp_rank = world, rank
        self.cp_kv_cache_interleave_size = int(cp_kv_cache_interleave_size)
        self.pad_slot_id = int(pad_slot_id)

        device_type = block_table.device.type
        self._device_index = block_table.device.index
        if interpret_mode():
            default_tile, default_programs = _INTERP_TILE, 4
        elif device_type == "cuda":
            default_tile, default_programs = _CUDA_TILE, multiprocessor_count("cuda", self._device_index)
        else:
            default_tile, default_programs = _NPU_TILE, multiprocessor_count(device_type, self._device_index)
        self.tile = next_power_of_2(tile or default_tile)
        max_programs = max(1, int(max_programs or default_programs))
        # fixed grid: enough programs for the padded buffer, at most one per core
        self.num_programs = max(1, min(-(-self.max_num_tokens // self.tile), max_programs))
        self.windowed = (device_type not in ("cuda", "cpu")) if windowed is None else bool(windowed)
        # owner guess with gathers on GPUs; contiguous-only (decode) guess where gathers are slow
        self.uniform_guess = (device_type in ("cuda", "cpu")) if uniform_guess is None else bool(uniform_guess)
        # local tokens per kernel block: B (no CP), B per I*W positions with CP -> a tile of TILE
        # positions touches at most TILE // B + 2 blocks either way.
        window = next_power_of_2(self.tile // self.block_size + 2)
        self._launcher = FastLauncher(
            _slot_mapping_kernel,
            dict(
                MAX_NUM_TOKENS=self.max_num_tokens,
                MAX_BLOCKS=self.max_blocks,
                BT_STRIDE=stride,
                NUM_PROGRAMS=self.num_programs,
                BLOCK_SIZE=self.block_size,
                CP_WORLD=world,
                CP_RANK=rank,
                CP_INTERLEAVE=self.cp_kv_cache_interleave_size,
                PAD_ID=self.pad_slot_id,
                TILE=self.tile,
                REQ_PAD=next_power_of_2(self.max_num_reqs + 1),
                REQ_CHUNK=_REQ_CHUNK,
                WINDOWED=self.windowed,
                WINDOW=window,
                UNIFORM_GUESS=self.uniform_guess,
            ),
            device_type=device_type,
            tensor_slots=(0, 1, 2, 3),
            num_warps=num_warps or _CUDA_WARPS,
            direct=direct_launch,
        )
        # direct launches: the block table and output buffer are bound here (BlockTable buffers are
        # allocated once); only query_start_loc / positions change from step to step
        self._bt_ptr = block_table.data_ptr()
        self._slot_ptr = slot_mapping.data_ptr()
        self._capacity = limits.capacity
        self._device_id = block_table.get_device()
        self._fast: Any = None
        self._fast_dtypes: tuple = ()

    def __call__(self, num_reqs: int, query_start_loc: torch.Tensor, positions: torch.Tensor) -> None:
        """Write ``slot_mapping`` for the batch; same arguments as ``BlockTable.compute_slot_mapping``.

        The arguments are checked with attribute and integer tests only (this runs every step);
        :func:`~zb_patch.kernels._checks.check_slot_mapping_call` explains a failure.
        """
        try:  # cheapest forms: numel() == shape[0] once ndim == 1, get_device() (an int) for the device
            qsl_dtype, pos_dtype = query_start_loc.dtype, positions.dtype
            num_tokens = positions.numel()
            ok = (
                type(num_reqs) is int
                and 0 <= num_reqs <= self.max_num_reqs
                and num_tokens <= self._capacity
                and query_start_loc.ndim == 1
                and positions.ndim == 1
                and query_start_loc.numel() > num_reqs
                and qsl_dtype in INDEX_DTYPES
                and pos_dtype in INDEX_DTYPES
                and query_start_loc.is_contiguous()
                and positions.is_contiguous()
                and query_start_loc.get_device() == self._device_id
                and positions.get_device() == self._device_id
            )
        except AttributeError:  # not tensors
            ok = False
        if not ok:  # raises, or normalises an integer type (numpy ints)
            num_reqs, num_tokens = check_slot_mapping_call(self._limits, num_reqs, query_start_loc, positions)
            qsl_dtype, pos_dtype = query_start_loc.dtype, positions.dtype
        fast = self._fast
        if fast is not None and qsl_dtype is self._fast_dtypes[0] and pos_dtype is self._fast_dtypes[1]:
            qsl_ptr = query_start_loc.data_ptr()
            pos_ptr = positions.data_ptr()
            if not (qsl_ptr | pos_ptr) & 15 and fast(
                self.num_programs, qsl_ptr, pos_ptr, self._bt_ptr, self._slot_ptr, num_reqs, num_tokens
            ):
                return
        compiled = self._launcher.launch_slow(
            self.num_programs,
            (query_start_loc, positions, self.block_table, self.slot_mapping, num_reqs, num_tokens),
        )
        if (
            self._fast is None
            and self._launcher.direct_supported
            and not (query_start_loc.data_ptr() | positions.data_ptr()) & 15
        ):
            self._fast = self._launcher.direct_launcher(compiled, self._device_index)
            self._fast_dtypes = (qsl_dtype, pos_dtype)

    @property
    def direct_launches(self) -> int:
        return self._launcher.direct_launches


__all__ = ["PAD_SLOT_ID", "SlotMappingLauncher"]
