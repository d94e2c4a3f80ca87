"""Contract of the adapter table against the REAL vLLM + vllm-ascend of this tox env (NPU runtime stand-in
only for torch_npu & co, see tests/support/npu_standin): the right adapter is selected, every target resolves
in the real upstream module, every fingerprint matches, apply + unpatch restore identity, the other families
are refused."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import types

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
import installed_release  # noqa: E402  (tests/support)
from npu_standin.ascend_imports import import_worker_modules  # noqa: E402
from zb_patch import registry as R  # noqa: E402
from zb_patch import versions as V  # noqa: E402
from zb_patch.detect import detect  # noqa: E402
from zb_patch.registry import Patch, PatchSet  # noqa: E402

# vllm-ascend family installed in this env -> the adapter that must be selected (None = refused)
EXPECTED = {"0.11": None, "0.13": "ascend-0.13", "0.18": "ascend-0.18", "0.23": "ascend-0.19-0.25"}

FAMILY = npu_standin.detect_family()
if FAMILY is None:
    pytest.skip(
        "vllm-ascend is not installed in this env (contract tests need a va0xx tox env)", allow_module_level=True
    )


@pytest.fixture(scope="module")
def worker_modules():
    return import_worker_modules()


@pytest.fixture(scope="module")
def versions():
    return detect()


@pytest.fixture(scope="module")
def selected(versions):
    return V.select(versions)


def test_selection_for_this_env(selected, versions):
    expected = EXPECTED[FAMILY]
    if expected is None:
        assert selected.verdict == V.REFUSED, selected.reason
        assert versions.vllm_ascend.raw in selected.reason and "older than 0.13" in selected.reason
    else:
        assert selected.verdict == V.SELECTED, selected.reason
        assert selected.adapter.id == expected


def _own_adapter():
    return V.by_id(EXPECTED[FAMILY]) if EXPECTED[FAMILY] else None


def _items(adapter):
    # a patch target must have either a form the patch replaces or a form that already carries the fix
    return [("guard", g.target, g.fingerprints) for g in adapter.patch_set.guards] + [
        ("patch", p.target, {**p.fingerprints, **p.native_fingerprints}) for p in adapter.patch_set.patches
    ]


OWN = _own_adapter()
# the adapter as it applies to what is installed: on a recorded commit form, without the parts refused there
OWN_HERE = OWN.for_form(installed_release.COMMIT_FORM) if OWN and installed_release.COMMIT_FORM else OWN
OWN_ITEMS = _items(OWN_HERE) if OWN_HERE else []


@pytest.mark.skipif(OWN is None, reason=f"vllm-ascend {FAMILY} has no adapter: it must be refused (tested below)")
@pytest.mark.parametrize("kind,target,expected", OWN_ITEMS, ids=[t for _, t, _ in OWN_ITEMS] or None)
def test_target_resolves_and_fingerprint_matches(worker_modules, kind, target, expected):
    res = R.resolve(target)
    assert res.found, res.reason
    assert res.patched_by is None, "a contract test left a patch behind"
    label, why = R.check_fingerprint(res, expected)
    assert label is not None, why


OWN_ADVISORIES = list(OWN.patch_set.advisories) if OWN else []


@pytest.mark.skipif(not OWN_ADVISORIES, reason="the adapter has no advisories")
@pytest.mark.parametrize("advisory", OWN_ADVISORIES, ids=[a.id for a in OWN_ADVISORIES] or None)
def test_advisory_target_resolves(worker_modules, advisory):
    """An advisory whose target cannot be resolved would stay silent: its target must exist here."""
    res = R.resolve(advisory.target)
    assert res.found and res.fingerprint, res.reason


@pytest.mark.skipif(OWN is None, reason=f"vllm-ascend {FAMILY} has no adapter: it must be refused (tested below)")
def test_adapter_verifies_ok(worker_modules, versions):
    report, _ = OWN_HERE.patch_set.verify(versions)
    assert report.verdict == R.OK, report.reason


OWN_COMMITS = list(OWN.commits) if OWN else []


@pytest.mark.skipif(not OWN_COMMITS, reason="the adapter records no commit form")
@pytest.mark.parametrize("form", OWN_COMMITS, ids=[f.short for f in OWN_COMMITS] or None)
def test_a_version_naming_a_commit_form_selects_its_patch_set(worker_modules, versions, form):
    """A version naming a recorded commit (what a setuptools-scm build of it reports) selects that form, with the
    patches refused there left out; the kept set verifies against the real installed code (the tag's: the commit's
    own tree is checked by tests/sources/test_commit_forms.py) and names no patch the form refuses."""
    import dataclasses

    from zb_patch.detect import parse

    claimed = dataclasses.replace(versions, vllm_ascend=parse("vllm_ascend", form.reports, "vllm-ascend"))
    sel = V.select(claimed)
    assert sel.verdict == V.SELECTED and sel.form == form, sel.reason
    kept = {p.id for p in sel.adapter.patch_set.patches}
    assert not kept & set(OWN.refused_on(form))
    report, _ = sel.adapter.patch_set.verify(versions)
    assert report.verdict == R.OK, report.reason


def _passthrough(orig):
    assert isinstance(orig, types.FunctionType), f"unexpected target type {type(orig)}"

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        return orig(*args, **kwargs)

    return wrapper


@pytest.mark.skipif(OWN is None, reason=f"vllm-ascend {FAMILY} has no adapter: it must be refused (tested below)")
def test_apply_and_unpatch_every_real_target_restores_identity(worker_modules):
    """Every target of the adapter (guards included; a target both guarded and patched once) can be replaced and
    restored exactly, on the real classes."""
    targets: dict[str, dict[str, str]] = {}
    for _, t, fps in OWN_ITEMS:
        targets.setdefault(t, {}).update(fps)
    originals = {t: R.resolve(t).raw for t in targets}
    patches = [
        Patch(
            id=f"contract-{i}",
            target=t,
            make=_passthrough,
            fingerprints=fps,
            why="contract",
            upstream=("-",),
            remove_when="-",
            rests_on=R.RestsOn(R.HOST, "the contract test's pass-through"),
        )
        for i, (t, fps) in enumerate(targets.items())
    ]
    ps = PatchSet("contract", patches)
    report = ps.apply()
    try:
        assert report.verdict == R.APPLIED, report.reason
        for t, orig in originals.items():
            live = R.resolve(t)
            assert live.raw is not orig and live.original is orig and live.patched_by
            assert live.fingerprint == R.fingerprint_object(orig)  # fingerprint sees through the wrapper
    finally:
        restored = ps.unpatch()
    assert len(restored) == len(patches)
    for t, orig in originals.items():
        assert R.resolve(t).raw is orig, t


OTHERS = [a for a in V.adapters() if a.id != EXPECTED[FAMILY]]


@pytest.mark.parametrize("adapter", OTHERS, ids=[a.id for a in OTHERS])
def test_other_families_are_refused(worker_modules, versions, adapter):
    report, _ = adapter.patch_set.verify(versions)
    assert report.verdict == R.REFUSED, f"{adapter.id} unexpectedly verifies against vllm-ascend {FAMILY}"
    assert "fingerprint mismatch" in report.reason or "not found" in report.reason or "not defined" in report.reason


def _doctor(env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZB_PATCH")}
    env.update(env_extra)
    r = subprocess.run(
        [sys.executable, "-m", "npu_standin", "zb_patch.cli", "doctor", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.stdout.strip(), r.stderr
    return r.returncode, json.loads(r.stdout[r.stdout.index("{") :])


def test_doctor_with_zb_patch_on():
    code, data = _doctor({"ZB_PATCH": "1"})
    assert data["schema"] == "zb-patch-doctor/1"
    assert data["versions"]["vllm_ascend"]["installed"]
    assert data["plugin"]["visible"] and data["plugin"]["loaded_by_vllm"]
    if EXPECTED[FAMILY] is None:
        assert (code, data["verdict"]) == (2, "refused"), data["reason"]
        assert "older than 0.13" in data["reason"]
    else:
        assert (code, data["verdict"], data["adapter"]) == (0, "apply", EXPECTED[FAMILY]), data["reason"]
        items = data["adapters"][0]["items"]
        assert items and all(i["found"] and i["fingerprint_ok"] for i in items if i["kind"] != "advisory")
        assert all(i["found"] for i in items)
