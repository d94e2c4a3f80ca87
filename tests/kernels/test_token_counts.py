"""Token-count correction kernel (+ fused positions / seq_lens) == pure-torch reference, exactly."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_env import KERNEL_DEVICE, examples, requires_kernels

from zb_patch import kernels
from zb_patch.kernels.reference import token_counts_reference, vllm_update_num_computed_tokens_for_batch_change

POISON = -999


@dataclass
class Step:
    """Inputs of one step's correction, laid out like the runner's buffers."""

    num_computed: torch.Tensor  # int32 [max_reqs]  (device state after the previous step)
    num_accepted: torch.Tensor  # [max_reqs]
    prev_positions: torch.Tensor  # int64 [num_reqs]
    valid_count: torch.Tensor | None  # [num_prev]
    prev_drafts: torch.Tensor  # int32 [max_reqs]
    cpu_computed: torch.Tensor  # int32 [num_reqs]
    num_scheduled: torch.Tensor  # int32 [num_reqs]
    max_reqs: int
    pad_tokens: int = 3
    extra: dict = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return self.prev_positions.numel()

    def token_layout(self):
        sched = self.num_scheduled.long()
        n_tok = int(sched.sum())
        req = torch.repeat_interleave(torch.arange(self.num_reqs), sched)
        qpos = torch.cat([torch.arange(int(s)) for s in sched]) if self.num_reqs else torch.zeros(0, dtype=torch.int64)
        size = n_tok + self.pad_tokens + 4
        req_buf = torch.full((size,), 0, dtype=torch.int64)
        qpos_buf = torch.full((size,), 0, dtype=torch.int64)
        req_buf[:n_tok], qpos_buf[:n_tok] = req, qpos
        return n_tok, req_buf, qpos_buf


def run_pair(
    step: Step,
    dev: str | None,
    *,
    correct=True,
    with_accepted=True,
    with_positions=True,
    num_prev_reqs=None,
    tiles=None,
    base="previous",
):
    """Run the kernel (dev) and the reference (CPU) on copies; return both states as dicts."""
    n_tok, req_buf, qpos_buf = step.token_layout()
    num_positions = n_tok + step.pad_tokens

    def state(device):
        return dict(
            num_computed=step.num_computed.clone().to(device),
            num_accepted=step.num_accepted.clone().to(device),
            seq_lens=torch.full((step.max_reqs,), POISON, dtype=torch.int32, device=device),
            positions=torch.full((num_positions + 4,), POISON, dtype=torch.int64, device=device),
        )

    def call(fn, s, device, **extra):
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        fn(
            s["num_computed"],
            s["num_accepted"] if with_accepted else None,
            to(step.prev_positions) if correct else None,
            to(step.valid_count) if correct else None,
            to(step.prev_drafts) if correct else None,
            to(step.cpu_computed),
            to(step.num_scheduled),
            s["seq_lens"],
            num_reqs=step.num_reqs,
            req_indices=to(req_buf) if with_positions else None,
            query_pos=to(qpos_buf) if with_positions else None,
            positions=s["positions"] if with_positions else None,
            num_tokens=n_tok,
            num_positions=num_positions,
            num_prev_reqs=num_prev_reqs,
            base=base,
            **extra,
        )

    ref = state("cpu")
    call(token_counts_reference, ref, "cpu")
    if dev is None:
        return None, ref
    ker = state(dev)
    call(kernels.update_token_counts, ker, dev, **({"tiles": tiles} if tiles else {}))
    return {k: v.cpu() for k, v in ker.items()}, ref


def assert_same(ker, ref):
    for name in ref:
        if not torch.equal(ker[name], ref[name]):
            bad = (ker[name] != ref[name]).nonzero().flatten()[:8].tolist()
            raise AssertionError(
                f"{name}: kernel != reference at {bad}: {ker[name][bad].tolist()} vs {ref[name][bad].tolist()}"
            )


def make_step(
    prev_positions,
    valid,
    drafts,
    *,
    nc_before=None,
    cpu=None,
    sched=None,
    max_reqs=None,
    accepted_dtype=torch.int32,
    valid_dtype=torch.int64,
    seed=0,
):
    g = torch.Generator().manual_seed(seed)
    n = len(prev_positions)
    max_reqs = max_reqs or max(n, len(valid), len(drafts)) + 3
    nc = torch.randint(10, 500, (max_reqs,), dtype=torch.int32, generator=g)
    if nc_before is not None:
        nc[: len(nc_before)] = torch.tensor(nc_before, dtype=torch.int32)
    drafts_buf = torch.zeros(max_reqs, dtype=torch.int32)
    drafts_buf[: len(drafts)] = torch.tensor(drafts, dtype=torch.int32)
    return Step(
        num_computed=nc,
        num_accepted=torch.randint(1, 5, (max_reqs,), dtype=accepted_dtype, generator=g),
        prev_positions=torch.tensor(prev_positions, dtype=torch.int64),
        valid_count=None if valid is None else torch.tensor(valid, dtype=valid_dtype),
        prev_drafts=drafts_buf,
        cpu_computed=torch.tensor(cpu, dtype=torch.int32)
        if cpu is not None
        else torch.randint(100, 900, (n,), dtype=torch.int32, generator=g),
        num_scheduled=torch.tensor(sched, dtype=torch.int32)
        if sched is not None
        else torch.randint(1, 5, (n,), dtype=torch.int32, generator=g),
        max_reqs=max_reqs,
    )


# ------------------------------------------------------------------------------------------------
# Scenarios of a real batch change
# ------------------------------------------------------------------------------------------------
SCENARIOS = {
    # prev batch [a b c d], drafts 3 each; current [a b c d] unchanged
    "steady-all-accepted": ([0, 1, 2, 3], [4, 4, 4, 4], [3, 3, 3, 3]),
    "steady-none-accepted": ([0, 1, 2, 3], [1, 1, 1, 1], [3, 3, 3, 3]),
    "steady-partial": ([0, 1, 2, 3], [1, 2, 4, 3], [3, 3, 3, 3]),
    # new requests appended (prev -1)
    "new-requests": ([0, 1, -1, -1], [2, 3], [2, 2]),
    # b finished, batch condensed: [a c d] came from rows [0 2 3]
    "finished-condensed": ([0, 2, 3], [2, 1, 3, 4], [3, 3, 3, 3]),
    # reordered (swap / permutation): reads rows that other rows overwrite -> in-place hazard
    "reordered": ([3, 2, 1, 0], [1, 2, 3, 4], [3, 3, 3, 3]),
    # prefills (no drafts last step) do not participate
    "prefill-no-drafts": ([0, 1, 2], [5, 6, 7], [0, 2, 0]),
    # stale previous rows beyond the previous batch (upstream hardening)
    "stale-prev-rows": ([-1, 3, 1], [2, 4, 6], [1, 1, 1]),
    # nothing to gather from
    "empty-counts": ([0, 1, -1], [], [2, 2]),
    "empty-batch": ([], [1, 2], [1, 1]),
    "one-request": ([0], [2], [1]),
}


@requires_kernels
@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("tiles", [None, (4, 4)], ids=["default-tiles", "tiny-tiles"])
def test_scenarios(dev, name, tiles):
    prev, valid, drafts = SCENARIOS[name]
    step = make_step(prev, valid, drafts, seed=zlib.crc32(name.encode()))
    assert_same(*run_pair(step, dev, tiles=tiles))


@requires_kernels
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenarios_cpu_base(dev, name):
    """base "cpu": the kernel equals the reference, and the reference equals the documented semantics computed one
    row at a time (this step's CPU count minus the rejected drafts where the row participates)."""
    prev, valid, drafts = SCENARIOS[name]
    step = make_step(prev, valid, drafts, seed=zlib.crc32(name.encode()))
    ker, ref = run_pair(step, dev, base="cpu", tiles=(4, 4))
    assert_same(ker, ref)
    want_nc, want_acc = step.num_computed.tolist(), step.num_accepted.tolist()
    for r, p in enumerate(prev):
        want_nc[r] = int(step.cpu_computed[r])
        if 0 <= p < len(valid) and int(step.prev_drafts[p]) > 0:
            want_nc[r] -= int(step.prev_drafts[p]) + 1 - valid[p]
            want_acc[r] = valid[p]
    assert (ref["num_computed"].tolist(), ref["num_accepted"].tolist()) == (want_nc, want_acc)


def test_upstream_hardening_example_values():
    # values of upstream's test_batch_change_ignores_out_of_range_previous_rows
    nc = torch.tensor([10, 20, 30], dtype=torch.int32)
    acc = torch.tensor([7, 8, 9], dtype=torch.int32)
    seq = torch.zeros(3, dtype=torch.int32)
    token_counts_reference(
        nc,
        acc,
        torch.tensor([-1, 3, 1]),
        torch.tensor([2, 4, 6], dtype=torch.int32),
        torch.tensor([1, 1, 1], dtype=torch.int32),
        torch.tensor([100, 200, 300], dtype=torch.int32),
        torch.tensor([1, 1, 1], dtype=torch.int32),
        seq,
        num_reqs=3,
    )
    assert nc.tolist() == [100, 200, 24]
    assert acc.tolist() == [7, 8, 4]
    assert seq.tolist() == [101, 201, 25]


@requires_kernels
def test_upstream_hardening_example_values_kernel(dev):
    nc = torch.tensor([10, 20, 30], dtype=torch.int32, device=dev)
    acc = torch.tensor([7, 8, 9], dtype=torch.int32, device=dev)
    seq = torch.zeros(3, dtype=torch.int32, device=dev)
    kernels.update_token_counts(
        nc,
        acc,
        torch.tensor([-1, 3, 1], device=dev),
        torch.tensor([2, 4, 6], dtype=torch.int32, device=dev),
        torch.tensor([1, 1, 1], dtype=torch.int32, device=dev),
        torch.tensor([100, 200, 300], dtype=torch.int32, device=dev),
        torch.tensor([1, 1, 1], dtype=torch.int32, device=dev),
        seq,
        num_reqs=3,
    )
    assert nc.cpu().tolist() == [100, 200, 24]
    assert acc.cpu().tolist() == [7, 8, 4]


@requires_kernels
@pytest.mark.parametrize("with_accepted", [True, False])
@pytest.mark.parametrize("with_positions", [True, False])
@pytest.mark.parametrize("correct", [True, False], ids=["async", "copy-cpu"])
def test_flag_combinations(dev, correct, with_accepted, with_positions):
    step = make_step([2, 0, -1, 1, 5], [3, 1, 2, 4], [2, 0, 3, 3], seed=3)
    assert_same(*run_pair(step, dev, correct=correct, with_accepted=with_accepted, with_positions=with_positions))


@requires_kernels
@pytest.mark.parametrize("accepted_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("valid_dtype", [torch.int32, torch.int64])
def test_dtypes(dev, accepted_dtype, valid_dtype):
    step = make_step([1, 0, 2], [3, 1, 2], [2, 2, 2], accepted_dtype=accepted_dtype, valid_dtype=valid_dtype)
    assert_same(*run_pair(step, dev))


@requires_kernels
def test_num_prev_reqs_bounds_participation(dev):
    # the previous batch had 2 rows although the count buffer has 4: row 3 is stale
    step = make_step([0, 1, 3], [2, 2, 2, 2], [1, 1, 1, 1])
    ker, ref = run_pair(step, dev, num_prev_reqs=2)
    assert_same(ker, ref)
    assert ref["num_computed"][2] == step.cpu_computed[2]


@requires_kernels
def test_many_rows_in_place_permutation_multi_tile(dev):
    # 70 rows, a random permutation of the previous batch, tiles of 8 rows: the read-at-prev /
    # write-at-current hazard crosses tiles in both directions
    g = torch.Generator().manual_seed(7)
    perm = torch.randperm(70, generator=g).tolist()
    step = make_step(perm, torch.randint(1, 5, (70,), generator=g).tolist(), [3] * 70, seed=7)
    assert_same(*run_pair(step, dev, tiles=(8, 16)))


def test_positions_and_seq_lens_semantics():
    step = make_step([0, -1], [2], [1], nc_before=[40], cpu=[7, 11], sched=[2, 3])
    _, ref = run_pair(step, None)
    assert ref["num_computed"][:2].tolist() == [42, 11]
    assert ref["seq_lens"].tolist()[:2] == [44, 14] and (ref["seq_lens"][2:] == 0).all()
    assert ref["positions"][:5].tolist() == [42, 43, 11, 12, 13]
    assert (ref["positions"][5:8] == 0).all() and (ref["positions"][8:] == POISON).all()


def test_reference_agrees_with_unhardened_upstream_semantics_in_range():
    g = torch.Generator().manual_seed(11)
    for trial in range(20):
        n_prev = int(torch.randint(1, 12, (1,), generator=g))
        n = int(torch.randint(0, 12, (1,), generator=g))
        prev = torch.where(torch.rand(n, generator=g) < 0.3, -1, torch.randint(0, n_prev, (n,), generator=g))
        valid = torch.randint(1, 5, (n_prev,), generator=g)
        drafts = torch.randint(0, 4, (16,), dtype=torch.int32, generator=g)
        nc = torch.randint(0, 100, (16,), dtype=torch.int32, generator=g)
        acc = torch.randint(1, 4, (n,), dtype=torch.int32, generator=g)
        cpu = torch.randint(0, 100, (n,), dtype=torch.int32, generator=g)
        a_nc, a_acc = nc.clone(), acc.clone()
        vllm_update_num_computed_tokens_for_batch_change(a_nc, a_acc, prev, valid, drafts, cpu)
        b_nc, b_acc = nc.clone(), acc.clone()
        token_counts_reference(
            b_nc,
            b_acc,
            prev,
            valid,
            drafts,
            cpu,
            torch.ones(n, dtype=torch.int32),
            torch.zeros(16, dtype=torch.int32),
            num_reqs=n,
        )
        assert torch.equal(a_nc, b_nc) and torch.equal(a_acc, b_acc), trial


def test_reference_differs_from_a_wrong_variant():
    """Teeth: reading the *current* row instead of the previous one gives a different answer."""
    step = make_step([1, 0], [3, 2], [2, 2], nc_before=[100, 200], cpu=[0, 0])
    _, ref = run_pair(step, None)
    wrong = step.num_computed.clone()
    wrong[:2] = wrong[:2] + step.valid_count[[1, 0]].int()  # row r read at r, not at prev[r]
    assert ref["num_computed"][:2].tolist() == [202, 103]
    assert not torch.equal(ref["num_computed"], wrong)


# ------------------------------------------------------------------------------------------------
# Hypothesis
# ------------------------------------------------------------------------------------------------
@st.composite
def steps(draw):
    n_prev = draw(st.integers(0, 24))
    n = draw(st.integers(0, 24))
    carried = draw(st.permutations(list(range(n_prev))))[: draw(st.integers(0, min(n, n_prev)))]
    prev = list(carried) + [-1] * (n - len(carried))
    prev = draw(st.permutations(prev)) if prev else prev
    stale = draw(st.lists(st.integers(0, n - 1), max_size=3)) if n else []
    for i in stale:
        prev[i] = n_prev + draw(st.integers(0, 3))
    drafts = draw(st.lists(st.integers(0, 4), min_size=n_prev, max_size=n_prev))
    valid = [draw(st.integers(1, d + 1)) for d in drafts]
    if draw(st.integers(0, 9)) == 0:
        valid = []
    return dict(
        prev=prev,
        valid=valid,
        drafts=drafts,
        seed=draw(st.integers(0, 2**16)),
        tiles=draw(st.sampled_from([None, (4, 8), (16, 4)])),
        correct=draw(st.sampled_from([True, True, False])),
        with_accepted=draw(st.booleans()),
        accepted_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        num_prev_reqs=draw(st.sampled_from([None, None, max(0, n_prev - 1)])),
    )


@requires_kernels
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=steps())
def test_hypothesis_kernel_equals_reference(case):
    step = make_step(
        case["prev"], case["valid"], case["drafts"], seed=case["seed"], accepted_dtype=case["accepted_dtype"]
    )
    assert_same(
        *run_pair(
            step,
            KERNEL_DEVICE,
            correct=case["correct"],
            with_accepted=case["with_accepted"],
            num_prev_reqs=case["num_prev_reqs"],
            tiles=case["tiles"],
        )
    )


# ------------------------------------------------------------------------------------------------
# The prepared (hot-path) form over consecutive steps
# ------------------------------------------------------------------------------------------------
def _runner_buffers(device, max_reqs=48, max_tokens=160):
    z = lambda n, dt: torch.zeros(n, dtype=dt, device=device)  # noqa: E731
    return dict(
        num_computed_tokens=z(max_reqs, torch.int32),
        seq_lens=z(max_reqs, torch.int32),
        num_scheduled_tokens=z(max_reqs, torch.int32),
        prev_positions=z(max_reqs, torch.int64),
        prev_num_draft_tokens=z(max_reqs, torch.int32),
        num_accepted_tokens=z(max_reqs, torch.int32),
        req_indices=z(max_tokens, torch.int64),
        query_pos=z(max_tokens, torch.int64),
        positions=z(max_tokens, torch.int64),
    )


@requires_kernels
@pytest.mark.parametrize("base", ["previous", "cpu"])
@pytest.mark.parametrize("tiles", [None, (8, 16)], ids=["default-tiles", "small-tiles"])
def test_prepared_launcher_over_consecutive_steps(dev, tiles, base):
    """One launcher bound to runner-like buffers, 12 steps of batch changes, state == reference."""
    g = torch.Generator().manual_seed(5)
    kb, rb = _runner_buffers(dev), _runner_buffers("cpu")
    kl = kernels.token_counts_launcher(**kb, base=base, **({"tiles": tiles} if tiles else {}))
    rl = kernels.token_counts_launcher(**rb, base=base)
    prev_n = 0
    for step in range(12):
        n = int(torch.randint(0, 40, (1,), generator=g))
        prev = torch.full((n,), -1, dtype=torch.int64)
        carried = torch.randperm(max(prev_n, 1), generator=g)[: min(n, prev_n)]
        prev[: len(carried)] = carried
        prev = prev[torch.randperm(n, generator=g)]
        sched = torch.randint(1, 5, (n,), dtype=torch.int32, generator=g)
        n_tok = int(sched.sum())
        drafts = torch.randint(0, 4, (prev_n,), dtype=torch.int32, generator=g)
        # steps 0, 4, 8 without valid counts: the copy variant, launched directly from its second step on CUDA
        valid = (torch.randint(0, 5, (prev_n,), generator=g) % (drafts.long() + 1) + 1) if step % 4 else None
        cpu = torch.randint(0, 3000, (n,), dtype=torch.int32, generator=g)
        for b, _d in ((kb, dev), (rb, "cpu")):
            b["prev_positions"][:n].copy_(prev)
            b["prev_num_draft_tokens"][:prev_n].copy_(drafts)
            b["num_scheduled_tokens"][:n].copy_(sched)
            b["req_indices"][:n_tok].copy_(torch.repeat_interleave(torch.arange(n), sched.long()))
            b["query_pos"][:n_tok].copy_(torch.cat([torch.arange(int(k)) for k in sched]) if n else torch.zeros(0))
        kl(n, cpu.to(dev), None if valid is None else valid.to(dev), num_tokens=n_tok, num_positions=n_tok + 2)
        rl(n, cpu, valid, num_tokens=n_tok, num_positions=n_tok + 2)
        for name in rb:
            assert torch.equal(kb[name].cpu(), rb[name]), (step, name)
        prev_n = n
    # every step launched once, through the direct launch (CUDA) or Triton's path
    assert kl.direct_launches + sum(launcher.slow_launches for launcher in kl._launchers.values()) == 12
    if dev == "cuda":  # 2 of the 3 copy steps, 8 of the 9 corrected ones, with slack for a misaligned pointer
        assert kl.direct_launches >= 9


@requires_kernels
def test_every_entry_point_checks_the_base(dev):
    """A base other than "previous" / "cpu" is refused by name where a launcher is built and on each functional
    call, on both paths."""
    from zb_patch.kernels.token_counts import TokenCountsLauncher

    for device in {dev, "cpu"}:
        b = _runner_buffers(device, max_reqs=4, max_tokens=8)
        for bad in ("CPU", "", None):
            with pytest.raises(ValueError, match="^base="):
                kernels.token_counts_launcher(**b, base=bad)
            with pytest.raises(ValueError, match="^base="):
                kernels.update_token_counts(
                    b["num_computed_tokens"], None, None, None, None, b["num_computed_tokens"],
                    b["num_scheduled_tokens"], b["seq_lens"], num_reqs=1, base=bad,
                )  # fmt: skip
    with pytest.raises(ValueError, match="^base="):
        TokenCountsLauncher(**_runner_buffers(dev, max_reqs=4, max_tokens=8), base="host")


def test_the_reference_launcher_keeps_its_base(monkeypatch):
    """CPU tensors without the interpreter get the torch reference's launcher, which corrects from the base it was
    built with (rows whose bases disagree: their previous step scheduled more than 1 + drafts)."""
    monkeypatch.setattr(kernels, "interpret_mode", lambda: False)
    results = {}
    for base in ("previous", "cpu"):
        b = _runner_buffers("cpu", max_reqs=4, max_tokens=8)
        b["num_computed_tokens"][:2] = torch.tensor([10, 20], dtype=torch.int32)  # last step's device counts
        b["prev_positions"][:2] = torch.tensor([1, 0])
        b["prev_num_draft_tokens"][:2] = torch.tensor([2, 2], dtype=torch.int32)
        launch = kernels.token_counts_launcher(**b, base=base)
        assert type(launch).__name__ == "_ReferenceTokenCounts"
        launch(2, torch.tensor([30, 40], dtype=torch.int32), torch.tensor([2, 3]))
        results[base] = b["num_computed_tokens"][:2].tolist()
    # previous: old[prev] + valid[prev] = [20 + 3, 10 + 2]; cpu: cpu - (drafts + 1 - valid[prev]) = [30 - 0, 40 - 1]
    assert results == {"previous": [23, 12], "cpu": [30, 39]}


@requires_kernels
def test_functional_call_without_tokens_leaves_positions_alone(dev):
    """num_tokens and num_positions left out of a functional call: no token, positions is not written."""
    i32 = dict(dtype=torch.int32, device=dev)
    nc, seq, pos = torch.zeros(2, **i32), torch.zeros(2, **i32), torch.full((4,), POISON, dtype=torch.int64, device=dev)
    idx = torch.zeros(4, dtype=torch.int64, device=dev)
    cpu, sched = torch.tensor([5, 6], **i32), torch.ones(2, **i32)
    kernels.update_token_counts(
        nc, None, None, None, None, cpu, sched, seq, num_reqs=2, req_indices=idx, query_pos=idx, positions=pos
    )
    assert seq.cpu().tolist() == [6, 7] and pos.cpu().tolist() == [POISON] * 4


@requires_kernels
def test_prepared_launcher_bounds_the_gather_by_its_buffers(dev):
    """Valid counts longer than the bound prev_num_draft_tokens: a previous row past that buffer does not participate
    (its CPU count is copied), one inside it is corrected."""
    b = _runner_buffers(dev, max_reqs=4, max_tokens=8)
    b["prev_num_draft_tokens"] = torch.tensor([2, 2], dtype=torch.int32, device=dev)
    b["num_computed_tokens"][:] = torch.tensor([10, 20, 30, 40], dtype=torch.int32)
    b["prev_positions"][:2] = torch.tensor([3, 0])
    launch = kernels.token_counts_launcher(**b)
    launch(2, torch.tensor([50, 60], dtype=torch.int32, device=dev), torch.full((4,), 2, device=dev))
    assert b["num_computed_tokens"][:2].cpu().tolist() == [50, 12]


@pytest.mark.parametrize("direct_launch", [None, False])
def test_prepared_launcher_keeps_direct_launch_off_when_asked(dev, monkeypatch, direct_launch):
    """``direct_launch=False`` reaches every kernel variant the prepared launcher builds, where the device would
    allow the direct launch (as if it did, also under the interpreter); the default leaves it to the device."""
    from zb_patch.kernels import _launch

    monkeypatch.setattr(_launch, "_direct_launch_supported", lambda device_type: True)
    launch = kernels.token_counts_launcher(**_runner_buffers(dev), direct_launch=direct_launch)
    assert [launch._launcher(correct).direct_supported for correct in (True, False)] == [direct_launch is None] * 2


def test_prepared_launcher_needs_all_position_buffers():
    b = _runner_buffers("cpu")
    b["query_pos"] = None
    with pytest.raises(ValueError, match="go together"):
        kernels.token_counts_launcher(**b)


@pytest.fixture
def fresh_launchers(monkeypatch):
    """A fresh launcher cache (the module's is filled by earlier tests), and a way to let the launchers take their
    direct-launch bookkeeping on this device (CUDA only in production: pointers keyed by dtype and alignment)."""
    from zb_patch.kernels import _launch
    from zb_patch.kernels import token_counts as tc

    monkeypatch.setattr(tc, "_LAUNCHERS", tc._TokenCountsLaunchers())

    def direct(supported: bool) -> None:
        monkeypatch.setattr(_launch, "_direct_launch_supported", lambda device_type: supported)

    return tc, direct


@requires_kernels
@pytest.mark.parametrize("with_positions", [True, False])
@pytest.mark.parametrize("correct", [True, False], ids=["async", "copy-cpu"])
def test_launch_passes_a_tensor_for_every_buffer(dev, fresh_launchers, correct, with_positions):
    """Absent optional buffers are replaced by a real tensor (the direct launch takes every pointer's data_ptr) and
    the launcher is keyed by each pointer's dtype and alignment; results equal the reference."""
    tc, direct = fresh_launchers
    direct(True)
    step = make_step([2, 0, -1, 1, 5], [3, 1, 2, 4], [2, 0, 3, 3], seed=3)
    assert_same(*run_pair(step, dev, correct=correct, with_accepted=False, with_positions=with_positions))
    (launcher,) = tc._LAUNCHERS._cache.values()
    assert launcher.slow_launches == 1 and len(launcher._direct) == 1
    (key,) = launcher._direct
    assert len(key) == 22 and all(isinstance(d, torch.dtype) for d in key[0::2]) and set(key[1::2]) <= {True, False}


@requires_kernels
def test_partial_correction_inputs_copy_the_cpu_counts(dev):
    """Correction needs previous positions, counts and drafts together; with any of them missing the CPU counts are
    copied (the non-async branch)."""
    i32 = dict(dtype=torch.int32, device=dev)
    cpu, nst = torch.tensor([3, 4], **i32), torch.ones(2, **i32)
    prev, valid = torch.tensor([1, 0], dtype=torch.int64, device=dev), torch.tensor([2, 2], **i32)
    for args in ((prev, None, torch.ones(2, **i32)), (None, valid, torch.ones(2, **i32)), (prev, valid, None)):
        nc, seq = torch.tensor([7, 9], **i32), torch.zeros(2, **i32)
        kernels.update_token_counts(nc, None, *args, cpu, nst, seq, num_reqs=2)
        assert nc.cpu().tolist() == [3, 4] and seq.cpu().tolist() == [4, 5]


@requires_kernels
def test_launchers_are_cached_per_flags_and_shape(fresh_launchers, monkeypatch):
    tc, _ = fresh_launchers
    cache = tc._LAUNCHERS
    a = cache.get("cpu", True, False, True, True, None)
    assert cache.get("cpu", True, False, True, True, None) is a
    assert cache.get("cpu", False, False, False, True, None) is not a
    assert (a._constexprs["REQ_TILE"], a._constexprs["TOK_TILE"]) == tc._default_tiles("cpu")
    b = cache.get("cpu", True, False, False, True, (16, 32))
    assert (b._constexprs["REQ_TILE"], b._constexprs["TOK_TILE"], b._constexprs["HAS_ACCEPTED"]) == (16, 32, False)
    on_cpu = cache.get("cpu", True, True, True, True, None)
    assert on_cpu is not a and (on_cpu._constexprs["BASE_CPU"], a._constexprs["BASE_CPU"]) == (True, False)
    # no correction: one variant, whatever the base
    assert cache.get("cpu", False, True, False, True, None)._constexprs["BASE_CPU"] is False
    from zb_patch.kernels import _launch

    monkeypatch.setattr(_launch, "_interpret", False)  # how a CUDA process builds them (nothing is launched here)
    cuda = cache.get("cuda", True, False, True, True, None)
    assert (cuda._constexprs["REQ_TILE"], cuda._constexprs["TOK_TILE"]) == tc._CUDA_TILES
    assert cuda.direct_supported == _launch._direct_launch_supported("cuda")
    assert cache.get("cuda", True, False, True, True, None, direct=False).direct_supported is False


@requires_kernels
def test_prepared_launcher_checks_its_correction_buffers(dev):
    """The bound previous-row buffers are checked when the launcher is built: a prev_positions shorter than the
    batch bounds num_reqs, a prev_num_draft_tokens of another dtype is rejected."""
    from zb_patch.kernels.token_counts import TokenCountsLauncher

    i32 = dict(dtype=torch.int32, device=dev)
    bufs = dict(num_computed_tokens=torch.zeros(4, **i32), seq_lens=torch.zeros(4, **i32))
    bufs.update(num_scheduled_tokens=torch.ones(4, **i32), prev_num_draft_tokens=torch.zeros(4, **i32))
    short = TokenCountsLauncher(**bufs, prev_positions=torch.zeros(1, dtype=torch.int64, device=dev))
    with pytest.raises(ValueError, match="num_reqs"):
        short(3, torch.zeros(3, **i32), torch.ones(3, **i32))
    bufs["prev_num_draft_tokens"] = torch.zeros(4, dtype=torch.float32, device=dev)
    with pytest.raises(ValueError, match="prev_num_draft_tokens"):
        TokenCountsLauncher(**bufs, prev_positions=torch.zeros(4, dtype=torch.int64, device=dev))
    # without both previous-row buffers the launcher cannot correct: given counts, it copies the CPU counts
    del bufs["prev_num_draft_tokens"]
    prev = torch.tensor([1, 0, 0, 0], dtype=torch.int64, device=dev)
    for launcher in (TokenCountsLauncher(**bufs), TokenCountsLauncher(**bufs, prev_positions=prev)):
        bufs["num_computed_tokens"].fill_(9)
        launcher(2, torch.tensor([3, 4], **i32), torch.tensor([2, 2], **i32))
        assert bufs["num_computed_tokens"].cpu().tolist() == [3, 4, 9, 9] and not launcher.can_correct


@requires_kernels
@pytest.mark.parametrize("short", ["drafts", "computed"])
def test_gather_is_bounded_by_every_previous_row_buffer(dev, short):
    """Counts for 6 previous rows, but the drafts / device counts buffer holds fewer: a previous row past it never
    participates (the short buffers are views of longer ones, so a read past their end would find drafts / counts)."""
    i32 = dict(dtype=torch.int32)
    nc_full, drafts_full = torch.tensor([10, 20, 30, 40, 50, 60], **i32), torch.tensor([1, 1, 5, 5, 5, 5], **i32)
    nc_len, drafts_len = (6, 2) if short == "drafts" else (3, 6)
    prev, valid = torch.tensor([4, 1, -1]), torch.full((6,), 2, **i32)
    cpu, nst = torch.tensor([7, 8, 9], **i32), torch.ones(3, **i32)
    got = []
    for fn, device in ((token_counts_reference, "cpu"), (kernels.update_token_counts, dev)):
        nc_all, drafts_all = nc_full.clone().to(device), drafts_full.clone().to(device)
        nc, seq = nc_all[:nc_len], torch.zeros(3, **i32).to(device)
        fn(
            nc,
            None,
            prev.to(device),
            valid.to(device),
            drafts_all[:drafts_len],
            cpu.to(device),
            nst.to(device),
            seq,
            num_reqs=3,
        )
        got.append(nc[:3].cpu().tolist())
    assert got[0] == got[1] == [7, 22, 9]


def _naive_token_counts(
    nc,
    acc,
    prev,
    valid,
    drafts,
    cpu,
    sched,
    seq_lens,
    positions,
    *,
    num_reqs,
    req=None,
    qpos=None,
    num_tokens=0,
    num_positions=None,
    num_prev_reqs=None,
    base="previous",
):
    """The documented semantics (zb_patch.kernels.token_counts) one element at a time, on Python lists."""
    n, old = num_reqs, nc.tolist()
    new_nc, new_acc = list(old), None if acc is None else acc.tolist()
    for r in range(n):
        new_nc[r] = int(cpu[r])
    if prev is not None and valid is not None and drafts is not None:
        bound = valid.numel() if num_prev_reqs is None else num_prev_reqs
        bound = min(bound, valid.numel(), drafts.numel(), len(old))
        for r in range(n):
            p = int(prev[r])
            if 0 <= p < bound and int(drafts[p]) > 0:
                if base == "cpu":
                    new_nc[r] = int(cpu[r]) - (int(drafts[p]) + 1 - int(valid[p]))
                else:
                    new_nc[r] = old[p] + int(valid[p])
                if new_acc is not None:
                    new_acc[r] = int(valid[p])
    new_seq = [new_nc[r] + int(sched[r]) for r in range(n)] + [0] * (seq_lens.numel() - n)
    new_pos = None if positions is None else positions.tolist()
    if positions is not None:
        num_positions = num_tokens if num_positions is None else num_positions
        for t in range(num_positions):
            r = int(req[t]) if t < num_tokens else -1
            new_pos[t] = new_nc[r] + int(qpos[t]) if 0 <= r < n else 0
    return new_nc, new_acc, new_seq, new_pos


EDGES = {
    # tokens of no request: index -1, num_reqs and past it, with live rows behind them in the buffers
    "tokens-of-no-request": dict(num_reqs=2, req=[0, 2, -1, 1, 3], num_tokens=5, num_positions=6),
    # a one-row buffer: a token of no request must not read past it
    "one-row-buffers": dict(num_reqs=1, rows=1, req=[0, 1, -1], num_tokens=3, num_positions=3),
    # no request, empty row buffers, padded tokens only
    "no-request": dict(num_reqs=0, rows=0, req=[0, -1], num_tokens=2, num_positions=4),
    # num_positions left out: the tokens only
    "num-positions-omitted": dict(num_reqs=2, req=[0, 1, 1], num_tokens=3),
    # num_tokens left out: no token, nothing written to positions
    "num-tokens-omitted": dict(num_reqs=2, req=[0, 1]),
    # no token and no index buffers: positions [0, num_positions) zeroed
    "no-tokens-no-indices": dict(num_reqs=2, req=None, num_tokens=0, num_positions=3),
    # correction inputs partly missing: the CPU counts are copied
    "no-previous-positions": dict(num_reqs=2, req=[0, 1], num_tokens=2, drop="prev"),
    "no-valid-counts": dict(num_reqs=2, req=[0, 1], num_tokens=2, drop="valid"),
    "no-previous-drafts": dict(num_reqs=2, req=[0, 1], num_tokens=2, drop="drafts"),
    "no-accepted-buffer": dict(num_reqs=2, req=[0, 1], num_tokens=2, drop="acc"),
}


@pytest.mark.parametrize("base", ["previous", "cpu"])
@pytest.mark.parametrize("name", list(EDGES))
def test_reference_edges_against_a_naive_loop(name, base):
    """The reference, on the edges the kernel comparisons leave out (the kernels refuse some of these buffers), equals
    the documented semantics computed one element at a time."""
    case = dict(EDGES[name])
    n, rows, req, drop = case.pop("num_reqs"), case.pop("rows", 4), case.pop("req"), case.pop("drop", None)
    i32 = dict(dtype=torch.int32)
    nc = torch.tensor([30, 50, 70, 90][:rows], **i32)
    acc = torch.tensor([1, 1, 1, 1][:rows], **i32)
    inputs = dict(
        prev=torch.tensor([1, 0][:n], dtype=torch.int64),
        valid=torch.tensor([3, 2][:rows], dtype=torch.int64),
        drafts=torch.tensor([2, 2, 2, 2][:rows], **i32),
    )
    if drop in inputs:
        inputs[drop] = None
    if drop == "acc":
        acc = None
    cpu, sched = torch.tensor([5, 6][:n], **i32), torch.tensor([2, 1][:n], **i32)
    req_t = None if req is None else torch.tensor(req, dtype=torch.int64)
    qpos = None if req is None else torch.arange(len(req), dtype=torch.int64) + 100
    positions = torch.full((8,), POISON, dtype=torch.int64)
    seq_lens = torch.full((4,), POISON, **i32)
    want = _naive_token_counts(
        nc, acc, inputs["prev"], inputs["valid"], inputs["drafts"], cpu, sched, seq_lens, positions,
        num_reqs=n, req=req_t, qpos=qpos, base=base, **case,
    )  # fmt: skip
    token_counts_reference(
        nc, acc, inputs["prev"], inputs["valid"], inputs["drafts"], cpu, sched, seq_lens,
        num_reqs=n, req_indices=req_t, query_pos=qpos, positions=positions, base=base, **case,
    )  # fmt: skip
    got = (nc.tolist(), None if acc is None else acc.tolist(), seq_lens.tolist(), positions.tolist())
    assert got == want


@requires_kernels
def test_valid_step_arguments_pass_the_attribute_checks_alone(dev, monkeypatch):
    """Every step, valid arguments pass the launcher's attribute and integer tests alone, at their bounds too (no
    request and every row, no previous request, CPU counts exactly num_reqs long, with and without counts, positions
    defaulted): the explaining checker runs only where those fail, e.g. for a numpy integer, which it normalises.
    Results are the reference's either way; the checker's cost is what a step saves."""
    import numpy as np

    from zb_patch.kernels import token_counts as tc

    explained = []

    def check(limits, num_reqs, *args):
        explained.append(num_reqs)
        return checker(limits, num_reqs, *args)

    checker = tc.check_token_counts_call
    monkeypatch.setattr(tc, "check_token_counts_call", check)
    rows = 6
    for with_positions in (True, False):
        kb, rb = (_runner_buffers(d, max_reqs=rows, max_tokens=24) for d in (dev, "cpu"))
        if not with_positions:
            for b in (kb, rb):
                b["req_indices"] = b["query_pos"] = b["positions"] = None
        else:
            for b in (kb, rb):
                b["positions"].fill_(POISON)
        kl = kernels.token_counts_launcher(**kb)
        with monkeypatch.context() as m:  # the comparison: the torch reference's launcher, as CPU runs get it
            m.setattr(kernels, "uses_triton", lambda device: False)
            rl = kernels.token_counts_launcher(**rb)
        assert isinstance(kl, tc.TokenCountsLauncher) and not isinstance(rl, tc.TokenCountsLauncher)
        calls = [
            (0, None, dict()),
            (rows, None, dict(num_tokens=rows)),
            (rows, 3, dict(num_tokens=rows, num_positions=24, num_prev_reqs=0)),
            (2, 3, dict(num_tokens=4, num_prev_reqs=1)),
            (np.int64(2), 3, dict(num_tokens=4)),
        ]
        for num_reqs, num_prev, kwargs in calls:
            n = int(num_reqs)
            for b in (kb, rb):
                b["prev_positions"][:n].copy_(torch.arange(n) % 3)
                b["prev_num_draft_tokens"][:3].fill_(2)
                if with_positions:
                    b["req_indices"][:n].copy_(torch.arange(n))
            cpu = torch.arange(n, dtype=torch.int32) + 10  # exactly num_reqs long
            valid = None if num_prev is None else torch.tensor([1, 2, 3][:num_prev], dtype=torch.int64)
            kl(num_reqs, cpu.to(dev), None if valid is None else valid.to(dev), **kwargs)
            rl(num_reqs, cpu, valid, **kwargs)
            for name, buf in rb.items():
                assert buf is None or torch.equal(kb[name].cpu(), buf), (with_positions, n, name)
        assert explained == [2], with_positions  # the numpy integer alone
        explained.clear()
        assert kl._launcher(True) is kl._launcher(True) and kl._launcher(False) is kl._launcher(False)


@requires_kernels
def test_entry_points_pass_their_arguments_on(dev, fresh_launchers, monkeypatch):
    """What the entry points forward: the launch shape (tiles) to the launcher they build, the optional buffers to
    the checks (a bad one is refused by name), and the first call of the module loads the Triton launch path."""
    tc, _ = fresh_launchers
    b = _runner_buffers(dev, max_reqs=4, max_tokens=8)
    assert kernels.token_counts_launcher(**b, tiles=(8, 16))._tiles == (8, 16)
    monkeypatch.setattr(kernels, "_triton_update_token_counts", None)  # as in a fresh process
    i32 = dict(dtype=torch.int32, device=dev)
    args = (b["num_computed_tokens"], b["num_accepted_tokens"], b["prev_positions"][:2], None)
    rest = (b["prev_num_draft_tokens"], torch.ones(2, **i32), b["num_scheduled_tokens"], b["seq_lens"])
    kernels.update_token_counts(*args, *rest, num_reqs=2, tiles=(16, 32))
    assert b["num_computed_tokens"][:2].cpu().tolist() == [1, 1]
    assert {key[5] for key in tc._LAUNCHERS._cache} == {(16, 32)}
    for name, index in (("num_accepted_tokens", 1), ("prev_num_draft_tokens", 4)):
        bad = list(args + rest)
        bad[index] = bad[index].float()
        with pytest.raises(ValueError, match=name):
            kernels.update_token_counts(*bad, num_reqs=2)


@requires_kernels
def test_cuda_compiles_with_the_launcher_s_warps(dev, fresh_launchers, monkeypatch):
    """The warps a CUDA launcher is built with reach Triton's compilation (they change a step's cost, not its values:
    the other tests cannot see them)."""
    if not dev.startswith("cuda"):
        pytest.skip("warps are a CUDA compile option (the interpreter and NPU launchers pass none)")
    from zb_patch.kernels import _launch

    compiled = []
    slow = _launch.FastLauncher.launch_slow

    def recorded(self, grid0, args):
        compiled.append(slow(self, grid0, args))
        return compiled[-1]

    monkeypatch.setattr(_launch.FastLauncher, "launch_slow", recorded)
    step = make_step([2, 0, -1, 1, 5], [3, 1, 2, 4], [2, 0, 3, 3], seed=3)
    assert_same(*run_pair(step, dev))
    assert compiled and [c.metadata.num_warps for c in compiled] == [8] * len(compiled)


def test_launch_shape_per_device(monkeypatch):
    """The tiles and warps each device's launcher is built with (module constants; the interpreter's tiles under
    TRITON_INTERPRET=1): every shape gives the reference's counts (the tests above); a step's cost depends on it."""
    from zb_patch.kernels import token_counts as tc

    monkeypatch.setattr(tc, "interpret_mode", lambda: True)
    assert tc._default_tiles("cuda") == tc._default_tiles("npu") == tc._INTERP_TILES
    monkeypatch.setattr(tc, "interpret_mode", lambda: False)
    assert (tc._default_tiles("cuda"), tc._default_tiles("npu")) == (tc._CUDA_TILES, tc._NPU_TILES)
    assert tc._CUDA_TILES != tc._NPU_TILES
    for device_type, options in (("cuda", {"num_warps": 8}), ("npu", {})):
        launcher = tc._make_launcher(device_type, True, False, True, True, (8, 16), False)
        assert launcher._options == options, device_type
        assert (launcher._constexprs["REQ_TILE"], launcher._constexprs["TOK_TILE"]) == (8, 16)
