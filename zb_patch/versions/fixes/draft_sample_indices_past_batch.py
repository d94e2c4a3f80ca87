"""draft-sample-indices-past-batch (vllm-ascend #9867 / #10080, in 0.21.0rc1): with FULL decode graphs and EAGLE the
draft graph samples stale indices past the real batch from the proposer's persistent sample-index buffer. Adapters
ascend-0.13, ascend-0.18, ascend-0.19-0.25; spec: :func:`patch`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from ...registry import ONE_STREAM, Patch, RestsOn

ID = "draft-sample-indices-past-batch"


def make_propose_draft_token_ids(buffer: str) -> Callable[[Callable], Callable]:
    """``make`` for ``NPUModelRunner.propose_draft_token_ids``: afterwards the drafter's persistent sample-index buffer
    (attribute ``buffer``) is all zeros, so the next proposal (which writes its real rows only) and any dummy run before
    it hand a padded FULL draft graph index 0 in the rows past the real batch."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def propose_draft_token_ids(runner, *args, **kwargs):
            result = original(runner, *args, **kwargs)
            indices = getattr(runner.drafter, buffer, None)  # None: a drafter without the buffer (n-gram, suffix)
            if indices is not None:
                indices.zero_()  # queued after the proposal's graph replay on the same stream: no host wait
            return result

        return propose_draft_token_ids

    return make


def patch(
    fingerprints: Mapping[str, str],
    *,
    buffer: str,
    release_lines: str,
    remove_when: str,
    native_fingerprints: Mapping[str, str] | None = None,
) -> Patch:
    """The ``draft-sample-indices-past-batch`` patch for an adapter whose proposer keeps its sample indices in the
    persistent buffer ``buffer`` (``release_lines``: where the release writes it and where the graph reads it)."""
    return Patch(
        id=ID,
        rests_on=RestsOn(
            ONE_STREAM,
            "one device fill of the drafter's buffer, queued after the proposal on its stream; every later reader (the next proposal, a dummy run) runs on that stream after it; vllm-ascend #9867 / #10080 (native from 0.21.0rc1) zero the same buffer on NPUs",
        ),
        target="vllm_ascend.worker.model_runner_v1:NPUModelRunner.propose_draft_token_ids",
        make=make_propose_draft_token_ids(buffer),
        fingerprints=fingerprints,
        native_fingerprints=native_fingerprints or {},
        why="(vllm-ascend #9867 / #10080, in 0.21.0rc1) The EAGLE drafter's FULL decode graph is captured for a padded "
        "batch and samples the draft model's hidden states at the first `padded requests` rows of the proposer's "
        "persistent sample-index buffer, but each proposal writes only its real requests' rows: the rows past "
        "them keep indices of earlier, larger batches (a prefill chunk of 64 tokens leaves indices up to 63), past "
        "the padded batch's tokens, and the graph's gather reads out of bounds (on the H200 stand-in a device-side "
        "assert in every FULL_DECODE_ONLY EAGLE run of the 48-request workload, sync included, docs/e2e.md). A dummy "
        "run's graph replay (data-parallel idle rank) reads the same stale rows (#10080).",
        how="Wrapper (zb_patch.versions.fixes.draft_sample_indices_past_batch). After the release's body, the drafter's buffer is filled with "
        "0 (one device fill, queued after the proposal's replay; no host wait). The buffer starts as zeros and only "
        "a proposal writes it, so at every later proposal and dummy run the rows past the real batch read 0 (a valid "
        "token of any padded batch), what #9867 (zero the rest in _propose) and #10080 (zero all in dummy_run) give. "
        "Any graph mode, sync or async, every drafter that has the buffer; tokens do not change (the padded rows' drafts "
        f"are discarded). Here the buffer is {buffer}, written in {release_lines}.",
        upstream=("vllm-ascend#9867", "vllm-ascend#10080"),
        remove_when=remove_when,
    )
