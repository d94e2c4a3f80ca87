"""valid-count-int64 (vllm-ascend #10205, native from 0.21.0rc1): the host valid-count buffer is int32 while the Ascend
proposer's device counts are int64, and the dtype-converting copy blocks the host. Adapter ascend-0.19-0.25; spec:
:func:`patch`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from ...registry import UPSTREAM, Patch, RestsOn

ID = "valid-count-int64"


def make_runner_init_int64_valid_count(original):
    """Wrap ``NPUModelRunner.__init__``: after the release's own constructor, re-create the pinned CPU valid-count
    buffer as int64, exactly as #10205 does (same condition, shape, device and pinning)."""
    import torch

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        # vllm-ascend #10205: reinit valid_sampled_token_count_cpu with torch.int64 dtype
        if self.use_async_scheduling and self.num_spec_tokens:
            self.valid_sampled_token_count_cpu = torch.empty(
                self.max_num_reqs,
                dtype=torch.int64,
                device="cpu",
                pin_memory=self.pin_memory,
            )

    return __init__


def patch(fingerprints: Mapping[str, str], *, native_fingerprints: Mapping[str, str]) -> Patch:
    """The fix for an adapter (``fingerprints`` of ``NPUModelRunner.__init__``)."""
    return Patch(
        id=ID,
        rests_on=RestsOn(
            UPSTREAM,
            "vllm-ascend #10205 (native from 0.21.0rc1, run on NPUs there): the valid-count buffers are int64, as the Ascend proposer writes them",
        ),
        target="vllm_ascend.worker.model_runner_v1:NPUModelRunner.__init__",
        make=make_runner_init_int64_valid_count,
        fingerprints=fingerprints,
        native_fingerprints=native_fingerprints,
        why="(pitfall P1) vLLM's GPUModelRunner.__init__ allocates valid_sampled_token_count_cpu as int32, but Ascend's "
        "prepare_next_token_ids_padded returns valid_mask.sum(dim=1), an int64 device tensor. The "
        "`copy_(counts, non_blocking=True)` then converts dtypes, which torch_npu turns into a blocking copy: a "
        "hidden host sync every step under async scheduling + spec decode (0.20.2rc1 worked around part of it by "
        "moving the copy after the drafter, #9656).",
        how="Wrap NPUModelRunner.__init__ (the target that tells the releases apart: _copy_valid_sampled_token_count is "
        "identical in 0.20.2rc1, which lacks the fix, and 0.21.0rc1+, which has it): after the original, when "
        "async scheduling and spec decode are on, re-create the buffer as int64 with the same size and pinning, "
        "as #10205 does. #9656's later copy placement in 0.20.2rc1 stays (harmless with a same-dtype copy).",
        upstream=("vllm-ascend#10205", "vllm-ascend#9656"),
        remove_when="vllm-ascend >= 0.21.0rc1 (native there: the installed __init__ has a post-#10205 fingerprint).",
        roles=("worker",),
    )
