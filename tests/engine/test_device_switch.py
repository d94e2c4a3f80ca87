"""NPU_STANDIN_DEVICE: where the NPU stand-in puts the NPU (CPU by default, a CUDA device on the GPU host). The switch
is checked here on CPU; what it does on a CUDA device is checked by benchmarks/bench_engine_gpu.py on the GPU host."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import npu_standin
from npu_standin import _core, runtime

SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")


@pytest.fixture
def device_env(monkeypatch):
    monkeypatch.setattr(runtime, "_cuda_objects", {})
    return lambda value: monkeypatch.setenv(runtime.DEVICE_ENV, value)


@pytest.mark.parametrize("value, device", [("", "cpu"), ("cpu", "cpu"), ("cuda", "cuda")])
def test_device_from_the_environment(device_env, value, device):
    device_env(value)
    assert runtime.device() == device


def test_other_device_names_are_refused(device_env):
    device_env("npu")
    with pytest.raises(ValueError, match="NPU_STANDIN_DEVICE='npu'; valid: cpu, cuda"):
        runtime.device()


def test_cpu_keeps_the_no_op_runtime_objects(device_env):
    device_env("cpu")
    assert _core.ref("runtime:Event")("torch_npu.npu.Event") is runtime.Event
    assert _core.ref("runtime:synchronize")("torch_npu.npu.synchronize") is runtime.synchronize
    assert _core.ref("runtime:is_available")("torch_npu.npu.is_available")() is False


def test_cuda_maps_streams_events_and_synchronisation_to_torch_cuda(device_env):
    device_env("cuda")
    for name, cuda_name in runtime.CUDA_EQUIVALENTS.items():
        assert _core.ref(f"runtime:{name}")(f"torch_npu.npu.{name}") is getattr(torch.cuda, cuda_name), name
    # transformers asks torch.npu.is_available(): still no NPU, whatever the NPU stands on
    assert _core.ref("runtime:is_available")("torch_npu.npu.is_available")() is False


def test_cuda_objects_are_taken_before_vllm_ascend_rebinds_torch_cuda(device_env, monkeypatch):
    """vllm-ascend's NPUModelRunner.__init__ points torch.cuda.Event etc. at the torch.npu names; the stand-in's
    objects are taken when the torch_npu stand-in is built, before that."""
    device_env("cuda")
    real_event = runtime.resolve("Event")
    monkeypatch.setattr(torch.cuda, "Event", object)
    assert runtime.resolve("Event") is real_event


def test_engine_wiring_on_cuda():
    """npu_engine.install() with NPU_STANDIN_DEVICE=cuda, in a fresh process (install() cannot be undone): the
    platform's device is CUDA, custom ops go to the CUDA dispatch key, pinned memory stays available, PrivateUse1 is
    left unnamed, torch.npu's streams / events are torch.cuda's, the release modules that need it see the CUDA
    stand-in's doubles, torch.npu's graph names are npu_graphs_cuda's. Needs no CUDA device (nothing is allocated)."""
    probe = (
        "import json, sys, torch, npu_engine\n"
        "npu_engine.install()\n"
        "import vllm_ascend.sample.rejection_sampler\n"
        "from vllm_ascend.platform import NPUPlatform\n"
        "print(json.dumps({'device_type': NPUPlatform.device_type, 'device_name': NPUPlatform.device_name,\n"
        "  'dispatch_key': NPUPlatform.dispatch_key, 'pin': NPUPlatform.is_pin_memory_available(),\n"
        "  'privateuse1': torch._C._get_privateuse1_backend_name(),\n"
        "  'event': torch.npu.Event is torch.cuda.Event, 'stream': torch.npu.Stream is torch.cuda.Stream,\n"
        "  'pin_memory_patched': torch.Tensor.pin_memory is npu_engine._pageable,\n"
        "  'unpinned_zeros': sorted(n.rsplit('.', 1)[1] for n in npu_engine.PROPOSERS_WITH_PINNED_DEVICE_ZEROS\n"
        "      if n in sys.modules and isinstance(sys.modules[n].torch, npu_engine._DeviceTensorsUnpinned)),\n"
        "  'rejection_guarded': hasattr(sys.modules['vllm_ascend.sample.rejection_sampler']\n"
        "      .rejection_greedy_sample_with_triton, '__wrapped__'),\n"
        "  'graphs': torch.npu.NPUGraph is sys.modules['npu_graphs_cuda'].NPUGraph}))\n"
    )
    env = {**os.environ, runtime.DEVICE_ENV: "cuda", "PYTHONPATH": os.pathsep.join([SUPPORT, *sys.path])}
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    family = npu_standin.detect_family()
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "device_type": "cuda",
        "device_name": "cuda",
        "dispatch_key": "CUDA",
        "pin": True,
        "privateuse1": "privateuseone",
        "event": True,
        "stream": True,
        "pin_memory_patched": False,
        # the NPU's zeros ignores pin_memory for a device tensor (npu_engine): every proposer module that asks for it
        "unpinned_zeros": ["eagle_proposer", "llm_base_proposer"] if family == "0.23" else ["eagle_proposer"],
        "rejection_guarded": family == "0.13",  # 0.13's greedy rejection kernel reads before its counts
        "graphs": True,  # ACL graphs as CUDA graphs (npu_graphs_cuda)
    }


@pytest.mark.skipif(
    npu_standin.detect_family() != "0.13", reason="the guard element is for vllm-ascend 0.13's rejection kernel"
)
def test_rejection_counts_after_a_guard_element():
    """The CUDA stand-in's launcher for vllm-ascend 0.13's greedy rejection kernel (npu_engine): the kernel still
    reads ``cu_num_draft_tokens[offset - 1]`` unmasked; the guarded launch hands it the same counts one element into
    a buffer of their own and gives the release's results (run here on CPU, TRITON_INTERPRET=1)."""
    probe = (
        "import inspect, json, torch, npu_engine\n"
        "npu_engine.install()\n"
        "from vllm_ascend.ops.triton import reject_sample as rs\n"
        "offsets = []\n"
        "def recording(out, n, cu, *args):\n"
        "    offsets.append(cu.storage_offset())\n"
        "    return rs.rejection_greedy_sample_with_triton(out, n, cu, *args)\n"
        "guarded = npu_engine._counts_after_a_guard_element(recording)\n"
        "i32 = lambda v: torch.tensor(v, dtype=torch.int32)\n"
        "n = [2, 3, 1]; cu = i32([2, 5, 6])\n"
        "drafts = i32([5, 6, 7, 8, 9, 3]); argmax = i32([5, 6, 7, 1, 9, 4]); bonus = i32([100, 101, 102])\n"
        "results = {}\n"
        "for name, launch in (('release', rs.rejection_greedy_sample_with_triton), ('guarded', guarded)):\n"
        "    for grid, block in ((3, 1), (1, 4)):\n"
        "        out = torch.full((3, 4), -1, dtype=torch.int32)\n"
        "        launch(out, n, cu, drafts, argmax, bonus, None, 3, grid, block)\n"
        "        results[f'{name} {grid}x{block}'] = out.tolist()\n"
        "source = inspect.getsource(rs.rejection_greedy_sample_triton.fn)\n"
        "print(json.dumps({'results': results, 'offsets': offsets, 'cu': cu.tolist(),\n"
        "  'reads_minus_one': 'cu_num_draft_tokens_ptr + offset - 1' in source}))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SUPPORT, *sys.path])}
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # request 0: both drafts accepted, bonus; request 1: rejected at its second draft; request 2: at its first
    expected = [[5, 6, 100, -1], [7, 1, -1, -1], [4, -1, -1, -1]]
    assert got["results"] == {
        f"{name} {shape}": expected for name in ("release", "guarded") for shape in ("3x1", "1x4")
    }
    assert got["offsets"] == [1, 1] and got["cu"] == [2, 5, 6]
    # the read the guard exists for (remove the guard when a 0.13 release clamps it as 0.18.0 does)
    assert got["reads_minus_one"]
