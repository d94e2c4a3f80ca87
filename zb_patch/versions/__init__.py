"""The adapter table: which installed vLLM / vLLM-Ascend gets which patch set.

An *adapter* is one supported release family. It names the vllm-ascend and vLLM release ranges it was
built for and holds one :class:`~zb_patch.registry.PatchSet`: the patches it applies plus guards (upstream
functions the patches rely on). Every target carries the fingerprints it was built against, so:

* a family in range whose targets all match -> applied;
* a family in range with any drifted target -> refused, nothing applied, one ERROR line;
* an unknown build (dev / nightly / unlisted pairing) -> every adapter is tried by fingerprint, and the
  first whose targets all match is accepted ("accepted by fingerprint"); none -> refused;
* a release past the newest adapter's range -> "native" only when its installed code is a recorded native form
  (:mod:`.native`, checked from the source files); anything else -> refused, naming every check.

Version checks live here and in :mod:`zb_patch.detect` only. A release's quirks live in its adapter module.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import os
import re
from collections.abc import Mapping

from ..detect import Versions
from ..registry import PatchSet, find_node, fingerprint_node, split_target
from . import native

Release = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Adapter:
    id: str
    title: str
    vllm_ascend: tuple[Release, Release]  # [low, high) on the release part
    vllm: tuple[Release, Release]  # [low, high)
    patch_set: PatchSet
    notes: str = ""
    # modules a diagnostic import must load first, in this order (the real worker imports them before the
    # runner; importing the runner module first can hit a circular import)
    preload: tuple[str, ...] = ()
    # vllm-ascend releases whose sources the fingerprints were computed from (tests/sources re-checks them
    # against the PyPI artifacts)
    releases: tuple[str, ...] = ()
    # ids of zb-patch's own zero-bubble / kernel patches (the others fix the release's own defects):
    # ZB_PATCH_DISABLE of these leaves the release's async path with only the fixes (selftest --engine's async+fixes)
    zero_bubble_ids: tuple[str, ...] = ()

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
SELECTED = "selected"  # one adapter by version range (fingerprints still decide at apply time)
PROBE = "probe"  # unknown build: adapters tried by fingerprint
NATIVE = "native"  # the installed code is a recorded native form: nothing to carry
REFUSED = "refused"  # nothing to do / unsupported, with a reason


@dataclasses.dataclass(frozen=True)
class Selection:
    verdict: str
    reason: str
    candidates: tuple[Adapter, ...] = ()
    checks: tuple[native.Check, ...] = ()  # the native-form checks behind a NATIVE / past-the-adapters verdict

    @property
    def adapter(self) -> Adapter | None:
        return self.candidates[0] if self.verdict == SELECTED else None

    def as_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "reason": self.reason,
            "candidates": [a.id for a in self.candidates],
            "checks": [c.as_dict() for c in self.checks],
        }


# Where the adapters end (the installed code decides from there on: native.py) and the oldest family that can run
# async scheduling + spec decode at all.
NATIVE_FROM: Release = (0, 26)
OLDEST_SUPPORTED: Release = (0, 13)


def adapters() -> tuple[Adapter, ...]:
    from . import ascend_0_13, ascend_0_18, ascend_0_19_0_25

    return (ascend_0_13.ADAPTER, ascend_0_18.ADAPTER, ascend_0_19_0_25.ADAPTER)


def by_id(adapter_id: str) -> Adapter:
    for a in adapters():
        if a.id == adapter_id:
            return a
    raise KeyError(f"unknown adapter {adapter_id!r} (known: {', '.join(a.id for a in adapters())})")


def select(v: Versions, tree: str | None = None) -> Selection:
    """The verdict for the installed versions. ``tree``: directory holding ``vllm_ascend/`` for the native check
    (default: where the installed package lives; tests pass a tree)."""
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
        return _native_by_code(str(va.raw), tree if tree is not None else native.installed_root())
    if not va.release_at_least(*OLDEST_SUPPORTED):
        return Selection(
            REFUSED,
            f"vllm-ascend {va.raw} is older than {_fmt(OLDEST_SUPPORTED)}: it cannot run async "
            f"scheduling together with speculative decoding, so there is nothing to backport",
        )
    in_range = [a for a in adapters() if a.in_range(v)]
    if in_range:
        a = in_range[0]
        kind = "release" if va.is_final and v.vllm.is_final else "build"
        return Selection(
            SELECTED, f"{kind} vllm-ascend {va.raw} + vLLM {v.vllm.raw} is in {a.id} ({a.range_text})", (a,)
        )
    family = [a for a in adapters() if a.ascend_in_range(v)]
    others = [a for a in adapters() if a not in family]
    why = (
        f"vllm-ascend {va.raw} is paired with vLLM {v.vllm.raw}, outside {family[0].id}'s {family[0].range_text}"
        if family
        else f"vllm-ascend {va.raw} + vLLM {v.vllm.raw} matches no adapter's version range"
    )
    return Selection(
        PROBE, why + "; accepted only if every target of one adapter matches its fingerprints", tuple(family + others)
    )


def _native_by_code(raw: str, root: str | None) -> Selection:
    """NATIVE when every native form (native.py) is recorded in the installed sources, else REFUSED naming what
    was checked: a release newer than everything recorded is never native by its number."""
    if root is None:
        return Selection(
            REFUSED,
            f"vllm-ascend {raw} is past every adapter (>= {_fmt(NATIVE_FROM)}) and its sources "
            f"cannot be found, so its slot-mapping and zero-bubble code cannot be checked",
        )
    checks = native.check_tree(root)
    unknown = [c for c in checks if c.matched is None]
    if not unknown:
        labels = sorted({c.matched for c in checks if c.matched})
        return Selection(
            NATIVE,
            f"vllm-ascend {raw} ships the Ascend-shaped slot-mapping kernel and zero-bubble "
            f"async scheduling + spec decode: {len(checks)} targets checked, each a recorded "
            f"native form ({'; '.join(labels)}); nothing to carry",
            checks=checks,
        )
    return Selection(
        REFUSED,
        f"vllm-ascend {raw} is past every adapter (>= {_fmt(NATIVE_FROM)}) and not a recorded "
        f"native form (recorded: {', '.join(native.RELEASES)}): checked "
        f"{'; '.join(c.text for c in checks)}; {len(unknown)} of {len(checks)} unknown, so "
        f"zb-patch cannot tell whether it needs the slot-mapping kernel or zero-bubble fixes",
        checks=checks,
    )


# ----------------------------------------------------------------------------------------------------
# Every published vllm-ascend release and its verdict (README table, `zb-patch supported`). The verdicts come from
# the recorded data (adapter releases and fingerprint labels, native.RELEASES); tests/sources recomputes each from
# the release's PyPI artifacts with tree_verdict().
# ----------------------------------------------------------------------------------------------------

PUBLISHED: tuple[str, ...] = (
    "0.9.1",
    "0.9.2rc1",
    "0.10.0rc1",
    "0.10.1rc1",
    "0.10.2rc1",
    "0.11.0rc0",
    "0.11.0rc1",
    "0.11.0rc2",
    "0.11.0rc3",
    "0.11.0",
    "0.12.0rc1",
    "0.13.0rc1",
    "0.13.0rc2",
    "0.13.0rc3",
    "0.13.0",
    "0.14.0rc1",
    "0.15.0rc1",
    "0.16.0rc1",
    "0.17.0rc1",
    "0.18.0rc1",
    "0.18.0",
    "0.19.1rc1",
    "0.20.2rc1",
    "0.21.0rc1",
    "0.22.1rc1",
    "0.23.0rc1",
    "0.23.0",
    "0.23.0.post1",
    "0.24.0rc1",
    "0.25.1rc1",
    "0.26.0rc1",
    "0.27.1rc1",
    "0.28.0rc1",
    "0.29.0rc1",
    "0.30.0rc1",
    "0.30.0rc2",
)

_VERSION = re.compile(r"\d+\.\d+\.\d+(?:rc\d+)?(?:\.post\d+)?")


def label_names(label: str, release: str) -> bool:
    """A fingerprint label names this exact release ("0.23.0" is not named by "0.23.0rc1" nor "0.23.0.post1")."""
    return release in _VERSION.findall(label)


def _release(release: str) -> Release:
    m = re.match(r"\d+(?:\.\d+)*", release)
    if m is None:
        raise ValueError(f"not a release number: {release!r}")
    return tuple(int(x) for x in m.group(0).split(".")[:3])


@dataclasses.dataclass(frozen=True)
class ReleaseVerdict:
    verdict: str  # NATIVE / SELECTED (an adapter applies) / REFUSED
    adapter: str | None = None
    patches: tuple[str, ...] = ()
    why: str = ""


def release_verdict(release: str) -> ReleaseVerdict:
    """What zb-patch does on a published release, from the recorded data alone."""
    rel = _release(release)
    if rel < OLDEST_SUPPORTED:
        return ReleaseVerdict(REFUSED, why="async + spec decode not supported by the release")
    if rel >= NATIVE_FROM:
        if release in native.RELEASES:
            return ReleaseVerdict(NATIVE, why="Ascend slot-mapping kernel + zero-bubble by installed code")
        return ReleaseVerdict(REFUSED, why="not a recorded native form: nothing applied")
    for a in adapters():
        if _fmt_pad(a.vllm_ascend[0]) <= _fmt_pad(rel) < _fmt_pad(a.vllm_ascend[1]):
            if release not in a.releases:
                return ReleaseVerdict(
                    REFUSED, why=f"in {a.id}'s range, targets not its recorded forms: nothing applied"
                )
            needed = tuple(p.id for p in a.patch_set.patches if any(label_names(lb, release) for lb in p.fingerprints))
            return ReleaseVerdict(SELECTED, a.id, needed)
    return ReleaseVerdict(REFUSED, why="no adapter's targets match (tried by fingerprint): nothing applied")


def _fmt_pad(r: Release) -> Release:
    return tuple(r) + (0,) * (3 - len(r))


def tree_verdict(root: str, release: str) -> ReleaseVerdict:
    """The verdict recomputed from a release's vllm-ascend sources under ``root`` (unpacked wheel or sdist), as
    selection + verification would decide it at run time, by fingerprint of every ``vllm_ascend`` target. vLLM's
    own targets live in vLLM's wheels: a patch of one counts by its recorded labels (the va envs check it live)."""
    rel = _release(release)
    if rel < OLDEST_SUPPORTED:
        return ReleaseVerdict(REFUSED, why="async + spec decode not supported by the release")
    if rel >= NATIVE_FROM:
        sel = _native_by_code(release, root)
        if sel.verdict == NATIVE:
            return ReleaseVerdict(NATIVE, why="Ascend slot-mapping kernel + zero-bubble by installed code")
        return ReleaseVerdict(REFUSED, why="not a recorded native form: nothing applied")
    in_range = [a for a in adapters() if _fmt_pad(a.vllm_ascend[0]) <= _fmt_pad(rel) < _fmt_pad(a.vllm_ascend[1])]
    for a in in_range or adapters():
        applied: list[str] = []
        ok = True
        # (target, forms a patch replaces / a guard accepts, forms that already carry the fix, patch id)
        items: list[tuple[str, Mapping[str, str], Mapping[str, str], str | None]] = [
            (g.target, g.fingerprints, {}, None) for g in a.patch_set.guards
        ]
        items += [(p.target, p.fingerprints, p.native_fingerprints, p.id) for p in a.patch_set.patches]
        for target, needs, has, pid in items:
            if not target.startswith("vllm_ascend."):
                # a vLLM function: not in this artifact; its recorded labels stand (the va envs check it live)
                if pid and any(label_names(lb, release) for lb in needs):
                    applied.append(pid)
                continue
            fp = fingerprint_in_tree(root, target)
            if fp is None or fp not in (*needs.values(), *has.values()):
                ok = False
                break
            if pid and fp in needs.values():
                applied.append(pid)
        if ok:
            return ReleaseVerdict(SELECTED, a.id, tuple(applied))
        if in_range:
            return ReleaseVerdict(REFUSED, why=f"in {a.id}'s range, targets not its recorded forms: nothing applied")
    return ReleaseVerdict(REFUSED, why="no adapter's targets match (tried by fingerprint): nothing applied")


def _pinned_vllm(release: str) -> str:
    """The vLLM a vllm-ascend release is built for: the same release number (its Dockerfile's VLLM_TAG)."""
    return ".".join(map(str, _release(release)))


def supported_table() -> list[dict]:
    """Rows for the README / `zb-patch supported`: one per run of published releases with the same verdict and
    patches, then the boundaries (unrecorded newer builds, no vllm-ascend)."""
    runs: list[tuple[list[str], ReleaseVerdict]] = []
    for release in PUBLISHED:
        rv = release_verdict(release)
        if runs and runs[-1][1] == rv:
            runs[-1][0].append(release)
        else:
            runs.append(([release], rv))
    rows = []
    for releases, rv in reversed(runs):
        first, last = releases[0], releases[-1]
        span = first if first == last else f"{first} - {last}"
        vllm_first, vllm_last = _pinned_vllm(first), _pinned_vllm(last)
        vllm = vllm_first if vllm_first == vllm_last else f"{vllm_first} - {vllm_last}"
        if rv.verdict == SELECTED:
            assert rv.adapter is not None
            opt_in = {p.id for p in by_id(rv.adapter).patch_set.patches if p.opt_in}
            default = [pid for pid in rv.patches if pid not in opt_in]
            patches = ", ".join(default) if default else "none (every fix native; guards verified)"
            if opt_in & set(rv.patches):
                patches += "; opt-in: " + ", ".join(pid for pid in rv.patches if pid in opt_in)
            rows.append(
                {"vllm_ascend": span, "vllm": vllm, "verdict": "adapter", "adapter": rv.adapter, "patches": patches}
            )
        else:
            rows.append({"vllm_ascend": span, "vllm": vllm, "verdict": rv.verdict, "adapter": "-", "patches": rv.why})
    rows.insert(
        0,
        {
            "vllm_ascend": f"newer / unrecorded builds >= {_fmt(NATIVE_FROM)}",
            "vllm": "any",
            "verdict": "checked",
            "adapter": "-",
            "patches": "native only if every native form is recorded; else refused, naming each check",
        },
    )
    rows.append(
        {
            "vllm_ascend": "not installed",
            "vllm": "any",
            "verdict": "refused",
            "adapter": "-",
            "patches": "zb-patch is for vLLM-Ascend deployments",
        }
    )
    return rows


def module_file(root: str, module: str) -> str | None:
    base = os.path.join(root, *module.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.exists(path):
            return path
    return None


def fingerprint_in_tree(root: str, target: str, *, follow_reexports: bool = True, _depth: int = 0) -> str | None:
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
    tree = _parsed(path, os.stat(path).st_mtime_ns)
    node = find_node(tree, parts)
    fp = None if node is None else fingerprint_node(copy.deepcopy(node))  # it strips docstrings in place
    if fp is not None or not follow_reexports or _depth >= 4:
        return fp
    origin = _reexport_origin(tree, module, path.endswith("__init__.py"), parts[0])
    if origin is None:
        return None
    src_module, src_name = origin
    return fingerprint_in_tree(root, f"{src_module}:{'.'.join((src_name, *parts[1:]))}", _depth=_depth + 1)


@functools.lru_cache(maxsize=16)
def _parsed(path: str, mtime_ns: int) -> ast.Module:
    """One parse per file version: a runner module is ~4,000 lines and several targets live in it."""
    with open(path, encoding="utf-8-sig") as fh:
        return ast.parse(fh.read())


def _reexport_origin(tree: ast.Module, module: str, is_package: bool, name: str) -> tuple[str, str] | None:
    """(module, name) that a module-level ``from X import ...`` binds to ``name``, if the last module-level
    binding of ``name`` is such an import (a later def/class would win at run time)."""
    origin: tuple[str, str] | None = None
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
