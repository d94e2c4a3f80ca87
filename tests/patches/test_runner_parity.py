"""Adapters ascend-0.13 / ascend-0.18 (zero-bubble backport): runner-level parity on the release's real
NPUModelRunner, in whichever of the two release families this env has (tests/parity/runner_harness.py, plus the
release's runner013.py / runner018.py).

The release's real vLLM AsyncScheduler drives its real runner methods (the harness says exactly which are real and
which are mirrored; on 0.13 the monolithic _prepare_inputs runs end to end, attention-metadata loop included)
in their classic async form and then with zero-bubble (the adapter applied; both runs carry the adapter's fixes of
the release's own defects, which tests/patches/test_stale_draft_placeholders.py reproduces), on the same seeded workload
(arrivals, chunked prefill, prefix-cache hits, preemption + resumption, stop tokens, max_model_len, aborts;
acceptance none / all / partial per request and position). Asserted:

* identical per-step, per-request positions, slot mapping, input ids, CPU and device seq_lens, CPU
  num_computed_tokens (at the forward and when the drafter runs), max_seq_len, discard flags, sampled tokens,
  drafted / accepted counts, drafter next-token inputs and req_state.num_computed_tokens after execute_model; the
  padded device seq_lens rows; identical token streams and finish reasons; on 0.13 no negative token id handed to
  the model;
* the accepted-count wait: >= 1 per spec-decode step before input preparation unpatched; 0 before input
  preparation on every step patched (its one wait per corrected step comes once the step's inputs are queued and
  before the attention metadata is built: Ascend attention's exact CPU seq_lens);
* >= 10,000 engine steps in total (k = 1..4), on the kernels' pure-torch twins; a shorter run on the Triton kernels
  (Triton's CPU interpreter); one without batch reordering;
* the waits on the input-preparation event: the patched path adds one per step on 0.13 (whose release makes none),
  none on 0.18;
* each planted mistake in the zero-bubble runner is caught by the divergence it must cause (PLANTS), or by the
  harness's PoisonedCounts for a count read without a wait; unsupported combinations fall through to the release
  with one WARNING.

* with a DeepSeek-V3-style MLA target and its MTP layer (``method="mtp"``, tests/parity/mla_harness.py), k = 1..3:
  every field of the metadata the release's ``AscendMLAMetadataBuilder`` builds per step for the target (prefill
  and decode parts, ``seq_lens_list``, ``actual_seq_lengths_q``, context-chunk bounds, RoPE positions), the MTP
  drafter's metadata per draft position (as its model reads it and as it was built), and on padded uniform-decode
  steps (an engine with FULL_DECODE_ONLY graphs) the host arguments of the graph's parameter update; identical
  unpatched vs patched, and a planted host seq_lens mistake shows up in all three.

0.13 only: input ids at draft placeholders the release cannot fill (rows re-added with drafts) are junk in both
modes and are not compared when the stale-draft-placeholders fix is off (runner013.Driver says why); their count is
printed (0 with the fix, which writes the request's own drafts there).

Cost on the 2-core CI box: ~1 minute after the vLLM import.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
from collections import Counter

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
# vllm-ascend family -> (the release's harness module, whether the adapter clamps the input ids to >= 0: 0.13's
# PREPARE_INPUTS spec; vllm-ascend 0.18 hands the model the same rare -1 id in both modes, compared like any id)
RELEASES = {"0.13": ("runner013", True), "0.18": ("runner018", False)}
FAMILY = npu_standin.detect_family()
if FAMILY not in RELEASES:
    pytest.skip(
        f"the NPU-runner zero-bubble adapters target vllm-ascend {' / '.join(RELEASES)}; this env has {FAMILY}",
        allow_module_level=True,
    )
HARNESS, CLAMPS_INPUT_IDS = RELEASES[FAMILY]

import numpy as np  # noqa: E402

from zb_patch import registry as R  # noqa: E402
from zb_patch import zero_bubble  # noqa: E402
from zb_patch.versions import npu_runner  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parity"))

PARITY_ITERATIONS = 2900  # engine iterations per k = 1..4: ~10,500 engine steps (schedule() calls) in total
MIN_TOTAL_STEPS = 10_000
# The default 64-token budget leaves room for every decode (8 requests x (1 + 4 drafts) <= 40 tokens): the scheduler
# cuts drafts for budget reasons only with a tighter budget. One more run: k = 4 with a 16-token budget.
TIGHT_BUDGET = (4, 16, 700, 7)  # (k, max_num_batched_tokens, iterations, seed)
# The fast parity runs (~10 s; the killer of tests/mutation): every edge case of runner_harness.EDGE_CASES.
EDGE_RUNS = ((1, None, 300, 1), (2, None, 600, 2), (3, None, 600, 23), (4, 16, 400, 7))


@pytest.fixture(scope="module")
def H(cpu_worker):
    import runner_harness

    return runner_harness


@pytest.fixture(scope="module")
def release(cpu_worker):
    return importlib.import_module(HARNESS)


@pytest.fixture(scope="module")
def ZB(release):
    return release.ZERO_BUBBLE


@pytest.fixture(scope="module")
def sess(H):
    with H.session() as s:
        yield s


def _shape(k, budget=None):
    from zb_patch.check.selftest.compat import EngineShape

    return EngineShape(num_spec_tokens=k, **({"max_num_batched_tokens": budget} if budget else {}))


def _check_waits(res):
    u, p = res["unpatched"], res["patched"]
    # unpatched: the classic blocking sync before input preparation on every spec-decode step
    assert u["spec_steps"] > 0
    assert u["min_before_prep_per_spec_step"] >= 1, u
    assert set(u["waits"]) == {"update_states"}, u["waits"]
    # patched: never before input preparation; at most one wait per step, after the inputs were queued
    assert p["max_before_prep_per_step"] == 0, p
    assert set(p["waits"]) <= {"prepare_inputs:after"}, p["waits"]
    assert p["max_waits_per_step"] <= 1, p
    assert p["zb"]["steps"] == p["steps"], p["zb"]  # its step count: one per engine step, all of them active
    zb = p["zb"]
    assert zb["active"] and zb["fallback_uploads"] == 0, zb
    assert zb["corrected_steps"] > 0 and p["waits"]["prepare_inputs:after"] == zb["corrected_steps"]
    assert zb["host_waits"] == zb["corrected_steps"]  # one wait per corrected step, counted
    # the input-preparation event: the patched path adds one wait per step where the release makes none (0.13), and
    # records it once per input preparation, after the last host-to-device copy of the step's inputs
    assert p["input_prep_waits"] - u["input_prep_waits"] == added_input_prep_waits(res), (u, p)
    added_records = p["prepared_steps"] if res["waits_for_input_prep"] else 0
    assert p["input_prep_records"] - u["input_prep_records"] == added_records, (u, p)
    assert zb["in_prepare"] is False  # the _prepare_inputs window is closed between steps (0.13)


def added_input_prep_waits(res):
    zb = res["patched"]["zb"]
    return zb["steps"] if res["waits_for_input_prep"] else 0


def test_parity_10k_steps(H, release, sess, capsys):
    total = 0
    lines = []
    edges = Counter()
    for k, budget, iterations, seed in [(k, None, PARITY_ITERATIONS, k) for k in (1, 2, 3, 4)] + [TIGHT_BUDGET]:
        res = H.parity(sess, _shape(k, budget), iterations, seed=seed, release=release)
        assert res["divergences"] == 0, res["examples"]
        _check_waits(res)
        u, p = res["unpatched"], res["patched"]
        edges.update(u["edges"])
        if budget:
            lines.append(f"k={k}, {budget}-token budget: {u['steps']} steps, edge cases {dict(u['edges'])}")
            total += u["steps"]
            continue
        assert 0 < u["accepted"] < u["drafted"]  # partial acceptance overall
        assert u["preemptions"] > 0 and u["aborted"] > 0  # batch changes of every kind happened
        assert p["negative_input_ids"] == (0 if CLAMPS_INPUT_IDS else u["negative_input_ids"]), (
            u["negative_input_ids"],
            p["negative_input_ids"],
        )
        total += u["steps"]
        lines.append(
            f"k={k}: {u['steps']} steps ({u['spec_steps']} spec), {u['requests']} requests, "
            f"{u['preemptions']} preemptions, {u['aborted']} aborts, drafted {u['drafted']} / accepted "
            f"{u['accepted']}; accepted-count waits before input prep per spec step: unpatched "
            f"{u['before_prep_per_spec_step']:.2f}, patched {p['max_before_prep_per_step']} (max per step); "
            f"patched waits after input prep: {p['waits'].get('prepare_inputs:after', 0)} on "
            f"{p['zb']['corrected_steps']} corrected steps; input-prep event waits unpatched / patched "
            f"{u['input_prep_waits']} / {p['input_prep_waits']}; unfilled draft ids (not compared) "
            f"{u['unfilled_drafts']} / {p['unfilled_drafts']}; negative input ids unpatched / patched "
            f"{u['negative_input_ids']} / {p['negative_input_ids']}; {u['seconds']}s / {p['seconds']}s"
        )
    assert total >= MIN_TOTAL_STEPS
    assert all(edges[e] for e in H.EDGE_CASES), edges
    lines.append(f"edge cases: {dict(edges)}")
    with capsys.disabled():
        print(f"\nrunner-level parity ({release.ADAPTER.id}), {total} steps, 0 divergences:\n  " + "\n  ".join(lines))


MLA_ITERATIONS = 300  # engine iterations per k = 1..3 (~2,700 engine steps in all)


def _mla_shape(k):
    from zb_patch.check.selftest.compat import EngineShape

    # blocks of 128 (AscendMLABackend's kernel block size); prompts up to 1022 tokens load their context in chunks
    return EngineShape(num_spec_tokens=k, block_size=128, max_model_len=1024, num_blocks=18, max_num_seqs=4)


def _draft_fields_overwritten(records):
    """Steps (and fields) where a draft position's metadata, as the draft model reads it, differs from what the
    builder returned for it."""
    steps, fields = 0, set()
    for rec in records.values():
        diff = {
            key
            for read, built in zip(rec.get("draft", []), rec.get("draft_built", []))
            for key in read
            if key in built and read[key] != built[key]
        }
        steps += bool(diff)
        fields |= diff
    return {"steps": steps, "fields": fields}


def test_mla_metadata_parity(H, release, sess, capsys):
    lines, totals = [], {"preemptions": 0, "multi_chunk_steps": 0, "padded_full_steps": 0}
    for k in (1, 2, 3):
        res = H.parity(sess, _mla_shape(k), MLA_ITERATIONS, seed=k, release=release, method="mtp")
        assert res["divergences"] == 0, res["examples"]
        _check_waits(res)
        u, p, cov = res["unpatched"], res["patched"], res["mla"]
        assert u["spec_steps"] > 0 and 0 < u["accepted"] < u["drafted"]
        assert p["negative_input_ids"] == (0 if CLAMPS_INPUT_IDS else u["negative_input_ids"])
        # every step that ran the model built target metadata, and the drafter's metadata for its positions
        assert cov["steps"]["target"] == cov["steps"]["draft"] == cov["steps"]["draft_built"] >= u["spec_steps"], cov
        assert cov["steps"].get("graph_update", 0) > 0 and cov["context_chunk_steps"] > 0, cov
        assert cov["max_draft_positions"] == k, cov
        # both runs carry the fixes: on 0.18 mla-draft-rope-rows gives every draft position rows of its own
        # (test_mla_018_draft_rope_rows_overwritten_without_the_fix shows the release without it)
        stale = _draft_fields_overwritten(res["mla_records"][0])
        assert stale["steps"] == 0, stale
        totals["preemptions"] += u["preemptions"]
        totals["multi_chunk_steps"] += cov["multi_chunk_steps"]
        totals["padded_full_steps"] += cov["padded_full_steps"]
        lines.append(
            f"k={k}: {u['steps']} steps, {u['preemptions']} preemptions; MLA steps {cov['steps']}; "
            f"fields {cov['fields']}; values compared {sum(cov['values'].values())}; context-chunk steps "
            f"{cov['context_chunk_steps']} ({cov['multi_chunk_steps']} in >= 2 chunks); padded FULL steps "
            f"{cov['padded_full_steps']}; 0 divergences; steps whose draft metadata was overwritten before the "
            f"model read it: {stale['steps']} {sorted(stale['fields'])}"
        )
    assert all(totals.values()), totals
    with capsys.disabled():
        print(f"\nMLA metadata parity ({release.ADAPTER.id}):\n  " + "\n  ".join(lines))


@pytest.mark.skipif(FAMILY != "0.18", reason="vllm-ascend 0.13 builds and runs the draft positions one by one")
def test_mla_018_draft_rope_rows_overwritten_without_the_fix(H, release, sess):
    """vllm-ascend 0.18 as released (``fixes=False``: both runs without the fixes of the release's defects) builds
    every draft position's metadata before the MTP model runs, and the decode RoPE rows are views of one static
    buffer (rotary_embedding._cos_mla / _sin_mla): each later build overwrites the rows of the earlier positions
    (docs/e2e.md, mla-draft-rope-rows), in both runs alike; with the fixes (test_mla_metadata_parity) no position's rows
    change between its build and the draft model's read."""
    res = H.parity(sess, _mla_shape(2), 120, seed=2, release=release, method="mtp", fixes=False)
    assert res["divergences"] == 0, res["examples"]
    for records in res["mla_records"]:
        stale = _draft_fields_overwritten(records)
        assert stale["steps"] > 0 and stale["fields"] == {"decode.cos", "decode.sin"}, stale


def test_mla_plant_reaches_every_recorded_part(H, release, ZB, sess, monkeypatch):
    """Ascend attention handed optimistic CPU seq_lens (the host correction left out): the MLA target metadata, the
    graph update's kv lengths and the drafter's metadata all diverge."""
    _plant(monkeypatch, ZB, "no-host-seq-lens-correction")
    res = H.parity(sess, _mla_shape(2), 120, seed=2, release=release, method="mtp")
    kinds = res["divergence_kinds"]
    assert {"mla target", "mla graph_update", "mla draft", "mla draft_built"} <= set(kinds), kinds


def test_parity_scheduler_edge_cases(H, release, sess):
    """Short parity runs that still go through every scheduler / batch edge case of ``runner_harness.EDGE_CASES``:
    drafts cut below k by the token budget (a 16-token budget) and near max_model_len, a request left out of a step
    while holding drafts and scheduled again, preempted and resumed, rows moved and swapped. The fast killer of the
    mutation run (docs/mutation.md)."""
    edges = Counter()
    for k, budget, iterations, seed in EDGE_RUNS:
        res = H.parity(sess, _shape(k, budget), iterations, seed=seed, release=release)
        assert res["divergences"] == 0, res["examples"]
        _check_waits(res)
        edges.update(res["unpatched"]["edges"])
        assert res["patched"]["edges"] == res["unpatched"]["edges"]
    assert all(edges[e] for e in H.EDGE_CASES), edges


def test_parity_with_outputs_processed_before_the_next_step(H, release, sess, monkeypatch):
    """Every third step's output processed before the next step is scheduled (vLLM 0.13 / 0.18's engine core does
    that when the output is already there): the next step's counts from the scheduler already have the rejected
    drafts subtracted. Zero-bubble with its own test of exact counts, the fix left out, stays identical to classic
    async with the adapter's fix exact-counts-after-early-output, which found such rows (classic async without it
    subtracts them a second time: tests/engine/test_engine.py forces that in the engine)."""
    from zb_patch.check.selftest.workload import make_workload
    from zb_patch.versions.fixes import exact_counts_after_early_output as exact_counts

    found = []
    already_exact = exact_counts.already_exact

    def spy(*args):  # the fix's own call of it (zero-bubble holds its own reference)
        found.append(already_exact(*args))
        return found[-1]

    monkeypatch.setattr(exact_counts, "already_exact", spy)
    shape, iterations, seed = _shape(2), 300, 3
    specs = make_workload(seed, shape, iterations)
    zb_ids, _ = H.zero_bubble_and_fix_ids(release.ADAPTER)

    def run(disabled):
        return H.run_mode(
            sess, shape, specs, iterations, release=release, seed=seed, patched=True, disabled=disabled, early=3
        )

    with H.reference_kernels():
        fix = run(zb_ids[:1])
        fix_found = sum(bool(rows) for rows in found)
        zb = run(("exact-counts-after-early-output",))  # zero-bubble's own test alone (the fix covers it too)
    diffs, examples, _ = H.compare(fix, zb)
    assert diffs == 0, examples
    assert zb.zb["active"] and zb.zb["steps"] == zb.steps and zb.zb["corrected_steps"] > 0, zb.zb
    assert fix_found > 0, "no step had rows whose count was already exact"


def test_parity_on_triton_kernels(H, release, ZB, sess):
    from zb_patch.kernels._launch import interpret_mode

    if not interpret_mode():
        pytest.skip("TRITON_INTERPRET=1 is not set: CPU tensors use the reference twins")
    res = H.parity(sess, _shape(3), 120, seed=11, release=release, triton=True)
    assert res["divergences"] == 0, res["examples"]
    _check_waits(res)
    buffers = res["runners"][1].__dict__[ZB.state_attr].buffers
    # one route on both releases: zero_bubble.CountCorrection over the Triton launcher bound with the release's base
    assert type(buffers.counts) is zero_bubble.CountCorrection
    assert type(buffers.counts.launch).__name__ == "TokenCountsLauncher" and buffers.counts.launch.base == ZB.count_base
    assert all(type(m).__name__ == "SlotMappingLauncher" for _, m in buffers.slot_mappers.values())


@pytest.mark.parametrize("max_num_seqs", [8, 17])  # 17: a section of more than one 16-row block
def test_staging_sections_are_disjoint_aligned_and_fill_the_buffer(H, ZB, sess, max_num_seqs):
    """The one pinned staging buffer: its six sections in order, each starting 16-element (64-byte) aligned, none
    overlapping the next, the last ending where the buffer ends; the upload's query_pos offset is that section's."""
    shape = dataclasses.replace(_shape(2), max_num_seqs=max_num_seqs)
    vc = H.build_config(sess, shape)
    runner = H.make_runner(vc, H.kv_cache_config(vc, shape))
    assert runner.max_num_reqs == max_num_seqs
    b = ZB.state_of(runner).buffers
    base = b.staging.np.__array_interface__["data"][0]
    names = ("cpu_counts", "num_scheduled", "prev_positions", "prev_drafts", "req_indices", "query_pos")
    spans = []
    for name in names:
        section = getattr(b, name)
        start = (section.np.__array_interface__["data"][0] - base) // section.np.itemsize
        assert start % 16 == 0 and section.gpu.data_ptr() - b.staging.gpu.data_ptr() == start * 4, name
        spans.append((start, start + section.np.shape[0]))
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    assert spans[-1][1] == b.staging.np.shape[0] and b.query_pos_at == spans[-1][0]
    assert [s[1] - s[0] for s in spans] == [runner.max_num_reqs] * 4 + [runner.positions.gpu.shape[0]] * 2


def test_parity_without_batch_reordering(H, release, sess):
    res = H.parity(sess, _shape(2), 700, seed=5, release=release, reorder=False)
    assert res["divergences"] == 0, res["examples"]
    _check_waits(res)


def test_fallback_upload_when_the_device_counts_are_missing(H, release, ZB, sess):
    """A corrected step whose previous step left no device counts (did not go through the padded drafter's copy)
    uploads the host counts instead -- one wait, inside input preparation after the inputs are queued, as the
    corrected step's own wait -- and stays exact."""
    drops = []

    def drop_device_counts(runner):
        copy = runner._copy_valid_sampled_token_count  # the patched method

        def every_third_lost(next_token_ids, valid_sampled_tokens_count):
            copy(next_token_ids, valid_sampled_tokens_count)
            if len(drops) % 3 == 2:
                ZB.active(runner).valid_gpu = None
            drops.append(1)

        runner._copy_valid_sampled_token_count = every_third_lost

    res = H.parity(sess, _shape(3), 300, seed=4, release=release, runner_hook=drop_device_counts)
    assert res["divergences"] == 0, res["examples"]
    p = res["patched"]
    zb = p["zb"]
    lost = (len(drops) + 2) // 3  # every third step's device counts: at most one upload each
    assert 1 < zb["fallback_uploads"] <= lost and zb["host_waits"] == zb["corrected_steps"]
    assert p["max_before_prep_per_step"] == 0 and p["max_waits_per_step"] <= 1
    assert set(p["waits"]) <= {"prepare_inputs:after"} and p["waits"]["prepare_inputs:after"] == zb["host_waits"]


def test_backup_token_buffers_alternate(H, release, ZB, sess):
    """The drafter's backup-token staging buffer alternates between the release's own and one more, step by step."""
    used = []

    def track(runner):
        own = runner.drafter.backup_next_token_ids
        copy = runner._copy_valid_sampled_token_count  # called right after prepare_next_token_ids_padded

        def tracked(*args):
            used.append(runner.drafter.backup_next_token_ids)
            copy(*args)

        runner._copy_valid_sampled_token_count = tracked
        used.append(own)

    res = H.parity(sess, _shape(2), 60, seed=3, release=release, runner_hook=track)
    assert res["divergences"] == 0, res["examples"]
    unpatched, patched = res["runners"]
    pair = patched.drafter.__dict__[ZB.backup_pair_attr]
    own, steps = used[0], used[1:]
    assert pair[0] is own and pair[1] is not own and patched.drafter.backup_next_token_ids in pair
    assert len(steps) > 10 and all(b is pair[i % 2] for i, b in enumerate(steps))
    assert ZB.backup_pair_attr not in unpatched.drafter.__dict__


class EmbeddingSpy:
    """Stands in for the model's embedding layer (the harness has no model): a real ``F.embedding`` lookup over a
    seeded table, so a negative id fails exactly as a real embedding would; counts the ids it was handed."""

    def __init__(self, vocab_size, hidden_size):
        import torch

        self.weight = torch.randn(vocab_size, hidden_size, generator=torch.Generator().manual_seed(0))
        self.ids = 0

    def embed_input_ids(self, input_ids, **kwargs):
        import torch.nn.functional as F

        self.ids += int(input_ids.numel())
        return F.embedding(input_ids, self.weight)


def test_prompt_embeds_model_never_embeds_a_negative_id(H, release, sess):
    """0.13 embeds prompt-embeds / multimodal inputs inside _prepare_inputs, right after _init_model_kwargs: the
    adapter's clamp must come before that (a -1 id would index the embedding out of range). Zero-bubble against the
    bare release (no fixes on either side: the stale-draft-placeholders fix leaves no -1 id to clamp)."""
    if not CLAMPS_INPUT_IDS:
        pytest.skip("the adapter of this release does not clamp input ids (its release hands the model the ids)")
    spies = []

    def prompt_embeds(runner):  # what enable_prompt_embeds=True gives the runner, with the embedding spied on
        runner.enable_prompt_embeds = True
        runner.model = EmbeddingSpy(runner.model_config.get_vocab_size(), runner.inputs_embeds.gpu.shape[1])
        spies.append(runner.model)

    res = H.parity(sess, _shape(3), 700, seed=3, release=release, runner_hook=prompt_embeds, fixes=False)
    assert res["divergences"] == 0, res["examples"]
    assert res["unpatched"]["negative_input_ids"] > 0  # the release's own path had -1 ids to clamp
    assert spies[0].ids > 0 and res["patched"]["negative_input_ids"] == 0


def test_kernels_compiled_at_kv_cache_initialisation(H, ZB, sess):
    """The initialize_kv_cache wrapper: the release's method runs first (arguments and result passed through), then
    zero-bubble's activation is decided and, when active, its launches run once on no request (compile_kernels):
    seq_lens.gpu becomes all padding (0), every slot mapping the release computes all PAD_SLOT_ID; positions.gpu and
    the device counts stay as they were; the time is kept per runner. Not active: nothing runs."""
    shape = _shape(2)
    vc = H.build_config(sess, shape)
    runner = H.make_runner(vc, H.kv_cache_config(vc, shape))
    calls = []

    def release(r, *args, **kwargs):
        calls.append((r, args, kwargs))
        return "release result"

    wrapped = ZB.make_initialize_kv_cache(release)
    st = ZB.state_of(runner)
    b = st.buffers
    for buf in (b.cpu_counts, b.num_scheduled):  # what a launch over one row would read
        buf.gpu.fill_(3)
    runner.seq_lens.gpu.fill_(5)
    runner.positions.gpu.fill_(9)
    tables = [t for t in runner.input_batch.block_table.block_tables if npu_runner.computes_slot_mapping(t)]
    assert tables
    for t in tables:
        t.slot_mapping.gpu.fill_(7)
    compiled = len(ZB.compile_seconds)
    assert wrapped(runner, "kv config", flag=1) == "release result"
    assert calls == [(runner, ("kv config",), {"flag": 1})]
    assert len(ZB.compile_seconds) == compiled + 1 and 0 <= ZB.compile_seconds[-1] < 60
    assert runner.seq_lens.gpu.eq(0).all() and runner.positions.gpu.eq(9).all() and b.num_computed.eq(0).all()
    if type(b.counts.launch).__name__ == "TokenCountsLauncher":  # Triton (interpreted here): the variant a corrected
        # step launches, the correcting one, for the release's base
        assert set(b.counts.launch._launchers) == {True} and b.counts.launch.base == ZB.count_base
    for t in tables:
        assert t.slot_mapping.gpu[: t.max_num_batched_tokens].eq(-1).all()

    off = H.build_config(sess, shape, async_scheduling=False)
    idle = H.make_runner(off, H.kv_cache_config(off, shape))
    idle.seq_lens.gpu.fill_(5)
    assert ZB.make_initialize_kv_cache(release)(idle) == "release result"
    assert len(ZB.compile_seconds) == compiled + 1 and idle.seq_lens.gpu.eq(5).all()


# -- planted mistakes: each must be caught ------------------------------------------------------------------


def _plant(monkeypatch, ZB, name):
    if name == "no-device-correction":  # positions / seq_lens / slot mapping left at the optimistic values
        original = ZB.device_correction

        def device_correction(runner, st, num_scheduled, total):
            queue, st.queue = st.queue, []
            original(runner, st, num_scheduled, total)
            st.queue = queue

        monkeypatch.setattr(ZB, "device_correction", device_correction)
    elif name == "no-host-seq-lens-correction":  # Ascend attention gets optimistic CPU seq_lens (#8461 / #10506)

        def exact_host_counts(runner, st):
            if st.queue and st.valid_host is None:
                st.valid_host = runner._get_valid_sampled_token_count()

        monkeypatch.setattr(ZB, "exact_host_counts", exact_host_counts)
    elif name == "no-deferred-correction":

        def apply_deferred(runner):
            st = ZB.active(runner)
            if st is not None:
                st.queue, st.valid_host = [], None

        monkeypatch.setattr(ZB, "apply_deferred", apply_deferred)
    elif name == "no-slot-mapping":
        monkeypatch.setattr(npu_runner, "computes_slot_mapping", lambda table: False)
    elif name == "counts-by-current-row":  # previous-step values read at the current row (vLLM #38556 fix 2)

        def by_row(req_ids, prev_map, n, out):
            out[:n] = np.arange(n)
            return out[:n]

        monkeypatch.setattr(zero_bubble, "compute_prev_positions", by_row)
    elif name == "read-counts-without-wait":  # host correction reads the count buffer without the event

        def exact_host_counts(runner, st):
            if not st.queue:
                return
            n_prev = st.num_prev
            st.valid_host = runner.valid_sampled_token_count_cpu[:n_prev].tolist()
            for host in (runner.seq_lens.np, runner.input_batch.num_computed_tokens_cpu):
                zero_bubble.correct_seq_lens_cpu(
                    host,
                    st.buffers.prev_positions.np,
                    st.buffers.prev_drafts.np,
                    np.asarray(st.valid_host),
                    runner.input_batch.num_reqs,
                    num_prev=n_prev,
                )

        monkeypatch.setattr(ZB, "exact_host_counts", exact_host_counts)
    elif name == "stale-padded-seq-lens":  # device seq_lens past num_reqs keep the previous step's values
        original = ZB.device_correction
        last = []

        def device_correction(runner, st, num_scheduled, total):
            original(runner, st, num_scheduled, total)
            n = runner.input_batch.num_reqs
            if last:
                runner.seq_lens.gpu[n:].copy_(last[0][n:])
            last[:] = [runner.seq_lens.gpu.clone()]

        monkeypatch.setattr(ZB, "device_correction", device_correction)
    elif name == "num-computed-cpu-after-forward":  # the deferred correction also hits num_computed_tokens_cpu
        original = ZB.apply_deferred

        def apply_deferred(runner):
            st = ZB.active(runner)
            if st is not None and st.valid_host:
                index = runner.input_batch.req_id_to_index
                for req_id, drafts, row in st.queue:
                    if req_id in index and row < len(st.valid_host):
                        runner.input_batch.num_computed_tokens_cpu[index[req_id]] -= drafts + 1 - st.valid_host[row]
            original(runner)

        monkeypatch.setattr(ZB, "apply_deferred", apply_deferred)
    else:
        raise KeyError(name)


# plant -> what must diverge first (a RowRecord field, "padded_seq_lens"), or the harness error it must raise
PLANTS = {
    "no-device-correction": "positions",
    "no-host-seq-lens-correction": "seq_len_cpu",
    "no-deferred-correction": "req_num_computed",
    "no-slot-mapping": "slots",
    "counts-by-current-row": "positions",
    "read-counts-without-wait": "PoisonedCounts",
    "stale-padded-seq-lens": "padded_seq_lens",
    "num-computed-cpu-after-forward": "num_computed_cpu_drafter",
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_planted_mistake_is_caught(H, release, ZB, sess, monkeypatch, plant):
    _plant(monkeypatch, ZB, plant)
    expected = PLANTS[plant]
    if expected == "PoisonedCounts":
        with pytest.raises(H.PoisonedCounts):
            H.parity(sess, _shape(2), 300, seed=0, release=release)
        assert R.resolve("vllm_ascend.worker.model_runner_v1:NPUModelRunner._prepare_inputs").patched_by is None
        return
    res = H.parity(sess, _shape(2), 300, seed=0, release=release)
    print(f"plant {plant}: {res['divergences']} divergences, first {res['examples'][:1]}")  # shown with -rP
    assert res["divergences"] > 0, f"planted mistake {plant!r} went unnoticed"
    assert res["first_divergence"] == expected, res["examples"][:3]


# -- activation scope ------------------------------------------------------------------------------------------


def test_unsupported_combination_falls_through_with_one_warning(H, release, ZB, sess, caplog):
    def hybrid(runner):  # what initialize_kv_cache sets for Mamba / GDN models
        runner.need_accepted_tokens = True

    ZB.warned.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.zb_patch"):
        res = H.parity(sess, _shape(2), 200, seed=2, release=release, runner_hook=hybrid)
        H.parity(sess, _shape(2), 20, seed=2, release=release, runner_hook=hybrid)  # a second runner: no new line
    assert res["divergences"] == 0, res["examples"]
    p = res["patched"]
    assert p["zb"]["active"] is False and "hybrid" in p["zb"]["reason"]
    assert set(p["waits"]) == {"update_states"} and p["min_before_prep_per_spec_step"] >= 1  # the classic path
    lines = [r for r in caplog.records if "zero-bubble NOT active" in r.getMessage()]
    assert len(lines) == 1 and "hybrid" in lines[0].getMessage()


def test_pd_decode_with_the_recompute_scheduler_is_refused_on_0_13(H, ZB, sess):
    """vllm-ascend 0.13 replaces GPUModelRunner._update_states on a PD decode node with the recompute scheduler; the
    adapter refuses exactly that combination (either setting alone is fine) and still needs a wanted runner first."""
    if FAMILY != "0.13":
        pytest.skip("a vllm-ascend 0.13 activation check")
    from types import SimpleNamespace

    shape = _shape(2)
    vc = H.build_config(sess, shape)
    runner = H.make_runner(vc, H.kv_cache_config(vc, shape))
    runner.ascend_config.recompute_scheduler_enable = True
    assert ZB.unsupported_reason(runner) == (True, "")
    runner.vllm_config = SimpleNamespace(kv_transfer_config=object())
    wanted, reason = ZB.unsupported_reason(runner)
    assert wanted and "PD decode" in reason
    runner.ascend_config.recompute_scheduler_enable = False
    assert ZB.unsupported_reason(runner) == (True, "")
    del runner.ascend_config  # no Ascend config at all: nothing to refuse
    assert ZB.unsupported_reason(runner) == (True, "")
    runner.use_async_scheduling = False
    assert ZB.unsupported_reason(runner)[0] is False


@pytest.mark.parametrize(
    "owner,attr,value,wanted,needle",
    [
        ("speculative_config", "disable_padded_drafter_batch", True, True, "disable_padded_drafter_batch"),
        ("speculative_config", "method", "ngram", True, "speculative method 'ngram'"),
        ("speculative_config", "num_speculative_tokens", 0, False, "off"),
        ("parallel_config", "pipeline_parallel_size", 2, True, "pipeline parallelism"),
        ("", "dcp_size", 2, True, "context parallelism"),
    ],
)
def test_settings_zero_bubble_leaves_alone(H, ZB, sess, monkeypatch, owner, attr, value, wanted, needle):
    shape = _shape(2)
    vc = H.build_config(sess, shape)
    runner = H.make_runner(vc, H.kv_cache_config(vc, shape))
    monkeypatch.setattr(getattr(runner, owner) if owner else runner, attr, value)  # a session config: restored after
    got_wanted, reason = ZB.unsupported_reason(runner)
    assert got_wanted is wanted and needle in reason


def test_release_instance_names(ZB):
    """A release's ZeroBubble: per-release names for the runner / drafter state and a logger under vllm.zb_patch (the
    logger tests and operators filter on), fresh bookkeeping."""
    zb = type(ZB)(ZB.release, other_runners="other")
    tag = ZB.release.replace(".", "")
    assert (zb.release, zb.other_runners) == (ZB.release, "other")
    assert zb.state_attr == ZB.state_attr == f"_zb_patch_{tag}"
    assert zb.backup_pair_attr == ZB.backup_pair_attr == f"_zb_patch_{tag}_backup_pair"
    assert zb.logger.name == ZB.logger.name == "vllm.zb_patch.ascend_" + ZB.release.replace(".", "_")
    assert zb.warned == set() and zb.compile_seconds == []


def test_async_scheduling_off_is_left_alone(H, ZB, sess, caplog):
    shape = _shape(2)
    vc = H.build_config(sess, shape, async_scheduling=False)
    runner = H.make_runner(vc, H.kv_cache_config(vc, shape))
    ZB.warned.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.zb_patch"):
        st = ZB.state_of(runner)
    assert not st.active and st.buffers is None and "off" in st.reason
    assert not [r for r in caplog.records if "zero-bubble" in r.getMessage()]


@pytest.mark.parametrize(
    "attr,value,needle",
    [
        ("pcp_size", 2, "context parallelism"),
        ("uses_mrope", True, "M-RoPE"),
        ("uses_xdrope_dim", 1, "XD-RoPE"),
        ("need_accepted_tokens", True, "hybrid"),
        ("cache_config.mamba_cache_mode", "align", "hybrid"),
        ("is_pooling_model", True, "pooling"),
        ("valid_sampled_token_count_event", None, "no valid_sampled_token_count_event"),
        ("speculative_config.method", "eagle3", ""),  # every supported method runs
        ("speculative_config.method", "mtp", ""),
        ("cache_config.mamba_cache_mode", "all", ""),  # only the accepted-token alignment is refused
    ],
)
def test_unsupported_reasons(H, ZB, sess, monkeypatch, attr, value, needle):
    """Each check of unsupported_reason, one setting at a time; needle "": zero-bubble runs."""
    shape = _shape(2)
    vc = H.build_config(sess, shape)
    runner = H.make_runner(vc, H.kv_cache_config(vc, shape))
    assert ZB.unsupported_reason(runner) == (True, "")
    *path, name = attr.split(".")
    owner = runner
    for part in path:
        owner = getattr(owner, part)
    monkeypatch.setattr(owner, name, value, raising=False)  # a session config: restored after
    wanted, reason = ZB.unsupported_reason(runner)
    assert wanted is True and (needle in reason if needle else reason == ""), reason


@pytest.mark.parametrize(
    "attr",
    [
        "pcp_size",
        "dcp_size",
        "uses_mrope",
        "uses_xdrope_dim",
        "need_accepted_tokens",
        "is_pooling_model",
        "cache_config.mamba_cache_mode",
    ],
)
def test_unsupported_reason_without_a_later_releases_attribute(H, ZB, sess, monkeypatch, attr):
    """A runner of a release that predates one of the features checked (no such attribute) runs zero-bubble: an
    absent attribute reads as the feature off."""
    shape = _shape(2)
    vc = H.build_config(sess, shape)
    runner = H.make_runner(vc, H.kv_cache_config(vc, shape))
    if attr == "cache_config.mamba_cache_mode":  # a dataclass field (class default): a config object without it
        from types import SimpleNamespace

        kept = {k: v for k, v in vars(runner.cache_config).items() if k != "mamba_cache_mode"}
        monkeypatch.setattr(runner, "cache_config", SimpleNamespace(**kept))
        owner, name = runner.cache_config, "mamba_cache_mode"
    else:
        owner, name = runner, attr
        monkeypatch.delattr(runner, attr)  # an instance attribute on the releases tested
    assert not hasattr(owner, name)
    assert ZB.unsupported_reason(runner) == (True, "")


def test_unsupported_reason_other_runner_classes(H, ZB, sess):
    """A subclass of the release's NPUModelRunner (the 310P / xlite runners are) keeps the classic path."""
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    shape = _shape(2)
    vc = H.build_config(sess, shape)
    runner = H.make_runner(vc, H.kv_cache_config(vc, shape))
    runner.__class__ = type("OtherRunner", (NPUModelRunner,), {})
    wanted, reason = ZB.unsupported_reason(runner)
    assert wanted is True and "runner class" in reason and "OtherRunner" in reason and ZB.other_runners in reason
