"""Plugin activation in real subprocesses (no vLLM needed): off-path imports, logging once, strictness,
post-import arming, drift refusal, fork and spawn children. Upstream modules are real files (FakeUpstream)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from _fake_upstream import FakeUpstream

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_py(code: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ZB_PATCH")}
    full_env["PYTHONPATH"] = REPO + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(textwrap.dedent(code))  # a file, not -c: spawn children must import __main__
    try:
        return subprocess.run([sys.executable, fh.name], capture_output=True, text=True, env=full_env, timeout=timeout)
    finally:
        os.unlink(fh.name)


PRELUDE = """
import json, logging, os, sys
sys.path.insert(0, {root!r})
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s", stream=sys.stdout)
from zb_patch import plugin, registry as R, versions as V
from zb_patch.registry import HOST, Patch, PatchSet, RestsOn, fingerprint_source

FP = fingerprint_source(open({runner_file!r}).read(), "Runner.step")
def make(orig):
    def step(self, x):
        return orig(self, x) * 10
    return step
def adapter(fp=FP, kind=HOST):
    return V.Adapter(id="fake", title="fake adapter", vllm_ascend=((0,), (1,)), vllm=((0,), (1,)),
                     patch_set=PatchSet("fake", [Patch(id="p", target="{pkg}.runner:Runner.step", make=make,
                                        fingerprints={{"fake 1.0": fp}}, why="w", upstream=("#1",),
                                        remove_when="r", rests_on=RestsOn(kind, "the fake's own code"))]))
def activate(fp=FP, env=None, kind=HOST, opted_in=()):
    sel = V.Selection(V.SELECTED, "test selection", (adapter(fp, kind),))
    settings = plugin.Settings(env or {{"ZB_PATCH": "1"}})
    settings.opted_in = frozenset(opted_in)  # the fake's ids are no real adapter's: ZB_PATCH_ENABLE would refuse them
    return plugin._activate(settings, "worker", selection=sel)
"""


@pytest.fixture
def prelude(tmp_path):
    fake = FakeUpstream(tmp_path)
    yield fake, PRELUDE.format(root=str(tmp_path), runner_file=str(tmp_path / fake.pkg / "runner.py"), pkg=fake.pkg)
    fake.unload()


def _lines(out: str, needle: str) -> list[str]:
    return [line for line in out.splitlines() if needle in line]


@pytest.mark.parametrize("value", [None, "0", ""])
def test_off_imports_nothing(value):
    env = {} if value is None else {"ZB_PATCH": value}
    r = run_py(
        """
        import sys
        before = set(sys.modules)
        from zb_patch import plugin
        plugin.register(); plugin.register()
        new = sorted(m for m in set(sys.modules) - before if not m.startswith("zb_patch.plugin"))
        heavy = [m for m in ("torch", "vllm", "triton", "wrapt", "packaging", "zb_patch.detect",
                             "zb_patch.versions", "zb_patch.registry", "importlib.metadata") if m in sys.modules]
        print("NEW", new); print("HEAVY", heavy); print("STATUS", plugin.status()["state"])
    """,
        env,
    )
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout, r.stdout
    assert "STATUS off" in r.stdout
    assert r.stderr == ""


def test_on_without_vllm_warns_once_and_reports():
    r = run_py(
        """
        import logging, sys, json
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s", stream=sys.stdout)
        from zb_patch import plugin
        plugin.register(); plugin.register()
        print("STATUS", json.dumps(plugin.status()["state"]))
    """,
        {"ZB_PATCH": "1"},
    )
    assert r.returncode == 0, r.stderr
    lines = _lines(r.stdout, "zb-patch:")
    assert len(lines) == 1, r.stdout
    assert lines[0].startswith("WARNING vllm.zb_patch") and "REFUSED: vLLM is not installed" in lines[0]
    assert "nothing applied" in lines[0] and "role=" in lines[0] and "pid=" in lines[0]
    assert 'STATUS "not-applicable"' in r.stdout


def test_strict_refusal_raises():
    r = run_py(
        """
        from zb_patch import plugin
        plugin.register()
    """,
        {"ZB_PATCH": "1", "ZB_PATCH_STRICT": "1"},
    )
    assert r.returncode != 0
    assert "PatchError" in r.stderr and "ZB_PATCH_STRICT=1" in r.stderr and "vLLM is not installed" in r.stderr


@pytest.mark.parametrize("strict", [False, True])
def test_invalid_value_errors_and_stays_off(strict):
    env = {"ZB_PATCH": "yes"}
    if strict:
        env["ZB_PATCH_STRICT"] = "1"
    r = run_py(
        """
        import logging, sys
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s", stream=sys.stdout)
        from zb_patch import plugin
        plugin.register()
        print("STATE", plugin.status()["state"])
    """,
        env,
    )
    if strict:
        assert r.returncode != 0 and "ZB_PATCH='yes' is invalid" in r.stderr
    else:
        assert r.returncode == 0
        line = _lines(r.stdout, "invalid settings")
        assert len(line) == 1 and line[0].startswith("ERROR") and "ZB_PATCH='yes' is invalid (valid: 0 or 1" in line[0]
        assert "STATE off" in r.stdout


def test_armed_then_applied_on_import(prelude):
    fake, pre = prelude
    r = run_py(
        pre
        + f'''
act = activate()
assert "{fake.pkg}.runner" not in sys.modules
print("STATE1", act.state)
import {fake.pkg}.runner as m
print("STATE2", act.state, m.Runner().step(2))
print("STATUS", json.dumps(plugin.status()["report"]["items"][0]["verdict"]))
'''
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert "STATE1 armed" in r.stdout and "STATE2 applied 40" in r.stdout
    assert 'STATUS "applied"' in r.stdout
    info = _lines(r.stdout, "adapter=fake")
    assert len(info) == 1 and info[0].startswith("INFO") and "applied [p]" in info[0]
    assert len(_lines(r.stdout, "armed fake")) == 1


@pytest.mark.parametrize("opted_in", [False, True])
def test_an_npu_contract_patch_applies_only_opted_in_and_then_warns(prelude, opted_in):
    fake, pre = prelude
    r = run_py(
        pre
        + f"""
import {fake.pkg}.runner as m
act = activate(kind=R.NPU_CONTRACT, opted_in={("p",) if opted_in else ()!r})
print("STATE", act.state, m.Runner().step(2))
"""
    )
    assert r.returncode == 0, r.stderr + r.stdout
    info = _lines(r.stdout, "adapter=fake")
    warnings = [line for line in info if line.startswith("WARNING")]
    if opted_in:
        assert "STATE applied 40" in r.stdout and "applied [p]" in info[-1]
        assert len(warnings) == 1 and "opt-in patch p applied (ZB_PATCH_ENABLE): not shown on an NPU" in warnings[0]
        assert "rests on the fake's own code" in warnings[0] and "zb-patch selftest --engine" in warnings[0]
    else:
        assert "STATE applied 4" in r.stdout and "applied []" in info[-1] and "opt-in, not enabled [p]" in info[-1]
        assert warnings == []


def test_already_imported_applies_at_once_and_twice_is_once(prelude):
    fake, pre = prelude
    r = run_py(
        pre
        + f"""
import {fake.pkg}.runner as m
act = activate()
plugin.register()  # vLLM calling general plugins again in this process
act.on_import()
print("STATE", act.state, m.Runner().step(1))
""",
        {"ZB_PATCH": "1"},
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert "STATE applied 20" in r.stdout  # wrapped exactly once
    assert len(_lines(r.stdout, "adapter=fake")) == 1


def test_drift_refuses_with_one_error_line_and_applies_nothing(prelude):
    fake, pre = prelude
    r = run_py(
        pre
        + f"""
act = activate(fp="0123456789abcdef")
import {fake.pkg}.runner as m
print("STATE", act.state, m.Runner().step(1), getattr(m.Runner.__dict__["step"], R.MARK_ID, None))
"""
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert "STATE refused 2 None" in r.stdout
    errors = _lines(r.stdout, "ERROR")
    assert len(errors) == 1, r.stdout
    line = errors[0]
    assert f"{fake.pkg}.runner:Runner.step" in line and "0123456789abcdef (fake 1.0)" in line
    assert "fingerprint mismatch: found " in line and "nothing applied" in line and "versions vllm=" in line


def test_drift_from_a_recorded_form_names_the_form_in_the_one_error_line(prelude):
    """A build whose version names a recorded form (here a commit) but whose code differs: refused, one ERROR line
    that names the form the version claimed and the target that differs."""
    fake, pre = prelude
    note = (
        "vllm-ascend 0.18.1.dev45+g35b0fdf (45 commits past a tag, commit 35b0fdf): recorded form commit 35b0fdf7d57a"
    )
    r = run_py(
        pre
        + f"""
sel = V.Selection(V.SELECTED, "test selection", (adapter("0123456789abcdef"),), form_note={note!r})
act = plugin._activate(plugin.Settings({{"ZB_PATCH": "1"}}), "worker", selection=sel)
import {fake.pkg}.runner as m
print("STATE", act.state)
"""
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert "STATE refused" in r.stdout
    errors = _lines(r.stdout, "ERROR")
    assert len(errors) == 1, r.stdout
    assert note in errors[0] and f"{fake.pkg}.runner:Runner.step" in errors[0] and "fingerprint mismatch" in errors[0]


def test_drift_under_strict_fails_the_import(prelude):
    fake, pre = prelude
    r = run_py(
        pre
        + f"""
act = activate(fp="0123456789abcdef", env={{"ZB_PATCH": "1", "ZB_PATCH_STRICT": "1"}})
import {fake.pkg}.runner
"""
    )
    assert r.returncode != 0
    assert "PatchError" in r.stderr and "fingerprint mismatch" in r.stderr


def test_fork_child_inherits_applied_patch(prelude):
    fake, pre = prelude
    r = run_py(
        pre
        + f"""
import {fake.pkg}.runner as m
act = activate()
pid = os.fork()
if pid == 0:
    st = plugin.status()
    item = st["report"]["items"][0]
    same_pid = st["pid"] == os.getpid()
    print("CHILD", same_pid, st["state"], item["verdict"], item["reason"], m.Runner().step(1), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
print("PARENT", plugin.status()["pid"] == os.getpid(), m.Runner().step(1))
"""
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert "CHILD True applied already-applied inherited from parent process" in r.stdout
    assert " 20" in _lines(r.stdout, "CHILD")[0]
    assert "PARENT True 20" in r.stdout


def test_fork_before_import_applies_in_child_only(prelude):
    fake, pre = prelude
    r = run_py(
        pre
        + f"""
act = activate()
pid = os.fork()
if pid == 0:
    import {fake.pkg}.runner as m
    print("CHILD", plugin.status()["state"], m.Runner().step(1), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
import importlib
print("PARENT", act.state)
"""
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert "CHILD applied 20" in r.stdout
    assert "PARENT armed" in r.stdout


def test_spawn_child_registers_itself(prelude):
    fake, pre = prelude
    r = run_py(
        pre
        + f"""
import multiprocessing as mp
def child(q):
    import sys
    sys.path.insert(0, {str(fake.root)!r})
    from zb_patch import plugin, versions as V
    # vLLM calls register() in every spawned process; here the test adapter stands in for selection
    exec(compile({pre!r}, "prelude", "exec"), globals())
    act = activate()
    import {fake.pkg}.runner as m
    q.put((act.state, m.Runner().step(1), act.pid == os.getpid()))
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start(); print("CHILD", q.get(timeout=60)); p.join()
"""
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert "CHILD ('applied', 20, True)" in r.stdout


def test_info_line_reaches_stderr_before_anyone_configured_logging():
    """vLLM 0.32's front end calls general plugins before it configures logging: the INFO/WARNING line must
    still be printed (once), not dropped by Python's last-resort handler."""
    r = run_py(
        """
        from zb_patch import plugin
        plugin.register()
    """,
        {"ZB_PATCH": "1"},
    )
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if "zb-patch:" in x]
    assert len(lines) == 1 and lines[0].startswith("WARNING vllm.zb_patch: zb-patch: pid="), r.stderr


def test_fallback_stays_silent_once_logging_is_configured(prelude):
    fake, pre = prelude  # the prelude configures logging on the root logger (stdout)
    r = run_py(
        pre
        + f"""
act = activate()
import {fake.pkg}.runner
"""
    )
    assert r.returncode == 0, r.stderr
    assert "zb-patch:" not in r.stderr
    assert len(_lines(r.stdout, "adapter=fake")) == 1


ENGINE = """
SCHED = {sched_file!r}
EFP = fingerprint_source(open(SCHED).read(), "Scheduler.reset")
def make_reset(orig):
    def reset(self):
        return orig(self) + 100
    return reset
def engine_adapter(efp=EFP, fp=FP):
    worker = adapter(fp).patch_set.patches
    engine = Patch(id="e", target="{pkg}.sched:Scheduler.reset", make=make_reset, fingerprints={{"fake 1.0": efp}},
                   why="w", upstream=("#2",), remove_when="r", rests_on=RestsOn(HOST, "the fake's scheduler"),
                   roles=("engine",))
    return V.Adapter(id="fake", title="fake adapter", vllm_ascend=((0,), (1,)), vllm=((0,), (1,)),
                     patch_set=PatchSet("fake", [*worker, engine]))
def activate_engine(verdict=V.SELECTED, **kw):
    sel = V.Selection(verdict, "test selection", (engine_adapter(**kw),))
    return plugin._activate(plugin.Settings({{"ZB_PATCH": "1"}}), "engine", selection=sel)
"""


@pytest.fixture
def engine_prelude(prelude, tmp_path):
    fake, pre = prelude
    sched = tmp_path / fake.pkg / "sched.py"
    sched.write_text("class Scheduler:\n    def reset(self):\n        return 1\n")  # imports no runner module
    return fake, pre + ENGINE.format(sched_file=str(sched), pkg=fake.pkg)


def test_an_engine_part_applies_where_only_the_scheduler_is_imported(engine_prelude):
    """The EngineCore of a multiprocess executor imports the scheduler and never the runner: the engine part applies
    there on its own, with its own line; the worker part stays armed."""
    fake, pre = engine_prelude
    r = run_py(
        pre
        + f"""
act = activate_engine()
import {fake.pkg}.sched as s
print("STATE", act.state, s.Scheduler().reset(), "{fake.pkg}.runner" in sys.modules)
print("PARTS", json.dumps({{k: v["verdict"] for k, v in plugin.status()["engine_parts"].items()}}))
import {fake.pkg}.runner as m
print("STATE2", act.state, m.Runner().step(2), s.Scheduler().reset())
"""
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert "STATE armed 101 False" in r.stdout and "STATE2 applied 40 101" in r.stdout
    assert f'PARTS {{"fake engine:{fake.pkg}.sched": "applied"}}' in r.stdout
    part, decision = _lines(r.stdout, "of adapter fake"), _lines(r.stdout, "adapter=fake")
    assert len(part) == 1 and f"part fake engine:{fake.pkg}.sched of adapter fake: applied [e]" in part[0]
    assert len(decision) == 1 and "applied [p]" in decision[0] and "[e]" not in decision[0]


def test_a_drifted_engine_part_is_refused_alone(engine_prelude):
    """A drifted scheduler: one error line for the part, nothing of it applied; the worker part applies."""
    fake, pre = engine_prelude
    r = run_py(
        pre
        + f"""
act = activate_engine(efp="0123456789abcdef")
import {fake.pkg}.sched as s, {fake.pkg}.runner as m
print("STATE", act.state, s.Scheduler().reset(), m.Runner().step(2))
"""
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert "STATE applied 1 40" in r.stdout
    errors = _lines(r.stdout, "ERROR")
    assert len(errors) == 1 and f"part fake engine:{fake.pkg}.sched of adapter fake REFUSED: " in errors[0], r.stdout
    assert "0123456789abcdef (fake 1.0)" in errors[0] and "nothing of it applied" in errors[0]


def test_a_refused_worker_part_names_the_engine_part_applied(engine_prelude):
    fake, pre = engine_prelude
    r = run_py(
        pre
        + f"""
act = activate_engine(fp="0123456789abcdef")
import {fake.pkg}.sched as s, {fake.pkg}.runner as m
print("STATE", act.state, s.Scheduler().reset(), m.Runner().step(2))
"""
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert "STATE refused 101 4" in r.stdout
    errors = _lines(r.stdout, "ERROR")
    assert len(errors) == 1, r.stdout
    assert f"nothing applied but part fake engine:{fake.pkg}.sched (an independent fix)" in errors[0]


def test_no_engine_part_while_adapters_are_probed(engine_prelude):
    """An unknown build (adapters tried by fingerprint): the engine part follows a selected adapter only."""
    fake, pre = engine_prelude
    r = run_py(
        pre
        + f"""
act = activate_engine(verdict=V.PROBE)
import {fake.pkg}.sched as s, {fake.pkg}.runner as m
print("STATE", act.state, s.Scheduler().reset(), m.Runner().step(2), plugin.status()["engine_parts"])
"""
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert "STATE applied 1 40 {}" in r.stdout
