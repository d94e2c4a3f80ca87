"""``async-penalty-output-tokens`` (ascend-0.18; vllm-ascend #7769, fixed by #7789 in 0.19.1rc1) on the release's real
vLLM ``AsyncScheduler`` + vllm-ascend ``NPUModelRunner`` (the runner-parity harness, tests/parity/runner_harness.py),
EAGLE k = 3, every request with repetition / presence / frequency penalties. The harness calls the release's own
``_sample`` (its sampler answering with the fake model's tokens) and makes its drafts' host copy, as the release's
``sample_tokens`` does; at every step the output ids and draft ids the sampler is handed are compared with what the
synchronous path hands it: every token the request has generated so far (the harness's sampler produced them at the
earlier steps) and the drafts its previous step proposed.

Without the fix (``ZB_PATCH_DISABLE=async-penalty-output-tokens``) the penalties read `-1` placeholders in classic
async and with zero-bubble alike; with it they read the synchronous path's ids, in both (zero-bubble's placeholders for
the previous step's rejected drafts are trimmed before sampling: tests/patches/test_sampling_fields.py). Its host
waits come after the step's inputs are queued, in the sampling phase only.
"""

from __future__ import annotations

import os
import sys

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
if npu_standin.detect_family() != "0.18":
    pytest.skip("async-penalty-output-tokens is ascend-0.18's", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parity"))

from zb_patch.versions.fixes import async_penalty_output_tokens as fix  # noqa: E402

K, SEED, ITERATIONS, BLOCKS = 3, 7, 160, 24


def _make_request(req_id, prompt, *, max_tokens, stop_token_ids, arrival_time, block_size, penalties=True):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    penalty_args = dict(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2) if penalties else {}
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        stop_token_ids=list(stop_token_ids),
        **penalty_args,
    )
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        arrival_time=arrival_time,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def _run(H, release, sess, monkeypatch, *, disabled):
    """One run; returns it and the drafts each step proposed, per request."""
    from zb_patch.check.selftest import compat
    from zb_patch.check.selftest.compat import EngineShape
    from zb_patch.check.selftest.workload import make_workload

    monkeypatch.setattr(compat, "make_request", _make_request)
    drafts: dict[int, dict[str, list[int]]] = {}
    sample_tokens = release.Driver.sample_tokens

    def sample(driver, so):
        st, step = driver.state, driver.step
        out = sample_tokens(driver, so)
        if st is not None:
            proposed = driver.runner._draft_token_ids.tolist()
            drafts[step] = {rid: proposed[r] for r, rid in enumerate(st.req_ids)}
        return out

    monkeypatch.setattr(release.Driver, "sample_tokens", sample)
    shape = EngineShape(num_spec_tokens=K, num_blocks=BLOCKS)
    specs = make_workload(SEED, shape, ITERATIONS)
    with H.reference_kernels():
        res = H.run_mode(sess, shape, specs, ITERATIONS, release=release, seed=SEED, patched=True, disabled=disabled)
    monkeypatch.undo()
    return res, drafts


def _against_sync(res, drafts) -> dict:
    """Per (step, request) the sampler was handed output ids for: its output ids against the tokens the request has
    generated before that step (what the synchronous path hands the sampler), and its draft ids against the drafts
    its previous step proposed (where it was sampled there)."""
    generated: dict[str, list[int]] = {}
    c = dict(rows=0, real=0, placeholders=0, output_differs=0, tail=0, inner_placeholders=0, drafts=0)
    c.update(draft_ids=0, draft_placeholders=0, drafts_differ=0)
    examples = []
    for step in sorted(res.records):
        handed = res.sampler_inputs.get(step, {})
        for rid, (out, spec) in handed.items():
            want = generated.get(rid, [])
            real = [t for t in out if t != -1]
            c["rows"] += 1
            c["real"] += len(real)
            c["placeholders"] += len(out) - len(real)
            if real != want:
                c["output_differs"] += 1
                if len(examples) < 4:
                    examples.append((step, rid, out[-8:], want[-8:]))
            tail = len(out) - len(real)
            if out[len(real) :] != [-1] * tail:
                c["inner_placeholders"] += 1  # a -1 before a real id: not a tail
            c["tail"] += tail
            prev = res.records.get(step - 1, {}).get(rid)
            if spec and prev is not None and prev.sampled:
                c["drafts"] += 1
                c["draft_ids"] += len(spec)
                c["draft_placeholders"] += spec.count(-1)
                c["drafts_differ"] += spec != drafts[step - 1][rid][: len(spec)]
        for rid, rec in res.records[step].items():
            generated.setdefault(rid, []).extend(rec.sampled)
    c["examples"] = examples
    return c


def _runs(H, release, sess, with_fix: bool) -> dict:
    """classic async + the fixes, zero-bubble + the fixes: without this fix, or with it."""
    zb_first = H.zero_bubble_and_fix_ids(release.ADAPTER)[0][:1]
    left_out = () if with_fix else (fix.ID,)
    suffix = "" if with_fix else ", no fix"
    mp = pytest.MonkeyPatch()
    out = {}
    for name, disabled in (("classic" + suffix, (*zb_first, *left_out)), ("zero-bubble" + suffix, left_out)):
        res, drafts = _run(H, release, sess, mp, disabled=disabled)
        out[name] = (res, _against_sync(res, drafts))
    mp.undo()
    for name, (res, c) in out.items():
        print(
            f"\n{name}: {res.steps} steps, {c['rows']} sampled rows with penalties; output ids real {c['real']}, "
            f"-1 {c['placeholders']}, rows differing from sync {c['output_differs']}; draft rows {c['drafts']}, "
            f"-1 drafts {c['draft_placeholders']}, differing {c['drafts_differ']}; copy waits {res.copy_waits}; "
            f"{res.preemptions} preemptions"
        )
    return out


# One fixture per test: mutation testing attributes what a fixture runs to the test that sets it up
# (docs/mutation.md, "Killers"), so the runs with the fix are set up by the test that judges them.
@pytest.fixture(scope="module")
def runs_without_fix(H, release, sess):
    return _runs(H, release, sess, with_fix=False)


@pytest.fixture(scope="module")
def runs_with_fix(H, release, sess):
    return _runs(H, release, sess, with_fix=True)


def test_without_the_fix_penalties_read_placeholders(runs_without_fix):
    """The reproduction: ZB_PATCH_DISABLE=async-penalty-output-tokens, classic async and zero-bubble alike: the
    sampler's output ids are placeholders where the synchronous path has the generated ids, and its draft ids are
    the scheduler's -1s."""
    for name in ("classic, no fix", "zero-bubble, no fix"):
        res, c = runs_without_fix[name]
        assert bool(res.zb.get("active")) == name.startswith("zero-bubble"), name
        assert c["rows"] > 200 and c["drafts"] > 100, (name, c)
        assert c["output_differs"] > c["rows"] // 2, (name, c)
        assert c["placeholders"] > 5 * c["real"], (name, c)
        assert c["draft_placeholders"] == c["draft_ids"] >= K * c["drafts"] // 2, (name, c)
        assert not res.copy_waits, (name, res.copy_waits)


def test_the_fix_hands_the_sampler_the_synchronous_ids(runs_with_fix, runs_without_fix):
    """With the fix the sampler is handed, at every step and for every request, the ids the synchronous path hands
    it: the generated ids, with no ``-1`` after them (zero-bubble's placeholders for the previous step's rejected
    drafts are trimmed before sampling), and the previous step's drafts. The host waits are on the copies of the
    previous step, in the sampling phase (after this step's inputs are queued); zero-bubble still waits for nothing
    before input preparation."""
    for name in ("classic", "zero-bubble"):
        res, c = runs_with_fix[name]
        assert bool(res.zb.get("active")) == (name == "zero-bubble"), name
        assert c["rows"] > 200 and c["drafts"] > 100, (name, c)
        assert c["output_differs"] == 0, (name, c["examples"])
        assert c["inner_placeholders"] == 0 and c["drafts_differ"] == 0, (name, c)
        assert set(res.copy_waits) <= {("sampled_ids", "sample"), ("draft_ids", "sample")}, res.copy_waits
        assert res.copy_waits.get(("sampled_ids", "sample"), 0) > 100, res.copy_waits
        assert res.edges.get("resumed_after_preemption", 0) > 0, res.edges
    assert runs_with_fix["classic"][1]["tail"] == 0 == runs_with_fix["zero-bubble"][1]["tail"], runs_with_fix
    zb = runs_with_fix["zero-bubble"][0]
    assert zb.min_before_prep_per_spec_step == 0 == zb.max_before_prep_per_step
    # the same tokens, steps and schedules with and without the fix (the fake sampler ignores penalties)
    for name in ("classic", "zero-bubble"):
        assert runs_with_fix[name][0].streams == runs_without_fix[f"{name}, no fix"][0].streams


def test_a_step_with_nothing_to_sample_passes_the_release_s_answer_through(H, sess):
    """``sample_tokens`` without an ``execute_model`` state to sample from (a step whose ``execute_model`` returned
    its output itself): the release's body answers None, and the wrapper hands that on, copying nothing; the drafts'
    request ids an earlier step's copy left stay for the next step that samples (vLLM clears them only there)."""
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    from zb_patch.check.selftest.compat import EngineShape

    shape = EngineShape(num_spec_tokens=K)
    vc = H.build_config(sess, shape)
    runner = H.make_runner(vc, H.kv_cache_config(vc, shape))
    assert runner.use_async_scheduling and runner.execute_model_state is None
    runner._draft_token_req_ids = ["r0", "r1"]
    assert fix.make_sample_tokens(NPUModelRunner.sample_tokens)(runner, None) is None
    assert runner._draft_token_req_ids == ["r0", "r1"]


def _with_penalties_on_even_requests(req_id, prompt, **kwargs):
    """The workload's request ``r<n>``, with penalties where ``n`` is even (a batch of odd ones needs no output ids:
    the release makes no draft copy at its step)."""
    return _make_request(req_id, prompt, penalties=int(req_id.lstrip("r")) % 2 == 0, **kwargs)


def test_the_draft_copy_is_waited_on_only_after_a_step_that_made_it(H, release, sess):
    """The wrapper's one host wait on the drafts' copy, per step: exactly at the steps that sample a batch with drafts
    after a step whose release body made the copy (a batch with output ids), and at no other step; half the requests
    with penalties, so the run has steps that make no copy, steps with drafts after them, and steps without drafts
    after a copy (the workload's prefill-only steps after a drain)."""
    from zb_patch.check.selftest import compat
    from zb_patch.check.selftest.compat import EngineShape
    from zb_patch.check.selftest.workload import make_workload

    steps = []  # per sample_tokens call: (samples, drafts in the batch, copy made, waits on the draft copy)
    sample_tokens = release.Driver.sample_tokens

    def sample(driver, so):
        runner, batch = driver.runner, driver.runner.input_batch
        samples = runner.execute_model_state is not None
        drafts = samples and any(batch.spec_token_ids[: batch.num_reqs])
        before = driver.copy_waits[("draft_ids", "sample")]
        out = sample_tokens(driver, so)
        copied = bool(runner._draft_token_req_ids)  # the release's copy sets its request ids; nothing else does
        steps.append((samples, drafts, copied, driver.copy_waits[("draft_ids", "sample")] - before))
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(compat, "make_request", _with_penalties_on_even_requests)
    mp.setattr(release.Driver, "sample_tokens", sample)
    shape = EngineShape(num_spec_tokens=K, num_blocks=BLOCKS)
    try:
        with H.reference_kernels():
            res = H.run_mode(
                sess,
                shape,
                make_workload(SEED, shape, ITERATIONS),
                ITERATIONS,
                release=release,
                seed=SEED,
                patched=True,
            )
    finally:
        mp.undo()
    assert res.zb.get("active"), res.zb
    kinds = {"wait": 0, "drafts, no copy before": 0, "copy before, no drafts": 0, "no copy": 0}
    for call, (samples, drafts, copied, waits) in enumerate(steps):
        copied_before = call > 0 and steps[call - 1][2]
        expected = int(samples and drafts and copied_before)
        assert waits == expected, (call, samples, drafts, copied_before, waits)
        kinds["wait"] += expected
        kinds["drafts, no copy before"] += samples and drafts and not copied_before
        kinds["copy before, no drafts"] += samples and copied_before and not drafts
        kinds["no copy"] += samples and not copied
    print(f"\n{len(steps)} sampling calls: {kinds}")
    assert min(kinds.values()) > 0, kinds
