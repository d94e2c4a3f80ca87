"""The commit axis of the adapter table: what a version string claims (detect.reported), the recorded form it maps
to (versions.form_for / select), and the recorded commit forms' data (complete, merged where accepted, refused parts
left out). tests/sources/test_commit_forms.py recomputes the commit forms' fingerprints from the archived trees."""

import pytest
from _versions import vers

from zb_patch import detect
from zb_patch import versions as V
from zb_patch.detect import parse

HEAD_018 = "35b0fdf7d57aee5bd93793e03506ae2d85959595"
HEAD_013 = "f92eadfca968666893715f0a295f036c7bc9d207"


@pytest.mark.parametrize(
    "raw, kind, release, commit",
    [
        ("0.18.0", detect.RELEASE, "0.18.0", None),
        ("0.13.0rc3", detect.RELEASE, "0.13.0rc3", None),
        ("0.23.0.post1", detect.RELEASE, "0.23.0.post1", None),
        ("0.18.0+empty", detect.LOCAL, "0.18.0", None),
        ("0.18.1.dev45+g35b0fdf", detect.COMMIT, "0.18.1", "35b0fdf"),
        ("0.18.1.dev45+g35b0fdf.d20260807", detect.DIRTY, "0.18.1", "35b0fdf"),
        ("0.18.1.dev45", detect.DEV, "0.18.1", None),
        ("0.0.0", detect.PLACEHOLDER, "0.0.0", None),
        (None, detect.UNKNOWN, None, None),
        ("garbage!", detect.UNKNOWN, None, None),
    ],
)
def test_reported(raw, kind, release, commit):
    rep = detect.reported(parse("vllm_ascend", raw))
    assert (rep.kind, rep.release, rep.commit) == (kind, release, commit)
    assert rep.text


@pytest.mark.parametrize(
    "vllm, ascend, ref",
    [
        ("0.18.0", "0.18.0", "v0.18.0"),
        ("0.18.0+empty", "0.18.0", "v0.18.0"),  # vLLM built for vllm-ascend (VLLM_TARGET_DEVICE=empty)
        ("0.18.0+empty", "0.18.0+empty", "v0.18.0"),
        ("0.18.0", "0.18.1.dev45+g35b0fdf", HEAD_018),
        ("0.18.0", "0.18.1.dev45+g35b0fdf7d57aee", HEAD_018),
        ("0.13.0", "0.13.0", "v0.13.0"),
        ("0.13.0+empty", "0.13.1.dev30+gf92eadf", HEAD_013),
    ],
)
def test_recorded_forms_are_recognised(vllm, ascend, ref):
    sel = V.select(vers(vllm, ascend))
    assert sel.verdict == V.SELECTED, sel.reason
    assert sel.form is not None and sel.form.ref == ref, sel.form_note
    assert "recorded form" in sel.form_note and sel.form_note in sel.reason
    assert sel.as_dict()["form"]["ref"] == ref


@pytest.mark.parametrize(
    "ascend, says",
    [
        (
            "0.18.1.dev3+gabcdef1",
            "commit abcdef1 is not a recorded form of ascend-0.18 (recorded commits: 35b0fdf7d57a)",
        ),
        ("0.18.1.dev45+g35b0fdf.d20260807", "uncommitted changes"),
        ("0.18.1.dev45", "names no commit"),
        ("0.18.1", "no recorded form of ascend-0.18 (recorded: v0.18.0, 35b0fdf7d57a)"),
        ("0.18.0rc1", "no recorded form of ascend-0.18"),
    ],
)
def test_other_builds_have_no_form_and_are_judged_by_fingerprints(ascend, says):
    sel = V.select(vers("0.18.0", ascend))
    assert sel.verdict == V.SELECTED and sel.form is None
    assert says in sel.form_note and says in sel.reason
    # the whole adapter, with every accepted fingerprint (tag and commits), decides at apply time
    assert sel.adapter is V.by_id("ascend-0.18")


def test_placeholder_version_is_probed_by_fingerprints_family_of_vllm_first():
    sel = V.select(vers("0.13.0", "0.0.0"))
    assert sel.verdict == V.PROBE and sel.form is None
    assert sel.candidates[0].id == "ascend-0.13" and len(sel.candidates) == len(V.adapters())
    assert "placeholder" in sel.reason


def test_a_recognised_commit_leaves_its_refused_parts_out():
    sel = V.select(vers("0.13.0", "0.13.1.dev30+gf92eadf"))
    full = V.by_id("ascend-0.13")
    kept = {p.id for p in sel.adapter.patch_set.patches}
    zero_bubble = {p.id for p in full.patch_set.patches if p.group == "zero-bubble-0.13"}
    assert zero_bubble and not zero_bubble & kept and "mtp-draft-slots" not in kept
    assert {"mtp-draft-lengths", "stale-draft-placeholders", "readded-request-drafts"} <= kept
    assert "refused there: zb013-optimistic-update-states" in sel.reason and "mtp-draft-slots" in sel.reason
    # the guards only refused parts rely on accept the commit's form, for this form only
    form = sel.form
    for item, decision in form.decisions.items():
        if item.startswith("guard:") and decision.decision == V.REFUSED_HERE:
            target = item[len("guard:") :]
            fp = form.fingerprints[target]
            (g,) = [g for g in sel.adapter.patch_set.guards if g.target == target]
            assert fp in g.fingerprints.values()
            (g_full,) = [g for g in full.patch_set.guards if g.target == target]
            assert fp not in g_full.fingerprints.values()


def test_018_head_carries_the_draft_lengths_fix():
    sel = V.select(vers("0.18.0", "0.18.1.dev45+g35b0fdf"))
    assert {p.id for p in sel.adapter.patch_set.patches} == {p.id for p in V.by_id("ascend-0.18").patch_set.patches}
    (p,) = [p for p in sel.adapter.patch_set.patches if p.id == "draft-seq-lens-max-model-len"]
    assert p.native_fingerprints == {"vllm-ascend commit 35b0fdf7d57a": "a33ff64447e5a581"}
    applied, native, refused = V.commit_patches(V.by_id("ascend-0.18"), sel.form)
    assert native == ("draft-seq-lens-max-model-len",) and not refused and "zb018-device-corrected-inputs" in applied


@pytest.mark.parametrize("adapter", [a for a in V.adapters() if a.commits], ids=lambda a: a.id)
def test_commit_forms_are_complete(adapter):
    """Every vllm-ascend target, and every vLLM target the commit replaces, has the commit's fingerprint; an item gets
    a decision exactly when its target differs from the tag's (a replaced vLLM target always does); an accepted
    decision is merged under the commit's label, a refused one nowhere."""
    tag = adapter.form_fingerprints(adapter.forms[0])
    for form in adapter.commits:
        assert form.is_commit and form.release in adapter.releases and form.branch and form.past_tag > 0
        targets = {t for _, t in V.item_ids(adapter) if t.startswith("vllm_ascend.")}
        assert all(t.startswith("vllm.") and f.startswith("vllm_ascend.") for t, f in form.replaced.items())
        assert set(form.fingerprints) == targets | set(form.replaced) and targets == set(tag)
        changed = {t for t in targets if form.fingerprints[t] != tag[t]} | set(form.replaced)
        expected = {item for item, t in V.item_ids(adapter) if t in changed}
        assert set(form.decisions) == expected
        for decision in form.decisions.values():
            assert decision.decision in (V.STILL_HOLDS, V.NATIVE_HERE, V.REFUSED_HERE) and decision.reason
        for item, target in V.item_ids(adapter):
            d = form.decisions.get(item)
            if d is None:
                continue
            fp = form.fingerprints[target]
            if item.startswith("guard:"):
                (g,) = [g for g in adapter.patch_set.guards if g.id == item]
                assert (g.fingerprints.get(form.label) == fp) == (d.decision == V.STILL_HOLDS), item
            else:
                (p,) = [p for p in adapter.patch_set.patches if p.id == item]
                assert (p.fingerprints.get(form.label) == fp) == (d.decision == V.STILL_HOLDS), item
                assert (p.native_fingerprints.get(form.label) == fp) == (d.decision == V.NATIVE_HERE), item


def test_commit_labels_name_no_release():
    """label_names() must not read a commit's label as a release (the published verdicts come from the labels)."""
    for a in V.adapters():
        for form in a.commits:
            assert not any(V.label_names(form.label, r) for r in V.PUBLISHED), form.label
            assert form.release not in form.label


def test_supported_table_has_a_row_per_commit_above_its_release():
    rows = V.supported_table()
    spans = [r["vllm_ascend"] for r in rows]
    for a in V.adapters():
        for form in a.commits:
            (i,) = [i for i, r in enumerate(rows) if r.get("form") == "commit" and form.short in r["vllm_ascend"]]
            assert form.reports in spans[i] and form.branch in spans[i]
            assert rows[i + 1]["vllm_ascend"] == form.release or form.release in spans[i + 1]
            assert rows[i]["adapter"] == a.id
    assert "refused there: zb013-" in next(r["patches"] for r in rows if "f92eadfca968" in r["vllm_ascend"])
    assert "native there: draft-seq-lens-max-model-len" in next(
        r["patches"] for r in rows if "35b0fdf7d57a" in r["vllm_ascend"]
    )


@pytest.mark.parametrize(
    "project, version, classified",
    [
        ("vllm-ascend", "0.18.0", "selected (ascend-0.18)"),
        ("vllm-ascend", "0.13.0rc3", "refused: in ascend-0.13's range"),
        ("vllm-ascend", "0.8.5rc1", "refused: older than 0.13"),
        ("vllm-ascend", "0.18.1rc1", None),  # in a family's range but never read
        ("vllm-ascend", "0.31.0rc1", None),  # past every recorded native release
        ("vllm", "0.12.0", "refused"),
        ("vllm", "0.18.1", "in ascend-0.18's vLLM range"),
        ("vllm", "0.27.1", "recorded form (vllm 0.26.0, 0.27.0, 0.27.1)"),
        ("vllm", "0.30.0", "recorded form (vllm 0.28.0, 0.29.0, 0.30.0)"),
        ("vllm", "0.14.0", "what vllm-ascend 0.14.0rc1 is built for"),
        ("vllm", "0.15.1", "vllm-ascend 0.15.0rc1 refused whatever vLLM"),
        ("vllm", "0.31.0", None),
    ],
)
def test_what_the_table_classifies(project, version, classified):
    said = V.classifies(project, version)
    assert (said is None) == (classified is None), said
    if classified:
        assert said.startswith(classified), said


def test_every_published_release_is_classified():
    assert all(V.classifies("vllm-ascend", r) for r in V.PUBLISHED)
