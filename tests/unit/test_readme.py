"""README.md stays true: the supported table is the generated one, every env var is documented, and the
two set-up commands are the ones .ci/run runs."""

import os
import re

from zb_patch.cli import supported_markdown
from zb_patch.plugin import ENV_VARS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as fh:
        return fh.read()


def test_supported_table_is_generated():
    readme = _read("README.md")
    block = re.search(r"<!-- supported:begin -->\n(.*?)<!-- supported:end -->", readme, re.S)
    assert block, "README.md lost its supported-versions markers"
    assert block.group(1) == supported_markdown(brief=True), "regenerate with `zb-patch supported --markdown --brief`"


def test_every_env_var_documented():
    readme = _read("README.md")
    for var in ENV_VARS:
        assert f"`{var}`" in readme, var


def test_ci_runs_the_readme_test_command():
    readme = _read("README.md")
    ci = _read(".ci/run")
    cmds = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    test_cmd = next(c for c in cmds if "tox" in c)
    assert test_cmd in ci, f"README test command {test_cmd!r} not run by .ci/run"
    assert any("zb-patch doctor" in c for c in cmds)
