"""Tokens through vLLM's real engine on the vllm-ascend 0.18 platform (CPU emulation of the NPU ops): the same
workload with async scheduling off, on, and on with ZB_PATCH=1 -- one engine process per configuration
(tests/engine/run_engine.py). Token ids per request must be identical across the runs, and the drafted /
accepted counts of the async runs equal to sync's. The same at k = 1, 3, 4 on a smaller workload; and the planted
mistakes of tests/engine/plants.py, each run as async + ZB_PATCH=1, must diverge as PLANT_DIVERGENCE / PLANT_ERROR
say (docs/e2e.md, "Planted mistakes").

E2E_BIG=1 runs the larger workload (more requests, longer prompts).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm_ascend", reason="the engine tests need vllm-ascend (va018-e2e env)")

import tiny_model  # noqa: E402
from workload import BIG, CI, Workload, divergences, summarize, table  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
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
    wl = BIG if os.environ.get("E2E_BIG") else CI
    out_dir = str(tmp_path_factory.mktemp("runs"))
    results = _in_pairs([lambda n=n: _run(n, models, out_dir, wl) for n in CONFIGS])
    runs = dict(zip(CONFIGS, (res for _, res, _, _ in results)))
    divs = {name: len(divergences(runs["sync"], res)) for name, res in runs.items()}
    print(f"\nk = {wl.num_speculative_tokens}\n" + table([summarize(n, r) for n, r in runs.items()], divs))
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


def test_runs_are_configured_as_named(runs):
    _, res = runs
    assert res["sync"]["async_scheduling"] is False
    assert res["async"]["async_scheduling"] is True and res["async"]["zb_patch"] == ""
    assert res["async+zb"]["async_scheduling"] is True and res["async+zb"]["zb_patch"] == "1"


@pytest.mark.parametrize("name", ["async", "async+zb"])
def test_async_matches_sync(runs, name):
    """Token ids per request equal to the sync run's; drafted and accepted counts too, except for requests that
    end at max_model_len: there vLLM 0.18's sync run verifies (and accepts) one draft more than its async runs,
    with and without zb-patch alike (docs/e2e.md, "Findings"; test_zero_bubble_matches_classic_async_exactly
    holds zb-patch to classic async exactly)."""
    wl, res = runs
    at_limit = wl.reaches_max_model_len(tiny_model.VOCAB)
    assert at_limit, "the workload must contain requests that reach max_model_len"
    assert divergences(res["sync"], res[name], fields=("tokens",)) == []
    counts = [
        d for d in divergences(res["sync"], res[name], fields=("drafted", "accepted")) if d.split()[0] not in at_limit
    ]
    assert counts == []


def test_zero_bubble_matches_classic_async_exactly(runs):
    _, res = runs
    zb, plain = res["async+zb"]["zb_patch_status"], res["async"]["zb_patch_status"]
    assert (zb["state"], zb["adapter"]) == ("applied", "ascend-0.18"), {
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
    return sweep


@pytest.mark.parametrize("k", K_SWEEP)
def test_k_sweep_async_and_zero_bubble_match_sync(k_sweep, k):
    runs = k_sweep[k]
    assert K_SWEEP_WORKLOAD.reaches_max_model_len(tiny_model.VOCAB) == set()
    assert sum(runs["sync"]["drafted"].values()) > 0
    assert runs["async+zb"]["zb_patch_status"]["state"] == "applied"
    for name in ("async", "async+zb"):
        assert divergences(runs["sync"], runs[name]) == [], name
    assert divergences(runs["async"], runs["async+zb"]) == []


# -- planted mistakes (tests/engine/plants.py): each run as async + ZB_PATCH=1 with the plant on -----------------

# plant -> (request, field) of the first divergence from the unplanted async+zb run (divergences() order: tokens
# before counts, requests in order) on the k = 2 workload
PLANT_DIVERGENCE = {
    "slot-mapping-off-by-one": ("0", "tokens"),
    "host-seq-lens-optimistic": ("0", "tokens"),
}
# plant -> the error it must raise: the -1 backup token reaches the EAGLE head's embedding
PLANT_ERROR = {"backup-token-minus-one": ("eagle_proposer.py", "IndexError: index out of range in self")}
# harmless on this path (docs/e2e.md says why): one process with both, which must change values and no token / count
HARMLESS = "drafter-reads-optimistic-num-computed,stale-padded-seq-lens"


@pytest.fixture(scope="module")
def planted(runs, models, tmp_path_factory):
    wl, _ = runs
    out_dir = str(tmp_path_factory.mktemp("plants"))
    names = [*PLANT_DIVERGENCE, *PLANT_ERROR, HARMLESS]
    results = _in_pairs([lambda p=p: _run("async+zb", models, out_dir, wl, plant=p, check=False) for p in names])
    return {p: (res, stderr) for p, (_, res, _, stderr) in zip(names, results)}


@pytest.mark.parametrize("plant", sorted(PLANT_DIVERGENCE))
def test_planted_mistake_diverges(runs, planted, plant):
    _, res = runs
    got, stderr = planted[plant]
    assert got is not None, stderr[-3000:]
    assert got["plant"] == plant and got["plant_hits"].get(plant, 0) > 0
    divs = divergences(res["async+zb"], got)
    print(f"\n{plant}: " + "; ".join(divs[:4]))
    assert divs, f"planted mistake {plant!r} went unnoticed"
    request, field = divs[0].split()[:2]
    assert (request, field.rstrip(":")) == PLANT_DIVERGENCE[plant], divs[:4]


@pytest.mark.parametrize("plant", sorted(PLANT_ERROR))
def test_planted_mistake_raises(planted, plant):
    got, stderr = planted[plant]
    where, error = PLANT_ERROR[plant]
    assert got is None, "the planted run finished"
    assert error in stderr and where in stderr, stderr[-3000:]


def test_harmless_plants_change_values_but_not_tokens(runs, planted):
    _, res = runs
    got, stderr = planted[HARMLESS]
    assert got is not None, stderr[-3000:]
    for plant in HARMLESS.split(","):
        assert got["plant_hits"].get(plant, 0) > 0, (plant, got["plant_hits"])
    assert divergences(res["async+zb"], got) == []
