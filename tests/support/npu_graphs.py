"""A CPU double of ACL graphs and of the NPU's asynchronous streams (test-only): ``torch.npu.NPUGraph``,
``torch.npu.graph``, graph pools, ``graph_task_group_begin/end``, ``graph_task_update_begin/end``,
``torch.npu.ExternalEvent``, ``torch.npu.Event`` / ``Stream`` / ``synchronize``, and the ``.out`` variant of
``torch_npu.npu_fused_infer_attention_score`` that vllm-ascend captures in a task group and re-issues on an update
stream. :func:`activate` hangs them on the NPU stand-in for the duration of a test (the stand-in alone has none of
them: docs/graph-modes.md).

Semantics (the documented behaviour of torch_npu / CANN, cited per item; each is tested against a naive reference in
tests/patches/test_npu_graph_double.py)
--------------------------------------------------------------------------------------------------------------------
* **Device and streams.** A stream is a FIFO queue of tasks; the device runs the head task of a *ready* stream (a
  wait task is ready once what it waits for happened), one task at a time, in an order chosen by the
  :class:`Device`'s ``schedule``. ``run_ahead=False`` (default): the device runs whatever is ready each time the host
  issues work, as a device that keeps up with the host. ``run_ahead=True``: the device runs only when the host blocks
  (``synchronize()`` of the device, a stream or an event), as a device far behind the host. A host block that can
  never be satisfied (every stream's head waits on something that no queued task will do) raises
  :class:`DeviceHang`, naming each blocked task. Host drains (``torch.npu.synchronize()``,
  ``Stream.synchronize()``) are logged with the caller's ``file:line`` (:attr:`Device.drains`).
* **Host-side tensor ops run at once.** Plain torch ops issued by the host outside a capture execute immediately on
  CPU; only graph replays, task updates, event tasks and functions queued with :meth:`Device.launch` are device
  tasks. A test that needs a host write ordered behind queued device work queues it with :meth:`Device.launch`.
* **Capture** (``with torch.npu.graph(g, pool=...)``, like ``torch.cuda.graph``: a private capture stream is current
  inside). Nothing executes while capturing (ACL: captured tasks are stored in the model, not run). Every aten op
  issued in the block is recorded: a functional op with its output tensors (filled with NaN / the dtype's minimum so
  that a read of an un-replayed capture output is visible), an in-place / ``out=`` op with the tensors it writes.
  View ops run (they alias and move no data). Tensors are recorded by identity (static buffers: a replay reads their
  contents at replay time); every other argument is frozen as captured (**frozen host parameters**). A host read of
  device data (``.item()``) and a synchronize inside the capture raise :class:`GraphError` (ACL refuses
  synchronisation on a capturing stream, error 107027).
* **Replay** (``g.replay()``) queues the recorded tasks on the current stream, in capture order: a functional op
  re-runs on its recorded inputs and its result is copied into its recorded outputs; an in-place op re-runs.
* **Task groups** (``graph_task_group_begin(stream)`` / ``graph_task_group_end(stream) -> handle`` inside a capture,
  on the capturing stream; CANN ``aclmdlRICaptureTaskGrpBegin/End``). The NPU op called between them (its ``.out``
  variant) is recorded as the group's task with its host parameters; **it keeps them until an update re-issues it**.
* **Updates** (``graph_task_update_begin(stream, handle)`` / ``graph_task_update_end(stream)``; CANN
  ``aclmdlRICaptureTaskUpdateBegin/End``): the same number and kinds of ops as the group holds are called between
  them; ``update_end`` queues **one update task on that stream**, which replaces the group's parameters when the
  device runs it (``aclmdlRICaptureTaskUpdateEnd``: the update is asynchronous, a returned call does not mean it is
  done). The stream must not be capturing and must not be the capture stream. A group is updated from one stream only
  (CANN's task-update guide: a task group is a critical resource, not updated from several threads or streams).
* **Which replay an update is for.** An update re-issues a group's parameters for the graph's latest replay the host
  had queued when it called ``update_end`` (vllm-ascend's order: replay, then update). When a group's task runs in
  replay *r* with parameters issued for another replay (or for the capture), the double raises
  :class:`StaleTaskGroup` naming the group: the **stale-parameter** bug class (an update that was never issued for
  this step, or the next step's update that overtook this step's replay). ``Device(check_stale=False)`` logs it
  instead (:attr:`Device.group_runs`).
* **ExternalEvent** (torch_npu ``ExternalEvent``; CANN external events): a flag. ``record(stream)`` queues a task
  that sets it, ``wait(stream)`` a task that blocks the stream until it is set, ``reset(stream)`` a task that clears
  it; ``wait`` does not clear it (torch_npu 7.x docs: wait, reset, record; the 26.0 docs have ``wait`` clear it, the
  same order for vllm-ascend, which calls ``reset`` right after each ``wait``). Called
  on the capturing stream, wait / reset are captured into the graph: **the captured wait holds the graph's next task
  until the update's record**.
* **Event** (``torch.npu.Event``): ``record(stream)`` marks the tasks issued on the stream so far; ``wait(stream)``
  blocks a stream until they ran; ``synchronize()`` blocks the host until they ran; an event never recorded is
  complete. **Graph pools**: ``graph_pool_handle()`` returns a pool object that graphs record; memory is not pooled
  (CPU allocations stay distinct).
* **NPU ops.** ``npu_fused_infer_attention_score`` is the eager emulation of tests/support/npu_ops/attention.py; its
  ``.out(..., workspace=, out=[attn_out, softmax_lse])`` writes the attention output into ``out[0]`` (and ``out[1]``
  only with ``softmax_lse_flag=True``). The workspace has no emulated meaning:
  ``_npu_fused_infer_attention_score_get_max_workspace`` returns an empty tensor and ``.out`` ignores it.
  ``torch_npu._C._weak_ref_tensor`` (0.18) and ``torch.ops._C_ascend.weak_ref_tensor`` (0.13) return an alias of
  their tensor (same storage; the alias keeps it alive, which a weak reference would not).

What it cannot show
-------------------
Real kernel timing and overlap; anything about ACL's implementation beyond the documented contract above (e.g. how a
task update patches a task, the task queue's host thread, multi-stream capture, which raises
``NotImplementedError``); memory reuse inside graph pools; host reads of a CPU tensor by an NPU op at launch time
(tensor arguments are recorded by reference and read when the task runs, the pessimistic case).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import os
import random
import sys
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

_HERE = os.path.abspath(__file__)


class DeviceHang(RuntimeError):
    """The host waits for device work that can never run (every queued stream waits on something nothing will do)."""


class StaleTaskGroup(RuntimeError):
    """A task group ran in a replay with parameters that were not issued for that replay."""


class GraphError(RuntimeError):
    """A use of graphs / task groups / updates that the NPU runtime refuses."""


def _site() -> str:
    """``file:line (function)`` of the first caller outside this module (the last three path parts)."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename) == _HERE:
        frame = frame.f_back
    if frame is None:
        return "?"
    path = "/".join(frame.f_code.co_filename.replace(os.sep, "/").split("/")[-3:])
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


# ----------------------------------------------------------------------------------------------------
# Tasks and the device
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Task:
    """One device task: ``run`` when the device reaches it, once ``ready()`` holds."""

    name: str
    run: Callable[[], None] = lambda: None
    ready: Callable[[], bool] = lambda: True
    seq: int = 0
    done: bool = False

    def __repr__(self) -> str:
        return f"<task {self.name}>"


@dataclasses.dataclass
class Drain:
    """A host drain: ``kind`` "device" (torch.npu.synchronize) or "stream" (Stream.synchronize)."""

    kind: str
    stream: str
    site: str


@dataclasses.dataclass
class GroupRun:
    """One execution of a task group in a replay (``params_for``: the replay its parameters were issued for; 0 =
    the capture)."""

    group: TaskGroup
    replay: int
    params_for: int
    calls: list


SCHEDULES = ("issue-order", "side-streams-first", "default-stream-first")


class Device:
    """The device: its streams, the capture / update in progress, and the logs tests read.

    ``schedule``: which ready stream runs next -- ``"issue-order"`` (the task the host issued first), ``"side-streams-
    first"`` (any stream but the default one, as soon as it can: an idle update stream that runs its tasks at once),
    ``"default-stream-first"``, ``"random:<seed>"``, or a callable ``(ready streams) -> stream``.
    """

    def __init__(
        self, *, run_ahead: bool = False, schedule: str | Callable = "issue-order", check_stale: bool = True
    ) -> None:
        self.run_ahead = run_ahead
        self.check_stale = check_stale
        self._schedule = self._make_schedule(schedule)
        self._seq = itertools.count(1)
        self._graph_ids = itertools.count(1)
        self.streams: list[Stream] = []
        self.default = Stream(name="default", _device=self)
        self._current: list[Stream] = [self.default]
        self.capture: Capture | None = None
        self.updating: PendingUpdate | None = None
        self.running = False
        self.drains: list[Drain] = []
        self.group_runs: list[GroupRun] = []
        self.executed: list[str] = []  # names of the tasks run, in order

    # -- scheduling -----------------------------------------------------------------------------------
    def _make_schedule(self, schedule: str | Callable) -> Callable[[list[Stream]], Stream]:
        if callable(schedule):
            return schedule
        if schedule == "issue-order":
            return lambda ready: min(ready, key=lambda s: s.queue[0].seq)
        if schedule == "side-streams-first":
            return lambda ready: min(ready, key=lambda s: (s is self.default, s.queue[0].seq))
        if schedule == "default-stream-first":
            return lambda ready: min(ready, key=lambda s: (s is not self.default, s.queue[0].seq))
        if schedule.startswith("random:"):
            rng = random.Random(int(schedule.split(":", 1)[1]))
            return lambda ready: ready[rng.randrange(len(ready))]
        raise ValueError(f"unknown schedule {schedule!r} (valid: {', '.join(SCHEDULES)}, random:<seed>, a callable)")

    # -- issuing -------------------------------------------------------------------------------------
    def current_stream(self) -> Stream:
        return self._current[-1]

    def enqueue(self, stream: Stream, task: Task) -> Task:
        task.seq = next(self._seq)
        stream.queue.append(task)
        if not self.run_ahead:
            self.run(until=None)
        return task

    def launch(self, fn: Callable[[], None], *, stream: Stream | None = None, name: str = "kernel") -> Task:
        """Queue a host function as a device task (a kernel / copy that must be stream-ordered)."""
        return self.enqueue(stream or self.current_stream(), Task(name, run=fn))

    # -- running -------------------------------------------------------------------------------------
    def run(self, until: Callable[[], bool] | None) -> None:
        """Run ready tasks until ``until()`` holds (None: until nothing is ready). Raises :class:`DeviceHang` when
        ``until`` can no longer become true."""
        if self.running:  # a task that issues work (never done by the tasks of this module)
            return
        self.running = True
        try:
            with _no_capture_recording():
                while True:
                    if until is not None and until():
                        return
                    ready = [s for s in self.streams if s.queue and s.queue[0].ready()]
                    if not ready:
                        if until is None:
                            return
                        raise DeviceHang(self.describe_blocked())
                    stream = self._schedule(ready)
                    task = stream.queue.popleft()
                    self.executed.append(f"{stream.name}:{task.name}")
                    task.run()
                    task.done = True
        finally:
            self.running = False

    def describe_blocked(self) -> str:
        heads = []
        for s in self.streams:
            if s.queue:
                guarded = next((t.name for t in s.queue if t.name.startswith("task group")), None)
                heads.append(
                    f"stream {s.name!r} waits at {s.queue[0].name}" + (f", before {guarded}" if guarded else "")
                )
        return "device hang: the host waits for work that cannot run; " + ("; ".join(heads) or "no queued task")

    def host_drain(self, stream: Stream | None) -> None:
        if self.capture is not None:
            raise GraphError("synchronize while a graph is being captured (ACL error 107027)")
        kind, name = ("device", "*") if stream is None else ("stream", stream.name)
        self.drains.append(Drain(kind, name, _site()))
        streams = self.streams if stream is None else [stream]
        self.run(until=lambda: all(not s.queue for s in streams))

    def idle(self) -> bool:
        return all(not s.queue for s in self.streams)


_DEVICE: Device | None = None


def device() -> Device:
    if _DEVICE is None:
        raise RuntimeError("npu_graphs: no device is active (use npu_graphs.activate())")
    return _DEVICE


@contextlib.contextmanager
def _no_capture_recording() -> Iterator[None]:
    """Device tasks run with no capture mode active (a task's aten ops are not recorded into a capture in progress)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


# ----------------------------------------------------------------------------------------------------
# Streams and events
# ----------------------------------------------------------------------------------------------------


class Stream:
    """A device stream (FIFO of tasks)."""

    _names = itertools.count(1)

    def __init__(
        self, device: Any = None, priority: int = 0, *, name: str | None = None, _device: Device | None = None
    ):
        self._dev = _device or globals()["device"]()
        self.name = name or f"stream{next(Stream._names)}"
        self.priority = priority
        self.queue: deque[Task] = deque()
        self._dev.streams.append(self)

    def synchronize(self) -> None:
        self._dev.host_drain(self)

    def query(self) -> bool:
        return not self.queue

    def wait_stream(self, other: Stream) -> None:
        event = Event()
        event.record(other)
        event.wait(self)

    def wait_event(self, event: Event) -> None:
        event.wait(self)

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"<npu_graphs Stream {self.name}>"


def _issue(stream: Stream | None, task: Task, *, capturable: bool) -> None:
    """Queue ``task`` on ``stream`` (default: current), or record it into the capture when ``stream`` captures."""
    dev = device()
    stream = stream or dev.current_stream()
    cap = dev.capture
    if cap is not None and stream is cap.stream:
        if not capturable:
            raise NotImplementedError(f"npu_graphs: {task.name} on a capturing stream is not modelled")
        cap.graph.tasks.append(_Template(task.name, lambda epoch, t=task: Task(t.name, run=t.run, ready=t.ready)))
        return
    dev.enqueue(stream, task)


class Event:
    """``torch.npu.Event``: marks the tasks issued on a stream so far."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **kw: Any):
        self._marker: Task | None = None

    def record(self, stream: Stream | None = None) -> None:
        self._marker = Task("event.record")
        _issue(stream, self._marker, capturable=False)

    def wait(self, stream: Stream | None = None) -> None:
        marker = self._marker
        if marker is not None:
            _issue(stream, Task("event.wait", ready=lambda: marker.done), capturable=False)

    def synchronize(self) -> None:
        marker = self._marker
        if marker is not None:
            device().run(until=lambda: marker.done)

    def query(self) -> bool:
        return self._marker is None or self._marker.done

    def elapsed_time(self, end_event: Event) -> float:
        raise NotImplementedError("npu_graphs: Event.elapsed_time needs a device clock")


class ExternalEvent:
    """``torch.npu.ExternalEvent``: a flag set by ``record``, awaited by ``wait``, cleared by ``reset``."""

    _ids = itertools.count(1)

    def __init__(self) -> None:
        self.flag = False
        self.id = next(ExternalEvent._ids)

    def _set(self, value: bool) -> None:
        self.flag = value

    def record(self, stream: Stream | None = None) -> None:
        _issue(stream, Task(f"ext{self.id}.record", run=lambda: self._set(True)), capturable=True)

    def wait(self, stream: Stream | None = None) -> None:
        _issue(stream, Task(f"ext{self.id}.wait", ready=lambda: self.flag), capturable=True)

    def reset(self, stream: Stream | None = None) -> None:
        _issue(stream, Task(f"ext{self.id}.reset", run=lambda: self._set(False)), capturable=True)


# ----------------------------------------------------------------------------------------------------
# Graphs, capture, task groups, updates
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Template:
    """A captured task: ``make(replay)`` builds the task one replay queues."""

    name: str
    make: Callable[[int], Task]


class GraphPool:
    """``graph_pool_handle()``: recorded by the graphs captured with it; memory is not pooled."""


def graph_pool_handle() -> GraphPool:
    return GraphPool()


class NPUGraph:
    """``torch.npu.NPUGraph``: the tasks recorded by one capture, queued again by every :meth:`replay`."""

    def __init__(self) -> None:
        self.id = next(device()._graph_ids)
        self.tasks: list[_Template] = []
        self.groups: list[TaskGroup] = []
        self.captured = False
        self.replays = 0  # replays the host has queued
        self.pool: GraphPool | None = None
        self.capture_stream: Stream | None = None

    def replay(self) -> None:
        dev = device()
        if not self.captured:
            raise GraphError(f"graph {self.id} replayed before it was captured")
        if dev.capture is not None:
            raise NotImplementedError("npu_graphs: replaying a graph inside a capture is not modelled")
        self.replays += 1
        epoch = self.replays
        stream = dev.current_stream()
        tasks = [t.make(epoch) for t in self.tasks]
        for task in tasks:
            task.seq = next(dev._seq)
            stream.queue.append(task)
        if not dev.run_ahead:
            dev.run(until=None)

    def __repr__(self) -> str:
        return f"<npu_graphs NPUGraph {self.id}>"


@dataclasses.dataclass
class OpCall:
    """One call of an NPU op's ``.out`` variant, with its host parameters frozen."""

    op: OutVariantOp
    args: tuple
    kwargs: dict
    site: str


def _freeze(value: Any) -> Any:
    """Tensors by identity (device memory), everything else copied as it is now (host parameters)."""
    return tree_map(lambda x: x if isinstance(x, torch.Tensor) else copy.deepcopy(x), value)


class TaskGroup:
    """A captured task group (the ``handle`` of ``graph_task_group_end``)."""

    def __init__(self, graph: NPUGraph, index: int, site: str) -> None:
        self.graph, self.index, self.site = graph, index, site
        self.calls: list[OpCall] = []  # current parameters
        self.params_for = 0  # the replay the parameters were issued for (0: the capture)
        self.update_stream: Stream | None = None
        self.closed = False

    @property
    def name(self) -> str:
        ops = ", ".join(c.op.name for c in self.calls) or "empty"
        return f"task group {self.index} of graph {self.graph.id} ({ops}; captured at {self.site})"

    def execute(self, replay: int) -> None:
        dev = device()
        if self.params_for != replay and dev.check_stale:
            issued = "the capture" if self.params_for == 0 else f"replay {self.params_for}"
            raise StaleTaskGroup(
                f"{self.name} ran in replay {replay} of graph {self.graph.id} with the parameters issued for "
                f"{issued}: no update was issued for this replay, or a later replay's update overtook it"
            )
        dev.group_runs.append(GroupRun(self, replay, self.params_for, list(self.calls)))
        for call in self.calls:
            call.op.execute(call)

    def __repr__(self) -> str:
        return f"<npu_graphs {self.name}>"


class Capture:
    def __init__(self, graph: NPUGraph, stream: Stream) -> None:
        self.graph, self.stream = graph, stream
        self.group: TaskGroup | None = None


@dataclasses.dataclass
class PendingUpdate:
    stream: Stream
    group: TaskGroup
    calls: list


def _is_write(arg: Any) -> bool:
    return arg.alias_info is not None and arg.alias_info.is_write


class _CaptureMode(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the aten ops issued inside ``torch.npu.graph`` (see the module docstring, "Capture")."""

    def __init__(self, capture: Capture) -> None:
        super().__init__()
        self.capture = capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in _ALLOCATIONS:  # memory, not a task: the contents are undefined until written
            out = func(*args, **kwargs)
            _poison(out)
            return out
        if func.is_view:  # metadata only: no task (a view of a captured tensor aliases it at every replay)
            return func(*args, **kwargs)
        if self.capture.group is not None:
            raise GraphError(f"aten op {func} inside a task group: only the grouped NPU op may be there")
        if func is torch.ops.aten._local_scalar_dense.default:
            raise GraphError("a host read of device data (.item()) inside a graph capture (ACL would synchronise)")
        schema = func._schema
        frozen_args, frozen_kwargs = _freeze(args), _freeze(kwargs)
        if schema.is_mutable:
            self._record(func.__name__, lambda: func(*frozen_args, **frozen_kwargs))
            return _written_result(func, args, kwargs)
        out = func(*args, **kwargs)
        leaves, _ = tree_flatten(out)
        if not all(isinstance(x, torch.Tensor) for x in leaves):
            raise GraphError(f"aten op {func} returns a host value inside a graph capture")
        inputs = {
            x.untyped_storage().data_ptr() for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)
        }
        if any(x.untyped_storage().data_ptr() in inputs for x in leaves):
            return out  # returns (a view of) an input, like a view op: no data moves
        for x in leaves:
            _poison(x)

        def rerun(out=out):
            result = func(*frozen_args, **frozen_kwargs)
            for dst, src in zip(tree_flatten(out)[0], tree_flatten(result)[0]):
                dst.copy_(src)

        self._record(func.__name__, rerun)
        return out

    def _record(self, name: str, fn: Callable[[], None]) -> None:
        self.capture.graph.tasks.append(_Template(name, lambda epoch: Task(name, run=fn)))


_ALLOCATIONS = (torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like)


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).min)


def _written_result(func: Any, args: tuple, kwargs: dict) -> Any:
    """What an in-place / out= op returns (the arguments it writes, per its schema), without running it."""
    schema = func._schema
    bound = {a.name: (args[i] if i < len(args) else kwargs.get(a.name)) for i, a in enumerate(schema.arguments)}
    results = []
    for ret in schema.returns:
        if ret.alias_info is None:
            raise NotImplementedError(f"npu_graphs: mutable op {func} returning a fresh value is not modelled")
        src = next(
            a
            for a in schema.arguments
            if a.alias_info is not None and a.alias_info.before_set == ret.alias_info.before_set
        )
        results.append(bound[src.name])
    if not results:
        return None
    return results[0] if len(results) == 1 else tuple(results)


class graph:
    """``torch.npu.graph(npu_graph, pool=None, stream=None)``: capture the tasks issued in the block."""

    def __init__(self, npu_graph: NPUGraph, pool: Any = None, stream: Stream | None = None, **kwargs: Any) -> None:
        self.npu_graph, self.pool, self.stream = npu_graph, pool, stream
        self._mode: _CaptureMode | None = None

    def __enter__(self) -> graph:
        dev = device()
        if dev.capture is not None:
            raise GraphError("a graph capture inside another capture")
        if self.npu_graph.captured:
            raise GraphError(f"graph {self.npu_graph.id} captured twice")
        stream = self.stream or Stream(name=f"capture{self.npu_graph.id}")
        self.npu_graph.pool, self.npu_graph.capture_stream = self.pool, stream
        dev.capture = Capture(self.npu_graph, stream)
        dev._current.append(stream)
        self._mode = _CaptureMode(dev.capture)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        dev = device()
        assert self._mode is not None
        self._mode.__exit__(*exc)
        open_group = dev.capture.group if dev.capture else None
        dev._current.pop()
        dev.capture = None
        if open_group is not None and exc[0] is None:
            raise GraphError(f"capture ended inside an open task group ({open_group.name})")
        self.npu_graph.captured = exc[0] is None


def graph_task_group_begin(stream: Stream) -> None:
    cap = device().capture
    if cap is None or stream is not cap.stream:
        raise GraphError("graph_task_group_begin on a stream that is not capturing")
    if cap.group is not None:
        raise GraphError(f"graph_task_group_begin inside an open task group ({cap.group.name})")
    cap.group = TaskGroup(cap.graph, len(cap.graph.groups), _site())


def graph_task_group_end(stream: Stream) -> TaskGroup:
    cap = device().capture
    if cap is None or stream is not cap.stream or cap.group is None:
        raise GraphError("graph_task_group_end without a task group open on this capturing stream")
    group, cap.group = cap.group, None
    if not group.calls:
        raise GraphError(f"{group.name}: a task group holds at least one task")
    group.closed = True
    cap.graph.groups.append(group)
    cap.graph.tasks.append(
        _Template(f"group{group.index}", lambda epoch, g=group: Task(g.name, run=lambda: g.execute(epoch)))
    )
    return group


def graph_task_update_begin(stream: Stream, handle: TaskGroup) -> None:
    dev = device()
    if not isinstance(handle, TaskGroup) or not handle.closed:
        raise GraphError(f"graph_task_update_begin: {handle!r} is not a task group handle")
    if dev.capture is not None and stream is dev.capture.stream:
        raise GraphError("graph_task_update_begin on a capturing stream")
    if stream is handle.graph.capture_stream:
        raise GraphError(f"{handle.name}: the update stream must differ from the capture stream")
    if dev.updating is not None:
        raise GraphError(f"graph_task_update_begin inside an open update of {dev.updating.group.name}")
    if handle.update_stream is not None and handle.update_stream is not stream:
        raise GraphError(f"{handle.name}: updated from two streams (a task group is updated from one stream only)")
    dev.updating = PendingUpdate(stream, handle, [])


def graph_task_update_end(stream: Stream) -> None:
    dev = device()
    pending = dev.updating
    if pending is None or pending.stream is not stream:
        raise GraphError("graph_task_update_end without graph_task_update_begin on this stream")
    dev.updating = None
    group = pending.group
    if [c.op.name for c in pending.calls] != [c.op.name for c in group.calls]:
        raise GraphError(
            f"{group.name}: the update issues {[c.op.name for c in pending.calls]}, the group holds "
            f"{[c.op.name for c in group.calls]} (same number and kinds of tasks)"
        )
    group.update_stream = stream
    calls, replay = pending.calls, group.graph.replays

    def apply() -> None:
        group.calls, group.params_for = calls, replay

    dev.enqueue(stream, Task(f"update of group{group.index} (graph {group.graph.id}) for replay {replay}", run=apply))


def synchronize(device_index: Any = None) -> None:
    device().host_drain(None)


def current_stream(device_index: Any = None) -> Stream:
    return device().current_stream()


def default_stream(device_index: Any = None) -> Stream:
    return device().default


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[Stream | None]:
    dev = device()
    if s is None:
        yield None
        return
    if dev.capture is not None and s is not dev.capture.stream:
        raise NotImplementedError(
            "npu_graphs: switching streams inside a capture (multi-stream capture) is not modelled"
        )
    dev._current.append(s)
    try:
        yield s
    finally:
        dev._current.pop()


def is_current_stream_capturing() -> bool:
    dev = device()
    return dev.capture is not None and dev.current_stream() is dev.capture.stream


# ----------------------------------------------------------------------------------------------------
# NPU ops with an .out variant
# ----------------------------------------------------------------------------------------------------


class OutVariantOp:
    """An NPU op callable eagerly and through ``.out(..., out=[...], workspace=...)``, the form vllm-ascend captures
    in a task group and re-issues in an update. ``write`` copies the eager result into ``out``."""

    def __init__(self, name: str, eager: Callable, write: Callable[[Any, list, dict], None]) -> None:
        self.name, self._eager, self._write = name, eager, write

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._eager(*args, **kwargs)  # inside a capture its aten ops are recorded, its host arguments frozen

    def out(self, *args: Any, out: list, workspace: Any = None, **kwargs: Any) -> None:
        dev = device()
        call = OpCall(self, _freeze(args), {**_freeze(kwargs), "out": out}, _site())
        if dev.updating is not None:
            dev.updating.calls.append(call)
        elif dev.capture is not None and dev.capture.group is not None:
            dev.capture.group.calls.append(call)
        elif dev.capture is not None:  # captured outside a task group: its host parameters stay the captured ones
            dev.capture.graph.tasks.append(
                _Template(self.name, lambda epoch: Task(self.name, run=lambda: self.execute(call)))
            )
        else:
            self.execute(call)

    def execute(self, call: OpCall) -> None:
        kwargs = dict(call.kwargs)
        out = kwargs.pop("out")
        with _no_capture_recording():
            result = self._eager(*call.args, **kwargs)
        self._write(result, out, kwargs)

    def __repr__(self) -> str:
        return f"<npu_graphs op {self.name}>"


def _write_attention(result: Any, out: list, kwargs: dict) -> None:
    attn, lse = result
    out[0].view(-1)[: attn.numel()].copy_(attn.reshape(-1))
    if kwargs.get("softmax_lse_flag", False):
        out[1].copy_(lse.view_as(out[1]))


def _fia_workspace(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _weak_ref_tensor(tensor: Any) -> Any:
    return torch.ops.aten.alias(tensor) if isinstance(tensor, torch.Tensor) else tensor


def _define_c_ascend_weak_ref() -> None:
    """vllm-ascend 0.13's ``torch.ops._C_ascend.weak_ref_tensor`` (its compiled extension): an alias of the tensor.
    Defined once per process (torch.library cannot unregister an op)."""
    try:
        torch.ops._C_ascend.weak_ref_tensor  # noqa: B018
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("_C_ascend", "FRAGMENT")
    lib.define("weak_ref_tensor(Tensor(a) tensor) -> Tensor(a)")
    lib.impl("weak_ref_tensor", lambda t: torch.ops.aten.alias(t), "CompositeExplicitAutograd")
    _LIBS.append(lib)


_LIBS: list = []


# ----------------------------------------------------------------------------------------------------
# Activation
# ----------------------------------------------------------------------------------------------------

NPU_NAMES = {
    "Stream": Stream,
    "Event": Event,
    "ExternalEvent": ExternalEvent,
    "NPUGraph": NPUGraph,
    "graph": graph,
    "graph_pool_handle": graph_pool_handle,
    "graph_task_group_begin": graph_task_group_begin,
    "graph_task_group_end": graph_task_group_end,
    "graph_task_update_begin": graph_task_update_begin,
    "graph_task_update_end": graph_task_update_end,
    "synchronize": synchronize,
    "current_stream": current_stream,
    "default_stream": default_stream,
    "stream": stream,
    "is_current_stream_capturing": is_current_stream_capturing,
}


@contextlib.contextmanager
def activate(**device_kwargs: Any) -> Iterator[Device]:
    """A fresh :class:`Device` and the double's names on the NPU stand-in (``torch.npu`` = ``torch_npu.npu``,
    ``torch_npu``, ``torch_npu._C``) for the duration of the block; the stand-in's own objects come back after it."""
    global _DEVICE
    import torch_npu

    from npu_ops.attention import npu_fused_infer_attention_score

    if _DEVICE is not None:
        raise RuntimeError("npu_graphs: already active")
    _define_c_ascend_weak_ref()
    fia = OutVariantOp("npu_fused_infer_attention_score", npu_fused_infer_attention_score, _write_attention)
    bindings = [(torch_npu.npu, name, value) for name, value in NPU_NAMES.items()]
    bindings += [
        (torch_npu, "npu_fused_infer_attention_score", fia),
        (torch_npu, "_npu_fused_infer_attention_score_get_max_workspace", _fia_workspace),
        (torch_npu._C, "_weak_ref_tensor", _weak_ref_tensor),
    ]
    missing = object()
    saved = [(obj, name, obj.__dict__.get(name, missing)) for obj, name, _ in bindings]
    _DEVICE = Device(**device_kwargs)
    try:
        for obj, name, value in bindings:
            setattr(obj, name, value)
        yield _DEVICE
    finally:
        _DEVICE = None
        for obj, name, old in reversed(saved):
            if old is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
