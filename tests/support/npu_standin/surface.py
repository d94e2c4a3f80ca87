"""The stand-in surface, as data: which modules and attributes exist, for which vllm-ascend
families, and why each is needed.

Families are vllm-ascend release lines: "0.11", "0.13", "0.18", "0.23" (the ones tox tests).
A name is present only for the families listed; the active family comes from the installed
vllm-ascend (see ``npu_standin.detect_family``). "Why" cites the upstream line that needs the
name (``<file>:<line>`` inside vllm_ascend unless another package is named) and whether it is
touched at import time or at run time (runner construction / per step).

Kinds (from ``_core``): ``unavailable`` (callable that raises RuntimeError: no CPU meaning),
``sentinel`` (opaque named value), ``opaque_class`` (nameable/subclassable, cannot be built),
``value(v)`` (a constant), ``ref("runtime:X")`` (a CPU no-op object from runtime.py).
"""

from __future__ import annotations

from typing import NamedTuple

from ._core import Kind, opaque_class, ref, standin_module, unavailable, value

F11, F13, F18, F23 = "0.11", "0.13", "0.18", "0.23"
FAMILIES: tuple[str, ...] = (F11, F13, F18, F23)
ALL = frozenset(FAMILIES)
# The first vllm-ascend release (major, minor) each family's surface serves. "0.23" (the transformers-5.x surface)
# serves 0.19-0.22 too: every worker module of 0.19.1rc1 .. 0.22.1rc1 imports with it, while the "0.18"
# surface fails there (transformers 5.5.x needs torchvision.transforms.InterpolationMode;
# docs/releases/ascend-0.19-0.25.md section 7.3).
FAMILY_FROM: dict[str, tuple[int, int]] = {F11: (0, 11), F13: (0, 13), F18: (0, 18), F23: (0, 19)}

# Top-level names this stand-in owns. Any import under these roots that is not declared in
# MODULES raises ModuleNotFoundError, even if a real package of that name is installed.
ROOTS = frozenset(
    {
        "torch_npu",
        "torchair",
        "torchvision",
        "acl",
        # triton-ascend's extension namespaces (triton-ascend >= 3.2.2 is not on PyPI and
        # cannot sit beside plain triton): only these subtrees, the rest of triton is real
        "triton.language.extra.cann",
        "triton.language.extra.ascend",
    }
)


class Entry(NamedTuple):
    kind: Kind
    families: frozenset
    why: str


def E(kind: Kind, families, why: str) -> Entry:
    return Entry(kind, frozenset(families), why)


# module name -> (families that need the module, why)
MODULES: dict[str, tuple[frozenset, str]] = {}
# module name -> {attribute: Entry}
ATTRS: dict[str, dict[str, Entry]] = {}


def module(name: str, families, why: str, **attrs: Entry) -> None:
    MODULES[name] = (frozenset(families), why)
    ATTRS.setdefault(name, {}).update(attrs)


# ---------------------------------------------------------------------------------------------
# torch_npu (needs CANN: libhccl.so, libascendcl.so, ... and a +cpu torch of its own version)
module(
    "torch_npu",
    ALL,
    "vllm_ascend/utils.py top-level `import torch_npu` (every vllm_ascend module goes through it)",
    __version__=E(
        value("2.10.0.post4"),
        {F23},
        "compilation/compiler_interface.py:244 (0.23) hashes it into the compile cache key when vLLM's compilation "
        "runs (graph modes, run time); 2.10.0.post4 is vllm-ascend 0.23.0's torch-npu pin",
    ),
)
module(
    "torch_npu._C",
    ALL,
    "torch_npu's C extension; named in annotations evaluated at import",
    _NPUTaskGroupHandle=E(
        opaque_class,
        ALL,
        "compilation/acl_graph.py (0.11: :368, 0.18: :248) class-body annotation "
        "`dict[int, list[torch_npu._C._NPUTaskGroupHandle]]` (import time)",
    ),
)
module(
    "torch_npu._C._distributed_c10d",
    {F13, F18, F23},
    "model_loader/netloader/executor/netloader_pg.py:27 (general plugin `ascend_model_loader`, "
    "which load_general_plugins() imports in every vLLM process)",
    ProcessGroupHCCL=E(
        opaque_class,
        {F13, F18, F23},
        "netloader_pg.py:27 `from torch_npu._C._distributed_c10d import ProcessGroupHCCL` "
        "(import); HCCL process groups (run time)",
    ),
)
module(
    "torch_npu.npu",
    ALL,
    "becomes torch.npu, as the real import does (install()'s on-create hook)",
    is_available=E(
        ref("runtime:is_available"),
        ALL,
        "transformers import_utils is_torch_npu_available(): torch_npu is importable, "
        "so it calls torch.npu.is_available() (import time) -> False",
    ),
    Stream=E(
        ref("runtime:Stream"),
        ALL,
        "return annotations `-> torch.npu.Stream` in utils.py (import time, 0.13+) and "
        "ops/fused_moe/prepare_finalize.py; streams built by NPUModelRunner.__init__ (run time)",
    ),
    Event=E(
        ref("runtime:Event"),
        {F13, F18, F23},
        "annotations at import (0.13+); NPUModelRunner.__init__ and per-step events (run time); "
        "GPUModelRunner code sees it through model_runner_v1._torch_cuda_wrapper",
    ),
    ExternalEvent=E(
        ref("runtime:ExternalEvent"), ALL, "attention backends reference it in annotations/class bodies (import time)"
    ),
    NPUGraph=E(
        opaque_class,
        ALL,
        "compilation/acl_graph.py:29 `aclgraph: torch.npu.NPUGraph | None` (import time); "
        "graph capture is never reached on CPU",
    ),
    current_stream=E(
        ref("runtime:current_stream"),
        ALL,
        "0.11: read at import (ops/register_custom_ops.py); 0.13+: "
        "model_runner_v1._torch_cuda_wrapper (runner construction)",
    ),
    stream=E(
        ref("runtime:stream"), ALL, "0.11: read at import (worker/model_runner_v1.py); 0.13+: _torch_cuda_wrapper"
    ),
    default_stream=E(
        ref("runtime:default_stream"),
        {F13, F18, F23},
        "model_runner_v1._torch_cuda_wrapper maps torch.cuda.default_stream to it (runner construction)",
    ),
    synchronize=E(ref("runtime:synchronize"), {F13, F18, F23}, "_torch_cuda_wrapper (runner construction)"),
    is_current_stream_capturing=E(
        ref("runtime:is_current_stream_capturing"),
        {F23},
        "0.25.1rc1 _torch_cuda_wrapper maps torch.cuda.is_current_stream_capturing to "
        "it (runner construction); worker/v2/aclgraph_utils.py calls it",
    ),
    mem_get_info=E(
        unavailable,
        {F13, F18, F23},
        "_torch_cuda_wrapper maps torch.cuda.mem_get_info to it (mapped, never called on "
        "the tested paths; needs device memory)",
    ),
    memory_reserved=E(
        unavailable,
        {F18, F23},
        "patch/platform/patch_torch_accelerator.py:15 `torch.accelerator.memory_reserved "
        "= torch.npu.memory_reserved` (import time)",
    ),
    memory_stats=E(unavailable, {F18, F23}, "patch_torch_accelerator.py:14 (import time)"),
    reset_peak_memory_stats=E(
        unavailable, {F18, F23}, "patch_torch_accelerator.py:16 (import time); platform.py:612 (run time)"
    ),
)
module(
    "torch_npu.npu.config",
    ALL,
    "model_runner_v1.py (0.11: :147, 0.18: :155, 0.23: :201) assigns "
    "`torch.npu.config.allow_internal_format = True` at import (assignment needs no declaration)",
)
module(
    "torch_npu.npu.memory",
    ALL,
    "device_allocator/camem.py:95 return annotation `torch.npu.memory.NPUPluggableAllocator`",
    NPUPluggableAllocator=E(
        opaque_class, ALL, "camem.py:95 annotation (import time); :97 sleep-mode allocator (run time)"
    ),
)
module(
    "torch_npu.npu.streams",
    {F11, F13},
    "utils.py:32 `from torch_npu.npu.streams import Event` (import time)",
    Event=E(ref("runtime:Event"), {F11, F13}, "utils.py:32 (import); runner events (run time)"),
)
module(
    "torch_npu._inductor",
    {F13},
    "0.13 worker/worker.py:107 NPUWorker.__init__ `import torch_npu._inductor` when HAS_TRITON (registers "
    "torch_npu's Inductor backend for graph mode; worker construction, run time). Nothing is read from it; "
    "0.18+ import it in NPUWorker._init_device, which the engine tests' worker double replaces",
)
module("torch_npu.op_plugin", ALL, "parent of op_plugin.atb")
module("torch_npu.op_plugin.atb", ALL, "parent of op_plugin.atb._atb_ops")
module(
    "torch_npu.op_plugin.atb._atb_ops",
    ALL,
    "worker/worker.py:28 (0.11: worker_v1.py) `from torch_npu.op_plugin.atb._atb_ops import _register_atb_extensions`",
    _register_atb_extensions=E(unavailable, ALL, "worker/worker.py:105 NPUWorker.__init__ (run time)"),
)
module("torch_npu.profiler", ALL, "parent of profiler.dynamic_profile")
module(
    "torch_npu.profiler.dynamic_profile",
    ALL,
    "worker/worker.py:29 `from torch_npu.profiler import dynamic_profile as dp` (its `dp.step()` in "
    "NPUWorker.execute_model is run time only: not declared)",
)

# ---------------------------------------------------------------------------------------------
# triton-ascend extension ops. vLLM's HAS_TRITON is True here (CUDA_VISIBLE_DEVICES= + plain triton,
# as on a real NPU host with triton-ascend), so vllm_ascend resolves these at import time; they are
# only called inside @triton.jit bodies (never at import).
# 0.13: the releases/v0.13.0 head (f92eadf) has this triton_utils.py (its DeepSeek-V4 kernels); the 0.13.0 tag does
# not import it.
module("triton.language.extra.cann", {F13, F18, F23}, "parent of extension")
module(
    "triton.language.extra.cann.extension",
    {F13, F18, F23},
    "ops/triton/triton_utils.py:12 `import triton.language.extra.cann.extension`; without it "
    "_resolve_triton_ascend_op raises at import (plain triton has no insert_slice)",
    insert_slice=E(unavailable, {F13, F18, F23}, "ops/triton/triton_utils.py:37 (import time)"),
    extract_slice=E(unavailable, {F13, F18, F23}, "ops/triton/triton_utils.py:38 (import time)"),
    get_element=E(unavailable, {F13, F18, F23}, "ops/triton/triton_utils.py:39 (import time)"),
)

# triton-ascend's `ascend` backend package. Its triton/language/extra/__init__.py imports every backend package,
# so on a real host `triton.language.extra.ascend` is an attribute as soon as triton.language is imported
# (TRITON_ASCEND_SIDE_EFFECTS below hangs the stand-in there).
module("triton.language.extra.ascend", {F23}, "parent of libdevice (0.19.1rc1 reads it as an attribute chain)")
module(
    "triton.language.extra.ascend.libdevice",
    {F23},
    "0.19.1rc1 worker/v2/sample/penalties.py:24 `pow = triton.language.extra.ascend.libdevice.pow` "
    "(module level; imported through patch/worker/__init__ -> patch_v2.patch_triton)",
    pow=E(unavailable, {F23}, "penalties.py:24 (import time); called only inside @triton.jit bodies"),
)

# ---------------------------------------------------------------------------------------------
# torchair (Ascend graph-mode compiler; needs torch_npu + CANN)
module(
    "torchair",
    {F11, F18, F23},
    "0.11: spec_decode/mtp_proposer.py:6; 0.18/0.23: patch/worker/patch_npugraph_ex_triton.py:22",
    patch_for_hcom=E(
        unavailable,
        {F11},
        "spec_decode/mtp_proposer.py:6 `from torchair import patch_for_hcom` (import); :615 (run time)",
    ),
)
module(
    "torchair.scope",
    {F11},
    "torchair/utils.py:9-14 (imported by platform.py:32)",
    super_kernel=E(unavailable, {F11}, "torchair/utils.py:9 (import); graph mode (run time)"),
    npu_stream_switch=E(unavailable, {F11}, "torchair/utils.py:13 (import; try-branch, else torchair.ops)"),
    npu_wait_tensor=E(unavailable, {F11}, "torchair/utils.py:14 (import)"),
)
module(
    "torchair.core", {F18, F23}, "parent of core._concrete_graph; patch_npugraph_ex_triton.py:111 sets ValuePack on it"
)
module(
    "torchair.core._concrete_graph",
    {F18, F23},
    "patch/worker/patch_npugraph_ex_triton.py:24",
    _is_symlist=E(unavailable, {F18, F23}, "patch_npugraph_ex_triton.py:24 (import)"),
)
module(
    "torchair.fx_summary",
    {F18, F23},
    "patch_npugraph_ex_triton.py:113 `importlib.reload(sys.modules['torchair.fx_summary'])`: it must "
    "be in sys.modules (torchair's __init__ imports it) and have a findable spec",
)
module(
    "torchair.npu_fx_compiler",
    {F18, F23},
    "patch_npugraph_ex_triton.py:25 and :114 (reload)",
    _unpack_meta_list=E(unavailable, {F18, F23}, "patch_npugraph_ex_triton.py:25 (import)"),
    _NpuGraphConverter=E(
        opaque_class, {F18, F23}, "patch_npugraph_ex_triton.py:116 assigns `_NpuGraphConverter._unpack_npu` (import)"
    ),
)

# ---------------------------------------------------------------------------------------------
# acl (pyACL, ships with CANN)
module("acl", ALL, "parent of acl.rt")
module(
    "acl.rt",
    ALL,
    "device_allocator/camem.py:26 `from acl.rt import memcpy` (imported by worker/worker.py)",
    memcpy=E(unavailable, ALL, "camem.py, sleep-mode weight offload (run time)"),
)

# ---------------------------------------------------------------------------------------------
# torchvision: PyPI's wheels are CUDA builds that fail to load beside the CPU torch
# (`operator torchvision::nms does not exist`); requirements/excludes.txt keeps them out.
module(
    "torchvision",
    {F13, F18, F23},
    "transformers models/qwen2_vl/image_processing_qwen2_vl.py hard-imports torchvision; vLLM's "
    "qwen2_vl / qwen3_vl models import it, and vllm_ascend patches those models at import "
    "(0.18: patch/worker/patch_qwen3_5.py -> vllm qwen3_5 -> qwen3_vl). With transformers 5.x "
    "(0.23) a findable torchvision also counts as *available*, which pulls the rest below.",
    __version__=E(
        value("0.25.0"),
        {F23},
        'transformers 5.14 image_processing_auto.py `is_torchvision_greater_or_equal("0.27")` parses it '
        "at import time (no dist metadata here); 0.25.0 is the torchvision vllm-ascend 0.24-0.26 pin",
    ),
)
module(
    "torchvision.io",
    {F23},
    "transformers 5.x video_utils.py:49 `from torchvision import io` (import time)",
    ImageReadMode=E(
        ref("runtime:ImageReadMode"),
        {F23},
        "transformers 5.14 image_utils.py `from torchvision.io import ImageReadMode, decode_image` "
        "(import time, once torchvision is found; vllm-ascend 0.25.1rc1 pins 5.14.1); the same plain "
        "enum as upstream",
    ),
    decode_image=E(unavailable, {F23}, "transformers 5.14 image_utils.py (import time; called only on images)"),
)
module(
    "torchvision.transforms",
    {F13, F18, F23},
    "parent of transforms.v2",
    InterpolationMode=E(
        ref("runtime:InterpolationMode"),
        {F23},
        "transformers 5.x image_utils.py:53 (import time, once torchvision is found); the same plain enum as upstream",
    ),
)
module(
    "torchvision.transforms.functional",
    {F23},
    "transformers 5.14 image_utils.py `from torchvision.transforms.functional import pil_to_tensor` (import time)",
    pil_to_tensor=E(unavailable, {F23}, "transformers 5.14 image_utils.py (called only on images)"),
)
module("torchvision.transforms.v2", {F13, F18, F23}, "parent of v2.functional")
module(
    "torchvision.transforms.v2.functional",
    {F13, F18, F23},
    "transformers qwen2_vl image processor `from torchvision.transforms.v2 import functional as tvF` "
    "(import time; only called when images are processed)",
)


# Side effects of the real `import torch_npu` on real torch namespaces (applied by install()'s
# on-create hook when the torch_npu stand-in is first imported): module -> {attr: Entry}.
TORCH_SIDE_EFFECTS: dict[str, dict[str, Entry]] = {
    "torch.distributed": {
        "is_hccl_available": E(
            value(lambda: False),
            {F13, F18, F23},
            "netloader_pg.py:25 `from torch.distributed import is_hccl_available` "
            "(import time, general plugin ascend_model_loader); HCCL is never "
            "available on CPU -> False",
        ),
    },
}


# What triton-ascend's import does to the (here: real, plain) triton package, applied at the same moment (the first
# stand-in import, which vllm_ascend/utils.py makes before anything reads triton-ascend names).
TRITON_ASCEND_SIDE_EFFECTS: dict[str, dict[str, Entry]] = {
    "triton.language.extra": {
        "ascend": E(
            standin_module("triton.language.extra.ascend"),
            {F23},
            "triton-ascend's triton/language/extra/__init__.py imports its `ascend` backend package; "
            "0.19.1rc1 penalties.py:24 reads it as an attribute without importing it",
        ),
    },
}


def side_effects_for(family: str | None) -> dict[str, dict[str, object]]:
    fams = ALL if family is None else frozenset({family})
    out: dict[str, dict[str, object]] = {}
    for table in (TORCH_SIDE_EFFECTS, TRITON_ASCEND_SIDE_EFFECTS):
        for mod, attrs in table.items():
            vals = {a: e.kind(f"{mod}.{a}") for a, e in attrs.items() if e.families & fams}
            if vals:
                out.setdefault(mod, {}).update(vals)
    return out


def modules_for(family: str | None) -> dict[str, dict[str, Kind]]:
    """The module -> {attr: kind} table for one family (``None``: the union of all families)."""
    fams = ALL if family is None else frozenset({family})
    out: dict[str, dict[str, Kind]] = {}
    for mod, (mfams, _why) in MODULES.items():
        if mfams & fams:
            out[mod] = {a: e.kind for a, e in ATTRS.get(mod, {}).items() if e.families & fams}
    return out


def check_consistency() -> None:
    """Every attribute table belongs to a declared module; every module's parent is declared."""
    for mod in ATTRS:
        assert mod in MODULES, f"ATTRS has undeclared module {mod}"
    for mod, (fams, _) in MODULES.items():
        roots = [r for r in ROOTS if mod == r or mod.startswith(r + ".")]
        assert roots, f"{mod} is outside the stand-in roots"
        parent = mod.rpartition(".")[0]
        if mod not in ROOTS:
            assert parent in MODULES and fams <= MODULES[parent][0], f"{mod}: parent {parent} missing for {fams}"
        for attr, e in ATTRS.get(mod, {}).items():
            assert e.families <= fams, f"{mod}.{attr} declared for families the module lacks"
