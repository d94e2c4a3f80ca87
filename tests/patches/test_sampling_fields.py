"""Sampling beyond greedy, on the release's real vLLM AsyncScheduler + vllm-ascend NPUModelRunner (the runner-parity
harness, tests/parity/runner_harness.py), vllm-ascend 0.13 / 0.18: every request carries non-greedy sampling
parameters (temperature, top-p / top-k, a per-request seed, ``min_tokens``; on 0.18 also repetition / presence /
frequency penalties, which vLLM 0.13 refuses under async scheduling + spec decode), and at every step, when the
sampler would run (entering ``sample_tokens``, after ``execute_model`` returned; the sampler's own view, after
``async-penalty-output-tokens``: tests/patches/test_async_penalty_output_tokens.py), the fields sampling reads are
recorded per request: the runner's ``output_token_ids`` (what penalties, bad words and the min-tokens processor
read: the same list objects as ``input_batch.req_output_token_ids``), its ``-1`` placeholders, and the input
batch's sampling state (temperature, top-p / top-k, generator seed, penalties, the batch's
``sampling_metadata.output_token_ids``), and on 0.18 the stop tokens vLLM's ``MinTokensLogitsProcessor`` masks. Classic
async with the adapter's fixes and zero-bubble must hand the sampler the same values, step by step.
"""

from __future__ import annotations

import os
import sys

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
HARNESS = {"0.13": "runner013", "0.18": "runner018"}
FAMILY = npu_standin.detect_family()
if FAMILY not in HARNESS:
    pytest.skip(f"the runner harness covers vllm-ascend 0.13 / 0.18; this env has {FAMILY}", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parity"))

K, SEED, ITERATIONS = 3, 5, 400


@pytest.fixture(scope="module")
def ZB(release):
    """The release's zero-bubble wrappers (:class:`zb_patch.versions.npu_runner.ZeroBubble`)."""
    return release.ZERO_BUBBLE


def sampling_params(req_id: str, max_tokens: int, stop_token_ids: list[int], min_tokens=None):
    from vllm import SamplingParams

    n = sum(ord(c) for c in req_id)
    penalties = (
        dict(repetition_penalty=1.0 + (n % 3) * 0.1, presence_penalty=(n % 2) * 0.3, frequency_penalty=(n % 4) * 0.1)
        if FAMILY == "0.18"
        else {}
    )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if n % 5 == 0 else 0.7 + (n % 3) * 0.2,  # a greedy request now and then: mixed batches
        top_p=0.9 if n % 2 else 1.0,
        top_k=20 if n % 3 else 0,
        seed=1000 + n,
        min_tokens=min(3 if min_tokens is None else min_tokens(req_id), max_tokens),
        ignore_eos=True,
        stop_token_ids=list(stop_token_ids),
        **penalties,
    )


def _make_request(req_id, prompt, *, max_tokens, stop_token_ids, arrival_time, block_size, min_tokens=None):
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    from zb_patch.check.selftest import compat

    extra = {"eos_token_id": None} if "eos_token_id" in compat._init_params(Request) else {}
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=sampling_params(req_id, max_tokens, stop_token_ids, min_tokens),
        pooling_params=None,
        arrival_time=arrival_time,
        block_hasher=get_request_block_hasher(block_size, sha256),
        **extra,
    )


def _batch_sampling_state(batch, rows: int) -> dict:
    def col(name):
        t = getattr(batch, f"{name}_cpu", None)  # the host copy the batch's sampling tensors are filled from
        return None if t is None else [round(float(x), 4) for x in t[:rows]]

    md = batch.sampling_metadata
    return dict(
        temperature=col("temperature"),
        top_p=col("top_p"),
        top_k=col("top_k"),
        penalties=[col(n) for n in ("presence_penalties", "frequency_penalties", "repetition_penalties")],
        generators=sorted(batch.generators),
        metadata_output_token_ids=[list(x) for x in (md.output_token_ids or [])],
        all_greedy=md.all_greedy,
    )


class _OffsetGenerator:
    """Stands for a request's CPU ``torch.Generator`` in the input batch: the release rewinds the generator of a
    discarded row (``gen.set_offset(gen.get_offset() - 4)``, NPU / CUDA generators have offsets, CPU ones do not);
    here the offset is a counter, recorded per step (the harness's sampler draws nothing from it)."""

    def __init__(self, gen) -> None:
        self.gen, self.offset = gen, 0

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset

    def __getattr__(self, name):
        return getattr(self.gen, name)


def _min_tokens_masks(runner, st, vocab_size: int) -> dict | None:
    """What vLLM's ``MinTokensLogitsProcessor`` masks this step, per request: the stop tokens it sets to ``-inf`` in
    the bonus row (``apply``, the sampler) and in each draft row (``apply_with_spec_decode``, the rejection sampler),
    from its state as the sampler would find it; None where the batch has no such processor (vLLM 0.13 builds none
    with a speculative config)."""
    import numpy as np
    import torch
    from vllm.v1.sample.logits_processor import MinTokensLogitsProcessor

    procs = [p for p in runner.input_batch.logitsprocs.all if isinstance(p, MinTokensLogitsProcessor)]
    if not procs:
        return None
    drafts = [int(d) for d in st.num_drafts] if st.spec_meta is not None else [0] * st.n
    bonus, target = torch.zeros(st.n, vocab_size), torch.zeros(sum(drafts), vocab_size)
    for proc in procs:
        bonus = proc.apply(bonus)
        if sum(drafts):
            target = proc.apply_with_spec_decode(target, drafts)
    starts = np.cumsum([0] + drafts)

    def masked(row) -> tuple[int, ...]:
        return tuple(torch.isinf(row).nonzero().flatten().tolist())

    return {
        rid: (masked(bonus[r]), tuple(masked(target[i]) for i in range(starts[r], starts[r + 1])))
        for r, rid in enumerate(st.req_ids)
    }


def _run(H, release, sess, monkeypatch, *, disabled, min_tokens=None):
    import functools

    from zb_patch.check.selftest import compat
    from zb_patch.check.selftest.compat import EngineShape
    from zb_patch.check.selftest.workload import make_workload

    monkeypatch.setattr(compat, "make_request", functools.partial(_make_request, min_tokens=min_tokens))
    shape = EngineShape(num_spec_tokens=K)
    steps: dict[int, dict] = {}
    sample_tokens = release.Driver.sample_tokens

    def sample(driver, so):
        runner, st = driver.runner, driver.state
        if st is not None:
            rows = {}
            for r, rid in enumerate(st.req_ids):
                out = list(runner.requests[rid].output_token_ids)
                params = runner.requests[rid].sampling_params
                rows[rid] = dict(row=r, output_token_ids=out, placeholders=out.count(-1), min_tokens=params.min_tokens)
            steps[driver.step] = dict(rows=rows, batch=_batch_sampling_state(runner.input_batch, st.n))
            steps[driver.step]["min_tokens"] = _min_tokens_masks(runner, st, shape.vocab_size)
            gens = runner.input_batch.generators
            for i, g in list(gens.items()):
                if not isinstance(g, _OffsetGenerator):
                    gens[i] = _OffsetGenerator(g)
        out = sample_tokens(driver, so)
        if st is not None:  # the rewinds of this step's discarded rows
            gens = runner.input_batch.generators
            steps[driver.step]["generator_offsets"] = {
                rid: gens[r].offset for r, rid in enumerate(st.req_ids) if r in gens
            }
        return out

    monkeypatch.setattr(release.Driver, "sample_tokens", sample)
    specs = make_workload(SEED, shape, ITERATIONS)
    with H.reference_kernels():
        res = H.run_mode(sess, shape, specs, ITERATIONS, release=release, seed=SEED, patched=True, disabled=disabled)
    monkeypatch.undo()
    return res, steps


def _rejected_last_time(records: dict, step: int, rid: str) -> int:
    """The drafts of ``rid`` rejected in the previous step, if it was sampled there (a request back after a skipped
    step or a preemption has its output ids rebuilt, without optimistic placeholders)."""
    rec = records.get(step - 1, {}).get(rid)
    return rec.drafted - rec.accepted if rec is not None and rec.sampled else 0


def test_zero_bubble_hands_the_sampler_what_classic_async_does(H, release, sess, monkeypatch, capsys):
    """Step by step, the sampler of classic async (+ the fixes) and of zero-bubble is handed the same sampling state
    (temperature, top-p / top-k, penalties, generators and their rewinds, the min-tokens processor's masks) and the
    same output ids: zero-bubble's ``_update_states`` appends one ``-1`` per draft of the previous step (all assumed
    accepted), and the rejected drafts' ones are trimmed before the sampler runs (``ZeroBubble.trim_placeholders``),
    also in the rows counted here, whose request had drafts rejected in the previous step."""
    zb_ids = H.zero_bubble_and_fix_ids(release.ADAPTER)[0]
    classic, ref = _run(H, release, sess, monkeypatch, disabled=zb_ids[:1])
    zb, got = _run(H, release, sess, monkeypatch, disabled=())
    assert zb.zb.get("active") and not classic.zb.get("active")
    assert sorted(ref) == sorted(got), "the two runs sampled at different steps"
    assert classic.streams == zb.streams
    diffs = [(s, ref[s], got[s]) for s in sorted(ref) if ref[s] != got[s]]
    trimmed = sum(_rejected_last_time(classic.records, s, rid) > 0 for s in ref for rid in ref[s]["rows"])
    placeholders = sum(r["placeholders"] for s in ref.values() for r in s["rows"].values())
    real = sum(len(r["output_token_ids"]) - r["placeholders"] for s in ref.values() for r in s["rows"].values())
    random_rows = sum(1 for s in ref.values() for t in s["batch"]["temperature"] if t > 0)
    with capsys.disabled():
        print(
            f"\n{release.ADAPTER.id} k={K}: {len(ref)} sampling steps, {random_rows} random-sampled rows, "
            f"{classic.preemptions} preemptions; entering sample_tokens: {real} real output ids and {placeholders} -1 "
            f"placeholders (classic async); {trimmed} rows after rejected drafts; {len(diffs)} steps differ"
        )
    assert random_rows > 0 and len(ref) > 50 and trimmed > 0
    assert not diffs, [(st, _diff(a, b)) for st, a, b in diffs[:4]]


def _diff(a: dict, b: dict) -> dict:
    """The fields of one step's record that differ (classic async, zero-bubble)."""
    out = {}
    for rid in sorted(set(a["rows"]) | set(b["rows"])):
        ra, rb = a["rows"].get(rid), b["rows"].get(rid)
        if ra != rb:
            out[rid] = [(len(r["output_token_ids"]), r["placeholders"], r["output_token_ids"][-6:]) for r in (ra, rb)]
    if a.get("min_tokens") != b.get("min_tokens"):
        out["min_tokens"] = (a.get("min_tokens"), b.get("min_tokens"))
    for key in ("batch", "generator_offsets"):
        for f in set(a.get(key, {})) | set(b.get(key, {})):
            if a.get(key, {}).get(f) != b.get(key, {}).get(f):
                out[f"{key}.{f}"] = (a[key].get(f), b[key].get(f))
    return out


def _long_min_tokens(req_id: str) -> int:
    """``min_tokens`` from 4 to 27 (then capped at ``max_tokens``): the stop-token mask stays on through several
    decode steps with drafts."""
    return 4 + sum(ord(c) for c in req_id) % 24


def _mask_crossings(records: dict, ref: dict) -> list[tuple[int, str]]:
    """(step, request) where the stop-token mask of a request with stop tokens depends on whether its output length
    counts the drafts it had rejected in the step before (``r``): with the exact length ``L`` (classic async's) below
    ``min_tokens`` ``m`` and ``d`` drafts this step, the bonus row is masked while ``L + r < m`` and draft row ``j``
    while ``L + j < m``, so ``L + r`` instead of ``L`` unmasks a row where ``L + r >= m`` or ``m - L - r < d``."""
    out = []
    for s in sorted(ref):
        for rid, row in ref[s]["rows"].items():
            mask = (ref[s]["min_tokens"] or {}).get(rid)
            rec = records.get(s, {}).get(rid)
            r, m, length = _rejected_last_time(records, s, rid), row["min_tokens"], len(row["output_token_ids"])
            d = rec.drafted if rec is not None else 0
            if mask and mask[0] and r and length < m and (length + r >= m or m - length - r < d):
                out.append((s, rid))
    return out


def _min_tokens_runs(H, release, sess, monkeypatch, plant=None):
    """Classic async (+ the fixes) and zero-bubble (``plant(monkeypatch)`` applied for its run) with
    :func:`_long_min_tokens`; returns classic's result, both runs' records and the rows masked differently."""
    if FAMILY != "0.18":
        pytest.skip("vLLM 0.13 builds no min-tokens processor with a speculative config (logits_processor/__init__.py)")
    zb_ids = H.zero_bubble_and_fix_ids(release.ADAPTER)[0]
    classic, ref = _run(H, release, sess, monkeypatch, disabled=zb_ids[:1], min_tokens=_long_min_tokens)
    with pytest.MonkeyPatch.context() as planted:
        if plant is not None:
            plant(planted)
        zb, got = _run(H, release, sess, monkeypatch, disabled=(), min_tokens=_long_min_tokens)
    assert zb.zb.get("active") and not classic.zb.get("active")
    assert sorted(ref) == sorted(got), "the two runs sampled at different steps"
    assert classic.streams == zb.streams
    diffs = [
        (s, rid, mask, got[s]["min_tokens"].get(rid))
        for s in sorted(ref)
        for rid, mask in ref[s]["min_tokens"].items()
        if got[s]["min_tokens"].get(rid) != mask
    ]
    return classic, ref, got, diffs


def test_min_tokens_mask_under_zero_bubble_is_classic_asyncs(H, release, sess, monkeypatch, capsys):
    """vLLM 0.18's ``MinTokensLogitsProcessor`` masks the stop tokens while ``len(output_token_ids) < min_tokens``
    (``builtin.py:196`` / ``:209``, ``:258``): at every step, zero-bubble's processor masks exactly the stop tokens
    classic async (+ the fixes) masks, in the bonus row and in every draft row -- also at the steps where the output
    length plus the drafts rejected a step before reaches ``min_tokens`` (the optimistic placeholders zero-bubble's
    ``_update_states`` appends are trimmed once the accepted counts are in: ``ZeroBubble.trim_placeholders``)."""
    classic, ref, _, diffs = _min_tokens_runs(H, release, sess, monkeypatch)
    masked = sum(1 for s in ref.values() for b, _ in s["min_tokens"].values() if b)
    crossings = _mask_crossings(classic.records, ref)
    with capsys.disabled():
        print(
            f"\n{release.ADAPTER.id} k={K}: {len(ref)} sampling steps, {masked} rows with stop tokens masked (classic "
            f"async), {len(crossings)} at which the rejected drafts' placeholders would reach min_tokens; "
            f"{len(diffs)} rows masked differently by zero-bubble"
        )
    assert masked > 0 and crossings
    assert not diffs, diffs[:6]


def test_min_tokens_mask_without_the_trim_releases_early(H, release, ZB, sess, monkeypatch, capsys):
    """The divergence the trim removes, planted back (``trim_placeholders`` a no-op, as zb-patch was before it): the
    zero-bubble processor masks less than classic async, never more, and each request's first difference is at a
    step where its exact output length is below ``min_tokens`` and that length plus the drafts it had rejected in the
    step before is not (the ``-1`` placeholders counted as output: the stop tokens can be sampled up to k tokens
    before ``min_tokens``)."""

    def plant(mp):
        mp.setattr(type(ZB), "trim_placeholders", lambda self, runner, st, rejected: None)

    classic, ref, _, diffs = _min_tokens_runs(H, release, sess, monkeypatch, plant)
    with capsys.disabled():
        print(f"\n{release.ADAPTER.id} k={K}, without the trim: {len(diffs)} rows masked differently by zero-bubble")
    assert diffs
    for s, rid, want, got in diffs:  # masks less, never more
        assert set(got[0]) <= set(want[0]) and len(got[1]) == len(want[1]), (s, rid, want, got)
        assert all(set(g) <= set(w) for g, w in zip(got[1], want[1])), (s, rid, want, got)
    first = {}
    for s, rid, _, _ in diffs:
        first.setdefault(rid, s)
    crossings = set(_mask_crossings(classic.records, ref))
    assert all((s, rid) in crossings for rid, s in first.items()), sorted(first.items())
