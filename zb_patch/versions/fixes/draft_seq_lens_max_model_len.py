"""draft-seq-lens-max-model-len (vllm-ascend #9221 / #10112 / #10147): the EAGLE / MTP proposer masks the draft rows'
sequence lengths past ``max_model_len`` differently on the device and on the host, so near the limit Ascend attention
and the other kernels read different lengths. Adapters ascend-0.18, ascend-0.19-0.25; spec: :func:`patch`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from ...registry import ONE_STREAM, Patch, RestsOn

ID = "draft-seq-lens-max-model-len"


def make_attn_update_stack_num_spec_norm(original: Callable) -> Callable:
    """Wrap ``SpecDecodeBaseProposer.attn_update_stack_num_spec_norm`` (draft steps 1 .. k-1 of the EAGLE / MTP
    proposer): the attention metadata of a draft step is built from sequence lengths masked as vllm-ascend #10112 /
    #10147 mask them.

    The release adds 1 to the draft rows' sequence lengths, then sets those of requests past ``max_model_len`` to 1:
    on the device by the *position* (``>= max_model_len``, the step's input position), on the host by the sequence
    length (``>= max_model_len``). The two disagree: a length that reaches ``max_model_len`` keeps it on the device and
    gets 1 on the host -- also for a row whose position is still below the limit, because the padded drafter's
    lengths count the step's rejected drafts, so that row's draft attends to one KV entry -- and a request masked in
    one step gets 1 again on the device but 2, 3, ... on the host in the next ones (the masked length is the next
    step's base). Ascend attention takes its lengths from the host copy and other kernels from the device one.
    #10112 masks both by ``seq_lens > max_model_len``.

    The release's own body runs; the metadata builder it is handed (``attn_group``) is a stand-in whose
    ``build_for_drafting`` first rewrites the draft rows' lengths of the step's common metadata to ``previous + 1``,
    set to 1 where that exceeds ``max_model_len`` (device ``seq_lens``, host ``seq_lens_cpu`` and, where the class has
    it, ``_seq_lens_cpu``), then builds. The previous lengths are those of the metadata the step was derived from,
    which the release clones before it adds (so they are unchanged) and which, from the second draft step on, is the
    previous step's corrected metadata. No host wait: the device rewrite is device ops, the host one host ops.
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def attn_update_stack_num_spec_norm(proposer, *args, **kwargs):
        bound = signature.bind(proposer, *args, **kwargs)
        group = bound.arguments.get("attn_group")
        if group is None:
            return original(proposer, *args, **kwargs)
        bound.arguments["attn_group"] = _MaskedLengthsGroup(
            group, bound.arguments["old_common_metadata"], bound.arguments["batch_size"], proposer.max_model_len
        )
        return original(*bound.args, **bound.kwargs)

    return attn_update_stack_num_spec_norm


class _MaskedLengthsGroup:
    """The attention group handed to one ``attn_update_stack_num_spec_norm`` call. The release's body (fingerprinted:
    0.18.0, 0.19.1rc1) asks it for nothing but ``get_metadata_builder()`` and calls nothing of that builder but
    ``build_for_drafting(common_attn_metadata=..., draft_index=...)``, which masks the draft rows' lengths before
    building (see :func:`make_attn_update_stack_num_spec_norm`)."""

    def __init__(self, group: Any, previous: Any, rows: int, max_model_len: int) -> None:
        self._zb_group, self._zb_previous, self._zb_rows, self._zb_max = group, previous, rows, max_model_len

    def get_metadata_builder(self) -> _MaskedLengthsBuilder:
        return _MaskedLengthsBuilder(self._zb_group.get_metadata_builder(), self)


class _MaskedLengthsBuilder:
    def __init__(self, builder: Any, group: _MaskedLengthsGroup) -> None:
        self._zb_builder, self._zb_group = builder, group

    def build_for_drafting(self, common_attn_metadata: Any, **kwargs: Any) -> Any:
        group = self._zb_group
        mask_draft_lengths(common_attn_metadata, group._zb_previous, group._zb_rows, group._zb_max)
        return self._zb_builder.build_for_drafting(common_attn_metadata=common_attn_metadata, **kwargs)


def mask_draft_lengths(common: Any, previous: Any, rows: int, max_model_len: int) -> None:
    """``common``'s lengths ``[:rows]`` = ``previous``'s + 1, set to 1 past ``max_model_len`` (vllm-ascend #10112)."""
    import torch

    lengths = previous.seq_lens[:rows] + 1
    common.seq_lens[:rows] = torch.where(lengths > max_model_len, torch.ones_like(lengths), lengths)
    for name in ("seq_lens_cpu", "_seq_lens_cpu"):
        before = getattr(previous, name, None)
        after = getattr(common, name, None)
        if before is None or after is None:
            continue
        host = before[:rows] + 1
        after[:rows] = torch.where(host > max_model_len, torch.ones_like(host), host)


def patch(
    proposer: str,
    fingerprints: Mapping[str, str],
    *,
    remove_when: str,
    native_fingerprints: Mapping[str, str] | None = None,
) -> Patch:
    """The fix for an adapter whose proposer class is ``proposer`` (``"module:Class"``)."""
    return Patch(
        id=ID,
        rests_on=RestsOn(
            ONE_STREAM,
            "device ops on the common metadata's device seq_lens, queued on the drafter's stream before the draft "
            "forward reads them, and host ops on its host copy; no host wait",
        ),
        target=f"{proposer}.attn_update_stack_num_spec_norm",
        make=make_attn_update_stack_num_spec_norm,
        fingerprints=fingerprints,
        native_fingerprints=native_fingerprints or {},
        why="(vllm-ascend #9221 / #9235 'MTP tokens out-of-range'; fixed by #10112 on releases/v0.18.0, unreleased, "
        "and #10147 in 0.21.0rc1) For draft steps 1 .. k-1 the proposer adds 1 to each draft row's sequence length and sets it "
        "to 1 for requests past max_model_len: on the device by the step's position (>= max_model_len), on the host by "
        "the new length (>= max_model_len). They disagree: a length reaching max_model_len gets it on the device and 1 "
        "on the host, also for a row whose position is still below the limit (the lengths count the step's rejected "
        "drafts), so its draft attends to one KV entry; a row masked once gets 1 on the device and 2, 3, ... on the "
        "host next. Ascend attention reads the host lengths (FIA actual_seq_lengths_kv), other kernels the device "
        "ones: the MTP out-of-range errors #9221 fixed near max_model_len. #9221's input_fits_in_drafter (skip the "
        "drafter) was reverted on releases/v0.18.0 by #10112 because it diverged across DP ranks and hung MoE models "
        "(vLLM #44185).",
        how="Wrapper (zb_patch.versions.fixes.draft_seq_lens_max_model_len). The release's body runs with a stand-in "
        "for its attn_group whose metadata builder, before it builds a draft step, rewrites the draft rows' lengths of "
        "the step's common metadata to the previous step's + 1, set to 1 where that exceeds max_model_len, on the "
        "device (seq_lens) and the host (seq_lens_cpu, and _seq_lens_cpu where the class has it): the masks of #10112 "
        "/ #10147. The previous lengths are the metadata the step was derived from, which the release clones before "
        "adding. Device ops on the device tensor, host ops on the host one: no wait. EAGLE and MTP, with or without "
        "async scheduling and zero-bubble. Tokens do not change (drafts are verified); drafts do: the host mask also "
        "hit rows whose position is below the limit, and their draft attended to one KV entry (docs/e2e.md, "
        "vllm-ascend 0.18: one more draft accepted with the fix).",
        upstream=("vllm-ascend#10112", "vllm-ascend#10147", "vllm-ascend#9221", "vllm-ascend#9235", "vllm#44185"),
        remove_when=remove_when,
    )
