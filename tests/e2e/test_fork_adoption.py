"""Forked children (multiprocessing, as vLLM starts its EngineCore and workers with
VLLM_WORKER_MULTIPROC_METHOD=fork) decide on their own at start, with the role their process name states.

vLLM's ``plugins_loaded`` flag is inherited over fork, so vLLM never calls register() in such a child.
These run without an engine (under a second each); test_engine_processes.py shows the same in a real one.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from e2e_support import base_env

CHILDREN = """
import logging, multiprocessing as mp, os, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s", stream=sys.stdout)
from zb_patch import plugin

def report(tag):
    act = plugin._ACTIVATIONS.get(os.getpid())   # read before anything calls current()
    print(tag, os.getpid(), "decided" if act else "undecided", act.role if act else "-",
          sorted(plugin._ACTIVATIONS), flush=True)

def worker():
    report("WORKER")

def engine_core():
    report("ENGINE")
    # the EngineCore forks the workers, as vLLM's MultiprocExecutor does
    p = mp.get_context("fork").Process(target=worker, name="VllmWorker-0"); p.start(); p.join()

if __name__ == "__main__":
    plugin.register(); plugin.register()          # registering twice in one process applies once
    report("FRONTEND")
    p = mp.get_context("fork").Process(target=engine_core, name="EngineCore"); p.start(); p.join()
    p = mp.get_context("fork").Process(target=worker, name="SomethingElse-1"); p.start(); p.join()
"""


def _run(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILDREN)], env=env, capture_output=True, text=True, timeout=120
    )


def _by_tag(out: str, tag: str) -> list[list[str]]:
    return [line.split(" ", 4) for line in out.splitlines() if line.startswith(tag + " ")]


def test_forked_children_decide_once_at_start_with_their_role():
    r = _run(base_env(ZB_PATCH="1"))
    assert r.returncode == 0, r.stderr + r.stdout
    decisions = [line for line in r.stdout.splitlines() if "zb-patch: pid=" in line]
    pids = [line.split("pid=")[1].split()[0] for line in decisions]
    assert len(pids) == len(set(pids)) == 4, r.stdout  # front end, EngineCore, worker, other child
    fe, eng, wk, other = (_by_tag(r.stdout, t) for t in ("FRONTEND", "ENGINE", "WORKER", "WORKER"))
    assert fe[0][2:4] == ["decided", "frontend"]
    assert eng[0][2:4] == ["decided", "engine"]
    assert [w[2:4] for w in wk] == [["decided", "worker"], ["decided", "unknown(SomethingElse-1)"]]
    # each process holds only its own activation (the parent's state is not kept as ours)
    for rows in (fe, eng, wk):
        for row in rows:
            assert row[4] == f"[{row[1]}]", row
    for role in ("frontend", "engine", "worker"):
        lines = [x for x in decisions if f"role={role} " in x]
        assert len(lines) == 1 and lines[0].startswith("WARNING vllm.zb_patch")
        assert " REFUSED: " in lines[0] and "nothing applied" in lines[0]


def test_forked_children_off_leave_no_trace():
    r = _run(base_env())
    assert r.returncode == 0, r.stderr + r.stdout
    assert "zb-patch" not in r.stdout + r.stderr
    for tag in ("FRONTEND", "ENGINE", "WORKER"):
        for row in _by_tag(r.stdout, tag):
            assert row[2:] == ["undecided", "-", "[]"], row
