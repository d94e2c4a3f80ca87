"""The probe's checks on synthetic engine results: it must flag the topology failures it exists for."""

from __future__ import annotations

from zb_patch.check import probe

LINE = (
    "zb-patch: pid={pid} role={role} REFUSED: vllm-ascend is not installed: zb-patch patches vLLM-Ascend "
    "deployments only; versions vllm=0.32.0, vllm_ascend=-, torch=2.13.0+cpu; nothing applied"
)


def _rep(pid: int, *, decided=True, state="not-applicable", env=None, same=True, status_pid=None):
    return {
        "pid": pid,
        "ppid": 1,
        "process_name": "VllmWorker-0",
        "start_method": "fork",
        "env": env if env is not None else {"ZB_PATCH": "1"},
        "zb_patch_modules": ["zb_patch", "zb_patch.plugin"],
        "wrapt_imported": False,
        "vllm_plugins_loaded": True,
        "entry_point_loaded": True,
        "activation_pids": [pid] if decided else [],
        "decided_before_probe": decided,
        "hooked_modules": [],
        "status": {"pid": status_pid or pid, "state": state, "role": "worker", "reason": "r"},
        "reregister": {"same_activation": same, "state_after": state, "activation_pids_after": [pid]},
        "rank": 0,
    }


def _result(workers, frontend=None):
    return {
        "schema": probe.RESULT_SCHEMA,
        "ok": True,
        "frontend_pid": 10,
        "frontend": frontend or dict(_rep(10), process_name="MainProcess", start_method=None),
        "engine_processes": [{"pid": 20, "name": "EngineCore", "start_method": "fork"}],
        "workers": workers,
        "process_tree": [
            {"pid": 20, "ppid": 10, "name": "python", "cmdline": ""},
            {"pid": 30, "ppid": 20, "name": "python", "cmdline": ""},
        ],
    }


def _log(*pids_roles):
    out = []
    for pid, role in pids_roles:
        prefix = "" if role == "frontend" else f"({'EngineCore' if role == 'engine' else 'VllmWorker-0'} pid={pid}) "
        level = "" if role == "frontend" else "WARNING 11-22 00:27:09 [plugin.py:191] "
        out.append(prefix + level + LINE.format(pid=pid, role=role) + "\n")
    return out


def test_all_good_is_refused_not_topology():
    r = probe.assemble(_result([_rep(30)]), _log((10, "frontend"), (20, "engine"), (30, "worker")), {"ZB_PATCH": "1"})
    assert r["problems"] == [] and r["exit_code"] == probe.EXIT_REFUSED
    assert [p["state"] for p in r["processes"]] == ["not-applicable"] * 3
    assert r["processes"][1]["log_lines"][0]["vllm_label"] == "EngineCore"
    assert r["processes"][0]["log_lines"][0]["handler"] == "python-default"  # bare line: no vLLM handler yet


def test_forked_engine_core_that_never_decided_is_flagged():
    r = probe.assemble(_result([_rep(30)]), _log((10, "frontend"), (30, "worker")), {"ZB_PATCH": "1"})
    assert r["exit_code"] == probe.EXIT_TOPOLOGY
    assert any("EngineCore pid 20: 0 zb-patch decision lines" in p for p in r["problems"])


def test_worker_that_decided_only_when_asked_is_flagged():
    r = probe.assemble(
        _result([_rep(30, decided=False)]), _log((10, "frontend"), (20, "engine"), (30, "worker")), {"ZB_PATCH": "1"}
    )
    assert r["exit_code"] == probe.EXIT_TOPOLOGY
    assert any("had not decided anything in this process until the probe asked" in p for p in r["problems"])


def test_twice_decided_stale_state_and_missing_env_are_flagged():
    log = _log((10, "frontend"), (20, "engine"), (30, "worker"), (30, "worker"))
    r = probe.assemble(_result([_rep(30, env={}, same=False, status_pid=10)]), log, {"ZB_PATCH": "1"})
    text = "\n".join(r["problems"])
    assert "2 zb-patch decision lines" in text
    assert "sees ZB_PATCH* = {}" in text
    assert "registering again created a new activation" in text
    assert "status is of pid 10 (stale state)" in text


def test_off_mode_flags_any_trace():
    off = dict(_rep(30, decided=False, env={}, state="off"), activation_pids=[10])
    r = probe.assemble(
        _result([off], frontend=dict(_rep(10, env={}, state="off"), activation_pids=[])), _log((20, "engine")), {}
    )
    text = "\n".join(r["problems"])
    assert r["mode"] == "off" and r["exit_code"] == probe.EXIT_TOPOLOGY
    assert "ZB_PATCH is off but zb-patch logged" in text and "ZB_PATCH is off but zb-patch holds state" in text


def test_off_mode_allows_only_the_entry_point_and_the_probe_modules():
    probe_mods = ["zb_patch", "zb_patch.plugin", "zb_patch.check", "zb_patch.check.probe"]
    clean = dict(_rep(30, decided=False, env={}, state="off"), activation_pids=[], zb_patch_modules=probe_mods)
    fe = dict(_rep(10, env={}, state="off"), activation_pids=[], zb_patch_modules=probe_mods)
    assert probe.assemble(_result([clean], frontend=fe), [], {})["problems"] == []
    leaky = dict(clean, zb_patch_modules=[*probe_mods, "zb_patch.versions"])
    r = probe.assemble(_result([leaky], frontend=fe), [], {})
    assert r["problems"] == [
        "worker rank 0 (VllmWorker-0) pid 30: ZB_PATCH is off but zb-patch imported zb_patch.versions"
    ]


def test_strict_refusal_is_exit_2_without_a_log_line():
    msg = LINE.format(pid=10, role="frontend") + " (ZB_PATCH_STRICT=1)"
    res = {
        "schema": probe.RESULT_SCHEMA,
        "ok": False,
        "frontend_pid": 10,
        "frontend": dict(
            _rep(10, env={"ZB_PATCH": "1", "ZB_PATCH_STRICT": "1"}), process_name="MainProcess", start_method=None
        ),
        "error": {"type": "zb_patch.registry.PatchError", "message": msg, "traceback": ""},
    }
    r = probe.assemble(res, [], {"ZB_PATCH": "1", "ZB_PATCH_STRICT": "1"})
    assert r["exit_code"] == probe.EXIT_REFUSED and r["problems"] == [] and r["strict_refusal"] == msg
    assert "ZB_PATCH_STRICT=1: the engine refused to start:" in probe.render_text(r)


def test_parse_log_handles_colour_and_levels():
    lines = [
        "\x1b[1;36m(EngineCore pid=5)\x1b[0;0m ERROR 11-22 00:27:09 [plugin.py:1] "
        "zb-patch: pid=5 role=engine REFUSED: adapter x: fingerprint mismatch; versions vllm_ascend=0.18.0\n",
        "(VllmWorker-0 pid=6) INFO 11-22 00:27:09 [plugin.py:1] zb-patch: pid=6 role=worker adapter=a "
        "selected by version: applied [p]\n",
        "zb-patch: pid=7 role=frontend native: vllm-ascend 0.24.0 already ships it; nothing to apply\n",
        "(ApiServer_0 pid=8) INFO 11-22 00:27:09 [x.py:1] zb-patch: pid=8 role=frontend armed a (r); "
        "applies when m are imported\n",
        "(ApiServer_0 pid=8) INFO 11-22 00:27:10 [x.py:1] zb-patch: pid=8 role=frontend part a engine:m of adapter "
        "a: applied [e]\n",
        "INFO model path /tmp/zb-patch-probe-x/model\n",
    ]
    parsed = probe.parse_log(lines)
    by_pid = parsed["by_pid"]
    assert {pid: v[0]["state"] for pid, v in by_pid.items()} == {5: "refused", 6: "applied", 7: "native", 8: "armed"}
    assert len(by_pid[8]) == 1 and parsed["parts"] == {8: ["part a engine:m of adapter a: applied [e]"]}
    assert by_pid[5][0]["vllm_label"] == "EngineCore" and by_pid[5][0]["level"] == "ERROR"
