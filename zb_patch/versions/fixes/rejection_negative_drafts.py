"""rejection-negative-drafts (vllm-ascend #10045, fixed by #10043 from 0.21.0rc1; 0.18.0's kernel by #8531): vllm-ascend
0.13's random-sampling rejection path (temperature > 0) reads a ``-1`` draft placeholder as a vocabulary index. The
wrapper hands the release non-negative drafts only and makes each placeholder count as rejected. Adapter ascend-0.13;
spec: :func:`patch`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from ...registry import ONE_STREAM, Patch, RestsOn

ID = "rejection-negative-drafts"


def make_rejection_sample(original: Callable) -> Callable:
    """Wrap vllm-ascend's ``rejection_sample`` (the function vLLM's ``RejectionSampler.forward`` calls, bound into
    ``vllm.v1.sample.rejection_sampler`` by vllm-ascend's ``patch_rejection_sampler``).

    A batch of only greedy requests goes to the release unchanged: its greedy kernels only compare a draft with the
    target's argmax, which a ``-1`` never equals. Otherwise, per request, the first negative draft at position ``p``
    is, as in #10043: rejected, the token at ``p`` a sample of the target distribution there (nothing left out), no
    token after it and no bonus token. Device ops only, no host wait:

    1. the drafts handed to the release are clamped to >= 0 (its kernels read ``target_probs`` / ``draft_probs`` at
       ``row * vocab + draft``, and its recovered-token kernel zeroes and restores that entry: for ``-1`` the previous
       row's last entry, or before the buffer for the first row);
    2. for the placeholders of non-greedy requests, ``target_probs[:, 0]`` (the column of the clamped draft) is set to
       0 while the release runs and restored after: the acceptance test ``target / draft >= uniform`` fails there
       (but for a uniform draw of exactly 0; in block verify ``pi`` is 0 from ``p`` on), so the release rejects at
       ``p`` as #10043's kernels do;
    3. the release's recovered token at ``p`` leaves token 0 out (the n-gram / MTP path zeroes the draft's column), so
       where ``p`` was reached it is replaced by a sample of the target distribution at ``p`` drawn before step 2
       (exponential race, ``argmax(probs / q)``, as the release samples; from the default generator, also for a seeded
       request); with ``draft_probs`` (which vllm-ascend 0.13's runner never passes: it hands the sampler None) the
       release's recovered token is kept, a sample of ``max(target - draft, 0)`` without token 0 at the placeholder;
    4. every token after ``p`` is set to the placeholder (greedy rows too: the clamped draft may have matched).
    """
    import torch

    @functools.wraps(original)
    def rejection_sample(
        draft_token_ids,
        num_draft_tokens,
        max_spec_len,
        cu_num_draft_tokens,
        draft_probs,
        target_probs,
        bonus_token_ids,
        sampling_metadata,
        *args,
        **kwargs,
    ):
        num_tokens = draft_token_ids.shape[0]
        if sampling_metadata.all_greedy or num_tokens == 0 or max_spec_len == 0:
            return original(
                draft_token_ids,
                num_draft_tokens,
                max_spec_len,
                cu_num_draft_tokens,
                draft_probs,
                target_probs,
                bonus_token_ids,
                sampling_metadata,
                *args,
                **kwargs,
            )
        from vllm.v1.sample.rejection_sampler import GREEDY_TEMPERATURE, PLACEHOLDER_TOKEN_ID

        device = draft_token_ids.device
        # per request, its drafts as a [batch, max_spec_len] grid (the release's own indexing)
        ends = cu_num_draft_tokens.long()
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        positions = torch.arange(max_spec_len, device=device)
        grid = (starts[:, None] + positions[None, :]).clamp(0, num_tokens - 1)
        valid = positions[None, :] < (ends - starts)[:, None]
        placeholder = (draft_token_ids[grid] < 0) & valid
        has_placeholder = placeholder.any(dim=1)
        first = placeholder.int().argmax(dim=1)  # the first placeholder's position (0 where there is none)
        first_token = grid.gather(1, first[:, None]).squeeze(1)
        greedy = sampling_metadata.temperature == GREEDY_TEMPERATURE
        # 3. the token for a reached placeholder: a sample of the full target distribution there, drawn before step 2
        resampled = None
        if draft_probs is None:
            rows = target_probs.index_select(0, first_token)
            scores = rows / torch.empty_like(rows).exponential_()
            resampled = torch.where(rows > 0, scores, torch.zeros_like(scores)).argmax(dim=1)  # no 0 / 0
        # 2. the placeholders of non-greedy requests: target probability 0 at the clamped draft (column 0)
        poisoned = torch.zeros(num_tokens, dtype=torch.float32, device=device).index_add_(
            0, grid.flatten(), (placeholder & ~greedy[:, None]).flatten().float()
        )
        column = target_probs[:, 0].clone()
        target_probs[:, 0] = torch.where(poisoned > 0, torch.zeros_like(column), column)
        try:
            output = original(
                draft_token_ids.clamp(min=0),  # 1.
                num_draft_tokens,
                max_spec_len,
                cu_num_draft_tokens,
                draft_probs,
                target_probs,
                bonus_token_ids,
                sampling_metadata,
                *args,
                **kwargs,
            )
        finally:
            target_probs[:, 0] = column
        columns = torch.arange(output.shape[1], device=device)[None, :]
        at_first = columns == first[:, None]
        if resampled is not None:
            reached = output.gather(1, first[:, None]).squeeze(1) != PLACEHOLDER_TOKEN_ID
            replace = at_first & (has_placeholder & ~greedy & reached)[:, None]
            output.copy_(torch.where(replace, resampled[:, None].to(output.dtype), output))
        # 4.
        output.masked_fill_(has_placeholder[:, None] & (columns > first[:, None]), PLACEHOLDER_TOKEN_ID)
        return output

    return rejection_sample


def patch(fingerprints: Mapping[str, str], *, release_lines: str, remove_when: str) -> Patch:
    """The ``rejection-negative-drafts`` patch (``release_lines``: where the release's random path and kernels read a
    draft as an index)."""
    return Patch(
        id=ID,
        rests_on=RestsOn(
            ONE_STREAM,
            "device ops queued before and after the release's rejection kernels on the sampler's stream (program "
            "order): a clamp of the drafts, an edit of target_probs[:, 0] restored after the release, one sample per "
            "request and masked writes to the output; the semantics are vllm-ascend #10043's (0.21.0rc1)",
        ),
        target="vllm_ascend.sample.rejection_sampler:rejection_sample",
        aliases=("vllm.v1.sample.rejection_sampler:rejection_sample",),
        make=make_rejection_sample,
        fingerprints=fingerprints,
        why="(vllm-ascend #10045) Unless the batch is all greedy, a `-1` draft (PD decode + MTP) is read as an "
        "index: `row * vocab - 1` in Triton kernels, `target_probs[t, -1]` (accepted) in the torch path. "
        f"Here: {release_lines}.",
        how="Wrapper (zb_patch.versions.fixes.rejection_negative_drafts) of rejection_sample and its binding in "
        "vllm.v1.sample.rejection_sampler. A batch of greedy requests only: unchanged. Otherwise the release is "
        "handed the drafts clamped to >= 0 and, for the placeholders of non-greedy requests, target probability 0 "
        "at the clamped draft (restored after), so it rejects the first placeholder; the token there is replaced "
        "by a sample of the unmodified target distribution at that position (the release's recovered token leaves "
        "the clamped draft out), and every token after it is dropped. As #10043: a negative draft counts as "
        "rejected and its token is sampled from the target distribution (here from the default generator, also "
        "for a seeded request, whose other tokens are the release's). Device ops, no host wait; one extra "
        "[batch, vocab] sample per step with a non-greedy request.",
        upstream=("vllm-ascend#10045", "vllm-ascend#10043"),
        remove_when=remove_when,
    )
