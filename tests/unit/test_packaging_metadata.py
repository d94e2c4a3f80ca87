"""Project metadata stays single-sourced: one version (zb_patch.__version__, read by pyproject.toml and printed by
the CLI), one set of lint-tool pins (requirements/lint.txt, mirrored by .pre-commit-config.yaml), and the tox
envs CONTRIBUTING.md tells people to run exist."""

import importlib.metadata
import os
import re

import pytest
from packaging.version import Version

import zb_patch
from zb_patch.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read(name: str) -> str:
    with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
        return fh.read()


def test_version_has_one_source():
    pyproject = _read("pyproject.toml")
    assert not re.search(r'^version\s*=\s*"', pyproject, re.M), "pyproject.toml must not write the version itself"
    assert re.search(r'^dynamic = \["version"\]$', pyproject, re.M)
    assert re.search(r'^version = \{ attr = "zb_patch.__version__" \}$', pyproject, re.M)
    Version(zb_patch.__version__)  # a valid PEP 440 version
    # the installed metadata (built by setuptools from the attribute) agrees
    assert importlib.metadata.version("zb-patch") == zb_patch.__version__


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"zb-patch {zb_patch.__version__}"


def _pins(text: str, pattern: str) -> dict[str, str]:
    return dict(re.findall(pattern, text, re.M))


def test_pre_commit_pins_equal_the_lint_env():
    lint = _pins(_read("requirements/lint.txt"), r"^([\w-]+)==([\w.]+)")
    hooks = _pins(_read(".pre-commit-config.yaml"), r'"([\w-]+)==([\w.]+)"')
    assert {"ruff", "mypy"} <= set(hooks), hooks
    assert hooks == {name: lint.get(name) for name in hooks}, f"pre-commit {hooks} vs requirements/lint.txt {lint}"


def test_contributing_names_existing_tox_envs():
    tox_envs = set(re.findall(r"^\[testenv:([\w-]+)\]", _read("tox.ini"), re.M))
    named = set(re.findall(r"tox -e ([\w-]+)", _read("CONTRIBUTING.md")))
    assert named, "CONTRIBUTING.md names no tox env"
    assert named <= tox_envs, f"CONTRIBUTING.md names tox envs that do not exist: {sorted(named - tox_envs)}"


def test_changelog_has_an_unreleased_section():
    assert re.search(r"^## \[Unreleased\]$", _read("CHANGELOG.md"), re.M)
