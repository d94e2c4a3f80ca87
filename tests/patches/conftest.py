"""Fixtures for behaviour tests of patched upstream methods (real vLLM + vllm-ascend classes on CPU tensors).

``cpu_worker`` (tests/support/cpu_worker.py) initialises vLLM's distributed state with vLLM's own CPU platform
and a gloo world of one process *before* the worker modules are imported; everything after that is the
release's real code.
"""

from __future__ import annotations

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")


@pytest.fixture(scope="session")
def cpu_worker():
    if npu_standin.detect_family() is None:
        pytest.skip("vllm-ascend is not installed in this env")
    from cpu_worker import setup_cpu_worker

    return setup_cpu_worker()
