"""The ACL-graph replay fix ``piecewise-replay-without-host-drain`` (adapters ascend-0.13 / ascend-0.18; its spec,
:func:`piecewise_replay_without_host_drain`, says why and how): vllm-ascend 0.13.0 / 0.18.0 drain the device from the
host before every graph replay (``ACLGraphWrapper.__call__``: ``torch.npu.synchronize()`` at 0.13.0,
``torch.npu.current_stream().synchronize()`` at 0.18.0), in PIECEWISE mode before every piece of every step. The fix
gives a PIECEWISE wrapper's call a ``torch`` in which those two drains do nothing; everything else the release's
``__call__`` does is unchanged, FULL replays keep their drain.

The FULL drain (vllm-ascend #4233) is kept: it orders the host's task-group parameter updates of step N+1 after the
device finished step N's replay (docs/graph-modes.md, "The FULL drain").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..registry import Patch

PIECEWISE = "PIECEWISE"


class Drains:
    """Host drains the fix skipped in this process (diagnostics: tests, reports)."""

    skipped = 0


class NoDrainStream:
    """A stream whose ``synchronize()`` does nothing (counted in :class:`Drains`); every other name is the stream's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def synchronize(self) -> None:
        Drains.skipped += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class NoDrainNpu:
    """``torch.npu`` without its two host drains: ``synchronize()`` does nothing and ``current_stream()`` hands out a
    :class:`NoDrainStream`; every other name is ``torch.npu``'s."""

    def __init__(self, npu: Any) -> None:
        self._npu = npu

    def synchronize(self, device: Any = None) -> None:
        Drains.skipped += 1

    def current_stream(self, *args: Any, **kwargs: Any) -> NoDrainStream:
        return NoDrainStream(self._npu.current_stream(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._npu, name)


class NoDrainTorch:
    """``torch`` as the release's ``ACLGraphWrapper.__call__`` sees it while the fix runs it: ``torch.npu`` is a
    :class:`NoDrainNpu`; every other name is ``torch``'s."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        self.npu = NoDrainNpu(torch.npu)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def wants_no_drain(vllm_config: Any) -> bool:
    """Async scheduling with speculative decoding: the configuration zb-patch serves, where the host waits on an event
    recorded behind the previous step's input copies before it rewrites their host buffers (docs/graph-modes.md)."""
    return bool(
        getattr(vllm_config.scheduler_config, "async_scheduling", False)
        and getattr(vllm_config, "speculative_config", None) is not None
    )


def make_call(original: Callable) -> Callable:
    """The wrapper of ``ACLGraphWrapper.__call__``: a PIECEWISE wrapper that is about to capture or replay (the forward
    context's runtime mode is PIECEWISE) runs the release's ``__call__`` with the module's ``torch`` rebound to a
    :class:`NoDrainTorch`, then the name is restored; every other call is the release's, unchanged."""
    namespace = original.__globals__  # vllm_ascend.compilation.acl_graph's module namespace
    stand_ins: dict[int, NoDrainTorch] = {}  # one per torch module seen (built once, not per piece and step)

    def __call__(wrapper, *args, **kwargs):
        if getattr(wrapper.runtime_mode, "name", None) != PIECEWISE or not wants_no_drain(wrapper.vllm_config):
            return original(wrapper, *args, **kwargs)
        from vllm.forward_context import get_forward_context

        mode = getattr(get_forward_context().cudagraph_runtime_mode, "name", None)
        torch = namespace["torch"]
        if mode != PIECEWISE or isinstance(torch, NoDrainTorch):
            return original(wrapper, *args, **kwargs)
        stand_in = stand_ins.get(id(torch))
        if stand_in is None:
            stand_in = stand_ins[id(torch)] = NoDrainTorch(torch)
        namespace["torch"] = stand_in
        try:
            return original(wrapper, *args, **kwargs)
        finally:
            namespace["torch"] = torch

    return __call__


def piecewise_replay_without_host_drain(fingerprints: dict[str, str]) -> Patch:
    """The fix of :mod:`.graph_replay` for vllm-ascend 0.13.0 / 0.18.0, whose ``ACLGraphWrapper.__call__`` drains the
    device before every replay."""
    return Patch(
        id="piecewise-replay-without-host-drain",
        group="piecewise-replay-without-host-drain",
        target="vllm_ascend.compilation.acl_graph:ACLGraphWrapper.__call__",
        make=make_call,
        fingerprints=fingerprints,
        roles=("worker",),
        why="ACLGraphWrapper.__call__ drains the device from the host before every replay (0.13.0: "
        "torch.npu.synchronize(); 0.18.0: torch.npu.current_stream().synchronize(); added by vllm-ascend #4233 "
        "against a hang of FULL graphs, whose task-group parameter updates run on a side stream). In PIECEWISE mode, "
        "vllm-ascend's default graph mode, that drain runs before every piece of every step and no task group is "
        "updated: the host can never run ahead of the device, so zero-bubble's overlap of host preparation with the "
        "device is lost at every piece boundary (vllm-ascend #8877, #8854).",
        how="Wrapper. Only for a PIECEWISE wrapper whose configuration runs async scheduling with speculative "
        "decoding, and only while the forward context's runtime mode is PIECEWISE (the wrapper captures or replays): "
        "the release's __call__ runs with its module's `torch` rebound to a stand-in whose torch.npu.synchronize() "
        "and current_stream().synchronize() do nothing (counted), then the name is restored; the release's capture, "
        "replay and dispatch are unchanged. FULL replays keep their drain. Without the drain a PIECEWISE step orders "
        "host and device as eager mode does (attention runs eagerly between the pieces); the host's reuse of staging "
        "buffers is ordered by the per-step event waits of async + spec decode (docs/graph-modes.md). vllm-ascend "
        "#9025 makes the same change (drain only in FULL mode) from 0.20.2rc1 on; earlier attempts on the 0.13 / 0.18 "
        "lines (#5761 / #5809, #8354) were reverted (#5965 / #5966, #8469) on accuracy reports upstream never "
        "explained, which is why this fix is limited to the configuration whose host-buffer ordering zb-patch "
        "verifies.",
        upstream=(
            "vllm-ascend#9025",
            "vllm-ascend#4233",
            "vllm-ascend#6432",
            "vllm-ascend#8877",
            "vllm-ascend#8854",
            "vllm-ascend#5761",
            "vllm-ascend#5809",
            "vllm-ascend#5965",
            "vllm-ascend#5966",
            "vllm-ascend#8354",
            "vllm-ascend#8469",
        ),
        remove_when="vllm-ascend >= 0.20.2rc1 drains only before FULL replays (#9025; served by adapter "
        "ascend-0.19-0.25 or native); this adapter covers its release only, so the patch goes with it",
    )
