"""seq-lens-cpu-prepare-inputs-padded (vllm-ascend #8749's proposer part, native from 0.20.2rc1): the drafter's padded
inputs drop the host seq-lens mirrors, so its builders read the lengths back from the device every step. Adapter
ascend-0.19-0.25; spec: :func:`patch`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from ...registry import UPSTREAM, Patch, RestsOn

ID = "seq-lens-cpu-prepare-inputs-padded"


def make_prepare_inputs_padded(original):
    """Wrap ``AscendSpecDecodeBaseProposer.prepare_inputs_padded``: the metadata it builds gets the two private CPU
    mirrors #8749 passes to its constructor (set on the freshly built object, nothing else changes)."""

    @functools.wraps(original)
    def prepare_inputs_padded(self, common_attn_metadata, *args, **kwargs):
        out = original(self, common_attn_metadata, *args, **kwargs)
        spec_common_attn_metadata = out[0]
        # vllm-ascend #8749: pass both CPU mirrors through unchanged (seq_lens are not changed here)
        spec_common_attn_metadata._seq_lens_cpu = common_attn_metadata._seq_lens_cpu
        spec_common_attn_metadata._num_computed_tokens_cpu = common_attn_metadata._num_computed_tokens_cpu
        return out

    return prepare_inputs_padded


def patch(fingerprints: Mapping[str, str], *, native_fingerprints: Mapping[str, str]) -> Patch:
    """The fix for an adapter (``fingerprints`` of ``AscendSpecDecodeBaseProposer.prepare_inputs_padded``)."""
    return Patch(
        id=ID,
        rests_on=RestsOn(
            UPSTREAM,
            "vllm-ascend #8749 (native from 0.20.2rc1, run on NPUs there): the drafter's padded inputs keep the host seq_lens; host metadata only",
        ),
        # 0.19.1rc1 defines the class in eagle_proposer; from 0.20.2rc1 on eagle_proposer re-exports it from
        # llm_base_proposer, and the target resolves to (and fingerprints) that definition.
        target="vllm_ascend.spec_decode.eagle_proposer:AscendSpecDecodeBaseProposer.prepare_inputs_padded",
        make=make_prepare_inputs_padded,
        fingerprints=fingerprints,
        native_fingerprints=native_fingerprints,
        why="(pitfall P5b) The drafter's metadata built by prepare_inputs_padded (the async padded-drafter path) keeps "
        "seq_lens_cpu (None in async mode) but drops _seq_lens_cpu / _num_computed_tokens_cpu, so the drafter's "
        "attention builders take the seq_lens.to('cpu') fallback: a device->host sync every step.",
        how="Wrap the method: set _seq_lens_cpu and _num_computed_tokens_cpu of the metadata it returns from its input, "
        "which is what #8749 passes to the constructor. The method's own work (Triton/torch index math) is "
        "untouched.",
        upstream=("vllm-ascend#8749",),
        remove_when="vllm-ascend >= 0.20.2rc1 (native there).",
        roles=("worker",),
    )
