"""zb_patch.zero_bubble: the pure bookkeeping functions (numpy / torch, no vLLM).

Needs numpy and torch (the ``unit`` tox env has neither: the module is skipped there and runs in the
envs that have them — kernels, va018, va023).  The differential tests against the installed vLLM /
vllm-ascend functions live in tests/parity/test_oracles.py.
"""

from __future__ import annotations

import pytest

_WHY = "zero_bubble needs numpy + torch; the unit env has neither (this module runs in the kernels and va envs)"
np = pytest.importorskip("numpy", reason=_WHY)
torch = pytest.importorskip("torch", reason=_WHY)
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from zb_patch import zero_bubble as zb  # noqa: E402


# ------------------------------------------------------------------------------------------------
# previous-position map
# ------------------------------------------------------------------------------------------------
def test_prev_positions_without_previous_batch_are_all_new():
    out = np.full(8, 7, dtype=np.int64)
    assert zb.compute_prev_positions(["a", "b"], None, 2, out).tolist() == [-1, -1]
    assert zb.compute_prev_positions(["a", "b"], {}, 2, out).tolist() == [-1, -1]
    assert out[2:].tolist() == [7] * 6  # nothing past num_reqs is touched


def test_prev_positions_follow_reorder_condense_and_new_requests():
    # previous batch: a b c d (rows 0..3); b finished, d moved into its hole, e is new, c and a swapped
    prev = {"a": 0, "b": 1, "c": 2, "d": 3}
    out = np.zeros(8, dtype=np.int64)
    got = zb.compute_prev_positions(["c", "d", "a", "e"], prev, 4, out)
    assert got.tolist() == [2, 3, 0, -1]
    # holes (None) count as new
    assert zb.compute_prev_positions(["c", None, "a"], prev, 3, out).tolist() == [2, -1, 0]


# ------------------------------------------------------------------------------------------------
# optimistic advance and the deferred CPU correction
# ------------------------------------------------------------------------------------------------
def test_optimistic_advance_resets_and_records_at_previous_rows():
    buf = np.full(6, 9, dtype=np.int32)
    zb.optimistic_advance(np.array([3, -1, 0]), np.array([2, 4, 1]), buf)
    assert buf.tolist() == [1, 0, 0, 2, 0, 0]
    buf2 = np.full(3, 5, dtype=np.int32)
    zb.optimistic_advance(np.array([1]), np.array([3]), buf2, reset=False)
    assert buf2.tolist() == [5, 3, 5]
    zb.optimistic_advance(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), buf2)
    assert buf2.tolist() == [0, 0, 0]


def test_deferred_corrections_subtract_rejected_drafts():
    valid = np.array([3, 1, 2, 0], dtype=np.int64)  # row 0: 2 of 2 accepted, row 1: 0 of 2, row 2: 1 of 3
    corr = zb.deferred_cpu_corrections(np.array([0, 1, 2, -1]), np.array([2, 2, 3, 4]), valid)
    assert corr.tolist() == [0, 2, 2, 0]


def test_deferred_corrections_ignore_rows_outside_previous_batch():
    valid = np.array([2, 2, 9, 9], dtype=np.int64)  # rows 2, 3: stale (previous batch had 2 rows)
    corr = zb.deferred_cpu_corrections(np.array([0, 2, 7]), np.array([2, 2, 2]), valid, num_prev=2)
    assert corr.tolist() == [1, 0, 0]
    assert zb.deferred_cpu_corrections(np.array([0]), np.array([2]), np.zeros(0, dtype=np.int64)).tolist() == [0]


def test_apply_cpu_corrections_skips_requests_that_left_the_batch():
    nc = np.array([10, 20, 30], dtype=np.int32)
    zb.apply_cpu_corrections(nc, np.array([2, -1, 0]), np.array([3, 5, 1]))
    assert nc.tolist() == [9, 20, 27]
    assert nc.dtype == np.int32


def test_rejected_tokens():
    assert zb.rejected_tokens(3, 4) == 0
    assert zb.rejected_tokens(3, 1) == 3
    assert zb.rejected_tokens(np.array([2, 2]), np.array([1, 3])).tolist() == [2, 0]


# ------------------------------------------------------------------------------------------------
# seq_lens, discard mask, backup token
# ------------------------------------------------------------------------------------------------
def test_optimistic_seq_lens_zero_padding():
    out = np.full(5, 99, dtype=np.int32)
    got = zb.optimistic_seq_lens(np.array([4, 7, 0, 0, 0], dtype=np.int32), np.array([3, 1, 0, 0, 0]), 2, out)
    assert got.tolist() == [7, 8]
    assert out.tolist() == [7, 8, 0, 0, 0]


def test_correct_seq_lens_cpu_subtracts_only_participating_rows():
    seq = np.array([20, 30, 40, 50], dtype=np.int32)
    prev = np.array([1, -1, 0, 2], dtype=np.int64)
    drafts = np.array([3, 2, 0, 0], dtype=np.int32)  # previous row 2 had no drafts (prefill)
    valid = np.array([4, 1, 1, 0], dtype=np.int64)
    zb.correct_seq_lens_cpu(seq, prev, drafts, valid, 4)
    assert seq.tolist() == [18, 30, 40, 50]


def test_correct_seq_lens_cpu_ignores_rows_past_the_previous_batch():
    seq = np.array([20, 30], dtype=np.int32)
    drafts, valid = np.array([2, 2, 2, 0], dtype=np.int32), np.array([1, 1, 1, 1], dtype=np.int64)
    zb.correct_seq_lens_cpu(seq, np.array([0, 2]), drafts, valid, 2, num_prev=2)  # row 2 of the counts is stale
    assert seq.tolist() == [18, 30]


def test_discard_mask():
    out = np.zeros(4, dtype=bool)
    assert zb.discard_request_mask(np.array([5, 9, 3]), np.array([9, 9, 3]), 3, out).tolist() == [True, False, False]


class _FakeRequest:
    """vLLM's CachedRequestState.get_token_id semantics (prompt, then outputs, else -1)."""

    def __init__(self, prompt, output):
        self.prompt, self.output = prompt, output

    def get_token_id(self, idx):
        if idx < len(self.prompt):
            return self.prompt[idx]
        if idx - len(self.prompt) < len(self.output):
            return self.output[idx - len(self.prompt)]
        return -1


def test_backup_token_is_the_last_committed_token_not_the_optimistic_seq_len():
    # vLLM #38098: seq_lens inflated by unaccepted draft placeholders index past the committed tokens
    reqs = [
        _FakeRequest([0, 1], [1000, 1001, 1002]),
        _FakeRequest([0, 1, 2, 3], [2000]),
        _FakeRequest([0], [3000, 3001, 3002, 3003]),
    ]
    ntns = np.array([5, 5, 5], dtype=np.int32)
    inflated = np.array([7, 9, 5])
    table = np.full((3, 16), -1, dtype=np.int32)
    for i, r in enumerate(reqs):
        toks = r.prompt + r.output
        table[i, : len(toks)] = toks
    assert [r.get_token_id(int(s)) for r, s in zip(reqs, inflated)] == [-1, -1, -1]  # the bug
    assert zb.backup_token_indices(ntns, 3).tolist() == [4, 4, 4]
    out = np.zeros(3, dtype=np.int64)
    assert zb.backup_next_token_ids(table, ntns, 3, out).tolist() == [1002, 2000, 3003]
    assert [r.get_token_id(4) for r in reqs] == [1002, 2000, 3003]


def test_backup_token_of_an_empty_row_is_minus_one():
    out = np.zeros(2, dtype=np.int64)
    assert zb.backup_next_token_ids(np.zeros((2, 4), dtype=np.int32), np.array([0, 2]), 2, out).tolist() == [-1, 0]


# ------------------------------------------------------------------------------------------------
# accepted-count remap
# ------------------------------------------------------------------------------------------------
def test_remap_accepted_counts_after_condense():
    snap = np.array([3, 1, 2], dtype=np.int32)  # previous rows: a=3, b=1, c=2 ; b finished, c condensed to 1
    out = np.zeros(4, dtype=np.int32)
    assert zb.remap_accepted_counts(np.array([0, 2, -1]), snap, 3, out).tolist() == [3, 2, 1]
    assert zb.remap_accepted_counts(np.array([5, 0]), snap, 2, out).tolist() == [1, 3]  # out of range: new
    assert zb.remap_accepted_counts(np.array([1]), snap, 1, out, num_prev=1).tolist() == [1]
    taken = zb.snapshot_rows(snap, 2)
    snap[0] = 99
    assert taken.tolist() == [3, 1]


def test_remap_accepted_counts_bounds():
    """The bound on previous rows is exclusive and num_prev narrows it below the snapshot's length; an empty or
    one-row snapshot is gathered without reading past it (mutation testing: docs/mutation.md)."""
    snap = np.array([3, 1, 2, 4], dtype=np.int32)  # rows 2, 3: stale (the previous batch had 2 rows)
    out = np.zeros(4, dtype=np.int32)
    assert zb.remap_accepted_counts(np.array([1, 2, 3]), snap, 3, out, num_prev=2).tolist() == [1, 1, 1]
    assert zb.remap_accepted_counts(np.array([0, 2]), snap, 2, out, num_prev=2, new_value=7).tolist() == [3, 7]
    assert zb.remap_accepted_counts(np.array([0, -1]), np.zeros(0, dtype=np.int32), 2, out).tolist() == [1, 1]
    assert zb.remap_accepted_counts(np.array([-1, 0]), np.array([5], dtype=np.int32), 2, out).tolist() == [1, 5]


# ------------------------------------------------------------------------------------------------
# the whole chain on random batch changes: optimistic + device correction + deferred correction
# == the classic exact arithmetic, and the Ascend CPU seq_lens == the device seq_lens
# ------------------------------------------------------------------------------------------------
@st.composite
def batch_changes(draw):
    n_prev = draw(st.integers(0, 10))
    k = draw(st.integers(1, 4))
    prev_ids = [f"p{i}" for i in range(n_prev)]
    exact_prev = [draw(st.integers(0, 500)) for _ in range(n_prev)]  # computed before step N
    drafts = [draw(st.integers(0, k)) for _ in range(n_prev)]  # drafts verified in step N
    valid = [draw(st.integers(1, d + 1)) for d in drafts]  # 1 + accepted
    keep = draw(st.lists(st.booleans(), min_size=n_prev, max_size=n_prev))
    carried = [i for i in range(n_prev) if keep[i]]
    n_new = draw(st.integers(0, 4))
    order = draw(st.permutations(list(range(len(carried) + n_new))))
    return n_prev, prev_ids, exact_prev, drafts, valid, carried, n_new, order


@settings(max_examples=200, deadline=None)
@given(batch_changes(), st.integers(0, 3))
def test_zero_bubble_chain_equals_classic(case, sched_extra):
    n_prev, prev_ids, exact_prev, drafts, valid, carried, n_new, order = case
    rows = [("c", i) for i in carried] + [("n", j) for j in range(n_new)]
    rows = [rows[o] for o in order]
    n = len(rows)
    R = 16
    req_ids = [prev_ids[i] if kind == "c" else f"new{i}" for kind, i in rows]
    prev_map = {prev_ids[i]: i for i in range(n_prev)}
    # scheduler view of step N+1: optimistic counts (all drafts accepted) for carried rows
    exact = np.array([exact_prev[i] + valid[i] if kind == "c" else 7 * i for kind, i in rows], dtype=np.int64)
    optimistic = np.array([exact_prev[i] + 1 + drafts[i] if kind == "c" else 7 * i for kind, i in rows], dtype=np.int32)
    # a carried row without drafts in step N was a (final) prefill / plain decode: scheduler count exact
    for r, (kind, i) in enumerate(rows):
        if kind == "c" and drafts[i] == 0:
            optimistic[r] = exact[r]
    nst = np.array([1 + sched_extra] * n, dtype=np.int32)

    prev_pos = zb.compute_prev_positions(req_ids, prev_map, n, np.zeros(R, dtype=np.int64))
    prev_drafts = np.zeros(R, dtype=np.int32)
    queued = [r for r, (kind, i) in enumerate(rows) if kind == "c" and drafts[i] > 0]
    zb.optimistic_advance(prev_pos[queued], np.array([drafts[rows[r][1]] for r in queued], dtype=np.int64), prev_drafts)
    valid_buf = np.zeros(R, dtype=np.int64)
    valid_buf[:n_prev] = valid

    # device: correction + positions + seq_lens
    dev_nc = torch.zeros(R, dtype=torch.int32)
    dev_nc[:n_prev] = torch.tensor(exact_prev, dtype=torch.int32)
    seq_lens = torch.zeros(R, dtype=torch.int32)
    positions = torch.zeros(64, dtype=torch.int64)
    req_idx = torch.from_numpy(np.repeat(np.arange(n), nst)).to(torch.int64)
    qpos = torch.from_numpy(np.concatenate([np.arange(x) for x in nst]) if n else np.zeros(0, dtype=np.int64))
    correction = zb.CountCorrection(
        num_computed_tokens=dev_nc,
        seq_lens=seq_lens,
        num_scheduled_tokens=torch.from_numpy(nst.copy()),
        prev_positions=torch.from_numpy(prev_pos.copy()),
        prev_num_draft_tokens=torch.from_numpy(prev_drafts.copy()),
        req_indices=req_idx,
        query_pos=qpos.to(torch.int64),
        positions=positions,
    )
    correction(
        n,
        torch.from_numpy(optimistic.copy()),
        torch.from_numpy(valid_buf[:n_prev].copy()),
        num_tokens=int(nst.sum()),
        num_prev_reqs=n_prev,
    )
    assert dev_nc[:n].tolist() == exact.tolist()
    assert seq_lens[:n].tolist() == (exact + nst).tolist()
    assert positions[: int(nst.sum())].tolist() == [int(exact[r]) + q for r in range(n) for q in range(nst[r])]

    # host, after the launch: the deferred correction makes the CPU counts exact
    cpu = optimistic.copy()
    corr = zb.deferred_cpu_corrections(
        prev_pos[queued], np.array([drafts[rows[r][1]] for r in queued]), valid_buf, num_prev=n_prev
    )
    zb.apply_cpu_corrections(cpu, np.array(queued, dtype=np.int64), corr)
    assert cpu.tolist() == exact.tolist()

    # Ascend: exact CPU seq_lens before the launch, from the optimistic ones
    sl = np.zeros(R, dtype=np.int32)
    zb.optimistic_seq_lens(optimistic, nst, n, sl)
    zb.correct_seq_lens_cpu(sl, prev_pos, prev_drafts, valid_buf, n, num_prev=n_prev)
    assert sl[:n].tolist() == seq_lens[:n].tolist()


def _device_correct(base, prev_pos, valid, drafts, cpu, prev_nc, n_prev):
    R = 8
    n = len(cpu)
    nc = torch.zeros(R, dtype=torch.int32)
    nc[:n_prev] = torch.tensor(prev_nc, dtype=torch.int32)
    seq = torch.zeros(R, dtype=torch.int32)
    pos = torch.zeros(16, dtype=torch.int64)
    nst = torch.ones(n, dtype=torch.int32)
    acc = torch.ones(n, dtype=torch.int32)
    correction = zb.CountCorrection(
        num_computed_tokens=nc,
        seq_lens=seq,
        num_scheduled_tokens=nst,
        prev_positions=torch.tensor(prev_pos, dtype=torch.int64),
        prev_num_draft_tokens=torch.tensor(drafts, dtype=torch.int32),
        req_indices=torch.arange(n, dtype=torch.int64),
        query_pos=torch.zeros(n, dtype=torch.int64),
        positions=pos,
        num_accepted_tokens=acc,
        base=base,
    )
    correction(
        n,
        torch.tensor(cpu, dtype=torch.int32),
        torch.tensor(valid, dtype=torch.int64),
        num_tokens=n,
        num_prev_reqs=n_prev,
    )
    return nc[:n].tolist(), acc.tolist(), seq[:n].tolist(), pos[:n].tolist()


def test_correction_bases_agree_when_the_previous_step_scheduled_one_plus_drafts():
    # row 0 was row 1 (3 drafts, 2 accepted), row 1 was row 0 (no drafts), row 2 is new
    prev_nc, drafts, valid = [40, 10], [0, 3, 0, 0], [1, 3]
    cpu = [10 + 1 + 3, 41, 7]  # scheduler: optimistic for the spec row, exact for the others
    a = _device_correct("previous", [1, 0, -1], valid, drafts, cpu, prev_nc, 2)
    b = _device_correct("cpu", [1, 0, -1], valid, drafts, cpu, prev_nc, 2)
    assert a == b
    assert a[0] == [13, 41, 7] and a[1] == [3, 1, 1]


def test_cpu_base_is_right_when_the_previous_step_also_caught_up_tokens():
    # vLLM 0.13's async scheduler: a resumed request scheduled m = 4 catch-up tokens + 3 drafts in one
    # step (7 tokens from 56); 2 drafts accepted -> exact = 56 + 4 + 2 = 62; optimistic = 63
    prev = _device_correct("previous", [0], [3], [3], [63], [56], 1)
    cpu = _device_correct("cpu", [0], [3], [3], [63], [56], 1)
    assert cpu[0] == [62] and cpu[2] == [63] and cpu[3] == [62]
    assert prev[0] == [59]  # upstream's previous + valid: short by m - 1


def test_correction_base_is_checked():
    with pytest.raises(ValueError, match="base"):
        _device_correct("nope", [0], [1], [1], [1], [0], 1)


# ------------------------------------------------------------------------------------------------
# bounds, dtypes and paddings the runner relies on (each test below kills mutants: docs/mutation.md)
# ------------------------------------------------------------------------------------------------
# previous batch: 3 rows in 5-row buffers (rows 3, 4: stale, with drafts). Row 0 had 1 draft (rejected: valid 1), row 1
# no draft (a discarded partial prefill: valid 0), row 2 two drafts (both accepted: valid 3).
_PREV_NC = [10, 20, 30, 99, 99]
_PREV_DRAFTS = [1, 0, 2, 2, 2]
_VALID = [1, 0, 3, 1, 1]
# current rows <- previous rows 2, 0, 1, 3 (== num_prev: stale), new; a prev_positions buffer longer than the batch
_PREV_POS = [2, 0, 1, 3, -1, 4, 4]
_CPU = [33, 12, 21, 50, 7]  # scheduler counts: optimistic (all drafts accepted) for the participating rows 0, 1
_EXACT = [33, 11, 21, 50, 7]


def _correct(base, *, valid=_VALID, drafts=_PREV_DRAFTS, prev_pos=_PREV_POS, num_prev=3, num_positions=12, tokens=True):
    n = len(_CPU)
    nc = torch.tensor(_PREV_NC + [0, 0, 0], dtype=torch.int32)
    acc = torch.full((8,), -5, dtype=torch.int32)
    seq = torch.full((8,), -9, dtype=torch.int32)
    pos = torch.full((16,), -9, dtype=torch.int64)
    correction = zb.CountCorrection(
        num_computed_tokens=nc,
        seq_lens=seq,
        num_scheduled_tokens=torch.full((8,), 2, dtype=torch.int32),
        prev_positions=torch.tensor(_PREV_POS if prev_pos is None else prev_pos, dtype=torch.int64),
        prev_num_draft_tokens=torch.tensor(_PREV_DRAFTS if drafts is None else drafts, dtype=torch.int32),
        req_indices=torch.arange(n, dtype=torch.int64).repeat_interleave(2),
        query_pos=torch.tensor([0, 1] * n, dtype=torch.int64),
        positions=pos,
        num_accepted_tokens=acc,
        base=base,
    )
    correction(
        n,
        torch.tensor(_CPU + [77], dtype=torch.int32),
        None if valid is None else torch.tensor(valid, dtype=torch.int64),
        num_prev_reqs=num_prev,
        **({"num_tokens": n * 2, "num_positions": num_positions} if tokens else {}),
    )
    return nc[:n].tolist(), acc.tolist(), seq.tolist(), pos.tolist()


@pytest.mark.parametrize("base", ["previous", "cpu"])
def test_correct_counts_participation_bounds_and_padding(base):
    """Only rows whose previous row is inside the previous batch (< num_prev, not merely inside the buffers) and had
    >= 1 draft are corrected -- one draft counts, a discarded no-draft row (valid 0) does not, a new row never reads
    row 0; num_accepted_tokens is written for exactly those rows; positions past num_tokens up to num_positions and
    seq_lens past num_reqs are zeroed. Both correction bases agree here (the previous step scheduled 1 + drafts)."""
    nc, acc, seq, pos = _correct(base)
    assert nc == _EXACT
    assert acc == [3, 1, -5, -5, -5, -5, -5, -5]
    assert seq == [c + 2 for c in _EXACT] + [0, 0, 0]
    assert pos[:10] == [c + q for c in _EXACT for q in (0, 1)] and pos[10:12] == [0, 0] and pos[12:] == [-9] * 4


@pytest.mark.parametrize("base", ["previous", "cpu"])
def test_correct_counts_without_previous_counts(base):
    """An empty count tensor (nothing to gather from) and no previous step at all (no valid counts: the buffers are
    bound but not read): the CPU counts are copied."""
    assert _correct(base, valid=[], drafts=[], num_prev=None)[0] == _CPU
    assert _correct(base, valid=None, drafts=None, prev_pos=None, num_prev=None)[0] == _CPU
    assert _correct(base, num_prev=None)[0][:3] == _EXACT[:3]  # num_prev defaults to the count tensor's length


@pytest.mark.parametrize("base", ["previous", "cpu"])
def test_correct_counts_without_tokens_leaves_positions_alone(base):
    """num_tokens and num_positions left out: no token, so positions is not written; the counts and seq_lens are."""
    nc, _, seq, pos = _correct(base, tokens=False)
    assert nc == _EXACT and seq[:5] == [c + 2 for c in _EXACT] and pos == [-9] * 16


def test_deferred_corrections_single_previous_row_and_dtype():
    corr = zb.deferred_cpu_corrections(np.array([0, -1]), np.array([3, 2]), np.array([2], dtype=np.int32))
    assert corr.tolist() == [2, 0] and corr.dtype == np.int64


def test_optimistic_advance_takes_the_runner_lists_and_arrays_alike():
    for prev, drafts in (([2, -1], [3, 5]), (np.array([2, -1], dtype=np.int32), np.array([3, 5], dtype=np.int32))):
        buf = np.full(4, 9, dtype=np.int32)
        zb.optimistic_advance(prev, drafts, buf)
        assert buf.tolist() == [0, 0, 3, 0]


def test_backup_token_indices_and_ids_at_the_row_edges():
    """Unsigned counts do not wrap; a one-token row reads column 0; a full row reads its last column; an index past
    the table is clamped to the last column; rows past num_reqs are not read."""
    assert zb.backup_token_indices(np.array([0, 1], dtype=np.uint32), 2).tolist() == [-1, 0]
    table = np.arange(12, dtype=np.int32).reshape(3, 4)
    out = np.full(3, 7, dtype=np.int64)
    got = zb.backup_next_token_ids(table, np.array([1, 4, 9, 2]), 3, out)
    assert got.tolist() == [0, 7, 11]


def test_device_slot_mapper_entry_point():
    """zero_bubble.slot_mapper forwards every argument (num_reqs and the context-parallel options included)."""
    bt = torch.arange(32, dtype=torch.int32).reshape(4, 8)
    qsl, pos = torch.tensor([0, 2, 3, 4], dtype=torch.int32), torch.tensor([0, 5, 1, 2])
    out = torch.zeros(8, dtype=torch.int64)
    zb.slot_mapper(bt, out, block_size=4, max_num_tokens=6)(2, qsl, pos)
    assert out.tolist() == [0, 5, 33, -1, -1, -1, 0, 0]  # the fourth token belongs to no request of the two
    zb.slot_mapper(bt, out, block_size=4, max_num_tokens=6, dcp_world_size=2, dcp_rank=1)(3, qsl, pos)
    assert out.tolist() == [-1, 2, 32, -1, -1, -1, 0, 0]  # rank 1 of 2 owns the odd positions, at local p // 2


# ------------------------------------------------------------------------------------------------
# zb_patch.versions.npu_runner helpers (no vLLM: stand-in block tables with the attributes the guarded
# vllm-ascend BlockTable has)
# ------------------------------------------------------------------------------------------------
class _Buf:
    def __init__(self, tensor):
        self.gpu = tensor


class _Table:
    def __init__(self, block_size=4, kernel_sizes=(4,), rows=4, cols=8):
        self.block_size, self.physical_block_size, self.max_num_batched_tokens = block_size, block_size, 6
        if kernel_sizes is not None:
            self.kernel_sizes = list(kernel_sizes)
        self.block_table = _Buf(torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols))
        self.slot_mapping = _Buf(torch.zeros(8, dtype=torch.int64))


def test_computes_slot_mapping_only_for_the_first_kernel_block_size():
    from zb_patch.versions.npu_runner import computes_slot_mapping

    assert computes_slot_mapping(_Table(4, (4,))) and computes_slot_mapping(_Table(4, (4, 8)))
    assert not computes_slot_mapping(_Table(4, (8, 4)))
    assert not computes_slot_mapping(_Table(4, ()))
    assert not computes_slot_mapping(_Table(4, None))  # no kernel_sizes attribute at all


def test_slot_mapper_is_built_once_per_block_table():
    from zb_patch.versions import npu_runner

    b = npu_runner.Buffers(*[None] * 9)
    t1, t2 = _Table(), _Table()
    m1 = npu_runner.slot_mapper(b, t1)
    m2 = npu_runner.slot_mapper(b, t2)
    assert m1 is not m2 and npu_runner.slot_mapper(b, t1) is m1 and npu_runner.slot_mapper(b, t2) is m2
    m1(2, torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([0, 5, 1]))
    assert t1.slot_mapping.gpu.tolist() == [0, 5, 33, -1, -1, -1, 0, 0] and not t2.slot_mapping.gpu.any()


class _Host:  # the host side of a CpuGpuBuffer
    def __init__(self, n):
        self.np = np.full(n, 7, dtype=np.int32)


class _Req:
    def __init__(self, drafts):
        self.prev_num_draft_len = drafts
        self.output_token_ids = [-1] * (drafts + 1)


class _Event:
    def __init__(self):
        self.waits = 0

    def synchronize(self):
        self.waits += 1


def _update_states_runner(zb, prev_sampled, prev_rows, requests, **attrs):
    from zb_patch.versions import npu_runner

    runner = type("Runner", (), {})()
    runner.input_batch = type("Batch", (), {})()
    runner.input_batch.prev_sampled_token_ids = prev_sampled
    runner.input_batch.prev_req_id_to_index = prev_rows
    runner.requests = requests
    runner.valid_sampled_token_count_event = object()
    for name, value in attrs.items():
        setattr(runner, name, value)
    buffers = npu_runner.Buffers(*[None] * 9)
    buffers.prev_drafts = _Host(8)
    runner.__dict__[zb.state_attr] = npu_runner.State(active=True, buffers=buffers)
    return runner, runner.__dict__[zb.state_attr]


class _SchedulerOutput:
    """The fields of vLLM's SchedulerOutput the wrapper reads: this step's tokens and the cached requests' counts."""

    def __init__(self, scheduled: dict[str, int] | None = None, cached: dict[str, int] | None = None) -> None:
        self.num_scheduled_tokens = scheduled or {}
        cached = cached or {}
        self.scheduled_cached_reqs = type(
            "Cached", (), {"req_ids": list(cached), "num_computed_tokens": list(cached.values())}
        )()


def test_update_states_wrapper_queues_the_rows_the_release_reads():
    """Optimistic counts (drafts + 1) at the previous rows of requests still known, 1 at the others, only rows of the
    previous batch; the rows the release reads with drafts become this step's corrections; the answer is withdrawn
    afterwards. Without a previous step the release runs as it is. The input-preparation wait where a release
    asks for it, and only when the runner has the event."""
    from zb_patch.versions import npu_runner

    zb = npu_runner.ZeroBubble("9.9", other_runners="-")
    rows = {"a": 0, "b": 1, "gone": 2, "stale": 3}  # "stale": a row past the previous batch (3 rows)
    runner, st = _update_states_runner(zb, torch.zeros(3, 1), rows, {"a": _Req(2), "b": _Req(0), "stale": _Req(1)})
    seen = []

    def release(r, scheduler_output):
        counts = r._get_valid_sampled_token_count()
        seen.append(list(counts))
        return counts[0], counts[1], scheduler_output  # the release reads rows 0 and 1

    so = _SchedulerOutput({"a": 3, "b": 1})
    assert zb.make_update_states(release)(runner, so) == (3, 1, so)
    assert seen == [[3, 1, 1]]
    assert st.queue == [("a", 2, 0)] and st.num_prev == 3 and st.steps == 1 and st.valid_host is None
    assert st.out_lens == {"a": 3, "b": 1}  # output lengths before the release's placeholders
    assert st.buffers.prev_drafts.np.tolist() == [2, 0, 0, 0, 0, 0, 0, 0]
    assert "_get_valid_sampled_token_count" not in runner.__dict__

    first, st = _update_states_runner(zb, None, None, {})
    assert zb.make_update_states(lambda r, so: "ran")(first, _SchedulerOutput()) == "ran"
    assert st.queue == [] and st.num_prev == 0 and not st.buffers.prev_drafts.np.any()

    zb.waits_for_input_prep = True
    event = _Event()
    waiting, _ = _update_states_runner(zb, None, None, {}, prepare_inputs_event=event)
    zb.make_update_states(lambda r, so: None)(waiting, _SchedulerOutput())
    assert event.waits == 1
    no_event, _ = _update_states_runner(zb, None, None, {})
    zb.make_update_states(lambda r, so: None)(no_event, _SchedulerOutput())


def test_deferred_correction_waits_only_when_input_preparation_did_not():
    """apply_deferred subtracts each queued request's rejected drafts from req_state.num_computed_tokens with the
    counts the host already waited for, or waits itself (an early return skipped input preparation), and trims their
    placeholders off output_token_ids: to the length before the placeholders plus the accepted drafts, never longer
    than the release left it; a request whose longer list had reached min_tokens and whose exact one has not goes to
    readd_min_tokens. Requests gone and rows past the counts are left alone; the step's queue and counts are
    cleared."""
    from types import SimpleNamespace

    from zb_patch.versions import npu_runner

    zb = npu_runner.ZeroBubble("9.9", other_runners="-")
    readded = []
    zb.readd_min_tokens = lambda runner, states: readded.append([s.req_id for s in states])

    class Counted:
        def __init__(self, req_id, n, out, min_tokens=0):
            self.req_id, self.num_computed_tokens, self.output_token_ids = req_id, n, out
            self.sampling_params = SimpleNamespace(min_tokens=min_tokens)

    for waited in (True, False):
        readded.clear()
        runner = type("Runner", (), {})()
        runner.requests = {
            "a": Counted("a", 50, [7] * 5 + [-1] * 2, min_tokens=6),  # 2 drafts, none accepted: 7 -> 5 < 6
            "b": Counted("b", 60, [7] * 4 + [-1] * 2, min_tokens=3),  # 1 of 2 accepted: 6 -> 5, past min_tokens
            "c": Counted("c", 70, [-1] * 3),  # row 4: past the 4 counts
            "d": Counted("d", 80, [7] * 5),  # 2 of 3 accepted: 4 + 2 = 6 > 5, the length the release left
        }
        counts = [1, 3, 2, 3]
        reads = []
        runner._get_valid_sampled_token_count = lambda reads=reads, counts=counts: reads.append(1) or counts
        st = npu_runner.State(active=True, host_waits=5)
        st.queue = [("a", 2, 0), ("gone", 3, 1), ("b", 2, 2), ("c", 1, 4), ("d", 3, 3)]
        st.out_lens = {"a": 5, "b": 4, "c": 2, "d": 4}
        st.valid_host = counts if waited else None
        runner.__dict__[zb.state_attr] = st
        zb.apply_deferred(runner)
        assert [runner.requests[r].num_computed_tokens for r in "abcd"] == [48, 59, 70, 79]
        assert [len(runner.requests[r].output_token_ids) for r in "abcd"] == [5, 5, 3, 5]
        assert readded == [["a"]]
        assert (len(reads), st.host_waits) == ((0, 5) if waited else (1, 6))
        assert st.queue == [] and st.valid_host is None

    # nothing queued (no request had drafts last step), or an inactive runner: no wait, nothing touched
    runner = type("Runner", (), {})()
    runner._get_valid_sampled_token_count = lambda: pytest.fail("apply_deferred waited with nothing queued")
    zb.apply_deferred(runner)
    st = runner.__dict__[zb.state_attr] = npu_runner.State(active=True, host_waits=5)
    zb.apply_deferred(runner)
    assert st.host_waits == 5 and st.queue == []


def test_runner_report_reads_the_state_a_wrapper_left_on_the_runner():
    """The engine child's per-runner figures (selftest's host waits, corrected steps) come from runner_report."""
    from types import SimpleNamespace

    from zb_patch.versions.npu_runner import State, runner_report

    state = State(active=False, reason="no spec decode", steps=7, corrected_steps=5, host_waits=2, fallback_uploads=1)
    assert runner_report(SimpleNamespace(model=object(), _zb=state)) == {
        "active": False,
        "reason": "no spec decode",
        "steps": 7,
        "corrected_steps": 5,
        "host_waits": 2,
        "fallback_uploads": 1,
    }
    assert runner_report(SimpleNamespace(model=object())) is None
