"""Device-side token-count correction for async spec decoding, fused with positions and seq_lens.

What it computes (one launch)
-----------------------------
With zero-bubble scheduling the CPU ``num_computed_tokens`` of a request that had drafts last step
is optimistic (all drafts assumed accepted).  The device knows the truth from last step's
``valid_sampled_token_count``.  For ``r < num_reqs`` (``prev = prev_positions[r]``, the request's row
in the previous batch, ``-1`` if it is new)::

    participating[r] = 0 <= prev < num_prev  and  prev_num_draft_tokens[prev] > 0
    num_computed_tokens[r] = num_computed_tokens_before[prev] + valid_sampled_token_count[prev]
                             if participating[r] else cpu_num_computed_tokens[r]
    num_accepted_tokens[r] = valid_sampled_token_count[prev] if participating[r] (else unchanged)

which is vLLM 0.19-0.23's ``update_num_computed_tokens_for_batch_change`` (``base="previous"``) plus the hardening
upstream added later: a previous position outside the previous batch (``>= num_prev``, where
``num_prev`` defaults to ``len(valid_sampled_token_count)``, capped by the lengths of
``prev_num_draft_tokens`` and ``num_computed_tokens``) or an empty / absent count tensor makes the
row non-participating instead of an out-of-bounds read.  ``num_computed_tokens_before`` is the
tensor's content before the launch: rows are read at *previous* positions and written at current
ones, in place, so a row's new value must not be visible to another row's read.

``base="cpu"`` corrects this step's CPU counts instead of the previous device counts (the same
participation; ``num_computed_tokens_before`` is not read)::

    num_computed_tokens[r] = cpu_num_computed_tokens[r] - (prev_num_draft_tokens[prev] + 1
                             - valid_sampled_token_count[prev])       if participating[r]

the arithmetic of vLLM 0.19's deferred CPU correction and of vllm-ascend's CPU seq_lens correction.
Both bases agree when each participating row's previous step scheduled exactly ``1 + drafts`` tokens;
:class:`zb_patch.zero_bubble.CountCorrection` says which scheduler needs which.

Fused in the same launch, as vLLM's ``_prepare_inputs`` does next with separate torch ops::

    positions[t] = num_computed_tokens[req_indices[t]] + query_pos[t]      t < num_tokens
    positions[num_tokens:num_positions] = 0                               (padded tokens, as
                                                                           execute_model zeroes them)
    seq_lens[r]  = num_computed_tokens[r] + num_scheduled_tokens[r]        r < num_reqs
    seq_lens[num_reqs:] = 0

Without ``prev_positions`` (or with ``valid_sampled_token_count=None``) it is the non-async branch:
``num_computed_tokens[:num_reqs] = cpu_num_computed_tokens`` and the same positions / seq_lens.
A token whose ``req_indices`` entry is outside ``[0, num_reqs)`` gets position 0, like a padded
token, instead of a read outside ``num_computed_tokens``.

Contract on inputs (both paths; :mod:`zb_patch.kernels._checks`, ``ValueError`` naming the argument):
every tensor 1-D, contiguous, on ``num_computed_tokens``' device; ``num_computed_tokens`` and
``seq_lens`` int32, the others int32 / int64; ``positions``, ``req_indices`` and ``query_pos`` all
or none.  Per call ``0 <= num_reqs <= rows`` (the shortest of ``num_computed_tokens``, ``seq_lens``,
``num_scheduled_tokens``, ``prev_positions``, ``num_accepted_tokens``), ``len(cpu_num_computed_tokens)
>= num_reqs``, ``0 <= num_tokens <= len(req_indices), len(query_pos)``, ``num_tokens <=
num_positions <= len(positions)``, ``num_prev_reqs >= 0``.  ``valid_sampled_token_count`` and
``prev_num_draft_tokens`` may have any length: they bound the gather themselves.

Expected call (the patched ``_prepare_inputs``; names as in vLLM 0.19 / vllm-ascend 0.23).  Bind the
runner's persistent buffers once (views like ``buf[:num_reqs]`` share their base pointer), then per
step pass only what changes — this is the form with ~7 us of host time per step on an H100::

    from zb_patch import kernels
    counts = kernels.token_counts_launcher(            # once, e.g. lazily on the runner
        num_computed_tokens=self.num_computed_tokens, seq_lens=self.seq_lens,
        num_scheduled_tokens=self.num_scheduled_tokens.gpu,
        prev_positions=self.prev_positions.gpu, prev_num_draft_tokens=self.prev_num_draft_tokens.gpu,
        num_accepted_tokens=self.num_accepted_tokens.gpu,
        req_indices=self.req_indices.gpu, query_pos=self.query_pos.gpu, positions=self.positions)
    counts(num_reqs, cpu_values,                       # H2D copy of num_computed_tokens_cpu[:num_reqs]
           self.valid_sampled_token_count_gpu if async_spec_active else None,
           num_tokens=total_num_scheduled_tokens)

replaces upstream's correction (or its ``num_computed_tokens[:n].copy_(cpu)`` else-branch) and the
positions / seq_lens lines that follow it.  The functional :func:`zb_patch.kernels.update_token_counts` takes the same
tensors per call (slower on the host: it keys 11 tensors per call).

Why it is one program (and why that is Ascend-shaped)
------------------------------------------------------
The in-place read-at-prev / write-at-current pattern is a cross-row dependency: with several
programs, one program could overwrite row ``x`` before another reads it as its previous row, and no
launch-wide barrier exists in Triton.  A single program does three passes separated by
``tl.debug_barrier()`` (documented for Ascend A2/A3 by triton-ascend): (1) compute every row's new
count into ``seq_lens`` (unused until pass 2, so it is the scratch), (2) copy it to
``num_computed_tokens`` and finish ``seq_lens``, (3) positions.  Batches are at most a few thousand
rows/tokens, so one vector core (NPU) / one CTA (GPU) with wide tiles is the right size anyway: it
replaces ~8 small ops (eager on vllm-ascend, a compiled graph on vLLM) plus 3-4 more for positions
and seq_lens, each of which is a separate launch on an NPU.  All vectors are int32 except the int64
``positions`` / ``query_pos`` themselves; tile widths are constexprs; every runtime integer is in
``do_not_specialize``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ._checks import INDEX_DTYPES, check_token_count_base, check_token_counts_buffers, check_token_counts_call
from ._launch import FastLauncher, interpret_mode

# Tile widths per device type (rows per request tile, tokens per position tile).
_CUDA_TILES = (1024, 2048)
_NPU_TILES = (1024, 1024)
_INTERP_TILES = (64, 64)


@triton.jit(do_not_specialize=["num_reqs", "num_prev", "seq_lens_len", "num_tokens", "num_positions"])
def _token_counts_kernel(
    num_computed_ptr,  # [>= num_reqs] int32, in/out
    num_accepted_ptr,  # [>= num_reqs] any int, out where participating (dummy if not HAS_ACCEPTED)
    prev_positions_ptr,  # [num_reqs] int64/int32, -1 = new request (dummy if not CORRECT)
    valid_count_ptr,  # [num_prev] any int (dummy if not CORRECT)
    prev_drafts_ptr,  # [>= num_prev] int32 (dummy if not CORRECT)
    cpu_computed_ptr,  # [num_reqs] int32 (device copy of the CPU counts)
    num_scheduled_ptr,  # [num_reqs] int32
    seq_lens_ptr,  # [seq_lens_len] int32, out (also pass-1 scratch)
    req_indices_ptr,  # [num_tokens] int64/int32 (dummy if not HAS_POSITIONS)
    query_pos_ptr,  # [num_tokens] int64 (dummy if not HAS_POSITIONS)
    positions_ptr,  # [>= num_positions] int64, out (dummy if not HAS_POSITIONS)
    num_reqs,
    num_prev,  # rows of the previous batch that may be gathered from
    seq_lens_len,  # seq_lens elements to write (rows >= num_reqs get 0)
    num_tokens,
    num_positions,  # positions elements to write (tokens >= num_tokens get 0)
    CORRECT: tl.constexpr,
    BASE_CPU: tl.constexpr,  # correct the CPU counts (base "cpu") instead of the previous device counts
    HAS_ACCEPTED: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    REQ_TILE: tl.constexpr,
    TOK_TILE: tl.constexpr,
):
    """Grid ``(1,)``: three passes over requests / requests / tokens, barriers in between."""
    rows = tl.arange(0, REQ_TILE)
    # pass 1: new num_computed per row -> seq_lens (scratch); num_accepted for participating rows
    for r0 in range(0, num_reqs, REQ_TILE):
        r = r0 + rows
        in_batch = r < num_reqs
        new = tl.load(cpu_computed_ptr + r, mask=in_batch, other=0)
        if CORRECT:
            prev = tl.load(prev_positions_ptr + r, mask=in_batch, other=-1)
            in_prev = in_batch & (prev >= 0) & (prev < num_prev)
            prev32 = tl.where(in_prev, prev, 0).to(tl.int32)
            drafts = tl.load(prev_drafts_ptr + prev32, mask=in_prev, other=0)
            part = in_prev & (drafts > 0)
            valid = tl.load(valid_count_ptr + prev32, mask=part, other=0)
            if BASE_CPU:
                rejected = drafts + 1 - valid.to(tl.int32)
                new = tl.where(part, new - rejected.to(new.dtype), new)
            else:
                before = tl.load(num_computed_ptr + prev32, mask=part, other=0)
                new = tl.where(part, before + valid.to(tl.int32), new)
            if HAS_ACCEPTED:
                tl.store(num_accepted_ptr + r, valid.to(num_accepted_ptr.dtype.element_ty), mask=part)
        tl.store(seq_lens_ptr + r, new.to(tl.int32), mask=in_batch)
    tl.debug_barrier()
    # pass 2: publish num_computed, finish seq_lens (and zero its tail)
    for r0 in range(0, seq_lens_len, REQ_TILE):
        r = r0 + rows
        in_batch = r < num_reqs
        new = tl.load(seq_lens_ptr + r, mask=in_batch, other=0)
        sched = tl.load(num_scheduled_ptr + r, mask=in_batch, other=0)
        tl.store(num_computed_ptr + r, new, mask=in_batch)
        tl.store(seq_lens_ptr + r, tl.where(in_batch, new + sched.to(tl.int32), 0), mask=r < seq_lens_len)
    if HAS_POSITIONS:
        tl.debug_barrier()
        pos_ty = positions_ptr.dtype.element_ty
        toks = tl.arange(0, TOK_TILE)
        # pass 3: positions from the published counts
        for t0 in range(0, num_positions, TOK_TILE):
            t = t0 + toks
            in_batch = t < num_tokens
            req_in = tl.load(req_indices_ptr + t, mask=in_batch, other=0)
            # a request index outside the batch gives position 0 (tested before the int32 cast)
            known = in_batch & (req_in >= 0) & (req_in < num_reqs)
            req = tl.where(known, req_in, 0).to(tl.int32)
            qpos = tl.load(query_pos_ptr + t, mask=in_batch, other=0)
            computed = tl.load(num_computed_ptr + req, mask=known, other=0)
            pos = tl.where(known, computed.to(pos_ty) + qpos.to(pos_ty), 0)
            tl.store(positions_ptr + t, pos.to(pos_ty), mask=t < num_positions)


def _default_tiles(device_type: str) -> tuple[int, int]:
    if interpret_mode():
        return _INTERP_TILES
    return _CUDA_TILES if device_type == "cuda" else _NPU_TILES


class _TokenCountsLaunchers:
    """Per (device type, flags) FastLaunchers, created on first use (functional API)."""

    def __init__(self) -> None:
        self._cache: dict[tuple, FastLauncher] = {}

    def get(
        self,
        device_type: str,
        correct: bool,
        base_cpu: bool,
        has_accepted: bool,
        has_positions: bool,
        tiles: tuple[int, int] | None,
        direct: bool | None = None,
    ) -> FastLauncher:
        interp = interpret_mode()
        key = (device_type, correct, base_cpu, has_accepted, has_positions, tiles, interp, direct)
        launcher = self._cache.get(key)
        if launcher is None:
            launcher = self._cache[key] = _make_launcher(
                device_type,
                correct,
                base_cpu,
                has_accepted,
                has_positions,
                tiles or _default_tiles(device_type),
                direct,
            )
        return launcher


def _make_launcher(
    device_type: str,
    correct: bool,
    base_cpu: bool,
    has_accepted: bool,
    has_positions: bool,
    tiles: tuple[int, int],
    direct: bool | None,
) -> FastLauncher:
    return FastLauncher(
        _token_counts_kernel,
        dict(
            CORRECT=correct,
            BASE_CPU=correct and base_cpu,  # one variant without a correction
            HAS_ACCEPTED=has_accepted,
            HAS_POSITIONS=has_positions,
            REQ_TILE=tiles[0],
            TOK_TILE=tiles[1],
        ),
        device_type=device_type,
        tensor_slots=tuple(range(11)),
        num_warps=8 if device_type == "cuda" else None,
        direct=direct,
    )


_LAUNCHERS = _TokenCountsLaunchers()


class TokenCountsLauncher:
    """The fused correction bound to a runner's persistent buffers (the hot-path form).

    Bind the full buffers once (views such as ``buf[:num_reqs]`` share their base pointer, so the
    kernel only needs ``num_reqs``); per step pass what changes::

        launcher = TokenCountsLauncher(
            num_computed_tokens=runner.num_computed_tokens, seq_lens=runner.seq_lens,
            num_scheduled_tokens=runner.num_scheduled_tokens.gpu,
            prev_positions=runner.prev_positions.gpu, prev_num_draft_tokens=runner.prev_num_draft_tokens.gpu,
            num_accepted_tokens=runner.num_accepted_tokens.gpu,
            req_indices=runner.req_indices.gpu, query_pos=runner.query_pos.gpu, positions=runner.positions)
        launcher(num_reqs, cpu_values, runner.valid_sampled_token_count_gpu,   # None: no correction
                 num_tokens=total_num_scheduled_tokens)

    The buffers must not be reallocated while the launcher lives (their addresses are kept).
    Semantics: :func:`zb_patch.kernels.update_token_counts`; ``base`` (``"previous"`` / ``"cpu"``): this
    module's docstring.
    """

    def __init__(
        self,
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
        tiles: tuple[int, int] | None = None,
        direct_launch: bool | None = None,
    ) -> None:
        check_token_count_base(base)
        self.base = base
        self.buffers = dict(
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
        limits = self._limits = check_token_counts_buffers(**self.buffers)
        self._rows = limits.rows
        # without a positions buffer the token counts are ignored (0 each step): their per-step bound is 0
        self._tokens, self._positions = (limits.tokens, limits.positions) if positions is not None else (0, 0)
        self._device_id = num_computed_tokens.get_device()
        self.device_type = num_computed_tokens.device.type
        self._device_index = num_computed_tokens.device.index
        self._tiles = tiles or _default_tiles(self.device_type)
        self._direct_flag = direct_launch
        self.can_correct = prev_positions is not None and prev_num_draft_tokens is not None
        self.has_positions = positions is not None
        self._launchers: dict[bool, FastLauncher] = {}
        self._fast: dict[tuple, Any] = {}
        dummy = num_computed_tokens
        self._static = (
            num_computed_tokens,
            num_accepted_tokens if num_accepted_tokens is not None else dummy,
            prev_positions if prev_positions is not None else dummy,
            prev_num_draft_tokens if prev_num_draft_tokens is not None else dummy,
            num_scheduled_tokens,
            seq_lens,
            req_indices if req_indices is not None else dummy,
            query_pos if query_pos is not None else dummy,
            positions if positions is not None else dummy,
        )
        self._static_ptrs = tuple(t.data_ptr() for t in self._static)
        self._seq_lens_len = seq_lens.numel()
        self._bound_prev = min(t.numel() for t in (prev_num_draft_tokens, num_computed_tokens) if t is not None)
        self.direct_launches = 0

    def _launcher(self, correct: bool) -> FastLauncher:
        launcher = self._launchers.get(correct)
        if launcher is None:
            has_acc = correct and self.buffers["num_accepted_tokens"] is not None
            base_cpu = self.base == "cpu"
            launcher = self._launchers[correct] = _make_launcher(
                self.device_type, correct, base_cpu, has_acc, self.has_positions, self._tiles, self._direct_flag
            )
        return launcher

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
        cpu, valid, num_positions_arg = cpu_num_computed_tokens, valid_sampled_token_count, num_positions
        if not self.has_positions:  # ignored without a positions buffer
            num_tokens = num_positions = 0
        elif num_positions is None:
            num_positions = num_tokens
        # the per-step checks as one expression of attribute / integer tests (this runs every step);
        # check_token_counts_call explains a failure
        try:  # cheapest forms: numel() == shape[0] once ndim == 1, get_device() (an int) for the device
            cpu_dtype = cpu.dtype
            ok = (
                type(num_reqs) is int
                and 0 <= num_reqs <= self._rows
                and type(num_tokens) is int
                and type(num_positions) is int
                and 0 <= num_tokens <= num_positions
                and num_tokens <= self._tokens
                and num_positions <= self._positions
                and (num_prev_reqs is None or (type(num_prev_reqs) is int and num_prev_reqs >= 0))
                and cpu.ndim == 1
                and cpu.numel() >= num_reqs
                and cpu_dtype in INDEX_DTYPES
                and cpu.is_contiguous()
                and cpu.get_device() == self._device_id
                and (
                    valid is None
                    or (
                        valid.ndim == 1
                        and valid.dtype in INDEX_DTYPES
                        and valid.is_contiguous()
                        and valid.get_device() == self._device_id
                    )
                )
            )
        except AttributeError:  # not tensors
            ok = False
        if not ok:  # raises, or normalises integer types (numpy ints)
            num_reqs, num_tokens, num_positions = check_token_counts_call(
                self._limits, num_reqs, cpu, valid, num_tokens, num_positions_arg, num_prev_reqs
            )
        correct = valid is not None and self.can_correct
        if correct:
            num_prev = valid.numel()
            if num_prev_reqs is not None and num_prev_reqs < num_prev:
                num_prev = num_prev_reqs
            if self._bound_prev < num_prev:
                num_prev = self._bound_prev
        else:
            num_prev = 0
            valid = self._static[0]
        s = self._static
        fast = self._fast.get((correct, cpu_dtype, valid.dtype))
        if fast is not None:
            cpu_ptr = cpu.data_ptr()
            valid_ptr = valid.data_ptr()
            p = self._static_ptrs
            if not (cpu_ptr | valid_ptr) & 15 and fast(
                1,
                p[0],
                p[1],
                p[2],
                valid_ptr,
                p[3],
                cpu_ptr,
                p[4],
                p[5],
                p[6],
                p[7],
                p[8],
                num_reqs,
                num_prev,
                self._seq_lens_len,
                num_tokens,
                num_positions,
            ):
                self.direct_launches += 1
                return
        launcher = self._launcher(correct)
        compiled = launcher.launch_slow(
            1,
            (
                s[0],
                s[1],
                s[2],
                valid,
                s[3],
                cpu,
                s[4],
                s[5],
                s[6],
                s[7],
                s[8],
                num_reqs,
                num_prev,
                self._seq_lens_len,
                num_tokens,
                num_positions,
            ),
        )
        key = (correct, cpu_dtype, valid.dtype)
        if key not in self._fast and launcher.direct_supported and not (cpu.data_ptr() | valid.data_ptr()) & 15:
            self._fast[key] = launcher.direct_launcher(compiled, self._device_index)


def launch_token_counts(
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
    req_indices: torch.Tensor | None,
    query_pos: torch.Tensor | None,
    positions: torch.Tensor | None,
    num_tokens: int,
    num_positions: int,
    num_prev_reqs: int | None,
    base: str,
    tiles: tuple[int, int] | None = None,
    direct_launch: bool | None = None,
) -> None:
    """:func:`zb_patch.kernels.update_token_counts` without the checks, for callers that made them (it)."""
    correct = prev_positions is not None and valid_sampled_token_count is not None and prev_num_draft_tokens is not None
    has_positions = positions is not None
    num_prev = 0
    if correct:
        num_prev = valid_sampled_token_count.numel() if num_prev_reqs is None else num_prev_reqs
        num_prev = min(
            num_prev, valid_sampled_token_count.numel(), prev_num_draft_tokens.numel(), num_computed_tokens.numel()
        )
    if not has_positions:
        num_tokens = num_positions = 0
    dummy = num_computed_tokens
    has_accepted = correct and num_accepted_tokens is not None
    base_cpu = correct and base == "cpu"
    launcher = _LAUNCHERS.get(
        num_computed_tokens.device.type, correct, base_cpu, has_accepted, has_positions, tiles, direct_launch
    )
    launcher.launch(
        1,
        (
            num_computed_tokens,
            num_accepted_tokens if has_accepted else dummy,
            prev_positions if correct else dummy,
            valid_sampled_token_count if correct else dummy,
            prev_num_draft_tokens if correct else dummy,
            cpu_num_computed_tokens,
            num_scheduled_tokens,
            seq_lens,
            req_indices if has_positions else dummy,
            query_pos if has_positions else dummy,
            positions if has_positions else dummy,
            num_reqs,
            num_prev,
            seq_lens.numel(),
            num_tokens,
            num_positions,
        ),
    )


__all__ = ["TokenCountsLauncher", "launch_token_counts"]
