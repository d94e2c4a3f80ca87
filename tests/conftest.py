"""Root conftest: activates the NPU stand-in in the real-package envs (va011/va013/va018/va023).

In an env with vllm-ascend installed, ``tests/support/npu_standin`` must be active before any test
module (or plugin) imports vllm: vllm-ascend's unconditional ``ascend`` platform plugin and its
general plugins import ``torch_npu``, which cannot exist on a CPU-only machine. Everywhere else
(the ``unit`` env: no vllm, no torch) this file only checks package metadata and does nothing else.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys

_SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has_vllm_ascend() -> bool:
    # metadata only: find_spec on a top-level name does not import it
    return _version("vllm-ascend") is not None or importlib.util.find_spec("vllm_ascend") is not None


_STANDIN_FAMILY: str | None = None


def pytest_configure(config) -> None:
    global _STANDIN_FAMILY
    if not _has_vllm_ascend():
        return
    if _SUPPORT not in sys.path:
        sys.path.insert(0, _SUPPORT)
    import npu_standin

    _STANDIN_FAMILY = npu_standin.install()


def pytest_report_header(config) -> list[str]:
    return _header_lines()


def pytest_sessionstart(session) -> None:
    # `pytest -q` (the tox commands) hides report headers; say which env this is anyway.
    config = session.config
    if config.option.verbose < 0 and _STANDIN_FAMILY is not None:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            for line in _header_lines():
                reporter.write_line(line)


def _header_lines() -> list[str]:
    names = ("vllm", "vllm-ascend", "torch", "transformers", "triton")
    found = [f"{n} {_version(n)}" for n in names if _version(n) is not None]
    lines = ["zb-patch env: " + (", ".join(found) if found else "no vllm / torch installed")]
    if _STANDIN_FAMILY is not None:
        lines.append(
            f"NPU stand-in ACTIVE (tests/support/npu_standin, vllm-ascend family {_STANDIN_FAMILY}): "
            "torch_npu / torch.npu / torchair / acl / torchvision are test doubles; "
            f"VLLM_PLUGINS={os.environ.get('VLLM_PLUGINS', '<unset: all plugins load>')!s}"
        )
    return lines
