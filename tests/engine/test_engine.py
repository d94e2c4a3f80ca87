"""Tokens through vLLM's real engine on the vllm-ascend platform (0.13.0 or 0.18.0, whichever the env installs; CPU
emulation of the NPU ops): the same workload with async scheduling off, on, and on with ZB_PATCH=1 -- one engine
process per configuration (tests/engine/run_engine.py). Token ids per request must be identical across the runs, and
the drafted / accepted counts of the async runs equal to sync's. The same at k = 1, 3, 4 on a smaller workload; and
the planted mistakes of tests/engine/plants.py, each run as async + ZB_PATCH=1, must diverge as the release's
EXPECTED entry says (docs/e2e.md, "Planted mistakes"). What differs between the releases is in EXPECTED.

E2E_BIG=1 runs the larger workload (more requests, longer prompts).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm_ascend", reason="the engine tests need vllm-ascend (va013-e2e / va018-e2e env)")

import tiny_model  # noqa: E402
from workload import Workload, divergences, summarize, table  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class Expected:
    """What a release's runs must show where the releases differ."""

    adapter: str  # the adapter zb-patch applies (zb_patch/versions)
    # vLLM 0.13's sync scheduler keeps the drafts proposed after a partial prefill chunk (its update_draft_token_ids
    # has no is_prefill_chunk check, 0.18's has) and verifies them with the request's last prompt chunk; async
    # scheduling adds draft placeholders only once the prompt is done. run_engine counts those drafts apart.
    sync_drafts_with_prefill: bool
    # plant -> (request, field) of the first divergence from the unplanted async+zb run (divergences() order:
    # tokens before counts, requests in order) on the k = 2 workload
    plant_divergence: dict
    # plant -> (where, error) it must stop with
    plant_error: dict


# the plants hit the same first divergence on both releases (docs/e2e.md, "Planted mistakes")
EXPECTED = {
    "0.13": Expected(
        adapter="ascend-0.13",
        sync_drafts_with_prefill=True,
        plant_divergence={"slot-mapping-off-by-one": ("2", "tokens"), "host-seq-lens-optimistic": ("2", "tokens")},
        plant_error={"backup-token-minus-one": ("eagle_proposer.py", "IndexError: index out of range in self")},
    ),
    "0.18": Expected(
        adapter="ascend-0.18",
        sync_drafts_with_prefill=False,
        plant_divergence={"slot-mapping-off-by-one": ("2", "tokens"), "host-seq-lens-optimistic": ("2", "tokens")},
        plant_error={"backup-token-minus-one": ("eagle_proposer.py", "IndexError: index out of range in self")},
    ),
}
RELEASE = ".".join(importlib.metadata.version("vllm-ascend").split(".")[:2])
EXPECT = EXPECTED[RELEASE]

SMALL = Workload()
BIG = Workload(
    num_requests=48,
    max_prompt=300,
    max_tokens=60,
    max_model_len=384,
    max_num_batched_tokens=64,
    max_num_seqs=8,
    num_gpu_blocks=6,
)
CONFIGS = {"sync": ([], {}), "async": (["--async"], {}), "async+zb": (["--async"], {"ZB_PATCH": "1"})}
TIMEOUT_S = 1500


def _run(name: str, models: str, out_dir: str, wl: Workload, plant: str = "", check: bool = True):
    """One engine process of configuration ``name`` (CONFIGS); returns (name, result or None, seconds, stderr)."""
    flags, extra_env = CONFIGS[name]
    tag = f"{name}-k{wl.num_speculative_tokens}-{plant or 'none'}"
    out = os.path.join(out_dir, f"{tag}.json")
    env = {k: v for k, v in os.environ.items() if k != "ZB_PATCH"}
    env.update(extra_env)
    cmd = [sys.executable, os.path.join(HERE, "run_engine.py"), "--models", models, "--out", out]
    cmd += ["--workload", json.dumps(wl.to_json()), *flags] + (["--plant", plant] if plant else [])
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    secs = time.monotonic() - start
    if proc.returncode != 0:
        if check:
            raise AssertionError(f"engine run {tag} failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
        return tag, None, secs, proc.stderr
    with open(out) as f:
        return tag, json.load(f), secs, proc.stderr


def _in_pairs(jobs):
    """Run the engine processes two at a time (the CI box has two cores)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda job: job(), jobs))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    models = str(tmp_path_factory.mktemp("models"))
    tiny_model.write_models(models)
    return models


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    wl = BIG if os.environ.get("E2E_BIG") else SMALL
    out_dir = str(tmp_path_factory.mktemp("runs"))
    results = _in_pairs([lambda n=n: _run(n, models, out_dir, wl) for n in CONFIGS])
    runs = dict(zip(CONFIGS, (res for _, res, _, _ in results)))
    divs = {name: len(divergences(runs["sync"], res)) for name, res in runs.items()}
    print(f"\nk = {wl.num_speculative_tokens}\n" + table([summarize(n, r) for n, r in runs.items()], divs))
    print(f"drafts verified with prompt tokens: {_drafts_with_prefill(runs)}")
    for name, res in runs.items():
        for line in divergences(runs["sync"], res):
            print(f"{name} vs sync: {line}")
    for tag, _, secs, _ in results:
        print(f"{tag}: {secs:.0f} s (engine process)")
    return wl, runs


def test_every_request_generates_its_tokens(runs):
    wl, res = runs
    reqs = wl.requests(tiny_model.VOCAB)
    sync = res["sync"]
    assert sorted(sync["tokens"], key=int) == [str(i) for i in range(len(reqs))]
    for i, (_, max_tokens) in enumerate(reqs):
        toks = sync["tokens"][str(i)]
        assert len(toks) == max_tokens, (i, len(toks), max_tokens)
        assert all(0 <= t < tiny_model.VOCAB for t in toks)
    assert sum(sync["drafted"].values()) > 0, "no draft token was verified: the EAGLE path did not run"


def test_sync_tokens_equal_transformers_greedy(runs, tmp_path_factory):
    """The engine's tokens (release code over the emulated NPU ops) equal transformers' own Llama, greedy, on the
    same weights: the emulated attention / KV cache / norms compute what the model means."""
    from test_tiny_model import reference_tokens
    from transformers import LlamaForCausalLM

    wl, res = runs
    root = str(tmp_path_factory.mktemp("reference"))
    target_dir, _ = tiny_model.write_models(root)
    model = LlamaForCausalLM.from_pretrained(target_dir, dtype="float32").eval()
    assert reference_tokens(model, wl) == res["sync"]["tokens"]


def test_acceptance_is_partial_and_varies(runs):
    _, res = runs
    sync = res["sync"]
    drafted, accepted = sum(sync["drafted"].values()), sum(sync["accepted"].values())
    assert 0.2 <= accepted / drafted <= 0.8, (accepted, drafted)
    rates = {r: sync["accepted"][r] / d for r, d in sync["drafted"].items() if d}
    assert max(rates.values()) - min(rates.values()) >= 0.2, rates


def test_preemption_happens(runs):
    _, res = runs
    for name, r in res.items():
        assert sum(r["preemptions"].values()) > 0, name


def _decode_counts(result: dict) -> dict:
    """``result`` with drafted / accepted counting only the drafts verified in decode steps (without the ones
    verified together with prompt tokens: ``drafted_in_prefill`` / ``accepted_in_prefill``)."""
    out = dict(result)
    for field in ("drafted", "accepted"):
        apart = result[f"{field}_in_prefill"]
        out[field] = {r: n - apart.get(r, 0) for r, n in result[field].items() if n - apart.get(r, 0)}
    return out


def _drafts_with_prefill(runs: dict) -> dict:
    return {name: sum(r["drafted_in_prefill"].values()) for name, r in runs.items()}


def test_drafts_verified_with_prompt_tokens_only_in_sync_on_013(runs):
    """EXPECT.sync_drafts_with_prefill: on 0.13 the sync run verifies drafts with the last chunk of chunked prompts
    (the async runs never do); on 0.18 no run does."""
    _, res = runs
    with_prefill = _drafts_with_prefill(res)
    assert (with_prefill["sync"] > 0) == EXPECT.sync_drafts_with_prefill, with_prefill
    assert with_prefill["async"] == with_prefill["async+zb"] == 0, with_prefill


def test_runs_are_configured_as_named(runs):
    _, res = runs
    assert res["sync"]["async_scheduling"] is False
    assert res["async"]["async_scheduling"] is True and res["async"]["zb_patch"] == ""
    assert res["async+zb"]["async_scheduling"] is True and res["async+zb"]["zb_patch"] == "1"


@pytest.mark.parametrize("name", ["async", "async+zb"])
def test_async_matches_sync(runs, name):
    """Token ids per request equal to the sync run's; drafted and accepted counts of the decode steps too, except
    for requests that end at max_model_len: there the sync run verifies (and accepts) one draft more than the
    async runs, with and without zb-patch alike, on 0.13 and 0.18 (docs/e2e.md, "Findings";
    test_zero_bubble_matches_classic_async_exactly holds zb-patch to classic async exactly). Drafts verified with
    prompt tokens: test_drafts_verified_with_prompt_tokens_only_in_sync_on_013."""
    wl, res = runs
    at_limit = wl.reaches_max_model_len(tiny_model.VOCAB)
    assert at_limit, "the workload must contain requests that reach max_model_len"
    assert divergences(res["sync"], res[name], fields=("tokens",)) == []
    counts = divergences(_decode_counts(res["sync"]), _decode_counts(res[name]), fields=("drafted", "accepted"))
    assert [d for d in counts if d.split()[0] not in at_limit] == []


def test_zero_bubble_matches_classic_async_exactly(runs):
    _, res = runs
    zb, plain = res["async+zb"]["zb_patch_status"], res["async"]["zb_patch_status"]
    assert (zb["state"], zb["adapter"]) == ("applied", EXPECT.adapter), {
        k: zb.get(k) for k in ("state", "adapter", "reason")
    }
    assert plain["state"] == "off"
    assert divergences(res["async"], res["async+zb"]) == []


# -- k = 1, 3, 4: the same three configurations on a smaller workload (k = 2 is the workload above) -------------

K_SWEEP = (1, 3, 4)
K_SWEEP_WORKLOAD = Workload(num_requests=4, max_prompt=40, max_tokens=40)  # no request reaches max_model_len


@pytest.fixture(scope="module")
def k_sweep(models, tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("k_sweep"))
    wls = {k: dataclasses.replace(K_SWEEP_WORKLOAD, num_speculative_tokens=k) for k in K_SWEEP}
    jobs = [lambda n=n, k=k: _run(n, models, out_dir, wls[k]) for k in K_SWEEP for n in CONFIGS]
    results = iter(_in_pairs(jobs))
    sweep = {k: {n: next(results)[1] for n in CONFIGS} for k in K_SWEEP}
    for k, runs in sweep.items():
        divs = {name: len(divergences(runs["sync"], res)) for name, res in runs.items()}
        print(f"\nk = {k}\n" + table([summarize(n, r) for n, r in runs.items()], divs))
        print(f"drafts verified with prompt tokens: {_drafts_with_prefill(runs)}")
    return sweep


@pytest.mark.parametrize("k", K_SWEEP)
def test_k_sweep_async_and_zero_bubble_match_sync(k_sweep, k):
    runs = k_sweep[k]
    assert K_SWEEP_WORKLOAD.reaches_max_model_len(tiny_model.VOCAB) == set()
    assert sum(runs["sync"]["drafted"].values()) > 0
    assert runs["async+zb"]["zb_patch_status"]["state"] == "applied"
    for name in ("async", "async+zb"):
        assert divergences(runs["sync"], runs[name], fields=("tokens",)) == [], name
        assert divergences(_decode_counts(runs["sync"]), _decode_counts(runs[name])) == [], name
    with_prefill = _drafts_with_prefill(runs)
    assert (with_prefill["sync"] > 0) == EXPECT.sync_drafts_with_prefill, with_prefill
    assert with_prefill["async"] == with_prefill["async+zb"] == 0, with_prefill
    assert divergences(runs["async"], runs["async+zb"]) == []


# -- planted mistakes (tests/engine/plants.py): each run as async + ZB_PATCH=1 with the plant on -----------------

# harmless on this path (docs/e2e.md says why): one process with both, which must change values and no token / count
HARMLESS = "drafter-reads-optimistic-num-computed,stale-padded-seq-lens"


@pytest.fixture(scope="module")
def planted(runs, models, tmp_path_factory):
    wl, _ = runs
    out_dir = str(tmp_path_factory.mktemp("plants"))
    names = [*EXPECT.plant_divergence, *EXPECT.plant_error, HARMLESS]
    results = _in_pairs([lambda p=p: _run("async+zb", models, out_dir, wl, plant=p, check=False) for p in names])
    return {p: (res, stderr) for p, (_, res, _, stderr) in zip(names, results)}


@pytest.mark.parametrize("plant", sorted(EXPECT.plant_divergence))
def test_planted_mistake_diverges(runs, planted, plant):
    _, res = runs
    got, stderr = planted[plant]
    assert got is not None, stderr[-3000:]
    assert got["plant"] == plant and got["plant_hits"].get(plant, 0) > 0
    divs = divergences(res["async+zb"], got)
    print(f"\n{plant}: " + "; ".join(divs[:4]))
    assert divs, f"planted mistake {plant!r} went unnoticed"
    request, field = divs[0].split()[:2]
    assert (request, field.rstrip(":")) == EXPECT.plant_divergence[plant], divs[:4]


@pytest.mark.parametrize("plant", sorted(EXPECT.plant_error))
def test_planted_mistake_raises(planted, plant):
    got, stderr = planted[plant]
    where, error = EXPECT.plant_error[plant]
    assert got is None, "the planted run finished"
    assert error in stderr and where in stderr, stderr[-3000:]


def test_harmless_plants_change_values_but_not_tokens(runs, planted):
    _, res = runs
    got, stderr = planted[HARMLESS]
    assert got is not None, stderr[-3000:]
    for plant in HARMLESS.split(","):
        assert got["plant_hits"].get(plant, 0) > 0, (plant, got["plant_hits"])
    assert divergences(res["async+zb"], got) == []
