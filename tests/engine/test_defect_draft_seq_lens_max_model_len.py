"""vllm-ascend 0.18 draft lengths at max_model_len, ``draft-seq-lens-max-model-len`` (MTP, k >= 2), through vLLM's real
engine (tests/engine/defect_engine.py): the draft steps' device and host sequence lengths of a request at the limit
differ (host 1 vs device max_model_len, then host 2, 3, ... vs device 1; the lengths count the step's rejected drafts,
so rows still below the limit are hit and their drafts attend to one KV entry). With the fix: equal; tokens
unchanged."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm_ascend", reason="the engine tests need vllm-ascend (va013-e2e / va018-e2e envs)")

from defect_engine import RELEASE, WITHOUT_FIX, applied, engine, show  # noqa: E402

from zb_patch.check.engine.run import run_all  # noqa: E402
from zb_patch.check.engine.workload import Workload  # noqa: E402

# MTP k = 3, every other request runs into max_model_len (64)
MTP_LIMIT = Workload(
    num_requests=6,
    max_prompt=20,
    num_speculative_tokens=3,
    max_model_len=64,
    limit_every=2,
    num_gpu_blocks=3,
    max_num_seqs=6,
)


@pytest.fixture(scope="module")
def draft_length_runs(defect_models, tmp_path_factory):
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
        engine(defect_models, out, n, MTP_LIMIT, async_scheduling=a, env=e, drafter="mtp", record=("draft-lengths",))
        for n, a, e in configs
    ]
    runs = run_all(jobs, parallel=2)
    show(runs)
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
    assert "draft-seq-lens-max-model-len" in applied(run.result)


def test_draft_length_fix_keeps_the_tokens(draft_length_runs):
    sync = draft_length_runs["sync"].result
    for name in ("sync+fixes", "async+zb"):
        assert draft_length_runs[name].result["tokens"] == sync["tokens"], name
