"""The `slot-mapping-kernel` patch (adapter ascend-0.19-0.25) gives the same slot mapping as the release's own
`BlockTable.compute_slot_mapping` on real BlockTable / MultiGroupBlockTable objects, for random batches,
hybrid block sizes and context-parallel settings; and unpatch restores the exact original.

Both sides run Triton under TRITON_INTERPRET=1 on CPU tensors: the release's path launches vLLM's generic
`_compute_slot_mapping_kernel` (CP off) or, from #10442 on (0.21.0rc1 sdist, 0.22.1rc1+), its torch CP routine
(CP on); the patched path launches zb-patch's kernel.

Releases before #10442 (0.19.1rc1 .. 0.21.0rc1 wheels) run vLLM's generic kernel with CP too. Where the CP
interleave size does not divide the kernel block size (hybrid blocks, e.g. physical 128 / kernel 16 with
interleave 128) that kernel's "virtual block" is wrong (vllm-ascend #10442); there the patch must give #10442's
answer (zb_patch.kernels.reference, vllm-ascend's virtual-physical-block formula), and the release must be
seen to differ from it (docs/releases/ascend-0.19-0.25.md section 5 item 2)."""

from __future__ import annotations

import random

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
if npu_standin.detect_family() != "0.23":
    pytest.skip(
        f"the slot-mapping patch targets vllm-ascend 0.19.1rc1-0.25.1rc1; this env has {npu_standin.detect_family()}",
        allow_module_level=True,
    )

import torch  # noqa: E402

from zb_patch import registry as R  # noqa: E402
from zb_patch.detect import detect  # noqa: E402
from zb_patch.versions import by_id  # noqa: E402

ADAPTER = by_id("ascend-0.19-0.25")
TARGET = "vllm_ascend.worker.block_table:BlockTable.compute_slot_mapping"
MAX_TOKENS = 640
MAX_REQS = 8


def _table(physical, kernel, cp=None, max_blocks=24):
    from vllm_ascend.worker.block_table import BlockTable

    bt = BlockTable(
        physical,
        MAX_REQS,
        max_blocks,
        MAX_TOKENS,
        False,
        torch.device("cpu"),
        kernel_sizes=[kernel],
        cp_kv_cache_interleave_size=(cp or {}).get("interleave", 1),
    )
    if cp:  # a rank of a CP group: the method reads these attributes at call time
        if _has_pcp():
            bt.pcp_world_size, bt.pcp_rank = cp["pcp"], cp["pcp_rank"]
        bt.dcp_world_size, bt.dcp_rank = cp["dcp"], cp["dcp_rank"]
    return bt


def _batch(rng, bt, physical, cp_world):
    """Random requests: block ids in each row, positions continuing from a random computed prefix."""
    num_reqs = rng.randint(1, MAX_REQS)
    cap = bt.max_num_blocks_per_req * physical * cp_world  # tokens a row can address
    lens, starts = [], []
    budget = MAX_TOKENS
    for _ in range(num_reqs):
        n = rng.randint(1, max(1, min(budget - (num_reqs - len(lens) - 1), 200)))
        budget -= n
        start = rng.randint(0, cap - n)
        lens.append(n)
        starts.append(start)
    rows = []
    for r in range(num_reqs):
        nblk = -(-(starts[r] + lens[r]) // (physical * cp_world))
        rows.append([rng.randint(1, 5000) for _ in range(nblk)])
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    positions = [s + i for s, n in zip(starts, lens) for i in range(n)]
    return num_reqs, rows, torch.tensor(qsl, dtype=torch.int32), torch.tensor(positions, dtype=torch.int64)


def _fill(bt, rows):
    for r, ids in enumerate(rows):
        bt.add_row(ids, r)
    bt.block_table.gpu.copy_(bt.block_table.cpu)  # commit_block_table pins memory (no accelerator here)


def _run(bt, num_reqs, qsl, positions, cp):
    bt.slot_mapping.gpu.fill_(12345)
    bt.slot_mapping.cpu.fill_(12345)
    bt.compute_slot_mapping(num_reqs, qsl, positions)
    n = positions.shape[0]
    if cp:
        # #10442's CP routine writes the .cpu half when the indices are CPU tensors (always, here) and only
        # [:num_tokens]; vLLM's kernel (releases before #10442) and zb-patch's kernel write the device buffer.
        return bt.slot_mapping.cpu[:n].clone() if _has_10442() and not _patched() else bt.slot_mapping.gpu[:n].clone()
    return bt.slot_mapping.gpu[:MAX_TOKENS].clone()


def _patched():
    return R.resolve(TARGET).patched_by is not None


def _has_10442():
    """#10442's torch CP routine (renamed _compute_dcp_slot_mapping when 0.25.1rc1 dropped PCP)."""
    from vllm_ascend.worker.block_table import BlockTable

    return bool({"_compute_pcp_dcp_slot_mapping", "_compute_dcp_slot_mapping"} & set(BlockTable.__dict__))


def _has_pcp():
    """Whether the release's block table has prefill context parallelism (0.25.1rc1 keeps DCP only)."""
    from vllm_ascend.worker.block_table import BlockTable

    return "_compute_pcp_dcp_slot_mapping" in BlockTable.__dict__ or not _has_10442()


def _answer_10442(bt, num_reqs, qsl, positions, cp):
    """#10442's slot mapping for this CP rank (pure torch, vllm-ascend's virtual-physical-block formula)."""
    from zb_patch.kernels.reference import slot_mapping_reference

    n = positions.shape[0]
    out = torch.full((n,), 12345, dtype=torch.int64)
    slot_mapping_reference(
        qsl,
        positions,
        bt.block_table.gpu,
        out,
        block_size=bt.block_size,
        max_num_tokens=n,
        num_reqs=num_reqs,
        physical_block_size=bt.physical_block_size,
        cp_world_size=cp["pcp"] * cp["dcp"],
        cp_rank=cp["dcp"] * cp["pcp_rank"] + cp["dcp_rank"],
        cp_kv_cache_interleave_size=cp["interleave"],
    )
    return out


@pytest.fixture
def patch_set(cpu_worker):
    ps = ADAPTER.patch_set
    yield ps
    ps.unpatch()


CONFIGS = [
    pytest.param(16, 16, None, id="bs16"),
    pytest.param(128, 128, None, id="bs128"),
    pytest.param(128, 16, None, id="hybrid-128/16"),
    pytest.param(64, 32, None, id="hybrid-64/32"),
    pytest.param(16, 16, {"pcp": 1, "pcp_rank": 0, "dcp": 2, "dcp_rank": 1, "interleave": 1}, id="dcp2-i1"),
    pytest.param(16, 16, {"pcp": 2, "pcp_rank": 1, "dcp": 2, "dcp_rank": 0, "interleave": 16}, id="pcp2dcp2-i16"),
    pytest.param(128, 16, {"pcp": 1, "pcp_rank": 0, "dcp": 4, "dcp_rank": 3, "interleave": 128}, id="hybrid-dcp4-i128"),
    pytest.param(64, 64, {"pcp": 2, "pcp_rank": 1, "dcp": 4, "dcp_rank": 2, "interleave": 1}, id="cp8-i1"),
]


@pytest.mark.parametrize("physical,kernel,cp", CONFIGS)
def test_patched_equals_release_on_random_batches(patch_set, physical, kernel, cp):
    if cp and cp["pcp"] > 1 and not _has_pcp():
        pytest.skip("this release's block table has no PCP (DCP only): a PCP rank does not exist here")
    rng = random.Random(physical * 1000 + kernel + (0 if not cp else cp["dcp"] * 10 + cp["pcp"]))
    world = 1 if not cp else cp["pcp"] * cp["dcp"]
    original = R.resolve(TARGET).raw
    # releases before #10442 run vLLM's generic kernel with CP: right where the interleave size divides the
    # kernel block size, wrong elsewhere; there the patch gives #10442's answer
    release_wrong = bool(cp) and not _has_10442() and kernel % cp["interleave"] != 0
    cases, release_differs = [], []
    for _ in range(6):
        ref_bt = _table(physical, kernel, cp)
        batch = _batch(rng, ref_bt, physical, world)
        _fill(ref_bt, batch[1])
        expected = _run(ref_bt, batch[0], batch[2], batch[3], cp)
        if cp and not _has_10442():
            fixed = _answer_10442(ref_bt, batch[0], batch[2], batch[3], cp)
            release_differs.append(not torch.equal(expected, fixed))
            expected = fixed
        cases.append((batch, expected))
    if cp and not _has_10442():
        # right where the interleave divides the kernel block, and seen to be wrong elsewhere
        assert any(release_differs) if release_wrong else not any(release_differs), release_differs
    report = patch_set.apply(detect())
    assert report.verdict == R.APPLIED, report.reason
    assert R.resolve(TARGET).raw is not original
    for (num_reqs, rows, qsl, positions), expected in cases:
        bt = _table(physical, kernel, cp)
        _fill(bt, rows)
        got = _run(bt, num_reqs, qsl, positions, cp)
        assert torch.equal(got, expected), (num_reqs, qsl.tolist())
        if cp:  # the kernel also pads the device tail
            assert bool((bt.slot_mapping.gpu[positions.shape[0] : MAX_TOKENS] == -1).all())
    patch_set.unpatch()
    assert R.resolve(TARGET).raw is original


def test_multi_group_block_table_goes_through_the_patch(patch_set):
    from vllm_ascend.worker.block_table import MultiGroupBlockTable

    rng = random.Random(7)

    def build():
        return MultiGroupBlockTable(
            MAX_REQS, 1024, MAX_TOKENS, False, torch.device("cpu"), [16, 64], kernel_sizes=[[16], [32]]
        )

    ref = build()
    rows16 = [[rng.randint(1, 900) for _ in range(8)] for _ in range(3)]
    rows64 = [[rng.randint(1, 900) for _ in range(2)] for _ in range(3)]
    qsl = torch.tensor([0, 5, 6, 40], dtype=torch.int32)
    positions = torch.tensor(list(range(3, 8)) + [100] + list(range(60, 94)), dtype=torch.int64)

    def fill(mg):
        for r in range(3):
            mg.add_row((rows16[r], rows64[r]), r)
        for bt in mg.block_tables:
            bt.block_table.gpu.copy_(bt.block_table.cpu)

    fill(ref)
    ref.compute_slot_mapping(3, qsl, positions)
    expected = [bt.slot_mapping.gpu[:MAX_TOKENS].clone() for bt in ref.block_tables]
    assert patch_set.apply(detect()).verdict == R.APPLIED
    mg = build()
    fill(mg)
    for bt in mg.block_tables:
        bt.slot_mapping.gpu.fill_(12345)
    mg.compute_slot_mapping(3, qsl, positions)
    for bt, exp in zip(mg.block_tables, expected):
        assert "_zb_slot_mapper" in bt.__dict__  # every group went through the patched method
        assert torch.equal(bt.slot_mapping.gpu[:MAX_TOKENS], exp)


def test_disabled_patch_is_not_applied(patch_set):
    original = R.resolve(TARGET).raw
    report = patch_set.apply(detect(), disabled={"slot-mapping-kernel"})
    assert report.by_verdict(R.DISABLED) == ["slot-mapping-kernel"]
    assert R.resolve(TARGET).raw is original


def test_one_mapper_per_block_table_across_steps(patch_set):
    """The launcher (its buffers, its compiled launch) is built at a table's first step and reused at every later
    one; another table gets its own."""
    rng = random.Random(11)
    steps = []
    for _ in range(3):
        ref_bt = _table(16, 16)
        batch = _batch(rng, ref_bt, 16, 1)
        _fill(ref_bt, batch[1])
        steps.append((batch, _run(ref_bt, batch[0], batch[2], batch[3], None)))
    assert patch_set.apply(detect()).verdict == R.APPLIED
    bt, other = _table(16, 16), _table(16, 16)
    mappers = []
    for (num_reqs, rows, qsl, positions), expected in steps:
        _fill(bt, rows)
        assert torch.equal(_run(bt, num_reqs, qsl, positions, None), expected)
        mappers.append(bt.__dict__["_zb_slot_mapper"])
    assert all(m is mappers[0] for m in mappers), "a new launcher was built for a table that had one"
    _fill(other, steps[0][0][1])
    _run(other, *(steps[0][0][i] for i in (0, 2, 3)), None)
    assert other.__dict__["_zb_slot_mapper"] is not mappers[0]


def test_an_interleave_that_does_not_divide_the_physical_block_is_refused(patch_set):
    """With context parallelism the kernel's formula holds where the interleave size divides the physical block
    (vLLM's own condition): the patched method reads the table's physical block size and refuses the rest by name
    at the first step instead of writing slots it cannot compute."""
    if not _has_pcp():
        cp = {"pcp": 1, "pcp_rank": 0, "dcp": 2, "dcp_rank": 1, "interleave": 64}
    else:
        cp = {"pcp": 2, "pcp_rank": 1, "dcp": 1, "dcp_rank": 0, "interleave": 64}
    assert patch_set.apply(detect()).verdict == R.APPLIED
    bt = _table(32, 32, cp)
    num_reqs, rows, qsl, positions = _batch(random.Random(3), bt, 32, 2)
    _fill(bt, rows)
    with pytest.raises(ValueError, match="cp_kv_cache_interleave_size"):
        bt.compute_slot_mapping(num_reqs, qsl, positions)
