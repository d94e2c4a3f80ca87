"""The ACL-graph replay patches of adapters ascend-0.13 / ascend-0.18 (their specs say why and how):
vllm-ascend 0.13.0 / 0.18.0 drain the device from the host before every graph replay (``ACLGraphWrapper.__call__``:
``torch.npu.synchronize()`` at 0.13.0, ``torch.npu.current_stream().synchronize()`` at 0.18.0). All three act through
one wrapper of ``ACLGraphWrapper.__call__`` (:func:`make_call`), under async scheduling with speculative decoding only:

* ``piecewise-drain-once-per-step`` (default; upstream's v0.23.0 form): in PIECEWISE mode the first drain of each
  target forward runs as released; the later pieces' and the drafter's do nothing (:class:`OncePerForwardTorch`).
* ``piecewise-replay-without-host-drain`` (opt-in): in PIECEWISE mode no drain at all (:class:`NoDrainTorch`); it
  supersedes the first.
* ``full-replay-ordered-on-device`` (opt-in): before a FULL replay the drain becomes an event on the replay's stream,
  and the task-group updates wait for it on their update stream (:class:`FullOrdering`; docs/graph-modes.md).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

from ...registry import MARK_ID, NPU_CONTRACT, UPSTREAM, Patch, RestsOn

PIECEWISE, FULL = "PIECEWISE", "FULL"


# Host drains before replays in this process, as the patches decided (diagnostics: tests, the engine's run report):
# "skipped" before PIECEWISE replays (left out); "once" before the first PIECEWISE replay of a target forward (run as
# released); "replaced" before FULL replays, by a device boundary; "kept" before FULL replays that followed a replay
# no update came after (run as released).
DRAINS: collections.Counter = collections.Counter()


def _skip() -> None:
    DRAINS["skipped"] += 1


class HookedStream:
    """A stream whose ``synchronize()`` calls ``on_drain(stream.synchronize)``; every other name is the stream's."""

    def __init__(self, stream: Any, on_drain: Callable[[Callable[[], Any]], None]) -> None:
        self._stream, self._on_drain = stream, on_drain

    def synchronize(self) -> None:
        self._on_drain(self._stream.synchronize)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class HookedNpu:
    """``torch.npu`` whose two host drains, ``synchronize()`` and ``current_stream().synchronize()``, call
    ``on_drain(the real drain)``; every other name is ``torch.npu``'s."""

    def __init__(self, npu: Any, on_drain: Callable[[Callable[[], Any]], None]) -> None:
        self._npu, self._on_drain = npu, on_drain

    def synchronize(self, device: Any = None) -> None:
        self._on_drain(lambda: self._npu.synchronize(device))

    def current_stream(self, *args: Any, **kwargs: Any) -> HookedStream:
        return HookedStream(self._npu.current_stream(*args, **kwargs), self._on_drain)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._npu, name)


class HookedTorch:
    """``torch`` as the release's ``ACLGraphWrapper.__call__`` sees it while a fix runs it: ``torch.npu`` is a
    :class:`HookedNpu`; every other name is ``torch``'s."""

    def __init__(self, torch: Any, on_drain: Callable[[Callable[[], Any]], None]) -> None:
        self._torch = torch
        self.npu = HookedNpu(torch.npu, on_drain)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


class NoDrainTorch(HookedTorch):
    """PIECEWISE: both drains do nothing (counted in :data:`DRAINS`)."""

    def __init__(self, torch: Any) -> None:
        super().__init__(torch, lambda drain: _skip())


class OncePerForwardTorch(HookedTorch):
    """PIECEWISE, one drain per step: the first drain within a target model's forward context runs (the release's
    own call, before the forward's first piece replay); every later one in that forward, and every one in a drafter's
    forward (``forward_context.is_draft_model``), does nothing. Counted in :data:`DRAINS`."""

    # the forward context whose drain ran (held until the next target forward drains: one context object)
    drained_forward: Any = None

    def __init__(self, torch: Any) -> None:
        super().__init__(torch, self._once_per_target_forward)

    @classmethod
    def _once_per_target_forward(cls, drain: Callable[[], Any]) -> None:
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        if getattr(context, "is_draft_model", False) or context is cls.drained_forward:
            _skip()
            return
        cls.drained_forward = context
        DRAINS["once"] += 1
        drain()


class FullOrdering:
    """The device-side ordering that replaces the drain before a FULL replay (this process's state; a worker has one
    runner). The hazard the drain guards against (vllm-ascend #4233): the update of a task group for replay N+1,
    issued on an update stream after that replay is queued, runs before replay N has consumed the group. Here:

    * where the release drains before a replay, an event (the *boundary*) is recorded on the replay's stream instead:
      it completes once everything queued before the replay has run, replay N included;
    * before each task-group update the update stream waits for the latest boundary, so the update runs after every
      replay queued before the one it serves, and its external-event record after their resets;
    * a replay that follows a replay no update came after (the releases' MTP drafter replays its FULL graph k times
      per update) is drained as released: that pairing is outside what the boundary covers."""

    boundary: Any = None
    # the boundary before: an event is not destroyed while it may still be pending (the host is at most about one
    # step ahead: zero-bubble waits each step for the previous step's accepted counts)
    retired: Any = None
    serial = 0
    replays_without_update = 0
    waited: dict[Any, int] = {}  # update stream -> serial of the boundary it waits behind

    @classmethod
    def reset(cls) -> None:
        cls.boundary, cls.retired, cls.serial, cls.replays_without_update, cls.waited = None, None, 0, 0, {}

    @classmethod
    def at_drain(cls, torch: Any, drain: Callable[[], Any]) -> None:
        if cls.replays_without_update:
            DRAINS["kept"] += 1
            drain()
        else:
            event = torch.npu.Event()
            event.record(torch.npu.current_stream())
            cls.retired, cls.boundary, cls.serial = cls.boundary, event, cls.serial + 1
            DRAINS["replaced"] += 1
        cls.replays_without_update += 1

    @classmethod
    def before_update(cls, update_stream: Any) -> None:
        cls.replays_without_update = 0
        if cls.boundary is not None and cls.waited.get(update_stream) != cls.serial:
            update_stream.wait_event(cls.boundary)
            cls.waited[update_stream] = cls.serial


def async_spec_decode(vllm_config: Any) -> bool:
    """Async scheduling with speculative decoding: the configuration zb-patch serves, where the host waits on an event
    recorded behind the previous step's input copies before it rewrites their host buffers (docs/graph-modes.md)."""
    return bool(
        getattr(vllm_config.scheduler_config, "async_scheduling", False)
        and getattr(vllm_config, "speculative_config", None) is not None
    )


FULL_ORDERING_ID = "full-replay-ordered-on-device"
# the releases' task-group update entry points, defined in acl_graph beside the wrapper (0.18.0: one; 0.13.0: four,
# one patch each, the first of them named here)
UPDATE_ENTRY_POINTS = ("update_full_graph_params", "update_attn_params")


def full_ordering_installed(namespace: dict) -> bool:
    """Whether ``full-replay-ordered-on-device`` replaced the update entry point of this ``acl_graph`` module."""
    return any(getattr(namespace.get(name), MARK_ID, "").startswith(FULL_ORDERING_ID) for name in UPDATE_ENTRY_POINTS)


def make_call(piecewise: Callable[[Any], HookedTorch]) -> Callable[[Callable], Callable]:
    """``make`` of the wrapper of ``ACLGraphWrapper.__call__``, for a wrapper about to capture or replay in its own
    mode (the forward context's runtime mode) under async scheduling with speculative decoding: PIECEWISE runs the
    release's ``__call__`` with the module's ``torch`` rebound to a ``piecewise`` stand-in (:class:`OncePerForwardTorch`
    or :class:`NoDrainTorch`); FULL, while ``full-replay-ordered-on-device`` is applied, to a :class:`HookedTorch`
    whose drains go to :meth:`FullOrdering.at_drain`; the name is restored after the call. Every other call is the
    release's, unchanged."""

    def make(original: Callable) -> Callable:
        return _call(original, piecewise)

    return make


def _call(original: Callable, piecewise: Callable[[Any], HookedTorch]) -> Callable:
    namespace = original.__globals__  # vllm_ascend.compilation.acl_graph's module namespace
    stand_ins: dict[tuple[int, str], HookedTorch] = {}  # per torch module seen and mode (built once)

    def __call__(wrapper, *args, **kwargs):
        mode = getattr(wrapper.runtime_mode, "name", None)
        if mode not in (PIECEWISE, FULL) or not async_spec_decode(wrapper.vllm_config):
            return original(wrapper, *args, **kwargs)
        if mode == FULL and not full_ordering_installed(namespace):
            return original(wrapper, *args, **kwargs)
        from vllm.forward_context import get_forward_context

        torch = namespace["torch"]
        if getattr(get_forward_context().cudagraph_runtime_mode, "name", None) != mode or isinstance(
            torch, HookedTorch
        ):
            return original(wrapper, *args, **kwargs)
        stand_in = stand_ins.get((id(torch), mode))
        if stand_in is None:
            if mode == PIECEWISE:
                stand_in = piecewise(torch)
            else:
                stand_in = HookedTorch(torch, functools.partial(FullOrdering.at_drain, torch))
            stand_ins[(id(torch), mode)] = stand_in
        namespace["torch"] = stand_in
        try:
            return original(wrapper, *args, **kwargs)
        finally:
            namespace["torch"] = torch

    return __call__


def make_ordered_update(stream_arg: int) -> Callable[[Callable], Callable]:
    """``make`` of a task-group update entry point whose update stream is positional argument ``stream_arg``: the
    stream waits for :class:`FullOrdering`'s latest boundary, then the release's update runs."""

    def make(original: Callable) -> Callable:
        def ordered_update(*args, **kwargs):
            stream = args[stream_arg] if len(args) > stream_arg else kwargs["update_stream"]
            FullOrdering.before_update(stream)
            return original(*args, **kwargs)

        return ordered_update

    return make


ONCE_PER_STEP_ID = "piecewise-drain-once-per-step"
NO_DRAIN_ID = "piecewise-replay-without-host-drain"
_TARGET = "vllm_ascend.compilation.acl_graph:ACLGraphWrapper.__call__"
_REMOVE_WHEN = (
    "vllm-ascend >= 0.20.2rc1 drains only before FULL replays (#9025; served by adapter ascend-0.19-0.25 or native); "
    "this adapter covers its release only, so the patch goes with it"
)
_PIECEWISE_WHY = (
    "ACLGraphWrapper.__call__ drains the device from the host before every replay (vllm-ascend #4233, against a hang of "
    "FULL graphs, whose task-group updates run on a side stream). In PIECEWISE mode, the default graph mode, that is "
    "before every piece of every step, the drafter's included, with no task group to order: the host waits for the "
    "device dozens of times per step (about 250 us each on the 0.13 line, #5761; #8877, #8854)."
)
_PIECEWISE_HOW = (
    "Wrapper (zb_patch.versions.fixes.graph_replay), only for a PIECEWISE wrapper under async scheduling with speculative "
    "decoding while the forward context's runtime mode is PIECEWISE: the release's __call__ runs with its module's "
    "`torch` rebound to a stand-in whose drains are counted and run or skipped as below; the name is restored after "
    "the call. Capture, replay and dispatch are the release's; FULL replays too, unless full-replay-ordered-on-device "
    "is enabled."
)


def piecewise_drain_once_per_step(fingerprints: dict[str, str]) -> Patch:
    """The default PIECEWISE patch of :mod:`.graph_replay` for vllm-ascend 0.13.0 / 0.18.0: upstream's current form,
    one drain per target forward."""
    return Patch(
        id=ONCE_PER_STEP_ID,
        group=ONCE_PER_STEP_ID,
        target=_TARGET,
        make=make_call(OncePerForwardTorch),
        fingerprints=fingerprints,
        roles=("worker",),
        rests_on=RestsOn(
            UPSTREAM,
            "vllm-ascend v0.23.0 on NPUs: no drain before a piece replay (#9025, from v0.20.2rc1) and one "
            "current_stream().synchronize() per target forward before its first piece, none for the EAGLE / MTP "
            "drafter (#14081); every drain kept here is the release's own call at its own place",
        ),
        why=_PIECEWISE_WHY + " Upstream removed the per-piece drain (#9025) and, on an accuracy report under async "
        "scheduling in PIECEWISE mode, put one per step back before the target's forward (#14081).",
        how=_PIECEWISE_HOW + " OncePerForwardTorch: the first drain within a target forward context runs (right before "
        "the forward's first piece replay); the later ones in that forward and all in a drafter forward "
        "(forward_context.is_draft_model) do nothing. The kept drain is where #14081's is in device order: after "
        "everything the step queued before its forward, before any of the forward's work (the compiled forward starts "
        "with its first piece); between pieces the host queues only that forward's eager attention and the next "
        "replay, in order on one stream. A target forward that replays no graph (a batch above every captured size) "
        "is not drained, as released (v0.23.0 drains it).",
        upstream=("vllm-ascend#9025", "vllm-ascend#14081", "vllm-ascend#4233", "vllm-ascend#8877", "vllm-ascend#5761"),
        remove_when=_REMOVE_WHEN,
    )


def piecewise_replay_without_host_drain(fingerprints: dict[str, str]) -> Patch:
    """The opt-in PIECEWISE patch of :mod:`.graph_replay` for vllm-ascend 0.13.0 / 0.18.0: no drain at all."""
    return Patch(
        id=NO_DRAIN_ID,
        group=NO_DRAIN_ID,
        target=_TARGET,
        supersedes=(ONCE_PER_STEP_ID,),
        make=make_call(NoDrainTorch),
        fingerprints=fingerprints,
        roles=("worker",),
        rests_on=RestsOn(
            NPU_CONTRACT,
            "that torch_npu / CANN need no host drain before a PIECEWISE step once the host's reuse of staging "
            "buffers is ordered by the per-step event waits of async + spec decode; upstream reverted this three "
            "times on these lines on accuracy reports (#5761 / #5965, #5809 / #5966, #8354 / #8469) and, after "
            "#9025, put one drain per step back (#14081) without naming the mechanism; neither stand-in models "
            "torch_npu's task queue",
        ),
        why=_PIECEWISE_WHY + " This patch also removes the one drain per step piecewise-drain-once-per-step keeps.",
        how=_PIECEWISE_HOW + " NoDrainTorch, in place of piecewise-drain-once-per-step (same target): no drain runs; a "
        "PIECEWISE step then orders host and device as eager mode does (docs/graph-modes.md).",
        upstream=(
            "vllm-ascend#9025",
            "vllm-ascend#14081",
            "vllm-ascend#5965",
            "vllm-ascend#5966",
            "vllm-ascend#8469",
            "vllm-ascend#8554",
        ),
        remove_when=_REMOVE_WHEN,
    )


def full_replay_ordered_on_device(
    suffix: str, target: str, fingerprints: dict[str, str], *, aliases: tuple[str, ...], stream_arg: int
) -> Patch:
    """One task-group update entry point of vllm-ascend 0.13.0 / 0.18.0 (``target``, bound by name in ``aliases``),
    ordered behind :class:`FullOrdering`'s boundary; the patches of one release share the group
    ``full-replay-ordered-on-device``. Opt-in."""
    return Patch(
        id=FULL_ORDERING_ID + suffix,
        group=FULL_ORDERING_ID,
        requires=(ONCE_PER_STEP_ID,),
        target=target,
        aliases=aliases,
        make=make_ordered_update(stream_arg),
        fingerprints=fingerprints,
        roles=("worker",),
        rests_on=RestsOn(
            NPU_CONTRACT,
            "that CANN runs a graph task update issued on an update stream only after that stream's wait on an event "
            "recorded on the replay's stream, also through torch_npu's task queue; both stand-ins implement that "
            "premise by construction, so their tests cannot refute it; upstream's twin, vllm-ascend #11915 "
            "(VLLM_ASCEND_FINE_GRAIN_REPLAY_SYNC), is open and opt-in",
        ),
        why="Before every FULL replay (the target's, and the MTP drafter's) ACLGraphWrapper.__call__ drains the device "
        "from the host (vllm-ascend #4233, #6432; through 0.30.0rc2): in FULL_DECODE_ONLY, the graph mode of the MTP "
        "tutorials, zero-bubble's overlap ends at every step. The drain orders each replay before the next replay's "
        "task-group updates: without it, stale attention parameters and #4233's hang, both reproduced on the "
        "release's code (docs/graph-modes.md).",
        how="Wrappers (zb_patch.versions.fixes.graph_replay.FullOrdering), under async scheduling with speculative decoding. "
        "Where the release drains before a FULL replay, the PIECEWISE patch's wrapper of ACLGraphWrapper.__call__ "
        "records an event on the replay's stream instead (the boundary: complete once everything queued before the "
        "replay has run); this entry point makes its update stream wait for the latest boundary before the release's "
        "update, so every update and its external-event record run after the replays queued before the one it "
        "serves, with no host wait. A replay after a replay no update came after (the MTP drafter's k replays per "
        "update) is drained as released. 0.13.0's drain is device-wide; the other streams' work it also ordered is "
        "ordered by the per-step event waits (docs/graph-modes.md).",
        upstream=("vllm-ascend#4233", "vllm-ascend#6432", "vllm-ascend#11915"),
        remove_when="upstream orders the FULL replay and its task-group updates on the device (every release up to "
        "0.30.0rc2 drains from the host; #11915 is open); this adapter covers its release only, so the patch goes "
        "with it",
    )
