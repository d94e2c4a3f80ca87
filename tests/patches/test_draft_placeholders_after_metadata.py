"""A ``-1`` draft placeholder left in the step's input ids (patch ``draft-placeholders-after-metadata``), on the
release's real vLLM AsyncScheduler + vllm-ascend NPUModelRunner (the runner-parity harness), vllm-ascend 0.13 / 0.18.

Such a draft is what a PD decode node with MTP schedules on a request's first step (RecomputeScheduler.add_request:
``spec_token_ids = [-1] * k``, vllm-ascend #10305) and what a row the stale-draft fixes cannot fill keeps. Planted
here: after the release's ``_prepare_input_ids`` (and the stale-draft fix) wrote the step's draft ids, the first
draft of the first row with drafts is set to ``-1`` for a few spec steps. What the release then does with it, read
from the ``SpecDecodeMetadata`` it builds and the ids it hands the forward, and verified with the release's own
rejection sampler (``vllm_ascend.sample.rejection_sampler.rejection_sample``, greedy, target argmax 0):

* bare release: the sampler sees ``-1`` (rejected), the forward is handed ``-1`` (an out-of-range embedding index:
  GatherV2 fault on NPUs, #10305);
* zero-bubble without the fix: on 0.13 its clamp in ``_init_model_kwargs`` runs before the release gathers the drafts,
  so the sampler sees token 0 and accepts it; on 0.18 (no clamp) the forward is handed ``-1`` as in the bare release;
* with the fix (with or without zero-bubble): the sampler sees ``-1`` and rejects it, the forward sees no negative id.
"""

from __future__ import annotations

import os
import sys
import types

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
HARNESS = {"0.13": "runner013", "0.18": "runner018"}
FAMILY = npu_standin.detect_family()
if FAMILY not in HARNESS:
    pytest.skip(f"the runner harness covers vllm-ascend 0.13 / 0.18; this env has {FAMILY}", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parity"))

FIX = "draft-placeholders-after-metadata"
K, SEED, ITERATIONS, PLANTS = 2, 3, 60, 4


def _planting_hook(planted: list):
    """``runner_hook``: the runner's ``_prepare_input_ids`` (the release's, as patched) is wrapped on the instance;
    after it, the first draft of the first row with scheduled drafts is set to -1 (the first PLANTS spec steps)."""

    def hook(runner):
        inner = runner._prepare_input_ids

        def _prepare_input_ids(scheduler_output, total, cu_num_tokens, *args, **kwargs):
            result = inner(scheduler_output, total, cu_num_tokens, *args, **kwargs)
            spec = scheduler_output.scheduled_spec_decode_tokens
            if len(planted) < PLANTS:
                for r, rid in enumerate(runner.input_batch.req_ids):
                    d = len(spec.get(rid, ()))
                    if d:
                        pos = int(cu_num_tokens[r]) - d
                        runner.input_ids.gpu[pos] = -1
                        planted.append(dict(req=rid, pos=pos, draft_index=0, seen={}))
                        break
            return result

        runner._prepare_input_ids = _prepare_input_ids

    return hook


def _run(H, release, sess, monkeypatch, *, patched, disabled=()):
    """One harness run with the plants; per plant: the draft the sampler is handed, the id the forward is handed, and
    how many of the row's drafts the release's greedy rejection sampler accepts against a target whose argmax is 0."""
    import torch
    from vllm_ascend.sample import rejection_sampler

    from zb_patch.check.selftest.compat import EngineShape
    from zb_patch.check.selftest.workload import make_workload

    planted: list = []
    prepare_step = release.Driver.prepare_step

    def prepare(driver, runner, so):
        n_before = len(planted)
        inputs = prepare_step(driver, runner, so)
        if inputs is not None and len(planted) > n_before:
            plant, meta = planted[-1], inputs.spec_meta
            assert meta is not None
            row = next(r for r, d in enumerate(meta.num_draft_tokens) if d)  # the planted row: its first draft is [0]
            vocab = 8
            target_probs = torch.zeros(len(meta.draft_token_ids), vocab)
            target_probs[:, 0] = 1.0  # the target's argmax is token 0 at every draft
            # the release's pytorch path (its Triton kernels need an NPU's vector-core count)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(rejection_sampler, "HAS_TRITON", False)
                out = rejection_sampler.rejection_sample(
                    meta.draft_token_ids.contiguous(),
                    meta.num_draft_tokens,
                    max(meta.num_draft_tokens),
                    meta.cu_num_draft_tokens,
                    None,
                    target_probs,
                    torch.zeros(len(meta.num_draft_tokens), 1, dtype=torch.int32),
                    types.SimpleNamespace(all_greedy=True, all_random=False),
                )
            plant["seen"] = dict(
                sampler=int(meta.draft_token_ids[0]),
                forward=int(inputs.input_ids[plant["pos"]]),
                accepted=int((out[row] != -1).sum()) - 1,
            )
        return inputs

    monkeypatch.setattr(release.Driver, "prepare_step", prepare)
    shape = EngineShape(num_spec_tokens=K)
    specs = make_workload(SEED, shape, ITERATIONS)
    with H.reference_kernels():
        res = H.run_mode(
            sess,
            shape,
            specs,
            ITERATIONS,
            release=release,
            seed=SEED,
            patched=patched,
            disabled=disabled,
            runner_hook=_planting_hook(planted),
        )
    monkeypatch.undo()
    assert len(planted) == PLANTS and all(p["seen"] for p in planted), planted
    return res, [p["seen"] for p in planted]


def _zb_ids(H, release):
    return H.zero_bubble_and_fix_ids(release.ADAPTER)[0]


def test_bare_release_hands_the_forward_a_minus_one(H, release, sess, monkeypatch):
    """The release as it is: the sampler rejects the -1, but the forward is handed it (#10305's GatherV2 fault)."""
    res, seen = _run(H, release, sess, monkeypatch, patched=False)
    assert all(s["sampler"] == -1 and s["accepted"] == 0 and s["forward"] == -1 for s in seen), seen
    assert res.negative_input_ids >= PLANTS


def test_zero_bubble_without_the_fix(H, release, sess, monkeypatch):
    """ZB_PATCH_DISABLE=draft-placeholders-after-metadata, zero-bubble on. 0.13: zero-bubble's clamp runs before the
    release gathers the drafts, so the sampler is handed token 0 and accepts it where the target's argmax is 0.
    0.18 (no clamp in zero-bubble): the forward is handed the -1, as in the bare release."""
    res, seen = _run(H, release, sess, monkeypatch, patched=True, disabled=(FIX,))
    assert res.zb.get("active")
    if FAMILY == "0.13":
        assert all(s["sampler"] == 0 and s["accepted"] >= 1 and s["forward"] == 0 for s in seen), seen
    else:
        assert all(s["sampler"] == -1 and s["accepted"] == 0 and s["forward"] == -1 for s in seen), seen


@pytest.mark.parametrize("mode", ["fix+zero-bubble", "fix-only"])
def test_with_the_fix_the_sampler_rejects_the_placeholder(H, release, sess, monkeypatch, mode):
    """With the fix, with zero-bubble and in classic async with only the fixes: the sampler is handed -1 and rejects
    it; the forward sees no negative id."""
    disabled = _zb_ids(H, release)[:1] if mode == "fix-only" else ()
    res, seen = _run(H, release, sess, monkeypatch, patched=True, disabled=disabled)
    assert bool(res.zb.get("active")) == (mode == "fix+zero-bubble")
    assert all(s["sampler"] == -1 and s["accepted"] == 0 and s["forward"] == 0 for s in seen), seen
    assert res.negative_input_ids == 0
    regathered = res.runner.__dict__.get("_zb_patch_placeholder_drafts", 0)
    assert (regathered > 0) == (mode == "fix+zero-bubble" and FAMILY == "0.13"), regathered


def _handshake(H, release, sess):
    """(runner, the release's ``_calc_spec_decode_metadata`` as the fix wraps it, ``plant_and_clamp``): vllm-ascend
    0.13's zero-bubble side of the handshake on this release's real runner: ids with -1 drafts are written, kept by
    ``keep_ids_before_clamp`` and clamped at 0 before the metadata is built."""
    import torch

    from zb_patch import registry as R
    from zb_patch.check.selftest.compat import EngineShape
    from zb_patch.versions.fixes import draft_placeholders_after_metadata as fix

    shape = EngineShape(num_spec_tokens=K)
    vc = H.build_config(sess, shape)
    runner = H.make_runner(vc, H.kv_cache_config(vc, shape))
    (spec,) = [p for p in release.ADAPTER.patch_set.patches if p.id == FIX]
    calc = spec.make(R.resolve(spec.target, import_missing=True).original)  # the release's own body, wrapped
    ids = runner.input_ids.gpu

    def plant_and_clamp():
        ids[:5] = torch.tensor([5, -1, 7, 9, -1], dtype=ids.dtype)  # row 0: drafts [-1, 7]; row 1: draft [-1]
        fix.keep_ids_before_clamp(runner, 5)
        ids[:5].clamp_(min=0)  # zero-bubble's clamp, before the metadata

    return runner, calc, plant_and_clamp


# two rows: 1 + 2 drafts and 1 + 1 draft
NUM_DRAFT_TOKENS, CU_NUM_SCHEDULED = [2, 1], [3, 5]


def test_ids_kept_before_the_clamp_feed_one_metadata_build(H, release, sess):
    """The handshake (``keep_ids_before_clamp``, the clamp, the wrapped ``_calc_spec_decode_metadata``,
    ``drop_ids_before_clamp`` after ``_prepare_inputs``): the metadata gathers its drafts from the ids as they were
    before the clamp (a -1 stays -1), consumes them and counts the re-gather; dropped unread, they feed no later
    build."""
    import numpy as np

    from zb_patch.versions.fixes import draft_placeholders_after_metadata as fix

    runner, calc, plant_and_clamp = _handshake(H, release, sess)
    num_draft_tokens, cu = np.array(NUM_DRAFT_TOKENS, dtype=np.int32), np.array(CU_NUM_SCHEDULED, dtype=np.int32)
    for built in (1, 2):
        plant_and_clamp()
        meta = calc(runner, num_draft_tokens, cu, None)
        assert meta.draft_token_ids.tolist() == [-1, 7, -1]
        assert fix.IDS_BEFORE_CLAMP_ATTR not in runner.__dict__  # consumed
        assert runner.__dict__[fix.PLACEHOLDER_DRAFTS_ATTR] == built
        fix.drop_ids_before_clamp(runner)  # nothing left to drop: a no-op
        assert runner.input_ids.gpu[:5].tolist() == [5, 0, 7, 9, 0]

    plant_and_clamp()
    fix.drop_ids_before_clamp(runner)  # _prepare_inputs returned without building the metadata
    assert fix.IDS_BEFORE_CLAMP_ATTR not in runner.__dict__
    meta = calc(runner, num_draft_tokens, cu, None)
    assert meta.draft_token_ids.tolist() == [0, 7, 0]  # the clamped ids: no stale copy read
    assert runner.__dict__[fix.PLACEHOLDER_DRAFTS_ATTR] == 2


def test_with_prefill_context_parallelism_the_release_s_drafts_stay(H, release, sess):
    """pcp_size > 1: the release replaces the logits indices after its gather, so the fix leaves the drafts as the
    release gathered them (from the clamped ids) and re-gathers nothing; the kept ids are consumed all the same."""
    import numpy as np

    from zb_patch.versions.fixes import draft_placeholders_after_metadata as fix

    runner, calc, plant_and_clamp = _handshake(H, release, sess)
    runner.pcp_size = 2
    plant_and_clamp()
    num_draft_tokens, cu = np.array(NUM_DRAFT_TOKENS, dtype=np.int32), np.array(CU_NUM_SCHEDULED, dtype=np.int32)
    meta = calc(runner, num_draft_tokens, cu, np.array([1, 1], dtype=np.int32))
    assert meta.draft_token_ids.tolist() == [0, 7, 0]
    assert fix.IDS_BEFORE_CLAMP_ATTR not in runner.__dict__
    assert fix.PLACEHOLDER_DRAFTS_ATTR not in runner.__dict__
