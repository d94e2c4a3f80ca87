"""mla-draft-rope-rows (no upstream fix; from vllm-ascend #5940 over #5277): with an MLA / SFA target and k >= 2, every
draft position's decode RoPE rows are views of one buffer that each later position's metadata build rewrites. Three
patches, one group: ``get_cos_and_sin_mla`` and the proposer's ``_propose`` / ``dummy_run``. Adapters ascend-0.18,
ascend-0.19-0.25; specs: :func:`patches`.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping

from ...registry import ONE_STREAM, Patch, RestsOn

ID = "mla-draft-rope-rows"

ROPE_ROWS_ATTR = "_zb_patch_rope_rows"  # per-proposer: [(cos rows, sin rows)] by draft position
_DRAFTING = threading.local()  # .call: the proposer call in progress on this thread (a _DraftCall) or None


@dataclasses.dataclass
class _DraftCall:
    rows: list  # the proposer's buffers, by draft position
    positions: int  # num_speculative_tokens: builds past that many keep the release's rows
    built: int = 0  # decode RoPE builds so far in this call


def make_drafting(original: Callable) -> Callable:
    """Wrap a proposer method that builds the metadata of its draft positions in order (``_propose`` at run time,
    ``dummy_run`` for FULL-graph capture): while it runs, the n-th decode RoPE build of this thread is draft
    position n's (:func:`make_get_cos_and_sin_mla`)."""

    @functools.wraps(original)
    def drafting(proposer, *args, **kwargs):
        outer = getattr(_DRAFTING, "call", None)
        rows = proposer.__dict__.setdefault(ROPE_ROWS_ATTR, [])
        _DRAFTING.call = _DraftCall(rows, proposer.num_speculative_tokens)
        try:
            return original(proposer, *args, **kwargs)
        finally:
            _DRAFTING.call = outer

    return drafting


def make_get_cos_and_sin_mla(original: Callable) -> Callable:
    """Wrap ``rotary_embedding.get_cos_and_sin_mla``: inside a proposer call (:func:`make_drafting`), the decode
    rows (``use_cache=True``) of draft position n are returned from a static buffer of position n's own.

    The release writes the rows into the one static buffer ``_cos_mla`` / ``_sin_mla`` and returns views of it; the
    proposer builds the metadata of every draft position before its model runs, so each later build rewrites the
    rows an earlier position reads. The wrapper lets the release write and then copies the rows it wrote into
    position n's buffer, allocated once like the shared one: every position keeps its rows, at the same address at
    every build, at capture and at run time (a captured FULL graph reads what the next build writes). Outside a
    proposer call (the target's builds), for rows of another layout, and past the k-th build of one call, the
    release's result is returned unchanged."""

    @functools.wraps(original)
    def get_cos_and_sin_mla(positions, use_cache=False):
        cos, sin = original(positions, use_cache)
        call = getattr(_DRAFTING, "call", None)
        if not use_cache or call is None:
            return cos, sin
        from vllm_ascend.ops import rotary_embedding as rope

        shared_cos, shared_sin = rope._cos_mla, rope._sin_mla
        if call.built >= call.positions or cos.untyped_storage().data_ptr() != shared_cos.untyped_storage().data_ptr():
            return cos, sin
        if call.built == len(call.rows):
            call.rows.append((shared_cos.new_empty(shared_cos.shape), shared_sin.new_empty(shared_sin.shape)))
        own_cos, own_sin = call.rows[call.built]
        call.built += 1
        n = cos.shape[0]
        own_cos[:n].copy_(cos)
        own_sin[:n].copy_(sin)
        return own_cos[:n], own_sin[:n]

    return get_cos_and_sin_mla


def patches(
    proposer: str,
    rope_rows: Mapping[str, str],
    propose: Mapping[str, str],
    dummy_run: Mapping[str, str],
    remove_when: str,
) -> tuple[Patch, Patch, Patch]:
    """The ``mla-draft-rope-rows`` group for an adapter: ``get_cos_and_sin_mla`` and the proposer class ``proposer``'s
    ``_propose`` / ``dummy_run``, with that adapter's fingerprints of each."""
    why = (
        "The MLA / SFA decode metadata's RoPE rows (decode.cos / decode.sin) are views of one static buffer "
        "(get_cos_and_sin_mla(positions, use_cache=True): `_cos_mla[:n] = rows`, returns `_cos_mla[:n]`). The EAGLE / "
        "MTP proposer builds the metadata of every draft position before its model runs (_propose: step 0, then "
        "attn_update_stack_num_spec_norm for steps 1 .. k-1; dummy_run the same for FULL capture), so from k = 2 on "
        "each later build rewrites the rows the earlier positions read: a draft pass applies another pass's rotary "
        "positions. The release's comment there notes that only slot_mapping gets memory per step. Tokens do not "
        "change (drafts are verified); acceptance does: at k = 3 the last draft position was never accepted on the "
        "MLA model of docs/e2e.md (vllm-ascend 0.18.0 and 0.23.0), and drafts differed between sync and async "
        "scheduling with the batch. No upstream issue or fix found. It arises from vllm-ascend #5940 (one merged graph "
        "for all draft passes: every position built first, slot_mapping given a buffer per step) over #5277 (the MLA "
        "builder's RoPE rows cached as views)."
    )
    upstream = ("vllm-ascend#5940", "vllm-ascend#5277")
    drafting_how = (
        "Wrapper (zb_patch.versions.fixes.mla_draft_rope_rows.make_drafting): marks the call on its thread, so that the decode RoPE "
        "builds made inside it are numbered by draft position (mla-draft-rope-rows)."
    )
    rows = Patch(
        id="mla-draft-rope-rows",
        rests_on=RestsOn(
            ONE_STREAM,
            "one device copy per draft build into buffers owned by that draft position, queued on the drafter's stream before the position's forward or captured graph reads them (program order; fixed addresses, as the release's own shared buffer)",
        ),
        group="mla-draft-rope-rows",
        target="vllm_ascend.ops.rotary_embedding:get_cos_and_sin_mla",
        aliases=(
            "vllm_ascend.attention.mla_v1:get_cos_and_sin_mla",
            "vllm_ascend.attention.sfa_v1:get_cos_and_sin_mla",
        ),
        make=make_get_cos_and_sin_mla,
        fingerprints=rope_rows,
        why=why,
        how="Wrapper (zb_patch.versions.fixes.mla_draft_rope_rows), with the two proposer wrappers of its group. While the proposer's "
        "_propose or dummy_run runs on a thread, its n-th decode RoPE build (n < k) gets the rows the release just "
        "wrote copied into draft position n's own static buffer (allocated once, like the shared one) and views of "
        "that copy: every position keeps its rows, at the same address at every build, at capture and at run time (a "
        "captured FULL graph reads what the next build writes). The target's builds, outside a proposer call, are the "
        "release's. One device copy per draft build, no host wait. Speculative decoding with an MLA / SFA target, "
        "sync or async. A batch without decode rows at draft position 0 (prefill only) makes k - 1 builds: they take "
        "the first buffers, still one each. With more than one draft attention group a call would make more than k "
        "builds, and those past the k-th keep the release's shared rows.",
        upstream=upstream,
        remove_when=remove_when,
    )

    def drafting(patch_id: str, method: str, fingerprints: Mapping[str, str], why: str) -> Patch:
        return Patch(
            id=patch_id,
            rests_on=rows.rests_on,
            group="mla-draft-rope-rows",
            target=f"{proposer}.{method}",
            make=make_drafting,
            fingerprints=fingerprints,
            why=why,
            how=drafting_how,
            upstream=("vllm-ascend#5940",),
            remove_when=remove_when,
        )

    return (
        rows,
        drafting(
            "mla-draft-rope-rows-propose",
            "_propose",
            propose,
            "Half of mla-draft-rope-rows (same group): the proposer's run-time call that builds the metadata of every "
            "draft position, in order, before the draft model runs.",
        ),
        drafting(
            "mla-draft-rope-rows-dummy-run",
            "dummy_run",
            dummy_run,
            "Third part of mla-draft-rope-rows (same group): the proposer's dummy run, which builds every draft "
            "position's metadata for a FULL-graph capture; the captured graph must read the buffers the run-time "
            "builds write.",
        ),
    )
