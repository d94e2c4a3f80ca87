"""Every vllm-ascend fingerprint recorded in the adapter table is reproducible from the PyPI artifacts of the
releases the adapter lists (wheel, or sdist when there is none): downloads them (cached under
.cache/sources), reads only the Python sources, imports nothing. vLLM-side targets are checked live by the
va0xx envs (their wheels are 250-470 MB each)."""

from __future__ import annotations

import io
import os
import re
import tarfile
import urllib.request
import zipfile

import pytest

from zb_patch import versions as V

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.path.join(ROOT, ".cache", "sources")


def _index() -> list[tuple[str, str]]:
    """(filename, url) of every vllm-ascend file on PyPI's simple index (it lists rc files too)."""
    global _INDEX
    if _INDEX is None:
        with urllib.request.urlopen("https://pypi.org/simple/vllm-ascend/", timeout=60) as r:
            html = r.read().decode()
        _INDEX = [(m.group(2), m.group(1)) for m in re.finditer(r'href="([^"#]+/([^/"#]+))(?:#[^"]*)?"', html)]
    return _INDEX


_INDEX = None


def _artifact(version: str) -> tuple[str, str]:
    files = _index()
    wheel = f"vllm_ascend-{version}-cp311-cp311-manylinux"
    wheels = [(u, n) for n, u in files if n.startswith(wheel) and n.endswith("x86_64.whl")]
    sdists = [(u, n) for n, u in files if n == f"vllm_ascend-{version}.tar.gz"]
    pick = (wheels or sdists or [None])[0]
    if pick is None:
        raise AssertionError(f"PyPI has no cp311 x86_64 wheel nor sdist for vllm-ascend {version}")
    return pick


def _sources(version: str) -> str:
    """Directory holding vllm_ascend/**.py of that release."""
    dest = os.path.join(CACHE, f"vllm_ascend-{version}")
    if os.path.isdir(os.path.join(dest, "vllm_ascend")):
        return dest
    url, name = _artifact(version)
    with urllib.request.urlopen(url, timeout=300) as r:
        data = r.read()
    os.makedirs(dest, exist_ok=True)
    if name.endswith(".whl"):
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            for member in z.namelist():
                if member.startswith("vllm_ascend/") and member.endswith(".py"):
                    z.extract(member, dest)
    else:
        with tarfile.open(fileobj=io.BytesIO(data)) as t:
            for member in t.getmembers():
                parts = member.name.split("/", 1)
                if len(parts) == 2 and parts[1].startswith("vllm_ascend/") and parts[1].endswith(".py"):
                    member.name = parts[1]
                    t.extract(member, dest)
    return dest


CASES = [(a, rel) for a in V.adapters() for rel in a.releases]


def test_every_adapter_names_its_releases():
    for a in V.adapters():
        assert a.releases, a.id


_VERSION = re.compile(r"\d+\.\d+\.\d+(?:rc\d+)?(?:\.post\d+)?")


def _named(release: str, label: str) -> bool:
    """The label names this exact release ("0.23.0" is not named by "0.23.0rc1" nor by "0.23.0.post1")."""
    return release in _VERSION.findall(label)


@pytest.mark.parametrize("adapter,release", CASES, ids=[f"{a.id}@{r}" for a, r in CASES])
def test_recorded_fingerprints_match_pypi_sources(adapter, release):
    """Every guard and patch target has, in every listed release, a recorded fingerprint (for a patch: of the
    form it replaces or, in native_fingerprints, of the form that already carries the fix) whose label names
    that release."""
    root = _sources(release)
    items = [(g.target, g.fingerprints) for g in adapter.patch_set.guards] + \
            [(p.target, {**p.fingerprints, **p.native_fingerprints}) for p in adapter.patch_set.patches]
    checked = 0
    for target, expected in items:
        if not target.startswith("vllm_ascend."):
            continue
        fp = V.fingerprint_in_tree(root, target)
        assert fp is not None, f"{target} not found in vllm-ascend {release}"
        assert fp in expected.values(), f"{target} in vllm-ascend {release}: {fp} is not recorded ({expected})"
        labels = [label for label, v in expected.items() if v == fp]
        assert any(release.split("rc")[0].split(".post")[0] in label for label in labels), \
            f"{target}: {fp} recorded under {labels}, which do not name {release}"
        checked += 1
    assert checked, f"{adapter.id} has no vllm_ascend target"


ADVISORY_CASES = [(a, adv, rel) for a in V.adapters() for adv in a.patch_set.advisories for rel in a.releases]


@pytest.mark.parametrize("adapter,advisory,release", ADVISORY_CASES,
                         ids=[f"{a.id}:{adv.id}@{r}" for a, adv, r in ADVISORY_CASES])
def test_advisories_name_exactly_the_affected_releases(adapter, advisory, release):
    """An advisory warns on a listed release iff one of its affected labels names that release: the target's
    fingerprint there is the recorded one, and a release no label names has none of the affected forms."""
    root = _sources(release)
    fp = V.fingerprint_in_tree(root, advisory.target)
    assert fp is not None, f"{advisory.target} not found in vllm-ascend {release}"
    named = {label: v for label, v in advisory.affected.items() if _named(release, label)}
    if named:
        assert fp in named.values(), f"{advisory.id}: {release} is named affected by {list(named)}, but has {fp}"
    else:
        assert fp not in advisory.affected.values(), \
            f"{advisory.id}: {release} has the affected form {fp}, but no label names it"
