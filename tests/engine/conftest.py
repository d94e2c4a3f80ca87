"""tests/engine: the tiny-model / workload modules beside the tests, the emulation under tests/support; one engine
zygote per session on the CPU (tests/support/engine_zygote.py: the launchers' engine processes are forked from one
interpreter that imported vLLM once). ``ZB_TEST_ENGINE_ZYGOTE=off``: every engine process starts on its own."""

import os
import shutil
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "support"))

import engine_zygote  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def engine_zygote_for_the_session():
    import importlib.util

    if (
        os.environ.get(engine_zygote.ZYGOTE_ENV) == "off"
        or os.environ.get("NPU_STANDIN_DEVICE") == "cuda"  # the GPU machine: real streams, fresh processes
        or importlib.util.find_spec("vllm_ascend") is None
    ):
        yield
        return
    folder = tempfile.mkdtemp(prefix="zbz")  # short: a Unix socket path has at most 107 bytes
    proc = engine_zygote.start(os.path.join(folder, "engine.sock"))
    try:
        if proc is None:
            yield
            return
        os.environ[engine_zygote.ZYGOTE_ENV] = os.path.join(folder, "engine.sock")
        try:
            yield
        finally:
            del os.environ[engine_zygote.ZYGOTE_ENV]
            engine_zygote.stop(proc)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def defect_models(tmp_path_factory):
    """The tiny EAGLE and MTP checkpoints of the release-defect reproductions (tests/engine/test_defect_*.py)."""
    from zb_patch.check.engine import model as tiny_model

    root = str(tmp_path_factory.mktemp("defect-models"))
    tiny_model.write_models(root)
    tiny_model.write_mtp_model(root)
    return root
