"""Every recorded vllm-ascend verdict and fingerprint is reproducible from the published artifacts: each release
from 0.13.0 to the newest recorded one, its cp311 x86_64 wheel and its sdist (no build: only the Python sources are
read, nothing is imported). They are found and downloaded through this environment's own pip configuration
(``pip_index.py``: index-url, extra-index-url, find-links, proxy, cert, ...), into .cache/sources once (extracted
``vllm_ascend/**.py`` only; later runs read the cache and ask no index). ``ZB_PATCH_SOURCES_CACHE`` names another
cache folder. A file no location offers fails its tests in one line naming it and the locations pip asked.
vLLM-side targets are checked live by the va0xx envs (their wheels are 250-470 MB)."""

from __future__ import annotations

import concurrent.futures
import os

import pip_index
import pytest

from zb_patch import versions as V
from zb_patch.versions import native

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.environ.get("ZB_PATCH_SOURCES_CACHE") or os.path.join(ROOT, ".cache", "sources")
FIRST = (0, 13, 0)


def _is_first_or_later(release: str) -> bool:
    return V._release(release) > FIRST or release == "0.13.0"


RELEASES = [r for r in V.PUBLISHED if _is_first_or_later(r)]
# 0.27.1rc1 and later, and 0.23.0.post1, are published as sdists only
SDIST_ONLY = {"0.23.0.post1", "0.27.1rc1", "0.28.0rc1", "0.29.0rc1", "0.30.0rc1", "0.30.0rc2"}
ARTIFACTS = [(rel, kind) for rel in RELEASES for kind in (("sdist",) if rel in SDIST_ONLY else ("wheel", "sdist"))]


_FAILED: dict[tuple[str, str], str] = {}


def _fetch(release: str, kind: str) -> str | None:
    """The artifact's source folder, or None after recording the one-line reason it could not be fetched."""
    if (release, kind) in _FAILED:
        return None
    try:
        return pip_index.sources(release, kind, CACHE)
    except pip_index.FetchError as exc:
        _FAILED[(release, kind)] = str(exc)
        return None


def _sources(release: str, kind: str) -> str:
    """Directory holding vllm_ascend/**.py of that artifact (downloaded and extracted once); a test whose artifact
    cannot be fetched fails in one line, without a traceback."""
    root = _fetch(release, kind)
    if root is None:
        pytest.fail(_FAILED[(release, kind)], pytrace=False)
    return root


@pytest.fixture(scope="session", autouse=True)
def _prefetch():
    """Fetch the missing artifacts in parallel once (network-bound; the 2-core CI box idles meanwhile)."""
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda a: _fetch(*a), ARTIFACTS))


def test_every_published_release_from_0_13_is_covered():
    assert RELEASES[0] == "0.13.0" and RELEASES[-1] == native.RELEASES[-1]
    assert all(r in V.PUBLISHED for a in V.adapters() for r in a.releases)
    assert set(native.RELEASES) <= set(RELEASES)


@pytest.mark.parametrize("release,kind", ARTIFACTS, ids=[f"{r}-{k}" for r, k in ARTIFACTS])
def test_recorded_verdict_recomputed_from_artifact(release, kind):
    """The verdict README / `zb-patch supported` state for the release is what its own files give."""
    assert V.tree_verdict(_sources(release, kind), release) == V.release_verdict(release)


NATIVE_CASES = [(r, k) for r, k in ARTIFACTS if r in native.RELEASES]


@pytest.mark.parametrize("release,kind", NATIVE_CASES, ids=[f"{r}-{k}" for r, k in NATIVE_CASES])
def test_native_forms_are_recorded_under_their_release(release, kind):
    checks = native.check_tree(_sources(release, kind))
    for c in checks:
        assert c.matched is not None, f"{c.target} in vllm-ascend {release}: {c.fingerprint} not recorded"
        assert V.label_names(c.matched, release), f"{c.target}: {c.fingerprint} recorded under {c.matched!r}"


CASES = [(a, rel, kind) for a in V.adapters() for rel in a.releases for r, kind in ARTIFACTS if r == rel]


def test_every_adapter_names_its_releases():
    for a in V.adapters():
        assert a.releases, a.id


@pytest.mark.parametrize("adapter,release,kind", CASES, ids=[f"{a.id}@{r}-{k}" for a, r, k in CASES])
def test_recorded_fingerprints_match_pypi_sources(adapter, release, kind):
    """Every guard and patch target has, in every listed release, a recorded fingerprint (for a patch: of the
    form it replaces or, in native_fingerprints, of the form that already carries the fix) whose label names
    that release."""
    root = _sources(release, kind)
    items = [(g.target, g.fingerprints) for g in adapter.patch_set.guards] + [
        (p.target, {**p.fingerprints, **p.native_fingerprints}) for p in adapter.patch_set.patches
    ]
    checked = 0
    for target, expected in items:
        if not target.startswith("vllm_ascend."):
            continue
        fp = V.fingerprint_in_tree(root, target)
        assert fp is not None, f"{target} not found in vllm-ascend {release}"
        assert fp in expected.values(), f"{target} in vllm-ascend {release}: {fp} is not recorded ({expected})"
        labels = [label for label, v in expected.items() if v == fp]
        assert any(release.split("rc")[0].split(".post")[0] in label for label in labels), (
            f"{target}: {fp} recorded under {labels}, which do not name {release}"
        )
        checked += 1
    assert checked, f"{adapter.id} has no vllm_ascend target"


# vLLM-side advisory targets (vllm.*) are not in these artifacts: the va0xx contract tests read the installed vLLM
ADVISORY_CASES = [
    (a, adv, rel, kind)
    for a, rel, kind in CASES
    for adv in a.patch_set.advisories
    if adv.target.startswith("vllm_ascend.")
]


@pytest.mark.parametrize(
    "adapter,advisory,release,kind", ADVISORY_CASES, ids=[f"{a.id}:{adv.id}@{r}-{k}" for a, adv, r, k in ADVISORY_CASES]
)
def test_advisories_name_exactly_the_affected_releases(adapter, advisory, release, kind):
    """An advisory warns on a listed release iff one of its affected labels names that release: the target's
    fingerprint there is the recorded one, and a release no label names has none of the affected forms."""
    root = _sources(release, kind)
    fp = V.fingerprint_in_tree(root, advisory.target)
    assert fp is not None, f"{advisory.target} not found in vllm-ascend {release}"
    named = {label: v for label, v in advisory.affected.items() if V.label_names(label, release)}
    if named:
        assert fp in named.values(), f"{advisory.id}: {release} is named affected by {list(named)}, but has {fp}"
    else:
        assert fp not in advisory.affected.values(), (
            f"{advisory.id}: {release} has the affected form {fp}, but no label names it"
        )
