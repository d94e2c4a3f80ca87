"""The vllm-ascend this env installed: the release it is or, for a recorded maintenance-branch commit (the
``va0xx-head`` tox envs, tests/sources/install_commit.py), the release that commit continues, and the commit's form.
The tests key what they expect of a release by ``RELEASE`` and what a commit changes by ``COMMIT_FORM``."""

from __future__ import annotations

import importlib.metadata

from zb_patch import detect
from zb_patch import versions as V

try:
    RAW: str | None = importlib.metadata.version("vllm-ascend")
except importlib.metadata.PackageNotFoundError:
    RAW = None


def _commit_form() -> V.Form | None:
    if RAW is None:
        return None
    info = detect.package("vllm-ascend")
    for adapter in V.adapters():
        form, _ = V.form_for(adapter, info)
        if form is not None and form.is_commit:
            return form
    return None


COMMIT_FORM = _commit_form()
RELEASE = COMMIT_FORM.release if COMMIT_FORM is not None else RAW
