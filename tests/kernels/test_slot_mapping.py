"""Slot-mapping kernel == pure-torch reference, exactly, on edge cases and hypothesis batches."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_env import KERNEL_DEVICE, examples, requires_kernels

from zb_patch import kernels
from zb_patch.kernels.reference import PAD_SLOT_ID, slot_mapping_reference, vllm_generic_slot_mapping

GUARD = 8  # elements past the written range that must stay untouched
POISON = -777


@dataclass
class Batch:
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    positions: torch.Tensor  # int64 [num_tokens]
    block_table: torch.Tensor  # int32 [rows, max_blocks]

    @property
    def num_reqs(self) -> int:
        return self.query_start_loc.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.positions.numel()


def make_batch(lens, starts, *, max_blocks=64, extra_rows=2, seed=0, shuffle=False, block_ids=10_000) -> Batch:
    g = torch.Generator().manual_seed(seed)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    if lens:
        qsl[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    pieces = []
    for n, s in zip(lens, starts):
        p = torch.arange(s, s + n, dtype=torch.int64)
        if shuffle and n > 1:
            p = p[torch.randperm(n, generator=g)]
        pieces.append(p)
    positions = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    rows = len(lens) + extra_rows
    block_table = torch.randint(0, block_ids, (rows, max_blocks), dtype=torch.int32, generator=g)
    return Batch(qsl, positions, block_table)


def run_pair(batch: Batch, dev: str, *, out_dtype=torch.int64, max_num_tokens=None, shape=None, block_size=16, **cfg):
    """Run the kernel (on ``dev``) and the reference (CPU); return both whole output buffers."""
    if max_num_tokens is None:
        max_num_tokens = batch.num_tokens + 5
    size = max(batch.num_tokens, max_num_tokens) + GUARD
    out_k = torch.full((size,), POISON, dtype=out_dtype, device=dev)
    out_r = torch.full((size,), POISON, dtype=out_dtype)
    mapper = kernels.slot_mapper(
        batch.block_table.to(dev), out_k, block_size=block_size, max_num_tokens=max_num_tokens, **cfg, **(shape or {})
    )
    mapper(batch.num_reqs, batch.query_start_loc.to(dev), batch.positions.to(dev))
    world = cfg.get("pcp_world_size", 1) * cfg.get("dcp_world_size", 1)
    rank = cfg.get("pcp_rank", 0) * cfg.get("dcp_world_size", 1) + cfg.get("dcp_rank", 0)
    slot_mapping_reference(
        batch.query_start_loc,
        batch.positions,
        batch.block_table,
        out_r,
        block_size=block_size,
        max_num_tokens=max_num_tokens,
        num_reqs=batch.num_reqs,
        physical_block_size=cfg.get("physical_block_size"),
        cp_world_size=world,
        cp_rank=rank,
        cp_kv_cache_interleave_size=cfg.get("cp_kv_cache_interleave_size", 1),
        pad_slot_id=cfg.get("pad_slot_id", PAD_SLOT_ID),
    )
    return out_k.cpu(), out_r


def assert_same(out_k, out_r):
    if not torch.equal(out_k, out_r):
        bad = (out_k != out_r).nonzero().flatten()[:10].tolist()
        raise AssertionError(
            f"kernel != reference at {bad}: kernel {out_k[bad].tolist()} reference {out_r[bad].tolist()}"
        )
    assert (out_k[-GUARD:] == POISON).all(), "kernel wrote past its range"


SHAPES = [
    pytest.param(None, id="default-shape"),
    pytest.param(dict(tile=16, max_programs=3, windowed=False), id="t16p3-gather"),
    pytest.param(dict(tile=16, max_programs=2, windowed=True, uniform_guess=False), id="t16p2-window-npu"),
    pytest.param(dict(tile=64, max_programs=1, windowed=True), id="t64p1-window"),
]


# ------------------------------------------------------------------------------------------------
# Edge cases
# ------------------------------------------------------------------------------------------------
@requires_kernels
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize(
    "lens,starts",
    [
        pytest.param([], [], id="empty"),
        pytest.param([1], [0], id="one-token"),
        pytest.param([1], [37], id="one-token-decode"),
        pytest.param([4, 4], [12, 28], id="block-boundaries"),  # positions 15|16, 31|32 with B=16
        pytest.param([130], [0], id="longer-than-tiles"),
        pytest.param([3, 1, 70, 2, 1, 5], [5, 0, 100, 7, 63, 15], id="ragged"),
        pytest.param([1] * 40, list(range(40)), id="decode-40"),
        pytest.param([4] * 12, [16 * i + 3 for i in range(12)], id="spec-k3"),
        pytest.param([4] * 11 + [5], [16 * i + 3 for i in range(12)], id="spec-almost-uniform"),
        pytest.param([3, 4, 4, 4, 4], [0, 9, 30, 60, 90], id="uniform-guess-misses"),
        pytest.param([2, 0, 3, 0, 0, 1], [1, 9, 4, 2, 3, 8], id="empty-requests"),
    ],
)
def test_edge_cases(dev, lens, starts, out_dtype, shape):
    batch = make_batch(lens, starts)
    assert_same(*run_pair(batch, dev, out_dtype=out_dtype, shape=shape, block_size=16))


@requires_kernels
def test_tile_boundary_matches_upstream_example(dev):
    # upstream's ">1024-token tile" case: positions 1023/1024 land in consecutive blocks
    batch = make_batch([1030], [0], max_blocks=80)
    out_k, out_r = run_pair(batch, dev, block_size=16, shape=dict(tile=1024))
    assert_same(out_k, out_r)
    bt = batch.block_table
    assert out_k[1023] == bt[0, 1023 // 16] * 16 + 1023 % 16
    assert out_k[1024] == bt[0, 64] * 16


@requires_kernels
@pytest.mark.parametrize("max_num_tokens", [0, 3, 7, 64, 200])
def test_padding_tail(dev, max_num_tokens):
    batch = make_batch([3, 4], [0, 10])
    out_k, out_r = run_pair(batch, dev, block_size=16, max_num_tokens=max_num_tokens, shape=dict(tile=16))
    assert_same(out_k, out_r)
    if max_num_tokens > batch.num_tokens:
        assert (out_k[batch.num_tokens : max_num_tokens] == PAD_SLOT_ID).all()
    assert (out_k[max(batch.num_tokens, max_num_tokens) :] == POISON).all()


@requires_kernels
@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("interleave_is_block", [False, True], ids=["I1", "I=B"])
@pytest.mark.parametrize("split", ["dcp"])  # pcp composes into the same flat rank: see the next test
def test_context_parallel_partitions_tokens(dev, world, interleave_is_block, split):
    """Every rank's kernel == reference, and every token is owned by exactly one rank."""
    block = 16
    batch = make_batch([5, 90, 3, 33], [0, 7, 250, 31], max_blocks=64)
    owners = torch.zeros(batch.num_tokens, dtype=torch.int64)
    for rank in range(world):
        cfg = dict(block_size=block, cp_kv_cache_interleave_size=block if interleave_is_block else 1)
        if split == "pcp":
            cfg.update(pcp_world_size=world, pcp_rank=rank)
        else:
            cfg.update(dcp_world_size=world, dcp_rank=rank)
        out_k, out_r = run_pair(batch, dev, shape=dict(tile=32, max_programs=2), **cfg)
        assert_same(out_k, out_r)
        owners += (out_k[: batch.num_tokens] != PAD_SLOT_ID).long()
    assert (owners == 1).all()


@requires_kernels
def test_pcp_times_dcp_rank_order(dev):
    # total rank = pcp_rank * dcp + dcp_rank: (pcp 2, dcp 2) rank (1, 0) behaves as flat rank 2 of 4
    batch = make_batch([40], [3])
    a, _ = run_pair(batch, dev, block_size=16, pcp_world_size=2, pcp_rank=1, dcp_world_size=2, dcp_rank=0)
    b, _ = run_pair(batch, dev, block_size=16, dcp_world_size=4, dcp_rank=2)
    assert torch.equal(a, b)


@requires_kernels
@pytest.mark.parametrize("kernel_block,physical", [(16, 32), (16, 64), (32, 128), (16, 16)])
@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (4, 16), (2, "physical")])
@pytest.mark.parametrize("windowed", [False, True], ids=["gather", "window"])
def test_hybrid_block_sizes(dev, kernel_block, physical, world, interleave, windowed):
    interleave = physical if interleave == "physical" else interleave
    batch = make_batch([7, 150, 1, 40], [0, 20, 500, 64], max_blocks=96)
    for rank in range(world):
        out_k, out_r = run_pair(
            batch,
            dev,
            block_size=kernel_block,
            physical_block_size=physical,
            dcp_world_size=world,
            dcp_rank=rank,
            cp_kv_cache_interleave_size=interleave,
            shape=dict(tile=32, max_programs=3, windowed=windowed),
        )
        assert_same(out_k, out_r)


@requires_kernels
@pytest.mark.parametrize("windowed", [False, True], ids=["gather", "window"])
def test_non_contiguous_positions_and_hardening(dev, windowed):
    # shuffled positions defeat the window (fallback gather); huge / negative positions -> PAD
    batch = make_batch([50, 3, 20], [0, 10, 900], max_blocks=40, shuffle=True)
    batch.positions[5] = -3
    batch.positions[60] = 10_000  # block 625 > 40 columns
    out_k, out_r = run_pair(batch, dev, block_size=16, shape=dict(tile=16, max_programs=2, windowed=windowed))
    assert_same(out_k, out_r)
    assert out_k[5] == PAD_SLOT_ID and out_k[60] == PAD_SLOT_ID


@requires_kernels
def test_offset_query_start_loc(dev):
    # tokens before query_start_loc[0] or after query_start_loc[-1] belong to no request -> PAD
    batch = make_batch([4, 4, 2], [0, 20, 40])
    batch.query_start_loc.copy_(torch.tensor([2, 6, 8, 9], dtype=torch.int32))  # tokens 0, 1, 9: no request
    out_k, out_r = run_pair(batch, dev, block_size=16)
    assert_same(out_k, out_r)
    assert out_k[0] == out_k[1] == out_k[batch.num_tokens - 1] == PAD_SLOT_ID


@requires_kernels
def test_one_shot_api_and_pad_id(dev):
    batch = make_batch([3, 2], [1, 5])
    out = torch.full((16,), POISON, dtype=torch.int32, device=dev)
    kernels.compute_slot_mapping(
        batch.query_start_loc.to(dev),
        batch.positions.to(dev),
        batch.block_table.to(dev),
        out,
        block_size=16,
        max_num_tokens=12,
        pad_slot_id=-5,
    )
    ref = torch.full((16,), POISON, dtype=torch.int32)
    slot_mapping_reference(
        batch.query_start_loc, batch.positions, batch.block_table, ref, block_size=16, max_num_tokens=12, pad_slot_id=-5
    )
    assert torch.equal(out.cpu(), ref)
    assert (ref[5:12] == -5).all()


@requires_kernels
def test_one_mapper_many_batches(dev):
    """A long-lived mapper (as a BlockTable holds it) stays exact across batches; on CUDA the calls
    after the first go through the cached compiled kernel (direct launch), also for a misaligned
    positions view (a second specialisation)."""
    bt = make_batch([1], [0], max_blocks=64, extra_rows=40).block_table
    out = torch.full((300,), POISON, dtype=torch.int32, device=dev)
    mapper = kernels.slot_mapper(bt.to(dev), out, block_size=16, max_num_tokens=256)
    for seed, (lens, shift) in enumerate(
        [([3, 9, 1], 0), ([1] * 30, 0), ([100, 28], 0), ([5], 1), ([2, 2], 1), ([40, 1, 1, 7], 0), ([], 0)]
    ):
        batch = make_batch(lens, [7 * i + 3 for i in range(len(lens))], max_blocks=64, seed=seed)
        batch.block_table = bt
        pos = torch.cat([torch.zeros(shift, dtype=torch.int64), batch.positions]).to(dev)[shift:]
        out.fill_(POISON)
        mapper(batch.num_reqs, batch.query_start_loc.to(dev), pos)
        ref = torch.full((300,), POISON, dtype=torch.int32)
        slot_mapping_reference(batch.query_start_loc, batch.positions, bt, ref, block_size=16, max_num_tokens=256)
        assert torch.equal(out.cpu(), ref), (seed, lens)
    if dev == "cuda":  # misaligned positions take Triton's normal path (a second specialisation)
        assert mapper.direct_launches >= 4, (mapper.direct_launches, mapper._launcher.slow_launches)


@requires_kernels
def test_valid_step_arguments_pass_the_attribute_checks_alone(dev, monkeypatch):
    """Every step, valid arguments pass the launcher's attribute and integer tests alone, at their bounds too (no
    request, every block-table row, a full buffer): the explaining checker runs only where those fail, e.g. for a
    numpy integer, which it normalises. Results are the same either way; the checker's cost is what a step saves."""
    from zb_patch.kernels import slot_mapping as sm

    explained = []

    def check(limits, num_reqs, query_start_loc, positions):
        explained.append(num_reqs)
        return checker(limits, num_reqs, query_start_loc, positions)

    checker = sm.check_slot_mapping_call
    monkeypatch.setattr(sm, "check_slot_mapping_call", check)
    rows, capacity = 6, 40
    bt = make_batch([1], [0], max_blocks=64, extra_rows=rows - 1).block_table.to(dev)
    out = torch.full((capacity,), POISON, dtype=torch.int32, device=dev)
    mapper = kernels.slot_mapper(bt, out, block_size=16, max_num_tokens=capacity)
    assert isinstance(mapper, sm.SlotMappingLauncher)
    for lens in ([], [1] * rows, [capacity], [2, 3]):
        batch = make_batch(lens, [5] * len(lens), max_blocks=64)
        mapper(batch.num_reqs, batch.query_start_loc.to(dev), batch.positions.to(dev))
        ref = torch.full((capacity,), POISON, dtype=torch.int32)
        slot_mapping_reference(
            batch.query_start_loc, batch.positions, bt.cpu(), ref, block_size=16, max_num_tokens=capacity
        )
        assert torch.equal(out.cpu(), ref), lens
    assert explained == []
    import numpy as np

    mapper(np.int64(2), batch.query_start_loc.to(dev), batch.positions.to(dev))
    assert explained == [2] and torch.equal(out.cpu(), ref)


@requires_kernels
@pytest.mark.parametrize(
    "cfg",
    [
        dict(physical_block_size=64, dcp_world_size=2, dcp_rank=1, cp_kv_cache_interleave_size=16, pad_slot_id=-7),
        dict(pcp_world_size=2, pcp_rank=1, dcp_world_size=2, dcp_rank=0),
    ],
    ids=["hybrid-dcp-pad", "pcp-dcp"],
)
def test_slot_mapper_s_two_branches_agree(dev, monkeypatch, cfg):
    """``slot_mapper`` hands its whole configuration to either branch: the torch reference's mapper (CPU tensors
    outside the interpreter) writes what the Triton launcher writes, CP ranks, hybrid blocks and pad id included."""
    batch = make_batch([7, 150, 1, 40], [0, 20, 500, 64], max_blocks=96)
    outs = []
    for triton in (True, False):
        with monkeypatch.context() as m:
            m.setattr(kernels, "uses_triton", lambda device, triton=triton: triton)
            out = torch.full((batch.num_tokens + 5 + GUARD,), POISON, dtype=torch.int64, device=dev)
            mapper = kernels.slot_mapper(
                batch.block_table.to(dev), out, block_size=16, max_num_tokens=batch.num_tokens + 5, **cfg
            )
            assert type(mapper).__name__ == ("SlotMappingLauncher" if triton else "_ReferenceSlotMapper")
            mapper(batch.num_reqs, batch.query_start_loc.to(dev), batch.positions.to(dev))
            outs.append(out.cpu())
    assert_same(*outs)
    assert (outs[0][batch.num_tokens : batch.num_tokens + 5] == cfg.get("pad_slot_id", PAD_SLOT_ID)).all()


@requires_kernels
def test_slot_mapper_hands_the_launch_shape_on(dev):
    bt = torch.zeros((7, 8), dtype=torch.int32, device=dev)
    out = torch.zeros(1000, dtype=torch.int32, device=dev)
    m = kernels.slot_mapper(bt, out, block_size=16, max_num_tokens=100, tile=48, max_programs=8, windowed=True)
    assert (m.tile, m.num_programs, m.windowed) == (64, 2, True)


@requires_kernels
def test_the_launcher_checks_its_configuration_itself(dev):
    """``SlotMappingLauncher`` built directly (not through ``slot_mapper``) refuses what ``slot_mapper`` refuses, and
    keeps an explicit ``uniform_guess``."""
    from zb_patch.kernels import slot_mapping as sm

    bt = torch.zeros((4, 8), dtype=torch.int32, device=dev)
    out = torch.zeros(64, dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match="block_table_stride=9"):
        sm.SlotMappingLauncher(bt, out, block_size=16, max_num_tokens=64, block_table_stride=9)
    with pytest.raises(ValueError, match="physical_block_size=24"):
        sm.SlotMappingLauncher(bt, out, block_size=16, max_num_tokens=64, physical_block_size=24)
    assert sm.SlotMappingLauncher(bt, out, block_size=16, max_num_tokens=64, uniform_guess=True).uniform_guess is True


@requires_kernels
def test_launch_shape_defaults_and_overrides(dev):
    """The launch shape the launcher picks for this device (module constants: the interpreter's tile and 4
    programs, CUDA's tile and one program per SM; the uniform owner guess and no block window on CPU and CUDA) and the
    overrides the tests use. Every shape gives the reference's slots (the tests above); a step's cost depends on it."""
    from zb_patch.kernels import _launch
    from zb_patch.kernels import slot_mapping as sm

    bt = torch.zeros((7, 8), dtype=torch.int32, device=dev)
    out = torch.zeros(1000, dtype=torch.int32, device=dev)
    if _launch.interpret_mode():
        tile, programs = sm._INTERP_TILE, 4
    else:
        tile, programs = sm._CUDA_TILE, _launch.multiprocessor_count("cuda", bt.device.index)
    m = sm.SlotMappingLauncher(bt, out, block_size=16, max_num_tokens=1000)
    assert (m.tile, m.num_programs, m.windowed, m.uniform_guess) == (tile, min(-(-1000 // tile), programs), False, True)
    assert m._launcher._options == ({"num_warps": sm._CUDA_WARPS} if bt.device.type == "cuda" else {})
    c = m._launcher._constexprs
    assert (c["WINDOW"], c["REQ_PAD"], c["WINDOWED"], c["UNIFORM_GUESS"]) == (
        _launch.next_power_of_2(tile // 16 + 2),
        8,
        False,
        True,
    )
    assert (c["CP_WORLD"], c["CP_RANK"], c["CP_INTERLEAVE"], c["BT_STRIDE"]) == (1, 0, 1, 8)

    shaped = sm.SlotMappingLauncher(
        bt, out, block_size=16, max_num_tokens=100, tile=48, max_programs=8, windowed=True, uniform_guess=False
    )
    assert (shaped.tile, shaped.num_programs, shaped.windowed, shaped.uniform_guess) == (64, 2, True, False)
    c = shaped._launcher._constexprs
    assert (c["WINDOW"], c["WINDOWED"], c["UNIFORM_GUESS"]) == (8, True, False)
    eight_rows = torch.zeros((8, 8), dtype=torch.int32, device=dev)
    one = sm.SlotMappingLauncher(eight_rows, out, block_size=32, max_num_tokens=1000, tile=64, max_programs=1)
    c = one._launcher._constexprs
    assert (one.num_programs, c["WINDOW"], c["REQ_PAD"]) == (1, 4, 16)  # 64 // 32 + 2 blocks; 8 + 1 starts
    # a device other than CUDA and CPU (the NPU's defaults; torch's meta device holds no data, nothing is launched):
    # the block-table window, the contiguous-only guess, no warps option
    npu_like = sm.SlotMappingLauncher(bt.to("meta"), out.to("meta"), block_size=16, max_num_tokens=1000)
    c = npu_like._launcher._constexprs
    assert (npu_like.windowed, npu_like.uniform_guess, c["WINDOWED"], c["UNIFORM_GUESS"]) == (True, False, True, False)
    assert npu_like._launcher._options == {}


# ------------------------------------------------------------------------------------------------
# The reference against an independent formulation, and the tests' teeth
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world,interleave,block", [(1, 1, 16), (2, 1, 16), (4, 16, 16), (8, 4, 16), (2, 8, 32)])
def test_reference_matches_vllm_generic_formula_when_interleave_divides_block(world, interleave, block):
    batch = make_batch([5, 61, 1, 17], [0, 9, 300, 40], max_blocks=64)
    for rank in range(world):
        ours = torch.full((100,), POISON, dtype=torch.int64)
        theirs = torch.full((100,), POISON, dtype=torch.int64)
        kw = dict(
            block_size=block,
            max_num_tokens=90,
            cp_world_size=world,
            cp_rank=rank,
            cp_kv_cache_interleave_size=interleave,
        )
        slot_mapping_reference(batch.query_start_loc, batch.positions, batch.block_table, ours, **kw)
        vllm_generic_slot_mapping(
            batch.query_start_loc, batch.positions, batch.block_table, theirs, num_reqs=batch.num_reqs, **kw
        )
        assert torch.equal(ours, theirs)


def test_vllm_generic_formula_differs_for_hybrid_blocks_with_large_interleave():
    # 16-token kernel blocks in 64-token pages, interleave 64, 2 ranks: the generic kernel's virtual
    # block (16 * 2) is wrong; the reference follows vllm-ascend #10442 (virtual block 64 * 2).
    batch = make_batch([100], [0], max_blocks=64)
    kw = dict(block_size=16, max_num_tokens=100, cp_world_size=2, cp_rank=0, cp_kv_cache_interleave_size=64)
    ours = torch.zeros(100, dtype=torch.int64)
    theirs = torch.zeros(100, dtype=torch.int64)
    slot_mapping_reference(
        batch.query_start_loc, batch.positions, batch.block_table, ours, physical_block_size=64, **kw
    )
    vllm_generic_slot_mapping(batch.query_start_loc, batch.positions, batch.block_table, theirs, num_reqs=1, **kw)
    assert not torch.equal(ours, theirs)
    # rank 0 owns positions 0..63 and stores them in its first 4 kernel blocks
    assert torch.equal(ours[:64], batch.block_table[0, torch.arange(64) // 16].long() * 16 + torch.arange(64) % 16)


@requires_kernels
def test_a_wrong_block_table_entry_is_detected(dev):
    """The comparison has teeth: one changed block id changes exactly the tokens in that block."""
    batch = make_batch([40], [0], max_blocks=8)
    good_k, good_r = run_pair(batch, dev, block_size=16)
    batch.block_table[0, 1] += 1
    bad_k, _ = run_pair(batch, dev, block_size=16)
    changed = (good_k != bad_k).nonzero().flatten().tolist()
    assert changed == list(range(16, 32))
    assert not torch.equal(bad_k, good_r)


def test_reference_edges():
    """The reference on its own edges: a one-entry block table read only where a token is valid (padding and a
    token past the row never index it), ``num_reqs`` taken from ``query_start_loc`` (trailing tokens pad), block
    numbers whose slots pass 2**31 (int64 arithmetic), and a block table stride that is not the table's."""
    table = torch.tensor([[5]], dtype=torch.int32)
    out = torch.full((4,), POISON, dtype=torch.int64)
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    slot_mapping_reference(qsl, torch.tensor([3, 16, 0]), table, out, block_size=16, max_num_tokens=4)
    assert out.tolist() == [5 * 16 + 3, PAD_SLOT_ID, PAD_SLOT_ID, PAD_SLOT_ID]

    no_request = torch.zeros(0, dtype=torch.int32)
    slot_mapping_reference(no_request, torch.zeros(0, dtype=torch.int64), table, out, block_size=16, max_num_tokens=3)
    assert out[:3].tolist() == [PAD_SLOT_ID] * 3

    big = torch.tensor([[2**28, 3]], dtype=torch.int32)
    out = torch.zeros(2, dtype=torch.int64)
    slot_mapping_reference(qsl, torch.tensor([1, 17]), big, out, block_size=16, max_num_tokens=2, num_reqs=1)
    assert out.tolist() == [2**32 + 1, 3 * 16 + 1]

    batch = make_batch([7, 150, 40], [0, 20, 64], max_blocks=96)
    for block, interleave in ((16, 64), (8, 16)):  # no physical block size: the lcm of the two
        outs = []
        for physical in (None, math.lcm(block, interleave)):
            outs.append(torch.zeros(batch.num_tokens, dtype=torch.int64))
            slot_mapping_reference(
                batch.query_start_loc,
                batch.positions,
                batch.block_table,
                outs[-1],
                block_size=block,
                max_num_tokens=0,
                physical_block_size=physical,
                cp_world_size=2,
                cp_rank=1,
                cp_kv_cache_interleave_size=interleave,
            )
        assert torch.equal(*outs)

    last = torch.tensor([2**31 - 1])  # the last position in range: block 1 of blocks of 2**30 tokens
    one = torch.tensor([0, 1], dtype=torch.int32)
    slot_mapping_reference(one, last, big, out, block_size=2**30, max_num_tokens=1)
    assert out[0] == 3 * 2**30 + 2**30 - 1

    with pytest.raises(ValueError, match="block_table_stride"):
        slot_mapping_reference(
            qsl, torch.tensor([1, 2]), big, out, block_size=16, max_num_tokens=2, block_table_stride=3
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="two device types: runs on the CUDA machine")
@pytest.mark.parametrize("inputs,table,out", [("cpu", "cpu", "cuda"), ("cuda", "cpu", "cpu"), ("cpu", "cuda", "cpu")])
def test_reference_across_devices(inputs, table, out):
    """The reference computes on ``slot_mapping``'s device whatever devices its inputs and block table are on."""
    batch = make_batch([7, 150, 1, 40], [0, 20, 500, 64], max_blocks=96)
    want = torch.full((batch.num_tokens + 5,), POISON, dtype=torch.int64)
    got = want.clone().to(out)
    cfg = dict(block_size=16, max_num_tokens=batch.num_tokens + 5, cp_world_size=2, cp_rank=1)
    slot_mapping_reference(batch.query_start_loc, batch.positions, batch.block_table, want, **cfg)
    q, p = batch.query_start_loc.to(inputs), batch.positions.to(inputs)
    slot_mapping_reference(q, p, batch.block_table.to(table), got, **cfg)
    assert torch.equal(got.cpu(), want)


def test_reference_differs_from_cp_oblivious_variant():
    batch = make_batch([30], [0])
    a = torch.zeros(30, dtype=torch.int64)
    b = torch.zeros(30, dtype=torch.int64)
    slot_mapping_reference(
        batch.query_start_loc,
        batch.positions,
        batch.block_table,
        a,
        block_size=16,
        max_num_tokens=30,
        cp_world_size=2,
        cp_rank=1,
    )
    slot_mapping_reference(
        batch.query_start_loc, batch.positions, batch.block_table, b, block_size=16, max_num_tokens=30
    )
    assert not torch.equal(a, b)
    assert (a[::2] == PAD_SLOT_ID).all() and (a[1::2] != PAD_SLOT_ID).all()


def test_invalid_configs_are_rejected():
    bt = torch.zeros(4, 8, dtype=torch.int32)
    out = torch.zeros(16, dtype=torch.int64)
    with pytest.raises(ValueError, match="divide the physical"):
        kernels.slot_mapper(bt, out, block_size=16, max_num_tokens=8, physical_block_size=24)
    with pytest.raises(ValueError, match="interleave"):
        kernels.slot_mapper(
            bt,
            out,
            block_size=16,
            max_num_tokens=8,
            physical_block_size=32,
            dcp_world_size=2,
            cp_kv_cache_interleave_size=48,
        )
    with pytest.raises(ValueError, match="int32"):
        kernels.slot_mapper(bt.long(), out, block_size=16, max_num_tokens=8)
    with pytest.raises(ValueError, match="max_num_tokens"):
        kernels.slot_mapper(bt, out, block_size=16, max_num_tokens=17)
    with pytest.raises(ValueError, match="rank"):
        kernels.slot_mapper(bt, out, block_size=16, max_num_tokens=8, dcp_world_size=2, dcp_rank=2)


# ------------------------------------------------------------------------------------------------
# Hypothesis
# ------------------------------------------------------------------------------------------------
@st.composite
def slot_cases(draw):
    block = draw(st.sampled_from([1, 4, 16, 32]))
    k = draw(st.sampled_from([1, 1, 2, 4]))
    physical = block * k
    world = draw(st.sampled_from([1, 1, 2, 4, 8]))
    rank = draw(st.integers(0, world - 1))
    interleave = draw(
        st.sampled_from(sorted({d for d in (1, block, physical, max(1, physical // 2)) if physical % d == 0}))
    )
    num_reqs = draw(st.integers(0, 9))
    lens = draw(st.lists(st.one_of(st.integers(0, 6), st.integers(1, 90)), min_size=num_reqs, max_size=num_reqs))
    starts = draw(st.lists(st.integers(0, 400), min_size=num_reqs, max_size=num_reqs))
    shuffle = draw(st.booleans()) and draw(st.booleans())
    max_local = max([s + n for s, n in zip(starts, lens)] + [1])
    needed = math.ceil(max_local / world / block) + k + 1
    max_blocks = draw(st.sampled_from([needed, needed + 7, max(1, needed // 2)]))  # sometimes too short
    extra = draw(st.integers(0, 60))
    max_num_tokens = draw(st.sampled_from([sum(lens) + extra, max(0, sum(lens) - 3)]))
    shape = dict(
        tile=draw(st.sampled_from([16, 32, 64])),
        max_programs=draw(st.integers(1, 4)),
        windowed=draw(st.booleans()),
        uniform_guess=draw(st.booleans()),
    )
    out_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    seed = draw(st.integers(0, 2**16))
    return dict(
        block=block,
        physical=physical,
        world=world,
        rank=rank,
        interleave=interleave,
        lens=lens,
        starts=starts,
        shuffle=shuffle,
        max_blocks=max_blocks,
        max_num_tokens=max_num_tokens,
        shape=shape,
        out_dtype=out_dtype,
        seed=seed,
    )


@requires_kernels
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=slot_cases())
def test_hypothesis_kernel_equals_reference(case):
    dev = KERNEL_DEVICE
    batch = make_batch(
        case["lens"], case["starts"], max_blocks=case["max_blocks"], seed=case["seed"], shuffle=case["shuffle"]
    )
    out_k, out_r = run_pair(
        batch,
        dev,
        out_dtype=case["out_dtype"],
        max_num_tokens=case["max_num_tokens"],
        shape=case["shape"],
        block_size=case["block"],
        physical_block_size=case["physical"],
        dcp_world_size=case["world"],
        dcp_rank=case["rank"],
        cp_kv_cache_interleave_size=case["interleave"],
    )
    assert_same(out_k, out_r)


def test_vllm_generic_formula_defaults_to_no_context_parallelism():
    bt = torch.arange(32, dtype=torch.int32).reshape(4, 8)
    qsl, pos = torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([0, 5, 1])
    generic, ours = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    vllm_generic_slot_mapping(qsl, pos, bt, generic, block_size=4, max_num_tokens=6, num_reqs=2)
    slot_mapping_reference(qsl, pos, bt, ours, block_size=4, max_num_tokens=6, num_reqs=2)
    assert generic.tolist() == ours.tolist() == [0, 5, 33, -1, -1, -1, 0, 0]
