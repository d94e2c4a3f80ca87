"""vllm-ascend 0.13's MtpProposer (MTP, k >= 2), through vLLM's real engine (tests/engine/defect_engine.py); one set
of runs for its two fixes:

* ``mtp-draft-slots`` (``slot_mapping += 1``): a later draft step's KV write at the first position of a new block lands
  in another running request's block (recorded: writer, slot, owner). With the fix: every later draft write lands in
  the writer's own blocks.
* ``mtp-draft-lengths`` (dense attention): later draft steps attend with the first step's host length lists; every
  draft after the first is rejected. With the fix: every draft position is accepted at times."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm_ascend", reason="the engine tests need vllm-ascend (va013-e2e / va018-e2e envs)")

from defect_engine import RELEASE, WITHOUT_FIX, applied, engine, show  # noqa: E402

from zb_patch.check.engine.run import run_all  # noqa: E402
from zb_patch.check.engine.workload import Workload  # noqa: E402

# four requests of 100-120 prompt tokens cross position 127 (the end of their first 128-token block) while drafting
# k = 3; the block after each one's first block id is another request's
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


@pytest.fixture(scope="module")
def mtp_slot_runs(defect_models, tmp_path_factory):
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
        engine(defect_models, out, n, MTP_SLOTS, async_scheduling=a, env=e, drafter="mtp", record=("kv-owners",))
        for n, a, e in configs
    ]
    runs = run_all(jobs, parallel=2)
    show(runs)
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
    assert "mtp-draft-slots" in applied(run.result)


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
    assert "mtp-draft-lengths" not in applied(run.result)


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
    assert "mtp-draft-lengths" in applied(run.result)
