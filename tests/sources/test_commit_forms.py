"""Every recorded commit form (``Adapter.commits``) recomputed from the archived source tree of its commit: the
``git archive`` of the maintenance-branch head, kept in the ``shared`` folder beside the clone
(``$(git rev-parse --show-toplevel)/../shared/upstream/vllm-ascend/``, read-only). Only the ``vllm_ascend/**.py`` files
are read, nothing is imported. Where that folder is absent the tests skip and say so (a skip is not a pass); where it
is present, a missing archive fails."""

from __future__ import annotations

import os
import tarfile

import pytest
from install_commit import ARCHIVES, SHARED, archive_path  # tests/sources/install_commit.py

from zb_patch import versions as V

CASES = [(a, form) for a in V.adapters() for form in a.commits]


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """commit -> folder holding the archive's vllm_ascend/**.py (extracted once per session)."""
    if not os.path.isdir(SHARED):
        pytest.skip(f"no shared folder beside the clone ({SHARED}): the commit forms' archives cannot be read here")
    out: dict[str, str] = {}

    def get(form: V.Form) -> str:
        if form.ref in out:
            return out[form.ref]
        path = archive_path(form)
        assert os.path.isfile(path), f"{form.text}: archive {os.path.basename(path)} missing from {ARCHIVES}"
        root = str(tmp_path_factory.mktemp(form.short))
        with tarfile.open(path) as t:
            # git archive records the commit in the pax global header
            assert t.pax_headers.get("comment") == form.ref, f"{path} is not commit {form.ref}"
            for m in t.getmembers():
                parts = m.name.split("/", 1)
                if m.isfile() and len(parts) == 2 and parts[1].startswith("vllm_ascend/") and parts[1].endswith(".py"):
                    if ".." in parts[1].split("/"):
                        continue
                    dest = os.path.join(root, *parts[1].split("/"))
                    os.makedirs(os.path.dirname(dest), exist_ok=True)
                    f = t.extractfile(m)
                    assert f is not None
                    with open(dest, "wb") as fh:
                        fh.write(f.read())
        out[form.ref] = root
        return root

    return get


def test_every_commit_form_has_an_archive_case():
    assert CASES, "no adapter records a commit form"


@pytest.mark.parametrize("adapter,form", CASES, ids=[f"{a.id}@{f.short}" for a, f in CASES])
def test_commit_form_fingerprints_recomputed_from_the_archive(trees, adapter, form):
    root = trees(form)
    targets = sorted({t for _, t in V.item_ids(adapter) if t.startswith("vllm_ascend.")})
    found = {t: V.fingerprint_in_tree(root, t) for t in targets}
    # a vLLM target the commit's vllm-ascend replaces at import: the fingerprint of the function it installs
    found.update({t: V.fingerprint_in_tree(root, installed) for t, installed in form.replaced.items()})
    wrong = {t: (fp, form.fingerprints.get(t)) for t, fp in found.items() if fp != form.fingerprints.get(t)}
    assert not wrong, f"{form.text}: (archive, recorded) differ for {wrong}"


@pytest.mark.parametrize("adapter,form", CASES, ids=[f"{a.id}@{f.short}" for a, f in CASES])
def test_commit_form_verdict_recomputed_from_the_archive(trees, adapter, form):
    """What the archive's code gets, as verification would decide it: with the commit recognised, every kept target is
    accepted (replaced or native); with no recorded form (the whole adapter), a refused part's target is unknown, so
    the adapter is refused (fail closed)."""
    root = trees(form)
    kept = adapter.for_form(form)
    applied, native_ids, refused = V.commit_patches(adapter, form)
    seen_applied, seen_native = [], []
    for target, needs, has, pid in [(g.target, g.fingerprints, {}, None) for g in kept.patch_set.guards] + [
        (p.target, p.fingerprints, p.native_fingerprints, p.id) for p in kept.patch_set.patches
    ]:
        if not target.startswith("vllm_ascend."):
            if pid and any(V.label_names(lb, V._pinned_vllm(form.release)) for lb in needs):
                seen_applied.append(pid)
            continue
        fp = V.fingerprint_in_tree(root, target)
        assert fp in (*needs.values(), *has.values()), f"{form.text}: {target} {fp} not accepted"
        if pid:
            (seen_native if fp in has.values() else seen_applied).append(pid)
    assert (tuple(seen_applied), tuple(seen_native)) == (applied, native_ids)
    if refused:
        whole = {
            p.target: {**p.fingerprints, **p.native_fingerprints} for p in adapter.patch_set.patches if p.id in refused
        }
        unknown = [t for t, fps in whole.items() if V.fingerprint_in_tree(root, t) not in fps.values()]
        assert unknown, f"{form.text}: a build that names no form would get the refused parts"


@pytest.mark.parametrize("adapter,form", CASES, ids=[f"{a.id}@{f.short}" for a, f in CASES])
def test_fingerprints_command_on_the_archive_names_each_decision(trees, adapter, form, capsys):
    """`zb-patch fingerprints` on the commit's tree: an accepted item is recorded under the commit's label, a refused
    one is NEW and says it is refused on the commit, every other one is recorded under the tag's release."""
    from zb_patch.cli import main

    root = trees(form)
    main(["fingerprints", "--root", root, "--adapter", adapter.id, "--only", "vllm_ascend"])
    lines = capsys.readouterr().out.splitlines()
    kinds = {i: ("guard" if i.startswith("guard:") else "patch") for i, _ in V.item_ids(adapter)}
    for item, target in V.item_ids(adapter):
        if not target.startswith("vllm_ascend."):
            continue
        fp = form.fingerprints[target]
        line = next(ln for ln in lines if ln.startswith(kinds[item]) and ln.endswith(" " + target) and fp in ln)
        d = form.decisions.get(item)
        if d is None:
            assert f"vllm-ascend {form.release}" in line, line
        elif d.decision == V.REFUSED_HERE:
            assert f"NEW (refused on commit {form.short})" in line, line
        else:
            assert form.label in line, line
