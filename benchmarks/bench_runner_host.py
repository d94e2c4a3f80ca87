"""Host CPU time per engine step of the runner-parity harness (tests/parity): the release's real ``AsyncScheduler``
driving its real ``NPUModelRunner`` on CPU tensors, patched (zero-bubble) and unpatched, one fixed workload.

Run inside a va013 / va018 env (``tox exec -e va018 -- python benchmarks/bench_runner_host.py``). Prints one JSON line
per run: process CPU time per step (ms) of the whole step (scheduler + runner + zb-patch's wrappers), and of
zb-patch's own per-step code (the ``correct`` and ``apply_deferred`` hooks of the release's ``ZeroBubble``).
To compare two trees in one session, pass the other one with ``--tree`` (``zb_patch`` is printed).

``--count-ops``: also the aten operations per step the host dispatches (each a launch, a copy or a view on a device),
counted with a ``TorchDispatchMode``: ``aten_ops_per_step`` outside zb-patch's two kernels, ``copies_per_step``
(``aten.copy_``), and ``kernel_twin_ops_per_step``, the ops of the kernels' pure-torch twins that run on CPU tensors
(one Triton launch each on a device). CPU time is not comparable with it on (the mode costs per op)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests", "parity"))
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests", "support"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--tree", help="import zb_patch from this checkout (another commit's tree) instead")
    ap.add_argument("--profile", action="store_true", help="cProfile the last patched run (top 25 by own time)")
    ap.add_argument("--count-ops", action="store_true", help="count the aten ops per step (module docstring)")
    args = ap.parse_args()
    # CPU tensors take the kernels' pure-torch twins: the figure is host code, not Triton's interpreter
    os.environ["TRITON_INTERPRET"] = "0"
    if args.tree:
        sys.path.insert(0, os.path.abspath(args.tree))

    import npu_standin
    from cpu_worker import setup_cpu_worker

    setup_cpu_worker()
    import runner_harness as H

    import zb_patch
    from zb_patch.check.selftest.compat import EngineShape

    family = npu_standin.detect_family()
    release = importlib.import_module({"0.13": "runner013", "0.18": "runner018"}[family])
    zb = release.ZERO_BUBBLE
    spent = {"s": 0.0}

    def timed(fn):
        def wrapper(*a, **kw):
            c0 = time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                spent["s"] += time.process_time() - c0

        return wrapper

    zb.correct = timed(zb.correct)
    zb.apply_deferred = timed(zb.apply_deferred)
    ops = _OpCounter() if args.count_ops else None
    shape = EngineShape(num_spec_tokens=args.k)
    with H.session() as sess:
        for rep in range(args.repeats):
            for patched in (False, True):
                spent["s"] = 0.0
                prof = None
                if args.profile and patched and rep == args.repeats - 1:
                    import cProfile

                    prof = cProfile.Profile()
                    prof.enable()
                c0 = time.process_time()
                with ops.counting() if ops else contextlib.nullcontext():
                    res = H.run_mode(
                        sess,
                        shape,
                        H.make_workload(args.seed, shape, args.iterations),
                        args.iterations,
                        release=release,
                        seed=args.seed,
                        patched=patched,
                    )
                cpu = time.process_time() - c0
                if prof is not None:
                    import pstats

                    prof.disable()
                    pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
                print(
                    json.dumps(
                        {
                            "zb_patch": os.path.dirname(zb_patch.__file__),
                            "family": family,
                            "repeat": rep,
                            "mode": res.mode,
                            "steps": res.steps,
                            "ms_per_step": round(1e3 * cpu / res.steps, 4),
                            "zb_hooks_ms_per_step": round(1e3 * spent["s"] / res.steps, 4),
                            **(ops.per_step(res.steps) if ops else {}),
                        }
                    ),
                    flush=True,
                )


class _OpCounter:
    """aten ops dispatched while counting, split into zb-patch's kernel twins (token counts, slot mapping: the torch
    reference that stands in for one Triton launch each) and everything else."""

    def __init__(self) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        from zb_patch.kernels import reference

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if counter.in_twin:
                    counter.twin += 1
                else:
                    counter.ops += 1
                    counter.copies += func.overloadpacket is torch.ops.aten.copy_
                return func(*args, **(kwargs or {}))

        self.mode_class = Mode
        self.in_twin = 0
        for name in ("token_counts_reference", "slot_mapping_reference"):
            for module in _modules_naming(getattr(reference, name)):
                setattr(module, name, self._twin(getattr(module, name)))

    def _twin(self, fn):
        def counted(*args, **kwargs):
            self.in_twin += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.in_twin -= 1

        return counted

    @contextlib.contextmanager
    def counting(self):
        self.ops = self.copies = self.twin = 0
        with self.mode_class():
            yield

    def per_step(self, steps: int) -> dict:
        return {
            "aten_ops_per_step": round(self.ops / steps, 1),
            "copies_per_step": round(self.copies / steps, 2),
            "kernel_twin_ops_per_step": round(self.twin / steps, 1),
        }


def _modules_naming(fn) -> list:
    """The zb_patch.kernels modules that hold ``fn`` under its name (the package imports it from reference)."""
    modules = [m for name, m in sys.modules.items() if name.startswith("zb_patch.kernels")]
    return [m for m in modules if getattr(m, fn.__name__, None) is fn]


if __name__ == "__main__":
    main()
