"""Mutation testing of zb-patch's per-step path and fixes with mutmut (docs/mutation.md).

Runs inside a va env that has mutmut (tox envs ``mutation-va018`` / ``-va013`` / ``-va019`` / ``-va025``;
``mutation`` runs the CI sample). mutmut keeps its state in ``mutants/`` under the directory it runs in, so each env
works in its own copy of the tree, ``.mutation/<env>/`` (git-ignored): ``zb_patch/``, ``tests/`` and a
``pyproject.toml`` holding the repository's ``[tool.mutmut]`` (what is mutated, what is left alone, the killers) and
pytest settings. A second run in the same directory that names no mutant reuses mutmut's results for every function
whose source did not change; named mutants (and globs) run again.

    python tests/mutation/run.py [--max-children N] [--tests NODE ...] [--json PATH] [MUTANT ...]
    python tests/mutation/run.py --sample            # the CI sample (SAMPLE below): fails unless every one is killed

``MUTANT`` names (or ``module.function*`` globs, mutmut's syntax) rerun just those mutants. ``--tests`` replaces the
killer selection of ``[tool.mutmut]``. ``--json`` writes every mutant's class and content. ``--report`` classifies
the statuses of ``.mutation/<env>/`` (or of several envs: ``--combine``) without running anything.

Single mutants are named by content everywhere (tests/mutation/keys.py): mutmut numbers a function's mutants in
source order, so an edit anywhere in a function renumbers them.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).parent))
from keys import Key, content_keys  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CLASSES = Path(__file__).with_name("classes.toml")

# The CI sample (tox -e mutation), by content: mutants of every part of the per-step path that a killer must kill,
# chosen among the ones the full run found killed only by the parity harness or by a test written for a survivor;
# to them --sample adds mutants of the functions the last commit changed (touched_mutants). Fails unless every one
# is killed; bounded to a few minutes on a 2-core CPU.
SAMPLE_TESTS = [
    "tests/unit/test_zero_bubble.py",
    "tests/patches/test_runner_parity.py::test_parity_scheduler_edge_cases",
]
_RUNNER = "zb_patch/versions/npu_runner.py::"
SAMPLE = [
    # killed by the parity harness (the release's runner diverges or waits where it must not)
    Key(_RUNNER + "ZeroBubble.device_correction", "if not correct:", "if correct:"),  # corrections on exact steps
    Key(
        _RUNNER + "ZeroBubble.device_correction",  # previous rows not remapped
        "zero_bubble.compute_prev_positions(batch.req_ids, batch.prev_req_id_to_index, n, b.prev_positions.np)",
        "zero_bubble.compute_prev_positions(None, batch.prev_req_id_to_index, n, b.prev_positions.np)",
    ),
    Key(_RUNNER + "ZeroBubble.exact_host_counts", "if st.valid_host is None:", "if st.valid_host is not None:"),
    # killed only by tests written for survivors (docs/mutation.md)
    Key(
        _RUNNER + "ZeroBubble.make_update_states",  # optimistic count drafts + 2
        "values[row] = req_state.prev_num_draft_len + 1",
        "values[row] = req_state.prev_num_draft_len + 2",
    ),
    Key(
        _RUNNER + "ZeroBubble.make_update_states",  # a row past the previous batch
        "if req_state is not None and 0 <= row < st.num_prev:",
        "if req_state is not None and 0 < row < st.num_prev:",
    ),
    Key(
        "zb_patch/zero_bubble/counts.py::deferred_cpu_corrections",  # a row past the counts (deferred)
        "ok = (prev >= 0) & (prev < bound)",
        "ok = (prev >= 0) & (prev <= bound)",
    ),
    Key(_RUNNER + "slot_mapper", "entry = buffers.slot_mappers.get(key)", "entry = None"),  # one mapper per table
    Key(
        "zb_patch/zero_bubble/batch.py::remap_accepted_counts",  # stale rows past num_prev
        "in_prev = (prev >= 0) & (prev < bound)",
        "in_prev = (prev >= 0) & (prev <= bound)",
    ),
    Key(
        _RUNNER + "ZeroBubble.device_correction",  # the step's one upload stops short of query_pos
        "b.staging.copy_to_gpu(b.query_pos_at + total)  # every section this step reads, prev_drafts included",
        "b.staging.copy_to_gpu(b.query_pos_at - total)  # every section this step reads, prev_drafts included",
    ),
    Key(
        "zb_patch/zero_bubble/counts.py::backup_next_token_ids",  # the last column of a full row
        "safe = np.clip(idx, 0, token_ids_cpu.shape[1] - 1)",
        "safe = np.clip(idx, 0, token_ids_cpu.shape[1] - 2)",
    ),
]
# The full run (docs/mutation.md, "Results"): every mutated file in one or more groups, each run in the env of one
# release (the tox env ``mutation-va0xx``) with the killers that reach its files; ``--group NAME`` runs one in
# ``.mutation/plan-NAME/``, ``--combine-groups`` reports them together. A fix shared by several releases is mutated in
# one group; its survivors are rerun in the others' envs by name (killed in any env: killed). The runner and the
# kernels run on 0.18, the runner again on 0.13 for what only its count base "cpu" reaches.
_PATCH_TESTS_018 = (
    "tests/patches/test_async_penalty_output_tokens.py",
    "tests/patches/test_cudagraph_sizes_after_rounding.py",
    "tests/patches/test_draft_placeholders_after_metadata.py",
    "tests/patches/test_draft_sample_indices_past_batch.py",
    "tests/patches/test_draft_seq_lens_values.py",
    "tests/patches/test_exact_counts_after_early_output.py",
    "tests/patches/test_fix_patches.py",
    "tests/patches/test_graph_modes.py",
    "tests/patches/test_mla_draft_rope_rows.py",
    "tests/patches/test_mtp_draft_graph_k_replays.py",
    "tests/patches/test_npu_graph_double.py",
    "tests/patches/test_placeholder_accounting.py",
    "tests/patches/test_reset_marks.py",
    "tests/patches/test_stale_draft_placeholders.py",
    "tests/unit/test_graph_replay.py",
)


@dataclass(frozen=True)
class Group:
    release: str  # the vllm-ascend release of its env (a version prefix)
    files: tuple[str, ...]  # what it mutates (globs of [tool.mutmut] only_mutate's form)
    tests: tuple[str, ...]  # killers


def _fixes(*names: str) -> tuple[str, ...]:
    return tuple(f"zb_patch/versions/fixes/{name}.py" for name in names)


GROUPS = {
    "kernels": Group(
        "0.18",
        tuple(
            f"zb_patch/kernels/{n}.py"
            for n in ("__init__", "_launch", "reference", "seq_lens_cpu", "slot_mapping", "token_counts")
        )
        + ("zb_patch/zero_bubble/*.py",),
        ("tests/kernels", "tests/unit/test_zero_bubble.py"),
    ),
    "runner": Group(
        "0.18",
        ("zb_patch/versions/npu_runner.py",),
        (
            "tests/patches/test_runner_parity.py",
            "tests/patches/test_npu_graph_double.py",
            "tests/patches/test_placeholder_accounting.py",
            "tests/patches/test_sampling_fields.py",
            "tests/unit/test_zero_bubble.py",
        ),
    ),
    "fixes-va018": Group(
        "0.18",
        (
            "zb_patch/versions/ascend_0_18.py",
            *_fixes(
                "async_penalty_output_tokens",
                "cudagraph_batch_sizes_after_rounding",
                "draft_placeholders_after_metadata",
                "draft_sample_indices_past_batch",
                "draft_seq_lens_max_model_len",
                "exact_counts_after_early_output",
                "graph_replay",
                "mla_draft_rope_rows",
                "mtp_draft_graph_k_replays",
                "reset_prefix_cache_in_flight",
                "stale_draft_placeholders",
            ),
        ),
        _PATCH_TESTS_018,
    ),
    "va013": Group(
        "0.13",
        (
            "zb_patch/versions/ascend_0_13.py",
            *_fixes("mtp_draft_lengths", "mtp_draft_slots", "readded_request_drafts", "rejection_negative_drafts"),
        ),
        (  # tests/patches first: its conftest sets up vLLM's CPU platform before anything imports the workers
            "tests/patches/test_mtp_draft_lengths.py",
            "tests/patches/test_mtp_draft_slots_values.py",
            "tests/patches/test_readded_request_drafts.py",
            "tests/patches/test_rejection_negative_drafts.py",
            "tests/patches/test_runner_parity.py",
            "tests/unit/test_zero_bubble.py",
        ),
    ),
    "va019": Group(
        "0.19",
        (
            "zb_patch/versions/ascend_0_19_0_25.py",
            *_fixes(
                "seq_lens_cpu_prepare_inputs_padded",
                "seq_lens_cpu_unpadded",
                "valid_count_copy_order",
                "valid_count_int64",
            ),
        ),
        (
            "tests/patches/test_seq_lens_cpu_mirrors.py",
            "tests/patches/test_slot_mapping_patch.py",
            "tests/patches/test_valid_count_copy.py",
            "tests/patches/test_fix_patches.py",
        ),
    ),
    "va025": Group("0.25", ("zb_patch/versions/ascend_0_19_0_25.py",), ("tests/patches/test_slot_mapping_patch.py",)),
    "runner-va013": Group(
        "0.13",
        ("zb_patch/versions/npu_runner.py",),
        ("tests/patches/test_runner_parity.py", "tests/unit/test_zero_bubble.py"),
    ),
}


# as [tool.mutmut]: the 10k-step run and the planted mistakes are no killers
KILLER_FILTER = ["-k", "not 10k and not planted"]
TOUCHED_PER_RUN = 6  # mutants of the last commit's changed functions that the sample adds


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return f"'{value}'" if "'" not in value and "\n" not in value else json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(value)


def _table(name: str, values: dict) -> str:
    return f"[{name}]\n" + "".join(f"{key} = {_toml_value(v)}\n" for key, v in values.items())


def module_file(mutant: str) -> str:
    """``zb_patch.versions.npu_runner.xǁZeroBubbleǁcorrect__mutmut_3`` -> ``zb_patch/versions/npu_runner.py``."""
    module = mutant.split(".x_")[0].split(".xǁ")[0]
    path = module.replace(".", "/")
    return path + ("/__init__.py" if (ROOT / path).is_dir() else ".py")


# Functions that declare rather than run: each fix module's spec factory (``patch`` / ``patches``) builds the patch
# specs once at import, data like the adapter tables (which are module-level and never mutated). What they declare
# is checked against every release by the contract and lifecycle tests, not by the per-step killers; a mutant there
# would be reported as a survivor of tests that never look at it. In the work directory their signatures end in
# mutmut's ``# pragma: no mutate block`` (graph_replay names its three spec factories).
DECLARATIONS = (
    "zb_patch/versions/fixes/*.py::patch",
    "zb_patch/versions/fixes/*.py::patches",
    "zb_patch/versions/fixes/graph_replay.py::piecewise_drain_once_per_step",
    "zb_patch/versions/fixes/graph_replay.py::piecewise_replay_without_host_drain",
    "zb_patch/versions/fixes/graph_replay.py::full_replay_ordered_on_device",
    "zb_patch/versions/fixes/min_tokens_draft_placeholders.py::advisory",
    "zb_patch/versions/fixes/reset_prefix_cache_in_flight.py::guard",
)


def _rewrite(path: Path, lines: list[str]) -> None:
    """Write a rewritten work copy. mutmut regenerates a file's mutants when the source is newer than its mutants:
    the copy keeps the original's time unless this script is newer (a changed rewrite must regenerate them)."""
    stamp = max(path.stat().st_mtime_ns, Path(__file__).stat().st_mtime_ns)
    path.write_text("".join(lines))
    os.utime(path, ns=(stamp, stamp))


def _leave_declarations_alone(work: Path) -> None:
    for pattern in DECLARATIONS:
        files, function = pattern.split("::")
        for path in sorted(work.glob(files)):
            text = path.read_text()
            lines = text.splitlines(keepends=True)
            nodes = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == function]
            for node in nodes:
                header = node.body[0].lineno - 2  # the line that ends the signature with ":" (a docstring follows)
                if not lines[header].rstrip().endswith(":"):
                    raise SystemExit(f"{path}:{header + 1}: expected the end of {function}'s signature")
                lines[header] = lines[header].rstrip() + "  # pragma: no mutate block\n"
            if nodes:
                _rewrite(path, lines)


REWRITTEN_DECORATOR = re.compile(r"(\w+) = functools\.wraps\(original\)\(\1\)$")


def _undecorate_wraps(work: Path) -> None:
    """mutmut leaves decorated functions alone, and every fix's wrapper is a closure decorated with
    ``@functools.wraps(original)``. In the work copy of ``versions/fixes/`` the decorator becomes a call right after
    the ``def`` (``name = functools.wraps(original)(name)``: the same function object), so the wrappers' bodies are
    mutated."""
    for path in sorted(work.glob("zb_patch/versions/fixes/*.py")):
        text = path.read_text()
        lines = text.splitlines(keepends=True)
        found = [
            (node, dec)
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.FunctionDef)
            for dec in node.decorator_list
            if ast.unparse(dec).startswith("functools.wraps(")
        ]
        if not found:
            continue
        for node, dec in sorted(found, key=lambda f: -f[0].lineno):  # bottom-up: earlier line numbers stay valid
            if len(node.decorator_list) != 1 or dec.lineno != dec.end_lineno:
                raise SystemExit(f"{path}:{node.lineno}: only a lone one-line functools.wraps decorator is rewritten")
            indent = lines[node.lineno - 1][: node.col_offset]
            call = f"{node.name} = {ast.unparse(dec)}({node.name})"
            lines.insert(node.end_lineno, f"{indent}{call}  # pragma: no mutate\n")  # a decorator is not mutated either
            del lines[dec.lineno - 1]
        _rewrite(path, lines)


def prepare(work: Path, tests: list[str] | None, only: list[str] | None = None) -> dict:
    """The work directory: a copy of ``zb_patch/`` and ``tests/`` (modification times kept: mutmut reuses results of
    unchanged functions) and the configuration (``tests``: another killer selection; ``only``: mutate just these
    files)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mutmut = dict(config["tool"]["mutmut"])
    if tests:
        mutmut["pytest_add_cli_args_test_selection"] = [*tests, *KILLER_FILTER]
    if only:
        mutmut["only_mutate"] = only
    work.mkdir(parents=True, exist_ok=True)
    for name in ("zb_patch", "tests"):
        target = work / name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(
            ROOT / name,
            target,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis"),
            copy_function=shutil.copy2,
        )
    _leave_declarations_alone(work)
    _undecorate_wraps(work)
    text = (
        _table("tool.mutmut", mutmut)
        + "\n"
        + _table("tool.pytest.ini_options", config["tool"]["pytest"]["ini_options"])
    )
    (work / "pyproject.toml").write_text(text)
    return mutmut


def ran_other_killers(group: str) -> bool:
    """Whether the group's work directory holds results of another killer selection than GROUPS gives it (a run
    before the group's killers changed): mutmut keeps results whose function did not change, so such a directory's
    survivors say nothing about the group's killers."""
    config = tomllib.loads((ROOT / ".mutation" / f"plan-{group}" / "pyproject.toml").read_text())["tool"]["mutmut"]
    return config["pytest_add_cli_args_test_selection"] != [*GROUPS[group].tests, *KILLER_FILTER]


def statuses(work: Path) -> dict[str, str]:
    """Every mutant's status from mutmut's ``mutants/**/*.py.meta`` files."""
    from mutmut.stats import status_by_exit_code

    out = {}
    for meta in sorted((work / "mutants").rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        for name, code in data.get("exit_code_by_key", {}).items():
            out[name] = status_by_exit_code[code]
    return out


# a mutant run in several envs: the first of these statuses that any env gave it
PRECEDENCE = (
    "killed",
    "timeout",
    "caught by type check",
    "segfault",
    "suspicious",
    "survived",
    "not checked",  # an env that can reach it has not run it yet: not a verdict, whatever the others say
    "no tests",
    "skipped",
)


def combine(per_env: list[dict[str, str]]) -> dict[str, str]:
    """One status per mutant over several envs' runs (killed in any env: killed)."""
    out: dict[str, str] = {}
    for name in sorted(set().union(*per_env)):
        seen = {statuses.get(name, "not checked") for statuses in per_env}
        out[name] = next((s for s in PRECEDENCE if s in seen), "not checked")
    return out


# mutmut's statuses -> the classes reported (docs/mutation.md); survivors that classes.toml explains become
# "equivalent" or "not testable here"
CLASS_OF_STATUS = {
    "killed": "killed",
    "caught by type check": "killed",
    "segfault": "killed",  # the test process died on the mutant: a kill
    "timeout": "timeout",
    "suspicious": "timeout",
    "survived": "survived",
    "no tests": "survived",  # no killer reaches the function
}
CLASS_ORDER = ("killed", "survived", "equivalent", "not testable here", "timeout", "not run")


def explained() -> dict[Key, tuple[str, dict]]:
    """tests/mutation/classes.toml: content key -> ("equivalent" | "not testable here", the entry)."""
    data = tomllib.loads(CLASSES.read_text())
    out: dict[Key, tuple[str, dict]] = {}
    for table, cls in (("equivalent", "equivalent"), ("device_only", "not testable here")):
        for entry in data.get(table, []):
            key = Key.from_entry(entry)
            if key in out:
                raise SystemExit(f"{CLASSES.name}: {key.describe()} is listed twice")
            out[key] = (cls, entry)
    return out


def classify(result: dict[str, str], keys: dict[str, Key]) -> tuple[dict[str, str], list[str]]:
    """Each mutant's class, and the problems with classes.toml: an entry whose mutant a killer kills (its claim is
    wrong) or that names no mutant of a file the run mutated."""
    known = explained()
    classes, problems = {}, []
    for name, status in result.items():
        cls = CLASS_OF_STATUS.get(status, "not run")
        entry = known.get(keys[name]) if name in keys else None
        if entry and cls == "survived":
            cls = entry[0]
        elif entry and cls == "killed":
            problems.append(f"listed as {entry[0]} but killed: {name} ({keys[name].describe()})")
        classes[name] = cls
    mutated = {k.where.split("::")[0] for k in keys.values()}
    present = set(keys.values())
    for key in known:
        if key.where.split("::")[0] in mutated and key not in present:
            problems.append(f"{CLASSES.name} names no mutant of this tree: {key.describe()}")
    return classes, problems


def _git(*args: str) -> str | None:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def _functions(tree: ast.Module) -> list[tuple[str, int, int]]:
    """(qualname, first line, last line) of every function and method of a module."""
    out = []

    def visit(body: list, prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, prefix + node.name + ".")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((prefix + node.name, node.lineno, node.end_lineno or node.lineno))

    visit(tree.body, "")
    return out


def changed_functions(since: str, files: list[str]) -> set[str] | None:
    """``<file>::<qualname>`` of every function of ``files`` whose lines changed since ``since`` (a git ref); None
    where git cannot tell (no repository, or a shallow clone without ``since``)."""
    if _git("rev-parse", "--verify", "--quiet", f"{since}^{{commit}}") is None:
        return None
    out: set[str] = set()
    for path in files:
        diff = _git("diff", "-U0", since, "HEAD", "--", path)
        if diff is None:
            return None
        lines = set()
        for start, count in re.findall(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", diff, re.M):
            lines.update(range(int(start), int(start) + max(int(count or 1), 1)))  # a deletion: the line above it
        for name, first, last in _functions(ast.parse((ROOT / path).read_text())) if lines else ():
            if lines & set(range(first, last + 1)):
                out.add(f"{path}::{name}")
    return out


def mutated_files(config: dict) -> list[str]:
    """The files ``[tool.mutmut] only_mutate`` names, relative to the repository."""
    return sorted({str(p.relative_to(ROOT)) for pattern in config["only_mutate"] for p in ROOT.glob(pattern)})


def touched_mutants(keys: dict[str, Key], functions: set[str], count: int) -> list[str]:
    """Up to ``count`` mutants of ``functions``, chosen by their content's hash (the same mutations on every run of
    the same code), leaving out the ones classes.toml explains."""
    known = explained()
    candidates = [n for n, k in keys.items() if k.where in functions and k not in known]
    return sorted(candidates, key=lambda n: hashlib.sha256(keys[n].describe().encode()).hexdigest())[:count]


def killers_of(files: set[str], selection: list[str]) -> list[str]:
    """The test files of ``selection`` (files or folders) whose text names one of ``files``' modules."""
    tests = []
    for item in selection:
        if item.startswith("-") or "::" in item or not (ROOT / item).exists():
            continue
        candidates = [ROOT / item] if (ROOT / item).is_file() else sorted((ROOT / item).rglob("test_*.py"))
        for test in candidates:
            text = test.read_text()
            if any((Path(f).parent.name if Path(f).stem == "__init__" else Path(f).stem) in text for f in files):
                tests.append(str(test.relative_to(ROOT)))
    return tests


def resolve(wanted: list[Key], keys: dict[str, Key]) -> list[str]:
    by_key = {k: n for n, k in keys.items()}
    missing = [k.describe() for k in wanted if k not in by_key]
    if missing:
        raise SystemExit(
            "the sample names mutants this tree does not have (update SAMPLE in tests/mutation/run.py):\n  "
            + "\n  ".join(missing)
        )
    return [by_key[k] for k in wanted]


def keys_in(work: Path, files: list[str]) -> dict[str, Key]:
    """Content keys of ``files``' mutants, generated in ``work`` (its mutmut configuration)."""
    here = os.getcwd()
    os.chdir(work)
    try:
        return content_keys(files, cache=work / "keys.json")
    finally:
        os.chdir(here)


def markdown_table(classes: dict[str, str], keys: dict[str, Key]) -> str:
    """The classes per mutated file (docs/mutation.md, "Results")."""
    per_file: dict[str, Counter] = {}
    for name, cls in classes.items():
        per_file.setdefault(keys[name].where.split("::")[0], Counter())[cls] += 1
    total = sum(per_file.values(), Counter())
    rows = [
        "| file (`zb_patch/`, `versions/`) | mutants | " + " | ".join(CLASS_ORDER) + " |",
        "|---|" + "---|" * (len(CLASS_ORDER) + 1),
    ]
    for path, counts in [*sorted(per_file.items()), ("all", total)]:
        label = "**all**" if path == "all" else f"`{path.removeprefix('zb_patch/').removeprefix('versions/')[:-3]}`"
        cells = " | ".join(str(counts[c]) for c in CLASS_ORDER)
        rows.append(f"| {label} | {sum(counts.values())} | {cells} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mutants", nargs="*")
    parser.add_argument("--env", default=os.environ.get("TOX_ENV_NAME", "local"))
    parser.add_argument("--max-children", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--tests", nargs="+", help="killers instead of [tool.mutmut]'s (the same -k filter)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--sample", action="store_true", help="run the CI sample; exit 1 unless every one is killed")
    parser.add_argument("--since", default="HEAD~1", help="--sample: add mutants of what changed since this git ref")
    parser.add_argument("--report", action="store_true", help="only classify the statuses of the last run")
    parser.add_argument("--prepare", action="store_true", help="only write the work directory")
    parser.add_argument("--keep", action="store_true", help="run in the work directory as it is (no fresh copy)")
    parser.add_argument("--combine", nargs="+", metavar="ENV", help="report the statuses of these envs' runs together")
    parser.add_argument("--table", action="store_true", help="print the classes per file as a markdown table")
    parser.add_argument("--group", choices=GROUPS, help="run one group of the full run (GROUPS) in its release's env")
    parser.add_argument("--combine-groups", action="store_true", help="report the full run's groups together")
    args = parser.parse_args(argv)
    if args.group:
        group = GROUPS[args.group]
        from packaging.version import Version

        from installed_release import RELEASE  # tests/support (on the va envs' PYTHONPATH)

        if Version(RELEASE).release[:2] != Version(group.release).release:
            raise SystemExit(f"group {args.group} runs on vllm-ascend {group.release}; this env has {RELEASE}")
        if args.tests:  # mutmut resets every result of a work directory whose configuration (the killers) changed
            raise SystemExit(f"--group {args.group} runs its own killers (GROUPS): add a test there, not with --tests")
        args.env = f"plan-{args.group}"
        args.tests = list(group.tests)
    if args.combine_groups:
        args.combine = [f"plan-{name}" for name in GROUPS if (ROOT / ".mutation" / f"plan-{name}").is_dir()]
        other = [env for env in args.combine if ran_other_killers(env.removeprefix("plan-"))]
        if other:
            raise SystemExit(f"{', '.join(other)}: ran other killers than GROUPS names; rerun with --group")

    work = ROOT / ".mutation" / args.env
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    mutants = list(args.mutants)
    tests = args.tests
    # a group mutates its files only and, without names, runs what has no result yet (new or changed functions, or
    # what a stopped run did not reach); named mutants run again
    only = list(GROUPS[args.group].files) if args.group else None
    touched_names: set[str] = set()
    if args.sample:
        functions = changed_functions(args.since, mutated_files(config))
        if functions is None:
            print(f"sample: git cannot tell what changed since {args.since} here: the fixed mutants only", flush=True)
            functions = set()
        sample_files = {k.where.split("::")[0] for k in SAMPLE}
        touched_files = {f.split("::")[0] for f in functions}
        only = sorted(sample_files | touched_files)
        selection = config["pytest_add_cli_args_test_selection"]
        tests = tests or [*SAMPLE_TESTS, *killers_of(touched_files, selection)]
        prepare(work, tests, only)
        args.keep = True
        keys = keys_in(work, only)
        touched = touched_mutants(keys, functions, TOUCHED_PER_RUN)
        print(
            f"sample: {len(SAMPLE)} fixed mutants; changed since {args.since}: {len(functions)} mutated functions, "
            f"{len(touched)} of their mutants added",
            flush=True,
        )
        for name in touched:
            print(f"  + {keys[name].describe()}", flush=True)
        mutants = mutants or resolve(SAMPLE, keys) + touched
        touched_names = set(touched)
        args.max_children = max(args.max_children, 2)
    if args.prepare:
        prepare(work, tests, only)
        return 0
    if not args.report and not args.combine:
        if not args.keep:
            prepare(work, tests, only)
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
        started = time.time()
        cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children), *mutants]
        print("+", " ".join(cmd), f"(in {work})", flush=True)
        rc = subprocess.call(cmd, cwd=work, env=env)
        print(f"mutmut exited {rc} after {time.time() - started:.0f} s", flush=True)
        if rc != 0:
            return rc
    envs = args.combine or [args.env]
    per_env = {env: statuses(ROOT / ".mutation" / env) for env in envs}
    result = combine(list(per_env.values()))
    if mutants:
        result = {k: v for k, v in result.items() if any(fnmatch.fnmatch(k, m) or k == m for m in mutants)}
    if args.group:
        result = {k: v for k, v in result.items() if any(fnmatch.fnmatch(module_file(k), f) for f in only or ())}
    if args.sample:  # a changed function this release never runs (another family's fix): its env has to judge it
        for name in sorted(n for n in touched_names if result.get(n) == "no tests"):
            print(f"  not reached on this release (run its mutation-va0xx env): {name}", flush=True)
            del result[name]
    # a mutant's content from the work copy of the env that ran it (each env copied the tree when it ran), the rest
    # from the first env's
    keys: dict[str, Key] = {}
    for env, env_statuses in per_env.items():
        ran = {n for n, s in env_statuses.items() if s != "not checked" and n in result}
        if ran:
            env_keys = keys_in(ROOT / ".mutation" / env, sorted({module_file(n) for n in ran}))
            keys.update({n: env_keys[n] for n in ran - keys.keys() if n in env_keys})
    rest = sorted({module_file(n) for n in result if n not in keys})
    if rest:
        keys.update({n: k for n, k in keys_in(ROOT / ".mutation" / envs[0], rest).items() if n not in keys})
    stale = [n for n in result if n not in keys]  # recorded by a run of another work copy (an older rewrite)
    if stale:
        print(f"left out: {len(stale)} mutants that the work copies of {envs} no longer have (rerun those envs)")
        result = {n: s for n, s in result.items() if n in keys}
    declared = [  # mutated by a run from before the function was listed or the line marked
        n
        for n in result
        if any(fnmatch.fnmatchcase(keys[n].where, d) for d in DECLARATIONS) or REWRITTEN_DECORATOR.match(keys[n].was)
    ]
    if declared:
        print(f"left out: {len(declared)} mutants of DECLARATIONS and of rewritten decorators")
        result = {n: s for n, s in result.items() if n not in declared}
    classes, problems = classify(result, keys)
    counts = Counter(classes.values())
    print("mutants:", len(classes), {c: counts[c] for c in CLASS_ORDER if counts[c]})
    for name, cls in sorted(classes.items()):
        if cls in ("survived", "timeout") or (args.sample and cls != "killed"):
            print(f"  {cls:10} {name}: {keys[name].describe()}")
    for problem in problems if not args.sample else []:
        print("  classes.toml:", problem)
    if args.table:
        print(markdown_table(classes, keys))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "env": envs,
                    "counts": {c: counts[c] for c in CLASS_ORDER},
                    "mutants": {n: {"class": c, "mutmut": result[n], **keys[n].__dict__} for n, c in classes.items()},
                    "classes_toml_problems": problems,
                },
                indent=1,
                sort_keys=True,
            )
        )
    if args.sample:
        return 0 if classes and set(classes.values()) == {"killed"} else 1
    return 1 if counts["survived"] or problems else 0


if __name__ == "__main__":
    sys.exit(main())
