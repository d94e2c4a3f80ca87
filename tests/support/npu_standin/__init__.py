"""Test-only stand-in for the NPU runtime packages that cannot exist on a CPU-only machine:
``torch_npu`` (+ ``torch.npu``), ``torchair``, ``acl`` and ``torchvision`` (PyPI's torchvision
cannot load beside the CPU torch build). See README.md beside this file.

Usage::

    import npu_standin
    npu_standin.install()          # before anything imports vllm_ascend; idempotent
    from npu_standin.ascend_imports import import_worker_modules
    mods = import_worker_modules() # the worker-side modules, in the order the real worker imports them

or run a CLI with the stand-in active: ``python -m npu_standin zb_patch.cli doctor``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
import types
from typing import Any

from . import runtime, surface
from ._core import HINT, StandinFinder, new_module, undeclared

__all__ = ["install", "is_installed", "active_family", "detect_family", "family_of", "accessed", "FAMILIES", "HINT"]

FAMILIES = surface.FAMILIES

_finder: StandinFinder | None = None
_family: str | None = None
_trace: set[tuple[str, str]] | None = None


class StandinError(RuntimeError):
    pass


def detect_family(dist: str = "vllm-ascend") -> str | None:
    """The vllm-ascend family of the installed distribution (``None`` if not installed).

    Family = the newest entry of FAMILIES whose first release (``surface.FAMILY_FROM``) is <= the installed
    major.minor, e.g. 0.18.0 -> "0.18", 0.19.1rc1 -> "0.23" (the transformers-5 surface serves 0.19-0.23),
    0.23.0.post1 -> "0.23". Older than every family: error.
    Read from package metadata; nothing is imported.
    """
    try:
        ver = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    return family_of(ver, dist)


def family_of(ver: str, dist: str = "vllm-ascend") -> str:
    """The family of a vllm-ascend version string (see detect_family)."""
    m = re.match(r"(\d+)\.(\d+)", ver)
    if not m:
        raise StandinError(f"NPU stand-in: cannot parse {dist} version {ver!r}")
    have = (int(m.group(1)), int(m.group(2)))
    fams = [f for f in FAMILIES if surface.FAMILY_FROM[f] <= have]
    if not fams:
        raise StandinError(f"NPU stand-in: {dist} {ver} is older than every covered family {FAMILIES} ({HINT})")
    return fams[-1]


def _on_create(module: types.ModuleType) -> None:
    """Side effects the real import has on torch itself, beyond the module's own attributes."""
    if _trace is not None:
        _trace.add((module.__name__, "<imported>"))
    if module.__name__ == "torch_npu":
        # real torch_npu adds HCCL helpers to torch.distributed (surface.TORCH_SIDE_EFFECTS)
        import importlib

        for ns_name, attrs in surface.side_effects_for(None if _family == "all" else _family).items():
            ns = importlib.import_module(ns_name)
            for attr, val in attrs.items():
                setattr(ns, attr, val)
    if module.__name__ == "torch_npu.npu":
        # import torch_npu makes torch.npu the torch_npu.npu module.
        import torch

        torch.npu = module  # type: ignore[attr-defined]
        sys.modules["torch.npu"] = module


class _TracingModule(types.ModuleType):
    """NPU_STANDIN_TRACE=1: records every declared attribute that is read (to keep the surface minimal); an
    undeclared one raises as in :func:`._core.new_module`."""

    __npu_standin__ = True

    def __getattribute__(self, name: str) -> Any:
        if _trace is not None and not name.startswith("__"):
            _trace.add((object.__getattribute__(self, "__name__"), name))
        return super().__getattribute__(name)

    def __getattr__(self, name: str) -> Any:
        raise undeclared(self, name)


def install(family: str | None = None) -> str:
    """Activate the stand-in for ``family`` (default: detected from the installed vllm-ascend;
    the union of all families when none is installed). Idempotent; returns the active family
    ("all" for the union). Must run before anything imports vllm_ascend, torch_npu, torchair,
    acl or torchvision.
    """
    global _finder, _family, _trace
    want = family if family is not None else (detect_family() or "all")
    if want != "all" and want not in FAMILIES:
        raise StandinError(f"NPU stand-in: unknown family {want!r}; valid: {FAMILIES} or 'all'")
    if _finder is not None:
        if want != _family:
            raise StandinError(f"NPU stand-in already installed for family {_family}, not {want}")
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        return _family  # type: ignore[return-value]

    late = [
        m
        for m in ("vllm_ascend", *surface.ROOTS)
        if m in sys.modules and not getattr(sys.modules[m], "__npu_standin__", False)
    ]
    if late:
        raise StandinError(
            f"NPU stand-in: install() ran after {late} was imported; install it first "
            "(tests/conftest.py pytest_configure, or `python -m npu_standin <module>`)"
        )
    surface.check_consistency()
    make_module = new_module
    if os.environ.get("NPU_STANDIN_TRACE"):
        _trace = set()
        make_module = _TracingModule
    modules = surface.modules_for(None if want == "all" else want)
    roots = surface.ROOTS
    if runtime.device() == "cuda" and importlib.util.find_spec("torchvision") is not None:
        # On a CUDA host PyPI's torchvision loads beside its torch: the real one serves (transformers finds its
        # dist metadata there and imports names the stand-in does not declare).
        roots = tuple(r for r in roots if r != "torchvision")
        modules = {m: v for m, v in modules.items() if m != "torchvision" and not m.startswith("torchvision.")}
    _finder = StandinFinder(modules, roots, on_create=_on_create, make_module=make_module)
    sys.meta_path.insert(0, _finder)
    _family = want
    return want


def is_installed() -> bool:
    return _finder is not None and _finder in sys.meta_path


def active_family() -> str | None:
    return _family


def accessed() -> set[tuple[str, str]]:
    """(module, attribute) pairs read so far; only recorded when NPU_STANDIN_TRACE is set."""
    if _trace is None:
        raise StandinError("NPU stand-in: set NPU_STANDIN_TRACE=1 before install() to record accesses")
    return set(_trace)
