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

**Forms.** An adapter records every upstream source form it was built and checked against: a release tag (one per
entry of ``releases``) or a commit of a maintenance branch (:class:`Form`, in ``commits``), each with the fingerprint
of every vllm-ascend target. A commit form's targets that differ from its tag each carry a decision
(:class:`FormDecision`: the patch or guard still holds -> its fingerprint is accepted under the commit's label; the
branch carries the fix -> native there; or that part is refused on the commit). :func:`form_for` maps what an
install reports (:func:`zb_patch.detect.reported`) to a recorded form; every other build is judged by fingerprints.

Version checks live here and in :mod:`zb_patch.detect` only. A release's quirks live in its adapter module.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import os
import re
from collections.abc import Mapping, Sequence

from ..detect import COMMIT, LOCAL, PLACEHOLDER, RELEASE, PackageInfo, Versions, reported
from ..registry import PatchSet, find_node, fingerprint_node, split_target
from . import native

Release = tuple[int, ...]


# Decisions on a commit form's target that differs from its tag (docs/releases/<adapter>.md lists them)
STILL_HOLDS = "still-holds"  # what the patch / guard relies on is unchanged: the new fingerprint is accepted
NATIVE_HERE = "native"  # the commit carries the patch's fix: verdict "native" there
REFUSED_HERE = "refused"  # the patch does not handle the change: not applied on that commit (nor its group); on a
# guard: only patches refused on that commit rely on what changed (the decision's reason names them)


@dataclasses.dataclass(frozen=True)
class FormDecision:
    decision: str  # STILL_HOLDS / NATIVE_HERE / REFUSED_HERE
    reason: str  # one line, read from the diff of the target between the tag and the commit


@dataclasses.dataclass(frozen=True)
class Form:
    """One upstream source form an adapter records: a release tag or a commit of a maintenance branch.

    A tag form is implied by each entry of ``Adapter.releases`` (its fingerprints are the ones whose labels name the
    release). A commit form lists the fingerprint of every vllm-ascend target in that commit's tree and, for each item
    (patch id, or ``guard:<target>``) whose target differs from the tag's, a :class:`FormDecision`."""

    ref: str  # "v0.18.0" (tag) or the full 40-digit commit
    release: str  # the release the tag is, or the tag the commit continues
    branch: str = ""  # commit forms: the branch the commit is the head of when recorded
    past_tag: int = 0  # commit forms: commits between the tag and the commit
    date: str = ""  # commit forms: commit date
    fingerprints: Mapping[str, str] = dataclasses.field(default_factory=dict)  # target -> fingerprint
    decisions: Mapping[str, FormDecision] = dataclasses.field(default_factory=dict)  # item id -> decision

    @property
    def is_commit(self) -> bool:
        return re.fullmatch(r"[0-9a-f]{40}", self.ref) is not None

    @property
    def short(self) -> str:
        return self.ref[:12] if self.is_commit else self.ref

    @property
    def label(self) -> str:
        """The fingerprint label of the form (a commit's names no release number: label_names() must not match it)."""
        return f"vllm-ascend commit {self.short}" if self.is_commit else f"vllm-ascend {self.release}"

    @property
    def text(self) -> str:
        if not self.is_commit:
            return f"tag {self.ref}"
        return f"commit {self.short} ({self.branch} head of {self.date}, {self.past_tag} commits past v{self.release})"

    @property
    def reports(self) -> str:
        """The version a setuptools-scm build of the commit reports (the tag's next patch release, devN, the commit)."""
        major, minor, patch = _release(self.release)
        return f"{major}.{minor}.{patch + 1}.dev{self.past_tag}+g{self.ref[:7]}"

    def refused(self) -> dict[str, str]:
        return {i: d.reason for i, d in self.decisions.items() if d.decision == REFUSED_HERE}

    def native(self) -> dict[str, str]:
        return {i: d.reason for i, d in self.decisions.items() if d.decision == NATIVE_HERE}


def _with_commit_forms(patch_set: PatchSet, commits: tuple[Form, ...]) -> PatchSet:
    """The patch set with every commit form's accepted fingerprints merged in under the commit's label: a still-holding
    target's into the guard's / patch's ``fingerprints``, a native one's into the patch's ``native_fingerprints``. A
    refused part's fingerprint is merged nowhere, so a build of that code that reports no recorded form is refused
    whole (fail closed); one that reports the commit gets :meth:`Adapter.for_form`."""
    if not commits:
        return patch_set
    guards = []
    for g in patch_set.guards:
        extra = {
            f.label: f.fingerprints[g.target]
            for f in commits
            if f.decisions.get(g.id) and f.decisions[g.id].decision == STILL_HOLDS
        }
        guards.append(dataclasses.replace(g, fingerprints={**g.fingerprints, **extra}) if extra else g)
    patches = []
    for p in patch_set.patches:
        holds, native_fps = {}, {}
        for f in commits:
            d = f.decisions.get(p.id)
            if d is not None and d.decision == STILL_HOLDS:
                holds[f.label] = f.fingerprints[p.target]
            elif d is not None and d.decision == NATIVE_HERE:
                native_fps[f.label] = f.fingerprints[p.target]
        if holds or native_fps:
            p = dataclasses.replace(
                p, fingerprints={**p.fingerprints, **holds}, native_fingerprints={**p.native_fingerprints, **native_fps}
            )
        patches.append(p)
    return PatchSet(patch_set.name, patches, guards, patch_set.advisories)


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
    # maintenance-branch commits the adapter was checked against (Form); their accepted fingerprints are merged into
    # patch_set when the adapter is made
    commits: tuple[Form, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_set", _with_commit_forms(self.patch_set, self.commits))

    @property
    def forms(self) -> tuple[Form, ...]:
        """Every recorded form: one tag per release, then the commits."""
        return tuple(Form(f"v{r}", r) for r in self.releases) + self.commits

    def form_fingerprints(self, form: Form) -> dict[str, str]:
        """target -> fingerprint of every vllm-ascend target in ``form`` (a tag's: the recorded ones whose labels name
        its release, as tests/sources checks them)."""
        if form.is_commit:
            return dict(form.fingerprints)
        out: dict[str, str] = {}
        for target, fps in _items(self.patch_set):
            if target.startswith("vllm_ascend."):
                for label, fp in fps.items():
                    if label.startswith("vllm-ascend ") and label_names(label, form.release):
                        out[target] = fp
        return out

    def for_form(self, form: Form) -> Adapter:
        """The adapter as it applies to a recognised commit form: the patches refused there left out, with every
        patch of their groups and every patch that requires one of them (they only work together)."""
        refused = set(form.refused())
        if not refused:
            return self
        groups = {p.group for p in self.patch_set.patches if p.id in refused and p.group}
        out = set()
        for p in self.patch_set.patches:  # a required patch is listed before the ones that require it
            if p.id in refused or (p.group and p.group in groups) or any(r in out for r in p.requires):
                out.add(p.id)
        ps = self.patch_set
        # a guard refused on the commit is one only refused parts rely on: with them left out, the commit's form of it
        # is accepted (for this form only: _with_commit_forms merges it nowhere)
        guards = [
            dataclasses.replace(g, fingerprints={**g.fingerprints, form.label: form.fingerprints[g.target]})
            if g.id in refused
            else g
            for g in ps.guards
        ]
        kept = PatchSet(ps.name, [p for p in ps.patches if p.id not in out], guards, ps.advisories)
        return dataclasses.replace(self, patch_set=kept, commits=())

    def refused_on(self, form: Form) -> tuple[str, ...]:
        """Ids of the patches left out on ``form`` (refused there, or with a refused patch's group / requirement)."""
        kept = {p.id for p in self.for_form(form).patch_set.patches}
        return tuple(p.id for p in self.patch_set.patches if p.id not in kept)

    def in_range(self, v: Versions) -> bool:
        return v.vllm_ascend.release_in(*self.vllm_ascend) and v.vllm.release_in(*self.vllm)

    def ascend_in_range(self, v: Versions) -> bool:
        return v.vllm_ascend.release_in(*self.vllm_ascend)

    @property
    def range_text(self) -> str:
        return f"vllm-ascend {_rng(self.vllm_ascend)} + vLLM {_rng(self.vllm)}"


def _items(patch_set: PatchSet) -> list[tuple[str, Mapping[str, str]]]:
    """(target, every recorded fingerprint by label) of each guard and patch."""
    out: list[tuple[str, Mapping[str, str]]] = [(g.target, g.fingerprints) for g in patch_set.guards]
    out += [(p.target, {**p.fingerprints, **p.native_fingerprints}) for p in patch_set.patches]
    return out


def item_ids(adapter: Adapter) -> list[tuple[str, str]]:
    """(item id, target) of every guard (``guard:<target>``) and patch of the adapter."""
    return [(g.id, g.target) for g in adapter.patch_set.guards] + [(p.id, p.target) for p in adapter.patch_set.patches]


def form_for(adapter: Adapter, info: PackageInfo) -> tuple[Form | None, str]:
    """The recorded form of ``adapter`` that the installed vllm-ascend reports, with one phrase saying which, or why
    none: a release (or a local build of it, ``0.18.0+empty``) -> its tag; a commit past a tag
    (``0.18.1.dev45+g35b0fdf``) -> the commit form whose commit it abbreviates. Anything else (another commit, a dev
    build naming none, uncommitted changes, a placeholder version) has no recorded form: its fingerprints decide."""
    rep = reported(info)
    if rep.kind in (RELEASE, LOCAL):
        for form in adapter.forms:
            if not form.is_commit and form.release == rep.release:
                return form, f"vllm-ascend {rep.text}: recorded form {form.text} of {adapter.id}"
        recorded = ", ".join(f.short for f in adapter.forms) or "none"
        return None, f"vllm-ascend {rep.text}: no recorded form of {adapter.id} (recorded: {recorded})"
    if rep.kind == COMMIT and rep.commit:
        for form in adapter.commits:
            if form.ref.startswith(rep.commit):
                return form, f"vllm-ascend {rep.text}: recorded form {form.text} of {adapter.id}"
        recorded = ", ".join(f.short for f in adapter.commits) or "none"
        return None, (
            f"vllm-ascend {rep.text}: commit {rep.commit} is not a recorded form of {adapter.id} "
            f"(recorded commits: {recorded})"
        )
    return None, f"vllm-ascend {rep.text}: no recorded form"


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
    form: Form | None = None  # the recorded form the installed vllm-ascend reports (SELECTED only)
    form_note: str = ""  # which form it is, or why none is (one phrase)

    @property
    def adapter(self) -> Adapter | None:
        return self.candidates[0] if self.verdict == SELECTED else None

    def as_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "reason": self.reason,
            "candidates": [a.id for a in self.candidates],
            "checks": [c.as_dict() for c in self.checks],
            "form": None if self.form is None else {"ref": self.form.ref, "release": self.form.release},
            "form_note": self.form_note,
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
    rep = reported(va)
    if rep.kind == PLACEHOLDER:
        family = [a for a in adapters() if v.vllm.release_in(*a.vllm)]
        return Selection(
            PROBE,
            f"vllm-ascend {rep.text} names no release: accepted only if every target of one adapter matches its "
            f"fingerprints (paired with vLLM {v.vllm.raw}, " + (f"{family[0].id} first)" if family else "none first)"),
            tuple(family + [a for a in adapters() if a not in family]),
            form_note=f"vllm-ascend {rep.text}: no recorded form",
        )
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
        form, note = form_for(a, va)
        chosen = a.for_form(form) if form is not None else a
        left_out = a.refused_on(form) if form is not None else ()
        if left_out:
            why = "; ".join(f"{pid}: {r}" for pid, r in form.refused().items())  # type: ignore[union-attr]
            note += f"; refused there: {', '.join(left_out)} ({why})"
        return Selection(
            SELECTED,
            f"{kind} vllm-ascend {va.raw} + vLLM {v.vllm.raw} is in {a.id} ({a.range_text}); {note}",
            (chosen,),
            form=form,
            form_note=note,
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
            patches = _patch_list(by_id(rv.adapter), rv.patches, "none (every fix native; guards verified)")
            rows.append(
                {"vllm_ascend": span, "vllm": vllm, "verdict": "adapter", "adapter": rv.adapter, "patches": patches}
            )
        else:
            rows.append({"vllm_ascend": span, "vllm": vllm, "verdict": rv.verdict, "adapter": "-", "patches": rv.why})
    for a in adapters():  # each commit form above the row of the release its branch continues
        for form in a.commits:
            at = next(i for i, r in enumerate(rows) if form.release in _row_releases(str(r["vllm_ascend"])))
            rows.insert(at, commit_row(a, form))
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


def _row_releases(span: str) -> list[str]:
    first, _, last = span.partition(" - ")
    if first not in PUBLISHED:
        return []
    return list(PUBLISHED[PUBLISHED.index(first) : PUBLISHED.index(last or first) + 1])


def commit_patches(adapter: Adapter, form: Form) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(applied, native, refused) patch ids on a commit form, from the recorded data: a vllm-ascend target by the
    form's fingerprint, a vLLM target by the labels naming the release the commit continues (same vLLM pin)."""
    refused = adapter.refused_on(form)
    applied, native_ids = [], []
    for p in adapter.patch_set.patches:
        if p.id in refused:
            continue
        if p.target.startswith("vllm_ascend."):
            fp = form.fingerprints.get(p.target)
            if fp in p.native_fingerprints.values():
                native_ids.append(p.id)
            elif fp in p.fingerprints.values():
                applied.append(p.id)
        elif any(label_names(lb, _pinned_vllm(form.release)) for lb in p.fingerprints):
            applied.append(p.id)
    return tuple(applied), tuple(native_ids), refused


def _patch_list(adapter: Adapter, ids: Sequence[str], none: str) -> str:
    """A supported row's patches: those ZB_PATCH=1 applies, then the opt-in ones (ZB_PATCH_ENABLE)."""
    opt_in = {p.id for p in adapter.patch_set.patches if p.opt_in}
    default = [pid for pid in ids if pid not in opt_in]
    text = ", ".join(default) if default else none
    if opt_in & set(ids):
        text += "; opt-in: " + ", ".join(pid for pid in ids if pid in opt_in)
    return text


def commit_row(adapter: Adapter, form: Form) -> dict:
    applied, native_ids, refused = commit_patches(adapter, form)
    patches = _patch_list(adapter, applied, "none")
    if native_ids:
        patches += f"; native there: {', '.join(native_ids)}"
    if refused:
        patches += f"; refused there: {', '.join(refused)}"
    return {
        "vllm_ascend": f"{form.branch} @ {form.short} (v{form.release} + {form.past_tag} commits: {form.reports})",
        "vllm": _pinned_vllm(form.release),
        "verdict": "adapter",
        "adapter": adapter.id,
        "patches": patches,
        "form": "commit",
    }


def classifies(project: str, version: str) -> str | None:
    """What the adapter table says about a published ``vllm-ascend`` or ``vllm`` release (one phrase), or None when
    it says nothing (a release to read and record; ``tox -e watch`` lists them).

    vllm-ascend: a release in :data:`PUBLISHED` (its recorded verdict), or one older than the oldest family (refused by
    rule). vLLM: older than the oldest family, inside an adapter's vLLM range, named by a recorded vLLM fingerprint
    label (adapters, native advisories), the vLLM a published vllm-ascend release is built for, or of the series of
    published vllm-ascend releases that are all refused whatever vLLM they run with."""
    rel = _release(version)
    if project == "vllm-ascend":
        if version in PUBLISHED:
            rv = release_verdict(version)
            return f"{rv.verdict}" + (f" ({rv.adapter})" if rv.adapter else f": {rv.why}")
        if rel < OLDEST_SUPPORTED:
            return f"refused: older than {_fmt(OLDEST_SUPPORTED)}"
        return None
    if project != "vllm":
        raise ValueError(f"unknown project {project!r} (vllm-ascend or vllm)")
    if rel < OLDEST_SUPPORTED:
        return f"refused: vllm-ascend older than {_fmt(OLDEST_SUPPORTED)}"
    for a in adapters():
        if _fmt_pad(a.vllm[0]) <= _fmt_pad(rel) < _fmt_pad(a.vllm[1]):
            return f"in {a.id}'s vLLM range {_rng(a.vllm)}"
    labels = [lb for a in adapters() for _, fps in _items(a.patch_set) for lb in fps]
    labels += [lb for a in adapters() for adv in a.patch_set.advisories for lb in adv.affected]
    labels += [lb for adv in native.ADVISORIES for lb in adv.affected]
    named = next((lb for lb in labels if lb.startswith("vllm ") and label_names(lb, version)), None)
    if named:
        return f"recorded form ({named})"
    pinned_by = [r for r in PUBLISHED if _pinned_vllm(r) == version]
    if pinned_by:
        return f"what vllm-ascend {', '.join(pinned_by)} is built for"
    series = [r for r in PUBLISHED if _release(r)[:2] == rel[:2]]
    if series and all(release_verdict(r).verdict == REFUSED for r in series):
        return f"vllm-ascend {', '.join(series)} refused whatever vLLM"
    return None


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
