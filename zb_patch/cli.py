"""``zb-patch`` command line: ``doctor`` (what ZB_PATCH=1 would do here) and ``fingerprints`` (maintainers)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import re
import sys

from . import __version__
from .console import run_command

DOCTOR_SCHEMA = "zb-patch-doctor/1"
EXIT_OK, EXIT_SETTINGS, EXIT_REFUSED = 0, 1, 2


# ----------------------------------------------------------------------------------------------------
# doctor
# ----------------------------------------------------------------------------------------------------


def _entry_point_info() -> dict:
    import importlib.metadata as md

    eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "zb_patch"]
    plugins_env = os.environ.get("VLLM_PLUGINS")
    # vLLM reads VLLM_PLUGINS as: unset -> every plugin loads; set -> comma-separated whitelist of plugin
    # names (all groups), so "" loads none.
    allowed = None if plugins_env is None else plugins_env.split(",")
    loads = bool(eps) and (allowed is None or "zb_patch" in allowed)
    if not eps:
        effect = "the zb_patch entry point is not installed: vLLM will never call zb-patch (pip install zb-patch)"
    elif allowed is None:
        effect = "VLLM_PLUGINS unset: vLLM loads every plugin, zb_patch included"
    elif "zb_patch" in allowed:
        effect = f"VLLM_PLUGINS={plugins_env!r} includes zb_patch: vLLM loads it"
    else:
        effect = (
            f"VLLM_PLUGINS={plugins_env!r} does not include zb_patch: vLLM will NOT load zb-patch "
            f"(add zb_patch to the list)"
        )
    return {
        "group": "vllm.general_plugins",
        "visible": bool(eps),
        "value": eps[0].value if eps else None,
        "vllm_plugins_env": plugins_env,
        "loaded_by_vllm": loads,
        "effect": effect,
    }


def doctor_data(import_targets: bool = True) -> dict:
    from . import registry as R
    from . import versions as V
    from .detect import detect
    from .plugin import ENV_VARS, Settings

    settings = Settings()
    versions = detect()
    selection = V.select(versions)
    data: dict = {
        "schema": DOCTOR_SCHEMA,
        "zb_patch": __version__,
        "python": sys.version.split()[0],
        "pid": os.getpid(),
        "versions": versions.as_dict(),
        "plugin": _entry_point_info(),
        "settings": settings.as_dict(),
        "env_vars": ENV_VARS,
        "selection": selection.as_dict(),
        "adapters": [],
        "supported": V.supported_table(),
    }
    verdict, reason, chosen = None, selection.reason, None
    if selection.verdict == V.NATIVE:
        verdict = "native"
        # known upstream bugs of the native release zb-patch does not fix there (read from the installed sources)
        from .versions import native

        data["native_advisories"] = [c.as_dict() for c in native.check_advisories(native.installed_vllm_root())]
    elif selection.verdict == V.REFUSED:
        verdict = "refused"
    else:
        for adapter in selection.candidates:
            if import_targets:
                for mod in adapter.preload:
                    try:
                        importlib.import_module(mod)
                    except Exception as exc:  # reported through the targets that stay unresolved
                        data.setdefault("import_errors", {})[mod] = f"{type(exc).__name__}: {exc}"
            report, _ = adapter.patch_set.verify(
                versions, settings.disabled, settings.opted_in, import_missing=import_targets
            )
            in_range = adapter.in_range(versions)
            specs = {p.id: p for p in adapter.patch_set.patches}
            items = []
            for item in report.items:
                d = item.as_dict()
                d["enabled"] = item.verdict not in (R.DISABLED, R.OPT_IN, R.SUPERSEDED)
                if item.id in specs:
                    d["rests_on"] = dataclasses.asdict(specs[item.id].rests_on)
                    d["opt_in"] = specs[item.id].opt_in
                d["in_range"] = in_range
                d["fingerprint_ok"] = item.matched is not None if item.kind != "advisory" else None
                items.append(d)
            data["adapters"].append(
                {
                    "id": adapter.id,
                    "title": adapter.title,
                    "range": adapter.range_text,
                    "in_range": in_range,
                    "verdict": report.verdict,
                    "reason": report.reason,
                    "items": items,
                }
            )
            if chosen is None and report.verdict in (R.OK, R.ALREADY):
                chosen = adapter
                if selection.verdict == V.SELECTED:
                    break
            elif selection.verdict == V.SELECTED:
                break
        if chosen is not None:
            verdict = "apply"
            how = "selected by version" if selection.verdict == V.SELECTED else "accepted by fingerprint"
            reason = f"{chosen.id} {how}: {selection.reason}"
        else:
            pending = [a for a in data["adapters"] if a["verdict"] == R.PENDING]
            if pending and not import_targets:
                verdict, reason = "pending", pending[0]["reason"]
            else:
                verdict = "refused"
                reason = "; ".join(f"{a['id']}: {a['reason']}" for a in data["adapters"]) or reason
    data["verdict"] = verdict
    data["adapter"] = chosen.id if chosen else None
    data["reason"] = reason
    if settings.errors:
        exit_code = EXIT_SETTINGS
    elif verdict in ("refused", "pending") and settings.enabled:
        exit_code = EXIT_REFUSED
    else:
        exit_code = EXIT_OK
    data["exit_code"] = exit_code
    return data


def _print_doctor(d: dict, out) -> None:
    w = out.write
    w(f"zb-patch {d['zb_patch']} doctor (python {d['python']}, pid {d['pid']})\n\n")
    w("Installed versions (package metadata):\n")
    for name, info in d["versions"].items():
        text = info["version"] or "not installed"
        if info.get("dist") and info["dist"].replace("_", "-") != name.replace("_", "-"):
            text += f"  (dist {info['dist']})"
        if info.get("commit"):
            text += f"  [commit {info['commit']}]"
        w(f"  {name:<14} {text}\n")
    p = d["plugin"]
    w("\nvLLM plugin:\n")
    w(f"  entry point    {p['group']}: zb_patch = {p['value'] or '(missing)'}\n")
    w(f"  VLLM_PLUGINS   {p['effect']}\n")
    s = d["settings"]
    w("\nSettings:\n")
    for key, doc in d["env_vars"].items():
        w(f"  {key:<17} {s['raw'].get(key, '(unset)'):<8} {doc}\n")
    for err in s["errors"]:
        w(f"  ERROR: {err}\n")
    sel = d["selection"]
    w(f"\nAdapter selection: {sel['verdict']}: {sel['reason']}\n")
    for a in d["adapters"]:
        w(f"\n  {a['id']}  [{a['range']}]  in range: {'yes' if a['in_range'] else 'no'}  -> {a['verdict']}\n")
        w(f"  {'kind':<8} {'verdict':<16} {'found':<6} {'fp ok':<6} {'fingerprint':<17} target\n")
        for it in a["items"]:
            w(
                f"  {it['kind']:<8} {it['verdict']:<16} {'yes' if it['found'] else 'no':<6} "
                f"{ {True: 'yes', False: 'no', None: '-'}[it['fingerprint_ok']]:<6} {it['fingerprint'] or '-':<17} "
                f"{it['target'] if it['kind'] == 'guard' else it['id'] + ' -> ' + it['target']}\n"
            )
            if it["reason"] and it["verdict"] not in ("ok",):
                w(f"  {'':<8} {it['reason']}\n")
        opt_in = [it for it in a["items"] if it.get("opt_in")]
        if opt_in:
            w(f"\n  Opt-in patches of {a['id']} (ZB_PATCH_ENABLE=id,...; not applied by default):\n")
            for it in opt_in:
                w(
                    f"    {it['id']}  [{it['verdict']}]\n      rests on: {it['rests_on']['kind']} -- "
                    f"{it['rests_on']['evidence']}\n"
                )
            w(
                "    Check one on this deployment before serving with it: `ZB_PATCH_ENABLE=<id> zb-patch selftest "
                "--engine --graph-mode <piecewise|full_decode_only>` (tokens through this engine, in the graph mode "
                "the patch acts in, against synchronous scheduling).\n"
            )
    w("\n")
    state = "ON" if s["enabled"] else "off (set ZB_PATCH=1 to enable)"
    w(f"zb-patch is {state}\n")
    verdict = d["verdict"]
    if verdict == "apply":
        w(f"Verdict: ZB_PATCH=1 applies adapter {d['adapter']} ({d['reason']})\n")
    elif verdict == "native":
        w(f"Verdict: native: {d['reason']}\n")
        for adv in d.get("native_advisories", []):
            if adv["matched"]:
                w(
                    f"  advisory {adv['id']} ({adv['matched']}; {', '.join(adv['upstream'])}): {adv['target']} "
                    f"{adv['fingerprint']}: {adv['message']}\n"
                )
            else:
                w(
                    f"  advisory {adv['id']}: not a recorded affected form ({adv['target']} "
                    f"{adv['fingerprint'] or 'absent'}; {', '.join(adv['upstream'])})\n"
                )
    else:
        w(f"Verdict: ZB_PATCH=1 would be REFUSED: {d['reason']}\n")


def cmd_doctor(args) -> int:
    if args.probe:
        from .check import probe

        return probe.run_cli(args)
    data = doctor_data(import_targets=not args.no_import)
    if args.json:
        json.dump(data, args.out, indent=2, sort_keys=True, default=str)
        args.out.write("\n")
    else:
        _print_doctor(data, args.out)
    return data["exit_code"]


def supported_markdown(brief: bool = False) -> str:
    """The supported table; ``brief`` (README): patch counts instead of the patch ids."""
    from . import versions as V

    lines = ["| vllm-ascend | vLLM | verdict | adapter | patches |", "|---|---|---|---|---|"]
    for r in V.supported_table():
        patches = r.get("summary", r["patches"]) if brief else r["patches"]
        lines.append(f"| {r['vllm_ascend']} | {r['vllm']} | {r['verdict']} | {r['adapter']} | {patches} |")
    return "\n".join(lines) + "\n"


SHARED_PAGE = "shared-fixes.md"  # beside docs/releases/<adapter>.md: the texts patches of several adapters share
# the spec texts the patch reference shows; how and the rests-on evidence: zb-patch patches (the full specs)
_TEXT_FIELDS = ("why", "upstream", "remove when")
_OPENING, _MIN_OPENING = "why (opening)", 300


def _text(p, field: str) -> str:
    return {"why": p.why, "upstream": ", ".join(p.upstream), "remove when": p.remove_when}[field]


def shared_name(patch_id: str) -> str:
    """The name a patch has in every adapter: its id, less the adapter tag of a zero-bubble patch (``zb013-``)."""
    return re.sub(r"^zb\d+-", "", patch_id)


def shared_texts() -> dict[str, tuple[list[tuple[str, str]], dict[str, str]]]:
    """shared name -> ((adapter, patch id) of each, {field: text}) for every patch of more than one adapter: the text
    fields that are the same in all of them (written once, in docs/releases/shared-fixes.md)."""
    from . import versions as V

    by_name: dict[str, list] = {}
    for a in V.adapters():
        for p in a.patch_set.patches:
            by_name.setdefault(shared_name(p.id), []).append((a.id, p))
    shared = {}
    for name, found in by_name.items():
        texts = {f: {_text(p, f) for _, p in found} for f in _TEXT_FIELDS}
        same = {f: next(iter(ts)) for f, ts in texts.items() if len(ts) == 1 and next(iter(ts))}
        # whys that differ past a long common opening (the fix's own words, then the release's): the opening once
        common = os.path.commonprefix(sorted(texts["why"]))
        opening = common[: common.rfind(". ") + 1]
        if "why" not in same and len(opening) >= _MIN_OPENING:
            same[_OPENING] = opening
        if len(found) > 1 and same:
            shared[name] = ([(a, p.id) for a, p in found], same)
    return shared


def shared_patches_markdown() -> str:
    """The block of docs/releases/shared-fixes.md: per patch of several adapters, the texts they share."""
    out = ["<!-- generated: zb-patch patches --markdown --shared (edit the specs, not this block) -->", ""]
    first: dict[tuple[str, str], str] = {}  # (field, text) -> the first name that has it: later ones refer to it
    for name, (patches, same) in shared_texts().items():
        where = ", ".join(f"[{a if pid == name else pid}]({a}.md#{pid})" for a, pid in patches)
        out += [f"#### `{name}`", "", f"- **adapters** {where}"]
        for field, text in same.items():
            seen = first.setdefault((field, text), name)
            out.append(f"- **{field}** {text if seen == name else f'as `{seen}`'}")
        out.append("")
    return "\n".join(out)


def patches_markdown(adapter_id: str) -> str:
    """The patch / guard / advisory reference of one adapter, as docs/releases/<adapter>.md embeds it: generated
    from the specs (the one place a patch's why / how / upstream / remove-when is written), without the how, the
    rests-on evidence and what a guard is relied upon for (``zb-patch patches`` prints the full specs). Texts the
    patch shares with the same patch of other adapters: docs/releases/shared-fixes.md (``--shared``)."""
    from . import versions as V

    a = V.by_id(adapter_id)
    shared = shared_texts()
    out = [f"<!-- generated: zb-patch patches --markdown --adapter {a.id} (edit the specs, not this block) -->", ""]
    # the remove-when most of the adapter's patches share is said once, above them
    texts = [
        p.remove_when for p in a.patch_set.patches if "remove when" not in shared.get(shared_name(p.id), ([], {}))[1]
    ]
    usual = max(texts, key=texts.count) if texts and texts.count(max(texts, key=texts.count)) > 1 else ""
    if usual:
        out += [f"Remove when (where a patch says nothing else): {usual}.", ""]
    first: dict[tuple[str, str], str] = {}  # (field, text) -> the first patch that has it: later ones refer to it

    def once(field: str, text: str, pid: str) -> str:
        seen = first.setdefault((field, text), pid)
        return text if seen == pid else f"as `{seen}`"

    for p in a.patch_set.patches:
        same = shared.get(shared_name(p.id), ([], {}))[1]
        for field, key in (("why", "why"), ("remove when", "remove")):
            if field in same:
                once(key, same[field], p.id)  # written on the shared page: a later patch with the text refers to it
        group = f" (group `{p.group}`)" if p.group and p.group != p.id else ""
        out.append(f"#### `{p.id}`{group}")
        out.append("")
        aliases = "".join(f", alias `{al}`" for al in p.aliases)
        opt = " **Opt-in** (`ZB_PATCH_ENABLE`)." if p.opt_in else ""
        out.append(f"- **target** `{p.target}`{aliases}; rests on `{p.rests_on.kind}`.{opt}")
        if p.requires:
            out.append("- **requires** " + ", ".join(f"`{r}`" for r in p.requires) + " (applied only with it)")
        if p.supersedes:
            out.append(
                "- **supersedes** " + ", ".join(f"`{r}`" for r in p.supersedes) + " (stands in for it when enabled)"
            )
        out.append("- **replaces** " + ", ".join(f"`{fp}` ({label})" for label, fp in p.fingerprints.items()))
        if p.native_fingerprints:
            out.append(
                "- **native in** " + ", ".join(f"`{fp}` ({label})" for label, fp in p.native_fingerprints.items())
            )
        if "why" not in same:
            opening = same.get(_OPENING, "")
            rest = once("why", p.why[len(opening) :].lstrip(), p.id)
            out.append(f"- **why** {'... ' if opening else ''}{rest}")
        if "upstream" not in same:
            out.append(f"- **upstream** {', '.join(p.upstream)}")
        if "remove when" not in same and p.remove_when != usual:
            out.append(f"- **remove when** {once('remove', p.remove_when, p.id)}")
        if same:
            out.append(f"- **{', '.join(same)}**: [shared]({SHARED_PAGE}#{shared_name(p.id)})")
        out.append("")
    if a.patch_set.guards:
        out += [
            f"#### Guards ({len(a.patch_set.guards)}): verified by fingerprint, never replaced",
            "",
            f"What each is relied upon for: `zb-patch patches --adapter {a.id}`.",
            "",
            "| target | fingerprints |",
            "|---|---|",
        ]
        for g in a.patch_set.guards:
            fps = ", ".join(f"`{fp}` ({label})" for label, fp in g.fingerprints.items())
            out.append(f"| `{g.target}` | {fps} |")
        out.append("")
    if a.commits:
        out += _commit_forms_markdown(a)
    if a.patch_set.advisories:
        out += [
            f"#### Advisories ({len(a.patch_set.advisories)}): known upstream bugs not fixed (one WARNING)",
            "",
            "| id | target | affected | message | upstream |",
            "|---|---|---|---|---|",
        ]
        for adv in a.patch_set.advisories:
            fps = ", ".join(f"`{fp}` ({label})" for label, fp in adv.affected.items())
            out.append(f"| `{adv.id}` | `{adv.target}` | {fps} | {adv.message} | {', '.join(adv.upstream)} |")
        out.append("")
    return "\n".join(out)


def _commit_forms_markdown(a) -> list[str]:
    """The commit forms of an adapter: per commit, each item whose target differs from the tag, with its decision."""
    from . import versions as V

    tag = a.form_fingerprints(a.forms[0])
    out = [f"#### Commit forms ({len(a.commits)}): maintenance-branch commits checked against the adapter", ""]
    for form in a.commits:
        applied, native_ids, refused = V.commit_patches(a, form)
        fps = form.fingerprints
        ascend = [t for t in fps if t not in form.replaced]
        same = sum(1 for t in ascend if tag.get(t) == fps[t])
        replaced = "".join(
            f" At import it replaces vLLM's `{t}` by `{f}` in every process." for t, f in form.replaced.items()
        )
        out += [
            f"`{form.ref}`: head of `{form.branch}` of {form.date}, {form.past_tag} commits past `v{form.release}`; "
            f"a setuptools-scm build of it reports `{form.reports}`. {same} of {len(ascend)} vllm-ascend targets have "
            f"the tag's fingerprint; the items of the others are listed below.{replaced}",
            "",
            "| item | target | decision | reason |",
            "|---|---|---|---|",
        ]
        for item, target in V.item_ids(a):
            d = form.decisions.get(item)
            if d is None:
                continue
            out.append(
                f"| `{item.split(':', 1)[0] if item.startswith('guard:') else item}` | `{target}` | "
                f"{d.decision} | {d.reason} |"
            )
        out += [
            "",
            f"Native there: {', '.join(native_ids) or 'none'}. Refused there (with their groups and the patches that "
            f"require them): {', '.join(refused) or 'none'}. The other {len(applied)} patches apply.",
            "",
            f"Tested in `tox -e {form.env}`: the commit built from its source, `ZB_PATCH=1 zb-patch doctor` and the "
            "tests tox.ini lists for that env."
            if form.env
            else "No test env: its fingerprints and decisions are recomputed from its source tree (`tox -e sources`).",
            "",
        ]
    return out


def cmd_supported(args) -> int:
    from . import versions as V

    if args.markdown:
        sys.stdout.write(supported_markdown(brief=args.brief))
    else:
        rows = V.supported_table()
        w = {k: max(len(r[k]) for r in rows) for k in ("vllm_ascend", "vllm", "verdict", "adapter")}
        for r in rows:
            print(
                f"{r['vllm_ascend']:<{w['vllm_ascend']}}  {r['vllm']:<{w['vllm']}}  {r['verdict']:<{w['verdict']}}  "
                f"{r['adapter']:<{w['adapter']}}  {r['patches']}"
            )
    return 0


def cmd_patches(args) -> int:
    from . import versions as V

    adapters = [V.by_id(args.adapter)] if args.adapter else list(V.adapters())
    if args.markdown and args.shared:
        sys.stdout.write(shared_patches_markdown())
        return 0
    if args.markdown:
        sys.stdout.write("\n".join(patches_markdown(a.id) for a in adapters))
        return 0
    for a in adapters:
        print(f"== {a.id}: {a.title}")
        print(f"   range: {a.range_text}")
        if a.notes:
            print(f"   notes: {a.notes}")
        for p in a.patch_set.patches:
            group = f", group: {p.group}" if p.group else ""
            default = "opt-in: ZB_PATCH_ENABLE" if p.opt_in else "applied by default"
            print(f"\n   patch {p.id}  (roles: {', '.join(p.roles)}{group}; {default})")
            print(f"     rests on:    {p.rests_on.line()}")
            print(f"     target:      {p.target}")
            for alias in p.aliases:
                print(f"     alias:       {alias}")
            if p.requires:
                print(f"     requires:    {', '.join(p.requires)}")
            if p.supersedes:
                print(f"     supersedes:  {', '.join(p.supersedes)} (stands in for it when enabled)")
            print(f"     why:         {p.why}")
            if p.how:
                print(f"     how:         {p.how}")
            print(f"     upstream:    {', '.join(p.upstream)}")
            print(f"     remove when: {p.remove_when}")
            for label, fp in p.fingerprints.items():
                print(f"     replaces:    {fp}  ({label})")
            for label, fp in p.native_fingerprints.items():
                print(f"     native:      {fp}  ({label}: already fixed, nothing applied)")
        if a.patch_set.guards:
            print(f"\n   guards ({len(a.patch_set.guards)}): verified, never replaced")
            for g in a.patch_set.guards:
                fps = ", ".join(f"{fp} ({label})" for label, fp in g.fingerprints.items())
                print(f"     {g.target}  {fps}")
                if g.why:
                    print(f"       {g.why}")
        if a.patch_set.advisories:
            print(f"\n   advisories ({len(a.patch_set.advisories)}): known upstream bugs NOT fixed (one WARNING)")
            for adv in a.patch_set.advisories:
                fps = ", ".join(f"{fp} ({label})" for label, fp in adv.affected.items())
                print(f"     {adv.id}: {adv.target}  affected: {fps}")
                print(f"       {adv.message}")
                if adv.upstream:
                    print(f"       upstream: {', '.join(adv.upstream)}")
        print()
    return 0


def cmd_selftest(args) -> int:
    if args.model and not args.engine:
        print("zb-patch selftest: --model needs --engine", file=sys.stderr)
        return 2
    if args.engine_args and not args.model:
        print(f"zb-patch selftest: engine arguments {args.engine_args} need --engine --model", file=sys.stderr)
        return 2
    if args.engine and args.model:
        from .check.engine import deploy

        return deploy.run_cli(args)
    if args.engine:
        from .check.engine import run

        return run.run_cli(args)
    from .check import selftest

    return selftest.run_cli(args)


# ----------------------------------------------------------------------------------------------------
# fingerprints (maintainers): recompute an adapter's fingerprints from a source tree
# ----------------------------------------------------------------------------------------------------


def cmd_fingerprints(args) -> int:
    from . import versions as V
    from .versions import native

    adapters = [V.by_id(args.adapter)] if args.adapter else list(V.adapters())
    root = args.root
    recorded_for = []  # adapters (and "native") whose every target in this tree is recorded
    for a in adapters:
        bad = 0
        print(f"# {a.id}  (source tree: {root})")
        specs = [("guard", g.target, g.fingerprints, g.id) for g in a.patch_set.guards]
        specs += [
            (
                "patch",
                p.target,
                {**p.fingerprints, **{f"native: {k}": v for k, v in p.native_fingerprints.items()}},
                p.id,
            )
            for p in a.patch_set.patches
        ]
        specs += [
            ("advis.", adv.target, {f"affected: {k}": v for k, v in adv.affected.items()}, adv.id)
            for adv in a.patch_set.advisories
        ]
        for kind, target, expected, item in specs:
            module = target.split(":")[0]
            if args.only and not module.startswith(tuple(args.only)):
                continue
            fp = V.fingerprint_in_tree(root, target)
            if fp is None:
                status = "absent"
            elif fp in expected.values():
                status = "recorded (" + ", ".join(k for k, v in expected.items() if v == fp) + ")"
            elif kind == "advis.":
                status = "not affected (or NEW)"
            else:
                status = "NEW"
                bad += 1
                refused_on = [
                    f.short
                    for f in a.commits
                    if f.fingerprints.get(target) == fp
                    and getattr(f.decisions.get(item), "decision", None) == V.REFUSED_HERE
                ]
                if refused_on:  # recorded as a commit form whose part on this target is refused there
                    status = f"NEW (refused on commit {', '.join(refused_on)})"
            print(f"{kind:<6} {fp or '-':<17} {status:<40} {target}")
        if not bad:
            recorded_for.append(a.id)
    if not args.adapter:
        print(f"# native forms (vllm-ascend >= {V._fmt(V.NATIVE_FROM)}: nothing to carry only if all are recorded)")
        checks = native.check_tree(root)
        for c in checks:
            status = f"recorded ({c.matched})" if c.matched else ("absent" if c.fingerprint is None else "NEW")
            print(f"native {c.fingerprint or '-':<17} {status:<40} {c.target}")
        if all(c.matched for c in checks):
            recorded_for.append("native")
    print(f"# every target recorded for: {', '.join(recorded_for) or 'nothing (NEW or absent targets above)'}")
    return 0 if recorded_for or not args.check else 3


# ----------------------------------------------------------------------------------------------------


def _setup_logging(verbose: bool) -> None:
    logger = logging.getLogger("vllm.zb_patch")
    if not logging.getLogger("vllm").handlers and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zb-patch",
        description="Zero-bubble async scheduling + speculative decoding patches for vLLM-Ascend. "
        "Activate in every vLLM process with ZB_PATCH=1; `zb-patch doctor` shows what that does here.",
    )
    parser.add_argument("--version", action="version", version=f"zb-patch {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    d = sub.add_parser(
        "doctor",
        help="show versions, the adapter ZB_PATCH=1 selects, and every patch's verdict",
        description="Detect installed versions, select the adapter, import the target modules and "
        "verify every fingerprint, without patching anything. Exit 0 when ZB_PATCH=1 "
        "would apply (or is off), 1 on invalid ZB_PATCH* settings, 2 when ZB_PATCH=1 "
        "is set and would be refused.",
    )
    d.add_argument("--json", action="store_true", help="stable JSON output (schema zb-patch-doctor/1)")
    d.add_argument(
        "--no-import",
        action="store_true",
        help="do not import vLLM / vllm-ascend modules (only what is already imported is verified)",
    )
    d.add_argument(
        "--probe",
        action="store_true",
        help="start the smallest engine the installed vLLM allows (tiny random model, no "
        "download) and report what zb-patch did in each of its processes (front end, "
        "EngineCore, workers); see docs/probe.md for its cost",
    )
    d.add_argument(
        "--probe-tp", type=int, default=1, metavar="N", help="--probe: tensor-parallel size (N worker processes)"
    )
    d.add_argument("--timeout", type=float, default=300.0, help="--probe: give up after this many seconds")
    d.set_defaults(func=cmd_doctor)

    st = sub.add_parser(
        "selftest",
        help="prove the zero-bubble bookkeeping against vLLM's real scheduler",
        description="Drive the installed vLLM's real AsyncScheduler with a deterministic fake "
        "model, once synchronously and once zero-bubble (optimistic CPU counts + "
        "device-side corrections), and compare every step. Exit 1 on any divergence.",
    )
    st.add_argument("--steps", type=int, default=2000, help="engine steps per mode (default 2000)")
    st.add_argument("--seed", type=int, default=0, help="workload / acceptance seed")
    st.add_argument("--json", action="store_true", help="JSON report")
    st.add_argument("--quiet", action="store_true", help="no progress bar")
    eng = st.add_argument_group(
        "engine self-test (--engine)",
        "Generate tokens with a tiny locally built model (no download) through the installed vLLM / vllm-ascend "
        "engine on the NPU: sync scheduling, async scheduling, async + ZB_PATCH=1, each in its own process. PASS "
        "when tokens and drafted / accepted counts per request agree. Exit 0 PASS, 1 FAIL, 2 no NPU.",
    )
    eng.add_argument("--engine", action="store_true", help="run the engine self-test instead of the bookkeeping one")
    eng.add_argument("--k", default="2", metavar="K[,K...]", help="draft tokens per step (default 2)")
    eng.add_argument("--jobs", type=int, default=1, help="engine processes at a time (default 1)")
    eng.add_argument("--keep", metavar="DIR", help="write the models and every run's result JSON under DIR")
    eng.add_argument("--workload", metavar="JSON", help="workload fields as JSON (zb_patch.check.engine.workload)")
    eng.add_argument(
        "--drafter",
        choices=("eagle", "mtp", "deepseek-mtp"),
        default="eagle",
        help="eagle: Llama target + EAGLE head (default); mtp: MiMo target drafting with its own MTP layer; "
        "deepseek-mtp: DeepSeek-V3-style MLA target drafting with its own MTP layer",
    )
    eng.add_argument(
        "--no-classic",
        action="store_true",
        help="leave out the classic async run without zb-patch (reported beside the verdict, never judged)",
    )
    eng.add_argument(
        "--graph-mode",
        choices=("eager", "piecewise", "full_decode_only"),
        default="eager",
        help="eager (default): enforce_eager; piecewise / full_decode_only: ACL graphs in that cudagraph_mode, the "
        "release's own compilation otherwise; FAIL unless every judged run captured graphs in that mode and replayed "
        "them, and each applied graph patch counted its work",
    )
    mod = st.add_argument_group(
        "on your model (--engine --model PATH ... -- <vLLM engine arguments>)",
        "Your model with your engine arguments, after `--` as vLLM's CLI spells them (parsed by vLLM's own "
        "parser; --model, --async-scheduling and --speculative-config there are refused; --data-parallel-size N: N "
        "engine processes per run, vLLM's offline data-parallel form). The tiny-model self-test "
        "runs first (the strict check, its drafter, k and graph mode following the deployment), then each "
        "configuration of --configs in its own engine process, greedy. Verdict (docs/selftest.md, 'On your model'): "
        "the strict check passed; the two async+fixes runs give the noise floor; each zero-bubble run against "
        "async+fixes must be exact where the floor is exact, else within the floor plus 5% of the requests diverging "
        "and 0.02 acceptance rate; over steps with identical schedules and histories the sampled tokens agree (a "
        "note where the floor breaks that too); every async run scheduled asynchronously, zero-bubble active and "
        "correcting where configured, off in async+fixes, each async+zb+<id> run's patch applied; in a graph mode "
        "graphs captured, decode replays > 0 in that mode and each applied graph patch's work counted. FAIL names "
        "the first diverging request and position. Progress on stderr (logger vllm.zb_patch.selftest), the report "
        "on stdout. Exit 0 PASS (or PASS-WITHOUT-STRICT-CHECK), 1 FAIL, 2 refused / no NPU.",
    )
    mod.add_argument("--model", metavar="PATH", help="your model directory (as vLLM's --model takes it)")
    mod.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='vLLM\'s --speculative-config, e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\'',
    )
    mod.add_argument(
        "--prompts", metavar="FILE", help='one prompt per line, or JSONL with "prompt" (default: generated token ids)'
    )
    mod.add_argument("--num-prompts", type=int, default=64, help="prompts used (default 64; 0 with --prompts: all)")
    mod.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (default 128)")
    mod.add_argument(
        "--configs",
        type=lambda text: [c.strip() for c in text.split(",") if c.strip()],
        default=["async+fixes", "async+fixes", "async+zb"],
        metavar="LIST",
        help="runs, comma-separated (default async+fixes,async+fixes,async+zb; async+fixes twice is required: the "
        "noise floor); also sync, async (classic, zb-patch off), async+zb+<opt-in id> (ZB_PATCH_ENABLE=<id>)",
    )
    mod.add_argument("--repeats", type=int, default=1, help="run every configuration N times (speed: median, spread)")
    mod.add_argument("--report", metavar="DIR", help="write report.md, report.json and every run's result under DIR")
    mod.add_argument(
        "--skip-tiny-check",
        action="store_true",
        help="(developers) leave out the tiny-model strict check; the verdict then reads PASS-WITHOUT-STRICT-CHECK",
    )
    mod.add_argument("engine_args", nargs="*", metavar="-- ENGINE_ARGS", help="vLLM engine arguments, after --")
    st.set_defaults(func=cmd_selftest)

    t = sub.add_parser("supported", help="print the supported-versions table (generated from the adapter table)")
    t.add_argument("--markdown", action="store_true", help="markdown table")
    t.add_argument("--brief", action="store_true", help="with --markdown: patch counts, not ids (as in README.md)")
    t.set_defaults(func=cmd_supported)

    lp = sub.add_parser(
        "patches", help="list every adapter's patches and guards: target, why, how, upstream, remove-when, fingerprints"
    )
    lp.add_argument("--adapter", help="only this adapter id")
    lp.add_argument(
        "--markdown",
        action="store_true",
        help="the reference block docs/releases/<adapter>.md embeds (generated from the specs)",
    )
    lp.add_argument(
        "--shared",
        action="store_true",
        help=f"with --markdown: the block docs/releases/{SHARED_PAGE} embeds (texts patches of several adapters share)",
    )
    lp.set_defaults(func=cmd_patches)

    f = sub.add_parser(
        "fingerprints",
        help="(maintainers) recompute adapter fingerprints from a source tree",
        description="Compute the fingerprint of every adapter target from a source tree that is "
        "never imported (site-packages, an unpacked wheel, a git checkout) and say "
        "whether it is recorded.",
    )
    f.add_argument("--root", required=True, help="directory that contains the vllm / vllm_ascend packages")
    f.add_argument("--adapter", help="only this adapter id")
    f.add_argument("--only", nargs="*", help="only targets in modules with these prefixes (e.g. vllm_ascend)")
    f.add_argument(
        "--check",
        action="store_true",
        help="exit 3 unless every target of one adapter (or every native form) is recorded in the tree",
    )
    f.set_defaults(func=cmd_fingerprints)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    _setup_logging(args.verbose)
    return run_command(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
