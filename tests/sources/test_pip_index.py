"""pip_index.py against local indexes, no network: a fake vllm-ascend release (a wheel and an sdist made here) served
as a PEP 503 folder through a file:// ``PIP_INDEX_URL``, or as a find-links folder named in a ``PIP_CONFIG_FILE``;
and what an unreachable index or a wrong file gives: one line naming the release file and the locations pip asked.
Every pip call pip_index.py makes runs here (pip is pinned in requirements/sources.txt; a bump is checked here)."""

from __future__ import annotations

import hashlib
import io
import os
import socket
import subprocess
import sys
import tarfile
import zipfile

import pip_index
import pytest

VERSION = "0.0.1"
WHEEL = f"vllm_ascend-{VERSION}-cp311-cp311-manylinux_2_24_x86_64.whl"
DECOY = f"vllm_ascend-{VERSION}-cp311-cp311-manylinux_2_24_aarch64.whl"  # same release, another platform
SDIST = f"vllm_ascend-{VERSION}.tar.gz"
TREE = {"vllm_ascend/__init__.py", "vllm_ascend/x.py", "vllm_ascend/sub/y.py"}


def _wheel(path: str, marker: str) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name in TREE:
            z.writestr(name, f"# {marker} {name}\n")
        z.writestr("vllm_ascend/table.json", "{}")  # not .py: not extracted
        z.writestr(f"vllm_ascend-{VERSION}.dist-info/METADATA", "Name: vllm-ascend\n")


def _sdist(path: str) -> None:
    top = f"vllm_ascend-{VERSION}"
    files = {f"{top}/{name}": f"# sdist {name}\n" for name in TREE}
    files[f"{top}/setup.py"] = "raise SystemExit('an sdist must not be built')\n"
    files[f"{top}/PKG-INFO"] = f"Name: vllm-ascend\nVersion: {VERSION}\n"
    with tarfile.open(path, "w:gz") as t:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


@pytest.fixture
def files(tmp_path) -> str:
    """A folder with the fake release's files (the cp311 x86_64 wheel, an aarch64 decoy and the sdist)."""
    d = tmp_path / "files"
    d.mkdir()
    _wheel(str(d / WHEEL), "wheel")
    _wheel(str(d / DECOY), "decoy")
    _sdist(str(d / SDIST))
    return str(d)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _simple_index(root, files: str, sha256: dict[str, str] | None = None) -> str:
    """A PEP 503 folder beside ``files`` (``root/files``) listing them by relative links (``#sha256=`` from
    ``sha256``, else the real hash); returns its file:// URL."""
    page = root / "simple" / "vllm-ascend"
    page.mkdir(parents=True)
    links = []
    for name in sorted(os.listdir(files)):
        digest = (sha256 or {}).get(name) or _sha256(os.path.join(files, name))
        links.append(f'<a href="../../files/{name}#sha256={digest}">{name}</a><br>')
    (page / "index.html").write_text("<!DOCTYPE html><html><body>\n" + "\n".join(links) + "\n</body></html>\n")
    return (root / "simple").as_uri()


@pytest.fixture
def pip_env(monkeypatch):
    """No pip configuration but what a test sets: no config file, no PIP_* variable, no proxy; no retries."""
    for name in list(os.environ):
        if name.startswith("PIP_") or name.lower() in ("http_proxy", "https_proxy", "all_proxy"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")
    return monkeypatch


def _tree(root: str) -> dict[str, str]:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            path = os.path.join(d, n)
            with open(path) as f:
                out[os.path.relpath(path, root).replace(os.sep, "/")] = f.read()
    return out


def _assert_fetched(root: str, kind: str, cache: str) -> None:
    marker = "wheel" if kind == "wheel" else "sdist"
    assert root == os.path.join(cache, f"vllm_ascend-{VERSION}-{kind}")
    assert _tree(root) == {name: f"# {marker} {name}\n" for name in TREE}  # .py under vllm_ascend/ only
    assert not [n for n in os.listdir(cache) if n.endswith(".part")]  # nothing half-done left beside it


def _no_index():
    raise AssertionError("a cached artifact must not ask any index")


def test_local_simple_index_via_pip_index_url(tmp_path, files, pip_env):
    """A file:// PEP 503 index named by PIP_INDEX_URL: the cp311 x86_64 wheel (not the aarch64 one) and the sdist
    are downloaded, their hashes checked, and only vllm_ascend/**.py extracted; a second call reads the cache."""
    url = _simple_index(tmp_path, files)
    pip_env.setenv("PIP_INDEX_URL", url)
    idx = pip_index.PipIndex()
    assert idx.where == [f"index {url}"]
    cache = str(tmp_path / "cache")
    for kind in ("wheel", "sdist"):
        _assert_fetched(pip_index.sources(VERSION, kind, cache, lambda: idx), kind, cache)
        _assert_fetched(pip_index.sources(VERSION, kind, cache, _no_index), kind, cache)
    assert sorted(os.listdir(cache)) == [f"vllm_ascend-{VERSION}-sdist", f"vllm_ascend-{VERSION}-wheel"]


def test_local_find_links_folder_via_pip_config_file(tmp_path, files, pip_env):
    """A find-links folder named in the pip.conf that PIP_CONFIG_FILE points at (no-index there too, so the machine's
    own config files add no index)."""
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nno-index = true\nfind-links = {files}\n")
    pip_env.setenv("PIP_CONFIG_FILE", str(conf))
    idx = pip_index.PipIndex()
    assert idx.where == [f"find-links {files}"]
    cache = str(tmp_path / "cache")
    for kind in ("wheel", "sdist"):
        _assert_fetched(pip_index.sources(VERSION, kind, cache, lambda: idx), kind, cache)


def test_default_index_is_pips_own(pip_env):
    """With nothing configured, the index asked is pip's built-in default (read from pip, not written here)."""
    from pip._internal.models.index import PyPI

    assert pip_index.PipIndex().where == [f"index {PyPI.simple_url}"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("where", ["http", "file"])
def test_unreachable_index_fails_in_one_line_naming_it(tmp_path, pip_env, where):
    """An index that cannot be reached (a closed local port, a missing folder): FetchError in one line naming the
    release file and the index, with pip's reason."""
    url = f"http://127.0.0.1:{_closed_port()}/simple" if where == "http" else (tmp_path / "no-such").as_uri()
    pip_env.setenv("PIP_INDEX_URL", url)
    with pytest.raises(pip_index.FetchError) as e:
        pip_index.sources(VERSION, "wheel", str(tmp_path / "cache"), pip_index.PipIndex)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"cannot fetch vllm-ascend {VERSION} cp311 manylinux x86_64 wheel: not listed by index {url}")
    assert "; pip: " in msg  # why pip skipped it
    assert not os.path.exists(tmp_path / "cache" / f"vllm_ascend-{VERSION}-wheel")


def test_hash_mismatch_fails_in_one_line(tmp_path, files, pip_env):
    """A file whose bytes are not the ones the index lists is not cached."""
    pip_env.setenv("PIP_INDEX_URL", _simple_index(tmp_path, files, sha256={SDIST: "0" * 64}))
    cache = tmp_path / "cache"
    with pytest.raises(pip_index.FetchError) as e:
        pip_index.sources(VERSION, "sdist", str(cache), pip_index.PipIndex)
    assert "\n" not in str(e.value) and f"the index lists {'0' * 64}" in str(e.value)
    assert os.listdir(cache) == []


def test_unfetchable_artifact_fails_its_test_in_one_line(tmp_path):
    """tests/sources itself, with an empty cache and an unreachable index: the test of a release fails with the one
    line, no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    url = f"http://127.0.0.1:{_closed_port()}/simple"
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_INDEX_URL=url,
        PIP_RETRIES="0",
        ZB_PATCH_SOURCES_CACHE=str(tmp_path / "cache"),
    )
    test = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_recorded_fingerprints.py")
    sel = "test_recorded_verdict_recomputed_from_artifact and 0.13.0-wheel"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", sel, test],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout
    assert run.returncode == 1 and "1 failed" in out, out + run.stderr
    failure = out.split("= FAILURES =")[1].split("short test summary")[0]
    lines = [line for line in failure.splitlines() if line.strip() and not line.startswith(("_", "="))]  # no rules
    want = f"cannot fetch vllm-ascend 0.13.0 cp311 manylinux x86_64 wheel: not listed by index {url}; pip: "
    assert len(lines) == 1 and lines[0].startswith(want), out


def test_command_line_lists_and_downloads_from_local_index(tmp_path, files, pip_env, capsys):
    """The command the release notes use: --where, --list (no download), then a download checked against the index."""
    url = _simple_index(tmp_path, files)
    pip_env.setenv("PIP_INDEX_URL", url)
    assert pip_index.main(["--where", "--list", VERSION]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0] == f"index {url}"
    assert sorted(line.split()[0] for line in listed[1:]) == sorted([SDIST, WHEEL])  # no aarch64 wheel
    out = tmp_path / "out"
    assert pip_index.main(["-d", str(out), VERSION]) == 0
    assert os.listdir(out) == [SDIST] and _sha256(str(out / SDIST)) == _sha256(os.path.join(files, SDIST))
    assert pip_index.main(["-d", str(out), "9.9.9"]) == 1
    assert capsys.readouterr().err.startswith("error: cannot fetch vllm-ascend 9.9.9 sdist: not listed by index ")
