"""Test double for the device-bound start-up parts of vllm-ascend's ``NPUWorker`` (CPU tensors, no CANN).

Only what cannot exist without an NPU is replaced; the model runner, model, attention backend, sampler,
rejection sampler and proposer are the release's own code. Replaced (each listed in docs/e2e.md):
- device set-up (``torch.npu.set_device``, memory snapshot, HCCL world) -> the CPU (or ``cuda:0`` with
  ``NPU_STANDIN_DEVICE=cuda``), a gloo world built with vLLM's own ``GroupCoordinator`` (vllm-ascend's
  replacement builds HCCL groups): of one process, or of the data-parallel ranks when vLLM's data-parallel
  environment is set (vLLM sizes the world and picks the rendezvous), with vLLM's base device communicator for
  groups of more than one rank (vllm-ascend's opens HCCL) and the CPU as the device of gloo's barriers;
- ATB extension registration (a CANN library load) and the SoC check (``torch_npu.npu.get_soc_version``)
  -> skipped in ``__init__``; the build's own device type (``_build_info``) stays what the code branches on;
- the Triton device properties (core counts from the NPU driver) -> an Atlas A2's counts;
- KV-cache memory profiling -> a fixed byte budget (the engine is sized by ``num_gpu_blocks_override``);
- the ATB matmul warm-up in ``compile_or_warm_up_model`` -> skipped (eager mode compiles nothing else; in a graph
  mode, on CUDA only, the release's own ``compile_or_warm_up_model`` runs: compilation, warm-up and graph capture
  through tests/support/npu_graphs_cuda).

Release differences (0.13.0 / 0.18.0 / 0.23.0): what ``compile_or_warm_up_model`` returns (see there); 0.13 imports
``torch_npu._inductor`` in ``__init__`` (0.18 in ``_init_device``, replaced here), so the 0.13 stand-in declares that
module; the seed is set through the release worker's own ``set_random_seed`` (vLLM 0.13 keeps it in
``model_executor.utils``, 0.18 in ``utils.torch_utils``).
"""

from __future__ import annotations

import socket
from unittest import mock

import torch
import vllm.v1.worker.worker_base as worker_base
import vllm_ascend.ops.triton.triton_utils as triton_utils
import vllm_ascend.worker.worker as ascend_worker
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment, parallel_state
from vllm.platforms import current_platform

from npu_standin import runtime

KV_CACHE_BYTES = 1 << 30  # ample; num_gpu_blocks_override sizes the cache
A2_AICORES, A2_VECTORCORES = 24, 48


class CpuNPUWorker(ascend_worker.NPUWorker):
    def __init__(self, *args, **kwargs):
        with (
            mock.patch.object(ascend_worker, "_register_atb_extensions", _no_atb),
            mock.patch.object(ascend_worker, "check_ascend_device_type", _no_soc_check),
        ):
            super().__init__(*args, **kwargs)

    def _init_device(self):
        if runtime.device() == "cuda":
            # the GPU machine (NPU_STANDIN_DEVICE=cuda): one CUDA device stands in for the NPU
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        self.vllm_config.device_config.device = device
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # vllm-ascend's GroupCoordinator builds HCCL process groups; a world of one on gloo uses vLLM's own.
        patched = parallel_state.GroupCoordinator
        with (
            mock.patch.object(parallel_state, "GroupCoordinator", patched.__mro__[1]),
            mock.patch.object(torch._C, "_get_accelerator", lambda: device),
            mock.patch.object(type(current_platform), "get_device_communicator_cls", classmethod(_gloo_communicator)),
        ):
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
            ensure_model_parallel_initialized(1, 1)
            ascend_worker.init_ascend_model_parallel(self.parallel_config)
        # init_device_properties_triton() asks the NPU driver for its core counts (the Triton kernels size their
        # grids with them); these are an Atlas A2's (24 AI cores, 48 vector cores).
        triton_utils._NUM_AICORE, triton_utils._NUM_VECTORCORE = A2_AICORES, A2_VECTORCORES
        ascend_worker.set_random_seed(self.model_config.seed)
        return device

    def determine_available_memory(self) -> int:
        self.model_runner.profile_run()
        return KV_CACHE_BYTES

    def compile_or_warm_up_model(self):
        if not self.model_config.enforce_eager:
            if runtime.device() != "cuda":
                raise NotImplementedError(
                    "graph modes need ACL graphs: on CUDA only (NPU_STANDIN_DEVICE=cuda, tests/support/npu_graphs_cuda)"
                )
            with mock.patch.object(self, "_warm_up_atb", _no_atb):
                return super().compile_or_warm_up_model()
        ascend_worker.set_random_seed(self.model_config.seed)
        # vLLM 0.23 collects CompilationTimes(language_model, encoder) from every worker; 0.13 / 0.18 a float (seconds)
        if hasattr(worker_base, "CompilationTimes"):
            return worker_base.CompilationTimes(language_model=0.0, encoder=0.0)
        return 0.0


def _gloo_communicator(cls) -> str:
    """vLLM's base device communicator (torch.distributed on the group's own backend, gloo here) for groups of more
    than one rank (data parallelism), where vllm-ascend's NPUCommunicator would open HCCL."""
    return "vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase"


def _no_atb() -> None:
    """ATB extensions are a CANN op library; nothing to register on CPU."""


def _no_soc_check() -> None:
    """No SoC to read on CPU; the build's device type (vllm_ascend._build_info) is used as is."""
