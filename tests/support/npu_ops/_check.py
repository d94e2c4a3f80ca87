"""Argument checks shared by the emulated ops: anything outside the implemented modes fails loudly."""

from __future__ import annotations


def unsupported(op: str, what: str) -> NotImplementedError:
    return NotImplementedError(f"emulated {op}: {what} is not implemented (tests/support/npu_ops)")


def only_defaults(op: str, kwargs: dict, allowed_defaults: dict) -> None:
    """Reject every keyword the emulation does not implement unless it carries the op's default value."""
    for name, val in kwargs.items():
        if name not in allowed_defaults:
            if val is None:
                continue
            raise unsupported(op, f"argument {name}={_short(val)}")
        if val != allowed_defaults[name]:
            raise unsupported(op, f"argument {name}={_short(val)} (only {allowed_defaults[name]!r})")


def _short(val) -> str:
    shape = getattr(val, "shape", None)
    return f"<tensor {tuple(shape)}>" if shape is not None else repr(val)
