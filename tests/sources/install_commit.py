"""Install vllm-ascend at a recorded commit form (``Adapter.commits``) into the running Python, without its
dependencies (the env's lock already holds the release's resolved dependencies; the branch heads change only the
NPU-only pins torch-npu / triton-ascend, which the envs exclude):

    python tests/sources/install_commit.py 35b0fdf7d57a

The source, in this order: the ``git archive`` of the commit in the ``shared`` folder beside the clone
(``../shared/upstream/vllm-ascend/vllm-ascend-<branch>-<commit12>.tar.xz``, its pax header naming the commit); else
the repository named by ``ZB_UPSTREAM_REPO`` (a vllm-ascend clone's path or a git URL the machine reaches), checked
out at the commit. Neither: one line naming the commit and both places, exit 1.

The build is vllm-ascend's own ``setup.py`` without its custom kernels (``COMPILE_CUSTOM_KERNELS=0``; they need
CANN), for a named chip (``SOC_VERSION``: setup.py asks ``npu-smi`` otherwise; ``910b``, the A2 family name, which both
heads' setup.py map to device type A2 and for which the 0.13 head's ``csrc/build_aclnn.sh``, always run by its
``build_ext``, builds no custom operator), with the version a setuptools-scm
build of the commit reports (``Form.reports``, e.g. ``0.18.1.dev45+g35b0fdf``: the archive carries no git metadata,
and without it setup.py would say ``0.0.0``). Prints the source used and the installed version on stdout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from zb_patch import versions as V  # noqa: E402

REPO_ENV = "ZB_UPSTREAM_REPO"  # not ZB_PATCH_*: zb-patch refuses to activate beside a ZB_PATCH_* name it does not know
BUILD_ENV = {"COMPILE_CUSTOM_KERNELS": "0", "SOC_VERSION": "910b"}


def _toplevel() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=HERE, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        out = ""
    return out or os.path.dirname(os.path.dirname(HERE))


SHARED = os.path.normpath(os.path.join(_toplevel(), os.pardir, "shared"))
ARCHIVES = os.path.join(SHARED, "upstream", "vllm-ascend")


def archive_path(form: V.Form) -> str:
    return os.path.join(ARCHIVES, f"vllm-ascend-{form.branch.replace('/', '-')}-{form.ref[:12]}.tar.xz")


def form_of(prefix: str) -> V.Form:
    forms = [f for a in V.adapters() for f in a.commits if f.ref.startswith(prefix)]
    if len(forms) != 1:
        known = ", ".join(f.short for a in V.adapters() for f in a.commits)
        raise SystemExit(f"install_commit: {prefix!r} names {len(forms)} recorded commit forms (recorded: {known})")
    return forms[0]


def _from_archive(form: V.Form, dest: str) -> str | None:
    path = archive_path(form)
    if not os.path.isfile(path):
        return None
    with tarfile.open(path) as t:
        if t.pax_headers.get("comment") != form.ref:
            raise SystemExit(f"install_commit: {path} is not commit {form.ref} (its header: {t.pax_headers})")
        t.extractall(dest, filter="data")
    (top,) = os.listdir(dest)
    return os.path.join(dest, top)


def _from_repository(form: V.Form, dest: str) -> str | None:
    repo = os.environ.get(REPO_ENV)
    if not repo:
        return None
    tree = os.path.join(dest, "vllm-ascend")
    for cmd in (
        ["git", "clone", "--quiet", "--no-checkout", repo, tree],
        ["git", "-C", tree, "checkout", "--quiet", form.ref],
    ):
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"install_commit: commit {form.short}: `{' '.join(cmd)}` failed ({REPO_ENV}={repo})")
    return tree


def install(form: V.Form) -> str:
    with tempfile.TemporaryDirectory(prefix="zb-commit-") as tmp:
        tree = _from_archive(form, tmp)
        source = f"archive {archive_path(form)}"
        if tree is None:
            tree = _from_repository(form, tmp)
            source = f"repository {os.environ.get(REPO_ENV)}"
        if tree is None:
            raise SystemExit(
                f"install_commit: vllm-ascend commit {form.ref} is reachable neither as {archive_path(form)} nor "
                f"through {REPO_ENV} (a vllm-ascend clone or git URL)"
            )
        env = {**os.environ, **BUILD_ENV, "SETUPTOOLS_SCM_PRETEND_VERSION": form.reports}
        uv = shutil.which("uv")
        cmd = [uv, "pip", "install", "--python", sys.executable] if uv else [sys.executable, "-m", "pip", "install"]
        cmd += ["--quiet", "--reinstall" if uv else "--force-reinstall", "--no-deps", "--no-build-isolation", tree]
        if subprocess.run(cmd, env=env).returncode != 0:
            raise SystemExit(f"install_commit: building vllm-ascend commit {form.short} from {source} failed")
    return source


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("commit", help="a recorded commit form's commit (a prefix of at least 7 digits)")
    args = ap.parse_args(argv)
    form = form_of(args.commit)
    source = install(form)
    got = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as m; print(m.version('vllm-ascend'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if got != form.reports:
        raise SystemExit(f"install_commit: installed vllm-ascend reports {got}, not {form.reports}")
    print(f"vllm-ascend {got}: {form.text}, built from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
