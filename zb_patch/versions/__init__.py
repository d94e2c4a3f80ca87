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

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..detect import PLACEHOLDER, PackageInfo, Versions, reported

# the adapter data types and the source-tree fingerprints live in leaf modules (no adapter imports this package's
# namespace); callers outside versions/ reach them here
from .adapter import ASCEND_RANGES as ASCEND_RANGES
from .adapter import NATIVE_HERE as NATIVE_HERE
from .adapter import REFUSED_HERE as REFUSED_HERE
from .adapter import STILL_HOLDS as STILL_HOLDS
from .adapter import Adapter, Form, Release, _fmt, _items, _release, _rng, form_for, label_names
from .adapter import item_ids as item_ids
from .source import fingerprint_in_tree
from .source import module_file as module_file

if TYPE_CHECKING:  # imported where used: only a release past the adapters (or a verdict over all releases) needs it
    from . import native

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
    """Every adapter, oldest family first (imports every adapter module)."""
    return tuple(_load(adapter_id) for adapter_id in ASCEND_RANGES)


def _ascend_family(va: PackageInfo) -> list[Adapter]:
    """The adapters whose vllm-ascend range holds the installed release: only their modules are imported."""
    return [_load(adapter_id) for adapter_id, rng in ASCEND_RANGES.items() if va.release_in(*rng)]


def _load(adapter_id: str) -> Adapter:
    """One adapter, its module imported on first use (each by its own import statement: the import graph that
    tests/unit/test_check_boundary.py reads from them reaches every adapter)."""
    if adapter_id == "ascend-0.13":
        from . import ascend_0_13

        return ascend_0_13.ADAPTER
    if adapter_id == "ascend-0.18":
        from . import ascend_0_18

        return ascend_0_18.ADAPTER
    if adapter_id == "ascend-0.19-0.25":
        from . import ascend_0_19_0_25

        return ascend_0_19_0_25.ADAPTER
    raise KeyError(adapter_id)


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
        from . import native

        return _native_by_code(str(va.raw), tree if tree is not None else native.installed_root())
    if not va.release_at_least(*OLDEST_SUPPORTED):
        return Selection(
            REFUSED,
            f"vllm-ascend {va.raw} is older than {_fmt(OLDEST_SUPPORTED)}: it cannot run async "
            f"scheduling together with speculative decoding, so there is nothing to backport",
        )
    in_range = [a for a in _ascend_family(va) if a.in_range(v)]
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
    from . import native

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
        from . import native

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
                {
                    "vllm_ascend": span,
                    "vllm": vllm,
                    "verdict": "adapter",
                    "adapter": rv.adapter,
                    "patches": patches,
                    "summary": _patch_count(by_id(rv.adapter), rv.patches),
                }
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


def _patch_count(adapter: Adapter, ids: Sequence[str]) -> str:
    """A supported row's patches in brief (README): how many ZB_PATCH=1 applies, and the opt-in ones."""
    opt_in = sum(1 for p in adapter.patch_set.patches if p.opt_in and p.id in ids)
    default = len(ids) - opt_in
    return (f"{default} patches" if default else "none (every fix native; guards verified)") + (
        f" + {opt_in} opt-in" if opt_in else ""
    )


def commit_row(adapter: Adapter, form: Form) -> dict:
    applied, native_ids, refused = commit_patches(adapter, form)
    patches = _patch_list(adapter, applied, "none")
    summary = _patch_count(adapter, applied)
    if native_ids:
        patches += f"; native there: {', '.join(native_ids)}"
        summary += f"; native there: {', '.join(native_ids)}"
    if refused:
        patches += f"; refused there: {', '.join(refused)}"
        zero_bubble = set(adapter.zero_bubble_ids) & set(refused)
        summary += f"; {len(refused)} refused there" + (" (zero-bubble among them)" if zero_bubble else "")
    tested = f"; tested in tox -e {form.env}" if form.env else "; fingerprints checked against its source only"
    return {
        "vllm_ascend": f"{form.branch} @ {form.short} (v{form.release} + {form.past_tag} commits: {form.reports})",
        "vllm": _pinned_vllm(form.release),
        "verdict": "adapter",
        "adapter": adapter.id,
        "patches": patches + tested,
        "summary": summary + tested,
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
    from . import native

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
