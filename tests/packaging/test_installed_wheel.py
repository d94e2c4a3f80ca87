"""zb-patch as ``pip install zb-patch`` gets it: the wheel built from the sdist, installed (not editable) beside
the real vLLM + vllm-ascend of this tox env (``tox -e va018-wheel``).

A packaging mistake -- a module or file left out of the sdist or the wheel, a stray file shipped, a broken
console script or entry point -- fails here, while the editable envs would not notice it.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap

import zb_patch

SOURCE_TREE = os.environ.get("ZB_PATCH_SOURCE_TREE")
DIST = md.distribution("zb-patch")
SITE_PACKAGES = os.path.realpath(sysconfig.get_paths()["purelib"])


def _installed_files() -> set[str]:
    assert DIST.files is not None, "the zb-patch distribution has no RECORD"
    return {f.as_posix() for f in DIST.files}


def test_runs_from_the_installed_wheel_not_the_source_tree():
    assert SOURCE_TREE, "ZB_PATCH_SOURCE_TREE is unset: run this module through `tox -e va018-wheel`"
    here = os.path.realpath(zb_patch.__file__)
    assert here.startswith(SITE_PACKAGES + os.sep), f"zb_patch imported from {here}, not from {SITE_PACKAGES}"
    assert not here.startswith(os.path.join(os.path.realpath(SOURCE_TREE), "zb_patch") + os.sep)
    direct_url = DIST.read_text("direct_url.json")
    assert direct_url is None or not json.loads(direct_url).get("dir_info", {}).get("editable"), direct_url
    assert DIST.version == zb_patch.__version__


def test_wheel_ships_every_package_module_and_nothing_else():
    files = _installed_files()
    dist_info = f"zb_patch-{DIST.version}.dist-info/"
    source = set()
    for dirpath, dirnames, filenames in os.walk(os.path.join(SOURCE_TREE, "zb_patch")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = os.path.relpath(dirpath, SOURCE_TREE)
        source |= {f"{rel}/{name}".replace(os.sep, "/") for name in filenames if not name.endswith(".pyc")}
    shipped = {f for f in files if f.startswith("zb_patch/") and "__pycache__" not in f}
    assert shipped == source, f"missing from the wheel: {sorted(source - shipped)}; extra: {sorted(shipped - source)}"
    scripts = {f for f in files if f.endswith("/bin/zb-patch")}
    assert len(scripts) == 1, sorted(files)
    stray = files - shipped - scripts - {f for f in files if f.startswith(dist_info) or "__pycache__" in f}
    assert not stray, f"the wheel installs files outside zb_patch/ and its dist-info: {sorted(stray)}"
    licenses = [f for f in files if f.startswith(dist_info) and f.rsplit("/", 1)[-1] == "LICENSE"]
    assert licenses, "LICENSE is not in the wheel's dist-info"
    assert "Apache License" in (DIST.locate_file(licenses[0])).read_text(encoding="utf-8")


def test_metadata_and_entry_points():
    meta = DIST.metadata
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Requires-Python"] == ">=3.10"
    (plugin,) = [ep for ep in DIST.entry_points if ep.group == "vllm.general_plugins"]
    assert (plugin.name, plugin.value) == ("zb_patch", "zb_patch.plugin:register")
    from zb_patch.plugin import register

    assert plugin.load() is register
    (script,) = [ep for ep in DIST.entry_points if ep.group == "console_scripts"]
    assert (script.name, script.value) == ("zb-patch", "zb_patch.cli:main")


def _console_script() -> str:
    path = os.path.join(os.path.dirname(sys.executable), "zb-patch")
    assert os.access(path, os.X_OK), f"console script {path} missing"
    return path


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("ZB_PATCH")}
    # vllm-ascend's own general plugins need torch_npu's torch.distributed extensions, which the NPU stand-in
    # does not provide: load the ascend platform plugin and zb-patch only (as tests/lifecycle does)
    full["VLLM_PLUGINS"] = "ascend,zb_patch"
    full.update(env)
    # cwd outside the source tree: nothing but site-packages can provide zb_patch
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full,
        cwd=os.path.dirname(SITE_PACKAGES),
        timeout=300,
    )


def test_console_script_version():
    r = subprocess.run([_console_script(), "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"zb-patch {DIST.version}"


def test_console_script_doctor_selects_the_release_adapter():
    # the installed console script, run with the NPU stand-in active (vLLM resolves the ascend platform)
    r = _run(
        f"""
        import runpy, sys
        import npu_standin
        npu_standin.install()
        sys.argv = ["zb-patch", "doctor", "--json"]
        runpy.run_path({_console_script()!r}, run_name="__main__")
    """,
        {"ZB_PATCH": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # vLLM's own log lines go to stdout before the JSON document
    start = re.search(r"^\{$", r.stdout, re.M)
    assert start, r.stdout[-3000:]
    data = json.loads(r.stdout[start.start() :])
    assert data["zb_patch"] == DIST.version
    assert data["plugin"]["visible"] and data["plugin"]["value"] == "zb_patch.plugin:register"
    assert data["plugin"]["loaded_by_vllm"], data["plugin"]
    assert (data["verdict"], data["adapter"], data["exit_code"]) == ("apply", "ascend-0.18", 0), data["reason"]
    items = data["adapters"][0]["items"]
    assert items and all(it["fingerprint_ok"] for it in items if it["kind"] != "advisory"), items


def test_vllm_loads_the_installed_plugin_and_it_applies():
    r = _run(
        """
        import npu_standin
        npu_standin.install()
        from npu_standin.ascend_imports import import_worker_modules
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        import_worker_modules()
        import zb_patch
        from zb_patch import plugin
        st = plugin.status()
        print("FILE", zb_patch.__file__)
        print("STATE", st["state"], st["adapter"])
    """,
        {"ZB_PATCH": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (file_line,) = [line for line in r.stdout.splitlines() if line.startswith("FILE ")]
    assert os.path.realpath(file_line[5:]).startswith(SITE_PACKAGES + os.sep), file_line
    assert "STATE applied ascend-0.18" in r.stdout, r.stdout + r.stderr[-3000:]
    applied = [
        line for line in (r.stdout + r.stderr).splitlines() if "zb-patch:" in line and "adapter=ascend-0.18" in line
    ]
    assert len(applied) == 1 and "selected by version" in applied[0], applied
