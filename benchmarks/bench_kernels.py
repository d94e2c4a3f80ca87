"""GPU benchmark of the zb-patch kernels against what vllm-ascend releases run today.

Per case (num_reqs x tokens per request), side by side in one process:

slot mapping
  * ``numpy+H2D``   vllm-ascend 0.18.0's path, re-implemented from its ``BlockTable.compute_slot_mapping``
                    (numpy gather into the pinned ``slot_mapping.np``, ``commit_slot_mapping`` =
                    non-blocking H2D of ``[:num_tokens]``) plus the ``fill_(-1)`` of the graph padding
                    that its attention-metadata code does, so that all rows produce the same buffer;
  * ``generic``     vLLM 0.23.0's ``_compute_slot_mapping_kernel`` (extracted from the wheel into
                    .bench/ by benchmarks/extract_upstream.py), launched exactly as vllm-ascend
                    0.19.1rc1-0.23 launch it (grid ``num_reqs + 1``, ``BLOCK_SIZE=1024``);
  * ``zb``          our kernel through :class:`SlotMappingLauncher` (direct compiled-kernel launch);
  * ``zb-jitrun``   the same kernel through Triton's normal ``kernel[grid](...)`` path;
  * ``trivial``     a one-program Triton kernel storing one int (normal path), the GPU-time yardstick.

token-count correction
  * ``upstream-compiled``  vLLM's ``update_num_computed_tokens_for_batch_change`` under
                           ``torch.compile(dynamic=True)`` (inductor: CUDA's simple_compile_backend);
  * ``upstream-eager``     the same function eager (how vllm-ascend runs its copy);
  * ``upstream-prep``      compiled correction + vLLM's positions / seq_lens torch ops (the full step);
  * ``zb-fused``           our one launch doing all of that.

GPU time: ``triton.testing.do_bench`` median (it flushes L2 before every call).  Host time: wall
time per call of a loop of calls without synchronisation (median of 5 loops).  Also: the
sync-freedom check (``torch.cuda.set_sync_debug_mode("error")``) and a launch-overhead breakdown.

    python benchmarks/extract_upstream.py          # once, where pip works
    PYTHONUNBUFFERED=1 python benchmarks/bench_kernels.py --out $OUT/bench.json
    TRITON_INTERPRET=1 python benchmarks/bench_kernels.py --dry-run   # CPU smoke test of the script
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

import numpy as np
import torch
import triton
import triton.language as tl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, ".bench"))

from zb_patch import kernels  # noqa: E402
from zb_patch.kernels._launch import FastLauncher  # noqa: E402
from zb_patch.kernels.reference import slot_mapping_reference, token_counts_reference  # noqa: E402

CASES = [(2, 2), (256, 1), (64, 4), (256, 32), (1, 8192)]
MAX_NUM_TOKENS = 8192
MAX_NUM_REQS = 256
BLOCK = 128  # vllm-ascend's usual page size
MAX_BLOCKS = 512  # 64k tokens per request


@triton.jit
def _trivial_kernel(ptr):
    tl.store(ptr, 1)


def host_us(fn, calls: int, repeats: int = 5, sync=None) -> float:
    sync = sync or (lambda: None)
    for _ in range(10):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync()
        samples.append((t1 - t0) / calls * 1e6)
    return statistics.median(samples)


class Bench:
    def __init__(self, device: str, dry_run: bool) -> None:
        self.device = device
        self.dry = dry_run
        self.cuda = device == "cuda"
        self.sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        self.calls = 3 if dry_run else 2000
        self.graph_error = None

    def gpu_us(self, fn) -> float | None:
        """Median of three do_bench medians (METHOD.md: time twice, differences below the spread are noise)."""
        if not self.cuda:
            return None
        runs = [triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3 for _ in range(3)]
        self.last_spread = max(runs) - min(runs)
        return statistics.median(runs)

    def host_us(self, fn, calls=None) -> float:
        return host_us(fn, calls or self.calls, repeats=1 if self.dry else 5, sync=self.sync)

    def graph_us(self, fn, n: int = 50, reps: int = 20) -> float | None:
        """Device time per call from replaying a CUDA graph of ``n`` back-to-back calls (no launch
        gaps, warm L2): the kernel's own execution time, much less noisy than do_bench at ~5 us."""
        if not self.cuda:
            return None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(n):
                    fn()
            graph.replay()
            torch.cuda.synchronize()
            samples = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    graph.replay()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) * 1e3 / (reps * n))
            return statistics.median(samples)
        except Exception as exc:  # noqa: BLE001 - not capturable (host work, torch.compile guards)
            self.graph_error = f"{type(exc).__name__}: {exc}"[:200]
            return None

    def measure(self, fn, calls=None, graph: bool = True) -> dict:
        self.last_spread = None
        gpu = self.gpu_us(fn)
        res = {"gpu_us": gpu, "gpu_spread_us": self.last_spread, "host_us": self.host_us(fn, calls)}
        res["graph_us"] = self.graph_us(fn) if graph else None
        return res


# ------------------------------------------------------------------------------------------------
# slot mapping
# ------------------------------------------------------------------------------------------------
def slot_case(b: Bench, num_reqs: int, per_req: int, upstream) -> dict:
    dev = b.device
    rng = np.random.default_rng(num_reqs * 1000 + per_req)
    lens = np.full(num_reqs, per_req, dtype=np.int64)
    T = int(lens.sum())
    ctx = rng.integers(0, BLOCK * MAX_BLOCKS - per_req - 1, num_reqs)
    positions_np = np.concatenate([np.arange(c, c + n) for c, n in zip(ctx, lens)]).astype(np.int64)
    req_indices_np = np.repeat(np.arange(num_reqs), lens).astype(np.int64)
    qsl_np = np.zeros(num_reqs + 1, dtype=np.int32)
    qsl_np[1:] = np.cumsum(lens)
    bt_cpu = torch.from_numpy(rng.integers(0, 100_000, (MAX_NUM_REQS, MAX_BLOCKS)).astype(np.int32))
    pin = b.cuda
    bt_pinned = bt_cpu.pin_memory() if pin else bt_cpu.clone()
    bt = bt_cpu.to(dev)
    qsl = torch.from_numpy(qsl_np).to(dev)
    positions = torch.from_numpy(positions_np).to(dev)
    slot_dtype = torch.int32  # vllm-ascend's slot_mapping buffer
    out = {
        name: torch.full((MAX_NUM_TOKENS,), -7, dtype=slot_dtype, device=dev)
        for name in ("np", "generic", "zb", "zbjit")
    }
    slot_cpu = torch.zeros(MAX_NUM_TOKENS, dtype=slot_dtype, pin_memory=pin)
    slot_np = slot_cpu.numpy()
    bt_np = bt_pinned.numpy()

    def numpy_h2d():  # vllm-ascend 0.18.0 BlockTable.compute_slot_mapping + commit_slot_mapping
        logical_block_idx = positions_np // BLOCK
        block_table_indices = req_indices_np * MAX_BLOCKS + logical_block_idx
        block_numbers = bt_np.ravel()[block_table_indices]
        block_offsets = positions_np % BLOCK
        np.add(block_numbers * BLOCK, block_offsets, out=slot_np[:T])
        out["np"][:T].copy_(slot_cpu[:T], non_blocking=True)
        out["np"][T:].fill_(-1)

    def generic():
        upstream._compute_slot_mapping_kernel[(num_reqs + 1,)](
            T,
            MAX_NUM_TOKENS,
            qsl,
            positions,
            bt,
            bt.stride(0),
            BLOCK,
            out["generic"],
            TOTAL_CP_WORLD_SIZE=1,
            TOTAL_CP_RANK=0,
            CP_KV_CACHE_INTERLEAVE_SIZE=1,
            PAD_ID=-1,
            BLOCK_SIZE=1024,
        )

    zb_mapper = kernels.slot_mapper(bt, out["zb"], block_size=BLOCK, max_num_tokens=MAX_NUM_TOKENS)
    zb_jit_mapper = kernels.slot_mapper(
        bt, out["zbjit"], block_size=BLOCK, max_num_tokens=MAX_NUM_TOKENS, direct_launch=False
    )

    def zb():
        zb_mapper(num_reqs, qsl, positions)

    def zbjit():
        zb_jit_mapper(num_reqs, qsl, positions)

    fns = {"numpy+H2D": numpy_h2d, "generic": generic, "zb": zb, "zb-jitrun": zbjit}
    # launch-shape variants of our kernel (JSON only): warps per program, the NPU window path
    variants = {}
    for label, shape in (
        ("zb-w1", dict(num_warps=1)),
        ("zb-w2", dict(num_warps=2)),
        ("zb-w8", dict(num_warps=8)),
        ("zb-window", dict(windowed=True)),
        ("zb-tile256", dict(tile=256)),
    ):
        if b.dry and label != "zb-window":
            continue
        out[label] = torch.full((MAX_NUM_TOKENS,), -7, dtype=slot_dtype, device=dev)
        m = kernels.slot_mapper(bt, out[label], block_size=BLOCK, max_num_tokens=MAX_NUM_TOKENS, **shape)
        variants[label] = lambda m=m: m(num_reqs, qsl, positions)
    for fn in list(fns.values()) + list(variants.values()):
        fn()
    b.sync()
    ref = torch.full((MAX_NUM_TOKENS,), -7, dtype=slot_dtype)
    slot_mapping_reference(qsl.cpu(), positions.cpu(), bt_cpu, ref, block_size=BLOCK, max_num_tokens=MAX_NUM_TOKENS)
    correct = {name: bool(torch.equal(t.cpu(), ref)) for name, t in out.items()}
    res = {"case": f"{num_reqs}x{per_req}", "num_tokens": T, "equal_to_reference": correct}
    for name, fn in fns.items():
        res[name] = b.measure(fn, graph=name != "numpy+H2D")  # its numpy half cannot be captured
    res["variants"] = {name: b.measure(fn) for name, fn in variants.items()}
    res["zb_direct_launches"] = zb_mapper._launcher.direct_launches
    return res


def trivial_rows(b: Bench) -> dict:
    buf = torch.zeros(16, dtype=torch.int32, device=b.device)
    fast = FastLauncher(_trivial_kernel, {}, device_type=b.device, tensor_slots=(0,))
    res = {
        "trivial": b.measure(lambda: _trivial_kernel[(1,)](buf)),
        "trivial-direct": b.measure(lambda: fast.launch(1, (buf,))),
        "torch-fill_": b.measure(lambda: buf.fill_(3)),
    }
    return res


def launch_breakdown(b: Bench) -> dict:
    """Where the host time of one slot-mapping call goes (CUDA only), decode batch of 256."""
    if not b.cuda:
        return {}
    from triton.runtime import driver

    from zb_patch.kernels.slot_mapping import _slot_mapping_kernel

    dev = b.device
    bt = torch.zeros(MAX_NUM_REQS, MAX_BLOCKS, dtype=torch.int32, device=dev)
    slot = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int32, device=dev)
    qsl = torch.arange(257, dtype=torch.int32, device=dev)
    pos = torch.arange(256, dtype=torch.int64, device=dev)
    mapper = kernels.slot_mapper(bt, slot, block_size=BLOCK, max_num_tokens=MAX_NUM_TOKENS)
    mapper(256, qsl, pos)
    fl = mapper._launcher
    grid = mapper.num_programs
    tensors = (qsl, pos, bt, slot, 256, 256)
    ints = (qsl.data_ptr(), pos.data_ptr(), bt.data_ptr(), slot.data_ptr(), 256, 256)
    compiled = fl.launch_slow(grid, tensors)
    fast = fl.direct_launcher(compiled, 0)
    stream = driver.active.get_current_stream(0)
    const = fl._constexpr_values
    n = 5000
    run = compiled.run
    return {
        "1 zb call (SlotMappingLauncher.__call__, direct)": b.host_us(lambda: mapper(256, qsl, pos), n),
        "2 direct closure, int pointers": b.host_us(lambda: fast(grid, *ints), n),
        "3 CompiledKernel.run only, int pointers, fixed stream": b.host_us(
            lambda: run(
                grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *ints, *const
            ),
            n,
        ),
        "4 CompiledKernel.run only, tensor pointers": b.host_us(
            lambda: run(
                grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *tensors, *const
            ),
            n,
        ),
        "5 get_current_stream(0)": b.host_us(lambda: driver.active.get_current_stream(0), n),
        "6 two data_ptr() calls": b.host_us(lambda: (qsl.data_ptr(), pos.data_ptr()), n),
        "7 Triton normal path kernel[grid](...) (JITFunction.run)": b.host_us(
            lambda: _slot_mapping_kernel[(grid,)](*tensors, **fl._constexprs, num_warps=4), n
        ),
        "8 zb call with direct_launch=False": b.host_us(lambda: jit_mapper(256, qsl, pos), n)
        if (
            jit_mapper := kernels.slot_mapper(
                bt, slot, block_size=BLOCK, max_num_tokens=MAX_NUM_TOKENS, direct_launch=False
            )
        )
        else None,
        "direct_launches": mapper.direct_launches,
    }


# ------------------------------------------------------------------------------------------------
# token-count correction
# ------------------------------------------------------------------------------------------------
def correction_case(b: Bench, num_reqs: int, per_req: int, upstream_fn, compiled_fn) -> dict:
    dev = b.device
    g = torch.Generator().manual_seed(num_reqs + per_req)
    n = num_reqs
    drafts_k = max(per_req - 1, 1)
    T = n * per_req
    nc0 = torch.randint(100, 5000, (MAX_NUM_REQS,), dtype=torch.int32, generator=g)
    prev = torch.randperm(n, generator=g).to(torch.int64)
    valid = torch.randint(1, drafts_k + 2, (n,), dtype=torch.int64, generator=g)
    drafts = torch.full((MAX_NUM_REQS,), drafts_k, dtype=torch.int32)
    cpu_vals = torch.randint(100, 5000, (n,), dtype=torch.int32, generator=g)
    sched = torch.full((n,), per_req, dtype=torch.int32)
    req_idx = torch.repeat_interleave(torch.arange(n), per_req).to(torch.int64)
    qpos = torch.arange(per_req).repeat(n).to(torch.int64)
    t = {
        k: v.to(dev)
        for k, v in dict(
            nc=nc0, prev=prev, valid=valid, drafts=drafts, cpu=cpu_vals, sched=sched, req=req_idx, qpos=qpos
        ).items()
    }
    acc = torch.ones(MAX_NUM_REQS, dtype=torch.int32, device=dev)
    positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=dev)
    seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=dev)
    nc = t["nc"].clone()

    def up_compiled():
        compiled_fn(nc, acc[:n], t["prev"], t["valid"], t["drafts"], t["cpu"])

    def up_eager():
        upstream_fn(nc, acc[:n], t["prev"], t["valid"], t["drafts"], t["cpu"])

    def up_prep():  # vLLM 0.23 _prepare_inputs: correction, then positions / seq_lens torch ops
        compiled_fn(nc, acc[:n], t["prev"], t["valid"], t["drafts"], t["cpu"])
        positions[:T] = nc[t["req"]].to(torch.int64) + t["qpos"]
        seq_lens[:n] = nc[:n] + t["sched"]
        seq_lens[n:].fill_(0)

    def zb_functional():
        kernels.update_token_counts(
            nc,
            acc[:n],
            t["prev"],
            t["valid"],
            t["drafts"],
            t["cpu"],
            t["sched"],
            seq_lens,
            num_reqs=n,
            req_indices=t["req"],
            query_pos=t["qpos"],
            positions=positions,
            num_tokens=T,
        )

    prepared = kernels.token_counts_launcher(
        num_computed_tokens=nc,
        seq_lens=seq_lens,
        num_scheduled_tokens=t["sched"],
        prev_positions=t["prev"],
        prev_num_draft_tokens=t["drafts"],
        num_accepted_tokens=acc,
        req_indices=t["req"],
        query_pos=t["qpos"],
        positions=positions,
    )

    def zb_fused():  # the hot-path form: buffers bound once, per step only what changes
        prepared(n, t["cpu"], t["valid"], num_tokens=T)

    # correctness of the fused kernel on this case (fresh state) against the reference
    k_state = [t["nc"].clone(), acc.clone(), seq_lens.clone(), positions.clone()]
    kernels.update_token_counts(
        k_state[0],
        k_state[1][:n],
        t["prev"],
        t["valid"],
        t["drafts"],
        t["cpu"],
        t["sched"],
        k_state[2],
        num_reqs=n,
        req_indices=t["req"],
        query_pos=t["qpos"],
        positions=k_state[3],
        num_tokens=T,
    )
    r_state = [
        nc0.clone(),
        torch.ones(MAX_NUM_REQS, dtype=torch.int32),
        torch.zeros(MAX_NUM_REQS, dtype=torch.int32),
        torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64),
    ]
    token_counts_reference(
        r_state[0],
        r_state[1][:n],
        prev,
        valid,
        drafts,
        cpu_vals,
        sched,
        r_state[2],
        num_reqs=n,
        req_indices=req_idx,
        query_pos=qpos,
        positions=r_state[3],
        num_tokens=T,
    )
    equal = all(torch.equal(a.cpu(), r) for a, r in zip(k_state, r_state))

    fns = {
        "upstream-compiled": up_compiled,
        "upstream-eager": up_eager,
        "upstream-prep": up_prep,
        "zb-fused": zb_fused,
        "zb-fused-functional": zb_functional,
    }
    res = {"case": f"{num_reqs}x{per_req}", "equal_to_reference": equal}
    for name, fn in fns.items():
        fn()
        b.sync()
        res[name] = b.measure(
            fn,
            calls=None if name.startswith("zb") else max(1, b.calls // 4),
            graph=name.startswith("zb") or name == "upstream-eager",
        )
    res["zb_direct_launches"] = getattr(prepared, "direct_launches", None)
    return res


# ------------------------------------------------------------------------------------------------
# sync freedom
# ------------------------------------------------------------------------------------------------
def sync_check(b: Bench) -> dict:
    if not b.cuda:
        return {"skipped": "needs CUDA"}
    dev = b.device
    n, k = 64, 4
    T = n * k
    pin = lambda x: x.pin_memory()  # noqa: E731
    # host-side buffers as the runner has them (pinned), device buffers persistent
    prev_cpu = pin(torch.randperm(n).to(torch.int64))
    drafts_cpu = pin(torch.full((MAX_NUM_REQS,), 3, dtype=torch.int32))
    cpu_vals = pin(torch.randint(100, 200, (n,), dtype=torch.int32))
    sched_cpu = pin(torch.full((n,), k, dtype=torch.int32))
    req_cpu = pin(torch.repeat_interleave(torch.arange(n), k).to(torch.int64))
    qpos_cpu = pin(torch.arange(k).repeat(n).to(torch.int64))
    qsl_cpu = pin(torch.arange(0, T + 1, k, dtype=torch.int32))
    valid_host = pin(torch.randint(1, 5, (MAX_NUM_REQS,), dtype=torch.int64))  # last step's D2H copy
    opt_seq = pin(torch.randint(100, 200, (MAX_NUM_REQS,), dtype=torch.int32))
    valid_gpu = valid_host[:n].to(dev)
    nc = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=dev)
    acc = torch.ones(MAX_NUM_REQS, dtype=torch.int32, device=dev)
    bufs = {
        name: torch.zeros_like(x, device=dev)
        for name, x in dict(
            prev=prev_cpu, drafts=drafts_cpu, cpu=cpu_vals, sched=sched_cpu, req=req_cpu, qpos=qpos_cpu, qsl=qsl_cpu
        ).items()
    }
    positions = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int64, device=dev)
    seq_lens = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=dev)
    bt = torch.randint(0, 1000, (MAX_NUM_REQS, MAX_BLOCKS), dtype=torch.int32, device=dev)
    slot = torch.zeros(MAX_NUM_TOKENS, dtype=torch.int32, device=dev)
    mapper = kernels.slot_mapper(bt, slot, block_size=BLOCK, max_num_tokens=MAX_NUM_TOKENS)
    counts = kernels.token_counts_launcher(
        num_computed_tokens=nc,
        seq_lens=seq_lens,
        num_scheduled_tokens=bufs["sched"],
        prev_positions=bufs["prev"],
        prev_num_draft_tokens=bufs["drafts"],
        num_accepted_tokens=acc,
        req_indices=bufs["req"],
        query_pos=bufs["qpos"],
        positions=positions,
    )
    cpu_dev = torch.zeros(n, dtype=torch.int32, device=dev)

    def step():
        # CPU: exact seq_lens for Ascend attention (numpy, no device access)
        kernels.correct_optimistic_seq_lens_cpu(
            opt_seq.numpy(), prev_cpu.numpy(), drafts_cpu.numpy(), valid_host.numpy(), n
        )
        for name, src in dict(
            prev=prev_cpu, drafts=drafts_cpu, cpu=cpu_vals, sched=sched_cpu, req=req_cpu, qpos=qpos_cpu, qsl=qsl_cpu
        ).items():
            bufs[name].copy_(src, non_blocking=True)  # pinned H2D: asynchronous
        cpu_dev.copy_(cpu_vals, non_blocking=True)
        counts(n, cpu_dev, valid_gpu, num_tokens=T)  # hot-path form
        kernels.update_token_counts(
            nc,
            acc[:n],
            bufs["prev"],
            valid_gpu,
            bufs["drafts"],
            bufs["cpu"],
            bufs["sched"],
            seq_lens,
            num_reqs=n,
            req_indices=bufs["req"],
            query_pos=bufs["qpos"],
            positions=positions,
            num_tokens=T,
        )  # functional form
        mapper(n, bufs["qsl"], positions[:T])

    results = {}
    for label, warm in (("first-call (compiles inside)", False), ("steady-state", True)):
        if warm:
            step()
            torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                step()
            results[label] = "ok: no synchronizing call"
        except Exception as exc:  # noqa: BLE001
            results[label] = f"raised {type(exc).__name__}: {exc}"[:400]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    # control: the debug mode does catch a synchronizing call here
    torch.cuda.set_sync_debug_mode("error")
    try:
        seq_lens.sum().item()
        results["control (.item())"] = "NOT caught"
    except RuntimeError:
        results["control (.item())"] = "caught, as it must be"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return results


def fmt(x) -> str:
    return "-" if x is None else f"{x:7.1f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write the full results as JSON here")
    ap.add_argument("--dry-run", action="store_true", help="CPU smoke test (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    b = Bench(device, args.dry_run)
    import upstream_vllm  # .bench/, made by benchmarks/extract_upstream.py

    upstream_fn = upstream_vllm.update_num_computed_tokens_for_batch_change
    compiled_fn = upstream_fn if args.dry_run else torch.compile(upstream_fn, dynamic=True, backend="inductor")
    env = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if b.cuda else "cpu (dry run)",
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(env))
    results = {"env": env, "trivial": trivial_rows(b), "slot": [], "correction": []}
    print("trivial:", json.dumps(results["trivial"]))
    for num_reqs, per_req in CASES:
        try:
            r = slot_case(b, num_reqs, per_req, upstream_vllm)
        except Exception:  # noqa: BLE001
            r = {"case": f"{num_reqs}x{per_req}", "error": traceback.format_exc()}
        results["slot"].append(r)
        print("slot", json.dumps(r))
    for num_reqs, per_req in CASES:
        try:
            r = correction_case(b, num_reqs, per_req, upstream_fn, compiled_fn)
        except Exception:  # noqa: BLE001
            r = {"case": f"{num_reqs}x{per_req}", "error": traceback.format_exc()}
        results["correction"].append(r)
        print("correction", json.dumps(r))
    try:
        results["launch_breakdown"] = launch_breakdown(b)
    except Exception:  # noqa: BLE001
        results["launch_breakdown"] = {"error": traceback.format_exc()}
    print("launch breakdown:", json.dumps(results["launch_breakdown"]))
    try:
        results["sync_debug"] = sync_check(b)
    except Exception:  # noqa: BLE001
        results["sync_debug"] = {"error": traceback.format_exc()}
    print("sync debug:", json.dumps(results["sync_debug"]))

    # summary table
    triv = results["trivial"]["trivial"]
    print(
        "\nslot mapping (us)        gpu: np+H2D generic    zb  zb-jit trivial | host: np+H2D generic    zb  zb-jit"
        " | graph: generic    zb trivial"
    )
    for r in results["slot"]:
        if "error" in r:
            print(r["case"], "ERROR")
            continue
        g = [r[k]["gpu_us"] for k in ("numpy+H2D", "generic", "zb", "zb-jitrun")] + [triv["gpu_us"]]
        h = [r[k]["host_us"] for k in ("numpy+H2D", "generic", "zb", "zb-jitrun")]
        gr = [r["generic"]["graph_us"], r["zb"]["graph_us"], triv["graph_us"]]
        print(
            f"{r['case']:>10} ok={all(r['equal_to_reference'].values())!s:5} "
            + " ".join(fmt(x) for x in g)
            + " | "
            + " ".join(fmt(x) for x in h)
            + " | "
            + " ".join(fmt(x) for x in gr)
        )
    print(
        "\ncorrection (us)        gpu: compiled  eager   prep  zb-fused zb-func"
        " | host: compiled  eager   prep  zb-fused zb-func"
    )
    for r in results["correction"]:
        if "error" in r:
            print(r["case"], "ERROR")
            continue
        names = ("upstream-compiled", "upstream-eager", "upstream-prep", "zb-fused", "zb-fused-functional")
        print(
            f"{r['case']:>10} ok={r['equal_to_reference']!s:5} "
            + " ".join(fmt(r[k]["gpu_us"]) for k in names)
            + " | "
            + " ".join(fmt(r[k]["host_us"]) for k in names)
            + " | graph eager/zb: "
            + " ".join(fmt(r[k]["graph_us"]) for k in ("upstream-eager", "zb-fused"))
        )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
