"""Notice upstream: every vllm-ascend and vLLM release the package index lists that the adapter table does not
classify (``zb_patch.versions.classifies``), i.e. a release nobody has read and recorded yet. Exit status 1 when there
is one, 0 when every listed release is classified, 2 when an index could not be asked.

The releases come from ``pip index versions <project> --pre``, run with this interpreter's pip, so the locations are
the ones pip is configured with here (pip.conf, ``PIP_CONFIG_FILE``, ``PIP_*``: ``pip config list`` shows them); no
index is named in this file. ``tox -e watch`` runs it (outside the default env list: its answer changes whenever
upstream publishes).

    python tests/sources/watch.py [--all]     # --all: every listed release with what the table says about it
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from packaging.version import InvalidVersion, Version

from zb_patch import versions as V

PROJECTS = ("vllm-ascend", "vllm")


class ListingError(Exception):
    pass


def listed(project: str) -> list[str]:
    """The versions pip's configured locations list for ``project``, newest first (pre-releases included)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "index",
        "versions",
        project,
        "--pre",
        "--no-input",
        "--disable-pip-version-check",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("Available versions:")), None)
    if proc.returncode != 0 or line is None:
        why = " ".join((proc.stderr or proc.stdout).split())[-400:]
        raise ListingError(f"pip index versions {project} failed (exit {proc.returncode}): {why}")
    out = []
    for item in line.split(":", 1)[1].split(","):
        item = item.strip()
        try:
            Version(item)
        except InvalidVersion:
            continue
        out.append(item)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="also print every classified release")
    args = parser.parse_args(argv)
    unclassified: list[str] = []
    for project in PROJECTS:
        try:
            versions = listed(project)
        except ListingError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        missing = []
        for version in versions:
            said = V.classifies(project, version)
            if said is None:
                missing.append(version)
            elif args.all:
                print(f"{project} {version}: {said}")
        print(f"{project}: {len(versions)} releases listed, {len(missing)} not classified by the adapter table")
        unclassified += [f"{project} {v}" for v in missing]
    for item in unclassified:
        print(f"NOT CLASSIFIED: {item}")
    return 1 if unclassified else 0


if __name__ == "__main__":
    sys.exit(main())
