"""mtp-draft-lengths (vllm-ascend 0.13 only; gone with MtpProposer in #7033, 0.16.0rc1): MtpProposer, k >= 2, dense
attention: later draft steps attend with the first step's host length lists. Adapter ascend-0.13; spec: :func:`patch`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from ...registry import HOST, Patch, RestsOn

ID = "mtp-draft-lengths"


def make_mtp_draft_forward_context(original: Callable) -> Callable:
    """Wrap the ``set_ascend_forward_context`` bound in 0.13's ``mtp_proposer`` module (the context the proposer enters
    before each draft model call): for a draft model's call outside a FULL graph, dense attention metadata whose
    host ``seq_lens`` the release moved on past its lists gets lists that follow them (see :func:`patch`)."""

    @functools.wraps(original)
    def set_ascend_forward_context(attn_metadata, *args, **kwargs):
        mode = getattr(kwargs.get("aclgraph_runtime_mode"), "name", "")
        if kwargs.get("is_draft_model") and isinstance(attn_metadata, dict) and mode != "FULL":
            for metadata in {id(m): m for m in attn_metadata.values()}.values():
                _follow_draft_seq_lens(metadata)
        return original(attn_metadata, *args, **kwargs)

    return set_ascend_forward_context


def _follow_draft_seq_lens(metadata) -> None:
    """Dense metadata (``attention_v1.AscendMetadata``: host ``seq_lens``, ``seq_lens_list``,
    ``actual_seq_lengths_q``) whose ``seq_lens`` differ from ``seq_lens_list`` is a later draft step's (the first
    step's are built equal; each later step adds one to ``seq_lens`` only): it gets one query token per request and
    the moved-on ``seq_lens`` as its lengths. Called once per draft pass: no import, no device read."""
    cls = type(metadata)
    if (cls.__name__, cls.__module__) != ("AscendMetadata", "vllm_ascend.attention.attention_v1"):
        return  # MLA metadata (the release updates its decode part), context-parallel metadata
    seq_lens = metadata.seq_lens
    if getattr(getattr(seq_lens, "device", None), "type", None) != "cpu":
        return  # lengths on the device (cross-attention metadata): reading them would wait for it
    lens = seq_lens.tolist()
    if lens != metadata.seq_lens_list:
        metadata.seq_lens_list = lens
        metadata.actual_seq_lengths_q = list(range(1, len(lens) + 1))


def patch(fingerprints: Mapping[str, str], *, remove_when: str) -> Patch:
    """The fix for an adapter on vllm-ascend 0.13 (``fingerprints`` of the ``set_ascend_forward_context`` binding in
    ``vllm_ascend.spec_decode.mtp_proposer``)."""
    return Patch(
        id=ID,
        rests_on=RestsOn(
            HOST,
            "the attention metadata's host lists only (seq_lens_list, actual_seq_lengths_q), set before the draft model call that reads them",
        ),
        target="vllm_ascend.spec_decode.mtp_proposer:set_ascend_forward_context",
        make=make_mtp_draft_forward_context,
        fingerprints={"vllm-ascend 0.13.0": "46d81270954ae85b"},
        why="vllm-ascend 0.13's MtpProposer, k >= 2, dense attention (attention_v1: a target without MLA, MiMo here): "
        "after the first draft step it moves the host seq_lens on by one per step and sets query_start_loc to one token "
        "per request, but updates seq_lens_list and actual_seq_lengths_q only in MLA metadata's decode part "
        "(spec_decode/mtp_proposer.py:412, :495; the MLA part :470, :550). The dense backend hands FIA the top-level lists "
        "(attention_v1.py _get_fia_params, forward_fused_infer_attention), so every later draft step attends with the "
        "first step's lengths: its own newest KV entry is not seen, and the first step's cumulative query ends (k + 1 "
        "tokens per decode request) assign the one-token rows to the wrong requests, so a later draft reads another "
        "request's KV and depends on what else is in the batch. On the test model every draft after the first is "
        "rejected (docs/e2e.md), and which ones are accepted by chance differs between sync and async "
        "scheduling. With or without async scheduling and zero-bubble. vllm-ascend #7033 (0.16.0rc1) deleted "
        "MtpProposer; never backported to 0.13.",
        how="Wrapper of the set_ascend_forward_context binding in vllm_ascend.spec_decode.mtp_proposer (the proposer enters "
        "it before each draft model call). For a draft model's call outside a FULL graph, each attention_v1.AscendMetadata "
        "whose host seq_lens differ from its seq_lens_list (the first step's are built equal; a later step is the only "
        "one that moves seq_lens alone) gets seq_lens_list = seq_lens and actual_seq_lengths_q = 1 .. batch size, what "
        "the release gives its MLA decode metadata at the same step. Host lists only, no device op or wait. Left as "
        "released: MLA metadata, FULL graph replays of the draft model (not shown with the change), context parallelism "
        "(other metadata classes).",
        upstream=("vllm-ascend#7033",),
        remove_when=remove_when,
    )
