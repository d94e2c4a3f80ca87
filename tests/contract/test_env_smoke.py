"""Proves a real-package env (va011 / va013 / va018 / va019 / va023) is what requirements/ says it is:
every installed distribution matches the pinned lock, the real worker modules of the release
import through the NPU stand-in, and vLLM's own plugin loading works in a fresh process with every
plugin enabled (the ascend platform plugin included), as on a real NPU host."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
import installed_release  # noqa: E402  (tests/support)

FAMILY = npu_standin.detect_family()
if FAMILY is None:
    pytest.skip("vllm-ascend is not installed in this env (smoke test of the va0xx tox envs)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
# installed vllm-ascend release -> (tox env, the vLLM release it is pinned with). Several envs can share a
# stand-in family (va019, va023 and va025 all use the "0.23" surface).
ENVS = {
    "0.11.0": ("va011", "0.11.0"),
    "0.13.0": ("va013", "0.13.0"),
    "0.18.0": ("va018", "0.18.0"),
    "0.19.1rc1": ("va019", "0.19.1"),
    "0.23.0": ("va023", "0.23.0"),
    "0.25.1rc1": ("va025", "0.25.1"),
}
ASCEND_RELEASE = installed_release.RELEASE
ENV, VLLM_RELEASE = ENVS[ASCEND_RELEASE]
LOCK = ROOT / "requirements" / f"{ENV}.txt"
# a maintenance-branch commit (tests/sources/install_commit.py) in place of the lock's vllm-ascend: its own env
COMMIT = installed_release.COMMIT_FORM
if COMMIT is not None:
    ENV += "-head"


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s#;]+)", line)
        if m:
            pins[m.group(1)] = m.group(2)
    return pins


def test_tox_env_matches_family():
    assert os.environ.get("TOX_ENV_NAME", ENV) == ENV


def test_release_pair_is_the_pinned_one():
    assert importlib.metadata.version("vllm") == VLLM_RELEASE
    assert _pins(LOCK)["vllm-ascend"] == ASCEND_RELEASE
    if COMMIT is not None:
        assert importlib.metadata.version("vllm-ascend") == COMMIT.reports
    assert importlib.metadata.version("torch") == "2.13.0+cpu"


def test_every_installed_distribution_matches_the_lock():
    pins = _pins(LOCK)
    assert "vllm" in pins and "vllm-ascend" in pins and "torch" in pins
    wrong = {}
    for name, want in pins.items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if name == "vllm-ascend" and COMMIT is not None:
            want = COMMIT.reports  # the commit built in place of the lock's release
        if have != want:
            wrong[name] = (want, have)
    assert not wrong, f"installed != {LOCK.name}: {wrong}"


def test_excluded_packages_are_absent():
    """The CUDA/NPU-only packages of requirements/excludes.txt must not sneak in."""
    excluded = [
        ln.strip()
        for ln in (ROOT / "requirements" / "excludes.txt").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    present = []
    for name in excluded:
        try:
            importlib.metadata.version(name)
            present.append(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    assert not present


def test_standin_is_active_and_strict():
    assert npu_standin.is_installed() and npu_standin.active_family() == FAMILY
    import torch
    import torch_npu

    assert torch.npu is torch_npu.npu and torch.npu.is_available() is False
    with pytest.raises(AttributeError, match="NPU stand-in: torch_npu has no attribute no_such_name"):
        torch_npu.no_such_name  # noqa: B018
    with pytest.raises(ModuleNotFoundError, match="NPU stand-in: no module named 'torch_npu.no_such_mod'"):
        import torch_npu.no_such_mod  # noqa: F401


def test_real_worker_modules_import():
    from npu_standin.ascend_imports import UPSTREAM_WORKER_MODULES, import_worker_modules

    mods = import_worker_modules()
    for name, mod in mods.items():
        assert sys.modules[name] is mod
        path = Path(mod.__file__).resolve()
        assert "site-packages" in path.parts, f"{name} is not the installed release: {path}"
    # the worker-side targets every adapter needs
    for name in (
        "vllm_ascend.worker.model_runner_v1",
        "vllm_ascend.worker.block_table",
        "vllm_ascend.spec_decode.eagle_proposer",
        "vllm.v1.worker.gpu_model_runner",
        "vllm.v1.worker.block_table",
        "vllm.v1.spec_decode.utils",
        "vllm.v1.core.sched.async_scheduler",
    ):
        assert name in mods
    assert mods["vllm_ascend.worker.model_runner_v1"].NPUModelRunner
    assert set(UPSTREAM_WORKER_MODULES) <= set(mods)


PROBE = r"""
import json, os, sys
import npu_standin
npu_standin.install()
from vllm.plugins import load_general_plugins, load_plugins_by_group
import vllm.plugins as P
names = sorted(ep.name for ep in __import__("importlib.metadata").metadata.entry_points(group=P.DEFAULT_PLUGINS_GROUP))
load_general_plugins()
from vllm.platforms import current_platform
platform = type(current_platform).__module__ + "." + type(current_platform).__name__
print(json.dumps({"general": names, "platform": platform}))
"""


def test_vllm_plugin_loading_in_a_fresh_process():
    """What every vLLM process does at start: load_general_plugins() (all plugins: VLLM_PLUGINS
    unset), then resolve current_platform -> the ascend platform plugin -> NPUPlatform."""
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    env.pop("ZB_PATCH", None)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert "zb_patch" in info["general"]
    assert info["platform"] == "vllm_ascend.platform.NPUPlatform"


# --- the stand-in's own contract (cheap: no vLLM import) ----------------------------------------------


@pytest.mark.parametrize(
    "version, family",
    [
        ("0.11.0", "0.11"),
        ("0.13.0rc2", "0.13"),
        ("0.18.0", "0.18"),
        ("0.18.1", "0.18"),
        # 0.19-0.22 need the transformers-5 surface (docs/releases/ascend-0.19-0.25.md section 7.3)
        ("0.19.1rc1", "0.23"),
        ("0.20.2rc1", "0.23"),
        ("0.22.1rc1", "0.23"),
        ("0.23.0.post1", "0.23"),
        ("0.27.1+empty", "0.23"),
    ],
)
def test_family_of(version, family):
    assert npu_standin.family_of(version) == family


def test_family_of_refuses_older_releases():
    with pytest.raises(RuntimeError, match="older than every covered family"):
        npu_standin.family_of("0.9.1")


def test_install_is_idempotent_and_refuses_another_family():
    assert npu_standin.install() == FAMILY
    other = next(f for f in npu_standin.FAMILIES if f != FAMILY)
    with pytest.raises(RuntimeError, match="already installed"):
        npu_standin.install(other)


def test_every_declared_name_of_this_family_exists():
    import importlib

    from npu_standin import surface

    for mod, attrs in surface.modules_for(FAMILY).items():
        m = importlib.import_module(mod)
        for attr in attrs:
            assert hasattr(m, attr), f"{mod}.{attr}"


def test_roots_this_family_does_not_need_are_absent():
    import importlib.util

    from npu_standin import surface

    declared = surface.modules_for(FAMILY)
    for root in surface.ROOTS:
        if root not in declared and "." not in root:
            assert importlib.util.find_spec(root) is None, root


def test_npu_only_calls_raise_and_runtime_objects_are_noops():
    import torch
    import torch_npu  # noqa: F401

    with pytest.raises(RuntimeError, match="needs an Ascend NPU"):
        torch.npu.mem_get_info() if FAMILY != "0.11" else __import__("acl.rt").rt.memcpy()
    with pytest.raises(RuntimeError, match="cannot be constructed on CPU"):
        torch.npu.NPUGraph()
    stream = torch.npu.Stream()
    event = torch.npu.ExternalEvent()
    event.record(stream)
    event.synchronize()
    assert event.query() and stream.query()
    with torch.npu.stream(stream):
        stream.wait_stream(torch.npu.current_stream())
