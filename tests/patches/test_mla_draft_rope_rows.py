"""``mla-draft-rope-rows`` (ascend-0.18, ascend-0.19-0.25) on the release's own ``get_cos_and_sin_mla`` and its
buffers: each draft position of one proposer call gets rows of its own, at the same address in every call (what a
captured FULL graph needs), with the release's values; the target's builds (outside a proposer call) are the
release's. The engine-level effect (acceptance per draft position, the verdict) is tests/engine/test_engine_mla.py's;
the bookkeeping-level one test_runner_parity.py's."""

from __future__ import annotations

import types

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
if npu_standin.detect_family() not in ("0.18", "0.23"):  # "0.23": the stand-in's surface for 0.19 and later
    pytest.skip("mla-draft-rope-rows: ascend-0.18 and ascend-0.19-0.25", allow_module_level=True)

import torch  # noqa: E402

from zb_patch.versions.fixes import mla_draft_rope_rows  # noqa: E402

K = 3


@pytest.fixture
def rope(cpu_worker, monkeypatch):
    """The release's rotary module with its caches as the MLA model sets them up (rows of 64 per position, the
    decode buffers allocated once for 16 tokens); the release's function wrapped as the patch wraps it."""
    from vllm_ascend.ops import rotary_embedding

    positions = torch.arange(100, dtype=torch.float32)[:, None]
    monkeypatch.setattr(rotary_embedding, "_cos_cache", torch.cos(positions * torch.linspace(0.01, 1, 64)))
    monkeypatch.setattr(rotary_embedding, "_sin_cache", torch.sin(positions * torch.linspace(0.01, 1, 64)))
    monkeypatch.setattr(rotary_embedding, "_cos_mla", torch.ones(16, 1, 1, 64))
    monkeypatch.setattr(rotary_embedding, "_sin_mla", torch.zeros(16, 1, 1, 64))
    return rotary_embedding, mla_draft_rope_rows.make_get_cos_and_sin_mla(rotary_embedding.get_cos_and_sin_mla)


def _propose(build_positions):
    """A proposer call (the patch's ``make_drafting`` around a body that builds each position's rows in order)."""
    proposer = types.SimpleNamespace(num_speculative_tokens=K)
    call = mla_draft_rope_rows.make_drafting(lambda _proposer, body: body())
    return proposer, lambda: call(proposer, build_positions)


def _ptr(t):
    return t.untyped_storage().data_ptr()


def test_each_draft_position_keeps_its_rows_at_one_address(rope):
    module, get_cos_and_sin_mla = rope
    built = []

    def build_positions():
        built.clear()
        for step in range(K + 1):  # one build past k: the release's rows
            positions = torch.tensor([10 * step + 1, 10 * step + 2, 10 * step + 3])
            built.append((positions, *get_cos_and_sin_mla(positions, use_cache=True)))

    _, propose = _propose(build_positions)
    propose()
    first = [(_ptr(cos), _ptr(sin)) for _, cos, sin in built]
    # every position's rows are still the ones built for it after the later builds (the release: all the last's)
    for positions, cos, sin in built[:K]:
        assert torch.equal(cos[:, 0, 0], module._cos_cache[positions]) and torch.equal(
            sin[:, 0, 0], module._sin_cache[positions]
        )
    assert len({c for c, _ in first[:K]}) == K and _ptr(module._cos_mla) not in {c for c, _ in first[:K]}
    assert first[K] == (_ptr(module._cos_mla), _ptr(module._sin_mla))  # past k: the shared buffer, as released
    propose()  # the next proposal (or the run after a capture): the same buffer per position
    assert [(_ptr(cos), _ptr(sin)) for _, cos, sin in built] == first


def test_outside_a_proposer_call_the_release_answers(rope):
    module, get_cos_and_sin_mla = rope
    positions = torch.tensor([5, 6])
    cos, sin = get_cos_and_sin_mla(positions, use_cache=True)  # a target build
    assert (_ptr(cos), _ptr(sin)) == (_ptr(module._cos_mla), _ptr(module._sin_mla))
    assert torch.equal(cos[:, 0, 0], module._cos_cache[positions])
    # prefill rows (no cache) are fresh tensors in the release; inside a proposer call too
    built = []
    _, propose = _propose(lambda: built.append(get_cos_and_sin_mla(positions)))
    propose()
    assert _ptr(built[0][0]) != _ptr(module._cos_mla) and torch.equal(
        built[0][0][:, 0, 0], module._cos_cache[positions]
    )


def test_a_call_without_decode_rows_at_position_0_still_gives_each_build_its_own_rows(rope):
    """A batch whose position 0 is all prefill builds decode rows for positions 1 .. k-1 only (k - 1 builds): they
    take the first buffers, each its own, and keep their values after the later builds."""
    module, get_cos_and_sin_mla = rope
    built = []

    def build_positions():
        for step in range(1, K):
            positions = torch.tensor([10 * step + 4, 10 * step + 5])
            built.append((positions, *get_cos_and_sin_mla(positions, use_cache=True)))

    _, propose = _propose(build_positions)
    propose()
    assert len({_ptr(cos) for _, cos, _ in built}) == K - 1
    for positions, cos, sin in built:
        assert torch.equal(cos[:, 0, 0], module._cos_cache[positions]) and torch.equal(
            sin[:, 0, 0], module._sin_cache[positions]
        )


def test_a_proposer_call_inside_another_gives_the_outer_one_back_its_rows(rope):
    """A proposer call made while another runs (``dummy_run`` from within ``_propose``): its builds take its own
    proposer's rows, and once it returns the outer call's next build is the outer call's next position, in the outer
    proposer's buffers (held under the patch's attribute)."""
    module, get_cos_and_sin_mla = rope
    inner_proposer, inner = _propose(lambda: get_cos_and_sin_mla(torch.tensor([7]), use_cache=True))
    built = []

    def build_positions():
        built.append(get_cos_and_sin_mla(torch.tensor([1, 2]), use_cache=True))
        inner()
        built.append(get_cos_and_sin_mla(torch.tensor([3, 4]), use_cache=True))

    outer_proposer, outer = _propose(build_positions)
    outer()
    rows = getattr(outer_proposer, mla_draft_rope_rows.ROPE_ROWS_ATTR)
    assert [(_ptr(cos), _ptr(sin)) for cos, sin in built] == [(_ptr(c), _ptr(s)) for c, s in rows[:2]]
    assert len(rows) == 2 and len(getattr(inner_proposer, mla_draft_rope_rows.ROPE_ROWS_ATTR)) == 1
    assert torch.equal(built[1][0][:, 0, 0], module._cos_cache[torch.tensor([3, 4])])
    # after the outer call: the release's answer again
    cos, _ = get_cos_and_sin_mla(torch.tensor([5]), use_cache=True)
    assert _ptr(cos) == _ptr(module._cos_mla)


def test_prefill_rows_leave_the_shared_decode_buffer_alone(rope):
    """Without ``use_cache`` (prefill rows) the release computes fresh rows and leaves its decode buffer as it was,
    inside a proposer call and outside one."""
    module, get_cos_and_sin_mla = rope
    positions = torch.tensor([5, 6])
    before = module._cos_mla.clone(), module._sin_mla.clone()
    built = [get_cos_and_sin_mla(positions)]
    _, propose = _propose(lambda: built.append(get_cos_and_sin_mla(positions)))
    propose()
    for cos, sin in built:
        assert _ptr(cos) != _ptr(module._cos_mla) and _ptr(sin) != _ptr(module._sin_mla)
        assert torch.equal(cos[:, 0, 0], module._cos_cache[positions])
    assert torch.equal(module._cos_mla, before[0]) and torch.equal(module._sin_mla, before[1])


def test_a_thread_that_never_drafted_gets_the_release_s_rows_and_can_draft(rope):
    """The call in progress is per thread: on a fresh thread (an executor's worker thread) a target build is the
    release's and a proposer call works from scratch."""
    import threading

    module, get_cos_and_sin_mla = rope
    seen, errors = [], []

    def work():
        try:
            seen.append(get_cos_and_sin_mla(torch.tensor([5]), use_cache=True))
            _, propose = _propose(lambda: seen.append(get_cos_and_sin_mla(torch.tensor([6]), use_cache=True)))
            propose()
        except Exception as e:  # noqa: BLE001 -- reported below, in the test's thread
            errors.append(e)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors, errors
    assert _ptr(seen[0][0]) == _ptr(module._cos_mla) and _ptr(seen[1][0]) != _ptr(module._cos_mla)
