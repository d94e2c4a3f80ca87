"""The runner side of the harness: a model runner's bookkeeping, in four modes, on a simulated device.

It mirrors what vLLM's ``GPUModelRunner`` (and vllm-ascend's ``NPUModelRunner``) do with a scheduler
output — persistent batch, block table, token ids, counts, positions, seq_lens, slot mapping, input
ids, sampling, drafting — and nothing else (no attention math, no sampling params).  Modes:

``sync``
    The classic async-spec runner (vLLM <= 0.18 ``_update_states``): before preparing step N+1 the
    host blocks on step N's accepted counts and makes its CPU counts exact; positions, seq_lens and
    the slot mapping are computed on the CPU (numpy, vllm-ascend 0.18 style) and copied over.  This
    is the reference every other mode is compared with, step by step.
``zero-bubble``
    vLLM 0.19+ (#32951) through :mod:`zb_patch.zero_bubble`: optimistic CPU counts, device-side
    correction + positions / seq_lens / slot mapping (:mod:`zb_patch.kernels`), deferred CPU
    correction after the forward launch.  Attention reads the device seq_lens.  The device
    correction starts from a private snapshot of this step's CPU counts minus last step's rejected
    drafts (``count_base="cpu"``, right for every scheduler seen) or, as upstream, from last step's
    device counts plus the valid counts (``"previous"``: wrong under vLLM 0.13's scheduler).
``zero-bubble-ascend``
    As ``zero-bubble`` plus vllm-ascend 0.23's exact CPU seq_lens (#10506): the host waits for step
    N's counts after the device prep is enqueued and corrects its optimistic seq_lens; the fake
    attention then reads *those* CPU seq_lens, as Ascend FIA / paged attention does.
``plain``
    vLLM's non-async ``Scheduler`` with a fully synchronous runner (real draft ids go back to the
    scheduler).  Only its final token streams are compared (it schedules differently).

Planted bugs (:data:`PLANTS`) switch single lines of the zero-bubble modes to the mistakes upstream
made; the self-test must report divergences for each.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from zb_patch import zero_bubble as zb

from . import compat, fakemodel
from .simdevice import Event, SimDevice, fresh_h2d

SYNC = "sync"
ZB = "zero-bubble"
ZB_ASCEND = "zero-bubble-ascend"
PLAIN = "plain"
ASYNC_MODES = (SYNC, ZB, ZB_ASCEND)
PAD_SLOT_ID = -1

#: planted bug -> (what it does, upstream it reproduces)
PLANTS: dict[str, tuple[str, str]] = {
    "backup-from-seq-lens": (
        "drafter backup token indexed with the optimistic CPU seq_len instead of num_tokens_no_spec - 1",
        "vLLM #38098 (fixed by #38556)",
    ),
    "no-input-prep-wait": (
        "pinned staging buffers rewritten while the previous step's host-to-device copies are in flight "
        "(in-place CPU update during an in-flight copy)",
        "vLLM #24527 / #25279, #24799 review",
    ),
    "accepted-counts-by-row": (
        "device correction reads last step's accepted counts at the current row, not through "
        "prev_positions (stale counts after condense / reorder)",
        "vLLM #38556 fix 2, vllm-ascend #13863 / #13865",
    ),
    "uncorrected-cpu-seq-lens": (
        "Ascend attention given the optimistic CPU seq_lens (no correct_optimistic_seq_lens_cpu)",
        "vllm-ascend #8461 / #10506 (acceptance drops or crashes)",
    ),
    "backup-staging-reuse": (
        "drafter backup tokens copied from a pinned buffer that the next step rewrites before the copy ran "
        "(vLLM 0.19+ / vllm-ascend 0.23 reuse backup_next_token_ids; safe only while a wait on this "
        "step's accepted counts follows)",
        "found by this harness; same class as vllm-ascend #15719",
    ),
    "live-cpu-values": (
        "device correction reads this step's CPU counts through a non-blocking copy of the live host "
        "buffer that the deferred correction changes in place after the launch (in-place CPU update "
        "during an in-flight copy)",
        "vLLM #24799 review (acceptance 1024/2034 -> 656/2094), #25279",
    ),
    "deferred-without-wait": (
        "deferred CPU correction reads the accepted-count host buffer without waiting for its copy",
        "vllm-ascend #9482 / #9456 (dirty reads of valid counts)",
    ),
}


@dataclass
class ReqState:
    req_id: str
    prompt: list[int]
    output: list[int]
    num_computed: int
    block_ids: list[int]
    prev_num_draft_len: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def get_token_id(self, idx: int) -> int:
        """vLLM ``CachedRequestState.get_token_id``."""
        if 0 <= idx < len(self.prompt):
            return self.prompt[idx]
        if 0 <= idx - len(self.prompt) < len(self.output):
            return self.output[idx - len(self.prompt)]
        return -1


@dataclass
class RowRec:
    """What one request did in one step, as the device saw it (compared across modes)."""

    num_computed: int = -1
    positions: tuple[int, ...] = ()
    seq_len: int = -1
    slot_mapping: tuple[int, ...] = ()
    input_ids: tuple[int, ...] = ()
    sampled: tuple[int, ...] = ()
    drafted: int = 0
    accepted: int = 0
    discarded: bool = False
    next_token: int = -1
    cpu_num_computed: int = -1
    checks: dict[str, tuple[int, int]] = field(default_factory=dict)  # internal consistency (want, got)


COMPARED_FIELDS = (
    "num_computed",
    "positions",
    "seq_len",
    "slot_mapping",
    "input_ids",
    "sampled",
    "drafted",
    "accepted",
    "discarded",
    "next_token",
    "cpu_num_computed",
)


class PersistentBatch:
    """The persistent input batch (vLLM ``InputBatch`` row semantics; block ids in vLLM's real
    ``BlockTable``): removals leave holes, additions fill the smallest hole, ``condense`` moves the
    last rows into the holes, ``swap`` exchanges two rows."""

    def __init__(self, shape: compat.EngineShape, max_blocks: int) -> None:
        r, m = shape.max_num_seqs, shape.max_model_len
        self.req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.removed: list[int] = []
        self.prev_req_id_to_index: dict[str, int] | None = None
        self.num_computed_cpu = np.zeros(r, dtype=np.int32)
        self.token_ids_cpu = np.full((r, m + 8), -1, dtype=np.int32)
        self.num_tokens_no_spec = np.zeros(r, dtype=np.int32)
        self.num_prompt = np.zeros(r, dtype=np.int32)
        self.block_table = compat.make_block_table(
            block_size=shape.block_size,
            max_num_reqs=r,
            max_num_blocks_per_req=max_blocks,
            max_num_batched_tokens=shape.max_num_batched_tokens,
        )

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def bt_np(self) -> np.ndarray:
        return self.block_table.block_table.np

    def add(self, st: ReqState) -> int:
        if self.removed:
            idx = self.removed.pop(0)
            self.req_ids[idx] = st.req_id
        else:
            idx = len(self.req_ids)
            self.req_ids.append(st.req_id)
        self.req_id_to_index[st.req_id] = idx
        n_prompt = len(st.prompt)
        toks = st.prompt + st.output
        self.token_ids_cpu[idx, : len(toks)] = toks
        self.num_prompt[idx] = n_prompt
        self.num_tokens_no_spec[idx] = len(toks)
        self.num_computed_cpu[idx] = st.num_computed
        self.block_table.add_row(st.block_ids, idx)
        return idx

    def remove(self, req_id: str) -> int | None:
        idx = self.req_id_to_index.pop(req_id, None)
        if idx is None:
            return None
        self.req_ids[idx] = None
        self.removed.append(idx)
        self.removed.sort()
        if self.prev_req_id_to_index is not None:
            self.prev_req_id_to_index.pop(req_id, None)
        return idx

    def _move(self, src: int, dst: int) -> None:
        rid = self.req_ids[src]
        assert rid is not None
        self.req_ids[dst], self.req_ids[src] = rid, None
        self.req_id_to_index[rid] = dst
        n = int(self.num_tokens_no_spec[src])
        self.token_ids_cpu[dst] = self.token_ids_cpu[src]
        self.num_tokens_no_spec[dst] = n
        self.num_prompt[dst] = self.num_prompt[src]
        self.num_computed_cpu[dst] = self.num_computed_cpu[src]
        self.block_table.move_row(src, dst)

    def condense(self) -> int:
        """Returns the number of rows moved."""
        if not self.removed:
            return 0
        if self.num_reqs == 0:
            self.req_ids.clear()
            self.removed.clear()
            return 0
        moved = 0
        last = len(self.req_ids) - 1
        while self.removed:
            while last >= 0 and self.req_ids[last] is None:
                last -= 1
            empty = self.removed[0]
            if empty >= last:
                break
            self.removed.pop(0)
            self._move(last, empty)
            moved += 1
            last -= 1
        del self.req_ids[self.num_reqs :]
        self.removed.clear()
        return moved

    def swap(self, i: int, j: int) -> None:
        if i == j:
            return
        a, b = self.req_ids[i], self.req_ids[j]
        assert a is not None and b is not None
        self.req_ids[i], self.req_ids[j] = b, a
        self.req_id_to_index[a], self.req_id_to_index[b] = j, i
        for arr in (self.token_ids_cpu, self.num_tokens_no_spec, self.num_prompt, self.num_computed_cpu):
            arr[[i, j]] = arr[[j, i]]
        self.block_table.swap_row(i, j)

    def set_spec(self, idx: int, st: ReqState, spec: dict[str, list[int]]) -> None:
        """``InputBatch.update_req_spec_token_ids``: placeholders (async) or real drafts (sync sched)."""
        toks = spec.get(st.req_id, ())
        st.prev_num_draft_len = len(toks)
        if toks:
            start = int(self.num_tokens_no_spec[idx])
            self.token_ids_cpu[idx, start : start + len(toks)] = toks


@dataclass
class StepCtx:
    """Per-step values shared by the device ops of one step (filled in stream order)."""

    step: int
    n: int
    total: int
    req_ids: list[str]
    spec_d: list[int]
    attn_seq_lens: list[int] | None
    discard: np.ndarray
    target: np.ndarray | None = None
    hidden: np.ndarray | None = None
    sampled: np.ndarray | None = None
    accepted: np.ndarray | None = None


@dataclass
class PendingOutput:
    """The async model-runner output of one step (what ``AsyncGPUModelRunnerOutput`` holds)."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    discarded: set[int]
    host_sampled: torch.Tensor
    event: Event

    def get_output(self) -> Any:
        self.event.synchronize("output")
        rows = self.host_sampled.numpy()
        sampled = [[] if i in self.discarded else [int(t) for t in rows[i] if t >= 0] for i in range(len(self.req_ids))]
        return compat.model_runner_output(self.req_ids, self.req_id_to_index, sampled)


class Runner:
    def __init__(
        self,
        mode: str,
        shape: compat.EngineShape,
        *,
        seed: int,
        plants: frozenset[str] = frozenset(),
        count_base: str = "cpu",
    ) -> None:
        if count_base not in zb.BASES:
            raise ValueError(f"device correction base must be 'cpu' or 'previous', not {count_base!r}")
        self.mode, self.shape, self.plants = mode, shape, plants
        self.count_base = count_base
        self.is_zb = mode in (ZB, ZB_ASCEND)
        self.async_sched = mode != PLAIN
        self.k = shape.num_spec_tokens
        self.seed = seed
        self.dev = SimDevice()
        self.pattern = fakemodel.AcceptancePattern(seed, self.k)
        R, T = shape.max_num_seqs, shape.max_num_batched_tokens
        self.max_blocks = -(-shape.max_model_len // shape.block_size) + 1
        self.batch = PersistentBatch(shape, self.max_blocks)
        self.requests: dict[str, ReqState] = {}
        # -- device memory -----------------------------------------------------------------------
        rng = np.random.default_rng(seed ^ 0xC0FFEE)
        self.kv = rng.integers(0, 1 << 62, size=shape.num_blocks * shape.block_size, dtype=np.int64)
        self.bt_dev = torch.zeros((R, self.max_blocks), dtype=torch.int32)
        self.num_computed_dev = torch.zeros(R, dtype=torch.int32)
        self.positions_dev = torch.zeros(T, dtype=torch.int64)
        self.seq_lens_dev = torch.zeros(R, dtype=torch.int32)
        self.slot_dev = torch.zeros(T, dtype=torch.int64)
        self.input_ids_dev = torch.zeros(T, dtype=torch.int32)
        self.qsl_dev = torch.zeros(R + 1, dtype=torch.int32)
        self.req_indices_dev = torch.zeros(T, dtype=torch.int64)
        self.query_pos_dev = torch.zeros(T, dtype=torch.int64)
        self.num_sched_dev = torch.zeros(R, dtype=torch.int32)
        self.prev_positions_dev = torch.zeros(R, dtype=torch.int64)
        self.prev_num_draft_dev = torch.zeros(R, dtype=torch.int32)
        self.cpu_values_dev = torch.zeros(R, dtype=torch.int32)
        self.backup_dev = torch.zeros(R, dtype=torch.int64)
        self.discard_dev = torch.zeros(R, dtype=torch.bool)
        # -- zero-bubble's device launches, bound to these buffers as the product runner binds its own -------------
        self.count_correction = zb.CountCorrection(
            num_computed_tokens=self.num_computed_dev,
            seq_lens=self.seq_lens_dev,
            num_scheduled_tokens=self.num_sched_dev,
            prev_positions=self.prev_positions_dev,
            prev_num_draft_tokens=self.prev_num_draft_dev,
            req_indices=self.req_indices_dev,
            query_pos=self.query_pos_dev,
            positions=self.positions_dev,
            base=count_base,
        )
        self.slot_mapper = zb.slot_mapper(
            self.bt_dev, self.slot_dev, block_size=shape.block_size, max_num_tokens=shape.max_num_batched_tokens
        )
        # -- pinned host staging buffers (CpuGpuBuffer.cpu / .np) ----------------------------------
        self.bt_cpu = torch.from_numpy(self.batch.bt_np)
        self.input_ids_np = np.zeros(T, dtype=np.int32)
        self.positions_np = np.zeros(T, dtype=np.int64)
        self.seq_lens_np = np.zeros(R, dtype=np.int32)
        self.slot_np = np.zeros(T, dtype=np.int64)
        self.qsl_np = np.zeros(R + 1, dtype=np.int32)
        self.req_indices_np = np.zeros(T, dtype=np.int64)
        self.query_pos_np = np.zeros(T, dtype=np.int64)
        self.num_sched_np = np.zeros(R, dtype=np.int32)
        self.prev_positions_np = np.zeros(R, dtype=np.int64)
        self.prev_num_draft_np = np.zeros(R, dtype=np.int32)
        self.optimistic_seq_lens_np = np.zeros(R, dtype=np.int32)
        self.backup_np = np.zeros(R, dtype=np.int64)
        self.discard_np = np.zeros(R, dtype=np.bool_)
        self.valid_cpu = torch.zeros(R, dtype=torch.int64)  # D2H destination of the accepted counts
        # -- state carried from the previous step --------------------------------------------------
        self.prev_next_dev: torch.Tensor | None = None  # input_batch.prev_sampled_token_ids
        self.prev_drafts_dev: torch.Tensor | None = None  # _draft_token_ids
        self.prev_valid_dev: torch.Tensor | None = None  # valid_sampled_token_count_gpu (stash)
        self.valid_event: Event | None = None
        self.prepare_event: Event | None = None
        self.prev_num_reqs = 0
        self.plain_drafts: tuple[list[str], list[list[int]]] | None = None
        self.ctx: StepCtx | None = None
        # -- results -------------------------------------------------------------------------------
        self.records: dict[int, dict[str, RowRec]] = {}
        self.steps_with_spec = 0
        self.steps_executed = 0
        self.coverage: dict[str, int] = dict.fromkeys(
            (
                "partial_prefill_rows",
                "prefix_cache_hits",
                "resumed",
                "condense_moves",
                "row_swaps",
                "rows_reused_from_previous_step",
            ),
            0,
        )

    # =============================================================================================
    # execute_model
    # =============================================================================================
    def execute_model(self, so: Any, step: int) -> bool:
        """Returns whether a forward was launched (False: nothing scheduled)."""
        if self.prepare_event is not None and "no-input-prep-wait" not in self.plants:
            # vLLM's synchronize_input_prep(): the previous step's H2D copies must have read the
            # pinned staging buffers before this step rewrites them.
            self.prepare_event.synchronize("input_prep")
        deferred = self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return False  # vLLM returns early (and skips the deferred correction) too
        self.steps_executed += 1
        if so.scheduled_spec_decode_tokens:
            self.steps_with_spec += 1
        ctx = self._prepare_inputs(so, step)
        self.prepare_event = self.dev.record()
        self._launch_forward(ctx)
        if deferred is not None:
            deferred()
        recs = self.records.setdefault(step, {})
        for i, rid in enumerate(ctx.req_ids):
            recs.setdefault(rid, RowRec()).cpu_num_computed = int(self.batch.num_computed_cpu[i])
        self.ctx = ctx
        return True

    def _update_states(self, so: Any) -> Callable[[], None] | None:
        b = self.batch
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            b.remove(rid)
        cv = compat.cached_view(so)
        scheduled = set(so.num_scheduled_tokens)
        for rid in set(b.req_id_to_index) - (scheduled - cv.resumed):
            b.remove(rid)
        to_add: list[ReqState] = []
        for nr in so.scheduled_new_reqs:
            st = ReqState(
                nr.req_id, list(nr.prompt_token_ids), [], int(nr.num_computed_tokens), compat.first_group(nr.block_ids)
            )
            if st.num_computed > 0:
                self.coverage["prefix_cache_hits"] += 1
            self.requests[nr.req_id] = st
            to_add.append(st)
        spec = so.scheduled_spec_decode_tokens

        valid_list: list[int] | None = None
        if self.mode == SYNC and self.valid_event is not None:
            # vLLM <= 0.18: wait until step N's valid counts reached the host, before anything else.
            self.valid_event.synchronize("accepted:before-prep")
            valid_list = self.valid_cpu.tolist()

        queued: list[tuple[str, int, ReqState]] = []
        queued_prev: list[int] = []
        for i, rid in enumerate(cv.req_ids):
            st = self.requests[rid]
            nc = int(cv.num_computed_tokens[i])
            new_blocks = cv.new_block_ids[i]
            resumed = rid in cv.resumed
            n_out = int(cv.num_output_tokens[i])
            idx = b.req_id_to_index.get(rid)
            if st.prev_num_draft_len and self.async_sched:
                d = st.prev_num_draft_len
                if idx is None:
                    st.prev_num_draft_len = 0
                elif self.mode == SYNC:
                    assert b.prev_req_id_to_index is not None and valid_list is not None
                    prev = b.prev_req_id_to_index[rid]
                    acc = valid_list[prev] - 1
                    nc -= zb_ref_rejected(d, acc)
                    st.output.extend([-1] * acc)
                else:
                    st.output.extend([-1] * d)
                    queued.append((rid, d, st))
                    prev_map = b.prev_req_id_to_index or {}
                    queued_prev.append(prev_map.get(rid, -1))
            st.num_computed = nc
            if n_out < len(st.output):
                del st.output[n_out:]
                if idx is not None:
                    b.num_tokens_no_spec[idx] = b.num_prompt[idx] + n_out
            if not resumed:
                if new_blocks is not None:
                    st.block_ids.extend(compat.first_group(new_blocks))
            else:
                st.block_ids = compat.first_group(new_blocks)
                self.coverage["resumed"] += 1
            if idx is None:
                if self.async_sched and n_out > 0:
                    st.output = list(cv.all_token_ids[rid][-n_out:])
                to_add.append(st)
                continue
            b.num_computed_cpu[idx] = nc
            if new_blocks is not None:
                b.block_table.append_row(compat.first_group(new_blocks), idx)
            b.set_spec(idx, st, spec)
        if self.is_zb:
            # prev_num_draft_tokens.np.fill(0) + [prev_idx] = d  (zero-bubble: no wait here)
            zb.optimistic_advance(
                np.array(queued_prev, dtype=np.int64),
                np.array([q[1] for q in queued], dtype=np.int64),
                self.prev_num_draft_np,
            )
        for st in to_add:
            idx = b.add(st)
            b.set_spec(idx, st, spec)
        self.coverage["condense_moves"] += b.condense()
        self.coverage["row_swaps"] += self._reorder(so)
        if not queued:
            return None
        return self._make_deferred(queued)

    def _make_deferred(self, queued: list[tuple[str, int, ReqState]]) -> Callable[[], None]:
        b = self.batch

        def correct_spec_decode_token_counts() -> None:
            if self.valid_event is None:
                return
            if "deferred-without-wait" not in self.plants:
                self.valid_event.synchronize("accepted:deferred")
            valid = self.valid_cpu.numpy()
            prev_map = b.prev_req_id_to_index
            if not prev_map:
                return
            prev_idx = np.array([prev_map.get(rid, -1) for rid, _, _ in queued], dtype=np.int64)
            corr = zb.deferred_cpu_corrections(
                prev_idx, np.array([d for _, d, _ in queued]), valid, num_prev=self.prev_num_reqs
            )
            cur_idx = np.array(
                [b.req_id_to_index.get(rid, -1) if p >= 0 else -1 for (rid, _, _), p in zip(queued, prev_idx)],
                dtype=np.int64,
            )
            for (_, _, st), p, c in zip(queued, prev_idx, corr):
                if p >= 0:
                    st.num_computed -= int(c)
            zb.apply_cpu_corrections(b.num_computed_cpu, cur_idx, corr)

        return correct_spec_decode_token_counts

    def _reorder(self, so: Any) -> int:
        """Attention-backend reordering (decodes first, as MLA / Ascend backends ask) or a random swap,
        decided by (seed, batch composition) so every async mode reorders identically."""
        b = self.batch
        n = b.num_reqs
        swaps = 0
        if n < 2:
            return 0
        key = zlib.crc32("|".join(b.req_ids[:n]).encode())
        rng = random.Random((self.seed * 1_000_003) ^ key)
        u = rng.random()
        if u < 0.3:
            thr = 1 + self.k
            is_dec = [so.num_scheduled_tokens[b.req_ids[i]] <= thr for i in range(n)]
            order = [i for i in range(n) if is_dec[i]] + [i for i in range(n) if not is_dec[i]]
            cur = list(range(n))  # cur[pos] = original row now at pos
            for pos, want in enumerate(order):
                at = cur.index(want)
                if at != pos:
                    b.swap(pos, at)
                    swaps += 1
                    cur[pos], cur[at] = cur[at], cur[pos]
        elif u < 0.5:
            i, j = rng.randrange(n), rng.randrange(n)
            if i != j:
                b.swap(i, j)
                swaps += 1
        return swaps

    # =============================================================================================
    # _prepare_inputs
    # =============================================================================================
    def _prepare_inputs(self, so: Any, step: int) -> StepCtx:
        b, dev, shape = self.batch, self.dev, self.shape
        n = b.num_reqs
        req_ids = [rid for rid in b.req_ids[:n]]
        assert None not in req_ids
        nst = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
        total = int(nst.sum())
        assert total == so.total_num_scheduled_tokens
        spec = so.scheduled_spec_decode_tokens
        spec_d = [len(spec.get(r, ())) for r in req_ids]

        dev.h2d(self.bt_dev, self.bt_cpu, n)  # commit_block_table
        req_indices = np.repeat(np.arange(n), nst)
        cu = np.cumsum(nst)
        starts = cu - nst
        self.query_pos_np[:total] = np.arange(total) - np.repeat(starts, nst)
        positions_cpu = b.num_computed_cpu[req_indices].astype(np.int64) + self.query_pos_np[:total]
        self.input_ids_np[:total] = b.token_ids_cpu[req_indices, positions_cpu]
        self.qsl_np[0] = 0
        self.qsl_np[1 : n + 1] = cu
        self.qsl_np[n + 1 :] = total
        dev.h2d(self.qsl_dev, self.qsl_np)
        num_tokens = np.array([self.requests[r].num_tokens for r in req_ids], dtype=np.int32)
        prev_map = b.prev_req_id_to_index if self.async_sched else None
        if self.is_zb:
            prev_positions = zb.compute_prev_positions(req_ids, prev_map, n, self.prev_positions_np)
        else:  # reference: straight from the map (vLLM 0.18 _prepare_input_ids), independent of zero_bubble
            prev_positions = self.prev_positions_np[:n]
            prev_positions[:] = [(prev_map or {}).get(r, -1) for r in req_ids]
        self.coverage["rows_reused_from_previous_step"] += int((prev_positions >= 0).sum())

        attn_seq_lens: list[int] | None = None
        if self.mode in (SYNC, PLAIN):
            # classic: exact CPU counts -> CPU positions / seq_lens / slot mapping, then H2D
            self.positions_np[:total] = positions_cpu
            self.seq_lens_np[:n] = b.num_computed_cpu[:n] + nst
            self.seq_lens_np[n:] = 0
            bt = b.bt_np
            bs = shape.block_size
            self.slot_np[:total] = bt[req_indices, positions_cpu // bs].astype(np.int64) * bs + positions_cpu % bs
            self.slot_np[total:] = PAD_SLOT_ID
            np.less(self.seq_lens_np[:n], num_tokens, out=self.discard_np[:n])
            dev.h2d(self.positions_dev, self.positions_np, total)
            dev.h2d(self.seq_lens_dev, self.seq_lens_np)
            dev.h2d(self.slot_dev, self.slot_np)
            dev.h2d(self.num_computed_dev, b.num_computed_cpu, n)
        else:
            zb.optimistic_seq_lens(b.num_computed_cpu, nst, n, self.optimistic_seq_lens_np)
            zb.discard_request_mask(self.optimistic_seq_lens_np, num_tokens, n, self.discard_np)
            self.req_indices_np[:total] = req_indices
            self.num_sched_np[:n] = nst
            dev.h2d(self.req_indices_dev, self.req_indices_np, total)
            dev.h2d(self.query_pos_dev, self.query_pos_np, total)
            dev.h2d(self.num_sched_dev, self.num_sched_np, n)
            correcting = self.prev_valid_dev is not None and bool(prev_map)
            if correcting:
                dev.h2d(self.prev_positions_dev, self.prev_positions_np, n)
                dev.h2d(self.prev_num_draft_dev, self.prev_num_draft_np)
            if self.count_base == "cpu" and "live-cpu-values" not in self.plants:
                # the deferred correction changes the live host counts in place after the launch:
                # the device must read a private snapshot when it corrects from them
                dev.h2d(self.cpu_values_dev, b.num_computed_cpu[:n].copy(), n)
            else:
                # a non-blocking copy straight from the live host counts (as vLLM 0.19+ does; benign
                # there because participating rows take previous + valid instead)
                dev.h2d(self.cpu_values_dev, b.num_computed_cpu, n)
            valid_dev = self.prev_valid_dev
            num_prev = self.prev_num_reqs
            by_row = "accepted-counts-by-row" in self.plants

            def correct() -> None:
                if by_row and correcting:
                    prev_pos = self.prev_positions_dev[:n]
                    prev_pos.copy_(torch.where(prev_pos >= 0, torch.arange(n, dtype=prev_pos.dtype), prev_pos))
                self.count_correction(
                    n,
                    self.cpu_values_dev[:n],
                    valid_dev if correcting else None,
                    num_tokens=total,
                    num_prev_reqs=num_prev if correcting else None,
                )
                self.slot_mapper(n, self.qsl_dev[: n + 1], self.positions_dev[:total])

            dev.launch(correct)
        dev.h2d(self.discard_dev, self.discard_np, n)
        self._prepare_input_ids(so, n, total, cu, req_ids, spec_d)

        if self.mode == ZB_ASCEND:
            attn_seq_lens_np = self.optimistic_seq_lens_np
            if (
                self.prev_valid_dev is not None
                and prev_map
                and self.valid_event is not None
                and "uncorrected-cpu-seq-lens" not in self.plants
            ):
                # vllm-ascend 0.23 _correct_optimistic_seq_lens_cpu: wait, then fix on the CPU
                self.valid_event.synchronize("accepted:cpu-seq-lens")
                zb.correct_seq_lens_cpu(
                    self.optimistic_seq_lens_np,
                    self.prev_positions_np,
                    self.prev_num_draft_np,
                    self.valid_cpu.numpy(),
                    n,
                    num_prev=self.prev_num_reqs,
                )
            attn_seq_lens = [int(x) for x in attn_seq_lens_np[:n]]
        self.coverage["partial_prefill_rows"] += int(self.discard_np[:n].sum())
        return StepCtx(
            step=step,
            n=n,
            total=total,
            req_ids=req_ids,
            spec_d=spec_d,
            attn_seq_lens=attn_seq_lens,
            discard=self.discard_np[:n].copy(),
        )

    def _prepare_input_ids(
        self, so: Any, n: int, total: int, cu: np.ndarray, req_ids: list[str], spec_d: list[int]
    ) -> None:
        """vLLM ``_prepare_input_ids``: CPU ids, then scatter last step's sampled / draft ids on device."""
        dev = self.dev
        dev.h2d(self.input_ids_dev, self.input_ids_np, total)
        if self.prev_next_dev is None or not self.async_sched:
            return
        prev_positions = self.prev_positions_np[:n]
        sample_idx: list[int] = []
        prev_idx: list[int] = []
        spec_idx: list[int] = []
        prev_draft_idx: list[int] = []
        kk = max(self.k, 1)
        for cur in range(n):
            p = int(prev_positions[cur])
            if p < 0:
                continue
            d = spec_d[cur]
            flat = int(cu[cur]) - 1
            sample_idx.append(flat - d)
            prev_idx.append(p)
            spec_idx.extend(range(flat - d + 1, flat + 1))
            prev_draft_idx.extend(range(p * kk, p * kk + d))
        if not sample_idx:
            return
        s_idx = fresh_h2d(dev, sample_idx, torch.int64)
        p_idx = fresh_h2d(dev, prev_idx, torch.int64)
        prev_next = self.prev_next_dev
        prev_drafts = self.prev_drafts_dev
        d_idx = fresh_h2d(dev, spec_idx, torch.int64) if spec_idx else None
        pd_idx = fresh_h2d(dev, prev_draft_idx, torch.int64) if spec_idx else None

        def scatter() -> None:
            self.input_ids_dev.scatter_(0, s_idx, prev_next[p_idx].to(torch.int32))
            if d_idx is not None and prev_drafts is not None:
                self.input_ids_dev.scatter_(0, d_idx, prev_drafts.flatten()[pd_idx].to(torch.int32))

        dev.launch(scatter)

    # =============================================================================================
    # forward, sampling, drafting
    # =============================================================================================
    def _launch_forward(self, ctx: StepCtx) -> None:
        shape = self.shape
        recs = self.records.setdefault(ctx.step, {})

        def forward() -> None:
            n, total = ctx.n, ctx.total
            ids = self.input_ids_dev[:total].numpy()
            pos = self.positions_dev[:total].numpy()
            slots = self.slot_dev[:total].numpy()
            qsl = self.qsl_dev[: n + 1].numpy()
            dev_sl = self.seq_lens_dev[:n].tolist()
            sl = ctx.attn_seq_lens if ctx.attn_seq_lens is not None else dev_sl
            ctx.target, ctx.hidden = fakemodel.forward(
                self.kv, ids, pos, slots, qsl, sl, self.bt_dev.numpy(), n, shape.block_size, shape.vocab_size
            )
            nc = self.num_computed_dev[:n].tolist()
            for r, rid in enumerate(ctx.req_ids):
                s, e = int(qsl[r]), int(qsl[r + 1])
                rec = recs.setdefault(rid, RowRec())
                rec.num_computed = nc[r]
                rec.positions = tuple(int(x) for x in pos[s:e])
                rec.seq_len = int(sl[r])
                rec.slot_mapping = tuple(int(x) for x in slots[s:e])
                rec.input_ids = tuple(int(x) for x in ids[s:e])
                if ctx.attn_seq_lens is not None and ctx.attn_seq_lens[r] != dev_sl[r]:
                    rec.checks["seq_lens_cpu==device"] = (dev_sl[r], ctx.attn_seq_lens[r])

        self.dev.launch(forward)

    def sample_tokens(self, so: Any) -> PendingOutput | None:
        ctx = self.ctx
        if ctx is None:
            return None
        self.ctx = None
        dev, b, k = self.dev, self.batch, self.k
        n = ctx.n
        recs = self.records.setdefault(ctx.step, {})

        def rejection_sampler() -> None:
            ctx.sampled, ctx.accepted = fakemodel.rejection_sample(
                ctx.target, self.input_ids_dev.numpy(), self.qsl_dev.numpy(), ctx.spec_d, n, k
            )

        dev.launch(rejection_sampler)

        # -- drafter (padded EAGLE): next tokens + valid counts, copy of the counts, proposals ------
        if "backup-from-seq-lens" in self.plants and self.is_zb:
            idx = self.optimistic_seq_lens_np[:n].astype(np.int64)  # the #38098 bug
            rows = np.arange(n)
            ok = idx < b.token_ids_cpu.shape[1]
            vals = np.where(ok, b.token_ids_cpu[rows, np.minimum(idx, b.token_ids_cpu.shape[1] - 1)], -1)
            # beyond the committed tokens get_token_id() returns -1
            vals = np.where(idx < b.num_tokens_no_spec[:n], vals, -1)
            self.backup_np[:n] = vals
        elif self.is_zb:
            zb.backup_next_token_ids(b.token_ids_cpu, b.num_tokens_no_spec, n, self.backup_np)
        else:  # reference: vLLM's own loop over the request states (independent of zero_bubble)
            for i, rid in enumerate(ctx.req_ids):
                self.backup_np[i] = self.requests[rid].get_token_id(int(b.num_tokens_no_spec[i]) - 1)
        if self.is_zb and "backup-staging-reuse" not in self.plants:
            # vLLM copies the reused pinned backup_next_token_ids buffer; under zero-bubble nothing
            # orders the next step's host write after this copy when this step has no participating
            # rows (no deferred wait follows) -- copy from a private host tensor instead.
            dev.h2d(self.backup_dev, self.backup_np[:n].copy(), n)
        else:
            dev.h2d(self.backup_dev, self.backup_np, n)
        next_dev = torch.zeros(n, dtype=torch.int64)
        valid_dev = torch.zeros(n, dtype=torch.int64)
        drafts_dev = torch.zeros((n, max(k, 1)), dtype=torch.int64)
        row_keys = [fakemodel.req_key(r) for r in ctx.req_ids]
        vocab = self.shape.vocab_size

        def prepare_next() -> None:
            nxt, valid = fakemodel.next_tokens(
                ctx.sampled, self.discard_dev[:n].numpy(), self.backup_dev[:n].numpy(), vocab, n
            )
            next_dev.copy_(torch.from_numpy(nxt))
            valid_dev.copy_(torch.from_numpy(valid))
            for r, rid in enumerate(ctx.req_ids):
                rec = recs.setdefault(rid, RowRec())
                disc = bool(ctx.discard[r])
                rec.discarded = disc
                rec.next_token = int(nxt[r])
                rec.drafted = ctx.spec_d[r]
                rec.accepted = int(ctx.accepted[r])
                rec.sampled = () if disc else tuple(int(t) for t in ctx.sampled[r] if t >= 0)

        dev.launch(prepare_next)
        if self.async_sched:
            dev.d2h(self.valid_cpu, valid_dev, n)
            self.valid_event = dev.record()
            self.prev_valid_dev = valid_dev  # ZB stash (valid_sampled_token_count_gpu)
            self.prev_num_reqs = n
        qsl_snapshot = self.qsl_dev  # read in stream order

        def drafter() -> None:
            sl = ctx.attn_seq_lens if ctx.attn_seq_lens is not None else self.seq_lens_dev[:n].tolist()
            drafts_dev.copy_(
                torch.from_numpy(
                    fakemodel.propose(
                        ctx.hidden,
                        next_dev.numpy(),
                        valid_dev.numpy(),
                        qsl_snapshot.numpy(),
                        ctx.spec_d,
                        sl,
                        row_keys,
                        n,
                        k,
                        vocab,
                        self.pattern,
                    )
                )
            )

        dev.launch(drafter)
        self.prev_next_dev = next_dev
        self.prev_drafts_dev = drafts_dev

        # -- bookkeeping (host) --------------------------------------------------------------------
        discarded = {int(i) for i in np.nonzero(ctx.discard)[0]}
        req_ids_copy = list(ctx.req_ids)
        req_id_to_index_copy = dict(b.req_id_to_index)
        host_sampled = torch.zeros((n, k + 1), dtype=torch.int64)

        def copy_sampled() -> None:
            host_sampled.copy_(torch.from_numpy(ctx.sampled))

        dev.launch(copy_sampled)
        out_event = dev.record()
        if self.async_sched:
            b.prev_req_id_to_index = {rid: i for i, rid in enumerate(ctx.req_ids) if i not in discarded}
            for i, rid in enumerate(ctx.req_ids):
                if i in discarded:
                    continue
                start = int(b.num_tokens_no_spec[i])
                b.token_ids_cpu[i, start] = -1
                b.num_tokens_no_spec[i] = start + 1
                self.requests[rid].output.append(-1)
            return PendingOutput(req_ids_copy, req_id_to_index_copy, discarded, host_sampled, out_event)

        # plain (synchronous scheduler): wait now, append the real tokens, hand real drafts back
        out_event.synchronize("output")
        rows = host_sampled.numpy()
        sampled_lists: list[list[int]] = []
        for i, rid in enumerate(ctx.req_ids):
            toks = [] if i in discarded else [int(t) for t in rows[i] if t >= 0]
            sampled_lists.append(toks)
            if toks:
                start = int(b.num_tokens_no_spec[i])
                b.token_ids_cpu[i, start : start + len(toks)] = toks
                b.num_tokens_no_spec[i] = start + len(toks)
                self.requests[rid].output.extend(toks)
        ev = dev.record()
        ev.synchronize("drafts")
        drafts = drafts_dev.numpy()
        self.plain_drafts = (
            req_ids_copy,
            [[] if i in discarded else [int(t) for t in drafts[i, :k]] for i in range(n)],
        )
        return PendingOutput(req_ids_copy, req_id_to_index_copy, discarded, host_sampled, out_event)

    def take_draft_token_ids(self) -> Any:
        if self.plain_drafts is None:
            return None
        ids, drafts = self.plain_drafts
        self.plain_drafts = None
        return compat.draft_token_ids(ids, drafts)


def zb_ref_rejected(num_drafts: int, num_accepted: int) -> int:
    """Classic (reference) arithmetic, deliberately independent of zb_patch.zero_bubble."""
    return num_drafts - num_accepted
