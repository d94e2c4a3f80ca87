"""A simulated accelerator: one in-order stream that runs as *late* as the host allows.

Device tensors are ordinary CPU torch tensors that only enqueued operations touch.  An operation
(kernel launch, host-to-device or device-to-host copy) runs when the host blocks on an event
recorded after it — never earlier.  That is the adversarial schedule for the two classic async bugs:

* a host buffer changed in place after a non-blocking copy *from* it was enqueued: the copy reads the
  buffer when it runs, so it sees the later value (the race behind vLLM #25279 / #24799's review);
* a host read of a device-to-host destination without waiting for its event: the copy has not run,
  the host sees the previous contents.

Host waits are counted by kind and whether they really blocked (work still pending), which is how
the harness measures "blocking accepted-count syncs per step".
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


class Event:
    """An event recorded on the stream after everything enqueued so far."""

    __slots__ = ("_dev", "seq")

    def __init__(self, dev: SimDevice, seq: int) -> None:
        self._dev, self.seq = dev, seq

    def query(self) -> bool:
        return self._dev.completed >= self.seq

    def synchronize(self, kind: str) -> bool:
        """Host waits until the stream reached this event. Returns whether it had to wait."""
        return self._dev.wait(self.seq, kind)


class SimDevice:
    def __init__(self) -> None:
        self._queue: deque[tuple[int, Callable[[], None]]] = deque()
        self.enqueued = 0
        self.completed = 0
        self.waits: Counter[str] = Counter()  # host waits by kind
        self.blocking_waits: Counter[str] = Counter()  # ... of which had pending work to wait for

    # -- enqueue ---------------------------------------------------------------------------------
    def launch(self, fn: Callable[[], None]) -> None:
        self.enqueued += 1
        self._queue.append((self.enqueued, fn))

    def h2d(self, dst: torch.Tensor, src: torch.Tensor | np.ndarray, n: int | None = None) -> None:
        """Non-blocking copy host -> device of ``src[:n]`` into ``dst[:n]``; ``src`` is read when it runs."""
        s = torch.from_numpy(src) if isinstance(src, np.ndarray) else src

        def run() -> None:
            if n is None:
                dst.copy_(s)
            else:
                dst[:n].copy_(s[:n])

        self.launch(run)

    def d2h(self, dst: torch.Tensor | np.ndarray, src: torch.Tensor, n: int | None = None) -> None:
        """Non-blocking copy device -> host; the host may read ``dst`` only after an event behind it."""
        d = torch.from_numpy(dst) if isinstance(dst, np.ndarray) else dst

        def run() -> None:
            if n is None:
                d.copy_(src)
            else:
                d[:n].copy_(src[:n])

        self.launch(run)

    def record(self) -> Event:
        return Event(self, self.enqueued)

    # -- host side -------------------------------------------------------------------------------
    def wait(self, seq: int, kind: str) -> bool:
        self.waits[kind] += 1
        blocked = self.completed < seq
        if blocked:
            self.blocking_waits[kind] += 1
        while self._queue and self._queue[0][0] <= seq:
            s, fn = self._queue.popleft()
            fn()
            self.completed = s
        self.completed = max(self.completed, seq)
        return blocked

    def synchronize(self, kind: str = "device") -> None:
        self.wait(self.enqueued, kind)

    @property
    def pending(self) -> int:
        return len(self._queue)


def fresh_h2d(dev: SimDevice, values: Any, dtype: torch.dtype) -> torch.Tensor:
    """A temporary pinned host tensor copied to a fresh device tensor (vLLM's
    ``torch.tensor(list, pin_memory=True).to(device, non_blocking=True)``).  The host tensor is
    private to this copy, so no later host write can race it."""
    host = torch.tensor(values, dtype=dtype)
    out = torch.empty_like(host)
    dev.h2d(out, host)
    return out
