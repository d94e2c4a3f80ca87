"""Tokens through vLLM's real engine on the vllm-ascend 0.18 platform (CPU emulation of the NPU ops), run by the
product's own ``zb-patch selftest --engine`` (zb_patch/check/engine) with the tests' launcher as its child
(tests/engine/run_engine.py, named in ``ZB_SELFTEST_ENGINE_CHILD``): the same workload with async scheduling off, on,
and on with ZB_PATCH=1, one engine process per configuration. Token ids per request must be identical across the
runs, and the drafted / accepted counts of the async runs equal to sync's. The same at k = 1, 3, 4 on a smaller
workload; and the planted mistakes of tests/engine/plants.py, each run as async + ZB_PATCH=1, must diverge as
PLANT_DIVERGENCE / PLANT_ERROR say (docs/e2e.md, "Planted mistakes").

E2E_BIG=1 runs the larger workload (more requests, longer prompts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm_ascend", reason="the engine tests need vllm-ascend (va018-e2e env)")

from zb_patch.check.engine import model as tiny_model  # noqa: E402
from zb_patch.check.engine.run import CHILD_ENV, CONFIGS, run_all, run_config  # noqa: E402
from zb_patch.check.engine.workload import Workload, divergences, summarize, table  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCHER = os.path.join(HERE, "run_engine.py")
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


@pytest.fixture(scope="module", autouse=True)
def emulated_child():
    """Every engine process of this module is the tests' launcher (NPU emulation + worker double)."""
    old = os.environ.get(CHILD_ENV)
    os.environ[CHILD_ENV] = LAUNCHER
    yield
    if old is None:
        os.environ.pop(CHILD_ENV, None)
    else:
        os.environ[CHILD_ENV] = old


def _selftest_cli(wl: Workload, ks, keep: str) -> tuple[int, dict]:
    """``zb-patch selftest --engine --json`` (two engine processes at a time: the CI box has two cores)."""
    cmd = [sys.executable, "-m", "zb_patch.cli", "selftest", "--engine", "--json", "--jobs", "2"]
    cmd += ["--k", ",".join(map(str, ks)), "--keep", keep, "--workload", json.dumps(wl.to_json())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3 * 3600)
    print("\n" + proc.stderr[-2000:])
    return proc.returncode, json.loads(proc.stdout)  # stdout carries the report and nothing else


def _kept_results(keep: str, k: int) -> dict[str, dict]:
    runs = {}
    for name in CONFIGS:
        with open(os.path.join(keep, f"{name}-k{k}-plain.json")) as f:
            runs[name] = json.load(f)
    divs = {name: len(divergences(runs["sync"], res)) for name, res in runs.items()}
    print(f"\nk = {k}\n" + table([summarize(n, r) for n, r in runs.items()], divs))
    for name, res in runs.items():
        for line in divergences(runs["sync"], res):
            print(f"{name} vs sync: {line}")
    return runs


@pytest.fixture(scope="module")
def selftest(tmp_path_factory):
    """The operator's command on the main workload (k = 2); its runs' results are kept for the tests below."""
    wl = BIG if os.environ.get("E2E_BIG") else SMALL
    keep = str(tmp_path_factory.mktemp("selftest"))
    rc, report = _selftest_cli(wl, [wl.num_speculative_tokens], keep)
    return wl, rc, report, keep


@pytest.fixture(scope="module")
def models(selftest):
    return os.path.join(selftest[3], "models")


@pytest.fixture(scope="module")
def runs(selftest):
    wl, _, _, keep = selftest
    return wl, _kept_results(keep, wl.num_speculative_tokens)


def test_engine_selftest_passes(selftest):
    """PASS and exit 0, one table row per configuration, the device and versions reported."""
    wl, rc, report, _ = selftest
    entry = report["k"][str(wl.num_speculative_tokens)]
    assert (report["verdict"], rc) == ("PASS", 0), report["failures"]
    assert [row["run"] for row in entry["rows"]] == list(CONFIGS)
    assert report["device"]["available"] and report["versions"]["vllm_ascend"] != "not installed"


def test_engine_selftest_without_npu_says_so():
    """Without the emulation the child finds no torch_npu: no engine runs, the report says why, exit 2."""
    env = {k: v for k, v in os.environ.items() if k != CHILD_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "zb_patch.cli", "selftest", "--engine"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no NPU: torch_npu cannot be imported" in proc.stdout
    assert "Verdict: NO-DEVICE" in proc.stdout


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
def k_sweep(tmp_path_factory):
    """``zb-patch selftest --engine --k 1,3,4`` on the smaller workload."""
    keep = str(tmp_path_factory.mktemp("k_sweep"))
    rc, report = _selftest_cli(K_SWEEP_WORKLOAD, K_SWEEP, keep)
    return rc, report, {k: _kept_results(keep, k) for k in K_SWEEP}


def test_k_sweep_selftest_passes(k_sweep):
    rc, report, _ = k_sweep
    assert (report["verdict"], rc) == ("PASS", 0), report["failures"]
    assert sorted(report["k"]) == [str(k) for k in K_SWEEP]


@pytest.mark.parametrize("k", K_SWEEP)
def test_k_sweep_async_and_zero_bubble_match_sync(k_sweep, k):
    runs = k_sweep[2][k]
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
    "slot-mapping-off-by-one": ("2", "tokens"),
    "host-seq-lens-optimistic": ("2", "tokens"),
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
    jobs = [lambda p=p: run_config("async+zb", models, out_dir, wl, extra_args=["--plant", p]) for p in names]
    return {p: (r.result, r.stderr) for p, r in zip(names, run_all(jobs, parallel=2))}


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
