"""seq-lens-cpu-unpadded (vllm-ascend #8749's unpadded() part, native from 0.20.2rc1): the sub-batch view of the
common attention metadata drops the host seq-lens mirrors, so the drafter's builders read the lengths back from the
device every step. Adapter ascend-0.19-0.25; spec: :func:`patch`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from ...registry import UPSTREAM, Patch, RestsOn

ID = "seq-lens-cpu-unpadded"


# Per-request fields of AscendCommonAttentionMetadata that 0.19.1rc1's unpadded() drops and #8749 carries through
# (sliced to the real requests), and batch-level fields it carries as they are.
_UNPADDED_PER_REQUEST = (
    "_seq_lens_cpu",
    "_num_computed_tokens_cpu",
    "dcp_local_seq_lens",
    "dcp_local_seq_lens_cpu",
    "is_prefilling",
    "encoder_seq_lens",
    "encoder_seq_lens_cpu",
)
_UNPADDED_AS_IS = ("logits_indices_padded", "num_logits_indices")


def make_unpadded(original):
    """Wrap ``AscendCommonAttentionMetadata.unpadded``: the release builds the sub-batch view; the wrapper adds the
    fields it drops (the private CPU mirrors above all), sliced to ``num_actual_reqs``, via dataclasses.replace.
    Fields the installed class does not have are skipped."""
    import dataclasses

    @functools.wraps(original)
    def unpadded(self, num_actual_tokens, num_actual_reqs):
        view = original(self, num_actual_tokens, num_actual_reqs)
        names = {f.name for f in dataclasses.fields(view) if f.init}
        carried = {}
        for name in _UNPADDED_PER_REQUEST:
            if name in names:
                value = getattr(self, name)
                carried[name] = value[:num_actual_reqs] if value is not None else None
        for name in _UNPADDED_AS_IS:
            if name in names:
                carried[name] = getattr(self, name)
        return dataclasses.replace(view, **carried) if carried else view

    return unpadded


def patch(fingerprints: Mapping[str, str], *, native_fingerprints: Mapping[str, str]) -> Patch:
    """The fix for an adapter (``fingerprints`` of ``AscendCommonAttentionMetadata.unpadded``)."""
    return Patch(
        id=ID,
        rests_on=RestsOn(
            UPSTREAM,
            "vllm-ascend #8749 (native from 0.20.2rc1, run on NPUs there): the sub-batch view keeps the host fields it dropped; host metadata only",
        ),
        target="vllm_ascend.attention.utils:AscendCommonAttentionMetadata.unpadded",
        make=make_unpadded,
        fingerprints=fingerprints,
        native_fingerprints=native_fingerprints,
        why="(pitfall P5b) In async + spec mode the runner passes seq_lens_cpu=None and only _seq_lens_cpu (the "
        "optimistic CPU mirror, #7640). unpadded(), which the runner calls whenever the target batch was padded, "
        "drops _seq_lens_cpu / _num_computed_tokens_cpu (and the DCP, encoder, is_prefilling and fast-prefill "
        "fields), so the drafter's metadata has no CPU mirror and the attention builders fall back to "
        "seq_lens.to('cpu'): a hidden device->host sync in the drafter every step.",
        how="Wrap the method: after the release builds the sub-batch view, carry the fields it drops into it "
        "(dataclasses.replace), per-request ones sliced to num_actual_reqs, as #8749 (931604054f) does.",
        upstream=("vllm-ascend#8749", "vllm-ascend#7640"),
        remove_when="vllm-ascend >= 0.20.2rc1 (native there).",
        roles=("worker",),
    )
