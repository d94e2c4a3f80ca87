"""Fixtures for unit tests: real, importable stand-in *upstream* modules written to a temp dir.

The registry is exercised against genuine Python modules (so ``inspect.getsource`` works exactly as on vLLM),
never against mocks. Each test gets a fresh package name, so tests cannot leak patches into each other.
"""

from __future__ import annotations

import importlib
import itertools
import sys
import textwrap

RUNNER_SRC = '''
"""A small upstream-like module."""
import functools


def helper(x):
    """Module-level function (fingerprinted, aliased by `from ... import helper`)."""
    return x + 1


class Base:
    def inherited(self):
        return "base"


class Runner(Base):
    scale = 2

    def __init__(self):
        self.calls = []

    def step(self, x):
        # a comment that must not change the fingerprint
        self.calls.append(x)
        return x * self.scale

    def prepare(self, n):
        return list(range(n))

    @staticmethod
    def pure(a, b):
        return a - b

    @classmethod
    def build(cls):
        return cls()
'''

USER_SRC = """
from {pkg}.runner import helper


def use(x):
    return helper(x)
"""

_counter = itertools.count()


class FakeUpstream:
    """A throwaway package ``zbfake_N`` with modules ``runner`` (targets) and ``user`` (an alias holder)."""

    def __init__(self, root, runner_src=RUNNER_SRC):
        self.pkg = f"zbfake_{next(_counter)}"
        self.root = root
        pkg_dir = root / self.pkg
        pkg_dir.mkdir()
        (pkg_dir / "__init__.py").write_text("")
        (pkg_dir / "runner.py").write_text(textwrap.dedent(runner_src))
        (pkg_dir / "user.py").write_text(USER_SRC.format(pkg=self.pkg))
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))

    def mod(self, name="runner"):
        return f"{self.pkg}.{name}"

    def target(self, qual, module="runner"):
        return f"{self.pkg}.{module}:{qual}"

    def load(self, name="runner"):
        return importlib.import_module(self.mod(name))

    def write(self, name, src):
        (self.root / self.pkg / f"{name}.py").write_text(textwrap.dedent(src))

    def unload(self):
        for key in [k for k in sys.modules if k == self.pkg or k.startswith(self.pkg + ".")]:
            del sys.modules[key]
