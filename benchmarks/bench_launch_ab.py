"""Host time per call of zb-patch's two hot-path launchers, this tree against another revision, in one process.

``bench_kernels.py`` measures each launcher once per case; between two runs a row moves by several us on a shared
VM, more than a change to the launchers' Python (argument checks, say) costs. This script puts both revisions'
launchers on the same buffers in one process and alternates them many times (A, B, A, B, ...), so slow drift of
the host affects both alike; it reports the median of the per-round medians and the median of the per-round
differences.

    git archive <rev> zb_patch | tar -x -C /tmp/base       # the other revision's package
    python benchmarks/bench_launch_ab.py --base /tmp/base [--rounds 40] [--calls 2000] [--out ab.json]

Needs a CUDA device (the launchers take the Triton path only on device tensors). The other revision is loaded as
package ``zb_patch_base``, so its relative imports resolve inside it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MAX_NUM_REQS = 256
MAX_NUM_TOKENS = 8192
BLOCK = 128


def load_base(root: str):
    pkg_dir = os.path.join(root, "zb_patch")
    spec = importlib.util.spec_from_file_location(
        "zb_patch_base", os.path.join(pkg_dir, "__init__.py"), submodule_search_locations=[pkg_dir]
    )
    assert spec is not None and spec.loader is not None, pkg_dir
    module = importlib.util.module_from_spec(spec)
    sys.modules["zb_patch_base"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("zb_patch_base.kernels")


def calls(kernels, dev: str, num_reqs: int, per_req: int) -> dict:
    """The two hot-path calls of one revision, bound to fresh buffers of one case."""
    g = torch.Generator().manual_seed(num_reqs * 1000 + per_req)
    n, T = num_reqs, num_reqs * per_req
    bt = torch.randint(0, 4096, (MAX_NUM_REQS, MAX_NUM_TOKENS // BLOCK), dtype=torch.int32, generator=g).to(dev)
    slot = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=dev)
    qsl = (torch.arange(n + 1, dtype=torch.int32) * per_req).to(dev)
    positions = torch.randint(0, 4000, (T,), dtype=torch.int64, generator=g).to(dev)
    mapper = kernels.slot_mapper(bt, slot, block_size=BLOCK, max_num_tokens=MAX_NUM_TOKENS)

    nc = torch.randint(100, 5000, (MAX_NUM_REQS,), dtype=torch.int32, generator=g).to(dev)
    acc = torch.ones(MAX_NUM_REQS, dtype=torch.int32, device=dev)
    seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=dev)
    pos_out = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=dev)
    k = max(per_req - 1, 1)
    prev = torch.randperm(n, generator=g).to(torch.int64).to(dev)
    valid = torch.randint(1, k + 2, (n,), dtype=torch.int64, generator=g).to(dev)
    drafts = torch.full((MAX_NUM_REQS,), k, dtype=torch.int32, device=dev)
    cpu_counts = torch.randint(100, 5000, (n,), dtype=torch.int32, generator=g).to(dev)
    sched = torch.full((n,), per_req, dtype=torch.int32, device=dev)
    req_idx = torch.repeat_interleave(torch.arange(n), per_req).to(torch.int64).to(dev)
    qpos = torch.arange(per_req).repeat(n).to(torch.int64).to(dev)
    counts = kernels.token_counts_launcher(
        num_computed_tokens=nc,
        seq_lens=seq_lens,
        num_scheduled_tokens=sched,
        prev_positions=prev,
        prev_num_draft_tokens=drafts,
        num_accepted_tokens=acc,
        req_indices=req_idx,
        query_pos=qpos,
        positions=pos_out,
    )
    return {
        "slot mapping": lambda: mapper(n, qsl, positions),
        "token counts": lambda: counts(n, cpu_counts, valid, num_tokens=T),
    }


def per_call_us(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()  # outside the timed loop: the launches are what is timed
    return (t1 - t0) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="directory holding the other revision's zb_patch package")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", help="write all samples as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from zb_patch import kernels as this

    revisions = {"base": load_base(args.base), "this": this}
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    for num_reqs, per_req in ((64, 4), (256, 1), (1, 8192)):
        case = f"{num_reqs}x{per_req}"
        fns = {rev: calls(mod, "cuda", num_reqs, per_req) for rev, mod in revisions.items()}
        for rev_fns in fns.values():  # compile and warm both
            for fn in rev_fns.values():
                for _ in range(20):
                    fn()
        torch.cuda.synchronize()
        for name in ("slot mapping", "token counts"):
            samples: dict[str, list[float]] = {"base": [], "this": []}
            for r in range(args.rounds):
                order = ("base", "this") if r % 2 == 0 else ("this", "base")
                for rev in order:
                    samples[rev].append(per_call_us(fns[rev][name], args.calls))
            diffs = [t - b for b, t in zip(samples["base"], samples["this"])]
            row = {
                "base_us": statistics.median(samples["base"]),
                "this_us": statistics.median(samples["this"]),
                "diff_us": statistics.median(diffs),
                "samples": samples,
            }
            results["cases"].setdefault(case, {})[name] = row
            print(
                f"{case:>8} {name:<13} base {row['base_us']:6.2f} us  this {row['this_us']:6.2f} us  "
                f"median diff {row['diff_us']:+.2f} us ({args.rounds} rounds x {args.calls} calls)"
            )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
