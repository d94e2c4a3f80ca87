"""Launch plumbing shared by the zb-patch Triton kernels (host side only).

Why this exists: a slot-mapping launch does a few microseconds of GPU work, but a plain
``kernel[grid](...)`` call spends 20-28 us of *host* time in Triton's ``JITFunction.run`` (argument
binding, specialisation key, cache lookup, hooks) before the driver launch.  With zero-bubble
scheduling the host prepares step N+1 while the device runs step N, so host time per launch is what
the step pays.  :class:`FastLauncher` therefore

1. launches through the normal ``kernel[grid](...)`` path the first time a (constexprs, pointer
   alignment) combination is seen, which compiles and caches the kernel and returns its
   ``CompiledKernel``;
2. afterwards calls that ``CompiledKernel``'s driver launcher directly with the current stream —
   the same call ``JITFunction.run`` ends with — skipping the binder and key computation.

The direct path is used only where it is known to be sound: CUDA/HIP drivers of Triton >= 3.3
(whose launcher takes every argument, constexprs included, in signature order), not under
``TRITON_INTERPRET=1``, and not while a launch hook (profiler) is installed.  Every runtime integer
argument of our kernels is listed in ``do_not_specialize`` and kept below 2**31, so one compiled
kernel serves every value; pointer arguments are keyed by element type and 16-byte alignment,
which Triton does specialise on.  Anything else (triton-ascend, older Triton, the interpreter) always takes the
normal path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

_INTERPRET_ENV = "TRITON_INTERPRET"


_interpret: bool | None = None


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    Read once per process, like Triton itself (``@triton.jit`` picks the interpreter when the
    kernel module is imported).
    """
    global _interpret
    if _interpret is None:
        _interpret = os.environ.get(_INTERPRET_ENV, "0") not in ("", "0")
    return _interpret


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _triton_version() -> tuple[int, int]:
    import triton

    parts = triton.__version__.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):  # pragma: no cover - exotic version strings
        return (0, 0)


def _direct_launch_supported(device_type: str) -> bool:
    if interpret_mode() or device_type not in ("cuda",):
        return False
    if os.environ.get("ZB_PATCH_KERNELS_NO_DIRECT_LAUNCH", "0") not in ("", "0"):
        return False
    if _triton_version() < (3, 3):
        return False
    try:
        from triton import knobs  # noqa: F401  (Triton >= 3.4 keeps hooks here)
    except ImportError:
        return False
    return True


def multiprocessor_count(device_type: str, device_index: int | None) -> int:
    """How many programs run at once on the device: SMs on CUDA, vector cores on Ascend."""
    if device_type == "cuda":
        import torch

        idx = torch.cuda.current_device() if device_index is None else device_index
        return int(torch.cuda.get_device_properties(idx).multi_processor_count)
    try:
        from triton.runtime import driver

        props = driver.active.utils.get_device_properties(device_index or 0)
        for key in ("num_vectorcore", "num_aicore", "multiprocessor_count"):
            if key in props and int(props[key]) > 0:
                return int(props[key])
    except Exception:  # noqa: BLE001 - best effort, fall back to a safe small number
        pass
    return 40  # Atlas A2 (910B) has 40-48 vector cores


def _hook_set(hook: Any) -> bool:
    """Whether a Triton launch hook is installed (Triton >= 3.6 keeps an always-present, usually
    empty ``HookChain``; 3.4/3.5 keep ``None`` or a callable)."""
    return hook is not None and bool(getattr(hook, "calls", True))


class FastLauncher:
    """Launch one ``@triton.jit`` kernel with fixed constexprs, as cheaply as Triton allows.

    Runtime arguments are passed in signature order; the constexprs (given once, here) must come
    after them in the kernel signature.  Two ways to launch:

    * :meth:`launch` — generic: keys the compiled kernel by each tensor's dtype and alignment, then
      launches it directly with integer pointers (CUDA) or through ``kernel[grid](...)``;
    * :meth:`launch_slow` + :meth:`direct_launcher` — for callers that bind fixed buffers once and
      know their pointers (the prepared launchers), so that a step costs one Python call into
      Triton's C launcher plus a couple of ``data_ptr()`` calls.
    """

    __slots__ = (
        "_kernel",
        "_constexprs",
        "_constexpr_values",
        "_options",
        "_direct",
        "_tensor_slots",
        "direct_supported",
        "direct_launches",
        "slow_launches",
    )

    def __init__(
        self,
        kernel: Any,
        constexprs: dict[str, Any],
        *,
        device_type: str,
        tensor_slots: Sequence[int],
        num_warps: int | None = None,
        direct: bool | None = None,
    ) -> None:
        self._kernel = kernel
        # the launcher wants signature order
        self._constexprs = {name: constexprs[name] for name in kernel.arg_names if name in constexprs}
        if len(self._constexprs) != len(constexprs):
            raise ValueError(f"unknown constexprs {sorted(set(constexprs) - set(self._constexprs))}")
        self._constexpr_values = tuple(self._constexprs.values())
        self._options: dict[str, Any] = {}
        if num_warps is not None and device_type == "cuda":
            self._options["num_warps"] = num_warps
        self._direct: dict[tuple, Callable[..., bool] | None] = {}
        self._tensor_slots = tuple(tensor_slots)
        self.direct_supported = _direct_launch_supported(device_type) and direct is not False
        self.direct_launches = 0
        self.slow_launches = 0

    def launch_slow(self, grid0: int, args: tuple) -> Any:
        """Triton's normal path (compiles on first use); returns the ``CompiledKernel`` where Triton does."""
        self.slow_launches += 1
        return self._kernel[(grid0,)](*args, **self._constexprs, **self._options)

    def direct_launcher(self, compiled: Any, device_index: int | None = None) -> Callable[..., bool] | None:
        """``f(grid0, *runtime_args) -> bool`` calling ``compiled``'s driver launcher directly.

        Pointer arguments may be plain ints (``data_ptr()``), which also spares the launcher its
        per-pointer attribute lookup and ``cuPointerGetAttribute`` check.  The caller must only pass
        arguments matching the specialisation ``compiled`` was built for (dtypes, 16-byte
        alignment).  Returns False without launching while a launch hook is installed (profilers
        rely on them), and disables itself if the launcher's calling convention is not the one
        expected (TypeError while parsing arguments, before anything is launched).
        """
        if not self.direct_supported or compiled is None or not hasattr(compiled, "packed_metadata"):
            return None
        from triton import knobs
        from triton.runtime import driver

        run = compiled.run  # loads the module / function handles now
        function = compiled.function
        metadata = compiled.packed_metadata
        constexpr_values = self._constexpr_values
        get_stream = driver.active.get_current_stream
        get_device = driver.active.get_current_device
        runtime = knobs.runtime
        launcher = self

        def call(grid0: int, *args: Any) -> bool:
            if _hook_set(runtime.launch_enter_hook) or _hook_set(runtime.launch_exit_hook):
                return False
            try:
                run(
                    grid0,
                    1,
                    1,
                    get_stream(get_device() if device_index is None else device_index),
                    function,
                    metadata,
                    None,
                    None,
                    None,
                    *args,
                    *constexpr_values,
                )
            except TypeError:
                launcher.direct_supported = False
                return False
            launcher.direct_launches += 1
            return True

        return call

    def launch(self, grid0: int, args: tuple) -> None:
        if not self.direct_supported:
            self.launch_slow(grid0, args)
            return
        # Triton specialises on each pointer's element type and 16-byte alignment: key on both.
        call_args = list(args)
        key = []
        for slot in self._tensor_slots:
            tensor = args[slot]
            ptr = tensor.data_ptr()
            call_args[slot] = ptr
            key.append(tensor.dtype)
            key.append(ptr & 15 == 0)
        key_t = tuple(key)
        call = self._direct.get(key_t)
        if call is not None and call(grid0, *call_args):
            return
        compiled = self.launch_slow(grid0, args)
        if key_t not in self._direct:
            self._direct[key_t] = self.direct_launcher(compiled)
