"""``--json`` keeps stdout for the one JSON document, whoever else writes to stdout while the command runs.

Each case runs in a fresh interpreter, so what reaches file descriptors 1 and 2 is what a shell pipe sees.
tests/lifecycle/test_cli_json.py runs `zb-patch doctor --json` against a real vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# A command that writes to stdout in every way a library can while it works: Python's print, a logging
# handler bound to sys.stdout before the command started (vLLM's is), libc's buffered printf (a C
# extension), a raw write to file descriptor 1, and a child process that inherits it.
NOISY = r"""
import argparse, ctypes, logging, os, subprocess, sys
from zb_patch import console

handler = logging.StreamHandler(sys.stdout)
log = logging.getLogger("noisy")
log.addHandler(handler)
log.setLevel(logging.INFO)

def noisy(args):
    print("python print")
    log.info("logging handler bound to sys.stdout")
    libc = ctypes.CDLL(None)
    libc.printf(b"libc printf\n")
    os.write(1, b"raw fd 1\n")
    subprocess.run([sys.executable, "-c", "print('child process')"], check=True)
    args.out.write('{"ok": true}\n')
    return 3

ns = argparse.Namespace(json=JSON)
code = console.run_command(noisy, ns)
print("after the command")
sys.exit(code)
"""
NOISE = ("python print", "logging handler bound to sys.stdout", "libc printf", "raw fd 1", "child process")


def _run(as_json: bool) -> subprocess.CompletedProcess:
    # PYTHONUNBUFFERED would make libc's stdout unbuffered too, hiding output that waits in its buffer
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run(
        [sys.executable, "-c", NOISY.replace("JSON", str(as_json))], capture_output=True, text=True, timeout=60, env=env
    )


def test_json_mode_stdout_carries_only_the_document():
    r = _run(True)
    assert r.returncode == 3, r.stderr
    doc, _, rest = r.stdout.partition("\n")
    assert json.loads(doc) == {"ok": True}
    assert rest == "after the command\n"  # stdout is the real one again once the command is done
    for line in NOISE:
        assert line in r.stderr, (line, r.stderr)


def test_human_mode_prints_to_stdout():
    r = _run(False)
    assert r.returncode == 3, r.stderr
    for line in NOISE:
        assert line in r.stdout, (line, r.stdout)
    assert '{"ok": true}' in r.stdout and r.stderr == ""


def test_doctor_json_and_text():
    cmd = [sys.executable, "-m", "zb_patch.cli", "doctor", "--no-import"]
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert "Verdict:" in text.stdout, text.stderr
    js = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=60)
    assert json.loads(js.stdout)["schema"] == "zb-patch-doctor/1", js.stdout + js.stderr
