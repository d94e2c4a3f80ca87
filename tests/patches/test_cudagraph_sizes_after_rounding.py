"""``cudagraph-batch-sizes-after-rounding`` (ascend-0.18, vllm-ascend #6860) on a real ``NPUModelRunner``: FULL decode
graphs, EAGLE k = 2, the default-style capture sizes [1, 2, 4, 8, 16]. vLLM rounds them to multiples of 1 + k for the
dispatcher ([3, 6, 9]); the release's runner keeps the unrounded list, and the drafter's padding lookup
(``eagle_proposer.py:533-534``, ``num_tokens <= cudagraph_batch_sizes[-1]`` then the dispatcher's table) indexes past
the table for 10-16 draft tokens (on the GPU machine: IndexError in the sync engine run, docs/e2e.md "Graph modes on
CUDA"). Here the lookup is the release's expression on the runner's state, without and with the wrapper."""

from __future__ import annotations

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
if npu_standin.detect_family() != "0.18":
    pytest.skip("cudagraph-batch-sizes-after-rounding is ascend-0.18's", allow_module_level=True)

import torch  # noqa: E402

from zb_patch.versions.fixes import cudagraph_batch_sizes_after_rounding  # noqa: E402

SIZES = [1, 2, 4, 8, 16]


@pytest.fixture(scope="module")
def vllm_config(tiny_eagle_config, tmp_path_factory):
    return tiny_eagle_config(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(autouse=True)
def _backend_selection_left_as_found():
    """The runner's constructor asks vLLM for the attention backend and vLLM caches the answer per shape: here (vLLM's
    CPU platform) the CPU backend, which later tests of this process must not inherit (the runner harness's platform
    answers with vllm-ascend's backend for the same shape)."""
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()
    yield
    selector._cached_get_attn_backend.cache_clear()


def _runner_after_graph_setup(vllm_config, check_and_update, mode="FULL_DECODE_ONLY"):
    """A runner built for ``mode`` (FULL_DECODE_ONLY) with ``SIZES`` (vLLM's CPU platform of
    tests/patches/conftest.py turns graphs off in the config; they are set back as an NPU host has them), then the
    runner's graph-mode resolution as ``initialize_kv_cache`` calls it (one full-attention KV-cache group on the
    release's attention backend)."""
    from vllm.config import CUDAGraphMode, set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm_ascend.attention.attention_v1 import AscendAttentionBackend
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    cc = vllm_config.compilation_config
    cc.cudagraph_mode, cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = (
        CUDAGraphMode[mode],
        list(SIZES),
        max(SIZES),
    )
    vllm_config.scheduler_config.async_scheduling = True
    with set_current_vllm_config(vllm_config):
        runner = NPUModelRunner(vllm_config, torch.device("cpu"))
        spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32)
        check_and_update(runner, [{AscendAttentionBackend}], [KVCacheGroupSpec(["layer"], spec)])
    return runner


def _draft_padding(runner, num_tokens):
    """eagle_proposer.py:533-534 (0.18.0) with use_cuda_graph on."""
    if num_tokens <= runner.cudagraph_batch_sizes[-1]:
        return runner.cudagraph_dispatcher._bs_to_padded_graph_size[num_tokens]
    return num_tokens


def test_the_release_pads_past_the_dispatchers_table(vllm_config):
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    runner = _runner_after_graph_setup(vllm_config, NPUModelRunner._check_and_update_cudagraph_mode)
    assert vllm_config.compilation_config.cudagraph_capture_sizes == [3, 6, 9]
    assert runner.cudagraph_batch_sizes == SIZES
    assert [_draft_padding(runner, n) for n in range(1, 10)] == [3, 3, 3, 6, 6, 6, 9, 9, 9]
    for n in range(10, 17):
        with pytest.raises(IndexError):
            _draft_padding(runner, n)


def test_with_the_fix_the_lookup_follows_the_dispatcher(vllm_config):
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    fixed = cudagraph_batch_sizes_after_rounding.make_check_and_update_cudagraph_mode(
        NPUModelRunner._check_and_update_cudagraph_mode
    )
    runner = _runner_after_graph_setup(vllm_config, fixed)
    assert runner.cudagraph_batch_sizes == [3, 6, 9]
    # up to the largest graph: padded to a captured size; past it: no padding (the dispatcher runs those eagerly)
    assert [_draft_padding(runner, n) for n in range(1, 17)] == [3, 3, 3, 6, 6, 6, 9, 9, 9, *range(10, 17)]


def test_with_graphs_off_the_fix_leaves_no_sizes_as_the_constructor_does(vllm_config):
    """Graph mode NONE (eager) with capture sizes still configured: the release's constructor keeps no sizes, and the
    fix's recomputation by the constructor's rule keeps none either (the drafter then never pads)."""
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    fixed = cudagraph_batch_sizes_after_rounding.make_check_and_update_cudagraph_mode(
        NPUModelRunner._check_and_update_cudagraph_mode
    )
    released = _runner_after_graph_setup(vllm_config, NPUModelRunner._check_and_update_cudagraph_mode, mode="NONE")
    assert vllm_config.compilation_config.cudagraph_capture_sizes and released.cudagraph_batch_sizes == []
    assert _runner_after_graph_setup(vllm_config, fixed, mode="NONE").cudagraph_batch_sizes == []
