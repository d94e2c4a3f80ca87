"""valid-count-copy-order (vllm-ascend #9456, native from 0.20.2rc1): the copy stream of the valid-token counts waits
on itself, so the D2H copy can run before the kernels that produce the counts. Adapter ascend-0.19-0.25; spec:
:func:`patch`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from ...registry import UPSTREAM, Patch, RestsOn

ID = "valid-count-copy-order"


def make_copy_valid_sampled_token_count(original):
    """Wrap ``NPUModelRunner._copy_valid_sampled_token_count``: order the copy stream after the default stream
    *before* the release's method runs.

    The release calls ``copy_stream.wait_stream(torch.npu.current_stream())`` inside ``with
    torch.npu.stream(copy_stream)``, where the current stream is the copy stream itself, so that wait orders
    nothing. Making the copy stream wait on the caller's (default) stream first gives the D2H copy the
    dependency #9456 restores: every kernel queued so far (rejection sampler, prepare_next_token_ids_padded)
    finishes before the counts are read. The release's own body then runs unchanged.
    """
    import torch

    @functools.wraps(original)
    def _copy_valid_sampled_token_count(self, next_token_ids, valid_sampled_tokens_count):
        if self.valid_sampled_token_count_event is not None:
            self.valid_sampled_token_count_copy_stream.wait_stream(torch.npu.current_stream())
        return original(self, next_token_ids, valid_sampled_tokens_count)

    return _copy_valid_sampled_token_count


def patch(fingerprints: Mapping[str, str], *, native_fingerprints: Mapping[str, str]) -> Patch:
    """The fix for an adapter whose releases copy the counts on a side stream (``fingerprints`` of
    ``NPUModelRunner._copy_valid_sampled_token_count``)."""
    return Patch(
        id=ID,
        rests_on=RestsOn(
            UPSTREAM,
            "vllm-ascend #9456 (native from 0.20.2rc1, run on NPUs there): the copy stream waits on the default stream before the valid-count copy",
        ),
        target="vllm_ascend.worker.model_runner_v1:NPUModelRunner._copy_valid_sampled_token_count",
        make=make_copy_valid_sampled_token_count,
        fingerprints=fingerprints,
        native_fingerprints=native_fingerprints,
        why="(pitfall P2) The release enters `with torch.npu.stream(copy_stream):` and only then calls "
        "`copy_stream.wait_stream(torch.npu.current_stream())`; inside the context the current stream IS the copy "
        "stream, so it waits on itself and the D2H copy of the valid-token counts can run before the "
        "sampler/drafter kernels that produce them finish: dirty counts, then num_accepted / num_computed_tokens "
        "overflow and a crash (vllm-ascend issue #9482).",
        how="Wrap the method: before the release's body, make the copy stream wait on the caller's (default) stream, "
        "the dependency #9456 restores by capturing the default stream outside the side-stream context. The "
        "release's own copy, event and stash of the device count run unchanged.",
        upstream=("vllm-ascend#9456", "vllm-ascend#9482", "vllm-ascend#8766"),
        remove_when="vllm-ascend >= 0.20.2rc1 (native there: the installed method has the fixed fingerprint).",
        roles=("worker",),
    )
