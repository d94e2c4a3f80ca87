"""How a ``zb-patch`` command writes its result: ``run_command`` (shared by ``zb_patch.cli`` and the diagnostics'
own entry points in ``zb_patch.check``, which import this leaf module instead of the CLI that imports them).

With ``--json`` stdout carries one JSON document and nothing else: file descriptor 1 points at stderr while the
command runs (Python prints, logging, C extensions, child processes)."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """While the block runs, everything written to stdout goes to stderr: Python code (``sys.stdout``, and
    vLLM's log handler, which binds the ``sys.stdout`` of vLLM's first import), C extensions and child
    processes (file descriptor 1)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        _flush_c_stdio()
        os.dup2(saved, 1)
        os.close(saved)


def _flush_c_stdio() -> None:
    """C-level ``printf`` output buffered in libc still belongs to the redirected descriptor."""
    import ctypes

    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to ask (not Linux / macOS)
        pass


def run_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command; it writes its result to ``args.out``. With ``--json`` stdout carries that one JSON
    document and nothing else: every other line (ours, vLLM's, a C extension's, a child's) goes to stderr."""
    if not getattr(args, "json", False):
        args.out = sys.stdout
        return func(args)
    args.out = io.StringIO()
    with _stdout_to_stderr():
        code = func(args)
    sys.stdout.write(args.out.getvalue())
    sys.stdout.flush()
    return code
