"""Mutation testing of the zero-bubble per-step path with mutmut (docs/mutation.md).

Runs inside a va env that has mutmut (tox envs ``mutation-va018`` / ``mutation-va013``; ``mutation`` runs the fixed
CI sample). mutmut keeps its state in ``mutants/`` under the directory it runs in, so each env works in its own copy
of the tree, ``.mutation/<env>/`` (git-ignored): ``zb_patch/``, ``tests/`` and a ``pyproject.toml`` holding the
repository's ``[tool.mutmut]`` (what is mutated, what is left alone, the killers) and pytest settings. A second run in
the same directory reuses mutmut's results for every function whose source did not change.

    python tests/mutation/run.py [--max-children N] [--tests NODE ...] [--json PATH] [MUTANT ...]
    python tests/mutation/run.py --sample            # the CI sample (SAMPLE below): fails if one survives

``MUTANT`` names (or ``module.function*`` globs, mutmut's syntax) rerun just those mutants. ``--tests`` replaces the
killer selection of ``[tool.mutmut]``. ``--json`` writes every mutant's status (mutmut's verdict per mutant).
``--report`` reads the statuses of ``.mutation/<env>/`` without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


# The CI sample (tox -e mutation): mutants of every part of the per-step path that a killer must kill, chosen among
# the ones the full run found killed only by the parity harness or by a test written for a survivor. Fails if one
# survives; bounded to a couple of minutes on the 2-core CI box.
SAMPLE_TESTS = [
    "tests/unit/test_zero_bubble.py",
    "tests/patches/test_runner_parity.py::test_parity_scheduler_edge_cases",
]
SAMPLE = [
    # killed by the parity harness (the release's runner diverges or waits where it must not)
    "zb_patch.versions.npu_runner.xǁZeroBubbleǁdevice_correction__mutmut_30",  # corrections skipped on corrected steps
    "zb_patch.versions.npu_runner.xǁZeroBubbleǁdevice_correction__mutmut_36",  # previous rows not remapped
    "zb_patch.versions.npu_runner.xǁZeroBubbleǁexact_host_counts__mutmut_2",  # exact CPU counts without the wait
    # killed only by tests written for survivors (docs/mutation.md)
    "zb_patch.versions.npu_runner.xǁZeroBubbleǁmake_update_states__mutmut_68",  # optimistic count drafts + 2
    "zb_patch.versions.npu_runner.xǁZeroBubbleǁmake_update_states__mutmut_65",  # a row past the previous batch
    "zb_patch.zero_bubble.counts.x_deferred_cpu_corrections__mutmut_26",  # a row past the counts (deferred)
    "zb_patch.versions.npu_runner.x_slot_mapper__mutmut_3",  # one slot mapper per block table
    "zb_patch.zero_bubble.batch.x_remap_accepted_counts__mutmut_17",  # stale rows past num_prev
    "zb_patch.zero_bubble.device.x__subtract_rejected__mutmut_21",  # the same, base="cpu"
    "zb_patch.zero_bubble.counts.x_backup_next_token_ids__mutmut_19",  # the last column of a full row
]


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


def prepare(work: Path, tests: list[str] | None, only: list[str] | None = None) -> dict:
    """The work directory: a copy of ``zb_patch/`` and ``tests/`` (modification times kept: mutmut reuses results of
    unchanged functions) and the configuration (``tests``: another killer selection; ``only``: mutate just these
    files)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mutmut = dict(config["tool"]["mutmut"])
    if tests:
        mutmut["pytest_add_cli_args_test_selection"] = tests
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
    text = (
        _table("tool.mutmut", mutmut)
        + "\n"
        + _table("tool.pytest.ini_options", config["tool"]["pytest"]["ini_options"])
    )
    (work / "pyproject.toml").write_text(text)
    return mutmut


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
PRECEDENCE = ("killed", "timeout", "caught by type check", "segfault", "suspicious", "survived", "no tests", "skipped")


def combine(per_env: list[dict[str, str]]) -> dict[str, str]:
    """One status per mutant over several envs' runs (killed in any env: killed)."""
    out: dict[str, str] = {}
    for name in sorted(set().union(*per_env)):
        seen = {statuses.get(name, "not checked") for statuses in per_env}
        out[name] = next((s for s in PRECEDENCE if s in seen), "not checked")
    return out


def equivalents() -> dict[str, str]:
    """tests/mutation/equivalent.toml: mutant name or fnmatch pattern -> why no test can kill it."""
    return tomllib.loads((Path(__file__).with_name("equivalent.toml")).read_text())


def classify(result: dict[str, str]) -> dict[str, str]:
    """Survivors that equivalent.toml explains become "equivalent"."""
    import fnmatch

    known = equivalents()
    return {
        name: "equivalent"
        if status == "survived" and any(name == k or fnmatch.fnmatchcase(name, k) for k in known)
        else status
        for name, status in result.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mutants", nargs="*")
    parser.add_argument("--env", default=os.environ.get("TOX_ENV_NAME", "local"))
    parser.add_argument("--max-children", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--tests", nargs="+")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--sample", action="store_true", help="run the CI sample; exit 1 if a mutant survives")
    parser.add_argument("--report", action="store_true", help="only read the statuses of the last run (or --combine)")
    parser.add_argument("--prepare", action="store_true", help="only write the work directory")
    parser.add_argument("--keep", action="store_true", help="run in the work directory as it is (no fresh copy)")
    parser.add_argument("--combine", nargs="+", metavar="ENV", help="report the statuses of these envs' runs together")
    args = parser.parse_args(argv)

    work = ROOT / ".mutation" / args.env
    mutants = list(args.mutants)
    tests = args.tests
    only = None
    if args.sample:
        mutants, tests = mutants or SAMPLE, tests or SAMPLE_TESTS
        only = sorted({module_file(m) for m in mutants})
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
    envs = args.combine or [args.env]
    result = combine([statuses(ROOT / ".mutation" / env) for env in envs])
    result = classify(result)
    if mutants:
        import fnmatch

        result = {k: v for k, v in result.items() if any(fnmatch.fnmatch(k, m) or k == m for m in mutants)}
    counts = Counter(result.values())
    print("mutants:", len(result), dict(sorted(counts.items())))
    for name, status in sorted(result.items()):
        if status != "killed":
            print(f"  {status:12} {name}")
    if args.json:
        args.json.write_text(
            json.dumps({"env": args.env, "counts": counts, "mutants": result}, indent=1, sort_keys=True)
        )
    if args.sample:
        return 0 if result and set(result.values()) == {"killed"} else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
