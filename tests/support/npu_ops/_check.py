"""Argument checks shared by the emulated ops: anything outside the implemented modes fails loudly."""

from __future__ import annotations


def unsupported(op: str, what: str) -> NotImplementedError:
    return NotImplementedError(f"emulated {op}: {what} is not implemented (tests/support/npu_ops)")


HALF = ("float16", "bfloat16")  # what the NPU attention / KV-cache / RoPE ops take (int8 only in quantised modes)
HALF_OR_FLOAT = (*HALF, "float32")  # the norm and activation ops take float32 as well


def dtypes(op: str, allowed: tuple[str, ...], **tensors) -> None:
    """Refuse tensors of a dtype the real op refuses (``allowed`` names torch dtypes) and tensors whose dtypes differ
    from each other's (the ops named here take one dtype for all of them)."""
    names = {name: str(t.dtype).removeprefix("torch.") for name, t in tensors.items()}
    for name, dtype in names.items():
        if dtype not in allowed:
            raise unsupported(op, f"{name} dtype {dtype} (the NPU op takes {' / '.join(allowed)})")
    if len(set(names.values())) > 1:
        raise unsupported(op, f"mixed dtypes {names} (the NPU op takes one dtype for all of them)")


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
