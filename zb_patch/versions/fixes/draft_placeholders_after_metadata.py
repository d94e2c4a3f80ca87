"""draft-placeholders-after-metadata (vllm-ascend #10305 / #10307, vLLM #47029): a ``-1`` draft placeholder the runner
has no proposal for must reach the rejection sampler as ``-1`` and the forward never. Adapters ascend-0.13,
ascend-0.18; spec: :func:`patch`; :func:`keep_ids_before_clamp` / :func:`drop_ids_before_clamp` for zero-bubble on
vllm-ascend 0.13, which clamps the input ids before the metadata.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from ...registry import ONE_STREAM, Patch, RestsOn

ID = "draft-placeholders-after-metadata"

IDS_BEFORE_CLAMP_ATTR = "_zb_patch_ids_before_clamp"  # per-runner, per input preparation: set, then consumed
PLACEHOLDER_DRAFTS_ATTR = "_zb_patch_placeholder_drafts"  # diagnostics: metadata whose drafts were re-read


def keep_ids_before_clamp(runner: Any, total: int) -> None:
    """Called by a wrapper that clamps the step's input ids before the spec-decode metadata is built (zero-bubble on
    vllm-ascend 0.13): keep a device copy of the ids as they were (no host wait), for
    :func:`make_calc_spec_decode_metadata` to read the drafts from."""
    runner.__dict__[IDS_BEFORE_CLAMP_ATTR] = runner.input_ids.gpu[:total].clone()


def drop_ids_before_clamp(runner: Any) -> None:
    runner.__dict__.pop(IDS_BEFORE_CLAMP_ATTR, None)


def make_calc_spec_decode_metadata(original: Callable) -> Callable:
    """Wrap ``NPUModelRunner._calc_spec_decode_metadata`` (``draft_token_ids = input_ids.gpu[logits_indices]
    [target_logits_indices + 1]``): when the step's input ids were clamped to >= 0 before it (kept by
    :func:`keep_ids_before_clamp`), the drafts are gathered again, with the same indices, from the ids as they were
    before the clamp, so a ``-1`` placeholder reaches the rejection sampler as ``-1`` (never accepted) instead of
    token 0 (accepted whenever the target's argmax is 0). Then the input ids are clamped to >= 0 for the forward
    (vllm-ascend #10307's order: metadata first, sanitised after). Device ops only; no host wait."""

    @functools.wraps(original)
    def _calc_spec_decode_metadata(runner, *args, **kwargs):
        metadata = original(runner, *args, **kwargs)
        before = runner.__dict__.pop(IDS_BEFORE_CLAMP_ATTR, None)
        # PCP replaces logits_indices after the gather (the release's pcp_size > 1 branch): leave it as it is there
        if before is not None and getattr(runner, "pcp_size", 1) == 1:
            metadata.draft_token_ids = before[metadata.logits_indices][metadata.target_logits_indices + 1]
            runner.__dict__[PLACEHOLDER_DRAFTS_ATTR] = runner.__dict__.get(PLACEHOLDER_DRAFTS_ATTR, 0) + 1
        # the drafts are in the metadata (a gather: a copy); from here on the input ids only feed the forward and the
        # drafter, where a -1 is an out-of-range embedding index (#10305): sanitised as #10307 does, over the whole
        # device buffer (the padded tail included); one device op, no host wait
        runner.input_ids.gpu.clamp_(min=0)
        return metadata

    return _calc_spec_decode_metadata


def patch(fingerprints: Mapping[str, str], *, release_lines: str, remove_when: str, not_covered: str = "") -> Patch:
    """The ``draft-placeholders-after-metadata`` patch (``release_lines``: where the release's scheduler gives the
    placeholders and where its runner gathers the drafts and embeds the ids; ``not_covered``: what the adapter's
    release embeds before the metadata)."""
    return Patch(
        id=ID,
        rests_on=RestsOn(
            ONE_STREAM,
            "device gathers and one clamp of the step's input ids, queued between the release's gather of the drafts "
            "and the forward on the stream of the input preparation (program order); vllm-ascend #10307 (0.21.0rc1) "
            "sanitises the same buffer at the same point on NPUs",
        ),
        target="vllm_ascend.worker.model_runner_v1:NPUModelRunner._calc_spec_decode_metadata",
        make=make_calc_spec_decode_metadata,
        fingerprints=fingerprints,
        why="(vllm-ascend #10305 / #10307, vLLM #47029) A draft the runner has no proposal for stays the scheduler's "
        "`-1` placeholder in the step's input ids: every request's first step on a PD decode node with MTP "
        "(RecomputeScheduler.add_request gives it `[-1] * k`) or a row the stale-draft fixes cannot fill. The "
        "release gathers the rejection sampler's drafts from the input ids and hands the same ids to the forward, "
        "whose embedding faults on `-1` (GatherV2 out of range on NPUs, #10305). On vllm-ascend 0.13 zero-bubble's "
        "clamp at 0 (zb013-corrections-before-metadata, in _init_model_kwargs) runs before that gather, so the "
        "sampler is handed token 0 (<｜begin▁of▁sentence｜> in DeepSeek vocabularies) and accepts it whenever the "
        "target's argmax is 0.",
        how="Wrapper (zb_patch.versions.fixes.draft_placeholders_after_metadata). After the release's body: where zero-bubble clamped the input "
        "ids before it (it keeps a device copy of them for this call), the drafts are gathered again from that copy "
        "with the metadata's own indices, so the sampler sees `-1` and rejects it (no PCP); then the whole device "
        "input-id buffer is clamped to >= 0 for the forward and the drafter (#10307's order: metadata first, "
        "sanitised after). Device ops, no host wait; any graph mode, with or without zero-bubble. Here: "
        f"{release_lines}.{not_covered}",
        upstream=("vllm-ascend#10305", "vllm-ascend#10307", "vllm-ascend#10043", "vllm#47029"),
        remove_when=remove_when,
    )
