"""Data parallelism 2 (the DeepSeek tutorial's topology, one engine per rank) on the vllm-ascend 0.18 platform: two
engine processes of the operators' command with vLLM's data-parallel environment (``VLLM_DP_RANK`` / ``VLLM_DP_SIZE``
/ ``VLLM_DP_MASTER_*``, as vLLM's offline data-parallel example starts them), the DeepSeek-style MLA target drafting
with its MTP layer at k = 3, rank 1 with less work than rank 0 so that it runs dummy batches while rank 0 still
generates (vLLM's ``LLMEngine.step`` -> ``execute_dummy_batch`` -> the release's ``_dummy_run``, which joins the
ranks' batch-size all-reduce). The ranks share one gloo world (tests/support/npu_worker_double.py).

Synchronous scheduling with ``ZB_PATCH=1`` (zb-patch's fixes on both ranks) and async scheduling with ``ZB_PATCH=1``
(zero-bubble active and correcting steps on both ranks): both ranks finish, each with transformers' greedy tokens.
Under async scheduling a step may run no model (the batch queue's collect-only step); the engine child then runs a
dummy batch, as vLLM's multiprocess data-parallel engine core does (``zb_patch.check.engine.child``,
docs/e2e.md "Data parallelism 2"). The same two ranks also run through that multiprocess engine core itself
(``DPEngineCoreProc``, tests/engine/run_dp_engine_core.py), with its own busy loop.
"""

from __future__ import annotations

import os
import socket
from importlib.metadata import version

import pytest

pytest.importorskip("vllm_ascend", reason="the engine tests need vllm-ascend (va0XX-e2e envs)")
if version("vllm-ascend") != "0.18.0":
    pytest.skip(
        "data parallelism 2: vllm-ascend 0.18.0 (the MLA + MTP tutorial's release here)", allow_module_level=True
    )

from test_engine import emulated_child  # noqa: E402, F401 (a module-wide fixture: the tests' launcher)

from zb_patch.check.engine import model as tiny_model  # noqa: E402
from zb_patch.check.engine.run import CHILD_ENV, run_all, run_config  # noqa: E402
from zb_patch.check.engine.workload import Workload  # noqa: E402

K = 3
# rank 0: six requests up to 60 output tokens; rank 1: two short ones (done early: dummy batches after)
RANK_WORKLOADS = (
    Workload(num_requests=6, max_prompt=60, max_tokens=60, max_model_len=256, limit_every=0, num_speculative_tokens=K),
    Workload(num_requests=2, max_prompt=30, max_tokens=20, max_model_len=256, limit_every=0, num_speculative_tokens=K),
)


def _run_ranks(tmp_path, models: str, configs, extra_args=()) -> dict:
    """{(configuration, rank): Run} for the two ranks of each configuration of ``configs`` (run.CONFIGS names), the
    two ranks of one configuration together, one configuration after another, each with its own rendezvous port."""
    jobs, keys = [], []
    for config in configs:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for rank, wl in enumerate(RANK_WORKLOADS):
            env = {
                "VLLM_DP_RANK": str(rank),
                "VLLM_DP_RANK_LOCAL": str(rank),
                "VLLM_DP_SIZE": "2",
                "VLLM_DP_MASTER_IP": "127.0.0.1",
                "VLLM_DP_MASTER_PORT": str(port),
                "ZB_TEST_ENGINE_ZYGOTE": "off",  # the data-parallel environment is set before vLLM is imported
            }
            folder = str(tmp_path / f"{config}-rank{rank}")
            os.makedirs(folder)
            jobs.append(
                lambda c=config, f=folder, w=wl, e=env: run_config(
                    c, models, f, w, extra_args, timeout=600, env_overrides=e
                )
            )
            keys.append((config, rank))
    return dict(zip(keys, run_all(jobs, parallel=2)))


def _greedy_model(target: str):
    import transformers

    return transformers.DeepseekV3ForCausalLM.from_pretrained(target, dtype=tiny_model.DTYPE).eval()


def test_two_ranks_finish_with_greedy_tokens_and_zb_patch_on_both(tmp_path):
    from greedy_reference import reference_tokens

    models = str(tmp_path / "models")
    target = tiny_model.write_deepseek_model(models)
    done = _run_ranks(tmp_path, models, ("sync", "async+zb"), ("--drafter", "deepseek-mtp"))
    model = _greedy_model(target)
    for (config, rank), run in done.items():
        wl = RANK_WORKLOADS[rank]
        assert run.result is not None, (config, rank, run.log[-3000:])
        res = run.result
        assert res["zb_patch_status"]["state"] == "applied", (config, rank, res["zb_patch_status"])
        assert sum(res["drafted"].values()) > 0, (config, rank)
        assert res["tokens"] == reference_tokens(model, wl), (config, rank)
        if config == "async+zb":
            zb = res["zero_bubble"]
            assert zb["kind"] == "zb-patch" and zb["active"] and zb["corrected_steps"] > 0, (rank, zb)
        print(
            f"\n{config}, rank {rank}: {sum(len(t) for t in res['tokens'].values())} tokens, drafted "
            f"{sum(res['drafted'].values())}, accepted {sum(res['accepted'].values())}, dummy batches "
            f"{res['dummy_batches']['calls']}, {run.seconds:.0f} s"
        )
    # rank 1 ran out of work first and stepped with dummy batches until rank 0 was done; in sync rank 0 never idled
    # (under async scheduling its collect-only steps run one each)
    assert all(done[(config, 1)].result["dummy_batches"]["calls"] > 0 for config in ("sync", "async+zb"))
    assert done[("sync", 0)].result["dummy_batches"]["calls"] == 0


MULTIPROCESS_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_dp_engine_core.py")


def test_each_rank_s_multiprocess_engine_core_runs_zero_bubble_and_dummy_batches(tmp_path, monkeypatch):
    """What ``vllm serve --data-parallel-size 2`` runs per rank: the rank's engine core in a process of its own, a
    ``DPEngineCoreProc`` with vLLM's own data-parallel busy loop (tests/engine/run_dp_engine_core.py; no rule of the
    engine child's). Sync and async scheduling with ``ZB_PATCH=1``: both ranks finish with transformers' greedy
    tokens; in each engine core process zb-patch is applied and (async) zero-bubble active and correcting steps;
    rank 1 runs out of work first and runs dummy batches there."""
    from greedy_reference import reference_tokens

    monkeypatch.setenv(CHILD_ENV, MULTIPROCESS_LAUNCHER)
    models = str(tmp_path / "models")
    target = tiny_model.write_deepseek_model(models)
    done = _run_ranks(tmp_path, models, ("sync", "async+zb"))
    model = _greedy_model(target)
    for (config, rank), run in done.items():
        assert run.result is not None, (config, rank, run.log[-3000:])
        res, core = run.result, run.result["engine_core"]
        assert res["client"] == "SyncMPClient" and core["pid"] != res["launcher_pid"], (config, rank, res["client"])
        assert (core["engine_core_class"], core["data_parallel_rank"]) == ("DPEngineCoreProc", rank), (config, core)
        assert core["zb_patch_status"]["state"] == "applied", (config, rank, core["zb_patch_status"])
        assert res["tokens"] == reference_tokens(model, RANK_WORKLOADS[rank]), (config, rank)
        zb = core["zero_bubble"]
        if config == "async+zb":
            assert zb["kind"] == "zb-patch" and zb["active"] and zb["corrected_steps"] > 0, (rank, zb)
        else:  # the release's sync path with zb-patch's fixes only
            assert zb["kind"] == "none", (rank, zb)
        print(
            f"\n{config}, rank {rank} ({core['engine_core_class']}, pid {core['pid']}): "
            f"{sum(len(t) for t in res['tokens'].values())} tokens, zero-bubble {zb}, dummy batches "
            f"{core['dummy_batches']}, {run.seconds:.0f} s"
        )
    assert all(done[(config, 1)].result["engine_core"]["dummy_batches"] > 0 for config in ("sync", "async+zb"))
