"""Sampling beyond greedy, on the release's real vLLM AsyncScheduler + vllm-ascend NPUModelRunner (the runner-parity
harness, tests/parity/runner_harness.py), vllm-ascend 0.13 / 0.18: every request carries non-greedy sampling
parameters (temperature, top-p / top-k, a per-request seed, ``min_tokens``; on 0.18 also repetition / presence /
frequency penalties, which vLLM 0.13 refuses under async scheduling + spec decode), and at every step, when the
sampler would run (entering ``sample_tokens``, after ``execute_model`` returned; the sampler's own view, after
``async-penalty-output-tokens``: tests/patches/test_async_penalty_output_tokens.py), the fields sampling reads are
recorded per request: the runner's ``output_token_ids`` (what penalties, bad words and the min-tokens processor
read: the same list objects as ``input_batch.req_output_token_ids``), its ``-1`` placeholders, and the input
batch's sampling state (temperature, top-p / top-k, generator seed, penalties, the batch's
``sampling_metadata.output_token_ids``). Classic async with the adapter's fixes and zero-bubble must hand the sampler
the same values, step by step.
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


def sampling_params(req_id: str, max_tokens: int, stop_token_ids: list[int]):
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
        min_tokens=min(3, max_tokens),
        ignore_eos=True,
        stop_token_ids=list(stop_token_ids),
        **penalties,
    )


def _make_request(req_id, prompt, *, max_tokens, stop_token_ids, arrival_time, block_size):
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    from zb_patch.check.selftest import compat

    extra = {"eos_token_id": None} if "eos_token_id" in compat._init_params(Request) else {}
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=sampling_params(req_id, max_tokens, stop_token_ids),
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


def _run(H, release, sess, monkeypatch, *, disabled):
    from zb_patch.check.selftest import compat
    from zb_patch.check.selftest.compat import EngineShape
    from zb_patch.check.selftest.workload import make_workload

    monkeypatch.setattr(compat, "make_request", _make_request)
    steps: dict[int, dict] = {}
    sample_tokens = release.Driver.sample_tokens

    def sample(driver, so):
        runner, st = driver.runner, driver.state
        if st is not None:
            rows = {}
            for r, rid in enumerate(st.req_ids):
                out = list(runner.requests[rid].output_token_ids)
                rows[rid] = dict(row=r, output_token_ids=out, placeholders=out.count(-1))
            steps[driver.step] = dict(rows=rows, batch=_batch_sampling_state(runner.input_batch, st.n))
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
    shape = EngineShape(num_spec_tokens=K)
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
    (temperature, top-p / top-k, penalties, generators and their rewinds) and the same output ids, except that
    zero-bubble's ``output_token_ids`` ends in one more ``-1`` per draft its request had rejected in the previous
    step (the optimistic placeholders, which the release's next ``_update_states`` trims): what
    ``MinTokensLogitsProcessor`` reads as the output length (docs/releases, "Sampling beyond greedy")."""
    zb_ids = H.zero_bubble_and_fix_ids(release.ADAPTER)[0]
    classic, ref = _run(H, release, sess, monkeypatch, disabled=zb_ids[:1])
    zb, got = _run(H, release, sess, monkeypatch, disabled=())
    assert zb.zb.get("active") and not classic.zb.get("active")
    assert sorted(ref) == sorted(got), "the two runs sampled at different steps"
    assert classic.streams == zb.streams
    diffs, longer = [], 0
    for s in sorted(ref):
        want = {**ref[s], "rows": {}}
        for rid, row in ref[s]["rows"].items():
            extra = _rejected_last_time(classic.records, s, rid)
            longer += extra > 0
            ids = row["output_token_ids"] + [-1] * extra
            want["rows"][rid] = dict(row=row["row"], output_token_ids=ids, placeholders=ids.count(-1))
        # the batch's list of output ids holds the same list objects
        want["batch"] = {**ref[s]["batch"]}
        want["batch"]["metadata_output_token_ids"] = [
            list(got[s]["rows"][rid]["output_token_ids"]) for rid in ref[s]["rows"]
        ][: len(ref[s]["batch"]["metadata_output_token_ids"])]
        if want != got[s]:
            diffs.append((s, want, got[s]))
    placeholders = sum(r["placeholders"] for s in ref.values() for r in s["rows"].values())
    real = sum(len(r["output_token_ids"]) - r["placeholders"] for s in ref.values() for r in s["rows"].values())
    random_rows = sum(1 for s in ref.values() for t in s["batch"]["temperature"] if t > 0)
    with capsys.disabled():
        print(
            f"\n{release.ADAPTER.id} k={K}: {len(ref)} sampling steps, {random_rows} random-sampled rows, "
            f"{classic.preemptions} preemptions; entering sample_tokens: {real} real output ids and {placeholders} -1 "
            f"placeholders (classic async); zero-bubble's output ids longer in {longer} rows; {len(diffs)} steps differ"
        )
    assert random_rows > 0 and len(ref) > 50 and longer > 0
    assert not diffs, [(st, _diff(a, b)) for st, a, b in diffs[:4]]


def _diff(a: dict, b: dict) -> dict:
    """The fields of one step's record that differ (classic async, zero-bubble)."""
    out = {}
    for rid in sorted(set(a["rows"]) | set(b["rows"])):
        ra, rb = a["rows"].get(rid), b["rows"].get(rid)
        if ra != rb:
            out[rid] = [(len(r["output_token_ids"]), r["placeholders"], r["output_token_ids"][-6:]) for r in (ra, rb)]
    for key in ("batch", "generator_offsets"):
        for f in set(a.get(key, {})) | set(b.get(key, {})):
            if a.get(key, {}).get(f) != b.get(key, {}).get(f):
                out[f"{key}.{f}"] = (a[key].get(f), b[key].get(f))
    return out
