"""Strict stand-in machinery: modules, attribute kinds, meta-path finder.

Nothing here accepts arbitrary names. A stand-in module holds exactly the attributes that
``surface.py`` declares for the active vllm-ascend family; any other attribute raises
``AttributeError`` naming the module and the attribute; any undeclared submodule under a
stand-in root raises ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable
from typing import Any

HINT = "add it explicitly in tests/support/npu_standin"


def undeclared(module: types.ModuleType, attr: str) -> AttributeError:
    return AttributeError(f"NPU stand-in: {module.__name__} has no attribute {attr} ({HINT})", name=attr, obj=module)


def new_module(name: str) -> types.ModuleType:
    """A module that knows only its declared attributes: a plain ``ModuleType`` (``torch.compile`` traces an ``import``
    inside a compiled function only when the result is exactly a module, and vllm-ascend's ops import torch_npu there)
    whose missing names raise through a module-level ``__getattr__`` (PEP 562)."""
    module = types.ModuleType(name)

    def __getattr__(attr: str) -> Any:
        # Only called when normal lookup failed, i.e. the name was not declared.
        raise undeclared(module, attr)

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    module.__npu_standin__ = True  # type: ignore[attr-defined]
    return module


class Unavailable:
    """A callable that exists (so imports and ``hasattr`` see it) but has no CPU meaning.

    Calling it raises ``RuntimeError``. Attribute access on it (``op.default``) raises too: a
    stand-in function is not a torch op overload packet.
    """

    def __init__(self, qualname: str):
        self.__qualname__ = self.__name__ = qualname.rsplit(".", 1)[-1]
        self._qualname = qualname

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"NPU stand-in: {self._qualname}() needs an Ascend NPU (CANN); it cannot run on CPU. "
            "Tests must not reach this call."
        )

    def __repr__(self) -> str:
        return f"<NPU stand-in unavailable function {self._qualname}>"


class Sentinel:
    """An opaque named value (e.g. an NPU-only dtype used as a dict key at import time)."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __repr__(self) -> str:
        return f"<NPU stand-in sentinel {self._qualname}>"

    def __reduce__(self):  # picklable by name, like torch dtypes
        return (_sentinel_by_name, (self._qualname,))


_SENTINELS: dict[str, Sentinel] = {}


def _sentinel_by_name(qualname: str) -> Sentinel:
    return _SENTINELS.setdefault(qualname, Sentinel(qualname))


def make_opaque_class(qualname: str) -> type:
    """A class that can be named, subclassed and used in annotations / isinstance, but not built."""
    modname, _, clsname = qualname.rpartition(".")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"NPU stand-in: {qualname} cannot be constructed on CPU ({HINT} if a test needs it).")

    return type(clsname, (), {"__init__": __init__, "__module__": modname, "__qualname__": clsname})


# Attribute kinds used by surface.py. Each is a callable (qualname) -> value.
Kind = Callable[[str], Any]


def unavailable(qualname: str) -> Unavailable:
    return Unavailable(qualname)


def sentinel(qualname: str) -> Sentinel:
    return _sentinel_by_name(qualname)


def opaque_class(qualname: str) -> type:
    return make_opaque_class(qualname)


def value(v: Any) -> Kind:
    return lambda qualname: v


def ref(dotted: str) -> Kind:
    """An object implemented in npu_standin.runtime (``ref("runtime:Stream")``), as ``runtime.resolve`` gives it for
    the device the NPU stands on (CPU no-op objects, or torch.cuda's under ``NPU_STANDIN_DEVICE=cuda``)."""
    mod, _, attr = dotted.partition(":")

    def build(qualname: str) -> Any:
        import importlib

        return importlib.import_module(f"npu_standin.{mod}").resolve(attr)

    return build


def standin_module(name: str) -> Kind:
    """Another declared stand-in module, imported through the finder (to hang it on a real package)."""

    def build(qualname: str) -> Any:
        import importlib

        return importlib.import_module(name)

    return build


class StandinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the declared stand-in modules; refuses every other name under the stand-in roots."""

    def __init__(
        self,
        modules: dict[str, dict[str, Kind]],
        roots: frozenset[str],
        on_create: Callable[[types.ModuleType], None],
        make_module: Callable[[str], types.ModuleType] = new_module,
    ):
        self.make_module = make_module
        self.modules = modules
        self.roots = roots
        self.on_create = on_create

    # -- finder ---------------------------------------------------------------------------------
    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        root = self._root_of(fullname)
        if root is None:
            return None
        if fullname not in self.modules:
            if fullname == root:
                # A root this family does not need: answer "not here" (availability probes such
                # as transformers' find_spec("torchvision") must see a plain absence).
                return None
            raise ModuleNotFoundError(f"NPU stand-in: no module named {fullname!r} ({HINT})", name=fullname)
        is_pkg = any(m.startswith(fullname + ".") for m in self.modules)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=is_pkg)

    def _root_of(self, fullname: str) -> str | None:
        for root in self.roots:
            if fullname == root or fullname.startswith(root + "."):
                return root
        return None

    # -- loader ---------------------------------------------------------------------------------
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = self.make_module(spec.name)
        if spec.submodule_search_locations is not None:
            mod.__path__ = []  # a package with no files: children come from this finder only
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        # Also runs on importlib.reload(): re-populating is idempotent.
        name = module.__name__
        for attr, kind in self.modules[name].items():
            setattr(module, attr, kind(f"{name}.{attr}"))
        self.on_create(module)  # type: ignore[arg-type]
        # A real package imports its submodules in its __init__; do the same for declared children.
        for child in sorted(self.modules):
            if child.rpartition(".")[0] == name:
                __import__(child)
                setattr(module, child.rpartition(".")[2], sys.modules[child])
