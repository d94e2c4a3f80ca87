"""What an adapter is: one supported release family's ranges, patch set and recorded source forms.

The data types of the adapter table (:class:`Adapter`, :class:`Form`, :class:`FormDecision` and the decisions on a
commit form) and what is read from them alone. The adapter modules (``ascend_*``) build their ``ADAPTER`` from these;
the table, selection and verdicts over all adapters are :mod:`zb_patch.versions`. This module imports nothing from
its package.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from ..detect import COMMIT, LOCAL, RELEASE, PackageInfo, Versions, reported
from ..registry import PatchSet

Release = tuple[int, ...]

# The vllm-ascend releases each adapter serves ([low, high) on the release part), by adapter id, oldest family first:
# each ADAPTER's ``vllm_ascend``. Written here, apart from the adapter modules, so that selection reads them before it
# imports any (importing one builds its patch set and imports its fixes) and imports only the family of the installed
# release (zb_patch.versions.adapters() imports every one).
ASCEND_RANGES: Mapping[str, tuple[Release, Release]] = {
    "ascend-0.13": ((0, 13, 0), (0, 14)),
    "ascend-0.18": ((0, 18, 0), (0, 19)),
    "ascend-0.19-0.25": ((0, 19, 0), (0, 26)),
}


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
    release). A commit form lists the fingerprint of every vllm-ascend target in that commit's tree, and of every vLLM
    target that the commit's vllm-ascend replaces on every process (``replaced``: the fingerprint is that of the
    installed function), and, for each item (patch id, or ``guard:<target>``) whose target differs from the tag's, a
    :class:`FormDecision`."""

    ref: str  # "v0.18.0" (tag) or the full 40-digit commit
    release: str  # the release the tag is, or the tag the commit continues
    branch: str = ""  # commit forms: the branch the commit is the head of when recorded
    past_tag: int = 0  # commit forms: commits between the tag and the commit
    date: str = ""  # commit forms: commit date
    # commit forms: the tox env that builds this commit and runs the tests on it ("" = fingerprints only, tests/sources)
    env: str = ""
    fingerprints: Mapping[str, str] = dataclasses.field(default_factory=dict)  # target -> fingerprint
    decisions: Mapping[str, FormDecision] = dataclasses.field(default_factory=dict)  # item id -> decision
    # commit forms: vLLM target -> the vllm_ascend function the commit installs in its place at import
    replaced: Mapping[str, str] = dataclasses.field(default_factory=dict)

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


_VERSION = re.compile(r"\d+\.\d+\.\d+(?:rc\d+)?(?:\.post\d+)?")


def label_names(label: str, release: str) -> bool:
    """A fingerprint label names this exact release ("0.23.0" is not named by "0.23.0rc1" nor "0.23.0.post1")."""
    return release in _VERSION.findall(label)


def _release(release: str) -> Release:
    m = re.match(r"\d+(?:\.\d+)*", release)
    if m is None:
        raise ValueError(f"not a release number: {release!r}")
    return tuple(int(x) for x in m.group(0).split(".")[:3])
