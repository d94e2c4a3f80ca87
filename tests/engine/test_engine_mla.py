"""DeepSeek-style MLA + MTP through vLLM's real engine on the installed vllm-ascend platform (0.13.0 / 0.18.0): the
tiny DeepSeek-V3-style target of ``model.write_deepseek_model`` drafting with its own MTP layer (``zb-patch selftest
--engine --drafter deepseek-mtp``), through the release's own MLA backend (``AscendMLAMetadataBuilder``,
``AscendMLAImpl``) over the emulated MLA ops of tests/support/npu_ops/mla.py; sync, classic async and async +
ZB_PATCH=1, one engine process each (docs/e2e.md, "MLA (DeepSeek-style) + MTP").

The workload is the CI workload (chunked prefill that loads context chunks, a preemption, requests at
max_model_len) at the tutorial's k = 3; E2E_BIG=1 runs k = 1, 2, 3 (about three times as long: ~6 minutes on two
cores).
"""

from __future__ import annotations

import os
from importlib.metadata import version

import pytest

pytest.importorskip("vllm_ascend", reason="the engine tests need vllm-ascend (va013-e2e / va018-e2e envs)")

from test_engine import LAUNCHER, _decode_verifications, _kept_results, _selftest_cli  # noqa: E402

from zb_patch.check.engine import model as tiny_model  # noqa: E402
from zb_patch.check.engine.run import CHILD_ENV  # noqa: E402
from zb_patch.check.engine.verdict import compare  # noqa: E402
from zb_patch.check.engine.workload import CI, divergences  # noqa: E402

RELEASE = version("vllm-ascend")
if RELEASE not in ("0.13.0", "0.18.0"):
    pytest.skip(f"MLA + MTP engine runs: vllm-ascend 0.13.0 / 0.18.0 (installed: {RELEASE})", allow_module_level=True)

KS = (1, 2, 3) if os.environ.get("E2E_BIG") else (3,)
WORKLOAD = CI
DRAFTER = "deepseek-mtp"
SUFFIX = "drafter-deepseek-mtp"  # run.run_config's tag of the kept results
# what each eager forward calls (the emulations count calls by mode: npu_ops.mla.CALLS, reported by run_engine.py)
FIA = {"0.18.0": "npu_fused_infer_attention_score_v2", "0.13.0": "npu_fused_infer_attention_score"}[RELEASE]
MLA_OPS = (
    "npu_interleave_rope interleaved",  # the query's RoPE part (decode path)
    "npu_kv_rmsnorm_rope_cache PA",  # decode path: latent + RoPE key into the paged caches
    "npu_kv_rmsnorm_rope_cache PA is_output_kv",  # prefill path: also returns them
    f"{FIA} MLA TND_NTD sparse_mode=3 paged",  # decode, verification and drafter passes
    "npu_transpose_batchmatmul perm_y=(1, 0, 2)",  # W_UV after FIA
    "npu_ring_mla first_ring triu",  # prefill: causal over the new tokens
    "npu_ring_mla default no_mask (context chunk)",  # prefill: the context, merged through the LSE
    "npu_paged_cache_load ND seq_starts",  # the context chunk's latent / RoPE key from the caches
)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    old = os.environ.get(CHILD_ENV)
    os.environ[CHILD_ENV] = LAUNCHER
    try:
        keep = str(tmp_path_factory.mktemp("mla_sweep"))
        rc, report = _selftest_cli(WORKLOAD, KS, keep, DRAFTER)
    finally:
        if old is None:
            os.environ.pop(CHILD_ENV, None)
        else:
            os.environ[CHILD_ENV] = old
    return rc, report, {k: _kept_results(keep, k, SUFFIX) for k in KS}


def test_mla_selftest_passes(sweep):
    rc, report, _ = sweep
    assert (report["verdict"], rc) == ("PASS", 0), report["failures"]
    assert report["drafter"] == DRAFTER and sorted(report["k"]) == [str(k) for k in KS]


@pytest.mark.parametrize("k", KS)
def test_mla_runs_use_the_mla_backend_and_every_mla_op(sweep, k):
    """The drafter is vllm-ascend's DeepSeek MTP model (AscendDeepSeekMTP); every run called each emulated MLA op in
    each of the release's modes while generating (context chunks included), and every run preempted."""
    runs = sweep[2][k]
    for name, res in runs.items():
        assert (res["drafter"], res["draft_model"]) == (DRAFTER, "AscendDeepSeekMTP"), name
        calls = res["mla_op_calls"]
        assert all(calls.get(op, 0) > 0 for op in MLA_OPS), (name, calls)
        assert sum(res["preemptions"].values()) > 0, name


@pytest.mark.parametrize("k", KS)
def test_mla_async_and_zero_bubble_match_sync(sweep, k):
    """Tokens identical in the three runs; drafted / accepted counts as strict as the k = 2 EAGLE comparison
    (verdict.compare's rules: the notes it allows are explained by preemption / max_model_len); zero-bubble equal
    to classic async on every field, and applied."""
    runs = sweep[2][k]
    for name in ("async", "async+zb"):
        assert divergences(runs["sync"], runs[name], fields=("tokens",)) == [], name
    failures, _ = compare(runs, WORKLOAD, tiny_model.VOCAB)
    assert failures == []
    assert runs["async+zb"]["zb_patch_status"]["state"] == "applied"
    assert runs["async"]["zb_patch_status"]["state"] == "off"
    assert divergences(runs["async"], runs["async+zb"]) == []
    assert _decode_verifications(runs["async"]) == _decode_verifications(runs["async+zb"])
    for field in ("drafted_per_pos", "accepted_per_pos"):
        assert runs["async"][field] == runs["async+zb"][field], field


def test_mla_sync_tokens_equal_transformers_greedy(sweep, tmp_path_factory):
    """The engine's tokens (the release's MLA backend over the emulated ops) equal transformers' DeepseekV3, greedy,
    on the same checkpoint."""
    import transformers
    from test_tiny_model import reference_tokens

    model_dir = tiny_model.write_deepseek_model(str(tmp_path_factory.mktemp("reference_deepseek")))
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=tiny_model.DTYPE).eval()
    expected = reference_tokens(model, WORKLOAD)
    for k, runs in sweep[2].items():
        assert runs["sync"]["tokens"] == expected, k


def test_mla_acceptance_is_partial_and_varies(sweep):
    """Over the sync runs: acceptance 20-80 %, different across requests; for k > 1 lower at the last draft position
    than at the first, yet not zero."""
    for k, runs in sweep[2].items():
        sync = runs["sync"]
        drafted, accepted = sum(sync["drafted"].values()), sum(sync["accepted"].values())
        assert 0.2 <= accepted / drafted <= 0.8, (k, accepted, drafted)
        rates = [sync["accepted"].get(r, 0) / d for r, d in sync["drafted"].items() if d >= 10]
        assert max(rates) - min(rates) >= 0.2, (k, rates)
        by_pos = [a / d for a, d in zip(sync["accepted_per_pos"], sync["drafted_per_pos"])]
        assert k == 1 or by_pos[0] > by_pos[-1] > 0, (k, by_pos)
