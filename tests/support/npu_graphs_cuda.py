"""ACL graphs with a CUDA device standing in for the NPU (test-only; ``NPU_STANDIN_DEVICE=cuda``):
``torch.npu.NPUGraph``, ``torch.npu.graph``, ``graph_pool_handle``, ``graph_task_group_begin/end``,
``graph_task_update_begin/end``, ``torch.npu.ExternalEvent`` and the ``.out`` variants of
``torch_npu.npu_fused_infer_attention_score`` (dense) and ``npu_fused_infer_attention_score_v2`` (MLA) that
vllm-ascend captures in a task group. :func:`install` binds them
on the NPU stand-in (npu_engine.install, on CUDA).

The CPU double of the same contract is tests/support/npu_graphs.py (its docstring cites the torch_npu / CANN sources);
this module keeps that contract on a real asynchronous device, so that the release's graph modes run with real
capture, replay and two streams.

Semantics
---------
* **Graphs** map to CUDA's: ``NPUGraph`` holds a ``torch.cuda.CUDAGraph``, ``torch.npu.graph(g, pool=, stream=)`` is
  ``torch.cuda.graph`` (capture mode ``thread_local``), ``graph_pool_handle`` is ``torch.cuda.graph_pool_handle``.
  As on the NPU, nothing runs while capturing; a replay re-issues the captured kernels, which read their tensors'
  contents at replay time (static buffers) and keep every host argument they were captured with.
* **Task groups.** The FIA ``.out`` call between ``graph_task_group_begin`` / ``graph_task_group_end`` is captured as
  a gather of the block table's rows from the address the last update named, then attention
  (:func:`graph_attention`: fixed shapes, no host read, capturable) whose host parameters (``actual_seq_lengths``,
  ``actual_seq_lengths_kv``) live in device tensors of the group, sized for as many requests as query rows: slots of
  buffers allocated before any capture, never memory of a graph's pool, which the graph's own earlier kernels may
  write while an update's copy lands. The capture leaves them unset: the task keeps no parameters a replay may use
  until an update writes them.
* **Updates.** ``graph_task_update_begin(stream, handle)``, the same op with this step's host lists, and
  ``graph_task_update_end(stream)`` queue on ``stream`` (not capturing, not the capture stream) a copy of the lists
  (padded: request ends with the last, KV lengths with 0) and of the block table's address, rows and row stride into
  the group's parameter tensors: asynchronous, stream-ordered, as ``aclmdlRICaptureTaskUpdateEnd``; the table's rows
  are read when the graph runs, as the NPU op reads them. The update may name another block table (int32, the
  captured width) and another number of requests, up to the capacity, where requests past the table's rows read no
  KV (vllm-ascend's merged EAGLE draft graph updates its later steps so); it must name the captured query, key,
  value and output and the same scalar arguments; anything else raises ``NotImplementedError`` naming what differs.
* **Which replay an update is for** (the stale-parameter bug class). vllm-ascend issues a replay, then the updates of
  its groups. Each replay of a graph checks, on the host, that every task group of the graph was updated exactly once
  for the graph's previous replay, and raises :class:`StaleTaskGroup` naming the group otherwise (that replay ran with
  parameters issued for another step, or none).
* **ExternalEvent** is a flag in device memory: ``record(stream)`` queues a kernel that sets it, ``reset(stream)`` one
  that clears it, ``wait(stream)`` one that polls it until set (volatile loads). Captured on the capturing stream,
  the wait and the reset are graph nodes: **the captured wait holds the graph's next kernel until the update's
  record**, whenever that is issued -- the NPU's semantics, which ``torch.cuda.Event`` (a wait snapshots the last
  record at issue time) does not have. The flags are slots of one buffer zeroed before the first capture (vllm-ascend
  creates its events inside captures). A wait that polls for :data:`WAIT_TIMEOUT_POLLS` loads without seeing the flag
  gives up and counts a timeout (a record that never comes: on the NPU, a device hang); :func:`report` returns the
  count, and :func:`check` raises :class:`DeviceHang` when it is not zero.
* **MLA** (FIA v2 ``.out`` in its MLA mode, vllm-ascend ``AscendMLAImpl._forward_decode`` and
  ``update_graph_params``): the same task-group contract, captured as :func:`graph_attention_mla` over the paged
  latent / RoPE caches (``TND_NTD``, ``sparse_mode=3``, one KV head; ``actual_seq_qlen`` cumulative,
  ``actual_seq_kvlen`` per request); the update must name the captured query, query RoPE, caches and output. The
  LSE output is not written (``softmax_lse_flag`` off: the release never reads it).
* **Refused**: ``CUDA_LAUNCH_BLOCKING=1`` with a capture (a blocking replay would wait for an update issued after it;
  vllm-ascend refuses ``ASCEND_LAUNCH_BLOCKING=1`` with ACL graphs likewise); FIA v1 ``.out`` in a graph in MLA mode,
  unpaged, or in another layout / sparse mode; FIA v2 ``.out`` outside its MLA mode, or with quantisation arguments;
  a task group with more than one op.
* ``_npu_fused_infer_attention_score_get_max_workspace`` and its v2 form return an empty tensor (the workspace has no
  emulated meaning); ``torch_npu._C._weak_ref_tensor`` / ``torch.ops._C_ascend.weak_ref_tensor`` return an alias
  (the CPU double's).

What it cannot show: ACL's implementation of task updates; torch_npu's task queue (a second host thread launching
ops); anything of npugraph_ex / torchair; NPU kernel timing. The emulated attention inside graphs pads every request
to the block table's width (fixed shapes): its cost is not the NPU op's.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import traceback
from typing import Any

import torch
import triton
import triton.language as tl

from npu_graphs import _define_c_ascend_weak_ref, _fia_workspace, _weak_ref_tensor, _write_attention
from npu_ops._check import HALF, dtypes
from npu_ops.attention import _INT_MAX as _NO_WINDOW  # pre_tokens / next_tokens that bound nothing (the defaults)

# ~1 s of volatile loads on an H100 before a wait gives up (a record that never comes)
WAIT_TIMEOUT_POLLS = 2_000_000
# Debugging: wait for the device before each replay and after each graph's last update, naming the graph of a
# device-side error (CUDA_LAUNCH_BLOCKING cannot serve: a blocking replay waits for an update issued after it)
SYNC_DEBUG = os.environ.get("NPU_GRAPHS_CUDA_SYNC") == "1"
# Debugging: one stderr line per replay and per update (graph, replay, the update's host lists)
TRACE = os.environ.get("NPU_GRAPHS_CUDA_TRACE") == "1"
# replays of task groups shown to have had their step's update (checked at the graph's next replay), by capture site
# (tests/engine/run_engine.py reports it)
REPLAYED_GROUPS: collections.Counter = collections.Counter()


class StaleTaskGroup(RuntimeError):
    """A task group ran in a replay without an update issued for that replay."""


class DeviceHang(RuntimeError):
    """An ExternalEvent wait never saw its record (on the NPU the stream would wait forever)."""


class GraphError(RuntimeError):
    """A use of graphs / task groups / updates that the NPU runtime refuses."""


# ----------------------------------------------------------------------------------------------------
# ExternalEvent: a device flag
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _wait_flag_kernel(flag_ptr, timeouts_ptr, max_polls):
    seen = tl.load(flag_ptr, volatile=True)
    polls = 0
    while (seen == 0) & (polls < max_polls):
        seen = tl.load(flag_ptr, volatile=True)
        polls += 1
    if seen == 0:
        tl.atomic_add(timeouts_ptr, 1)


FLAG_SLOTS = 1 << 16
_TIMEOUTS: torch.Tensor | None = None
_FLAGS: torch.Tensor | None = None
_flags_taken = 0


def _timeouts() -> torch.Tensor:
    global _TIMEOUTS
    if _TIMEOUTS is None:
        _TIMEOUTS = torch.zeros(1, dtype=torch.int32, device="cuda")
    return _TIMEOUTS


class ExternalEvent:
    """``torch.npu.ExternalEvent``: a flag in device memory set by ``record``, awaited by ``wait``, cleared by
    ``reset`` (each a kernel on the given stream; captured when that stream captures)."""

    def __init__(self) -> None:
        global _flags_taken
        # vllm-ascend creates its events inside the capture: a flag allocated and zeroed there would be a graph node
        # that clears it at every replay, before the wait. The flags are slots of one buffer zeroed beforehand.
        if _FLAGS is None:
            if torch.cuda.is_current_stream_capturing():
                raise GraphError("an ExternalEvent created in a capture not begun through torch.npu.graph")
            _prepare()
        if _flags_taken == FLAG_SLOTS:
            raise RuntimeError(f"npu_graphs_cuda: more than {FLAG_SLOTS} ExternalEvents")
        self.flag = _FLAGS[_flags_taken : _flags_taken + 1]
        _flags_taken += 1

    def record(self, stream: Any = None) -> None:
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            self.flag.fill_(1)

    def wait(self, stream: Any = None) -> None:
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            _wait_flag_kernel[(1,)](self.flag, _timeouts(), WAIT_TIMEOUT_POLLS)

    def reset(self, stream: Any = None) -> None:
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            self.flag.zero_()


# The task groups' host parameters (request ends, KV lengths, the block table's address) and their block-table rows
# live in slots of buffers allocated outside every capture: memory of a graph's pool is also written by the graph's own
# earlier kernels (a block freed during the capture and handed to a later tensor keeps its first owner's writes in the
# graph), and an update's copy runs beside those kernels, before the graph's wait.
PARAM_SLOTS = 1 << 22
_PARAMS: torch.Tensor | None = None  # int32
_ADDRS: torch.Tensor | None = None  # int64: block-table addresses
_taken = {"int32": 0, "int64": 0}


def _param_slots(n: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """``n`` slots of the int32 (or int64) parameter buffer, for one task group."""
    name, buffer = ("int64", _ADDRS) if dtype == torch.int64 else ("int32", _PARAMS)
    if _taken[name] + n > buffer.numel():
        raise RuntimeError(f"npu_graphs_cuda: more than {buffer.numel()} {name} task-group parameters")
    slots = buffer[_taken[name] : _taken[name] + n]
    _taken[name] += n
    return slots


def _prepare() -> None:
    """Allocate the flags and the parameter buffer and compile the wait kernel, once, outside any capture (a module
    load is not capturable)."""
    global _FLAGS, _PARAMS, _ADDRS
    if _FLAGS is not None:
        return
    if not torch.cuda.is_available():
        raise RuntimeError("npu_graphs_cuda needs a CUDA device (NPU_STANDIN_DEVICE=cuda)")
    _FLAGS = torch.zeros(FLAG_SLOTS, dtype=torch.int32, device="cuda")
    _PARAMS = torch.zeros(PARAM_SLOTS, dtype=torch.int32, device="cuda")
    _ADDRS = torch.zeros(FLAG_SLOTS, dtype=torch.int64, device="cuda")
    _timeouts()
    event = ExternalEvent()
    event.record()
    event.wait()
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------
# Graphs, task groups, updates
# ----------------------------------------------------------------------------------------------------


def _site() -> str:
    frame = sys._getframe(2)
    path = "/".join(frame.f_code.co_filename.split("/")[-3:])
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


@dataclasses.dataclass
class TaskGroup:
    """A captured task group (the ``handle`` of ``graph_task_group_end``): the attention it holds and the device
    tensors its host parameters live in."""

    graph: NPUGraph
    index: int
    site: str
    call: GroupCall | None = None
    updated_for: list[int] = dataclasses.field(default_factory=list)  # replays an update was issued for

    @property
    def name(self) -> str:
        return f"task group {self.index} of graph {self.graph.id} (captured at {self.site})"


@dataclasses.dataclass
class GroupCall:
    """The attention captured in a task group: tensors (by storage), scalar arguments, parameter tensors."""

    tensors: dict[str, tuple]  # name -> (data_ptr, shape, stride)
    scalars: dict[str, Any]
    q_ends: torch.Tensor  # int32 [capacity]: an update's request ends, padded with the last
    kv_lens: torch.Tensor  # int32 [capacity]: an update's KV lengths, padded with 0
    table_source: torch.Tensor  # int64 [1]: the address of the update's block table
    table_shape: torch.Tensor  # int32 [2]: its rows and row stride
    table: torch.Tensor  # int32 [capacity, width]: its rows, gathered by the graph after the wait
    kwargs: dict | None = None  # the captured call's arguments (NPU_GRAPHS_CUDA_SYNC=1 checks)
    lists: tuple | None = None  # the last update's host lists and block table
    result: torch.Tensor | None = None  # NPU_GRAPHS_CUDA_SYNC=1: the attention of the last replay, in memory of its own
    query: torch.Tensor | None = None  # NPU_GRAPHS_CUDA_SYNC=1: the query of the last replay, in memory of its own
    query_rope: torch.Tensor | None = None  # MLA, NPU_GRAPHS_CUDA_SYNC=1: likewise its RoPE part
    mla: bool = False  # FIA v2's MLA mode (graph_attention_mla; output NTD)

    def check_against_eager(self, name: str) -> None:
        """NPU_GRAPHS_CUDA_SYNC=1, after the replay ran: the attention it computed equals the eager emulation on the
        same buffers and the update's lists (rows of real requests)."""
        from npu_ops.attention import npu_fused_infer_attention_score
        from npu_ops.mla import npu_fused_infer_attention_score_v2

        q_ends, kv_lens, block_table = self.lists
        real = [i for i in range(len(q_ends)) if (q_ends[i] - (q_ends[i - 1] if i else 0)) and kv_lens[i]]
        last = max(real) + 1 if real else 0
        rows = q_ends[last - 1] if last else 0
        # the query as the replay saw it: the captured query tensor's memory may be reused later in the same graph
        if self.mla:
            drop = ("actual_seq_qlen", "actual_seq_kvlen", "out", "query", "query_rope", "block_table")
            kw = {k: v for k, v in self.kwargs.items() if k not in drop} | {"block_table": block_table}
            eager, _ = npu_fused_infer_attention_score_v2(
                self.query[:rows],
                query_rope=self.query_rope[:rows],
                actual_seq_qlen=q_ends[:last],
                actual_seq_kvlen=kv_lens[:last],
                **kw,
            )
            eager = eager.transpose(0, 1)  # [T, N, 512] rows first, as the dense check compares
            got = self.result.transpose(0, 1)[:rows].float()
        else:
            drop = ("actual_seq_lengths", "actual_seq_lengths_kv", "out", "query", "block_table")
            kw = {k: v for k, v in self.kwargs.items() if k not in drop} | {"block_table": block_table}
            eager, _ = npu_fused_infer_attention_score(
                query=self.query, actual_seq_lengths=q_ends[:last], actual_seq_lengths_kv=kv_lens[:last], **kw
            )
            # not the output buffer: the graph's memory pool may hand it to a later tensor of the same graph
            got = self.result.view(-1)[: eager.numel()].view_as(eager)[:rows].float()
        diff = (got - eager[:rows].float()).abs().max().item() if rows else 0.0
        if diff > 0.05:
            raise RuntimeError(
                f"npu_graphs_cuda: {name}: graph attention differs from the eager op by {diff:.3g} "
                f"(q_ends {q_ends}, kv_lens {kv_lens}; in the group's device tensors now: {self.q_ends.tolist()}, "
                f"{self.kv_lens.tolist()})"
            )


_graph_ids = iter(range(1, 1 << 30))


class NPUGraph:
    """``torch.npu.NPUGraph``: a CUDA graph plus the task groups captured in it."""

    def __init__(self) -> None:
        self.id = next(_graph_ids)
        self.cuda = torch.cuda.CUDAGraph()
        self.groups: list[TaskGroup] = []
        self.replays = 0  # replays the host has issued
        self.site = ""  # the release's frames that captured it (innermost last)

    def replay(self) -> None:
        if SYNC_DEBUG:
            _sync_or_name(f"before replay {self.replays + 1} of graph {self.id} (captured {self.site})")
        if self.replays:
            for group in self.groups:
                if group.updated_for.count(self.replays) != 1 or group.updated_for[-1] != self.replays:
                    raise StaleTaskGroup(
                        f"{group.name}: replay {self.replays} of graph {self.id} ran without exactly one update "
                        f"issued for it (updates issued for replays {group.updated_for[-4:]})"
                    )
            REPLAYED_GROUPS.update(group.site for group in self.groups)  # the previous replay had its update
        self.replays += 1
        if TRACE:
            print(f"npu_graphs_cuda: replay {self.replays} of graph {self.id} ({self.site})", file=sys.stderr)
        self.cuda.replay()

    def __repr__(self) -> str:
        return f"<npu_graphs_cuda NPUGraph {self.id}>"


@dataclasses.dataclass
class _State:
    capturing: NPUGraph | None = None
    open_group: TaskGroup | None = None
    updating: tuple[Any, TaskGroup, list] | None = None  # (stream, group, calls)


_STATE = _State()


class graph:
    """``torch.npu.graph(npu_graph, pool=None, stream=None)``: ``torch.cuda.graph`` around the block."""

    def __init__(self, npu_graph: NPUGraph, pool: Any = None, stream: Any = None, **kwargs: Any) -> None:
        if kwargs:
            raise NotImplementedError(f"npu_graphs_cuda: torch.npu.graph arguments {sorted(kwargs)}")
        self.npu_graph = npu_graph
        self._cuda = torch.cuda.graph(npu_graph.cuda, pool=pool, stream=stream, capture_error_mode="thread_local")

    def __enter__(self) -> graph:
        if _STATE.capturing is not None:
            raise GraphError("a graph capture inside another capture")
        if os.environ.get("CUDA_LAUNCH_BLOCKING") == "1":
            # as vllm-ascend refuses ASCEND_LAUNCH_BLOCKING=1 with ACL graphs: a replay that blocks until done waits
            # for the update the host issues after it, and every captured wait times out
            raise GraphError("CUDA_LAUNCH_BLOCKING=1 cannot run ACL graphs (debugging: NPU_GRAPHS_CUDA_SYNC=1)")
        _prepare()
        self._cuda.__enter__()
        _STATE.capturing = self.npu_graph
        self.npu_graph.site = " < ".join(
            f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(traceback.extract_stack()[-9:-1])
        )
        return self

    def __exit__(self, *exc: Any) -> None:
        open_group = _STATE.open_group
        _STATE.capturing, _STATE.open_group = None, None
        self._cuda.__exit__(*exc)
        if open_group is not None and exc[0] is None:
            raise GraphError(f"capture ended inside an open task group ({open_group.name})")


def graph_pool_handle() -> Any:
    return torch.cuda.graph_pool_handle()


def graph_task_group_begin(stream: Any) -> None:
    if _STATE.capturing is None or not torch.cuda.current_stream() == stream:
        raise GraphError("graph_task_group_begin on a stream that is not capturing")
    if _STATE.open_group is not None:
        raise GraphError(f"graph_task_group_begin inside an open task group ({_STATE.open_group.name})")
    _STATE.open_group = TaskGroup(_STATE.capturing, len(_STATE.capturing.groups), _site())


def graph_task_group_end(stream: Any) -> TaskGroup:
    group = _STATE.open_group
    if group is None or not torch.cuda.current_stream() == stream:
        raise GraphError("graph_task_group_end without a task group open on this capturing stream")
    if group.call is None:
        raise GraphError(f"{group.name}: a task group holds one task (the attention's .out call)")
    _STATE.open_group = None
    group.graph.groups.append(group)
    return group


def graph_task_update_begin(stream: Any, handle: TaskGroup) -> None:
    if not isinstance(handle, TaskGroup):
        raise GraphError(f"graph_task_update_begin: {handle!r} is not a task group handle")
    if torch.cuda.is_current_stream_capturing():
        raise GraphError("graph_task_update_begin while capturing")
    if _STATE.updating is not None:
        raise GraphError(f"graph_task_update_begin inside an open update of {_STATE.updating[1].name}")
    _STATE.updating = (stream, handle, [])


def graph_task_update_end(stream: Any) -> None:
    pending = _STATE.updating
    if pending is None or pending[0] != stream:
        raise GraphError("graph_task_update_end without graph_task_update_begin on this stream")
    _STATE.updating = None
    _, group, calls = pending
    if len(calls) != 1:
        raise GraphError(f"{group.name}: the update issues {len(calls)} ops, the group holds one")
    q_ends, kv_lens, block_table = calls[0]
    call, pad = group.call, group.call.q_ends.numel() - len(q_ends)
    host = {
        call.q_ends: q_ends + [q_ends[-1] if q_ends else 0] * pad,
        call.kv_lens: kv_lens + [0] * pad,
        call.table_shape: [block_table.shape[0], block_table.stride(0)],
        call.table_source: [block_table.data_ptr()],
    }
    with torch.cuda.stream(stream):
        # host values, as a task update takes them; pinned staging: the copy is asynchronous, and torch's host
        # allocator keeps the block until the copy ran. The block table's rows are read by the graph, after its wait.
        for device, values in host.items():
            device.copy_(torch.tensor(values, dtype=device.dtype).pin_memory(), non_blocking=True)
    group.updated_for.append(group.graph.replays)
    call.lists = (q_ends, kv_lens, block_table)
    if TRACE:
        print(
            f"npu_graphs_cuda: update of {group.name} for replay {group.graph.replays}: {q_ends} {kv_lens}",
            file=sys.stderr,
        )
    if SYNC_DEBUG and group is group.graph.groups[-1]:
        _sync_or_name(f"in replay {group.graph.replays} of graph {group.graph.id} (captured {group.graph.site})")
        for g in group.graph.groups:
            g.call.check_against_eager(g.name)


def _sync_or_name(where: str) -> None:
    """NPU_GRAPHS_CUDA_SYNC=1: wait for the device here, and name the place of a device-side error."""
    try:
        torch.cuda.synchronize()
    except Exception as exc:
        raise RuntimeError(f"npu_graphs_cuda: device error {where}: {exc}") from exc


# ----------------------------------------------------------------------------------------------------
# The attention op's .out variant
# ----------------------------------------------------------------------------------------------------


def _describe(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()))


class _TaskGroupAttention:
    """An attention op and its ``.out`` variant as vllm-ascend uses them with ACL graphs: the eager emulation when
    called; ``.out`` eager outside a task group, captured inside one (the block table's rows gathered from the address
    the last update named, then the capturable attention), re-issued by an update. The subclasses name the op's
    arguments and its mode."""

    OP = ""
    TENSOR_ARGS: tuple[str, ...] = ()  # an update names the captured ones; the block table may be another
    SCALAR_ARGS: tuple[str, ...] = ()
    Q_ENDS = KV_LENS = ""  # the host lists: cumulative query ends, per-request KV lengths
    MLA = False  # the output is NTD (GroupCall.check_against_eager)

    def __init__(self, eager: Any) -> None:
        self._eager = eager

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._eager(*args, **kwargs)

    def _out(self, kwargs: dict, out: list) -> None:
        if _STATE.updating is not None:
            self._update(_STATE.updating, kwargs, out)
        elif _STATE.open_group is not None:
            self._capture(_STATE.open_group, kwargs, out)
        elif torch.cuda.is_current_stream_capturing():
            raise NotImplementedError(f"npu_graphs_cuda: {self.OP}.out captured outside a task group")
        else:
            _write_attention(self._eager(**kwargs), out, kwargs)

    def _check(self, kwargs: dict) -> None:
        self._check_mode(kwargs)
        if kwargs.get("sparse_mode") == 3 and kwargs.get("atten_mask") is None:
            raise NotImplementedError(f"npu_graphs_cuda: {self.OP}.out with sparse_mode=3 without atten_mask")
        if len(kwargs[self.Q_ENDS]) != len(kwargs[self.KV_LENS]):
            raise NotImplementedError("npu_graphs_cuda: query and kv length lists of different lengths")

    @classmethod
    def _check_mode(cls, kwargs: dict) -> None:
        raise NotImplementedError

    def _attend(self, kwargs: dict, call: GroupCall) -> torch.Tensor:
        """The captured attention on the group's parameter tensors."""
        raise NotImplementedError

    def _capture(self, group: TaskGroup, kwargs: dict, out: list) -> None:
        self._check(kwargs)
        if group.call is not None:
            raise GraphError(f"{group.name}: a second op in one task group")
        table = _check_block_table(kwargs["block_table"])
        # as many requests as query rows (an update may name more requests than the capture: vllm-ascend's merged
        # EAGLE draft graph captures its later steps with the batch's request count, and updates them with one
        # request per query row); outside the capture's pool (_param_slots); left unset: only an update gives the
        # task its parameters
        capacity = max(len(kwargs[self.Q_ENDS]), kwargs["query"].shape[0])
        width = table.shape[1]
        call = GroupCall(
            tensors={name: _describe(kwargs[name]) for name in self.TENSOR_ARGS} | {"out": _describe(out[0])},
            scalars={name: kwargs[name] for name in self.SCALAR_ARGS},
            q_ends=_param_slots(capacity),
            kv_lens=_param_slots(capacity),
            table_source=_param_slots(1, torch.int64),
            table_shape=_param_slots(2),
            table=_param_slots(capacity * width).view(capacity, width),
            mla=self.MLA,
        )
        call.kwargs = {**kwargs, "out": out} if SYNC_DEBUG else None
        if SYNC_DEBUG:  # graph nodes: each replay copies its query here
            call.query = kwargs["query"].clone()
            if kwargs.get("query_rope") is not None:
                call.query_rope = kwargs["query_rope"].clone()
        group.call = call
        # graph nodes: the block table's rows read where the last update points, when the graph runs (as the NPU op
        # reads its block table), then the attention
        _gather_rows_kernel[(capacity,)](
            call.table_source, call.table_shape, call.table, width, BLOCK=triton.next_power_of_2(width)
        )
        result = self._attend(kwargs, call)
        out[0].view(-1)[: result.numel()].copy_(result.reshape(-1))
        if SYNC_DEBUG:
            call.result = result.clone()  # allocated in the capture, kept alive by the group: the pool keeps it

    def _update(self, pending: tuple, kwargs: dict, out: list) -> None:
        self._check(kwargs)
        _, group, calls = pending
        captured = group.call
        now = {name: _describe(kwargs[name]) for name in self.TENSOR_ARGS} | {"out": _describe(out[0])}
        differ = [name for name in now if now[name] != captured.tensors[name]]
        differ += [name for name in self.SCALAR_ARGS if kwargs[name] != captured.scalars[name]]
        if differ:
            raise NotImplementedError(
                f"npu_graphs_cuda: {group.name} re-issued with other {', '.join(differ)} than captured"
            )
        table = _check_block_table(kwargs["block_table"])
        q_ends = [int(x) for x in kwargs[self.Q_ENDS]]
        kv_lens = [int(x) for x in kwargs[self.KV_LENS]]
        capacity, width = captured.table.shape
        # requests past the block table's rows must read no KV (vllm-ascend 0.13 pads its lists with KV length 0)
        unread = any(kv_lens[table.shape[0] :])
        if len(q_ends) > capacity or table.shape[1] != width or unread:
            raise NotImplementedError(
                f"npu_graphs_cuda: {group.name} re-issued with {len(q_ends)} requests and a block table of "
                f"{tuple(table.shape)} (captured: at most {capacity} requests, block table width {width})"
            )
        calls.append((q_ends, kv_lens, table))


class FusedInferAttentionScore(_TaskGroupAttention):
    """``torch_npu.npu_fused_infer_attention_score`` (dense, TND, paged): captured as :func:`graph_attention`."""

    OP = "npu_fused_infer_attention_score"
    TENSOR_ARGS = ("query", "key", "value")
    SCALAR_ARGS = ("input_layout", "block_size", "num_key_value_heads", "num_heads", "scale", "sparse_mode")
    Q_ENDS, KV_LENS = "actual_seq_lengths", "actual_seq_lengths_kv"

    def __init__(self, eager: Any) -> None:
        super().__init__(eager)
        self._mla = FusedInferAttentionScoreMLA(eager)

    def out(self, *args: Any, out: list, workspace: Any = None, **kwargs: Any) -> None:
        if len(args) > 3:
            raise NotImplementedError(f"npu_graphs_cuda: {self.OP}.out with {len(args)} positional arguments")
        kwargs.update(zip(("query", "key", "value"), args))  # vllm-ascend 0.13's MLA decode passes them by position
        if kwargs.get("query_rope") is not None:
            self._mla._out(kwargs, out)
        else:
            self._out(kwargs, out)

    @classmethod
    def _check_mode(cls, kwargs: dict) -> None:
        known = set(cls.TENSOR_ARGS) | set(cls.SCALAR_ARGS) | {"block_table", "atten_mask", cls.Q_ENDS, cls.KV_LENS}
        # vllm-ascend 0.23 passes the window bounds; at their maximum (no sliding window) they bound nothing
        known |= {name for name in ("pre_tokens", "next_tokens") if kwargs.get(name) == _NO_WINDOW}
        if set(kwargs) - known or kwargs.get("softmax_lse_flag"):
            raise NotImplementedError(f"npu_graphs_cuda: {cls.OP}.out with {sorted(set(kwargs) - known)}")
        if kwargs.get("input_layout") != "TND" or kwargs.get("sparse_mode") != 3 or kwargs.get("block_table") is None:
            raise NotImplementedError(f"npu_graphs_cuda: {cls.OP}.out in a graph: only TND, sparse_mode=3, paged")

    def _attend(self, kwargs: dict, call: GroupCall) -> torch.Tensor:
        return graph_attention(
            kwargs["query"],
            kwargs["key"],
            kwargs["value"],
            call.table,
            call.q_ends,
            call.kv_lens,
            block_size=kwargs["block_size"],
            num_heads=kwargs["num_heads"],
            num_key_value_heads=kwargs["num_key_value_heads"],
            scale=kwargs["scale"],
        )


class FusedInferAttentionScoreV2(_TaskGroupAttention):
    """``torch_npu.npu_fused_infer_attention_score_v2`` in its MLA mode (npu_ops/mla.py; vllm-ascend
    ``AscendMLAImpl._forward_decode`` and ``update_graph_params``): captured as :func:`graph_attention_mla`."""

    OP = "npu_fused_infer_attention_score_v2"
    TENSOR_ARGS = ("query", "key", "value", "query_rope", "key_rope")
    HEADS, SCALE = "num_query_heads", "softmax_scale"
    SCALAR_ARGS = ("input_layout", "block_size", "num_key_value_heads", HEADS, SCALE)
    Q_ENDS, KV_LENS = "actual_seq_qlen", "actual_seq_kvlen"
    DEFAULTS: dict = {}  # arguments taken only at these values (they select nothing else)
    MLA = True

    def out(self, query: Any, key: Any, value: Any, *, out: list, workspace: Any = None, **kwargs: Any) -> None:
        self._out({"query": query, "key": key, "value": value, **kwargs}, out)

    @classmethod
    def _check_mode(cls, kwargs: dict) -> None:
        known = set(cls.TENSOR_ARGS) | set(cls.SCALAR_ARGS)
        known |= {"block_table", "atten_mask", "sparse_mode", cls.Q_ENDS, cls.KV_LENS}
        known |= {name for name, value in cls.DEFAULTS.items() if name in kwargs and _is_default(kwargs[name], value)}
        extra = set(kwargs) - known
        if extra or kwargs.get("query_rope") is None or kwargs["value"] is not kwargs["key"]:
            raise NotImplementedError(
                f"npu_graphs_cuda: {cls.OP}.out in a graph outside its MLA mode (extra arguments {sorted(extra)}, "
                f"query_rope given: {kwargs.get('query_rope') is not None})"
            )
        if kwargs["input_layout"] != "TND_NTD" or kwargs["sparse_mode"] != 3 or kwargs.get("block_table") is None:
            raise NotImplementedError(f"npu_graphs_cuda: {cls.OP}.out in a graph: only TND_NTD, sparse_mode=3, paged")

    def _attend(self, kwargs: dict, call: GroupCall) -> torch.Tensor:
        return graph_attention_mla(
            kwargs["query"],
            kwargs["query_rope"],
            kwargs["key"],
            kwargs["key_rope"],
            call.table,
            call.q_ends,
            call.kv_lens,
            block_size=kwargs["block_size"],
            num_heads=kwargs[self.HEADS],
            scale=kwargs[self.SCALE],
        )


class FusedInferAttentionScoreMLA(FusedInferAttentionScoreV2):
    """``torch_npu.npu_fused_infer_attention_score`` (v1) in its MLA mode, the same mode under v1's argument names
    (npu_ops/mla.py ``fia_v1_mla``; vllm-ascend 0.13 ``AscendMLAImpl._forward_decode`` and
    ``update_mla_attn_params``): reached through :class:`FusedInferAttentionScore` ``.out`` when ``query_rope`` is
    given."""

    OP = "npu_fused_infer_attention_score"
    HEADS, SCALE = "num_heads", "scale"
    SCALAR_ARGS = ("input_layout", "block_size", "num_key_value_heads", HEADS, SCALE)
    Q_ENDS, KV_LENS = "actual_seq_lengths", "actual_seq_lengths_kv"
    DEFAULTS = {"antiquant_mode": 0, "antiquant_scale": None}


def _is_default(given: Any, default: Any) -> bool:
    return given is None if default is None else type(given) is type(default) and given == default


def _check_block_table(table: torch.Tensor) -> torch.Tensor:
    if table.dtype != torch.int32 or table.dim() != 2 or table.stride(1) != 1:
        raise NotImplementedError(
            f"npu_graphs_cuda: a block table in a graph: only int32 rows of contiguous entries "
            f"(got {table.dtype}, shape {tuple(table.shape)}, strides {table.stride()})"
        )
    return table


@triton.jit
def _gather_rows_kernel(source_ptr, shape_ptr, table_ptr, width, BLOCK: tl.constexpr):
    """Row ``pid`` of the block table at the address in ``source_ptr`` (rows and row stride in ``shape_ptr``) into
    ``table``; rows past the source's are zero."""
    row = tl.program_id(0)
    rows = tl.load(shape_ptr)
    stride = tl.load(shape_ptr + 1)
    source = tl.load(source_ptr).to(tl.pointer_type(tl.int32))
    cols = tl.arange(0, BLOCK)
    keep = (cols < width) & (row < rows)
    values = tl.load(source + row * stride + cols, mask=keep, other=0)
    tl.store(table_ptr + row * width + cols, values, mask=cols < width)


def _row_requests(
    tokens: int, q_ends: torch.Tensor, kv_lens: torch.Tensor, width: int, device: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """For query rows ``0 .. tokens-1`` of a TND batch (``q_ends`` cumulative, ``kv_lens`` per request, device
    tensors): each row's request (clamped to the last; rows past the last end attend nothing) and the KV positions
    ``0 .. width-1`` it attends, right-down causal (``sparse_mode=3``): ``[T]``, ``[T, W]``. No host read."""
    requests = q_ends.numel()
    rows = torch.arange(tokens, device=device, dtype=torch.int32)
    request = torch.searchsorted(q_ends, rows, right=True)  # [T], == requests past the last end
    valid = request < requests
    request = request.clamp(max=requests - 1)
    q_start = torch.where(request > 0, q_ends[(request - 1).clamp(min=0)], 0)
    q_len = q_ends[request] - q_start
    kv_len = kv_lens[request]
    limit = kv_len - q_len + (rows - q_start)  # last KV position row t attends
    positions = torch.arange(width, device=device)
    allowed = (positions[None, :] <= limit[:, None]) & (positions[None, :] < kv_len[:, None]) & valid[:, None]
    return request, allowed


def _paged_rows(cache: torch.Tensor, block_table: torch.Tensor, block_size: int, request: torch.Tensor) -> torch.Tensor:
    """The block table's full width of ``cache`` (viewed as ``[blocks, block_size, ...]``) for each row's request,
    float32 ``[T, W, ...]``. Rows of padded requests are gathered but never attended: a block id past the cache reads
    block 0 instead."""
    blocks = block_table.long()
    num_blocks = cache.shape[0]
    blocks = torch.where((blocks >= 0) & (blocks < num_blocks), blocks, 0)
    width = blocks.shape[1] * block_size
    return cache[blocks].reshape(blocks.shape[0], width, *cache.shape[2:])[request].float()


def graph_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_table: torch.Tensor,
    q_ends: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    block_size: int,
    num_heads: int,
    num_key_value_heads: int,
    scale: float,
) -> torch.Tensor:
    """FIA's paged TND attention with ``sparse_mode=3`` (the semantics of npu_ops/attention.py), with the host
    parameters read from device tensors: ``q_ends [B]`` cumulative query ends, ``kv_lens [B]`` KV lengths. Fixed shapes
    and no host read, so that it can be captured: every request gathers the block table's full width of KV, and a
    query row ``t`` belongs to request ``b`` with ``q_ends[b-1] <= t < q_ends[b]``. Rows past the last request, and
    rows that attend nothing, are zero (the eager emulation leaves rows past the last request zero too). Query, key
    and value are float16 or bfloat16, one dtype, as the NPU op takes them."""
    dtypes("npu_fused_infer_attention_score", HALF, query=query, key=key, value=value)
    tokens, _, head_dim = query.shape
    kv_heads = num_key_value_heads or num_heads
    table = block_table[: q_ends.numel()]
    request, allowed = _row_requests(tokens, q_ends, kv_lens, table.shape[1] * block_size, query.device)
    group = num_heads // kv_heads
    k = _paged_rows(key.view(-1, block_size, kv_heads, head_dim), table, block_size, request)  # [T, W, KVN, D]
    v = _paged_rows(value.view(-1, block_size, kv_heads, head_dim), table, block_size, request)
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)  # [T, W, N, D]
    scores = torch.einsum("tnd,twnd->tnw", query.float(), k) * scale
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that attends nothing: all -inf -> zeros
    return torch.einsum("tnw,twnd->tnd", probs, v).to(query.dtype)


def graph_attention_mla(
    query: torch.Tensor,
    query_rope: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    block_table: torch.Tensor,
    q_ends: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    block_size: int,
    num_heads: int,
    scale: float,
) -> torch.Tensor:
    """FIA v2's MLA mode (the semantics of npu_ops/mla.py: ``TND_NTD``, ``sparse_mode=3``, one KV head) with the host
    parameters read from device tensors, as :func:`graph_attention` does for the dense mode: ``query [T, N, 512]``,
    ``query_rope [T, N, 64]``, the paged caches ``latent [blocks, 1, block_size, 512]`` (key and value) and ``rope
    [blocks, 1, block_size, 64]``, ``q_ends [B]`` cumulative, ``kv_lens [B]`` per request. Every request gathers the
    block table's full width; rows past the last request and rows that attend nothing (a padded request: KV length 0)
    are zero. Returns ``[N, T, 512]`` (NTD)."""
    dtypes("npu_fused_infer_attention_score_v2", HALF, query=query, query_rope=query_rope, latent=latent, rope=rope)
    table = block_table[: q_ends.numel()]
    request, allowed = _row_requests(query.shape[0], q_ends, kv_lens, table.shape[1] * block_size, query.device)
    c = _paged_rows(latent.view(latent.shape[0], block_size, -1), table, block_size, request)  # [T, W, 512]
    r = _paged_rows(rope.view(rope.shape[0], block_size, -1), table, block_size, request)  # [T, W, 64]
    scores = torch.einsum("tnd,twd->tnw", query.float(), c) + torch.einsum("tnd,twd->tnw", query_rope.float(), r)
    probs = torch.softmax((scores * scale).masked_fill(~allowed[:, None, :], float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("tnw,twd->ntd", probs, c).to(query.dtype)


# ----------------------------------------------------------------------------------------------------
# Installation
# ----------------------------------------------------------------------------------------------------

NPU_NAMES = {
    "NPUGraph": NPUGraph,
    "graph": graph,
    "graph_pool_handle": graph_pool_handle,
    "graph_task_group_begin": graph_task_group_begin,
    "graph_task_group_end": graph_task_group_end,
    "graph_task_update_begin": graph_task_update_begin,
    "graph_task_update_end": graph_task_update_end,
    "ExternalEvent": ExternalEvent,
}


def install() -> None:
    """Bind the names on the NPU stand-in (``torch_npu.npu`` is ``torch.npu``); CUDA only. Graph capture also reads
    the device's memory (vLLM's ``capture_model``: ``torch.cuda.mem_get_info``, which vllm-ascend maps to
    ``torch.npu.mem_get_info``; ``torch.accelerator.empty_cache``, which it routes to ``torch.npu.empty_cache``):
    torch.cuda's own functions, taken before vllm-ascend rebinds the torch.cuda names."""
    import torch_npu

    _define_c_ascend_weak_ref()
    for name, value in NPU_NAMES.items():
        setattr(torch_npu.npu, name, value)
    torch_npu.npu.mem_get_info = torch.cuda.mem_get_info
    torch_npu.npu.empty_cache = torch.cuda.empty_cache
    torch_npu.npu_fused_infer_attention_score = FusedInferAttentionScore(torch_npu.npu_fused_infer_attention_score)
    torch_npu._npu_fused_infer_attention_score_get_max_workspace = _fia_workspace
    torch_npu.npu_fused_infer_attention_score_v2 = FusedInferAttentionScoreV2(
        torch_npu.npu_fused_infer_attention_score_v2
    )
    torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace = _fia_workspace
    torch_npu._C._weak_ref_tensor = _weak_ref_tensor


def report() -> dict:
    """The ExternalEvent waits that timed out so far (0 when no graph was captured)."""
    if _FLAGS is None:
        return {"external_event_wait_timeouts": 0}
    torch.cuda.synchronize()
    return {"external_event_wait_timeouts": int(_timeouts().item())}


def check() -> None:
    timeouts = report()["external_event_wait_timeouts"]
    if timeouts:
        raise DeviceHang(
            f"{timeouts} ExternalEvent waits never saw their record (on the NPU the stream would wait forever)"
        )
