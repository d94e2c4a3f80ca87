"""A ``-1`` draft placeholder in vllm-ascend 0.13's random-sampling rejection path (vllm-ascend #10045, fixed by #10043
from 0.21.0rc1), patch ``rejection-negative-drafts``, on the release's real code: the release's
``AsyncRecomputeScheduler`` on a kv-consumer (a PD decode node) schedules a new request at temperature 1 with
``[-1] * k`` drafts, the release's ``NPUModelRunner`` prepares the step (``draft-placeholders-after-metadata`` and
``readded-request-drafts`` hand the sampler the ``-1``), and ``vllm.v1.sample.rejection_sampler.rejection_sample`` (the
binding vLLM's ``RejectionSampler.forward`` calls: vllm-ascend's function) samples it with the runner's own sampling
metadata, on the release's torch path (its Triton kernels need an NPU's vector-core count; they read and write
``target_probs`` at ``row * vocab + draft`` alike, out of the row for a ``-1``).

The target distribution puts all its mass on the last vocabulary token. Without the fix the torch path reads
``target_probs[t, -1]`` (that token's probability, 1) for each ``-1``, accepts both and appends the bonus token: the
request's first decode step emits the bonus token alone. With the fix the first ``-1`` is rejected and its token is
sampled from the target distribution (the last token), as #10043 does.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
FAMILY = npu_standin.detect_family()
if FAMILY != "0.13":
    pytest.skip(f"a fix of vllm-ascend 0.13; this env has {FAMILY}", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parity"))

FIX = "rejection-negative-drafts"
K, VOCAB, BONUS = 2, 16, 5
LAST = VOCAB - 1
P = -1  # vLLM's PLACEHOLDER_TOKEN_ID


@contextlib.contextmanager
def _release_torch_path():
    """The release's torch path on CPU: HAS_TRITON off (as tests/patches/test_draft_placeholders_after_metadata.py),
    host tensors unpinned (the random path asks for pinned ones, which a CPU-only torch cannot make; pinning changes
    no value)."""
    import functools

    import torch
    from vllm_ascend.sample import rejection_sampler

    def unpinned(make):
        @functools.wraps(make)
        def call(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return make(*args, **kwargs)

        return call

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rejection_sampler, "HAS_TRITON", False)
        for name in ("tensor", "arange", "full", "ones"):
            mp.setattr(torch, name, unpinned(getattr(torch, name)))
        yield


def _sampling_metadata(temperature, *, all_greedy, all_random, generators):
    """vLLM's SamplingMetadata for a batch without penalties, logprobs or logits processors (what the rejection path
    reads: the temperatures, the greedy / random flags and the per-request generators)."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    zeros = torch.zeros(0)  # no_penalties: never read
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=all_greedy,
        all_random=all_random,
        top_p=None,
        top_k=None,
        generators=generators,
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=zeros,
        presence_penalties=zeros,
        repetition_penalties=zeros + 1,
        output_token_ids=[],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def _drafts_and_target(requests):
    """The flat drafts and the target probabilities [drafts, VOCAB] of ``requests``: (drafts, {token: probability}
    per draft, ...) each."""
    import torch

    drafts = torch.tensor([t for r in requests for t in r[0]], dtype=torch.int32)
    target = torch.zeros(len(drafts), VOCAB)
    for i, dist in enumerate(dist for r in requests for dist in r[1]):
        for token, prob in dist.items():
            target[i, token] = prob
    return drafts, target


def _sample_and_unpatch(release, drafts, counts, draft_probs, target, sampling):
    """The output rows of ``vllm.v1.sample.rejection_sampler.rejection_sample`` (the binding vLLM's sampler calls, as
    patched now) on the release's torch path, requests of ``counts`` drafts each; the adapter is unpatched after."""
    import torch
    import vllm.v1.sample.rejection_sampler as vllm_rejection

    try:
        with _release_torch_path():
            return vllm_rejection.rejection_sample(
                drafts,
                counts,
                max(counts),
                torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32),
                draft_probs,
                target,
                torch.full((len(counts), 1), BONUS, dtype=torch.int32),
                sampling,
            ).tolist()
    finally:
        release.ADAPTER.patch_set.unpatch()


def _applied(release, disabled):
    from zb_patch import registry as R

    report = release.ADAPTER.patch_set.apply(disabled=disabled)
    assert report.verdict == R.APPLIED, report.reason
    return {p: v for v in (R.APPLIED, R.DISABLED) for p in report.by_verdict(v)}


def _zero_bubble(H, release):
    return H.zero_bubble_and_fix_ids(release.ADAPTER)[0][:1]  # one id disables its group


def _pd_first_step_sampled(H, release, sess, disabled):
    """The first step of a temperature-1 request on a PD decode node, prepared by the release's runner and sampled by
    the release's rejection sampler, patched with ``disabled`` left out. Returns (drafts handed to the sampler, the
    sampler's output row, patch verdicts)."""
    import copy

    import torch
    import vllm.v1.sample.rejection_sampler as vllm_rejection
    from test_pd_decode_first_step import CONNECTOR, _connector_class
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm_ascend.core.recompute_scheduler import AsyncRecomputeScheduler

    from zb_patch.check.selftest import compat
    from zb_patch.check.selftest.compat import EngineShape

    shape = EngineShape(num_spec_tokens=K)
    vc = H.build_config(sess, shape)
    kvc = H.kv_cache_config(vc, shape)
    if CONNECTOR not in KVConnectorFactory._registry:
        import test_pd_decode_first_step

        test_pd_decode_first_step.NoHitConsumer = _connector_class()
        KVConnectorFactory.register_connector(CONNECTOR, "test_pd_decode_first_step", "NoHitConsumer")
    decode_vc = copy.copy(vc)
    decode_vc.kv_transfer_config = KVTransferConfig(kv_connector=CONNECTOR, kv_role="kv_consumer")
    scheduler = AsyncRecomputeScheduler(
        vllm_config=decode_vc,
        kv_cache_config=kvc,
        structured_output_manager=StructuredOutputManager(decode_vc),
        block_size=shape.block_size,
        log_stats=False,
    )
    request = compat.make_request(
        "pd-0", list(range(40, 61)), max_tokens=8, stop_token_ids=[], arrival_time=0.0, block_size=shape.block_size
    )
    request.sampling_params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    scheduler.add_request(request)
    so = scheduler.schedule()
    assert list(so.scheduled_spec_decode_tokens["pd-0"]) == [P] * K
    verdicts = _applied(release, disabled)
    try:
        runner = H.make_runner(vc, kvc)
        inputs = release.Driver(runner, shape, seed=0).prepare_step(runner, so)
        meta, sampling = inputs.spec_meta, runner.input_batch.sampling_metadata
        assert not sampling.all_greedy
        target_probs = torch.zeros(len(meta.draft_token_ids), VOCAB)
        target_probs[:, LAST] = 1.0  # the target puts all its mass on the last token
        with _release_torch_path():
            out = vllm_rejection.rejection_sample(
                meta.draft_token_ids.contiguous(),
                meta.num_draft_tokens,
                meta.max_spec_len,
                meta.cu_num_draft_tokens,
                None,
                target_probs,
                torch.tensor([[BONUS]], dtype=torch.int32),
                sampling,
            )
    finally:
        release.ADAPTER.patch_set.unpatch()
    return [int(x) for x in meta.draft_token_ids], [int(x) for x in out[0]], verdicts


def test_pd_decode_first_step_without_the_fix_accepts_the_placeholders(H, release, sess):
    """ZB_PATCH_DISABLE=rejection-negative-drafts (zero-bubble off too): the sampler is handed the -1 drafts, reads the
    last token's probability for each, accepts both and appends the bonus token."""
    drafts, row, verdicts = _pd_first_step_sampled(H, release, sess, (*_zero_bubble(H, release), FIX))
    assert verdicts.get(FIX) == "disabled" and verdicts.get("draft-placeholders-after-metadata") == "applied"
    assert drafts == [P] * K
    assert row == [P, P, BONUS]  # "accepted" placeholders, then the bonus token: the step emits BONUS alone


def test_pd_decode_first_step_with_the_fix_rejects_the_placeholder(H, release, sess):
    """ZB_PATCH=1 (zero-bubble off): the first -1 is rejected and its token sampled from the target (the last token);
    nothing after it, no bonus token."""
    drafts, row, verdicts = _pd_first_step_sampled(H, release, sess, _zero_bubble(H, release))
    assert verdicts.get(FIX) == "applied", verdicts
    assert drafts == [P] * K
    assert row == [LAST, P, P]


def _seed_past_the_first_draft(k):
    """A seed whose request generator draws uniforms ``u`` with ``u[0] > 0.5 >= u[0] * u[1]``: the row below then
    rejects its first draft (target probability 0.5) and, in block verify, would count a placeholder at position 1
    as legal (cumulative ``pi`` 0.5) if the clamped draft kept its target probability (1 on token 0 there)."""
    import torch

    for seed in range(1000):
        u = torch.empty(k, dtype=torch.float64).uniform_(generator=torch.Generator().manual_seed(seed))
        if u[0] > 0.5 >= u[0] * u[1]:
            return seed
    raise AssertionError("no seed")


def _mixed_batch(k):
    """Six requests, k drafts each: (drafts, target distribution per draft as {token: probability}, temperature,
    the row #10043 samples)."""
    d = list(range(3, 3 + k))
    one = [{LAST: 1.0}] * (k - 1)
    return [
        (d, [{t: 1.0} for t in d], 1.0, [*d, BONUS]),  # random, real drafts the target agrees with: all + bonus
        ([3] + [P] * (k - 1), [{3: 1.0}, *one], 1.0, [3, LAST] + [P] * (k - 1)),  # random, placeholder at 1
        ([P] * k, [{0: 1.0}] * k, 0.0, [0] + [P] * k),  # greedy, placeholders, target argmax 0
        ([P] * k, [{2: 1.0}] * k, 1.0, [2] + [P] * k),  # random, placeholders, no mass on the last token
        # random, seeded (_seed_past_the_first_draft): the first draft rejected, its recovered token 9
        ([3] + [P] * (k - 1), [{3: 0.5, 9: 0.5}] + [{0: 1.0}] * (k - 1), 1.0, [9] + [P] * k),
        # random, placeholders, the target on token 0 (the clamped draft, which the release's recovered token leaves
        # out: it would be 7)
        ([P] * k, [{0: 1.0, 7: 1e-30}] * k, 1.0, [0] + [P] * k),
    ]


@pytest.mark.parametrize("k", [2, 3], ids=["k2-sequential", "k3-block-verify"])
@pytest.mark.parametrize("fixed", [False, True], ids=["disabled", "fixed"])
def test_mixed_batch(H, release, cpu_worker, k, fixed):
    """The release's two random kernels (torch path: sequential below k = 3, block verify from 3), a batch of random
    and greedy requests with and without placeholders. With the fix every row is #10043's and ``target_probs`` is
    handed back unchanged; without it the random row whose target favours the last token accepts its ``-1`` (and,
    in block verify, every draft after it) and gets the bonus token."""
    import torch

    rows = _mixed_batch(k)
    drafts, target = _drafts_and_target(rows)
    handed = target.clone()
    sampling = _sampling_metadata(
        torch.tensor([r[2] for r in rows]),
        all_greedy=False,
        all_random=False,
        generators={4: torch.Generator().manual_seed(_seed_past_the_first_draft(k))},
    )
    disabled = _zero_bubble(H, release) + (() if fixed else (FIX,))
    verdicts = _applied(release, disabled)
    got = _sample_and_unpatch(release, drafts, [k] * len(rows), None, target, sampling)
    assert verdicts.get(FIX) == ("applied" if fixed else "disabled")
    if fixed:
        assert got == [r[3] for r in rows]
        assert torch.equal(target, handed)
    else:
        assert [got[i] for i in (0, 3, 4, 5)] == [rows[i][3] for i in (0, 3, 4, 5)]
        assert got[2] == [0] + [P] * k  # greedy: a -1 never equals the argmax
        assert got[1] == [3] + [P] * (k - 1) + [BONUS]  # the -1 drafts "accepted", then the bonus token


def _sampled(H, release, requests, *, all_greedy=False, draft_probs=None, generators=None, fixed=True):
    """``requests``: (drafts, target distribution per draft as {token: probability}, temperature) per request, drafts
    of any count. The patched binding's output rows, with the fix (or, ``fixed=False``, without any patch: the
    release's own output) on the release's torch path; target_probs is checked to be handed back unchanged."""
    import torch

    drafts, target = _drafts_and_target(requests)
    handed = target.clone()
    counts = [len(r[0]) for r in requests]
    # as vLLM's InputBatch makes it: no temperature tensor for an all-greedy batch
    temperatures = None if all_greedy else torch.tensor([r[2] for r in requests])
    sampling = _sampling_metadata(
        temperatures,
        all_greedy=all_greedy,
        all_random=not all_greedy and all(r[2] > 0 for r in requests),
        generators=generators or {},
    )
    if fixed:
        _applied(release, _zero_bubble(H, release))
    out = _sample_and_unpatch(release, drafts, counts, draft_probs, target, sampling)
    assert torch.equal(target, handed)
    return out


def test_all_greedy_batch_is_the_release_s_own_output(H, release, cpu_worker):
    """A batch of greedy requests only goes to the release as it is: the same rows as the release alone (its greedy
    path compares a draft with the target's argmax, which a -1 never equals)."""
    requests = [
        ([3, 4], [{3: 1.0}, {4: 1.0}], 0.0),  # real drafts the target agrees with: both + bonus
        ([5, P, 6], [{5: 1.0}, {0: 1.0}, {6: 1.0}], 0.0),  # a placeholder at 1, the target's argmax 0 there
        ([P], [{0: 0.6, 4: 0.4}], 0.0),
    ]
    released = _sampled(H, release, requests, all_greedy=True, fixed=False)
    assert released == [[3, 4, BONUS, P], [5, 0, P, P], [0, P, P, P]]
    assert _sampled(H, release, requests, all_greedy=True) == released


@pytest.mark.parametrize(
    "requests, rows",
    [
        pytest.param([([P], [{LAST: 1.0}], 1.0)], [[LAST, P]], id="one-request-one-placeholder"),
        pytest.param(
            [
                # a placeholder after a real draft, first in the batch; fewer drafts than the longest request
                ([3, P], [{3: 1.0}, {0: 1.0, 7: 1e-30}], 1.0),
                ([5, 6, 7], [{5: 1.0}, {6: 1.0}, {7: 1.0}], 1.0),  # real drafts: all + bonus
                ([0, 0], [{0: 1.0}, {0: 1.0}], 1.0),  # real drafts of token 0 (where a placeholder is clamped to)
                ([P], [{0: 0.6, 4: 0.4}], 0.0),  # greedy: the argmax at the placeholder, nothing after it
                ([P], [{LAST: 1.0}], 1.0),  # last in the batch, one draft of three
            ],
            [[3, 0, P, P], [5, 6, 7, BONUS], [0, 0, BONUS, P], [0, P, P, P], [LAST, P, P, P]],
            id="uneven-drafts",
        ),
    ],
)
def test_placeholder_rows_of_uneven_batches(H, release, cpu_worker, requests, rows):
    """Batches whose requests have different draft counts (the release's [batch, max_spec_len] grid has positions
    past a request's drafts, clamped into the next request's): every row is #10043's, the others' drafts untouched."""
    assert _sampled(H, release, requests) == rows


def test_with_draft_probs_the_release_s_recovered_token_is_kept(H, release, cpu_worker):
    """Draft probabilities given (a draft model's): a real draft whose draft probability equals its target
    probability is accepted whatever the uniform draw (ratio 1), here one of 1e-6 (rejected as an n-gram draft);
    at a placeholder the token is the release's recovered one, a sample of max(target - draft, 0)."""
    import torch

    requests = [
        ([3, 4], [{3: 1e-6, 8: 1.0 - 1e-6}, {4: 1e-6, 8: 1.0 - 1e-6}], 1.0),
        ([P, P], [{LAST: 1.0}, {LAST: 1.0}], 1.0),
    ]
    draft_probs = torch.zeros(4, VOCAB)
    draft_probs[0, 3] = draft_probs[1, 4] = 1e-6
    draft_probs[0, 9] = draft_probs[1, 9] = 1.0 - 1e-6
    draft_probs[2:, 2] = draft_probs[2:, LAST] = 0.5
    generators = {0: torch.Generator().manual_seed(0)}
    rows = _sampled(H, release, requests, draft_probs=draft_probs, generators=generators)
    assert rows == [[3, 4, BONUS], [LAST, P, P]]


def test_placeholder_token_follows_the_target_distribution(H, release, cpu_worker):
    """The token at a reached placeholder is a sample of the target distribution there: 2000 requests with one
    placeholder each, the target 0.6 on one token and 0.1 on four others; each token's count is within 5 standard
    deviations of 2000 * p (seeded; an exponential race scored p * E instead of p / E gives the 0.6 token 0.72)."""
    import math

    import torch

    dist = {2: 0.6, 5: 0.1, 7: 0.1, 9: 0.1, 11: 0.1}
    n = 2000
    torch.manual_seed(1234)
    rows = _sampled(H, release, [([P], [dist], 1.0)] * n)
    assert all(row[1] == P for row in rows)
    counts = {t: sum(row[0] == t for row in rows) for t in dist}
    assert sum(counts.values()) == n, counts
    for token, p in dist.items():
        assert abs(counts[token] - n * p) <= 5 * math.sqrt(n * p * (1 - p)), counts
