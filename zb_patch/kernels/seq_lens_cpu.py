"""CPU twin of vllm-ascend's exact-seq_lens correction (``correct_optimistic_seq_lens_cpu``, #10506).

Ascend attention (FIA / paged attention) needs *exact* CPU ``seq_lens``.  Under async spec
decoding the CPU values are optimistic: the scheduler advanced every request that had ``d`` drafts
last step by ``d + 1`` tokens.  Once the previous step's ``valid_sampled_token_count`` has reached
the host (its D2H copy was issued a whole step earlier, so waiting on its event is normally free),
the rejected tokens are subtracted on the CPU — the same numbers the device correction
(:func:`zb_patch.kernels.update_token_counts`) computes, without a device-to-host copy::

    rejected[r] = prev_num_draft_tokens[prev] + 1 - valid_sampled_token_count[prev]
    optimistic_seq_lens[r] -= rejected[r]        for participating rows r < num_reqs

Participation is the device kernel's: ``0 <= prev < num_prev`` and ``prev_num_draft_tokens[prev] > 0``.
``num_prev`` defaults to ``len(valid_sampled_token_count)`` (vllm-ascend passes its whole
``max_num_reqs`` host buffer, so this is its exact behaviour); pass the previous batch size to also
ignore stale rows past it (the hardening of the device side).  numpy (and torch's CPU tensors), no Triton.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ._checks import check_int, reject


def _as_numpy(name: str, a: Any) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    if isinstance(a, torch.Tensor):
        if a.device.type != "cpu":
            reject(name, a, "must be a CPU tensor or a numpy array (this is the host-side correction)")
        return a.numpy()  # zero-copy view
    return np.asarray(a)


def correct_optimistic_seq_lens_cpu(
    optimistic_seq_lens: Any,
    prev_positions: Any,
    prev_num_draft_tokens: Any,
    valid_sampled_token_count: Any,
    num_reqs: int,
    num_prev: int | None = None,
) -> None:
    """Subtract the previous step's rejected drafts from ``optimistic_seq_lens[:num_reqs]`` in place.

    ``optimistic_seq_lens`` is a 1-D integer numpy array or CPU torch tensor (corrected in place,
    so never a list); the other arrays may also be sequences.  Same order as vllm-ascend's function,
    plus the optional ``num_prev`` bound.  Bad arguments raise ``ValueError`` naming the argument.
    """
    if not isinstance(optimistic_seq_lens, (np.ndarray, torch.Tensor)):
        reject(
            "optimistic_seq_lens",
            optimistic_seq_lens,
            "must be a numpy array or a CPU torch tensor (it is corrected in place)",
        )
    seq = _as_numpy("optimistic_seq_lens", optimistic_seq_lens)
    arrays = {
        "optimistic_seq_lens": seq,
        "prev_positions": _as_numpy("prev_positions", prev_positions),
        "prev_num_draft_tokens": _as_numpy("prev_num_draft_tokens", prev_num_draft_tokens),
        "valid_sampled_token_count": _as_numpy("valid_sampled_token_count", valid_sampled_token_count),
    }
    for name, array in arrays.items():
        if array.ndim != 1 or not (array.dtype.kind in "iu" or array.size == 0):
            reject(name, array, "must be a 1-D integer array")
    num_reqs = check_int(
        "num_reqs",
        num_reqs,
        0,
        min(len(seq), len(arrays["prev_positions"])),
        "the lengths of optimistic_seq_lens and prev_positions",
    )
    if num_prev is not None:
        num_prev = check_int("num_prev", num_prev, 0)
    if num_reqs == 0:
        return
    prev = arrays["prev_positions"][:num_reqs]
    drafts_all = arrays["prev_num_draft_tokens"]
    valid_all = arrays["valid_sampled_token_count"]
    bound = len(valid_all) if num_prev is None else min(num_prev, len(valid_all))
    bound = min(bound, len(drafts_all))
    if bound <= 0:
        return
    in_prev = (prev >= 0) & (prev < bound)
    gather = np.where(in_prev, prev, 0)
    drafts = drafts_all[gather]
    participating = in_prev & (drafts > 0)
    rejected = (drafts.astype(np.int64) + 1 - valid_all[gather].astype(np.int64)) * participating
    seq[:num_reqs] -= rejected.astype(seq.dtype, copy=False)


__all__ = ["correct_optimistic_seq_lens_cpu"]
