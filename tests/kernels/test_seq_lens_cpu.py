"""CPU twin of vllm-ascend's correct_optimistic_seq_lens_cpu: agrees with the device correction."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zb_patch.kernels import correct_optimistic_seq_lens_cpu
from zb_patch.kernels.reference import token_counts_reference


def vllm_ascend_0_23_semantics(opt, prev_positions, prev_drafts, valid, num_reqs):
    """What vllm-ascend 0.23.0 computes (read from its wheel), restated element by element."""
    out = opt.copy()
    for r in range(num_reqs):
        p = int(prev_positions[r])
        if p >= 0 and prev_drafts[p] > 0:
            out[r] -= prev_drafts[p] + 1 - valid[p]
    return out


def consistent_state(rng, n_prev, n, *, accept="random"):
    """A batch change where the CPU values are the scheduler's optimistic ones."""
    exact_prev = rng.integers(10, 500, n_prev).astype(np.int32)  # device num_computed of the prev batch
    drafts = rng.integers(0, 4, n_prev).astype(np.int32)
    if accept == "all":
        valid = drafts.astype(np.int64) + 1
    elif accept == "none":
        valid = np.ones(n_prev, dtype=np.int64)
    else:
        valid = np.array([rng.integers(1, d + 2) for d in drafts], dtype=np.int64)
    carried = rng.permutation(n_prev)[: min(n, n_prev)]
    prev = np.full(n, -1, dtype=np.int64)
    prev[: len(carried)] = carried
    prev = rng.permutation(prev)
    cpu = rng.integers(0, 500, n).astype(np.int32)
    for r, p in enumerate(prev):  # scheduler advanced by drafts + 1 (all assumed accepted)
        if p >= 0 and drafts[p] > 0:
            cpu[r] = exact_prev[p] + drafts[p] + 1
    sched = rng.integers(1, 5, n).astype(np.int32)
    return exact_prev, drafts, valid, prev, cpu, sched


def device_seq_lens(exact_prev, drafts, valid, prev, cpu, sched):
    n = len(prev)
    size = max(len(exact_prev), n) + 2
    nc = torch.zeros(size, dtype=torch.int32)
    nc[: len(exact_prev)] = torch.from_numpy(exact_prev)
    drafts_t = torch.zeros(size, dtype=torch.int32)
    drafts_t[: len(drafts)] = torch.from_numpy(drafts)
    seq = torch.zeros(size, dtype=torch.int32)
    token_counts_reference(
        nc,
        None,
        torch.from_numpy(prev),
        torch.from_numpy(valid),
        drafts_t,
        torch.from_numpy(cpu),
        torch.from_numpy(sched),
        seq,
        num_reqs=n,
    )
    return seq[:n].numpy()


@pytest.mark.parametrize("accept", ["all", "none", "random"])
@pytest.mark.parametrize("n_prev,n", [(0, 3), (4, 4), (6, 3), (3, 6), (1, 1), (5, 0)])
def test_cpu_and_device_corrections_agree(accept, n_prev, n):
    rng = np.random.default_rng(n_prev * 31 + n)
    exact_prev, drafts, valid, prev, cpu, sched = consistent_state(rng, n_prev, n, accept=accept)
    optimistic = np.zeros(n + 3, dtype=np.int32)
    optimistic[:n] = cpu + sched
    correct_optimistic_seq_lens_cpu(optimistic, prev, drafts, valid, n)
    assert optimistic[:n].tolist() == device_seq_lens(exact_prev, drafts, valid, prev, cpu, sched).tolist()
    assert (optimistic[n:] == 0).all()


@settings(max_examples=60, deadline=None)
@given(n_prev=st.integers(0, 20), n=st.integers(0, 20), seed=st.integers(0, 2**16))
def test_hypothesis_matches_vllm_ascend_and_device(n_prev, n, seed):
    rng = np.random.default_rng(seed)
    exact_prev, drafts, valid, prev, cpu, sched = consistent_state(rng, n_prev, n)
    optimistic = np.zeros(n + 2, dtype=np.int32)
    optimistic[:n] = cpu + sched
    expected = vllm_ascend_0_23_semantics(optimistic, prev, drafts, valid, n)
    correct_optimistic_seq_lens_cpu(optimistic, prev, drafts, valid, n)
    assert optimistic.tolist() == expected.tolist()
    assert optimistic[:n].tolist() == device_seq_lens(exact_prev, drafts, valid, prev, cpu, sched).tolist()


def test_torch_tensors_are_corrected_in_place():
    opt = torch.tensor([10, 20, 30, 0], dtype=torch.int32)
    correct_optimistic_seq_lens_cpu(
        opt, torch.tensor([1, -1, 0]), torch.tensor([2, 3], dtype=torch.int32), torch.tensor([1, 4]), 3
    )
    # row 0 <- prev 1: drafts 3, valid 4 -> 0 rejected; row 2 <- prev 0: drafts 2, valid 1 -> 2 rejected
    assert opt.tolist() == [10, 20, 28, 0]


def test_no_participants_and_empty_counts_leave_values():
    opt = np.array([5, 6, 7], dtype=np.int32)
    correct_optimistic_seq_lens_cpu(opt, np.array([-1, -1, -1]), np.array([2, 2]), np.array([1, 1]), 3)
    correct_optimistic_seq_lens_cpu(opt, np.array([0, 1, 0]), np.array([2, 2]), np.array([], dtype=np.int64), 3)
    correct_optimistic_seq_lens_cpu(opt, np.array([0, 1, 0]), np.array([0, 0]), np.array([1, 1]), 3)  # prefills
    assert opt.tolist() == [5, 6, 7]


def test_num_prev_hardening_and_partial_batch():
    opt = np.array([50, 60, 70, 80], dtype=np.int32)
    # prev row 2 exists in the (max_num_reqs) buffer but not in the previous batch of 2 rows
    correct_optimistic_seq_lens_cpu(
        opt, np.array([2, 0, 1, 0]), np.array([3, 3, 3]), np.array([1, 2, 1]), 3, num_prev=2
    )
    assert opt.tolist() == [50, 57, 68, 80]  # only the first 3 rows; row 0 (stale) untouched


def test_wrong_direction_is_detected():
    """Teeth: adding instead of subtracting the rejected tokens breaks agreement with the device."""
    rng = np.random.default_rng(5)
    exact_prev, drafts, valid, prev, cpu, sched = consistent_state(rng, 6, 6, accept="none")
    dev = device_seq_lens(exact_prev, drafts, valid, prev, cpu, sched)
    wrong = cpu + sched
    assert wrong.tolist() != dev.tolist()


def test_arguments_named_in_rejections_and_no_draft_rows():
    """Rejections name the argument (a device tensor, a negative num_prev, a non-integer count array; an empty one of
    any dtype is fine); a previous row without drafts is never corrected, even with a count of 0 (discarded)."""
    seq = np.array([20, 30], dtype=np.int32)
    with pytest.raises(ValueError, match="^optimistic_seq_lens="):
        correct_optimistic_seq_lens_cpu(torch.zeros(2, dtype=torch.int32, device="meta"), [0, 1], [1, 1], [1, 1], 2)
    with pytest.raises(ValueError, match="^num_prev="):
        correct_optimistic_seq_lens_cpu(seq, [0, 1], [1, 1], [1, 1], 2, num_prev=-1)
    with pytest.raises(ValueError, match="^valid_sampled_token_count="):
        correct_optimistic_seq_lens_cpu(seq, [0], [1], [2.0], 1)
    correct_optimistic_seq_lens_cpu(seq, [0, 1], [0, 1], [], 2)  # no counts: nothing to do
    correct_optimistic_seq_lens_cpu(seq, [0, 1], [0, 1], [0, 2], 2)
    assert seq.tolist() == [20, 30]
