"""Plugin lifecycle in subprocesses against the REAL vLLM + vllm-ascend of this tox env, driven by vLLM's own
``vllm.plugins.load_general_plugins()``: off leaves no trace; on arms and applies when the worker modules are
imported; double registration applies once; fork and spawn children; a drifted target refuses with one
ERROR line naming the target and both fingerprints and applies nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")

FAMILY = npu_standin.detect_family()
if FAMILY is None:
    pytest.skip(
        "vllm-ascend is not installed in this env (lifecycle tests need a va0xx tox env)", allow_module_level=True
    )

EXPECTED = {"0.11": None, "0.13": "ascend-0.13", "0.18": "ascend-0.18", "0.23": "ascend-0.19-0.25"}[FAMILY]
from installed_release import RELEASE  # noqa: E402  (tests/support, after the stand-in check)

PRELUDE = """
import json, os, sys
import npu_standin
npu_standin.install()
from npu_standin.ascend_imports import import_worker_modules
from vllm.plugins import load_general_plugins
"""


def run(code: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    import tempfile

    full = {k: v for k, v in os.environ.items() if not k.startswith("ZB_PATCH")}
    # vllm-ascend's own general plugins (model loader, connectors) need torch_npu's extensions of
    # torch.distributed, which the NPU stand-in does not provide: load only the ascend platform plugin and
    # zb-patch (VLLM_PLUGINS is a whitelist of plugin names across groups).
    full["VLLM_PLUGINS"] = "ascend,zb_patch"
    full.update(env)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(PRELUDE + textwrap.dedent(code))
    try:
        return subprocess.run([sys.executable, fh.name], capture_output=True, text=True, env=full, timeout=timeout)
    finally:
        os.unlink(fh.name)


def zb_lines(r: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (r.stdout + r.stderr).splitlines() if "zb-patch:" in line]


def test_off_leaves_no_trace():
    r = run(
        """
load_general_plugins()
import_worker_modules()
from zb_patch import plugin
print("STATE", plugin.status()["state"])
print("LOADED", sorted(m for m in sys.modules if m.startswith("zb_patch")))
""",
        {},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "STATE off" in r.stdout
    assert "LOADED ['zb_patch', 'zb_patch.plugin']" in r.stdout  # the entry point module only
    assert zb_lines(r) == []


def test_on_applies_once_via_load_general_plugins():
    r = run(
        """
load_general_plugins()
load_general_plugins()          # vLLM may call it again
from zb_patch import plugin
plugin.register()               # and a second registration path
print("STATE1", plugin.status()["state"])
import_worker_modules()
st = plugin.status()
print("STATE2", st["state"], st["adapter"])
""",
        {"ZB_PATCH": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = zb_lines(r)
    if EXPECTED is None:
        assert "STATE1 refused" in r.stdout and "STATE2 refused None" in r.stdout
        assert len(lines) == 1 and "REFUSED" in lines[0] and "older than 0.13" in lines[0]
        return
    assert "STATE1 armed" in r.stdout, r.stdout
    assert f"STATE2 applied {EXPECTED}" in r.stdout, r.stdout
    armed = [line for line in lines if " armed " in line]
    applied = [line for line in lines if f"adapter={EXPECTED}" in line and "known issue" not in line]
    assert len(armed) == 1 and len(applied) == 1, lines
    # advisories of the installed release (adapter ascend-0.19-0.25): one WARNING each, never repeated
    advisories = [line.split("known issue ")[1].split()[0] for line in lines if "known issue" in line]
    assert len(advisories) == len(set(advisories)) and all(
        "WARNING" in line for line in lines if "known issue" in line
    ), lines
    assert "INFO" in applied[0] and "guards verified" in applied[0] and "selected by version" in applied[0]


@pytest.mark.skipif(EXPECTED is None, reason=f"vllm-ascend {FAMILY} is refused: no engine part")
def test_engine_parts_apply_where_only_the_scheduler_is_imported():
    """An EngineCore process of a multiprocess executor imports the scheduler and never the runner: the engine parts
    (vLLM's scheduler, then vllm-ascend's recompute scheduler) apply there, each with its own line; the adapter's
    worker part stays armed. On vllm-ascend 0.25.1rc1 the recompute scheduler's loop already skips a marked request
    (#46066): its part applies nothing (verdict ok, logged as native)."""
    r = run(
        """
load_general_plugins()
import vllm.v1.core.sched.async_scheduler
import vllm_ascend.core.recompute_scheduler
from zb_patch import plugin, registry
st = plugin.status()
print("STATE", st["state"], "vllm_ascend.worker.model_runner_v1" in sys.modules)
print("PARTS", json.dumps({k: v["verdict"] for k, v in st["engine_parts"].items()}))
marks = [registry.resolve(t).raw for t in ("vllm.v1.core.sched.scheduler:Scheduler.reset_prefix_cache",
         "vllm_ascend.core.recompute_scheduler:RecomputeScheduler.update_from_output")]
print("MARKS", *[getattr(m, registry.MARK_ID, None) for m in marks])
""",
        {"ZB_PATCH": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "STATE armed False" in r.stdout, r.stdout
    names = [
        f"{EXPECTED} engine:vllm.v1.core.sched.scheduler",
        f"{EXPECTED} engine:vllm_ascend.core.recompute_scheduler",
    ]
    loop_native = RELEASE == "0.25.1rc1"  # #46066 in its RecomputeScheduler
    recompute = None if loop_native else "reset-prefix-cache-in-flight-recompute"
    verdicts = {names[0]: "applied", names[1]: "ok" if loop_native else "applied"}
    assert f"PARTS {json.dumps(verdicts)}" in r.stdout, r.stdout
    assert f"MARKS reset-prefix-cache-in-flight {recompute}" in r.stdout, r.stdout
    parts = [line for line in zb_lines(r) if f"of adapter {EXPECTED}: applied" in line]
    applied = [n for n, v in verdicts.items() if v == "applied"]
    assert [n for n in names if any(f"part {n} of" in line for line in parts)] == applied, parts
    assert len(parts) == len(applied), parts


@pytest.mark.skipif(EXPECTED is None, reason=f"vllm-ascend {FAMILY} is refused: nothing is applied in children")
def test_fork_and_spawn_children():
    r = run(
        """
import multiprocessing as mp

def spawn_child(q):
    import npu_standin
    npu_standin.install()
    from npu_standin.ascend_imports import import_worker_modules
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    import_worker_modules()
    from zb_patch import plugin
    st = plugin.status()
    q.put((st["state"], st["adapter"], st["pid"] == os.getpid()))

if __name__ == "__main__":
    load_general_plugins()
    import_worker_modules()
    from zb_patch import plugin
    assert plugin.status()["state"] == "applied"
    # fork: vLLM's plugins_loaded flag is inherited, so register() is not called again in the child
    pid = os.fork()
    if pid == 0:
        st = plugin.status()
        print("FORK", st["state"], st["adapter"], st["pid"] == os.getpid(), flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=spawn_child, args=(q,))
    p.start()
    print("SPAWN", *q.get(timeout=240), flush=True)
    p.join()
""",
        {"ZB_PATCH": "1"},
        timeout=400,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"FORK applied {EXPECTED} True" in r.stdout, r.stdout
    assert f"SPAWN applied {EXPECTED} True" in r.stdout, r.stdout


DRIFT = """
import importlib.abc, importlib.util, pathlib, tempfile
# Simulate a nightly build whose target changed: load the real module from a copy in which one guarded
# method has one extra statement (what a drifted upstream looks like to zb-patch). MARKED: the adapter's worker part.
TARGET_MOD, QUAL = {mod!r}, {qual!r}
spec = importlib.util.find_spec(TARGET_MOD)
src = pathlib.Path(spec.origin).read_text()
cls, meth = QUAL.split(".")
marker = "    def " + meth + "("
start = src.index("class " + cls)
at = src.index(marker, start)
body = src.index(":\\n", src.index(")", at)) + 2
drifted = src[:body] + "        _zb_drift = 1\\n" + src[body:]
tmp = pathlib.Path(tempfile.mkdtemp()) / pathlib.Path(spec.origin).name
tmp.write_text(drifted)

class DriftFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == TARGET_MOD:
            return importlib.util.spec_from_file_location(name, tmp)
sys.meta_path.insert(0, DriftFinder())
load_general_plugins()
import_worker_modules()
from zb_patch import plugin, registry as R, versions as V
st = plugin.status()
ad = V.by_id({adapter!r})
marked = [p.id for p in ad.patch_set.parts()[0].patches if R.resolve(p.target).patched_by]
print("STATE", st["state"], "MARKED", marked)
"""


@pytest.mark.skipif(EXPECTED is None, reason=f"vllm-ascend {FAMILY} is refused before any fingerprint is read")
def test_drifted_target_refuses_with_one_error_line():
    from zb_patch import versions as V

    adapter = V.by_id(EXPECTED)
    guard = next(g for g in adapter.patch_set.guards if g.target.startswith("vllm_ascend.worker.block_table:"))
    mod, qual = guard.target.split(":")
    r = run(DRIFT.format(mod=mod, qual=qual, adapter=EXPECTED), {"ZB_PATCH": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "STATE refused MARKED []" in r.stdout, r.stdout
    errors = [line for line in zb_lines(r) if "REFUSED" in line]
    assert len(errors) == 1, zb_lines(r)
    line = errors[0]
    assert line.startswith("ERROR") or " ERROR " in line[:40] or "ERROR" in line.split("zb-patch:")[0]
    assert guard.target in line and "fingerprint mismatch: found " in line
    for label, fp in guard.fingerprints.items():
        assert f"{fp} ({label})" in line
    assert "nothing applied" in line and "vllm_ascend=" in line
    # the engine parts are fingerprinted on their own (the scheduler did not drift): an independent fix
    engine_lines = [x for x in zb_lines(r) if " engine:" in x and ("applied [" in x or ": native [" in x)]
    assert len(engine_lines) == len(adapter.patch_set.parts()) - 1, zb_lines(r)


@pytest.mark.skipif(EXPECTED is None, reason=f"vllm-ascend {FAMILY} is refused before any fingerprint is read")
def test_drift_under_strict_stops_the_worker_import():
    from zb_patch import versions as V

    adapter = V.by_id(EXPECTED)
    guard = next(g for g in adapter.patch_set.guards if g.target.startswith("vllm_ascend.worker.block_table:"))
    mod, qual = guard.target.split(":")
    r = run(DRIFT.format(mod=mod, qual=qual, adapter=EXPECTED), {"ZB_PATCH": "1", "ZB_PATCH_STRICT": "1"})
    assert r.returncode != 0
    assert "PatchError" in r.stderr and "ZB_PATCH_STRICT=1" in r.stderr and guard.target in r.stderr
