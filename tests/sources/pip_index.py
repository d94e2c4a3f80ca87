"""Find and download vllm-ascend release files through this environment's own pip configuration.

Where files come from is what ``pip download`` would use here: ``index-url``, ``extra-index-url``, ``find-links``,
``no-index``, ``proxy``, ``cert``, ``client-cert``, ``trusted-host``, ``timeout`` and ``retries`` from the pip.conf
files, ``PIP_CONFIG_FILE`` and the ``PIP_*`` variables (``pip config list`` shows them), and pip's own default index
where none is set. No index is named in this file: pip reads its configuration and lists the files itself, with its
``download`` command's option parser, HTTP session and package finder (PEP 503 HTML and PEP 691 JSON pages,
``file://`` indexes, find-links folders, netrc / keyring credentials). Constraint files play no part (nothing is
resolved), and an sdist is only downloaded and unpacked, never built. The wheel is picked by its name (CPython 3.11,
manylinux, x86_64) on whatever platform runs this.

This uses ``pip._internal``, which is not a public API: ``requirements/sources.txt`` pins pip for ``tox -e sources``,
and ``test_pip_index.py`` runs every call made here against a local index, so a pip bump that changes them fails there.

Command line, for reading a release's files by hand (``docs/releases/native.md``)::

    python tests/sources/pip_index.py --where                      # the locations pip asks, one per line
    python tests/sources/pip_index.py --list [VERSION...]          # the files they list, upload time, hash
    python tests/sources/pip_index.py [--kind sdist|wheel] [-d DIR] VERSION...   # download, hash checked
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import sys
import tarfile
import threading
import zipfile
from collections.abc import Callable
from typing import Any

PROJECT = "vllm-ascend"
KINDS = ("wheel", "sdist")
WHAT = {"wheel": "cp311 manylinux x86_64 wheel", "sdist": "sdist"}
# every manylinux tag an x86_64 wheel may carry: pip keeps only wheels whose tags match its target, and it expands
# neither manylinux_2_N nor the running platform into these (the check must not depend on the machine running it)
_PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(60, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]


class FetchError(Exception):
    """A file could not be found or downloaded. ``str()`` is one line: what, and which locations pip asked."""


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def is_artifact(filename: str, version: str, kind: str) -> bool:
    """Whether ``filename`` is the release's cp311 manylinux x86_64 wheel, or its sdist."""
    if kind == "wheel":
        return (
            filename.startswith(f"vllm_ascend-{version}-cp311-cp311-")
            and "manylinux" in filename
            and filename.endswith("x86_64.whl")
        )
    return filename in (f"vllm_ascend-{version}.tar.gz", f"vllm-ascend-{version}.tar.gz")


class _Complaints(logging.Handler):
    """Collects why pip skipped a location (it logs that and goes on), for the one-line failure."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if record.levelno >= logging.WARNING or msg.startswith("Could not fetch URL"):
            self.lines.append(_one_line(msg)[:300])


class PipIndex:
    """pip's package locations for this environment, read once when the object is made (as ``pip download`` reads
    them: config files, then ``PIP_*`` variables). ``locations`` names them (credentials redacted)."""

    def __init__(self) -> None:
        try:
            from pip._internal.commands import create_command
            from pip._internal.models.format_control import FormatControl
            from pip._internal.models.target_python import TargetPython
            from pip._internal.utils.misc import redact_auth_from_url
        except ImportError as exc:
            raise FetchError(f"pip is needed to find {PROJECT} files ({exc}); tox -e sources installs it") from None
        cmd = create_command("download")
        try:
            options, _ = cmd.parse_args([])  # applies pip.conf, PIP_CONFIG_FILE and PIP_* exactly as pip does
        except SystemExit:  # pip's option parser exits on a bad value, after printing why
            raise FetchError("pip rejected its configuration (see above; `pip config list` shows it)") from None
        options.cache_dir = None  # .cache/sources is the cache: no second copy of every wheel in pip's HTTP cache
        options.no_input = True  # never wait for a password on stdin
        options.format_control = FormatControl(set(), set())  # both kinds, whatever only-binary / no-binary say
        self._session = cmd._build_session(options)
        target = TargetPython(platforms=_PLATFORMS, py_version_info=(3, 11), abis=["cp311"], implementation="cp")
        self._finder = cmd._build_package_finder(
            options, self._session, target_python=target, ignore_requires_python=True
        )
        where = [("index", u) for u in self._finder.index_urls] + [("find-links", u) for u in self._finder.find_links]
        if options.proxy:
            where.append(("proxy", options.proxy))
        self.where: list[str] = [f"{k} {redact_auth_from_url(u)}" for k, u in where] or ["no index and no find-links"]
        self.locations = ", ".join(self.where)
        self._lock = threading.Lock()
        self._links: list[Any] | None = None
        self._complaints: list[str] = []

    def links(self) -> list[Any]:
        """Every vllm-ascend file pip's locations list (pip ``Link`` objects; find-links first, then the indexes in
        order); asked once, whatever the number of threads asking."""
        with self._lock:
            if self._links is None:
                self._links = self._list()
            return self._links

    def _list(self) -> list[Any]:
        handler = _Complaints()
        log = logging.getLogger("pip._internal")
        saved = log.level, log.propagate
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)  # pip says why it skipped an index at DEBUG
        log.propagate = False  # ... and nobody else needs those lines: the failure message carries them
        try:
            return [c.link for c in self._finder.find_all_candidates(PROJECT)]
        except Exception as exc:  # pip skips an unreachable location itself; anything else is reported the same way
            handler.lines.append(_one_line(f"{type(exc).__name__}: {exc}")[:300])
            return []
        finally:
            log.removeHandler(handler)
            log.setLevel(saved[0])
            log.propagate = saved[1]
            self._complaints = list(dict.fromkeys(handler.lines))

    def find(self, version: str, kind: str) -> Any:
        """The ``Link`` of the release's wheel or sdist, or :class:`FetchError`."""
        for link in self.links():
            if is_artifact(link.filename, version, kind):
                return link
        said = f"; pip: {' | '.join(self._complaints)}" if self._complaints else ""
        raise FetchError(f"cannot fetch {PROJECT} {version} {WHAT[kind]}: not listed by {self.locations}{said}")

    def download(self, link: Any, path: str, what: str) -> None:
        """Download ``link`` to ``path`` through pip's session (proxy, cert, credentials; ``file://`` too) and check
        the hash the index gave for it."""
        from pip._internal.utils.misc import redact_auth_from_url

        url = link.url_without_fragment
        try:
            digest = hashlib.new(link.hash_name) if link.hash_name in hashlib.algorithms_available else None
            with self._session.get(url, headers={"Accept-Encoding": "identity"}, stream=True) as resp:
                resp.raise_for_status()
                with open(path, "wb") as out:
                    for chunk in resp.iter_content(1 << 20):
                        out.write(chunk)
                        if digest:
                            digest.update(chunk)
        except Exception as exc:
            raise FetchError(
                f"cannot fetch {what}: downloading {redact_auth_from_url(url)} failed: {_one_line(exc)}"
            ) from None
        if digest and digest.hexdigest() != link.hash:
            raise FetchError(
                f"cannot fetch {what}: {redact_auth_from_url(url)} has {link.hash_name} {digest.hexdigest()}, "
                f"the index lists {link.hash}"
            )


_SHARED: PipIndex | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> PipIndex:
    """One :class:`PipIndex` for the whole process, made on first use (threads share it)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = PipIndex()
        return _SHARED


def _member(name: str) -> bool:
    return name.startswith("vllm_ascend/") and name.endswith(".py") and ".." not in name.split("/")


def _write(root: str, name: str, data: bytes) -> None:
    path = os.path.join(root, *name.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def extract(archive: str, into: str) -> None:
    """Write the ``vllm_ascend/**.py`` files of a wheel (at its root) or an sdist (under its one top folder) under
    ``into``; nothing else, nothing run."""
    if archive.endswith(".whl"):
        with zipfile.ZipFile(archive) as z:
            for name in z.namelist():
                if _member(name):
                    _write(into, name, z.read(name))
        return
    with tarfile.open(archive) as t:
        for m in t.getmembers():
            parts = m.name.split("/", 1)
            if m.isfile() and len(parts) == 2 and _member(parts[1]):
                f = t.extractfile(m)
                assert f is not None
                _write(into, parts[1], f.read())


def sources(version: str, kind: str, cache: str, index: Callable[[], PipIndex] = shared) -> str:
    """The folder holding ``vllm_ascend/**.py`` of the release's wheel or sdist: ``<cache>/vllm_ascend-<v>-<kind>``,
    downloaded and extracted on first use (``index()`` is only called then), later read as it is. A killed or failed
    fetch leaves only ``<folder>.part``, which never counts as cached. Raises :class:`FetchError`."""
    dest = os.path.join(cache, f"vllm_ascend-{version}-{kind}")
    if os.path.isdir(os.path.join(dest, "vllm_ascend")):
        return dest
    idx = index()
    link = idx.find(version, kind)
    what = f"{PROJECT} {version} {WHAT[kind]}"
    tmp = dest + ".part"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        archive = os.path.join(tmp, link.filename)
        idx.download(link, archive, what)
        try:
            extract(archive, tmp)
        except (OSError, zipfile.BadZipFile, tarfile.TarError) as exc:
            raise FetchError(f"cannot read {what} ({link.filename}): {_one_line(exc)}") from None
        os.remove(archive)
        if not os.path.isdir(os.path.join(tmp, "vllm_ascend")):
            raise FetchError(f"cannot read {what}: {link.filename} holds no vllm_ascend/**.py")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, dest)  # a killed download never leaves a half tree that looks cached
    return dest


def _of_release(filename: str, version: str) -> bool:
    return filename.startswith((f"vllm_ascend-{version}-", f"vllm-ascend-{version}-")) or is_artifact(
        filename, version, "sdist"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=f"Find and download {PROJECT} release files through this environment's pip configuration "
        "(`pip config list`). An sdist is downloaded, never built; the hash the index lists is checked."
    )
    parser.add_argument("versions", nargs="*", metavar="VERSION", help="release, e.g. 0.26.0rc1")
    parser.add_argument("--kind", choices=KINDS, default="sdist", help="sdist (default) or cp311 x86_64 wheel")
    parser.add_argument("-d", "--dest", default=".", help="folder to download into (default: .)")
    parser.add_argument("--where", action="store_true", help="print the locations pip asks, one per line")
    parser.add_argument(
        "--list",
        action="store_true",
        help="download nothing: print the sdists and cp311 x86_64 wheels of the VERSIONs (of every release if none) "
        "the locations list, with the upload time where the index gives one (PEP 700) and the hash",
    )
    args = parser.parse_args(argv)
    try:
        idx = PipIndex()
        if args.where:
            print("\n".join(idx.where))
        if args.list:
            for link in idx.links():
                if not args.versions or any(_of_release(link.filename, v) for v in args.versions):
                    when = link.upload_time.isoformat() if getattr(link, "upload_time", None) else "-"
                    print(f"{link.filename}  {when}  {link.hash_name or '-'}:{link.hash or '-'}")
            return 0
        for version in args.versions:
            link = idx.find(version, args.kind)
            path = os.path.join(args.dest, link.filename)
            os.makedirs(args.dest, exist_ok=True)
            idx.download(link, path, f"{PROJECT} {version} {WHAT[args.kind]}")
            print(path)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
