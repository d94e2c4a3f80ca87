"""readded-request-drafts (vLLM #31944, in vLLM 0.14.0): vLLM 0.13's runner never writes the scheduled drafts of a
row re-added to the persistent batch (a request skipped for a step, or preempted and resumed), so the model and the
rejection sampler read another request's tokens (or a ``-1``) as its drafts. Adapter ascend-0.13; spec: :func:`patch`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from ...registry import HOST, Patch, RestsOn

ID = "readded-request-drafts"


def make_may_reorder_batch(original: Callable) -> Callable:
    """Wrap ``GPUModelRunner._may_reorder_batch(scheduler_output)`` (vLLM 0.13), which ``_update_states`` calls right
    after it re-added the requests that were not in the persistent batch: first give each re-added row its scheduled
    drafts, as vLLM 0.14+ does there with ``InputBatch.update_req_spec_token_ids`` (#31944).

    vLLM 0.13's ``_update_states`` writes a request's scheduled draft ids into ``token_ids_cpu`` (and
    ``spec_token_ids``, ``num_tokens``) only on the path of rows that stayed in the batch; a re-added row keeps
    whatever its slot held before (``add_request`` empties its ``spec_token_ids``), so the model and the rejection
    sampler get another request's tokens or a ``-1`` as its drafts. Re-added rows with drafts are exactly the rows
    whose ``spec_token_ids`` is empty while the scheduler scheduled drafts for them (the other path always fills it).
    Synchronous scheduling: those are the request's real drafts (the scheduler keeps them over a preemption until
    vLLM 0.14, #31944, and over a skipped step). Async scheduling: the scheduler's ``-1`` placeholders, which the
    ``stale-draft-placeholders`` fix replaces with the request's drafts on the device. Host work only.
    """

    @functools.wraps(original)
    def _may_reorder_batch(runner, scheduler_output, *args, **kwargs):
        write_readded_drafts(runner, scheduler_output)
        return original(runner, scheduler_output, *args, **kwargs)

    return _may_reorder_batch


READDED_ATTR = "_zb_patch_readded_drafts"  # per-runner count of re-added rows given their drafts (diagnostics)


def write_readded_drafts(runner: Any, scheduler_output: Any) -> None:
    spec = scheduler_output.scheduled_spec_decode_tokens
    if not spec:
        return
    batch = runner.input_batch
    written = 0
    for req_id, drafts in spec.items():
        index = batch.req_id_to_index.get(req_id)
        if index is None or not drafts or batch.spec_token_ids[index]:
            continue  # not in the batch, no drafts, or a row that stayed (its drafts were written)
        start = batch.num_tokens_no_spec[index]
        batch.token_ids_cpu[index, start : start + len(drafts)] = drafts
        batch.num_tokens[index] = start + len(drafts)  # vLLM 0.13: num_tokens may include spec tokens
        batch.spec_token_ids[index].extend(drafts)
        written += 1
    if written:
        runner.__dict__[READDED_ATTR] = runner.__dict__.get(READDED_ATTR, 0) + written


def patch(fingerprints: Mapping[str, str], *, remove_when: str) -> Patch:
    """The fix for an adapter on vLLM 0.13 (``fingerprints`` of ``GPUModelRunner._may_reorder_batch``)."""
    return Patch(
        id=ID,
        rests_on=RestsOn(
            HOST,
            "host writes to the persistent batch (token_ids_cpu, num_tokens, spec_token_ids) before the step's inputs are built from it; no device op",
        ),
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._may_reorder_batch",
        make=make_may_reorder_batch,
        fingerprints=fingerprints,
        why="(vLLM #31944, in vLLM 0.14.0) vLLM 0.13's scheduler keeps a preempted request's spec_token_ids, and any "
        "request's over a step it was not scheduled in, and schedules them again with the request: a resumed request "
        "gets them with the last chunk of its recomputed prompt. Its runner writes a request's scheduled drafts into "
        "the persistent batch (token_ids_cpu, spec_token_ids, num_tokens) only for rows that stayed in the batch; a "
        "row re-added for a skipped or preempted request keeps what its slot held before, so the model and the "
        "rejection sampler get another request's tokens (or a -1) as its drafts. Synchronous scheduling verifies junk "
        "there (no crash, lost acceptance); under async scheduling it is where stale-draft-placeholders writes the "
        "request's real drafts. #31944 writes them (InputBatch.update_req_spec_token_ids on the re-added rows) and also "
        "clears spec_token_ids at preemption in the scheduler; zb-patch patches worker processes only (the scheduler "
        "runs in the EngineCore process), so the kept drafts are verified with the recomputed prompt, as vLLM 0.13's "
        "sync scheduling meant to: they are the request's drafts for the position it resumes at.",
        how="Wrapper (zb_patch.versions.fixes.readded_request_drafts). _update_states calls _may_reorder_batch right after re-adding the "
        "requests that were not in the batch (guarded); first, each row whose spec_token_ids is empty while drafts are "
        "scheduled for it (the re-added ones: the other path always fills the list) gets them written into "
        "token_ids_cpu after its tokens, num_tokens and spec_token_ids, as vLLM 0.14's update_req_spec_token_ids does. "
        "Host work only, no device op. Synchronous and async scheduling alike, zero-bubble active or not.",
        upstream=("vllm#31944", "vllm#30916"),
        remove_when=remove_when,
    )
