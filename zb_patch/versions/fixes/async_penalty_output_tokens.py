"""async-penalty-output-tokens (vllm-ascend #7769, fixed by #7789 in 0.19.1rc1): under async scheduling the
sampler's output ids (penalties, bad words) are the runner's ``-1`` placeholders, because the release's
``sample_tokens`` / ``_sample`` never call vLLM's repair of them; with speculative decoding its draft ids are the
scheduler's ``-1`` placeholders too. Adapter ascend-0.18; spec: :func:`patch`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from ...registry import UPSTREAM, Patch, RestsOn

ID = "async-penalty-output-tokens"


def make_sample_tokens(original: Callable) -> Callable:
    """Wrap ``NPUModelRunner.sample_tokens`` with vLLM 0.18's steps that the release leaves out.

    Before the release's body, when it will sample (``execute_model_state`` set): ``InputBatch.
    update_async_output_token_ids`` writes the previous step's sampled ids over the output placeholders, in place
    (it waits on that step's copy event, only when a row needs output ids and ends in a placeholder), and with
    drafts in the batch ``update_async_spec_token_ids`` writes the previous step's drafts over the scheduler's ``-1`` drafts
    (``_get_draft_token_ids_cpu``: the copy the release makes with ``_copy_draft_token_ids_to_cpu`` when output ids
    are needed), as vLLM's ``GPUModelRunner._sample`` does; then the drafts' request ids are cleared, as vLLM's
    ``sample_tokens`` does, so a later step without a copy never pairs its rows with stale drafts. After the body:
    the async output's host copy of the sampled ids and its event go to ``set_async_sampled_token_ids`` (kept only
    when the batch needs output ids), as vLLM's ``sample_tokens`` and #7789 do."""

    @functools.wraps(original)
    def sample_tokens(runner, *args, **kwargs):
        if runner.use_async_scheduling and runner.execute_model_state is not None:
            batch = runner.input_batch
            batch.update_async_output_token_ids()
            if runner._draft_token_req_ids is not None and any(batch.spec_token_ids[: batch.num_reqs]):
                draft_token_ids, _ = runner._get_draft_token_ids_cpu()
                batch.update_async_spec_token_ids(draft_token_ids)
            runner._draft_token_req_ids = None
        output = original(runner, *args, **kwargs)
        copied = getattr(output, "sampled_token_ids_cpu", None)
        if copied is not None and runner.use_async_scheduling:
            runner.input_batch.set_async_sampled_token_ids(copied, output.async_copy_ready_event)
        return output

    return sample_tokens


def patch(fingerprints: Mapping[str, str], *, release_lines: str, remove_when: str) -> Patch:
    """The fix (``fingerprints`` of ``NPUModelRunner.sample_tokens``; ``release_lines``: where the release samples
    without vLLM's calls)."""
    return Patch(
        id=ID,
        rests_on=RestsOn(
            UPSTREAM,
            "vllm-ascend #7789 (0.19.1rc1 on) makes the output-id calls of vLLM's InputBatch on NPUs, around the same "
            "sampling; the drafts come from the copy and event the release reads on NPUs for structured outputs "
            "(vLLM _copy_draft_token_ids_to_cpu / _get_draft_token_ids_cpu)",
        ),
        target="vllm_ascend.worker.model_runner_v1:NPUModelRunner.sample_tokens",
        make=make_sample_tokens,
        fingerprints=fingerprints,
        why="(vllm-ascend #7769, fixed by #7789 in 0.19.1rc1) Under async scheduling the sampler's output ids and "
        f"drafts are `-1` placeholders: {release_lines}, so penalties and bad words see no generated id.",
        how="Wrapper (zb_patch.versions.fixes.async_penalty_output_tokens). Before the release's body, when it will "
        "sample: vLLM 0.18's InputBatch.update_async_output_token_ids (the previous step's sampled ids over the output "
        "placeholders, in place: #7789) and, with drafts, update_async_spec_token_ids (the previous step's drafts "
        "over the scheduler's `-1`s; not in #7789, nor in vllm-ascend through 0.25.1rc1), then the drafts' request "
        "ids cleared, as vLLM's GPUModelRunner._sample / sample_tokens do. After it: the async output's host copy of "
        "the sampled ids and its event handed to set_async_sampled_token_ids (kept only when the batch needs output "
        "ids). One host wait per step, only then: on the previous step's copy events, recorded after its drafter, "
        "while this step's forward is queued (never before input preparation). Zero-bubble's placeholders for the "
        "previous step's rejected drafts are gone by then (its deferred correction trims them).",
        upstream=("vllm-ascend#7769", "vllm-ascend#7789"),
        remove_when=remove_when,
    )
