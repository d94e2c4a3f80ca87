"""The engine-core fix ``keep-async-steps-overlapped`` (adapters ascend-0.13 / ascend-0.18; its spec,
:func:`keep_async_steps_overlapped`, says why and how): the engine core's batch queue hands out step futures that
report done only once waited on, so vLLM 0.13 / 0.18's ``step_with_batch_queue`` never processes a step's output
before it has scheduled the next one (``not batch_queue[-1][0].done()`` is then always true for a step not yet
waited on)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from ..registry import Patch


class WaitedFuture:
    """A step's output future that reports done only after :meth:`result` has returned it once."""

    __slots__ = ("_future", "_waited")

    def __init__(self, future: Any) -> None:
        self._future = future
        self._waited = False

    def done(self) -> bool:
        return self._waited

    def result(self, timeout: float | None = None) -> Any:
        value = self._future.result() if timeout is None else self._future.result(timeout)
        self._waited = True
        return value

    def __getattr__(self, name: str) -> Any:
        return getattr(self._future, name)


class OverlappedQueue(deque):
    """The engine core's batch queue; each appended step's output future is wrapped in :class:`WaitedFuture`."""

    def appendleft(self, item: Any) -> None:
        future, *rest = item
        super().appendleft((WaitedFuture(future), *rest))


def wants_overlap(core: Any) -> bool:
    """Async scheduling with speculative decoding: the runner corrects counts it assumes optimistic."""
    config = core.vllm_config
    return bool(config.scheduler_config.async_scheduling and config.speculative_config is not None)


def make_step_with_batch_queue(original: Callable) -> Callable:
    def step_with_batch_queue(core):
        queue = core.batch_queue
        if queue is not None and not isinstance(queue, OverlappedQueue) and wants_overlap(core):
            core.batch_queue = OverlappedQueue(queue, maxlen=queue.maxlen)
        return original(core)

    return step_with_batch_queue


def keep_async_steps_overlapped(fingerprints: dict[str, str]) -> Patch:
    """The engine-core fix of :mod:`.engine_overlap` for a vLLM release whose ``step_with_batch_queue`` asks
    ``done()`` (vLLM 0.13 / 0.18)."""
    return Patch(
        id="keep-async-steps-overlapped",
        group="keep-async-steps-overlapped",
        target="vllm.v1.engine.core:EngineCore.step_with_batch_queue",
        make=make_step_with_batch_queue,
        fingerprints=fingerprints,
        roles=("engine",),
        why="With async scheduling + speculative decoding, the engine core processes a step's output before "
        "scheduling the next whenever the step's output future is already done when it checks (a race with the "
        "executor's async-output thread; won on host-bound steps). The scheduler then sends exact token counts, "
        "and the runner -- vLLM's classic async path and zero-bubble alike -- subtracts the previous step's "
        "rejected drafts from them a second time: positions, seq_lens and slots fall short and the step reads "
        "and writes the wrong KV entries (wrong tokens; reproduced by forcing the early path, docs/e2e.md).",
        how="Wrapper. Before the release's loop body runs, the engine core's batch queue becomes an "
        "OverlappedQueue (once, only with async scheduling + speculative decoding): each queued step's future "
        "reports done only after the engine core has waited on it, so every step is scheduled before its "
        "predecessor's output is processed -- what vLLM 0.19+ does. Empty batches and the end of the requests "
        "still process the oldest output at once. Applies whether or not zero-bubble is active: the classic "
        "path has the defect too.",
        upstream=("vllm 0.19+ step_with_batch_queue (no done() check; uni-process AsyncOutputFuture)",),
        remove_when="the installed vLLM's step_with_batch_queue no longer processes an output early because its "
        "future is done (vLLM 0.19+; this adapter's vLLM 0.13 / 0.18 never will)",
    )
