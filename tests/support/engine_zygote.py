"""Engine processes forked from one pre-imported interpreter (the CPU engine tests: tests/engine).

Every engine process of the e2e envs starts by installing the NPU emulation, which imports torch, vLLM and
vllm-ascend: a two-request run takes 21 s on its own and 11.5 s forked (vllm-ascend 0.18, one core, warm caches), in
each of the thirty-odd engine processes of va018-e2e. The zygote does that once and forks a copy per engine process;
the fork runs the launcher script as ``python SCRIPT ARGS`` would (argv, environment, working directory and the
caller's stdin / stdout / stderr), and its exit status is the caller's.

Who uses it: the launchers (tests/engine/run_engine.py, run_defect_engine.py) call :func:`delegate` first. When
``ZB_TEST_ENGINE_ZYGOTE`` names a serving zygote, the launcher process sends its request and waits; otherwise (no
zygote, or one that refuses the request) it runs itself, as before. tests/engine/conftest.py starts one zygote per
pytest session on the CPU.

What makes a fork equivalent to a fresh process here:

- the zygote imports exactly what the launchers import before ``child.main`` builds the engine
  (:func:`preload_engine`); plugins (zb-patch's included) load later, inside ``LLM(...)``, in the fork;
- the fork's environment is the caller's, and the zygote refuses a request whose environment differs from its own in
  a variable outside :data:`PER_RUN` (what differs between configurations: zb-patch's switches, the selftest's child),
  so nothing read at import time can differ;
- the zygote has one thread when it forks (checked); a fork whose caller dies is killed.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import threading
import traceback

ZYGOTE_ENV = "ZB_TEST_ENGINE_ZYGOTE"  # the socket path of a serving zygote
# variables that may differ between the zygote and a request: read by zb-patch / the launchers at run time only
PER_RUN = (
    "ZB_PATCH",
    "ZB_PATCH_DISABLE",
    "ZB_PATCH_ENABLE",
    "ZB_PATCH_STRICT",
    "ZB_SELFTEST_ENGINE_CHILD",
    "PYTEST_CURRENT_TEST",
    ZYGOTE_ENV,
    # terminal size: set in the C environment of the pytest process by an import (not in os.environ), so a process
    # started without env= inherits them and one started with env=dict(os.environ) does not; only text layout reads them
    "COLUMNS",
    "LINES",
)
_MAX_REQUEST = 1 << 20
_in_fork = False  # True inside a fork: its launcher must run, not delegate again


def preload_engine() -> None:
    """What run_engine.py does before ``child.main``: the emulation installed, vLLM and the engine child imported."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import npu_engine

    npu_engine.install()
    import vllm  # noqa: F401

    from npu_ops import mla  # noqa: F401
    from zb_patch.check.engine import child  # noqa: F401


# -- the launcher's side ---------------------------------------------------------------------------------------


def delegate(script: str) -> None:
    """Run ``script`` (with this process's argv, environment, working directory and stdio) in a fork of the zygote
    named by ``ZB_TEST_ENGINE_ZYGOTE`` and exit with its status. Returns when there is none to use (the launcher then
    runs itself); says why on stderr when a named zygote could not take the request."""
    path = os.environ.get(ZYGOTE_ENV)
    if not path or _in_fork:
        return
    request = {
        "script": os.path.abspath(script),
        "argv": sys.argv[1:],
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "executable": sys.executable,
    }
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        reply = json.loads(_recv_all(conn))
    except (OSError, ValueError) as exc:
        print(f"engine_zygote: {path} did not take the run ({exc}); running in this process", file=sys.stderr)
        return
    if "refused" in reply:
        print(f"engine_zygote: refused ({reply['refused']}); running in this process", file=sys.stderr)
        return
    if "signal" in reply:  # the fork was killed: so is this process, as a fresh one would have been
        signal.signal(reply["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), reply["signal"])
    os._exit(reply["exit"])


def _recv_all(conn: socket.socket) -> bytes:
    chunks = []
    while True:
        data = conn.recv(65536)
        if not data:
            return b"".join(chunks)
        chunks.append(data)


# -- the zygote's side -----------------------------------------------------------------------------------------


def serve(path: str, preload: bool, env_at_start: dict[str, str]) -> None:
    """Import, then fork one process per request until stdin closes (the starter's end: it owns the zygote).
    ``env_at_start``: the environment the zygote was started with, which requests must match."""
    if preload:
        preload_engine()
    if threading.active_count() != 1:
        raise SystemExit(f"engine_zygote: {threading.active_count()} threads after the imports: cannot fork safely")
    try:  # a fork is watched through its pidfd (Linux 5.3+)
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError) as exc:
        raise SystemExit(f"engine_zygote: no pidfd_open here ({exc})") from None
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".binding")
    server.listen(16)
    os.rename(path + ".binding", path)  # the path appears once connections are accepted
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ, ("accept", None))
    sel.register(sys.stdin, selectors.EVENT_READ, ("stop", None))
    running: dict[int, tuple[socket.socket, int]] = {}  # pid -> (caller connection, pidfd)
    while True:
        for key, _ in sel.select():
            what, data = key.data
            if what == "stop":
                for pid in running:
                    os.kill(pid, signal.SIGKILL)
                return
            if what == "accept":
                conn, _ = server.accept()
                try:
                    started = _start(conn, env_at_start, server, sel)
                except (OSError, ValueError, KeyError) as exc:  # a malformed request: its caller runs itself
                    print(f"engine_zygote: request not served ({exc!r})", file=sys.stderr)
                    conn.close()
                    continue
                if started is not None:
                    pid, pidfd = started
                    running[pid] = (conn, pidfd)
                    sel.register(pidfd, selectors.EVENT_READ, ("exited", pid))
                    sel.register(conn, selectors.EVENT_READ, ("caller", pid))
            elif what == "caller":  # the caller went away (killed on a timeout): its fork goes too
                sel.unregister(key.fileobj)
                if data in running:
                    os.kill(data, signal.SIGKILL)
            elif what == "exited" and data in running:
                conn, pidfd = running.pop(data)
                _, status = os.waitpid(data, 0)
                sel.unregister(pidfd)
                os.close(pidfd)
                if conn in sel.get_map():
                    sel.unregister(conn)
                code = os.waitstatus_to_exitcode(status)  # -N: killed by signal N
                reply = {"signal": -code, "exit": 1} if code < 0 else {"exit": code}
                try:
                    conn.sendall(json.dumps(reply).encode())
                except OSError:
                    pass
                conn.close()


def _start(conn, env_at_start, server, sel):
    """Fork for one request; None when it is refused (the reply says why)."""
    msg, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 3)
    request = json.loads(msg)
    differing = sorted(
        k
        for k in set(env_at_start) | set(request["env"])
        if k not in PER_RUN and env_at_start.get(k) != request["env"].get(k)
    )
    why = ""
    if request["executable"] != sys.executable:
        why = f"another interpreter: {request['executable']}"
    elif differing:
        why = f"environment differs from the zygote's in {differing}"
    elif len(fds) != 3:
        why = "stdin / stdout / stderr not received"
    if why:
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"refused": why}).encode())
        conn.close()
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            sel.close()
            server.close()
            conn.close()
            _run(request, fds)
        finally:
            os._exit(70)
    for fd in fds:
        os.close(fd)
    return pid, os.pidfd_open(pid)


def _run(request: dict, fds: list[int]) -> None:
    """In the fork: become ``python SCRIPT ARGV`` and exit with its status."""
    global _in_fork
    _in_fork = True
    import atexit
    import runpy

    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    code = 0
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.pop(ZYGOTE_ENV, None)  # the launcher runs here; the processes it starts are its own
        script = request["script"]
        sys.argv = [script, *request["argv"]]
        sys.path[0] = os.path.dirname(script)  # as the interpreter sets it for a script
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# -- the starter's side (tests/engine/conftest.py) ----------------------------------------------------------------


def start(path: str, preload: bool = True, timeout: float = 600.0):
    """A zygote serving on ``path`` (a Popen; its output goes to this process's stderr), or None when it did not come
    up within ``timeout`` (said on stderr). It stops when :func:`stop` closes its stdin, or when this process dies."""
    import subprocess
    import time

    cmd = [sys.executable, os.path.abspath(__file__), path] + ([] if preload else ["--no-preload"])
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=sys.stderr.fileno(), env=dict(os.environ))
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            print(
                f"engine_zygote: not serving (exit {proc.poll()}); engine processes start on their own", file=sys.stderr
            )
            stop(proc)
            return None
        time.sleep(0.2)
    return proc


def stop(proc) -> None:
    import subprocess

    proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    ENV_AT_START = dict(os.environ)  # before anything here could change it
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("socket", help="the Unix socket to serve on")
    ap.add_argument("--no-preload", action="store_true", help="fork without importing the engine (tests)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import engine_zygote  # the module the launchers import (its _in_fork is theirs), not this __main__

    engine_zygote.serve(args.socket, preload=not args.no_preload, env_at_start=ENV_AT_START)
