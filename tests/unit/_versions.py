"""The detected versions of an imagined install: vLLM and vllm-ascend as given, a CPU torch, nothing of the NPU."""

from zb_patch.detect import Versions, parse


def vers(vllm=None, ascend=None):
    return Versions(
        vllm=parse("vllm", vllm),
        vllm_ascend=parse("vllm_ascend", ascend),
        torch=parse("torch", "2.13.0+cpu"),
        torch_npu=parse("torch_npu", None),
        triton=parse("triton", None),
        triton_ascend=parse("triton_ascend", None),
    )
