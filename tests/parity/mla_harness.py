"""The MLA KV-cache group of the runner-parity harness (:mod:`runner_harness`): a DeepSeek-V3-style config (MLA,
one MTP layer), the release's real ``AscendMLAMetadataBuilder`` for the target layers and for the MTP drafter's
layer, and what is recorded of the metadata they build. Release-independent; ``runner018`` / ``runner013`` call
it where their release builds attention metadata.

Recorded per step, unpatched vs patched (compared by :func:`runner_harness.compare`, field by field):

- ``target``: every field of the ``AscendMLAMetadata`` the builder returned for the step (:func:`flatten`: the
  prefill and decode parts, ``seq_lens_list``, ``actual_seq_lengths_q``, the context-chunk bounds, slot mapping,
  block tables, the RoPE cos / sin rows -- which carry the positions, see :func:`position_rope_cache`);
- ``draft[i]``: the MTP drafter's metadata for draft position i (0: the first pass over the verified tokens,
  i >= 1: the later drafts), as the drafter hands them to its model, and ``draft_built[i]``: the same at the
  moment each was built (the release builds all of them before the model runs; a field that differs between the
  two was overwritten by a later build);
- ``graph_update``: on a padded uniform-decode step (:class:`FullDecodeDispatcher`), the host arguments
  ``update_graph_params`` (0.18) / ``update_mla_attn_params`` (0.13) hands the captured FIA call per layer
  (:class:`GraphUpdateRecorder`).

Harness knobs (not the release's defaults, each says why): the builder's context-chunk workspace is the smallest
the release allows (``max_num_seqs * block_size``) so that long contexts split into several chunks; KV blocks of 128
tokens (``AscendMLABackend``'s only kernel block size).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

TARGET_LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
DRAFT_LAYER = "model.layers.2.self_attn.attn"  # DeepSeek MTP layers are numbered after the target's
KV_LORA_RANK, ROPE_DIM = 512, 64  # the widths the NPU MLA ops take
HEADS = 32
BLOCK_SIZE = 128
MAX_POSITIONS = 4096


def model_config(arch: str, vocab_size: int) -> dict:
    """config.json of a DeepSeek-V3-style target (no weights are loaded): MLA with q / kv LoRA ranks, dense layers
    (first_k_dense_replace past the MTP layer), one MTP layer (num_nextn_predict_layers)."""
    return {
        "architectures": [arch],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_hidden_layers": len(TARGET_LAYERS),
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "q_lora_rank": 64,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": ROPE_DIM,
        "v_head_dim": 32,
        "n_routed_experts": None,
        "first_k_dense_replace": 100,
        "n_group": 1,
        "topk_group": 1,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": MAX_POSITIONS,
        "torch_dtype": "float32",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def kv_cache_config(vllm_config: Any, shape: Any) -> Any:
    """One MLA KV-cache group holding the target's layers and the MTP layer (as the engine groups them)."""
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    if shape.block_size != BLOCK_SIZE:
        raise ValueError(f"MLA runs on blocks of {BLOCK_SIZE} tokens (AscendMLABackend's kernel block size)")
    spec = MLAAttentionSpec(
        block_size=shape.block_size, num_kv_heads=1, head_size=KV_LORA_RANK + ROPE_DIM, dtype=torch.float32
    )
    vllm_config.cache_config.num_gpu_blocks = shape.num_blocks
    return KVCacheConfig(
        num_blocks=shape.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([*TARGET_LAYERS, DRAFT_LAYER], spec)],
    )


def make_builder(builder_cls: type, vllm_config: Any, kvc: Any, layer_names: list[str]) -> Any:
    import torch
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        builder = builder_cls(kvc.kv_cache_groups[0].kv_cache_spec, layer_names, vllm_config, torch.device("cpu"))
    # the smallest context-chunk workspace the release allows (ascend_chunked_prefill_workspace_size's lower
    # bound), so that a long context is loaded in several chunks
    sched = vllm_config.scheduler_config
    builder.chunked_prefill_workspace_size = sched.max_num_seqs * vllm_config.cache_config.block_size
    return builder


def triton_core_counts() -> None:
    """The NPU core counts vllm-ascend's Triton kernels size their grids with (the proposer's
    ``prepare_inputs_padded_kernel``), as the worker reads them from the driver at start-up: an Atlas A2's (24 AI
    cores, 48 vector cores; tests/support/npu_worker_double.py uses the same)."""
    import vllm_ascend.ops.triton.triton_utils as triton_utils

    if triton_utils._NUM_VECTORCORE <= 0:
        triton_utils._NUM_AICORE, triton_utils._NUM_VECTORCORE = 24, 48


class PageableTorch:
    """``torch`` as one release module sees it where there is no pinned-memory allocator (CPU-only torch):
    ``zeros(..., pin_memory=True)`` allocates pageable memory (page locking changes no value); every other name is
    torch's own. vllm-ascend's MLA builder allocates its context-chunk bounds with ``pin_memory=True``."""

    def __init__(self, torch_module: Any) -> None:
        self._torch = torch_module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def zeros(self, *size: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return self._torch.zeros(*size, **kwargs)


@contextlib.contextmanager
def mla_session(vllm_config: Any) -> Iterator[None]:
    """For the duration: the current vLLM config (a worker process runs under it; the MLA backend reads it),
    :func:`position_rope_cache`, and :class:`PageableTorch` for vllm-ascend's ``mla_v1``."""
    import torch
    import vllm_ascend.attention.mla_v1 as mla_v1
    from vllm.config import set_current_vllm_config

    saved = mla_v1.torch
    mla_v1.torch = PageableTorch(torch)
    try:
        with (
            set_current_vllm_config(vllm_config),
            position_rope_cache(vllm_config.scheduler_config.max_num_batched_tokens),
        ):
            yield
    finally:
        mla_v1.torch = saved


@contextlib.contextmanager
def position_rope_cache(max_num_batched_tokens: int) -> Iterator[None]:
    """vllm-ascend's MLA RoPE tables (``ops/rotary_embedding.py`` ``_cos_cache`` / ``_sin_cache``, recorded by the
    model's rotary embedding; ``_cos_mla`` / ``_sin_mla``, the decode metadata's static rows) with position p's row
    holding p in every column (cos) and -p (sin): the cos / sin rows the builders gather are the positions they
    used. Restored on exit."""
    import torch
    import vllm_ascend.ops.rotary_embedding as rope

    names = ("_cos_cache", "_sin_cache", "_cos_mla", "_sin_mla")
    saved = {n: getattr(rope, n) for n in names}
    pos = torch.arange(MAX_POSITIONS, dtype=torch.float32)[:, None].expand(-1, ROPE_DIM).contiguous()
    rope._cos_cache, rope._sin_cache = pos, -pos
    rope._cos_mla = torch.ones(max_num_batched_tokens, 1, 1, ROPE_DIM)
    rope._sin_mla = torch.zeros(max_num_batched_tokens, 1, 1, ROPE_DIM)
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(rope, n, v)


# -- what is recorded ---------------------------------------------------------------------------------------------

# fields whose content is no function of the batch: the chunked-context workspace (scratch memory), the constant
# masks (recorded by shape and checksum)
_SCRATCH = ("workspace",)
_MASKS = ("attn_mask",)
_MASK_SUMS: dict[tuple, float] = {}


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every field of a metadata dataclass (recursively), as comparable Python values: tensors as (dtype, shape,
    values), cos / sin rows as the positions they encode (:func:`position_rope_cache`), enums by name."""
    out: dict[str, Any] = {}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            out.update(flatten(getattr(obj, f.name), f"{prefix}{f.name}."))
        return out
    name = prefix.rstrip(".")
    out[name] = _value(name, obj)
    return out


def _value(name: str, v: Any) -> Any:
    import torch

    leaf = name.rsplit(".", 1)[-1]
    if isinstance(v, torch.Tensor):
        if leaf in _SCRATCH:
            return ("scratch", tuple(v.shape))
        if leaf in _MASKS:
            key = (v.data_ptr(), v._version, tuple(v.shape))  # the masks are built once and reused
            if key not in _MASK_SUMS:
                _MASK_SUMS[key] = float(v.float().sum())
            return ("mask", str(v.dtype), tuple(v.shape), _MASK_SUMS[key])
        if leaf in ("cos", "sin") and v.dim() == 4:  # [tokens, 1, 1, rope]: the rows encode positions
            sign = 1 if leaf == "cos" else -1
            return ("positions", tuple(int(x) * sign for x in v[:, 0, 0, 0].tolist()))
        return (str(v.dtype), tuple(v.shape), tuple(v.reshape(-1).tolist()))
    if isinstance(v, enum.Enum):
        return v.name
    if isinstance(v, (list, tuple)):
        return tuple(_value(name, x) for x in v)
    if v is None or isinstance(v, (int, float, bool, str)):
        return v
    return type(v).__name__


class FullDecodeDispatcher:
    """Stands in for the runner's ``cudagraph_dispatcher`` as an engine with FULL_DECODE_ONLY ACL graphs sees it
    (captures at ``uniform_decode_query_len`` x 1, 2, 4, ... requests): a uniform-decode batch dispatches FULL,
    padded to the next captured size; everything else runs eager. Only the dispatch decision: nothing is
    captured or replayed."""

    def __init__(self, uniform_decode_query_len: int, max_num_seqs: int, batch_descriptor: type) -> None:
        self.q = uniform_decode_query_len
        self.sizes = []
        n = 1
        while n < max_num_seqs:
            self.sizes.append(n)
            n *= 2
        self.sizes.append(max_num_seqs)
        self.batch_descriptor = batch_descriptor
        self.full_steps = 0

    def padded_reqs(self, num_tokens: int) -> int | None:
        if num_tokens % self.q:
            return None
        reqs = num_tokens // self.q
        return next((s for s in self.sizes if s >= reqs), None)

    def dispatch(self, num_tokens: int, uniform_decode: bool = False, has_lora: bool = False, **kwargs: Any) -> Any:
        from vllm.config import CUDAGraphMode

        invalid = kwargs.get("invalid_modes") or ()
        reqs = self.padded_reqs(num_tokens) if uniform_decode else None
        if reqs is None or CUDAGraphMode.FULL in invalid:
            return CUDAGraphMode.NONE, self.batch_descriptor(num_tokens)
        self.full_steps += 1
        return CUDAGraphMode.FULL, self.batch_descriptor(reqs * self.q, num_reqs=reqs, uniform=True)


class _Handle:
    def __init__(self, layer: str) -> None:
        self.layer = layer


class _Event:
    def record(self, stream: Any = None) -> None:
        pass


class GraphUpdateRecorder:
    """The host side of an ACL FULL-graph parameter update, recorded: ``graph_params`` as captured for one padded
    size (one captured FIA call per target layer, placeholder tensors for what capture owns), and
    ``torch.npu.graph_task_update_begin/end`` + the FIA op's ``.out`` replaced by recorders for the duration of
    :meth:`recording`. Each update yields the arguments the release passes (host lists, block table rows)."""

    def __init__(self, fia_op: str, n_params: int) -> None:
        self.fia_op, self.n_params = fia_op, n_params
        self.calls: list[dict] = []
        self._open: _Handle | None = None

    def graph_params(self, num_tokens: int, layers: list[str]) -> Any:
        import torch

        params = []
        for _ in layers:
            p: list[Any] = [None] * self.n_params
            p[0] = p[1] = p[2] = p[3] = torch.zeros(1)  # q_nope, k_nope, q_pe, k_pe: owned by the capture
            params.append(tuple(p))
        return SimpleNamespace(
            attn_params={num_tokens: params},
            handles={num_tokens: [_Handle(layer) for layer in layers]},
            events={num_tokens: [_Event() for _ in layers]},
            workspaces={num_tokens: None},
        )

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        import torch
        import torch_npu

        def begin(stream: Any, handle: _Handle) -> None:
            assert self._open is None, "graph_task_update_begin twice"
            self._open = handle

        def end(stream: Any) -> None:
            assert self._open is not None, "graph_task_update_end without begin"
            self._open = None

        def out(*args: Any, **kwargs: Any) -> None:
            assert self._open is not None, f"{self.fia_op}.out outside a task-group update"
            rec = {"layer": self._open.layer}
            for k, v in kwargs.items():
                # the captured tensors and constants (placeholders here) are the capture's; the rest is the update's
                if k in ("out", "workspace", "atten_mask") or v is None or (hasattr(v, "shape") and v.numel() == 1):
                    continue
                rec[k] = _value(k, v)
            self.calls.append(rec)

        saved = {n: torch.npu.__dict__.get(n) for n in ("graph_task_update_begin", "graph_task_update_end")}
        saved_op = torch_npu.__dict__.get(self.fia_op)
        torch.npu.graph_task_update_begin, torch.npu.graph_task_update_end = begin, end
        setattr(torch_npu, self.fia_op, SimpleNamespace(out=out))
        try:
            yield
        finally:
            for n, v in saved.items():
                if v is None:
                    delattr(torch.npu, n)
                else:
                    setattr(torch.npu, n, v)
            if saved_op is None:
                delattr(torch_npu, self.fia_op)
            else:
                setattr(torch_npu, self.fia_op, saved_op)
