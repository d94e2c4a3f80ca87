"""Batch-change bookkeeping: where each request of this step sat in the previous step's batch.

Zero-bubble keeps last step's per-row results on the device (``valid_sampled_token_count``,
``num_computed_tokens``, sampled / draft token ids) in the *previous* row order, and reads them
for the *current* rows.  Between two steps the persistent batch changes: finished and unscheduled
requests leave holes, new and resumed requests fill the smallest holes, ``condense()`` slides the
last rows into the remaining holes, and attention backends may reorder rows (decodes first).  The
only safe way to read a previous-step value for current row ``r`` is through ``prev_positions[r]``.

Nothing here imports vLLM or knows a release; callers pass plain sequences, mappings and arrays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["compute_prev_positions", "remap_accepted_counts", "snapshot_rows"]


def compute_prev_positions(
    req_ids: Sequence[str | None],
    prev_req_id_to_index: Mapping[str, int] | None,
    num_reqs: int,
    out: np.ndarray,
) -> np.ndarray:
    """Fill ``out[:num_reqs]`` with each current row's index in the previous batch (-1: not there).

    Mirrors ``GPUModelRunner._compute_prev_positions`` (vLLM 0.19+, #32951; vllm-ascend inherits it
    from 0.19.1rc1).  ``prev_req_id_to_index`` is the previous step's *sampled* rows (vLLM builds it
    in ``_bookkeeping_sync`` without the discarded partial-prefill rows, so those map to -1 too).
    ``None`` or empty means no previous batch: every row is new.

    Returns ``out[:num_reqs]`` (a view).
    """
    view = out[:num_reqs]
    if not prev_req_id_to_index:
        view.fill(-1)
        return view
    get = prev_req_id_to_index.get
    for i in range(num_reqs):
        rid = req_ids[i]
        view[i] = -1 if rid is None else get(rid, -1)
    return view


def remap_accepted_counts(
    prev_positions: np.ndarray,
    prev_num_accepted: np.ndarray,
    num_reqs: int,
    out: np.ndarray,
    *,
    num_prev: int | None = None,
    new_value: int = 1,
) -> np.ndarray:
    """Carry the previous step's accepted-token counts into the current row order.

    ``out[r] = prev_num_accepted[prev_positions[r]]`` for rows that were in the previous batch, and
    ``new_value`` (1: "one token accepted", the non-spec value vLLM uses) for new rows.  This is vLLM
    #38556 fix 2 (ported to vllm-ascend in #8461): ``num_accepted_tokens_cpu`` is indexed by the
    previous step's rows, so reading it at the current row after ``condense()`` / a reorder hands a
    request another request's count (hybrid models then read the wrong Mamba state).

    ``prev_num_accepted`` must be a snapshot in the previous row order that no later batch change
    has touched (vllm-ascend #13865 keeps it in runner-owned buffers for that reason; see
    :func:`snapshot_rows`).  ``num_prev`` bounds valid previous rows (default: the snapshot
    length); out-of-range previous positions count as new rows instead of reading stale memory.
    ``out`` may alias nothing that ``prev_num_accepted`` aliases.

    Returns ``out[:num_reqs]``.
    """
    prev = np.asarray(prev_positions[:num_reqs])
    bound = len(prev_num_accepted) if num_prev is None else min(int(num_prev), len(prev_num_accepted))
    in_prev = (prev >= 0) & (prev < bound)
    gathered = np.asarray(prev_num_accepted)[np.where(in_prev, prev, 0)] if bound > 0 else np.zeros_like(prev)
    view = out[:num_reqs]
    view[:] = np.where(in_prev, gathered, new_value)
    return view


def snapshot_rows(values: np.ndarray, num_rows: int) -> np.ndarray:
    """A private copy of ``values[:num_rows]`` taken before the batch changes (see remap above)."""
    return np.array(values[:num_rows], copy=True)
