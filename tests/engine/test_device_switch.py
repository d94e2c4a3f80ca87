"""NPU_STANDIN_DEVICE: where the NPU stand-in puts the NPU (CPU by default, a CUDA device on the GPU box). The switch
is checked here on CPU; what it does on a CUDA device is checked by benchmarks/bench_engine_gpu.py on the box."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

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
    left unnamed, torch.npu's streams / events are torch.cuda's. Needs no CUDA device (nothing is allocated)."""
    probe = (
        "import json, torch, npu_engine\n"
        "npu_engine.install()\n"
        "from vllm_ascend.platform import NPUPlatform\n"
        "print(json.dumps({'device_type': NPUPlatform.device_type, 'device_name': NPUPlatform.device_name,\n"
        "  'dispatch_key': NPUPlatform.dispatch_key, 'pin': NPUPlatform.is_pin_memory_available(),\n"
        "  'privateuse1': torch._C._get_privateuse1_backend_name(),\n"
        "  'event': torch.npu.Event is torch.cuda.Event, 'stream': torch.npu.Stream is torch.cuda.Stream,\n"
        "  'pin_memory_patched': torch.Tensor.pin_memory is npu_engine._pageable}))\n"
    )
    env = {**os.environ, runtime.DEVICE_ENV: "cuda", "PYTHONPATH": os.pathsep.join([SUPPORT, *sys.path])}
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "device_type": "cuda",
        "device_name": "cuda",
        "dispatch_key": "CUDA",
        "pin": True,
        "privateuse1": "privateuseone",
        "event": True,
        "stream": True,
        "pin_memory_patched": False,
    }
