"""CPU meanings for the few ``torch.npu`` runtime objects that vllm-ascend builds on the paths the
tests drive (runner construction, per-step bookkeeping).

These are deliberately **no-op** objects: on CPU every operation is already synchronous, so a
stream has nothing to order and an event is complete as soon as it is recorded. They exist so
that code which *creates* streams/events and calls ``record()`` / ``synchronize()`` / ``wait()``
runs unchanged. They do not emulate asynchrony: a test that needs to observe overlap or a missing
synchronisation cannot rely on them (that needs the real device, see benchmarks/).

Anything that would need device memory or a device clock (``mem_get_info``, ``elapsed_time`` ...)
is declared in surface.py as ``unavailable`` and raises ``RuntimeError`` when called.

CUDA standing in for the NPU (``NPU_STANDIN_DEVICE=cuda``, the GPU machine: docs/environments.md): the names of
``CUDA_EQUIVALENTS`` resolve to torch.cuda's own streams, events and synchronisation instead, so the code runs
with real asynchrony. ``is_available()`` stays False either way (transformers would take NPU paths).
"""

from __future__ import annotations

import contextlib
import enum as _enum
import os
from typing import Any

DEVICE_ENV = "NPU_STANDIN_DEVICE"
DEVICES = ("cpu", "cuda")
# stand-in name -> torch.cuda attribute that does the same on a CUDA device
CUDA_EQUIVALENTS = {
    "Stream": "Stream",
    "Event": "Event",
    "ExternalEvent": "Event",
    "current_stream": "current_stream",
    "default_stream": "default_stream",
    "stream": "stream",
    "synchronize": "synchronize",
    "is_current_stream_capturing": "is_current_stream_capturing",
}
_cuda_objects: dict[str, Any] = {}


def device() -> str:
    """The device the NPU stands on: ``NPU_STANDIN_DEVICE`` (unset or empty: "cpu")."""
    value = os.environ.get(DEVICE_ENV, "") or "cpu"
    if value not in DEVICES:
        raise ValueError(f"NPU stand-in: {DEVICE_ENV}={value!r}; valid: {', '.join(DEVICES)} (unset = cpu)")
    return value


def resolve(name: str) -> Any:
    """The object a ``ref("runtime:<name>")`` entry of surface.py stands for on the current device."""
    if device() == "cuda" and name in CUDA_EQUIVALENTS:
        if not _cuda_objects:
            # Taken once, when the torch_npu stand-in is first built (before vllm-ascend imports): vllm-ascend's
            # NPUModelRunner later rebinds torch.cuda.Event / current_stream / ... to the torch.npu names.
            import torch

            _cuda_objects.update({k: getattr(torch.cuda, v) for k, v in CUDA_EQUIVALENTS.items()})
        return _cuda_objects[name]
    return globals()[name]


class Stream:
    """No-op NPU stream (CPU work is synchronous: there is nothing to order)."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = device
        self.priority = priority

    def wait_stream(self, stream: Stream) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __repr__(self) -> str:
        return "<NPU stand-in Stream (CPU no-op)>"


class Event:
    """No-op NPU event: complete as soon as recorded."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **kwargs: Any
    ) -> None:
        self.enable_timing = enable_timing
        self.recorded = False

    def record(self, stream: Stream | None = None) -> None:
        self.recorded = True

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Event) -> float:
        raise RuntimeError("NPU stand-in: Event.elapsed_time needs a device clock; not available on CPU")

    def __repr__(self) -> str:
        return "<NPU stand-in Event (CPU no-op)>"


class ExternalEvent(Event):
    """torch_npu's graph-capturable event; same no-op behaviour."""

    def reset(self, stream: Stream | None = None) -> None:
        self.recorded = False


_DEFAULT_STREAM = Stream()


def current_stream(device: Any = None) -> Stream:
    return _DEFAULT_STREAM


def default_stream(device: Any = None) -> Stream:
    return _DEFAULT_STREAM


def stream(s: Stream | None = None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext(s)


def synchronize(device: Any = None) -> None:
    pass


def is_available() -> bool:
    return False


def is_current_stream_capturing() -> bool:
    """torch.npu.is_current_stream_capturing: whether an ACL graph is being captured on the current stream. The
    stand-in never captures graphs (streams are CPU no-ops), so always False."""
    return False


def device_count() -> int:
    return 0


# --- torchvision -----------------------------------------------------------------------------
# PyPI's torchvision wheels are built against CUDA torch and fail to load beside the CPU torch
# (`operator torchvision::nms does not exist`). transformers imports a few of its names at import
# time. InterpolationMode is a plain enum upstream; this is the same enum.


class ImageReadMode(_enum.Enum):
    """torchvision.io.ImageReadMode: a plain enum upstream too (transformers 5.14 imports it at import time)."""

    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


class InterpolationMode(_enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"
