"""Host cost of zb-patch's activation: ``register()`` with ``ZB_PATCH=1`` in a worker-like process.

vLLM calls ``register()`` in every process it starts (front end, EngineCore, each worker), so its cost is paid
once per process. This script starts ``--runs`` FRESH interpreters (default 5); each one

1. installs the NPU stand-in (this machine has no torch_npu / CANN) and imports what an NPU worker has imported
   before vLLM loads its general plugins: the selected adapter's ``preload`` modules, then the modules of every
   patch / guard target (vllm-ascend's runner, the proposer, vLLM's GPU runner, ...);
2. imports ``zb_patch.plugin`` (what vLLM's entry-point loading does), timed on its own;
3. times ``register()`` with ``ZB_PATCH=1`` (wall time, and the process's CPU time: on a shared, loaded
   machine the wall time mostly measures waiting for a core) -- the activation: settings, version detection, adapter
   selection, verification of every target by fingerprint, and the patching itself.

The activation is split into the zb-patch modules ``register()`` imports first (``zb_patch.registry``, ``.detect``,
``.versions``, imported explicitly so that ``registry.fingerprint_object`` can be wrapped before ``register()`` runs),
the time spent inside ``fingerprint_object`` (wrapped to sum its calls), and the rest of ``register()`` (the adapter
module that selection picks is imported there: only that one). ``activation_ms`` = imports + register.

    .tox/va018/bin/python benchmarks/bench_activation.py            # PYTHONPATH must hold tests/support
    python3 -m tox -e va023 --  ...   (tox.ini runs pytest; use the env's python as above)
    .tox/va018/bin/python benchmarks/bench_activation.py --json out.json --runs 5
    .tox/va018/bin/python benchmarks/bench_activation.py --zb-patch-from /tmp/base   # and another revision
    .tox/va018/bin/python benchmarks/bench_activation.py --zb-patch-from /tmp/base --runs 2 --forks 6   # 12 each

Prints one line per process and, per revision, the medians and the range; ``--json`` also writes every value. With
``--zb-patch-from`` the two revisions' processes alternate (which goes first alternates too), so a changing load on a
shared host weighs on both alike. ``--forks N``: each fresh process imports vLLM once and forks N activations per
revision (alternating), for many samples on a loaded host; a forked child also pays a page copy for every page it
shares with its parent and writes, so its figures sit above a fresh process's (for both revisions alike).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SUPPORT = os.path.join(ROOT, "tests", "support")


def worker_modules() -> list[str]:
    """The modules a worker has imported before register(): the adapter's preload list, then its targets'."""
    from zb_patch.detect import detect
    from zb_patch.versions import select

    selection = select(detect())
    if not selection.candidates:
        raise SystemExit(f"no adapter to activate here: {selection.reason}")
    mods: list[str] = []
    for adapter in selection.candidates:
        for name in (*adapter.preload, *adapter.patch_set.modules()):
            if name not in mods:
                mods.append(name)
    return mods


def use_zb_patch_from(tree: str) -> None:
    """Import zb_patch from ``tree`` (a copy of another revision) instead of the editable install of this one."""
    sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("__editable__")]
    sys.path.insert(0, os.path.abspath(tree))


def import_worker_modules(modules: list[str]) -> float:
    """What a worker has imported before register(): the NPU stand-in, then ``modules``. Returns the seconds taken."""
    import importlib

    import npu_standin

    npu_standin.install()
    t0 = time.perf_counter()
    for name in modules:
        importlib.import_module(name)
    return time.perf_counter() - t0


def child(modules: list[str]) -> dict:
    """One fresh process: import the worker modules, then time the activation."""
    return activation(import_worker_modules(modules))


def forked(modules: list[str], other: str | None, forks: int, cache: str, scratch: str) -> list[dict]:
    """One fresh process imports the worker modules once, then forks ``forks`` children per revision, alternating
    revisions (and which goes first), each of which times one activation and sends its figures back. A forked child
    starts in the state a fresh process has after the worker imports (no zb_patch module, empty linecache), at the
    cost of a page copy for every shared page it writes to (both revisions alike)."""
    worker_import_s = import_worker_modules(modules)
    if any(m == "zb_patch" or m.startswith("zb_patch.") for m in sys.modules):
        raise SystemExit("the worker imports loaded zb_patch: a forked child would not import it afresh")
    trees = ["this"] + (["from"] if other else [])

    def one(tree: str, cache_dir: str) -> dict:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: activate, report, exit without running the parent's clean-up
            os.close(read)
            try:
                if tree == "from" and other:
                    use_zb_patch_from(other)
                os.environ["XDG_CACHE_HOME"] = cache_dir
                run = activation(worker_import_s)
                run["tree"] = tree
                os.write(write, json.dumps(run).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as fh:
            data = fh.read()
        os.waitpid(pid, 0)
        if not data:
            raise SystemExit(f"the forked activation of {tree} reported nothing")
        return json.loads(data)

    if cache == "warm":
        for tree in trees:  # untimed: fills the shared fingerprint cache
            one(tree, os.path.join(scratch, "shared"))
    runs = []
    for i in range(forks):
        for tree in trees if i % 2 == 0 else list(reversed(trees)):
            cache_dir = os.path.join(scratch, "shared" if cache == "warm" else f"fork-{tree}-{i}")
            runs.append(one(tree, cache_dir))
    return runs


def activation(worker_import_s: float) -> dict:
    """Time the zb-patch imports and register() in this process, the worker modules imported."""
    loaded = set(sys.modules)

    t0 = time.perf_counter()
    from zb_patch import plugin

    plugin_import_s = time.perf_counter() - t0

    # what register() imports first, timed apart so fingerprint_object can be wrapped before register() runs (the
    # adapter module selection picks is imported inside register(): a revision that imports every one does it there)
    c0 = time.process_time()
    t0 = time.perf_counter()
    import zb_patch.detect  # noqa: F401
    import zb_patch.versions  # noqa: F401
    from zb_patch import registry

    zb_import_s = time.perf_counter() - t0

    spent = {"fingerprint_s": 0.0, "fingerprints": 0}
    original = registry.fingerprint_object

    def timed_fingerprint(obj):
        start = time.perf_counter()
        try:
            return original(obj)
        finally:
            spent["fingerprint_s"] += time.perf_counter() - start
            spent["fingerprints"] += 1

    registry.fingerprint_object = timed_fingerprint
    os.environ["ZB_PATCH"] = "1"
    t0 = time.perf_counter()
    plugin.register()
    register_s = time.perf_counter() - t0
    cpu_s = time.process_time() - c0
    registry.fingerprint_object = original

    act = plugin.current()
    ms = 1000.0
    return {
        "zb_patch": os.path.dirname(plugin.__file__),
        "state": act.state if act else "off",
        "adapter": act.adapter_id if act else None,
        "reason": act.reason if act else "register() did not activate",
        "worker_import_ms": worker_import_s * ms,
        "plugin_import_ms": plugin_import_s * ms,
        "zb_import_ms": zb_import_s * ms,
        "register_ms": register_s * ms,
        "fingerprint_ms": spent["fingerprint_s"] * ms,
        "fingerprints": spent["fingerprints"],
        "other_ms": (register_s - spent["fingerprint_s"]) * ms,
        "activation_ms": (zb_import_s + register_s) * ms,
        "activation_cpu_ms": cpu_s * ms,
        "new_modules_in_register": sorted(m for m in set(sys.modules) - loaded if not m.startswith("zb_patch")),
        "zb_patch_modules": sorted(m for m in sys.modules if m == "zb_patch" or m.startswith("zb_patch.")),
    }


KEYS = (
    "activation_ms",
    "activation_cpu_ms",
    "zb_import_ms",
    "register_ms",
    "fingerprint_ms",
    "other_ms",
    "plugin_import_ms",
)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="fresh processes per revision (default 5)")
    ap.add_argument("--json", help="write every value to this file")
    ap.add_argument(
        "--zb-patch-from",
        metavar="DIR",
        help="also measure the zb_patch package under DIR (another revision, e.g. the base: "
        "git archive main zb_patch | tar -x -C DIR, or a worktree), its processes interleaved with this checkout's",
    )
    ap.add_argument(
        "--cache",
        choices=("warm", "cold"),
        default="warm",
        help="warm (default): the processes share one fingerprint cache, filled by an untimed first "
        "process (every start after the first on a host); cold: each starts with an empty one",
    )
    ap.add_argument(
        "--forks",
        type=int,
        default=0,
        help="fork this many activations per revision from each fresh process after its worker imports "
        "(0, the default: one activation per fresh process); many samples for one vLLM import each",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--scratch", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        if args.forks:
            runs = forked(args.child.split(","), args.zb_patch_from, args.forks, args.cache, args.scratch)
            print(json.dumps(runs))
            return 0
        if args.zb_patch_from:
            use_zb_patch_from(args.zb_patch_from)
        print(json.dumps(child(args.child.split(","))))
        return 0

    modules = worker_modules()
    env = dict(os.environ)
    env.pop("ZB_PATCH", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SUPPORT, env.get("PYTHONPATH")) if p)
    trees: dict[str, list[str]] = {"this": []}
    if args.zb_patch_from:
        trees["from"] = ["--zb-patch-from", args.zb_patch_from]
    commands = {
        tree: [sys.executable, os.path.abspath(__file__), *extra, "--child", ",".join(modules)]
        for tree, extra in trees.items()
    }
    scratch = tempfile.mkdtemp(prefix="bench-activation-")
    env["XDG_CACHE_HOME"] = os.path.join(scratch, "shared")
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    if args.forks:
        command = [sys.executable, os.path.abspath(__file__), *trees.get("from", []), "--child", ",".join(modules)]
        command += ["--forks", str(args.forks), "--cache", args.cache]
        for i in range(args.runs):
            command_i = [*command, "--scratch", os.path.join(scratch, f"process{i}")]
            out = subprocess.run(command_i, env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
            for run in json.loads(out.strip().splitlines()[-1]):
                runs[run["tree"]].append(run)
                _print_run(f"process {i + 1}, fork {len(runs[run['tree']])}", run["tree"], run)
        return _summary(args, modules, runs)
    if args.cache == "warm":
        for command in commands.values():
            subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    for i in range(args.runs):
        order = list(trees) if i % 2 == 0 else list(reversed(trees))  # alternate who goes first
        for tree in order:
            if args.cache == "cold":
                env["XDG_CACHE_HOME"] = os.path.join(scratch, f"{tree}-run{i}")
            out = subprocess.run(commands[tree], env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
            run = json.loads(out.strip().splitlines()[-1])
            runs[tree].append(run)
            _print_run(f"run {i + 1}", tree, run)
    return _summary(args, modules, runs)


def _print_run(label: str, tree: str, run: dict) -> None:
    print(
        f"{label} {tree}: activation {run['activation_ms']:.1f} ms, cpu {run['activation_cpu_ms']:.1f} ms "
        f"(zb-patch imports {run['zb_import_ms']:.1f}, "
        f"register {run['register_ms']:.1f} = fingerprints {run['fingerprint_ms']:.1f} "
        f"[{run['fingerprints']} calls] + other {run['other_ms']:.1f}); state {run['state']} "
        f"{run['adapter']}; {len(run['zb_patch_modules'])} zb_patch modules; "
        f"plugin import {run['plugin_import_ms']:.1f} ms",
        flush=True,
    )
    if run["state"] != "applied":
        print(f"  not applied: {run['reason']}", flush=True)


def _summary(args: argparse.Namespace, modules: list[str], runs: dict[str, list[dict]]) -> int:
    from importlib.metadata import version

    summary: dict = {
        "vllm": version("vllm"),
        "vllm_ascend": version("vllm-ascend"),
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "load_average": os.getloadavg(),
        "cache": args.cache,
        "forks": args.forks,
        "modules": modules,
        "trees": {},
    }
    for tree, tree_runs in runs.items():
        medians = {k: statistics.median(r[k] for r in tree_runs) for k in KEYS}
        spread = {k: [min(r[k] for r in tree_runs), max(r[k] for r in tree_runs)] for k in KEYS}
        summary["trees"][tree] = {
            "zb_patch": tree_runs[0]["zb_patch"],
            "medians": medians,
            "range": spread,
            "runs": tree_runs,
        }
        print(f"{tree}: zb_patch from {tree_runs[0]['zb_patch']}")
        print("  median: " + ", ".join(f"{k} {v:.1f}" for k, v in medians.items()))
        for k in ("activation_cpu_ms", "activation_ms"):
            values = ", ".join(f"{r[k]:.1f}" for r in tree_runs)
            print(f"  {k} values: {values} (median {medians[k]:.1f}, range {spread[k][0]:.1f}-{spread[k][1]:.1f})")
        new_modules = tree_runs[0]["new_modules_in_register"]
        if new_modules:
            print("  modules imported by the activation (not zb_patch): " + ", ".join(new_modules))
    print("load average (1, 5, 15 min): " + ", ".join(f"{x:.1f}" for x in os.getloadavg()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
