"""The adapter table: which installed vLLM / vLLM-Ascend gets which patch set.

An *adapter* is one supported release family. It names the vllm-ascend and vLLM release ranges it was
built for and holds one :class:`~zb_patch.registry.PatchSet`: the patches it applies plus guards (upstream
functions the patches rely on). Every target carries the fingerprints it was built against, so:

* a family in range whose targets all match -> applied;
* a family in range with any drifted target -> refused, nothing applied, one ERROR line;
* an unknown build (dev / nightly / unlisted pairing) -> every adapter is tried by fingerprint, and the
  first whose targets all match is accepted ("accepted by fingerprint"); none -> refused.

Version checks live here and in :mod:`zb_patch.detect` only. A release's quirks live in its adapter module.
"""

from __future__ import annotations

import ast
import dataclasses
import os
from typing import Optional

from ..detect import Versions
from ..registry import PatchSet, fingerprint_source, split_target

Release = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Adapter:
    id: str
    title: str
    vllm_ascend: tuple[Release, Release]   # [low, high) on the release part
    vllm: tuple[Release, Release]          # [low, high)
    patch_set: PatchSet
    notes: str = ""
    # modules a diagnostic import must load first, in this order (the real worker imports them before the
    # runner; importing the runner module first can hit a circular import)
    preload: tuple[str, ...] = ()
    # vllm-ascend releases whose sources the fingerprints were computed from (tests/sources re-checks them
    # against the PyPI artifacts)
    releases: tuple[str, ...] = ()

    def in_range(self, v: Versions) -> bool:
        return v.vllm_ascend.release_in(*self.vllm_ascend) and v.vllm.release_in(*self.vllm)

    def ascend_in_range(self, v: Versions) -> bool:
        return v.vllm_ascend.release_in(*self.vllm_ascend)

    @property
    def range_text(self) -> str:
        return f"vllm-ascend {_rng(self.vllm_ascend)} + vLLM {_rng(self.vllm)}"


def _fmt(r: Release) -> str:
    return ".".join(map(str, r))


def _rng(r: tuple[Release, Release]) -> str:
    return f">={_fmt(r[0])},<{_fmt(r[1])}"


# Verdicts of selection
SELECTED = "selected"       # one adapter by version range (fingerprints still decide at apply time)
PROBE = "probe"             # unknown build: adapters tried by fingerprint
NATIVE = "native"           # the release already has everything zb-patch carries
REFUSED = "refused"         # nothing to do / unsupported, with a reason


@dataclasses.dataclass(frozen=True)
class Selection:
    verdict: str
    reason: str
    candidates: tuple[Adapter, ...] = ()

    @property
    def adapter(self) -> Optional[Adapter]:
        return self.candidates[0] if self.verdict == SELECTED else None

    def as_dict(self) -> dict:
        return {"verdict": self.verdict, "reason": self.reason,
                "candidates": [a.id for a in self.candidates]}


# The native boundary and the oldest family that can run async scheduling + spec decode at all.
NATIVE_FROM: Release = (0, 24)
OLDEST_SUPPORTED: Release = (0, 13)


def adapters() -> tuple[Adapter, ...]:
    from . import ascend_0_13, ascend_0_18, ascend_0_19_0_23

    return (ascend_0_13.ADAPTER, ascend_0_18.ADAPTER, ascend_0_19_0_23.ADAPTER)


def by_id(adapter_id: str) -> Adapter:
    for a in adapters():
        if a.id == adapter_id:
            return a
    raise KeyError(f"unknown adapter {adapter_id!r} (known: {', '.join(a.id for a in adapters())})")


def select(v: Versions) -> Selection:
    if not v.vllm.installed:
        return Selection(REFUSED, "vLLM is not installed")
    if v.vllm.error:
        return Selection(REFUSED, f"vLLM version {v.vllm.raw!r} cannot be parsed: {v.vllm.error}")
    if not v.vllm_ascend.installed:
        return Selection(REFUSED, "vllm-ascend is not installed: zb-patch patches vLLM-Ascend deployments only")
    if v.vllm_ascend.error:
        return Selection(REFUSED, f"vllm-ascend version {v.vllm_ascend.raw!r} cannot be parsed: {v.vllm_ascend.error}")
    va = v.vllm_ascend
    if va.release_at_least(*NATIVE_FROM):
        return Selection(NATIVE, f"vllm-ascend {va.raw} (>= {_fmt(NATIVE_FROM)}) already ships zero-bubble "
                                 f"async scheduling + spec decode and the fixes zb-patch carries")
    if not va.release_at_least(*OLDEST_SUPPORTED):
        return Selection(REFUSED, f"vllm-ascend {va.raw} is older than {_fmt(OLDEST_SUPPORTED)}: it cannot run async "
                                  f"scheduling together with speculative decoding, so there is nothing to backport")
    in_range = [a for a in adapters() if a.in_range(v)]
    if in_range:
        a = in_range[0]
        kind = "release" if va.is_final and v.vllm.is_final else "build"
        return Selection(SELECTED, f"{kind} vllm-ascend {va.raw} + vLLM {v.vllm.raw} is in {a.id} ({a.range_text})",
                         (a,))
    family = [a for a in adapters() if a.ascend_in_range(v)]
    others = [a for a in adapters() if a not in family]
    why = (f"vllm-ascend {va.raw} is paired with vLLM {v.vllm.raw}, outside {family[0].id}'s {family[0].range_text}"
           if family else f"vllm-ascend {va.raw} + vLLM {v.vllm.raw} matches no adapter's version range")
    return Selection(PROBE, why + "; accepted only if every target of one adapter matches its fingerprints",
                     tuple(family + others))


def supported_table() -> list[dict]:
    """Rows for the README / doctor: one per adapter plus the native and refused boundaries."""
    rows = [{"vllm_ascend": f">= {_fmt(NATIVE_FROM)}", "vllm": "(as pinned)", "verdict": "native",
             "adapter": "-", "patches": "none needed"}]
    for a in sorted(adapters(), key=lambda a: a.vllm_ascend, reverse=True):
        pids = [p.id for p in a.patch_set.patches]
        rows.append({"vllm_ascend": _rng(a.vllm_ascend), "vllm": _rng(a.vllm), "verdict": "adapter",
                     "adapter": a.id, "patches": ", ".join(pids) if pids else "(guards only so far)"})
    rows.append({"vllm_ascend": f"< {_fmt(OLDEST_SUPPORTED)}", "vllm": "any", "verdict": "refused",
                 "adapter": "-", "patches": "async + spec decode not supported by the release"})
    rows.append({"vllm_ascend": "not installed", "vllm": "any", "verdict": "refused", "adapter": "-",
                 "patches": "zb-patch is for vLLM-Ascend deployments"})
    return rows


def module_file(root: str, module: str) -> Optional[str]:
    base = os.path.join(root, *module.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.exists(path):
            return path
    return None


def fingerprint_in_tree(root: str, target: str, *, follow_reexports: bool = True, _depth: int = 0) -> Optional[str]:
    """Fingerprint of ``target`` in a source tree (site-packages, unpacked wheel, git checkout).

    Resolves like the running process does (through the module's namespace): when the module does not define
    the target's first name but binds it with a module-level ``from X import Name`` (a re-export, e.g.
    ``vllm_ascend.spec_decode.eagle_proposer`` re-exports ``AscendSpecDecodeBaseProposer`` from
    ``llm_base_proposer`` since vllm-ascend 0.20.2rc1), the definition in ``X`` is fingerprinted, as
    ``registry.resolve`` + ``fingerprint_object`` would. ``follow_reexports=False``: only definitions in that
    very file count (docs/releases/fingerprint_matrix.py reports re-exports as absent).
    """
    module, parts = split_target(target)
    path = module_file(root, module)
    if path is None:
        return None
    with open(path, encoding="utf-8-sig") as fh:
        source = fh.read()
    fp = fingerprint_source(source, parts)
    if fp is not None or not follow_reexports or _depth >= 4:
        return fp
    origin = _reexport_origin(ast.parse(source), module, path.endswith("__init__.py"), parts[0])
    if origin is None:
        return None
    src_module, src_name = origin
    return fingerprint_in_tree(root, f"{src_module}:{'.'.join((src_name, *parts[1:]))}", _depth=_depth + 1)


def _reexport_origin(tree: ast.Module, module: str, is_package: bool, name: str) -> Optional[tuple[str, str]]:
    """(module, name) that a module-level ``from X import ...`` binds to ``name``, if the last module-level
    binding of ``name`` is such an import (a later def/class would win at run time)."""
    origin: Optional[tuple[str, str]] = None
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
            origin = None
        elif isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if (alias.asname or alias.name) == name and alias.name != "*":
                    if stmt.level:
                        base = module.split(".") if is_package else module.split(".")[:-1]
                        base = base[: len(base) - (stmt.level - 1)] if stmt.level > 1 else base
                        src = ".".join(base + ([stmt.module] if stmt.module else []))
                    else:
                        src = stmt.module or ""
                    origin = (src, alias.name) if src else None
    return origin
