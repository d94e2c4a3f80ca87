"""cudagraph-batch-sizes-after-rounding (vllm-ascend #6860, in 0.19.1rc1): with FULL decode graphs and EAGLE the
runner's capture sizes are not the dispatcher's after vLLM rounds them to multiples of 1 + k, and the drafter's padding
lookup indexes past the dispatcher's table. Adapter ascend-0.18; spec: :func:`patch`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from ...registry import HOST, Patch, RestsOn

ID = "cudagraph-batch-sizes-after-rounding"


def make_check_and_update_cudagraph_mode(original: Callable) -> Callable:
    """Wrap ``NPUModelRunner._check_and_update_cudagraph_mode``: afterwards ``cudagraph_batch_sizes`` is the list the
    dispatcher was just initialised from.

    The runner sets ``cudagraph_batch_sizes`` from the configured capture sizes in its constructor; this method then
    lets vLLM resolve the graph mode and adjust the sizes (rounded up to multiples of 1 + k for FULL decode graphs
    with speculative decoding, capped for Mamba caches) before the dispatcher builds its padding table from them.
    The drafter pads ``num_tokens <= cudagraph_batch_sizes[-1]`` through that table, so a stale list larger than the
    table's last size indexes past it. The list is recomputed by the constructor's own rule from the adjusted
    configuration."""

    @functools.wraps(original)
    def _check_and_update_cudagraph_mode(runner, *args, **kwargs):
        result = original(runner, *args, **kwargs)
        from vllm.config import CUDAGraphMode

        config = runner.compilation_config
        sizes = config.cudagraph_capture_sizes
        runner.cudagraph_batch_sizes = sorted(sizes) if sizes and config.cudagraph_mode != CUDAGraphMode.NONE else []
        return result

    return _check_and_update_cudagraph_mode


def patch(fingerprints: Mapping[str, str], *, remove_when: str) -> Patch:
    """The fix for an adapter on vllm-ascend 0.18 (``fingerprints`` of ``NPUModelRunner._check_and_update_cudagraph_mode``)."""
    return Patch(
        id=ID,
        rests_on=RestsOn(
            HOST,
            "a host list (cudagraph_batch_sizes) recomputed at start-up from the configuration the dispatcher was initialised from",
        ),
        target="vllm_ascend.worker.model_runner_v1:NPUModelRunner._check_and_update_cudagraph_mode",
        make=make_check_and_update_cudagraph_mode,
        fingerprints=fingerprints,
        why="(vllm-ascend #6860, in 0.19.1rc1) NPUModelRunner.__init__ sets cudagraph_batch_sizes from the configured "
        "capture sizes; _check_and_update_cudagraph_mode then lets vLLM round them up to multiples of 1 + k for FULL "
        "decode graphs with speculative decoding (CompilationConfig.adjust_cudagraph_sizes_for_spec_decode: [1, 2, 4, 8, "
        "16] -> [3, 6, 9] at k = 2) and builds the dispatcher's padding table from the rounded list, but the runner's "
        "list is never refreshed. The EAGLE proposer pads `num_tokens <= cudagraph_batch_sizes[-1]` through that table "
        "(eagle_proposer.py:533-534): a draft batch of 10-16 tokens indexes past it, IndexError (sync) or a device-side "
        "assert (async), whenever the largest capture size is not a multiple of 1 + k (EAGLE k = 2 with the default "
        "sizes; MTP under async scheduling runs its drafter without graphs and is not affected).",
        how="Wrapper (zb_patch.versions.fixes.cudagraph_batch_sizes_after_rounding). After the release's body, cudagraph_batch_sizes is recomputed by "
        "the constructor's own rule (sorted capture sizes unless the mode is NONE) from the configuration the "
        "dispatcher was just initialised from, so the drafter's lookup stays within the table and sizes past the largest "
        "graph run without padding, as the dispatcher itself decides for them. cudagraph_batch_sizes has no other reader "
        "in vLLM 0.18 or vllm-ascend 0.18.0. Any graph mode, with or without speculative decoding (unchanged where nothing was adjusted). "
        "#6860 instead replaced the lookup with the dispatcher's dispatch (with its merged MTP graph).",
        upstream=("vllm-ascend#6860",),
        remove_when=remove_when,
    )
