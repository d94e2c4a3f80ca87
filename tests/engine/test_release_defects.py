"""The release's own async + speculative-decoding defects that zb-patch fixes, through vLLM's real engine on the
installed vllm-ascend platform (CPU emulation of the NPU ops, tests/support), one engine process per configuration
(tests/engine/run_defect_engine.py: tests/engine/run_engine.py's launcher plus recorders of the defects).

Each defect: the release as it is shows it; ``ZB_PATCH=1`` (with zero-bubble, and where the defect is not
zero-bubble's business also with zero-bubble left out: ``ZB_PATCH_DISABLE=<a zero-bubble patch>`` disables its group,
"async with only the fixes", or in synchronous scheduling) fixes it; ``ZB_PATCH_DISABLE=<the fix>`` brings it back.

* vLLM #37159, ``stale-draft-placeholders`` (vllm-ascend 0.13 / 0.18 / 0.23): requests that run into max_model_len
  skip a step with their ``-1`` draft placeholders (vLLM's max_model_len clamp on an optimistic count) and come back
  with draft input ids that are not their drafts: on 0.18 the ``-1`` reaches the target's embedding (``IndexError``);
  on 0.23 the same ``-1`` (its embedding masks it: a rejected draft), on 0.13 the row's stale ids are verified. With
  the fix: every such row gets the drafts proposed for its request, the tokens are synchronous scheduling's, zb-patch
  equals the release's async with only the fix in every field.
* vllm-ascend 0.13's MtpProposer ``slot_mapping += 1``, ``mtp-draft-slots`` (0.13, MTP, k >= 2): a later draft step's
  KV write at the first position of a new block lands in another running request's block (recorded: writer, slot,
  owner). With the fix: every later draft write lands in the writer's own blocks.
* vllm-ascend 0.18 draft lengths at max_model_len, ``draft-seq-lens-max-model-len`` (0.18, MTP, k >= 2): the draft
  steps' device and host sequence lengths of a request at the limit differ (host 1 vs device max_model_len, then
  host 2, 3, ... vs device 1; the lengths count the step's rejected drafts, so rows still below the limit are hit and
  their drafts attend to one KV entry). With the fix: equal; tokens unchanged.
* vllm-ascend 0.13 / 0.18 EAGLE sample indices past the real batch, ``draft-sample-indices-past-batch`` (#9867 /
  #10080, in 0.21.0rc1): recorded on the eager engine at each draft-model call (the rows a padded FULL draft graph
  would sample; the out-of-bounds gather itself needs graphs: the GPU machine's FULL_DECODE_ONLY runs). With the fix:
  0 in every such row, as 0.23.0 gives natively.

docs/e2e.md ("Release defects") has the measured numbers. Cost: 10 engine processes on 0.13 / 0.18, 5 on 0.23, two at
a time (E2E_BIG=1: one more per defect, its ``-without-fix`` run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from importlib.metadata import version

import pytest

pytest.importorskip("vllm_ascend", reason="the engine tests need vllm-ascend (va013-e2e / va018-e2e envs)")

from zb_patch.check.engine import model as tiny_model  # noqa: E402
from zb_patch.check.engine.run import run_all  # noqa: E402
from zb_patch.check.engine.workload import Workload, divergences, summarize, table  # noqa: E402

RELEASE = version("vllm-ascend")
if RELEASE not in ("0.13.0", "0.18.0", "0.23.0"):
    pytest.skip(
        f"release defects are reproduced on vllm-ascend 0.13.0 / 0.18.0 / 0.23.0; this env has {RELEASE}",
        allow_module_level=True,
    )
# the patch ZB_PATCH_DISABLE names to leave the release's classic async path with only the fixes: zero-bubble's group
# on 0.13 / 0.18; on 0.23 (zero-bubble is the release's own) the slot-mapping kernel, the one other patch there
NOT_A_FIX = {
    "0.13.0": "zb013-optimistic-update-states",
    "0.18.0": "zb018-optimistic-update-states",
    "0.23.0": "slot-mapping-kernel",
}[RELEASE]
HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCHER = os.path.join(HERE, "run_defect_engine.py")
# the engine runs with everything of zb-patch on but the fix (``-without-fix``): E2E_BIG=1 only. CI shows each defect
# on the release as it is, and tests/patches/test_release_defects.py shows on the runner that disabling a fix brings
# its defect back.
WITHOUT_FIX = bool(os.environ.get("E2E_BIG"))
EMBEDDING_ERROR = "IndexError: index out of range in self"

# vLLM #37159: every request runs into max_model_len (64) at k = 4; the max_model_len clamp on the optimistic count
# leaves a request 0 tokens for a step, and it comes back with its placeholders (found by running it: classic async
# stops in the target's embedding on 0.13 and 0.18)
STALE = Workload(
    num_requests=6,
    max_prompt=20,
    num_speculative_tokens=4,
    max_model_len=64,
    limit_every=1,
    num_gpu_blocks=3,
    max_num_seqs=6,
)
# MTP slots: four requests of 100-120 prompt tokens cross position 127 (the end of their first 128-token block)
# while drafting k = 3; the block after each one's first block id is another request's
MTP_SLOTS = Workload(
    num_requests=4,
    min_prompt=100,
    max_prompt=120,
    min_tokens=24,
    max_tokens=40,
    num_speculative_tokens=3,
    max_model_len=256,
    limit_every=0,
    num_gpu_blocks=12,
    max_num_seqs=4,
    max_num_batched_tokens=64,
)
# draft lengths at max_model_len: MTP k = 3, every other request runs into max_model_len (64)
MTP_LIMIT = replace(STALE, num_speculative_tokens=3, limit_every=2)
# sample indices past the batch: prefill chunks of up to 64 tokens leave indices up to 63 in rows that preemption and
# finished requests then leave past the real batch (found by running it: 11 of 109 drafter calls on 0.18.0 hold an
# index past 4 * (1 + 2) = 12, every padded decode batch's tokens)
SAMPLE_INDICES = Workload(
    num_requests=12, max_prompt=120, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4, limit_every=0
)


@dataclass
class Engine:
    name: str
    returncode: int
    result: dict | None
    stderr: str


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("defect-models"))
    tiny_model.write_models(root)
    tiny_model.write_mtp_model(root)
    return root


def engine(models, out_dir, name, wl, *, async_scheduling, env, drafter="eagle", record=()):
    """One engine process (a job for run_all)."""

    def job():
        out = os.path.join(out_dir, f"{name}.json")
        cmd = [sys.executable, LAUNCHER, "--record", ",".join(record), "--models", models, "--out", out]
        cmd += ["--workload", json.dumps(wl.to_json()), "--drafter", drafter]
        if async_scheduling:
            cmd.append("--async")
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("ZB_PATCH")}
        full_env.update(env)
        proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=3600)
        result = None
        if proc.returncode == 0:
            with open(out) as f:
                result = json.load(f)
        return Engine(name, proc.returncode, result, proc.stderr)

    return job


def _applied(result):
    status = result["zb_patch_status"]
    return {i["id"] for i in status.get("report", {}).get("items", []) if i["verdict"] == "applied"}


def _show(runs):
    done = {r.name: r.result for r in runs if r.result is not None}
    ref = next(iter(done.values()))
    print(
        "\n" + table([summarize(n, r) for n, r in done.items()], {n: len(divergences(ref, r)) for n, r in done.items()})
    )
    for r in runs:
        if r.result is None:
            print(f"{r.name}: exit {r.returncode}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}")


# ---------------------------------------------------------------------------------------------------------------
# vLLM #37159: stale -1 draft placeholders
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stale_runs(models, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("stale"))
    on = {"ZB_PATCH": "1"}
    configs = [
        ("sync", False, {}),
        ("async", True, {}),
        ("async+fixes", True, {**on, "ZB_PATCH_DISABLE": NOT_A_FIX}),
        ("async+zb", True, on),
    ]
    if WITHOUT_FIX:
        configs.append(("async+zb-without-fix", True, {**on, "ZB_PATCH_DISABLE": "stale-draft-placeholders"}))
    record = ("saved-drafts", "returning-rows")
    jobs = [engine(models, out, n, STALE, async_scheduling=a, env=e, record=record) for n, a, e in configs]
    runs = run_all(jobs, parallel=2)
    _show(runs)
    return {r.name: r for r in runs}


@pytest.mark.parametrize("name", ["async", "async+zb-without-fix"] if WITHOUT_FIX else ["async"])
def test_without_the_fix_returning_rows_get_wrong_drafts(stale_runs, name):
    """The release's classic async (on 0.23: its own zero-bubble), and zb-patch without the fix: a row back with
    scheduled drafts is not handed its request's drafts. vllm-ascend 0.18 (vLLM 0.18 writes the -1 placeholders into
    the re-added row): the -1 indexes the target's embedding out of range and the run stops. vllm-ascend 0.23: the
    same -1, which vLLM 0.23's embedding masks to a zero vector on this path (no crash; a draft that is rejected).
    vllm-ascend 0.13 (vLLM 0.13 writes nothing there): whatever the row's slot held before (zero-bubble's clamp turns
    a -1 into 0)."""
    run = stale_runs[name]
    if RELEASE == "0.18.0":
        assert run.returncode != 0 and EMBEDDING_ERROR in run.stderr, run.stderr[-3000:]
        assert "embed_input_ids" in run.stderr  # the target model's embedding (vllm/model_executor/models/llama.py)
        return
    assert run.result is not None, run.stderr[-3000:]
    rows = run.result["defects"]["returning-rows"]["rows"]
    assert rows and all(r["ids"] != r["proposed"] for r in rows), rows
    if RELEASE == "0.23.0":
        assert all(r["ids"] == r["scheduled"] == [-1] * len(r["ids"]) for r in rows), rows


@pytest.mark.parametrize("name", ["async+fixes", "async+zb"])
def test_with_the_fix_returning_rows_get_the_request_s_drafts(stale_runs, name):
    """Every row back with scheduled drafts is handed the drafts proposed for that request when it was last
    sampled (what it would have been verified with without the skip)."""
    run = stale_runs[name]
    assert run.result is not None, run.stderr[-3000:]
    rows = run.result["defects"]["returning-rows"]["rows"]
    assert rows and all(r["ids"] == r["proposed"] and None not in r["proposed"] for r in rows), rows
    counters = run.result["defects"]["saved-drafts"]
    assert counters["filled"] == len(rows) and counters["unknown"] == 0, counters


def test_with_the_fix_tokens_are_sync_s(stale_runs):
    runs = {n: stale_runs[n].result for n in ("sync", "async+fixes", "async+zb")}
    for name, result in runs.items():
        assert result is not None, (name, stale_runs[name].stderr[-3000:])
    assert runs["async+fixes"]["tokens"] == runs["sync"]["tokens"]
    assert runs["async+zb"]["tokens"] == runs["sync"]["tokens"]
    reqs = STALE.requests(tiny_model.VOCAB)
    assert all(len(runs["sync"]["tokens"][str(i)]) == n for i, (_, n) in enumerate(reqs))


def test_zero_bubble_equals_classic_async_with_the_fix(stale_runs):
    fixes, zb = stale_runs["async+fixes"].result, stale_runs["async+zb"].result
    assert divergences(fixes, zb) == []
    assert "stale-draft-placeholders" in _applied(fixes) and NOT_A_FIX not in _applied(fixes)
    assert {"stale-draft-placeholders", NOT_A_FIX} <= _applied(zb)


def test_acceptance_with_the_fix_is_sync_s_up_to_the_max_model_len_clamp(stale_runs):
    """Every request of this workload ends at max_model_len, where vLLM's sync and async schedulers verify different
    numbers of drafts (docs/e2e.md, "The max_model_len clamp"); the acceptance rate stays sync's
    within 2 points (the drafts fed are the request's own: tests/patches/test_release_defects.py checks them one by
    one on the runner)."""
    sync, fixes = stale_runs["sync"].result, stale_runs["async+fixes"].result

    def rate(r):
        return sum(r["accepted"].values()) / sum(r["drafted"].values())

    assert abs(rate(sync) - rate(fixes)) < 0.02, (rate(sync), rate(fixes))


# ---------------------------------------------------------------------------------------------------------------
# vllm-ascend 0.13 / 0.18: the draft graph's sample indices past the real batch (vllm-ascend #9867 / #10080)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sample_index_runs(models, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sample-indices"))
    configs = [("sync", False, {})]
    if RELEASE != "0.23.0":  # 0.23.0 carries #9867 / #10080: nothing to fix
        configs += [("sync+fix", False, {"ZB_PATCH": "1"}), ("async+zb", True, {"ZB_PATCH": "1"})]
    jobs = [
        engine(models, out, n, SAMPLE_INDICES, async_scheduling=a, env=e, record=("sample-indices",))
        for n, a, e in configs
    ]
    runs = run_all(jobs, parallel=2)
    _show(runs)
    return {r.name: r for r in runs}


def test_without_the_fix_the_draft_graph_would_sample_past_its_batch(sample_index_runs):
    """The release's synchronous run: at the drafter's model calls, rows of the sample-index buffer past the real
    requests hold indices of earlier, larger batches, some past the tokens of every padded decode batch
    (``max_num_seqs * (1 + k)``): what a FULL draft graph, which samples the padded batch's rows, gathers out of bounds
    (docs/e2e.md, the big workload in FULL_DECODE_ONLY). vllm-ascend 0.23.0 carries #9867: zeros there."""
    run = sample_index_runs["sync"]
    assert run.result is not None, run.stderr[-3000:]
    seen = run.result["defects"]["sample-indices"]
    assert seen["after_wider"] > 0, seen  # calls whose rows past the batch an earlier, wider call wrote
    if RELEASE == "0.23.0":
        assert seen["stale_rows"] == 0, seen
    else:
        assert seen["past_every_batch"] > 0 and seen["largest"] >= seen["bound"], seen


@pytest.mark.skipif(RELEASE == "0.23.0", reason="0.23.0 carries #9867 / #10080 (the release's own run above)")
@pytest.mark.parametrize("name", ["sync+fix", "async+zb"])
def test_with_the_fix_rows_past_the_batch_sample_index_0(sample_index_runs, name):
    run = sample_index_runs[name]
    assert run.result is not None, run.stderr[-3000:]
    seen = run.result["defects"]["sample-indices"]
    assert seen["after_wider"] > 0 and seen["stale_rows"] == 0, seen
    assert "draft-sample-indices-past-batch" in _applied(run.result)
    # eager: nothing reads the rows past the batch, so the fix changes no token (and in sync no count either)
    fields = ("tokens", "drafted", "accepted") if name == "sync+fix" else ("tokens",)
    assert divergences(sample_index_runs["sync"].result, run.result, fields) == []


# ---------------------------------------------------------------------------------------------------------------
# vllm-ascend 0.13: MtpProposer's later draft slots (slot_mapping += 1)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mtp_slot_runs(models, tmp_path_factory):
    if RELEASE != "0.13.0":
        pytest.skip("vllm-ascend 0.16.0rc1+ has no MtpProposer (#7033): MTP slots come from the block table")
    out = str(tmp_path_factory.mktemp("mtp-slots"))
    configs = [
        ("sync", False, {}),
        ("sync+fixes", False, {"ZB_PATCH": "1"}),
        ("async+zb", True, {"ZB_PATCH": "1"}),
        ("sync+fixes-without-lengths-fix", False, {"ZB_PATCH": "1", "ZB_PATCH_DISABLE": "mtp-draft-lengths"}),
    ]
    if WITHOUT_FIX:
        configs.append(("sync+fixes-without-fix", False, {"ZB_PATCH": "1", "ZB_PATCH_DISABLE": "mtp-draft-slots"}))
    jobs = [
        engine(models, out, n, MTP_SLOTS, async_scheduling=a, env=e, drafter="mtp", record=("kv-owners",))
        for n, a, e in configs
    ]
    runs = run_all(jobs, parallel=2)
    _show(runs)
    for r in runs:
        if r.result is not None:
            kv = r.result["defects"]["kv-owners"]
            print(
                f"{r.name}: {kv['draft_writes']} later-draft KV writes, {len(kv['foreign_writes'])} into another "
                f"request's block {kv['foreign_writes'][:2]}, {len(kv['past_cache'])} past the cache; "
                f"{len(kv['wrong_slots'])} of {kv['slots_checked']} not their position's slot {kv['wrong_slots'][:2]} "
                f"({kv['block_starts_checked']} at a block's first position, {kv['padded']} padded)"
            )
    return {r.name: r for r in runs}


@pytest.mark.parametrize("name", ["sync", "sync+fixes-without-fix"] if WITHOUT_FIX else ["sync"])
def test_mtp_later_draft_writes_another_request_s_kv(mtp_slot_runs, name):
    run = mtp_slot_runs[name]
    assert run.result is not None, run.stderr[-3000:]
    kv = run.result["defects"]["kv-owners"]
    assert kv["foreign_writes"], kv
    for w in kv["foreign_writes"]:
        assert w["offset"] == 0 and w["owner"] != w["writer"]  # slot 0 of the next block id: another request's
    # as values: each wrong slot is a draft at a block's first position, given the slot after the previous one
    assert kv["wrong_slots"], kv
    for w in kv["wrong_slots"]:
        assert w["position"] % kv["block_size"] == 0 and w["slot"] != w["expected"], w


@pytest.mark.parametrize("name", ["sync+fixes", "async+zb"])
def test_with_the_fix_every_later_draft_write_is_the_writer_s(mtp_slot_runs, name):
    run = mtp_slot_runs[name]
    assert run.result is not None, run.stderr[-3000:]
    kv = run.result["defects"]["kv-owners"]
    assert kv["draft_writes"] > 0 and kv["foreign_writes"] == [] and kv["past_cache"] == [], kv
    # as values: every later draft's slot is the one its position has in the writer's own blocks (a slot in the
    # writer's blocks but at another offset, which the owner check alone cannot see, fails here), block starts included
    assert kv["wrong_slots"] == [] and kv["slots_checked"] == kv["draft_writes"], kv["wrong_slots"][:5]
    assert kv["block_starts_checked"] > 0, kv
    assert "mtp-draft-slots" in _applied(run.result)


def test_mtp_slot_fix_keeps_the_tokens(mtp_slot_runs):
    sync = mtp_slot_runs["sync"].result
    for name in ("sync+fixes", "async+zb", "sync+fixes-without-lengths-fix"):
        assert mtp_slot_runs[name].result["tokens"] == sync["tokens"], name


@pytest.mark.parametrize("name", ["sync", "sync+fixes-without-lengths-fix"])
def test_mtp_later_drafts_attend_with_the_first_step_s_lengths(mtp_slot_runs, name):
    """docs/e2e.md "mtp-draft-lengths": on the dense backend 0.13's later MTP draft steps attend with the first step's
    seq_lens_list / actual_seq_lengths_q (another request's KV, without their own newest entry), so the drafts after
    the first are not the model's: never accepted here, the first draft is."""
    run = mtp_slot_runs[name]
    assert run.result is not None, run.stderr[-3000:]
    accepted = run.result["accepted_per_pos"]
    print(f"\n{name}: accepted per position {accepted} of {run.result['drafted_per_pos']}")
    assert accepted[0] > 0 and accepted[1:] == [0] * (len(accepted) - 1), accepted
    assert "mtp-draft-lengths" not in _applied(run.result)


@pytest.mark.parametrize("name", ["sync+fixes", "async+zb"])
def test_with_the_lengths_fix_every_mtp_draft_position_is_accepted_at_times(mtp_slot_runs, name):
    """mtp-draft-lengths: each later step's lists follow the seq_lens the release moved on (one query token per
    request), so every draft position is the model's and accepted at times, less often than the one before."""
    run = mtp_slot_runs[name]
    assert run.result is not None, run.stderr[-3000:]
    accepted, drafted = run.result["accepted_per_pos"], run.result["drafted_per_pos"]
    print(f"\n{name}: accepted per position {accepted} of {drafted}")
    rates = [a / d for a, d in zip(accepted, drafted)]
    assert all(rates[i] > rates[i + 1] > 0 for i in range(len(rates) - 1)), rates
    assert "mtp-draft-lengths" in _applied(run.result)


# ---------------------------------------------------------------------------------------------------------------
# vllm-ascend 0.18: draft sequence lengths at max_model_len (host vs device)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_length_runs(models, tmp_path_factory):
    if RELEASE != "0.18.0":
        pytest.skip("the 0.18 proposer's masks (vllm-ascend 0.13 has MtpProposer, not attn_update_stack_num_spec_norm)")
    out = str(tmp_path_factory.mktemp("draft-lengths"))
    configs = [
        ("sync", False, {}),
        ("sync+fixes", False, {"ZB_PATCH": "1"}),
        ("async+zb", True, {"ZB_PATCH": "1"}),
    ]
    if WITHOUT_FIX:
        disable = {"ZB_PATCH": "1", "ZB_PATCH_DISABLE": "draft-seq-lens-max-model-len"}
        configs.append(("sync+fixes-without-fix", False, disable))
    jobs = [
        engine(models, out, n, MTP_LIMIT, async_scheduling=a, env=e, drafter="mtp", record=("draft-lengths",))
        for n, a, e in configs
    ]
    runs = run_all(jobs, parallel=2)
    _show(runs)
    for r in runs:
        if r.result is not None:
            d = r.result["defects"]["draft-lengths"]
            print(
                f"{r.name}: {d['draft_steps']} draft steps, {len(d['mismatches'])} rows with device != host "
                f"lengths {d['mismatches'][:3]}; {len(d['wrong_values'])} not #10112's {d['wrong_values'][:3]} "
                f"({d['at_limit']} rows expected at max_model_len, {d['masked']} at 1)"
            )
    return {r.name: r for r in runs}


@pytest.mark.parametrize("name", ["sync", "sync+fixes-without-fix"] if WITHOUT_FIX else ["sync"])
def test_draft_lengths_at_max_model_len_differ_on_host_and_device(draft_length_runs, name):
    run = draft_length_runs[name]
    assert run.result is not None, run.stderr[-3000:]
    d = run.result["defects"]["draft-lengths"]
    limit = d["max_model_len"]
    assert d["mismatches"], d
    # the first: a draft at position max_model_len - 1, device max_model_len, host 1
    assert any(m["device"] == limit and m["host"] == 1 for m in d["mismatches"]), d["mismatches"][:5]
    # as values: the host mask `>=` sets a length of max_model_len to 1, where #10112 keeps it
    assert any(w["expected"] == limit and w["host"] == 1 for w in d["wrong_values"]), d["wrong_values"][:5]


@pytest.mark.parametrize("name", ["sync+fixes", "async+zb"])
def test_with_the_fix_draft_lengths_agree(draft_length_runs, name):
    run = draft_length_runs[name]
    assert run.result is not None, run.stderr[-3000:]
    d = run.result["defects"]["draft-lengths"]
    assert d["draft_steps"] > 0 and d["mismatches"] == [], d["mismatches"][:5]
    # as values: #10112's lengths from each pass's first step (equal device and host with a shared off-by-one fail
    # here), with rows at max_model_len (kept) and past it (1) among them
    assert d["wrong_values"] == [], d["wrong_values"][:5]
    assert d["at_limit"] > 0 and d["masked"] > 0, d
    assert "draft-seq-lens-max-model-len" in _applied(run.result)


def test_draft_length_fix_keeps_the_tokens(draft_length_runs):
    sync = draft_length_runs["sync"].result
    for name in ("sync+fixes", "async+zb"):
        assert draft_length_runs[name].result["tokens"] == sync["tokens"], name
