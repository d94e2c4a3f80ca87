"""draft-sample-indices-past-batch's wrapper of ``NPUModelRunner.propose_draft_token_ids``: after the release's
proposal, the drafter's persistent sample-index buffer is all zeros; the call and its result pass through unchanged;
a drafter without the buffer (n-gram, suffix) is left alone. The defect and the fix through a real engine (FULL decode
graphs, EAGLE): tests/engine/test_defect_draft_sample_indices_past_batch.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from zb_patch.versions.fixes.draft_sample_indices_past_batch import make_propose_draft_token_ids  # noqa: E402


@pytest.mark.parametrize("buffer", ["token_indices_to_sample", "last_token_indices"])  # 0.18 / 0.19-0.25, 0.13
def test_the_buffer_is_zeroed_after_the_proposal_and_the_call_passes_through(buffer):
    indices = torch.tensor([3, 7, 11, 15, 19], dtype=torch.int32)
    seen = []

    def propose_draft_token_ids(runner, *args, **kwargs):
        seen.append((runner, args, kwargs, getattr(runner.drafter, buffer).tolist()))
        return "drafts"

    runner = SimpleNamespace(drafter=SimpleNamespace(**{buffer: indices}))
    wrapped = make_propose_draft_token_ids(buffer)(propose_draft_token_ids)

    assert wrapped(runner, "scheduler output", 2, sampled=[5]) == "drafts"
    assert seen == [(runner, ("scheduler output", 2), {"sampled": [5]}, [3, 7, 11, 15, 19])]  # before the zeroing
    assert indices.tolist() == [0, 0, 0, 0, 0]
    assert wrapped.__wrapped__ is propose_draft_token_ids


def test_a_drafter_without_the_buffer_is_left_alone():
    other = torch.tensor([4, 5], dtype=torch.int32)
    runner = SimpleNamespace(drafter=SimpleNamespace(token_indices_to_sample=other))
    wrapped = make_propose_draft_token_ids("last_token_indices")(lambda runner: "drafts")

    assert wrapped(runner) == "drafts"
    assert other.tolist() == [4, 5]
