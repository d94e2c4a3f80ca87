"""tests/support/engine_zygote.py: a launcher that delegates runs in a fork of the zygote, with its argv, environment,
working directory and stdio; the fork's exit status (or signal) is the launcher's; a killed launcher takes its fork
with it; a request whose environment differs in an import-time variable runs in the launcher itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
sys.path.insert(0, SUPPORT)

import engine_zygote  # noqa: E402

SCRIPT = f"""
import json, os, signal, sys, time
sys.path.insert(0, {SUPPORT!r})
import engine_zygote
if __name__ == "__main__":
    engine_zygote.delegate(__file__)
    mode = sys.argv[1]
    if mode == "report":
        print(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "pid": os.getpid(), "ppid": os.getppid(),
                          "flag": os.environ.get("ZB_PATCH"), "zygote": os.environ.get(engine_zygote.ZYGOTE_ENV)}}))
        print("to stderr", file=sys.stderr)
        sys.exit(3)
    if mode == "raise":
        raise ValueError("planted")
    if mode == "sleep":
        with open(sys.argv[2], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)
    if mode == "signal":
        os.kill(os.getpid(), signal.SIGTERM)
"""


@pytest.fixture
def zygote(tmp_path):
    path = str(tmp_path / "z.sock")
    env = {k: v for k, v in os.environ.items() if k != engine_zygote.ZYGOTE_ENV}
    old = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        proc = engine_zygote.start(path, preload=False, timeout=60)
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert proc is not None
    script = tmp_path / "launcher.py"
    script.write_text(SCRIPT)
    yield proc, path, str(script), env
    engine_zygote.stop(proc)


def _launch(zygote_, *args, extra_env=None, cwd=None, **kwargs):
    proc, path, script, env = zygote_
    run_env = {**env, engine_zygote.ZYGOTE_ENV: path, **(extra_env or {})}
    return subprocess.Popen(
        [sys.executable, script, *args], env=run_env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs
    )


def test_the_fork_runs_the_launcher_with_its_argv_environment_cwd_and_stdio(zygote, tmp_path):
    launcher = _launch(zygote, "report", "--x", "1", extra_env={"ZB_PATCH": "1"}, cwd=str(tmp_path))
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 3, err
    got = json.loads(out)
    assert b"engine_zygote" not in err, err
    assert got["ppid"] == zygote[0].pid and got["pid"] != launcher.pid  # it ran in a fork of the zygote
    assert got["argv"] == ["report", "--x", "1"] and got["cwd"] == str(tmp_path) and got["flag"] == "1"
    assert got["zygote"] is None  # the fork's own children start on their own
    assert b"to stderr" in err


def test_an_uncaught_exception_prints_its_traceback_and_exits_1(zygote):
    launcher = _launch(zygote, "raise")
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 1 and b"ValueError: planted" in err and b"Traceback" in err


def test_a_fork_killed_by_a_signal_kills_its_launcher_with_it(zygote):
    launcher = _launch(zygote, "signal")
    launcher.communicate(timeout=60)
    assert launcher.returncode == -signal.SIGTERM


def test_a_killed_launcher_takes_its_fork_with_it(zygote, tmp_path):
    pid_file = tmp_path / "pid"
    launcher = _launch(zygote, "sleep", str(pid_file))
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and launcher.poll() is None
        time.sleep(0.1)
    fork = int(pid_file.read_text())
    assert fork != launcher.pid
    launcher.kill()  # as subprocess.run does on a timeout
    launcher.wait()
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{fork}"):
        assert time.monotonic() < deadline, "the fork outlived its launcher"
        time.sleep(0.1)


def test_a_request_with_another_import_time_variable_runs_in_the_launcher(zygote):
    launcher = _launch(
        zygote, "report", extra_env={"TRITON_INTERPRET": "0" if os.environ.get("TRITON_INTERPRET") else "1"}
    )
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 3
    assert json.loads(out)["pid"] == launcher.pid  # not delegated
    assert b"refused (environment differs from the zygote's in ['TRITON_INTERPRET'])" in err
