"""Wiring for running vLLM's engine on the vllm-ascend platform without an NPU: the NPU stand-in, the emulated NPU
ops (npu_ops) bound where vllm-ascend looks them up, and the worker double (npu_worker_double).

``install()`` must run before anything imports vllm / vllm_ascend. Engine processes set
``worker_cls=WORKER_CLS`` and ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (one process; see docs/e2e.md).

The NPU stands on the CPU (default) or, with ``NPU_STANDIN_DEVICE=cuda``, on a CUDA device (the GPU machine,
docs/environments.md): tensors live there, the stand-in's streams / events are torch.cuda's and host memory is pinned,
so the release's asynchrony is real.
"""

from __future__ import annotations

WORKER_CLS = "npu_worker_double.CpuNPUWorker"
# the release modules that allocate NPU tensors with pin_memory=True (npu_engine.install, CUDA stand-in)
PROPOSERS_WITH_PINNED_DEVICE_ZEROS = (
    "vllm_ascend.spec_decode.eagle_proposer",  # 0.18
    "vllm_ascend.spec_decode.llm_base_proposer",  # 0.23
)

# What of the release's compilation cannot run over the stand-in, turned off through its own configuration in a
# graph mode (docs/e2e.md, "Graph modes on CUDA"): npugraph_ex compiles through torchair (needs CANN; 0.18 / 0.23
# default on, 0.13 has no such key there); the fusion passes trace their patterns on example tensors on device "npu"
# and replace them with fused NPU kernels (none matches the dense test models' graphs).
GRAPH_MODE_CONFIG = {
    "ascend_compilation_config": {
        "enable_npugraph_ex": False,
        "fuse_norm_quant": False,
        "fuse_qknorm_rope": False,
        "fuse_allreduce_rms": False,
        "fuse_muls_add": False,
    }
}

_installed = False


def llm_overrides(child_argv: list[str]) -> dict:
    """The engine child's ``LLM(...)`` overrides on the stand-in: the worker double; with ``--graph-mode`` other than
    eager, :data:`GRAPH_MODE_CONFIG` as ``additional_config``."""
    overrides: dict = {"worker_cls": WORKER_CLS}
    mode = "eager"
    for i, arg in enumerate(child_argv):
        if arg.startswith("--graph-mode="):
            mode = arg.split("=", 1)[1]
        elif arg == "--graph-mode" and i + 1 < len(child_argv):
            mode = child_argv[i + 1]
    if mode != "eager":
        overrides["additional_config"] = GRAPH_MODE_CONFIG
    return overrides


def install() -> None:
    global _installed
    if _installed:
        return
    import os

    # before torch is imported (it reads this at import): vllm-ascend's AscendCompiler hands aot_autograd an FX
    # GraphModule, which the AOT-autograd cache of the torch here (newer than the releases' own) refuses to store
    # ("expected OutputCode"). Only graph modes compile; the cache only saves recompiles.
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
    import npu_standin
    from npu_standin import runtime

    device = runtime.device()
    family = npu_standin.install()
    import npu_ops
    import npu_ops.triton_ascend

    # before vllm_ascend.ops.triton resolves the triton-ascend extension ops (at import)
    npu_ops.triton_ascend.bind(family)
    import torch
    import torch_npu  # the stand-in

    if device == "cpu" and torch._C._get_privateuse1_backend_name() != "npu":
        # The real `import torch_npu` names the PrivateUse1 backend "npu" (so torch.device("npu") parses, as vLLM's
        # DeviceConfig needs for the platform's device_type). No tensor is ever placed there: the worker double runs
        # on CPU. On CUDA it stays unnamed: a named PrivateUse1 backend becomes torch's current accelerator, and
        # pinned host memory (allocated through the current accelerator) would then need NPU hooks.
        torch.utils.rename_privateuse1_backend("npu")
    # Python custom ops (vLLM's and vllm-ascend's `direct_register_custom_op`) register their kernels under the
    # platform's dispatch key, or "PrivateUse1" (the NPU) by name; the tensors live on the stand-in device. Before
    # vllm_ascend is imported: its modules register ops at import.
    import vllm.utils.torch_utils as torch_utils

    dispatch_key = {"cpu": "CPU", "cuda": "CUDA"}[device]
    torch_utils.direct_register_custom_op = _on_device(torch_utils.direct_register_custom_op, dispatch_key)
    from vllm_ascend.platform import NPUPlatform

    NPUPlatform.dispatch_key = dispatch_key
    if device == "cpu":
        # Page-locked host memory needs the device driver. CPU tensors stay pageable: the platform says pinning is
        # not available, and the unconditional `.pin_memory()` calls (e.g. the runner's spec-decode metadata) keep
        # the tensor.
        NPUPlatform.is_pin_memory_available = classmethod(lambda cls: False)
        torch.Tensor.pin_memory = _pageable
        # Device memory accounting (load_model's DeviceMemoryProfiler): nothing lives in device memory here.
        NPUPlatform.get_current_memory_usage = classmethod(lambda cls, device=None: 0.0)
        # vllm-ascend's MLA builder allocates its context-chunk bounds with torch.zeros(..., pin_memory=True) (0.13 /
        # 0.18 mla_v1.build_chunked_metadata): pageable here, as .pin_memory() above
        import importlib

        importlib.import_module("vllm_ascend.ops")  # first, as the worker imports it
        mla_v1 = importlib.import_module("vllm_ascend.attention.mla_v1")
        mla_v1.torch = _HostZerosPageable(torch)
    else:
        # The platform's device is CUDA: vLLM derives torch.device(device_type) and its process groups' devices from
        # these; the release's own is_pin_memory_available (True) stays.
        NPUPlatform.device_type = NPUPlatform.device_name = "cuda"
        NPUPlatform.get_current_memory_usage = classmethod(_cuda_memory_usage)
    npu_ops.bind(torch_npu)
    # Whether vllm-ascend's compiled custom ops load (they never do here: False), decided once and cached, as the
    # first eager call does. In a graph mode torch.compile traces the callers, and cannot trace the failing import.
    import vllm_ascend.utils

    vllm_ascend.utils.enable_custom_op()
    if device == "cuda":
        # ACL graphs (graph modes): CUDA graphs with task groups, updates and ExternalEvents (npu_graphs_cuda)
        import npu_graphs_cuda

        npu_graphs_cuda.install()
    # torch_npu's Tensor.npu(): to the NPU, which is the stand-in's device (vllm-ascend's MLA builder moves its
    # context-chunk lengths with it)
    torch.Tensor.npu = lambda self, *args, **kwargs: self.to(device)
    if device == "cuda":
        # vllm-ascend's proposers allocate device tensors with pin_memory=<runner.pin_memory> (0.18:
        # eagle_proposer, 0.23: llm_base_proposer, `torch.zeros(..., device=device, pin_memory=...)`). torch_npu's
        # zeros for the NPU (op-plugin's op_api::zeros, the default on 910B-class SoCs) allocates through
        # OpPreparation's apply_tensor_use_empty, which passes pin_memory=false: an ordinary device tensor. torch's
        # CUDA factory refuses the flag ("Only dense CPU tensors can be pinned"); those modules see a torch whose zeros
        # leaves device tensors unpinned. vllm_ascend.ops first, as the worker imports it: from 0.23 on, importing
        # spec_decode before it runs into the ops <-> device_op import cycle.
        import importlib

        import vllm_ascend.ops  # noqa: F401

        for name in PROPOSERS_WITH_PINNED_DEVICE_ZEROS:
            try:
                proposer = importlib.import_module(name)
            except ModuleNotFoundError:
                continue
            proposer.torch = _DeviceTensorsUnpinned(torch)
        if family == "0.13":
            import vllm_ascend.sample.rejection_sampler as rejection_sampler

            rejection_sampler.rejection_greedy_sample_with_triton = _counts_after_a_guard_element(
                rejection_sampler.rejection_greedy_sample_with_triton
            )
    # vLLM inspects model classes in a fresh interpreter, which needs the stand-in too (it loads all plugins).
    import sys

    import vllm.model_executor.models.registry as model_registry

    model_registry._SUBPROCESS_COMMAND = [sys.executable, "-m", "npu_standin", "vllm.model_executor.models.registry"]
    _installed = True


class _DeviceTensorsUnpinned:
    """``torch`` for one release module on the CUDA stand-in: ``zeros`` drops ``pin_memory`` for a non-CPU device (page
    locking is a host-memory property); every other name is torch's own."""

    def __init__(self, torch_module):
        self._torch = torch_module

    def __getattr__(self, name):
        # looked up once: the proposer reads torch.<name> in every step
        value = getattr(self._torch, name)
        setattr(self, name, value)
        return value

    def zeros(self, *size, device=None, pin_memory=False, **kwargs):
        if pin_memory and device is not None and self._torch.device(device).type != "cpu":
            pin_memory = False
        return self._torch.zeros(*size, device=device, pin_memory=pin_memory, **kwargs)


class _HostZerosPageable:
    """``torch`` for one release module on the CPU stand-in: ``zeros(..., pin_memory=True)`` allocates pageable memory
    (page locking needs the device driver and changes no value); every other name is torch's own."""

    def __init__(self, torch_module):
        self._torch = torch_module

    def __getattr__(self, name):
        value = getattr(self._torch, name)
        setattr(self, name, value)
        return value

    def zeros(self, *size, pin_memory=False, **kwargs):
        return self._torch.zeros(*size, **kwargs)


def _counts_after_a_guard_element(launch):
    """vllm-ascend 0.13.0's ``rejection_greedy_sample_with_triton`` for the CUDA stand-in. Its kernel loads
    ``cu_num_draft_tokens[offset - 1]`` for offset 0 too, unmasked (``tl.where`` discards the value; vllm-ascend #8531
    clamps the index from 0.18.0 on). On CUDA that read can fault where nothing is mapped just before the tensor's
    allocation (illegal memory access, sporadic, k >= 2). The launcher gets the same counts as a view one element
    into a buffer of its own, so the stray read stays in owned memory; kernel, arguments and results are the
    release's."""

    def launch_guarded(output_token_ids, num_draft_tokens, cu_num_draft_tokens, *args):
        buffer = cu_num_draft_tokens.new_empty(cu_num_draft_tokens.numel() + 1)  # the guard's value is never used
        buffer[1:].copy_(cu_num_draft_tokens)
        return launch(output_token_ids, num_draft_tokens, buffer[1:], *args)

    launch_guarded.__wrapped__ = launch
    return launch_guarded


def _pageable(self, *args, **kwargs):
    return self


def _cuda_memory_usage(cls, device=None) -> float:
    """What the release's NPUPlatform.get_current_memory_usage reads from torch.npu, from torch.cuda."""
    import torch

    torch.cuda.reset_peak_memory_stats(device)
    return float(torch.cuda.max_memory_allocated(device))


def _on_device(register, key: str):
    def direct_register_custom_op(*args, dispatch_key=None, **kwargs):
        return register(*args, dispatch_key=key if dispatch_key == "PrivateUse1" else dispatch_key, **kwargs)

    return direct_register_custom_op
