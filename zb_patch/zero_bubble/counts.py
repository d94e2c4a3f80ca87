"""Host-side token-count bookkeeping of zero-bubble async spec decoding.

The async scheduler hands the runner, for step N+1, ``num_computed_tokens`` that already count all
of step N's ``d`` draft tokens as accepted (it subtracts the rejected ones later, in
``update_from_output``).  The classic runner (vLLM <= 0.18, vllm-ascend <= 0.18) blocks on step N's
accepted counts before preparing step N+1 to undo that optimism.  Zero-bubble (vLLM #32951) keeps
the CPU counts optimistic instead:

1. :func:`optimistic_advance` — what ``_update_states`` records instead of syncing: the request
   keeps the scheduler's (optimistic) count, its output ids grow by ``d`` placeholders, and ``d`` is
   remembered at the request's previous row for the device correction;
2. the device corrects the counts in-stream from the previous step's ``valid_sampled_token_count``
   (:mod:`zb_patch.zero_bubble.device`);
3. :func:`deferred_cpu_corrections` / :func:`apply_cpu_corrections` — after the forward has been
   launched the host waits for the accepted counts (now hidden behind the forward) and subtracts
   the rejected drafts from its CPU copies (the ``correct_spec_decode_token_counts`` closure);
4. :func:`optimistic_seq_lens` + :func:`correct_seq_lens_cpu` — Ascend attention (FIA / paged
   attention) needs *exact* CPU ``seq_lens`` before the launch; vllm-ascend 0.23 (#10506) subtracts
   the rejected drafts on the CPU once the counts have arrived;
5. :func:`backup_token_indices` / :func:`backup_next_token_ids` — the drafter's fallback next token
   for discarded rows is the last *committed* token, ``num_tokens_no_spec - 1`` (vLLM #38556 fixing
   #38098: indexing with the optimistic ``seq_lens`` returns the ``-1`` placeholder).

All functions take numpy arrays (or CPU tensors via ``.numpy()``), are release-agnostic and import
nothing from vLLM.  ``int`` inputs follow vLLM's dtypes: counts int32, positions int64.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import kernels

__all__ = [
    "optimistic_advance",
    "rejected_tokens",
    "deferred_cpu_corrections",
    "apply_cpu_corrections",
    "optimistic_seq_lens",
    "correct_seq_lens_cpu",
    "discard_request_mask",
    "backup_token_indices",
    "backup_next_token_ids",
]


def optimistic_advance(
    prev_index: Sequence[int],
    num_drafts: Sequence[int],
    prev_num_draft_tokens: np.ndarray,
    *,
    reset: bool = True,
) -> None:
    """Record step N's draft counts at the requests' step-N rows.

    ``prev_index[i]``: request i's row in the previous batch (-1 if absent), ``num_drafts[i]``: the
    drafts it was scheduled with in step N (``req_state.prev_num_draft_len``; each request gets that
    many ``-1`` output placeholders, all drafts assumed accepted, and hands it to
    :func:`deferred_cpu_corrections` later as ``optimistic``).  Writes
    ``prev_num_draft_tokens[prev_index[i]] = num_drafts[i]`` after zeroing the buffer (``reset``;
    vLLM 0.19 ``_update_states`` does ``prev_num_draft_tokens.np.fill(0)`` first so that rows of
    requests that left the batch do not participate).  A loop, not array ops: the runner calls it
    every step with one short list per batch, where building arrays costs more than the writes.
    """
    if reset:
        prev_num_draft_tokens.fill(0)
    for prev, drafts in zip(prev_index, num_drafts):
        if prev >= 0:
            prev_num_draft_tokens[prev] = drafts


def rejected_tokens(num_drafts: Any, valid_sampled_token_count: Any) -> Any:
    """Drafts rejected in a step: ``num_drafts + 1 - valid`` (valid = accepted drafts + the bonus /
    corrected token).  Scalars or arrays."""
    return num_drafts + 1 - valid_sampled_token_count


def deferred_cpu_corrections(
    prev_index: np.ndarray,
    optimistic: np.ndarray,
    valid_sampled_token_count: np.ndarray,
    *,
    num_prev: int | None = None,
) -> np.ndarray:
    """Amount to subtract from each queued request's optimistic CPU count once step N's counts are in.

    Mirrors vLLM 0.19's ``correct_spec_decode_token_counts`` closure: for a request queued by
    :func:`optimistic_advance` with ``optimistic`` drafts and previous row ``p >= 0``,
    ``correction = optimistic - (valid[p] - 1)`` (:func:`rejected_tokens`); requests without a previous
    row get 0.
    ``valid_sampled_token_count`` is the host copy in step N's row order (the caller waited on its
    event).  ``num_prev`` bounds the previous rows (default: the buffer length) — a row outside it
    gets 0 instead of a stale count.  Returns int64 corrections, one per queued request.
    """
    prev = np.asarray(prev_index, dtype=np.int64)
    opt = np.asarray(optimistic, dtype=np.int64)
    valid = np.asarray(valid_sampled_token_count)
    bound = len(valid) if num_prev is None else min(int(num_prev), len(valid))
    ok = (prev >= 0) & (prev < bound)
    if bound <= 0:
        return np.zeros_like(opt)
    gathered = valid[np.where(ok, prev, 0)].astype(np.int64)
    return np.where(ok, rejected_tokens(opt, gathered), 0)


def apply_cpu_corrections(
    num_computed_tokens_cpu: np.ndarray,
    cur_index: np.ndarray,
    corrections: np.ndarray,
) -> None:
    """``num_computed_tokens_cpu[cur_index[i]] -= corrections[i]`` for requests still in the batch.

    ``cur_index[i] < 0``: the request left the batch (the caller corrects its request state only).
    Runs after the forward launch.  vLLM's device path copied ``num_computed_tokens_cpu[:n]`` to the
    device non-blocking earlier in the step; the rows corrected here are exactly the participating
    rows, whose device value comes from ``prev + valid`` instead, so that in-flight copy may see
    either value without harm.  Any *other* in-place change of a host buffer that is the source of
    an in-flight copy is a race (the self-test plants one).
    """
    cur = np.asarray(cur_index, dtype=np.int64)
    corr = np.asarray(corrections)
    sel = cur >= 0
    if sel.any():
        np.subtract.at(num_computed_tokens_cpu, cur[sel], corr[sel].astype(num_computed_tokens_cpu.dtype))


def optimistic_seq_lens(
    num_computed_tokens_cpu: np.ndarray,
    num_scheduled_tokens: np.ndarray,
    num_reqs: int,
    out: np.ndarray,
) -> np.ndarray:
    """``out[:n] = num_computed_tokens_cpu[:n] + num_scheduled_tokens[:n]``; ``out[n:] = 0``.

    vLLM 0.19 ``_prepare_inputs`` (``optimistic_seq_lens_cpu``): exact for requests without drafts
    last step, too long by the rejected drafts otherwise.  Used for ``max_seq_len`` and the discard
    mask (both sides of that comparison carry the same optimism), and on Ascend corrected in place
    by :func:`correct_seq_lens_cpu` before attention metadata is built.
    """
    np.add(num_computed_tokens_cpu[:num_reqs], num_scheduled_tokens[:num_reqs], out=out[:num_reqs], casting="unsafe")
    out[num_reqs:] = 0
    return out[:num_reqs]


def correct_seq_lens_cpu(
    optimistic_seq_lens_cpu: np.ndarray,
    prev_positions: np.ndarray,
    prev_num_draft_tokens: np.ndarray,
    valid_sampled_token_count: np.ndarray,
    num_reqs: int,
    *,
    num_prev: int | None = None,
) -> None:
    """Exact CPU seq_lens for Ascend attention: subtract last step's rejected drafts in place.

    vllm-ascend 0.23 ``correct_optimistic_seq_lens_cpu`` (#10506); delegated to the numpy twin in
    :mod:`zb_patch.kernels` (participation as the device kernel: previous row in range and
    ``prev_num_draft_tokens[prev] > 0``).  The caller must have waited for step N's
    ``valid_sampled_token_count`` copy (vllm-ascend: ``valid_sampled_token_count_event``).
    """
    kernels.correct_optimistic_seq_lens_cpu(
        optimistic_seq_lens_cpu, prev_positions, prev_num_draft_tokens, valid_sampled_token_count, num_reqs, num_prev
    )


def discard_request_mask(seq_lens: np.ndarray, num_tokens: np.ndarray, num_reqs: int, out: np.ndarray) -> np.ndarray:
    """Rows whose sample is thrown away (partial prefill chunks): ``seq_lens < num_tokens``.

    With zero-bubble both sides are optimistic by the same placeholders (vLLM 0.19 compares
    ``optimistic_seq_lens_cpu`` with ``request.num_tokens``), so the mask is exact.
    """
    view = out[:num_reqs]
    np.less(seq_lens[:num_reqs], num_tokens[:num_reqs], out=view)
    return view


def backup_token_indices(num_tokens_no_spec: np.ndarray, num_reqs: int) -> np.ndarray:
    """Index of the drafter's backup next token per row: the last committed token.

    ``num_tokens_no_spec[:n] - 1`` (vLLM #38556 fix 1, vllm-ascend #8461).  Never derive it from the
    (optimistic) ``seq_lens``: under zero-bubble they count unverified drafts and point past the
    committed tokens, where ``get_token_id`` returns the ``-1`` placeholder (vLLM #38098).
    """
    return np.asarray(num_tokens_no_spec[:num_reqs], dtype=np.int64) - 1


def backup_next_token_ids(
    token_ids_cpu: np.ndarray,
    num_tokens_no_spec: np.ndarray,
    num_reqs: int,
    out: np.ndarray,
) -> np.ndarray:
    """``out[i] = token_ids_cpu[i, num_tokens_no_spec[i] - 1]`` (``-1`` where that index is < 0).

    ``token_ids_cpu`` is the persistent batch's ``[max_num_reqs, max_model_len]`` token table in the
    current row order (what ``requests[req_id].get_token_id(idx)`` reads in vLLM).
    """
    idx = backup_token_indices(num_tokens_no_spec, num_reqs)
    view = out[:num_reqs]
    if num_reqs:
        rows = np.arange(num_reqs)
        safe = np.clip(idx, 0, token_ids_cpu.shape[1] - 1)
        view[:] = np.where(idx >= 0, token_ids_cpu[rows, safe], -1)
    return view
