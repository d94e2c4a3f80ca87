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


# the runner harness of each release family (tests/support: runner013.py, runner018.py)
RUNNER_HARNESS = {"0.13": "runner013", "0.18": "runner018"}


@pytest.fixture(scope="module")
def H(cpu_worker):
    """tests/support/runner_harness.py: vLLM's real scheduler driving the release's real runner on CPU."""
    import runner_harness

    return runner_harness


@pytest.fixture(scope="module")
def release(cpu_worker):
    """This env's release family's runner harness module (RUNNER_HARNESS)."""
    import importlib

    return importlib.import_module(RUNNER_HARNESS[npu_standin.detect_family()])


@pytest.fixture(scope="module")
def sess(H):
    """One harness session (its engine state) per test module."""
    with H.session() as s:
        yield s


@pytest.fixture(scope="session")
def tiny_eagle_config(cpu_worker):
    """The function :func:`_tiny_eagle_engine_config` (vLLM's worker state set up first)."""
    return _tiny_eagle_engine_config


@pytest.fixture(scope="module")
def eager_eagle_config(tiny_eagle_config, tmp_path_factory):
    """One eager tiny-EAGLE configuration per test module."""
    return tiny_eagle_config(tmp_path_factory.mktemp("tiny-models"), enforce_eager=True)


@pytest.fixture
def make_npu_runner(eager_eagle_config):
    """``make(async_scheduling=True)``: a real ``NPUModelRunner`` of the release on CPU, over the module's eager tiny
    EAGLE configuration (no weights)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    def make(async_scheduling=True):
        # vLLM's CPU platform (see cpu_worker) turns async scheduling off; the runner reads the flag in its
        # constructor, so it is set back here
        eager_eagle_config.scheduler_config.async_scheduling = async_scheduling
        with set_current_vllm_config(eager_eagle_config):
            return NPUModelRunner(eager_eagle_config, torch.device("cpu"))

    return make


def _tiny_eagle_engine_config(root, **engine_args):
    """vLLM's engine configuration (``create_engine_config``, then vllm-ascend's ``init_ascend_config``) for a tiny
    Llama target with a one-layer EAGLE head, written as configs only under ``root`` (dummy weights): async
    scheduling, EAGLE k = 2, float32; ``engine_args`` add to / override the ``EngineArgs``."""
    import transformers
    from vllm import ModelRegistry
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
    from vllm_ascend.ascend_config import init_ascend_config

    for name, layers, arch in (("target", 2, "LlamaForCausalLM"), ("eagle", 1, "EagleLlamaForCausalLM")):
        cfg = transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            torch_dtype="float32",
        )
        cfg.architectures = [arch]
        cfg.save_pretrained(root / name)
    # inspect the two architectures in this process (vLLM would start a subprocess per architecture, which
    # has no NPU stand-in and would cost ~20 s each)
    ModelRegistry.register_model("LlamaForCausalLM", LlamaForCausalLM)
    ModelRegistry.register_model("EagleLlamaForCausalLM", EagleLlamaForCausalLM)
    args = {
        "model": str(root / "target"),
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "dtype": "float32",
        "max_model_len": 256,
        "block_size": 16,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "async_scheduling": True,
        "speculative_config": {"method": "eagle", "model": str(root / "eagle"), "num_speculative_tokens": 2},
        **engine_args,
    }
    vc = EngineArgs(**args).create_engine_config()
    init_ascend_config(vc)
    return vc


@pytest.fixture
def later_patch_set(cpu_worker):
    """Adapter ascend-0.19-0.25's patch set (tests/patches/later_fixes.py), unpatched after the test."""
    from zb_patch.versions import ascend_0_19_0_25 as A

    ps = A.ADAPTER.patch_set
    yield ps
    ps.unpatch()
