"""The engine e2e with real asynchrony: vLLM 0.18's offline ``LLM`` on the vllm-ascend 0.18 platform (the release's
runner, model, attention backend, sampler, rejection sampler, EAGLE proposer; tests/support's NPU stand-in and
emulated ops), with a CUDA device standing in for the NPU (``NPU_STANDIN_DEVICE=cuda``): streams, events, pinned
host memory and host/device overlap are real. For the GPU host, which has torch + Triton and no vLLM: the packages come
from the carried ``.gpu-stack/`` (benchmarks/gpu_stack.py; docs/environments.md, "GPU machine").

    OUT=/some/dir python3 benchmarks/bench_engine_gpu.py [--workload JSON] [--k 2] [--sync-debug warn|error]

One call runs, each configuration in its own engine process (zb_patch.check.engine.run.run_config with this file as
the child):

(a) sync / async / async + ``ZB_PATCH=1`` on the workload: tokens and drafted / accepted counts compared as
    ``zb-patch selftest --engine`` compares them, plus transformers' own greedy Llama on the same weights (CUDA).
(b) sync debug: ``torch.cuda.set_sync_debug_mode`` armed for the whole of ``execute_model`` and ``sample_tokens``;
    each synchronising CUDA call is counted per step and phase: ``pre`` (before ``_update_states``), ``prep``
    (``_update_states`` up to the forward launch, ``_model_forward``, on 0.13 ``_generate_process_reqs_hidden_states``:
    the window that must be sync-free), ``forward``, ``post``, ``sample``. zb-patch's one documented wait
    (``ZeroBubble.exact_host_counts``) is its own phase, ``zb-wait``. CUDA's sync debug does not see
    ``Event.synchronize`` (the classic accepted-count wait is one), so event waits are counted by wrapping
    ``torch.cuda.Event.synchronize``, with their site and time. ``--sync-debug error`` instead raises on the first
    synchronising call inside ``prep`` (the run stops there; its stack is the result).
(c) time per step: host (step period, input preparation, execute_model, sample_tokens, time blocked in event waits)
    over the steps before the profiler starts, and device idle per step (torch.profiler / CUPTI: the step period
    minus the union of kernel / memcpy / memset time) over ``--profile-steps`` steps after ``--profile-from``.
(d) time per output token, measured in the engine process (the offline ``LLM`` keeps vLLM's request metrics off):
    each engine output's arrival (``OutputProcessor.process_outputs``, host clock) per request; TPOT per request =
    (last token's arrival - first token's) / (output tokens - 1), median over the requests; ITL = the gaps between a
    request's successive outputs that carry tokens (one output can carry up to k + 1 tokens), median and p90 over all
    gaps; output tokens / s = every request's output tokens / the wall time of the ``generate`` call.

Writes ``$OUT/bench_engine_gpu.json`` and ``$OUT/bench_engine_gpu.md`` (+ each run's result, probe and trace).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
import warnings

BENCH = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(BENCH))
SUPPORT = os.path.join(REPO, "tests", "support")
ABSENT = os.path.join(SUPPORT, "gpu_box", "absent")
sys.path.insert(0, REPO)

SYNC_WARNING = "called a synchronizing CUDA operation"
# orchestrator -> engine child (run_config names a run by its flags, so paths travel in the environment)
PROBE_ENV, SYNC_ENV, PROFILE_ENV, DRY_ENV, DEVICE_MS_ENV = (
    "ZB_BENCH_PROBE",
    "ZB_BENCH_SYNC_DEBUG",
    "ZB_BENCH_PROFILE",
    "ZB_BENCH_DRY_RUN",
    "ZB_BENCH_DEVICE_MS",
)
# "1": zb-patch's start-up compilation (ZeroBubble.compile_kernels) does nothing, the rest of zero-bubble runs (the
# patch cannot be left out alone: ZB_PATCH_DISABLE of one patch leaves out its whole group)
NO_START_COMPILE_ENV = "ZB_BENCH_NO_START_COMPILE"
# "1": an experiment on classic async scheduling (no zb-patch): vLLM's synchronize_input_prep protocol added alone
# (see _add_input_prep_wait)
INPUT_PREP_WAIT_ENV = "ZB_BENCH_INPUT_PREP_WAIT"
PHASES = ("pre", "prep", "zb-wait", "forward", "post", "sample")


# ---------------------------------------------------------------------------------------------------------------
# orchestrator (runs first; imports no vLLM)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/zb-bench-engine"))
    ap.add_argument("--stack", default=os.path.join(REPO, ".gpu-stack"), help="the carried stack folder")
    ap.add_argument("--workload", default="{}", help="zb_patch.check.engine.workload.Workload fields as JSON")
    ap.add_argument("--k", type=int, default=2, help="num_speculative_tokens")
    ap.add_argument("--sync-debug", choices=("warn", "error"), default="warn")
    ap.add_argument("--profile-from", type=int, default=30, help="first profiled step (earlier steps: host timing)")
    ap.add_argument("--profile-steps", type=int, default=30)
    ap.add_argument(
        "--configs",
        default="sync,async,async+zb",
        help="configurations (zb_patch.check.engine.run.CONFIGS), comma-separated; NAME~ID runs NAME with "
        "ZB_PATCH_DISABLE=ID (e.g. async+zb~piecewise-drain-once-per-step: zb-patch with the release's drain before "
        "every piece), NAME@ID with ZB_PATCH_ENABLE=ID (an opt-in patch, e.g. "
        "async+zb@full-replay-ordered-on-device)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="engine runs per configuration, interleaved (sync, async, async+zb, sync, ...): the summary gives each "
        "figure's median over the repeats and its spread (min..max)",
    )
    ap.add_argument(
        "--device-ms",
        type=float,
        default=0.0,
        help="device time added to every forward (a spin kernel on the forward's stream before the model's kernels): "
        "the tiny model's own forward takes microseconds, a served model's milliseconds; the bubble between steps "
        "shows only when the device, not the host, is the longer part of a step",
    )
    ap.add_argument("--no-warmup", action="store_true", help="skip the short run that fills Triton's kernel cache")
    ap.add_argument("--no-reference", action="store_true", help="skip transformers' greedy reference run")
    ap.add_argument(
        "--models",
        metavar="ARCHIVE",
        help="the tiny models (target + EAGLE head, MiMo + MTP, DeepSeek-V3-style + MTP) as a .tar.xz written by "
        "--write-models (the GPU host has no scipy, which writing the constructed model needs); by default they are "
        "written here",
    )
    ap.add_argument(
        "--selftest",
        metavar="KS",
        help="instead of (a)-(c): zb-patch selftest --engine (the product's comparison; tests/engine/run_engine.py as "
        "the engine child, the NPU ops emulated on CUDA) at these k (comma-separated) on --workload, per drafter of "
        "--drafters; no probes. Writes $OUT/selftest-<drafter>-k<k>.{json,md} and each engine's log in that folder",
    )
    ap.add_argument("--drafters", default="eagle,mtp", help="--selftest's drafters (default eagle,mtp)")
    ap.add_argument(
        "--drafter",
        choices=("eagle", "mtp", "deepseek-mtp"),
        default="eagle",
        help="the drafter of (a)-(d) (the child's --drafter): eagle (Llama + EAGLE head), mtp (MiMo + its MTP layer), "
        "deepseek-mtp",
    )
    ap.add_argument(
        "--plants",
        default="",
        help="--selftest: after each report, these planted mistakes (tests/engine/plants.py, comma-separated), each "
        "one async+zb run in the same mode; $OUT/selftest-...-plants.md lists each one's divergences from sync",
    )
    ap.add_argument(
        "--graph-mode",
        choices=("eager", "piecewise", "full_decode_only"),
        default="eager",
        help="the engine child's --graph-mode (ACL graphs as CUDA graphs: tests/support/npu_graphs_cuda.py)",
    )
    ap.add_argument("--jobs", type=int, default=4, help="--selftest: k values run at a time (4 engines each)")
    ap.add_argument(
        "--write-models",
        metavar="ARCHIVE",
        help="write the tiny models (zb_patch.check.engine.model.write_models, write_mtp_model, "
        "write_deepseek_model) into ARCHIVE (.tar.xz) and stop: run where scipy is installed (a va0XX tox env), carry "
        "the archive to the GPU machine",
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per engine process at most")
    ap.add_argument(
        "--budget",
        type=float,
        default=540.0,
        help="seconds for the whole script (the device tool stops a command at 600 s): later runs get what is left, "
        "and the report is written after every run",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="on a CPU machine: the NPU on the CPU, Triton interpreted, no sync debug / device trace (checks the "
        "script, the stack and the probes, not the numbers)",
    )
    args = ap.parse_args(argv)
    if args.write_models:
        return _write_models_archive(args.write_models)
    os.makedirs(args.out, exist_ok=True)
    started = time.monotonic()
    report: dict = {
        "schema": "zb-patch-bench-engine-gpu/1",
        "argv": argv,
        "device_ms": args.device_ms,
        "drafter": args.drafter,
    }

    tree, manifest = _stack(args.stack)
    report["stack"] = {k: manifest[k] for k in ("release", "python", "archive", "archive_sha256", "tree_bytes")}
    report["stack"]["unpacked"] = tree
    import gpu_stack

    report["box"] = gpu_stack.box_report(tree, manifest)
    if report["box"]["missing"]:
        missing = ", ".join(report["box"]["missing"])
        return _finish(
            args.out,
            report,
            [f"the GPU machine lacks {missing} (BOX_HAS: not carried): add them to gpu_stack.PACKAGES and rebuild"],
        )
    _child_environment(tree, manifest, args.dry_run)
    report["stand_ins"] = os.environ.get("ZB_BENCH_STAND_INS", "")
    from zb_patch.check.engine import run, verdict
    from zb_patch.check.engine.model import VOCAB, write_models

    os.environ[run.CHILD_ENV] = BENCH  # this file is the engine child (run_config does not pass it on)
    from zb_patch.check.engine.workload import Workload, divergences, summarize, table

    deadline = started + args.budget

    def timeout() -> float:
        return max(1.0, min(args.timeout, deadline - time.monotonic()))

    device = run.check_device(timeout=timeout())
    report["device"] = device
    print(f"device: {json.dumps(device)}", flush=True)
    if not device.get("available"):
        return _finish(args.out, report, ["no usable CUDA device / the stack does not import: see device"])

    if args.selftest:
        wl = Workload(**json.loads(args.workload))
        return _selftest(run, wl, args, deadline - time.monotonic())
    wl = Workload(**{**json.loads(args.workload), "num_speculative_tokens": args.k})
    report["workload"] = wl.to_json()
    models = os.path.join(args.out, "models")
    if args.models:
        shutil.rmtree(models, ignore_errors=True)
        with tarfile.open(args.models) as tar:
            tar.extractall(args.out, filter="data")  # the archive holds models/target and models/eagle
    else:
        from zb_patch.check.engine.model import write_deepseek_model, write_mtp_model

        {"eagle": write_models, "mtp": write_mtp_model, "deepseek-mtp": write_deepseek_model}[args.drafter](models)
    runs_dir = os.path.join(args.out, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    graph_flags = () if args.graph_mode == "eager" else ("--graph-mode", args.graph_mode)
    if args.drafter != "eagle":
        graph_flags = ("--drafter", args.drafter, *graph_flags)
    report["graph_mode"] = args.graph_mode
    failures: list[str] = []
    if not args.no_warmup:
        # async+zb launches every Triton kernel the three runs use (the release's and zb-patch's): compiled into
        # Triton's cache here, not inside the measured runs
        small = Workload(num_requests=2, max_prompt=20, max_tokens=12, num_speculative_tokens=args.k)
        warm = _run(run, "async+zb", models, runs_dir, small, ("--warmup", *graph_flags), timeout())
        if warm.result is None:
            failures.append(f"warm-up {warm.tag} failed (rc {warm.returncode}): {warm.log[-3000:]}")
            return _finish(args.out, report, failures)

    results, probes, repeats = {}, {}, {}
    configs = args.configs.split(",")
    for rep in range(args.repeats):
        rep_dir = os.path.join(runs_dir, f"r{rep}")
        os.makedirs(rep_dir, exist_ok=True)
        for name in configs:
            base, env = _config_env(name)
            run_dir = os.path.join(rep_dir, name) if env else rep_dir  # same tag as NAME: its own folder
            os.makedirs(run_dir, exist_ok=True)
            probe_path = os.path.join(rep_dir, f"{name}-probe.json")
            os.environ[PROBE_ENV] = probe_path
            os.environ[SYNC_ENV] = "off" if args.dry_run else args.sync_debug
            os.environ[PROFILE_ENV] = f"{args.profile_from},{args.profile_steps}"
            os.environ[DEVICE_MS_ENV] = "0" if args.dry_run else str(args.device_ms)
            r = _run(run, base, models, run_dir, wl, ("--bench", *graph_flags), timeout(), env)
            label = f"{name} #{rep + 1}"
            if os.path.isfile(probe_path):
                with open(probe_path) as fh:
                    probes[label] = json.load(fh)
            report["probes"] = {n: p.get("summary", p) for n, p in probes.items()}
            report["repeats"] = summarize_repeats(report["probes"], configs)
            if r.result is None:
                failures.append(f"{r.tag} #{rep + 1}: engine process failed (rc {r.returncode}): {r.log[-4000:]}")
            elif name in results:
                # every repeat must generate what the first did
                repeats[label] = divergences(results[name], r.result, fields=("tokens",))
                failures += [f"{label} vs #1: {d}" for d in repeats[label]]
            else:
                results[name] = r.result
                failures += _config_env_failures(name, r.result)
                report.setdefault("tokens", {})[name] = r.result.get("tokens")  # the first repeat's, per config
                # greedy: every configuration generates what the first one did
                first = next(iter(results))
                failures += [f"{name} vs {first}: {d}" for d in divergences(results[first], r.result, ("tokens",))]
            _finish(args.out, dict(report, partial=True), failures, quiet=True)  # what is there if the call is cut off

    reference = (
        {} if args.no_reference else _reference_tokens(models, wl, os.path.join(runs_dir, "reference.json"), timeout())
    )
    report["reference"] = {k: v for k, v in reference.items() if k != "tokens"}
    if set(run.CONFIGS) <= set(results):
        judged = {n: results[n] for n in run.CONFIGS}  # the verdict's configurations (NAME~ID runs: reported only)
        fails, notes = verdict.compare(judged, wl, VOCAB)
        failures += fails
        report["notes"] = notes
        report["rows"] = [summarize(n, res) for n, res in results.items()]
        report["divergences"] = {n: len(divergences(results["sync"], res)) for n, res in results.items()}
        report["table"] = table(report["rows"], report["divergences"])
        report["zb_patch_status"] = results["async+zb"].get("zb_patch_status")
    if "tokens" in reference:
        ref = {"tokens": reference["tokens"]}
        report["vs_transformers"] = {n: divergences(ref, res, fields=("tokens",)) for n, res in results.items()}
    report["seconds"] = round(time.monotonic() - started, 1)
    return _finish(args.out, report, failures)


def _selftest(run, wl, args, seconds: float) -> int:
    """``zb-patch selftest --engine`` on the GPU machine, one report per (drafter, k); ``--jobs`` of them at a time."""
    from concurrent.futures import ThreadPoolExecutor

    if not args.models:
        print("--selftest needs --models (the GPU machine cannot write the constructed model)", file=sys.stderr)
        return 2
    os.environ[run.CHILD_ENV] = os.path.join(REPO, "tests", "engine", "run_engine.py")
    # the models come from the archive: unpacked where run_engine_selftest writes them (its keep folder)
    run.write_models = run.write_mtp_model = run.write_deepseek_model = lambda root, seed=0: None
    run_config = run.run_config

    def run_config_keeping_log(name, models, out_dir, wl, *args, **kwargs):
        # each engine's whole log beside its result (the report keeps only a failure's tail)
        r = run_config(name, models, out_dir, wl, *args, **kwargs)
        with open(os.path.join(out_dir, f"{r.tag}.log"), "w") as fh:
            fh.write(r.log)
        return r

    run.run_config = run_config_keeping_log

    def one(drafter: str, k: int) -> str:
        keep = os.path.join(
            args.out, f"selftest-{drafter}-k{k}" + ("" if args.graph_mode == "eager" else f"-{args.graph_mode}")
        )
        with tarfile.open(args.models) as tar:
            tar.extractall(keep, filter="data")
        started = time.monotonic()
        with open(os.path.join(keep, "progress.log"), "w") as log:
            report = run.run_engine_selftest(
                wl, [k], parallel=len(run.CONFIGS), keep=keep, log=log, drafter=drafter, graph_mode=args.graph_mode
            )
        report["seconds"] = round(time.monotonic() - started, 1)
        for ext, text in (("json", json.dumps(report, indent=2)), ("md", run.render(report))):
            with open(f"{keep}.{ext}", "w") as fh:
                fh.write(text + "\n")
        if args.plants:
            _plants(run, wl, k, drafter, args, keep)
        return f"{drafter} k={k}: {report['verdict']} ({report['seconds']:.0f} s)"

    jobs = [(d, int(k)) for d in args.drafters.split(",") for k in args.selftest.split(",")]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(one, d, k) for d, k in jobs]
        for f in futures:
            print(f.result(timeout=max(1.0, seconds)), flush=True)
    return 0


def _plants(run, wl, k: int, drafter: str, args, keep: str) -> None:
    """Each planted mistake as one async+zb run beside the selftest's (same models, mode and workload); its first
    divergence from the selftest's sync run, or none."""
    from dataclasses import replace

    from zb_patch.check.engine.workload import divergences

    wk = replace(wl, num_speculative_tokens=k)
    mode = ["--graph-mode", args.graph_mode] if args.graph_mode != "eager" else []
    draft = ["--drafter", drafter] if drafter != "eagle" else []
    suffix = "-".join(a.lstrip("-") for a in draft + mode) or "plain"
    with open(os.path.join(keep, f"sync-k{k}-{suffix}.json")) as fh:
        sync = json.load(fh)
    lines = [f"# planted mistakes, {drafter} k = {k}, {args.graph_mode}: async+zb with the plant vs sync", ""]
    for plant in args.plants.split(","):
        r = run.run_config("async+zb", os.path.join(keep, "models"), keep, wk, [*draft, *mode, "--plant", plant])
        with open(os.path.join(keep, f"{r.tag}.log"), "w") as fh:
            fh.write(r.log)
        if r.result is None:
            lines.append(f"- {plant}: stopped (rc {r.returncode}): {r.log.strip().splitlines()[-1:]}")
            continue
        found = divergences(sync, r.result)
        hits = dict(r.result.get("plant_hits", {}))
        lines.append(f"- {plant}: hits {hits}; " + ("; ".join(found[:3]) if found else "no divergence from sync"))
    with open(f"{keep}-plants.md", "w") as fh:
        fh.write("\n".join(lines) + "\n")


def _write_models_archive(archive: str) -> int:
    from zb_patch.check.engine.model import write_deepseek_model, write_models, write_mtp_model

    with tempfile.TemporaryDirectory() as tmp:
        write_models(os.path.join(tmp, "models"))
        write_mtp_model(os.path.join(tmp, "models"))
        write_deepseek_model(os.path.join(tmp, "models"))
        with tarfile.open(archive, "w:xz") as tar:
            tar.add(os.path.join(tmp, "models"), arcname="models")
    print(f"wrote {archive} ({os.path.getsize(archive)} bytes)", file=sys.stderr)
    return 0


def _run(run, name, models, runs_dir, wl, flags, timeout, env=None):
    """run.run_config, the engine's log saved beside its result; a timeout is a failed run."""
    try:
        r = run.run_config(name, models, runs_dir, wl, flags, timeout=timeout, env_overrides=env)
    except subprocess.TimeoutExpired as exc:
        err = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else exc.output or ""
        r = run.Run(
            name, f"{name}-{flags[0].lstrip('-')}", None, timeout, -9, f"timed out after {timeout:.0f} s\n{err}"
        )
    with open(os.path.join(runs_dir, f"{r.tag}.log"), "w") as fh:
        fh.write(r.log)
    print(f"{r.tag}: {r.seconds:.0f} s, rc {r.returncode}", flush=True)
    return r


def _stack(stack_dir: str) -> tuple[str, dict]:
    sys.path.insert(0, os.path.dirname(BENCH))
    import gpu_stack

    return gpu_stack.unpack(stack_dir, os.path.join(REPO, ".gpu-stack-unpacked"))


def _child_environment(tree: str, manifest: dict, dry_run: bool) -> None:
    """The environment every engine process inherits (run_config copies os.environ)."""
    import importlib.util

    missing = [m for m in manifest.get("stand_ins", []) if importlib.util.find_spec(m) is None]
    paths = [tree, *([ABSENT] if missing else []), SUPPORT, REPO]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p])
    os.environ["ZB_BENCH_STAND_INS"] = ",".join(missing)
    os.environ["NPU_STANDIN_DEVICE"] = "cpu" if dry_run else "cuda"
    os.environ[DRY_ENV] = "1" if dry_run else ""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["PYTHONUNBUFFERED"] = "1"
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # each run's log is its stderr (saved beside its result)
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # vLLM keeps HAS_TRITON with no active driver (docs/environments.md)
    else:
        os.environ.pop("TRITON_INTERPRET", None)  # compiled Triton kernels on the device
    sys.path[:0] = paths


def _reference_tokens(models: str, wl, out: str, timeout: float) -> dict:
    cmd = [sys.executable, BENCH, "--reference", models, json.dumps(wl.to_json()), out]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": proc.stderr[-3000:]}
    with open(out) as fh:
        return json.load(fh)


def reference_main(models: str, workload: str, out: str) -> int:
    """transformers' own Llama, greedy, on the target weights, on CUDA (what the sync engine run must generate)."""
    import torch
    from transformers import LlamaForCausalLM

    from zb_patch.check.engine.model import DTYPE, VOCAB
    from zb_patch.check.engine.workload import Workload

    wl = Workload(**json.loads(workload))
    device = "cpu" if os.environ.get(DRY_ENV) else "cuda"
    model = LlamaForCausalLM.from_pretrained(os.path.join(models, "target"), dtype=DTYPE).to(device).eval()
    tokens = {}
    with torch.no_grad():
        for i, (prompt, n) in enumerate(wl.requests(VOCAB)):
            ids = torch.tensor([prompt], device=device)
            gen = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
            tokens[str(i)] = gen[0, len(prompt) :].tolist()
    with open(out, "w") as fh:
        json.dump({"tokens": tokens, "matmul_precision": torch.get_float32_matmul_precision()}, fh)
    return 0


def _config_env(name: str) -> tuple[str, dict[str, str] | None]:
    """``NAME``, ``NAME~ID`` (ZB_PATCH_DISABLE=ID) or ``NAME@ID`` (ZB_PATCH_ENABLE=ID): the configuration of
    zb_patch.check.engine.run.CONFIGS and the environment set on top of its own."""
    for mark, variable in (("~", "ZB_PATCH_DISABLE"), ("@", "ZB_PATCH_ENABLE")):
        base, _, ids = name.partition(mark)
        if ids:
            return base, {variable: ids}
    return name, None


def _config_env_failures(name: str, result: dict) -> list[str]:
    """A ``NAME@ID`` run whose engine did not apply patch ID, or a ``NAME~ID`` run whose engine did: its figures would
    be another configuration's."""
    _, env = _config_env(name)
    if not env:
        return []
    report = (result.get("zb_patch_status") or {}).get("report") or {}
    applied = {i["id"] for i in report.get("items", []) if i.get("verdict") in ("applied", "already-applied")}
    ids = set(next(iter(env.values())).split(","))
    if "ZB_PATCH_ENABLE" in env and not ids <= applied:
        return [f"{name}: the engine did not apply {', '.join(sorted(ids - applied))} (applied: {sorted(applied)})"]
    if "ZB_PATCH_DISABLE" in env and ids & applied:
        return [f"{name}: the engine applied {', '.join(sorted(ids & applied))}, which it was run without"]
    return []


def summarize_repeats(probes: dict, configs: list[str]) -> dict:
    """Per configuration, over its repeats (``probes`` keyed "<config> #<n>"): the median of each run's figure and
    the spread (min, max) for device idle per step (median and p90 of each run), host time blocked in event waits
    per step, event waits per step by site, host ms per step, TPOT / ITL (median, p90) and output tokens / s."""
    out = {}
    for name in configs:
        runs = [p for label, p in probes.items() if label.rsplit(" #", 1)[0] == name and "steps" in p]
        if not runs:
            continue

        def spread(values):
            values = [v for v in values if isinstance(v, (int, float))]
            if not values:
                return None
            return {"median": round(statistics.median(values), 2), "min": min(values), "max": max(values)}

        sites: dict[str, list[float]] = collections.defaultdict(list)
        for p in runs:
            steps = p.get("steps") or 1
            for site, count in (p.get("event_waits", {}).get("sites") or {}).items():
                sites[site].append(count / steps)
        out[name] = {
            "repeats": len(runs),
            "idle_us_median": spread([p.get("device", {}).get("idle_us_median") for p in runs]),
            "idle_us_p90": spread([p.get("device", {}).get("idle_us_p90") for p in runs]),
            "idle_us_median_decode": spread([p.get("device", {}).get("idle_us_median_decode") for p in runs]),
            "idle_us_p90_decode": spread([p.get("device", {}).get("idle_us_p90_decode") for p in runs]),
            "blocked_ms_per_step": spread([p.get("host", {}).get("blocked_ms_per_step") for p in runs]),
            "event_waits_per_step_by_site": {site: spread(v) for site, v in sorted(sites.items())},
            "prep_syncs_after_first_step": spread([p.get("syncs", {}).get("prep_after_first_step") for p in runs]),
            "host_period_ms_median": spread([p.get("host", {}).get("period_ms_median") for p in runs]),
            **{
                field: spread([p.get("token_timing", {}).get(field) for p in runs])
                for field in ("tpot_ms_median", "tpot_ms_p90", "itl_ms_median", "itl_ms_p90", "output_tok_s")
            },
        }
    return out


def _finish(out: str, report: dict, failures: list[str], quiet: bool = False) -> int:
    report["failures"] = failures
    report["verdict"] = "FAIL" if failures else ("PARTIAL" if report.get("partial") else "OK")
    with open(os.path.join(out, "bench_engine_gpu.json"), "w") as fh:
        json.dump(report, fh, indent=1, default=str)
    text = render(report)
    with open(os.path.join(out, "bench_engine_gpu.md"), "w") as fh:
        fh.write(text + "\n")
    if not quiet:
        print(text)
    return 0 if not failures else 1


def render(report: dict) -> str:
    lines = ["# Engine e2e, CUDA standing in for the NPU (benchmarks/bench_engine_gpu.py)", ""]
    dev = report.get("device", {})
    stack = report.get("stack", {})
    lines.append(
        f"device: {dev.get('name') or dev.get('reason')}; stack: vllm-ascend {stack.get('release')} for "
        f"Python {stack.get('python')}; stand-ins: {report.get('stand_ins') or 'none'}; device time added per "
        f"forward: {report.get('device_ms', 0)} ms"
    )
    box = report.get("box", {})
    if box.get("missing"):
        lines.append(f"box lacks: {', '.join(box['missing'])}")
    if box.get("unmet"):
        lines.append(
            "declared requirements of carried packages the GPU machine does not meet (informational; the CPU "
            "simulation runs with the same kind):"
        )
        lines += [f"- {u}" for u in box["unmet"]]
    if "table" in report:
        lines += ["", "## (a) tokens and counts", "", "```", report["table"], "```"]
        for n, divs in report.get("vs_transformers", {}).items():
            lines.append(
                f"- {n} vs transformers greedy (same device): {len(divs)} requests differ"
                + (f" (first: {divs[0]})" if divs else "")
            )
        lines += [f"- note: {n}" for n in report.get("notes", [])]
    summary = report.get("repeats", {})
    if summary:
        lines += ["", "## Over the repeats: median [min..max] of each run's figure", ""]
        lines.append(
            "| config | runs | TPOT ms, median over requests | ITL ms, median | output tok / s | host ms / step | "
            "device idle us / step, median | device idle us / step, p90 | device idle us / decode step, median | "
            "device idle us / decode step, p90 | blocked in event waits ms / step | unexpected syncs in prep after "
            "step 0 | event waits / step by site |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for n, a in summary.items():
            sites = "; ".join(f"{site} {_spread(v)}" for site, v in a["event_waits_per_step_by_site"].items())
            lines.append(
                f"| {n} | {a['repeats']} | {_spread(a.get('tpot_ms_median'))} | {_spread(a.get('itl_ms_median'))} | "
                f"{_spread(a.get('output_tok_s'))} | {_spread(a.get('host_period_ms_median'))} | "
                f"{_spread(a['idle_us_median'])} | {_spread(a['idle_us_p90'])} | "
                f"{_spread(a.get('idle_us_median_decode'))} | {_spread(a.get('idle_us_p90_decode'))} | "
                f"{_spread(a['blocked_ms_per_step'])} | {_spread(a['prep_syncs_after_first_step'])} | {sites or '-'} |"
            )
    probes = report.get("probes", {})
    if probes:
        lines += ["", "## (b) synchronisation per step, (c) time per step", ""]
        lines.append(
            "| run | steps | unexpected syncs in prep: all (steps with any) / after step 0 | other CUDA syncs / step | "
            "event waits / step (classic in prep, zb-wait) | host ms / step median (p90) | prep ms | execute_model ms "
            "| sample ms | blocked in waits ms / step mean (p90) | device idle us / step median (p90) | idle % | "
            "TPOT ms median (p90) | ITL ms median (p90) | output tok / s (tokens, s) |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for n, p in probes.items():
            if "error" in p and "steps" not in p:
                lines.append(f"| {n} | failed: {p['error'][:200]} |")
                continue
            s = p.get("syncs", {})
            ev = p.get("event_waits", {})
            h = p.get("host", {})
            d = p.get("device", {})
            t = p.get("token_timing", {})
            lines.append(
                f"| {n} | {p.get('steps')} | {s.get('prep_total', 0)} ({s.get('prep_steps', 0)}) / "
                f"{s.get('prep_after_first_step', '-')} | {s.get('other_per_step', 0):.2f} | "
                f"{ev.get('per_step', 0):.2f} ({ev.get('prep_per_step', 0):.2f}, "
                f"{ev.get('zb_wait_per_step', 0):.2f}) | "
                f"{h.get('period_ms_median', '-')} ({h.get('period_ms_p90', '-')}) | {h.get('prep_ms_median', '-')} | "
                f"{h.get('execute_model_ms_median', '-')} | {h.get('sample_ms_median', '-')} | "
                f"{h.get('blocked_ms_per_step', '-')} ({h.get('blocked_ms_p90', '-')}) | "
                f"{d.get('idle_us_median', '-')} ({d.get('idle_us_p90', '-')}) | {d.get('idle_pct', '-')} | "
                f"{t.get('tpot_ms_median', '-')} ({t.get('tpot_ms_p90', '-')}) | "
                f"{t.get('itl_ms_median', '-')} ({t.get('itl_ms_p90', '-')}) | "
                f"{t.get('output_tok_s', '-')} ({t.get('output_tokens', '-')}, {t.get('generate_s', '-')}) |"
            )
        for n, p in probes.items():
            first = p.get("first_corrected_step")
            if first:
                lines.append(
                    f"- {n}: first corrected step (#{first['index']}): execute_model {first['execute_model_ms']} ms; "
                    f"later corrected steps: median {first['later_median_ms']} ms"
                )
            for site, count in (p.get("syncs", {}).get("prep_sites") or {}).items():
                lines.append(f"- {n}: unexpected sync in prep x{count}: {site}")
            if p.get("runner_error"):
                lines.append(
                    f"- {n}: runner error (the sync-debug error when --sync-debug error): {p['runner_error'][-600:]}"
                )
    lines += ["", f"Verdict: {report.get('verdict')}"] + [f"- FAIL {f[:2000]}" for f in report.get("failures", [])]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# engine child (started by run_config: run.CHILD_ENV names this file)


def child_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--bench", action="store_true", help="instrument the run (options in ZB_BENCH_* variables)")
    ap.add_argument("--warmup", action="store_true", help="just run (fills Triton's kernel cache)")
    args, rest = ap.parse_known_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import npu_engine

    npu_engine.install()
    from zb_patch.check.engine import child

    if os.environ.get(NO_START_COMPILE_ENV) == "1":
        from zb_patch.versions import ascend_0_13, ascend_0_18

        for zb in (ascend_0_13.ZERO_BUBBLE, ascend_0_18.ZERO_BUBBLE):
            zb.compile_kernels = lambda runner, st: None
    probes = None
    if args.bench:
        profile_from, profile_steps = (int(x) for x in os.environ.get(PROFILE_ENV, "0,0").split(","))
        probes = Probes(
            os.environ[PROBE_ENV],
            os.environ.get(SYNC_ENV, "off"),
            profile_from,
            profile_steps,
            float(os.environ.get(DEVICE_MS_ENV) or 0.0),
        )
    after_build = probes.install if probes else None
    if os.environ.get(INPUT_PREP_WAIT_ENV) == "1":
        if os.environ.get("ZB_PATCH") == "1":
            raise SystemExit(f"{INPUT_PREP_WAIT_ENV}=1 is an experiment on classic async scheduling, without ZB_PATCH")
        after_build = _chain(_add_input_prep_wait, after_build)
    return child.main(
        rest,
        llm_overrides=npu_engine.llm_overrides(rest),
        after_build=after_build,
        device=_device,
    )


def _chain(first, then):
    def both():
        out = first()
        return {**out, **then()} if then else out

    return both


def _add_input_prep_wait() -> dict:
    """vLLM's ``synchronize_input_prep`` protocol, which vllm-ascend 0.13's ``execute_model`` lacks, added alone to
    the release's runner: ``_update_states`` first waits for an event recorded after the previous step's
    ``_prepare_inputs`` queued its non-blocking host-to-device copies, so the reused pinned host buffers are not
    rewritten under a copy still queued (what zb-patch's ascend-0.13 adapter does with ``prepare_inputs_event``).
    Tells whether a classic async crash on the GPU machine (docs/benchmarks.md) is that race."""
    import torch
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    cls = NPUModelRunner
    update_states, prepare_inputs = cls._update_states, cls._prepare_inputs
    event = torch.cuda.Event()  # never recorded before the first step: synchronize() returns at once

    def _update_states(runner, *args, **kwargs):
        event.synchronize()
        return update_states(runner, *args, **kwargs)

    def _prepare_inputs(runner, *args, **kwargs):
        try:
            return prepare_inputs(runner, *args, **kwargs)
        finally:
            event.record()

    cls._update_states, cls._prepare_inputs = _update_states, _prepare_inputs
    return {"input_prep_wait": True}


def _device() -> dict:
    import torch

    if os.environ.get(DRY_ENV):
        return {"available": True, "name": "CPU (dry run: NPU on the CPU, Triton interpreted)", "count": 1}
    if not torch.cuda.is_available():
        return {"available": False, "reason": "torch.cuda.is_available() is False"}
    name = f"{torch.cuda.get_device_name(0)} (CUDA standing in for the NPU)"
    return {"available": True, "name": name, "count": torch.cuda.device_count(), "torch": torch.__version__}


class Probes:
    """Per-step instrumentation of the release's NPUModelRunner, installed once ``LLM(...)`` is built (zb-patch's
    wrappers are in place: these wrap them from outside) and finished when ``LLM.generate`` returns."""

    def __init__(self, path: str, sync_mode: str, profile_from: int, profile_steps: int, device_ms: float) -> None:
        self.path = path
        self.device_ms = device_ms
        self.spin_cycles = 0
        self.sync_mode = sync_mode
        self.profile_from, self.profile_steps = profile_from, profile_steps
        self.steps: list[dict] = []
        self.phase = "idle"
        self.thread = threading.get_ident()
        self.other_threads: collections.Counter = collections.Counter()
        self.other_sites: collections.Counter = collections.Counter()  # "phase: site" of syncs outside prep
        self.runner_error = ""
        self.profiler = None
        self.trace_path = os.path.splitext(path)[0] + "-trace.json"
        # (d): per request, [arrival (perf_counter), new tokens] of each engine output that carries tokens
        self.arrivals: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)
        self.generate_s: float | None = None

    # -- install ----------------------------------------------------------------------------------------------------

    def install(self) -> dict:
        import torch
        from vllm import LLM
        from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

        from npu_standin import runtime

        cls = NPUModelRunner
        cls.execute_model = self._wrap_execute(cls.execute_model)
        cls._update_states = self._wrap_phase(cls._update_states, "prep", arm_strict=True)
        # the runner method that runs the model: vllm-ascend 0.13 has its own, 0.18+ calls vLLM's _model_forward
        forward = (
            "_generate_process_reqs_hidden_states"
            if "_generate_process_reqs_hidden_states" in vars(cls)
            else "_model_forward"
        )
        if self.device_ms > 0:
            self.spin_cycles = _spin_cycles(self.device_ms)
            setattr(cls, forward, self._wrap_device_load(getattr(cls, forward)))
        setattr(cls, forward, self._wrap_phase(getattr(cls, forward), "forward", disarm_strict=True, after="post"))
        cls.sample_tokens = self._wrap_sample(cls.sample_tokens)
        zb = self._zero_bubble()
        if zb is not None:
            zb.exact_host_counts = self._wrap_phase(zb.exact_host_counts, "zb-wait", disarm_strict=True, restore=True)
        event_cls = runtime.resolve("Event")  # torch.cuda.Event as it was before vllm-ascend rebound the name
        event_cls.synchronize = self._wrap_event_sync(event_cls.synchronize)
        warnings.filterwarnings("always", message=SYNC_WARNING)
        self._showwarning = warnings.showwarning
        warnings.showwarning = self._on_warning
        LLM.generate = self._wrap_generate(LLM.generate)
        try:  # (d): where the engine core's outputs reach the front end (no TPOT figures if it moved)
            from vllm.v1.engine.output_processor import OutputProcessor

            OutputProcessor.process_outputs = self._wrap_process_outputs(OutputProcessor.process_outputs)
        except (ImportError, AttributeError):
            pass
        if self.profile_steps:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=self.profile_from, warmup=1, active=self.profile_steps, repeat=1),
                on_trace_ready=lambda prof: prof.export_chrome_trace(self.trace_path),
            )
            self.profiler.start()
        self.zb_active = zb is not None
        self.matmul_precision = torch.get_float32_matmul_precision()
        return {"bench_probe": self.path}

    def _zero_bubble(self):
        from zb_patch import plugin

        status = plugin.status()
        if status.get("state") != "applied":
            return None
        module = {"ascend-0.18": "ascend_0_18", "ascend-0.13": "ascend_0_13"}.get(str(status.get("adapter")))
        if module is None:
            return None
        import importlib

        return importlib.import_module(f"zb_patch.versions.{module}").ZERO_BUBBLE

    # -- sync debug ---------------------------------------------------------------------------------------------

    def _arm(self, mode: str) -> None:
        if self.sync_mode != "off":
            import torch

            torch.cuda.set_sync_debug_mode(mode)

    def _on_warning(self, message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):
            return self._showwarning(message, category, filename, lineno, file, line)
        if threading.get_ident() != self.thread:
            self.other_threads[_site(traceback.extract_stack())] += 1
            return None
        if self.steps:
            step = self.steps[-1]
            step["syncs"][self.phase] += 1
            if self.phase == "prep":
                step["prep_sites"].append(_site(traceback.extract_stack()))
            else:
                self.other_sites[f"{self.phase}: {_site(traceback.extract_stack())}"] += 1
        return None

    # -- wrappers -----------------------------------------------------------------------------------------------

    def _wrap_execute(self, original):
        probes = self

        def execute_model(runner, *args, **kwargs):
            import torch

            n = len(probes.steps)
            probes.thread = threading.get_ident()  # the thread that runs the model runner
            if probes.profiler is not None:
                probes.profiler.step()
            probes.steps.append(
                {"t0": time.perf_counter(), "syncs": collections.Counter(), "prep_sites": [], "waits": []}
            )
            probes.steps[n]["decode"] = _decode_only(args[0] if args else kwargs.get("scheduler_output"))
            probes.phase = "pre"
            if probes.sync_mode == "warn":
                probes._arm("warn")
            try:
                with torch.profiler.record_function(f"zb_bench_exec_{n}"):
                    return original(runner, *args, **kwargs)
            except BaseException:
                probes.runner_error = probes.runner_error or traceback.format_exc()
                probes.write()
                raise
            finally:
                probes._arm("default")
                probes.phase = "between"
                probes.steps[n]["t_exec_end"] = time.perf_counter()

        return execute_model

    def _wrap_phase(self, original, phase, arm_strict=False, disarm_strict=False, after=None, restore=False):
        probes = self

        def wrapped(*args, **kwargs):
            before = probes.phase
            probes.phase = phase
            if probes.steps and phase in ("prep", "forward"):
                probes.steps[-1][f"t_{phase}"] = time.perf_counter()
            strict = probes.sync_mode == "error"
            if strict and arm_strict:
                probes._arm("error")
            if strict and disarm_strict:
                probes._arm("default")
            try:
                return original(*args, **kwargs)
            finally:
                if restore:
                    probes.phase = before
                    if strict and before == "prep":
                        probes._arm("error")
                elif after:
                    probes.phase = after

        return wrapped

    def _wrap_device_load(self, original):
        cycles = self.spin_cycles

        def _model_forward(*args, **kwargs):
            import torch

            torch.cuda._sleep(cycles)  # on the current stream, ahead of the model's kernels: a longer forward
            return original(*args, **kwargs)

        return _model_forward

    def _wrap_sample(self, original):
        probes = self

        def sample_tokens(runner, *args, **kwargs):
            import torch

            probes.phase = "sample"
            t = time.perf_counter()
            if probes.sync_mode == "warn":
                probes._arm("warn")
            try:
                with torch.profiler.record_function(f"zb_bench_sample_{max(len(probes.steps) - 1, 0)}"):
                    return original(runner, *args, **kwargs)
            finally:
                probes._arm("default")
                probes.phase = "idle"
                if probes.steps:
                    probes.steps[-1]["sample_s"] = probes.steps[-1].get("sample_s", 0.0) + time.perf_counter() - t

        return sample_tokens

    def _wrap_event_sync(self, original):
        probes = self

        def synchronize(event):
            t = time.perf_counter()
            try:
                return original(event)
            finally:
                if threading.get_ident() == probes.thread and probes.steps and probes.phase != "idle":
                    caller = traceback.extract_stack(limit=2)[0]
                    probes.steps[-1]["waits"].append((probes.phase, caller.name, time.perf_counter() - t))

        return synchronize

    def _wrap_generate(self, original):
        probes = self

        def generate(llm, *args, **kwargs):
            t = time.perf_counter()
            try:
                return original(llm, *args, **kwargs)
            finally:
                probes.generate_s = time.perf_counter() - t
                probes.finish()

        return generate

    def _wrap_process_outputs(self, original):
        probes = self

        def process_outputs(processor, *args, **kwargs):
            t = time.perf_counter()
            outputs = args[0] if args else kwargs.get("engine_core_outputs", ())
            for out in outputs:
                n = len(getattr(out, "new_token_ids", None) or ())
                if n:
                    probes.arrivals[str(out.request_id).split("-")[0]].append((t, n))
            return original(processor, *args, **kwargs)

        return process_outputs

    # -- results ------------------------------------------------------------------------------------------------

    def finish(self) -> None:
        self._arm("default")
        warnings.showwarning = self._showwarning
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
        self.write()

    def write(self) -> None:
        data = {"summary": self.summary(), "steps": [_jsonable(s) for s in self.steps]}
        with open(self.path, "w") as fh:
            json.dump(data, fh, default=str)
        if os.path.isfile(self.trace_path):  # read by summary(); kept compressed (chrome://tracing reads .json.gz)
            with open(self.trace_path, "rb") as src, gzip.open(self.trace_path + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(self.trace_path)

    def summary(self) -> dict:
        steps = self.steps
        n = len(steps)
        out: dict = {"steps": n, "sync_debug": self.sync_mode, "zb_patch_active": getattr(self, "zb_active", None)}
        out["device_ms"], out["spin_cycles"] = self.device_ms, self.spin_cycles
        out["matmul_precision"] = getattr(self, "matmul_precision", None)
        if self.runner_error:
            out["runner_error"] = self.runner_error[-4000:]
        if not n:
            return out
        prep = [s["syncs"]["prep"] for s in steps]
        sites = collections.Counter(site for s in steps for site in s["prep_sites"])
        out["syncs"] = {
            "prep_total": sum(prep),
            "prep_steps": sum(1 for x in prep if x),
            # the first step builds the release's lazily cached tensors (e.g. vllm-ascend's attention mask, a pageable
            # host-to-device copy): once per process; every later step is what async scheduling repeats
            "prep_after_first_step": sum(prep[1:]),
            "prep_step_indices": [i for i, x in enumerate(prep) if x][:20],
            "prep_sites": dict(sites.most_common(10)),
            "by_phase": {p: sum(s["syncs"][p] for s in steps) for p in PHASES},
            "other_per_step": sum(s["syncs"][p] for s in steps for p in PHASES if p != "prep") / n,
            "other_threads": dict(self.other_threads.most_common(5)),
            "other_sites": dict(self.other_sites.most_common(5)),
        }
        waits = [w for s in steps for w in s["waits"]]
        by_site = collections.Counter(f"{phase}:{name}" for phase, name, _ in waits)
        out["event_waits"] = {
            "per_step": len(waits) / n,
            "prep_per_step": sum(1 for w in waits if w[0] == "prep") / n,
            "zb_wait_per_step": sum(1 for w in waits if w[0] == "zb-wait") / n,
            "sites": dict(by_site.most_common(10)),
            "seconds_by_phase": {p: round(sum(w[2] for w in waits if w[0] == p), 6) for p in {w[0] for w in waits}},
        }
        host_steps = [i for i in range(min(n, self.profile_from if self.profile_steps else n)) if i >= 3]
        periods = [steps[i + 1]["t0"] - steps[i]["t0"] for i in host_steps if i + 1 < n]
        preps = [s["t_forward"] - s["t0"] for s in (steps[i] for i in host_steps) if "t_forward" in s]
        execs = [s["t_exec_end"] - s["t0"] for s in (steps[i] for i in host_steps) if "t_exec_end" in s]
        blocked = [sum(w[2] for w in steps[i]["waits"]) for i in host_steps]
        out["host"] = {
            "steps_measured": f"{host_steps[0]}..{host_steps[-1]}" if host_steps else "none",
            "period_ms_median": _ms(periods),
            "period_ms_p90": _ms(periods, _p90),
            "period_ms_mean": _ms(periods, statistics.fmean),
            "prep_ms_median": _ms(preps),
            "execute_model_ms_median": _ms(execs),
            "sample_ms_median": _ms([steps[i].get("sample_s", 0.0) for i in host_steps]),
            "blocked_ms_per_step": _ms(blocked, statistics.fmean),
            "blocked_ms_p90": _ms(blocked, _p90),
        }
        # the first step that waits for the previous step's accepted counts is the first corrected one: zb-patch's
        # kernels launch there first (Triton compiles them there unless they were compiled at start-up)
        # (zb-patch's wait is its own phase; on 0.13 it also waits in prep for the input-preparation event, every step)
        zb_waits = [i for i, s in enumerate(steps) if any(w[0] == "zb-wait" for w in s["waits"])]
        corrected = zb_waits or [i for i, s in enumerate(steps) if any(w[0] == "prep" for w in s["waits"])]
        timed = [i for i in corrected if "t_exec_end" in steps[i]]
        if timed:
            execute = {i: steps[i]["t_exec_end"] - steps[i]["t0"] for i in timed}
            out["first_corrected_step"] = {
                "index": timed[0],
                "execute_model_ms": _ms([execute[timed[0]]]),
                "later_median_ms": _ms([execute[i] for i in timed[1:]]),
            }
        if os.path.isfile(self.trace_path):
            out["device"] = device_idle(self.trace_path, {i for i, s in enumerate(steps) if s.get("decode")})
        out["token_timing"] = token_timing(self.arrivals, self.generate_s)
        return out


def token_timing(arrivals: dict, generate_s: float | None) -> dict:
    """(d) from each request's ``[(arrival, new tokens), ...]``: TPOT per request (last arrival - first) / (tokens
    - 1), median / p90 / mean over the requests with two tokens or more; ITL, the gaps between a request's successive
    outputs; output tokens per second of the ``generate`` call."""
    tpot, gaps, total = [], [], 0
    for outs in arrivals.values():
        n = sum(c for _, c in outs)
        total += n
        if n >= 2 and len(outs) >= 2:
            tpot.append((outs[-1][0] - outs[0][0]) / (n - 1))
        gaps += [b[0] - a[0] for a, b in zip(outs, outs[1:])]
    return {
        "source": "engine outputs' arrival per request (OutputProcessor.process_outputs), host clock",
        "requests": len(arrivals),
        "output_tokens": total,
        "generate_s": round(generate_s, 4) if generate_s is not None else None,
        "output_tok_s": round(total / generate_s, 1) if generate_s else None,
        "tpot_ms_median": _ms(tpot),
        "tpot_ms_p90": _ms(tpot, _p90),
        "tpot_ms_mean": _ms(tpot, statistics.fmean),
        "itl_ms_median": _ms(gaps),
        "itl_ms_p90": _ms(gaps, _p90),
        "tokens_per_output": round(total / max(1, sum(len(o) for o in arrivals.values())), 3),
    }


def _decode_only(scheduler_output) -> bool | None:
    """Whether a step is a pure decode step: no new request, every scheduled request computes its last token and its
    drafts (no prompt chunk, no recomputation after a preemption). None when it cannot tell."""
    try:
        if scheduler_output.scheduled_new_reqs or not scheduler_output.total_num_scheduled_tokens:
            return False
        spec = scheduler_output.scheduled_spec_decode_tokens or {}
        return all(n == 1 + len(spec.get(r, ())) for r, n in scheduler_output.num_scheduled_tokens.items())
    except AttributeError:
        return None


def device_idle(trace_path: str, decode_steps: set[int] | None = None) -> dict:
    """Per profiled step: the step period (start of ``zb_bench_exec_<n>`` to the next one, host clock) minus the union
    of device activity (kernels, memcpy, memset) inside it. Kineto puts host and device events on one clock. The
    ``_decode`` figures: the steps in ``decode_steps`` only (pure decode steps)."""
    with open(trace_path) as fh:
        events = json.load(fh)["traceEvents"]
    starts = sorted(
        (e["ts"], int(e["name"].rsplit("_", 1)[1]))
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name", "").startswith("zb_bench_exec_")
    )
    busy = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    idle, periods, decode = [], [], []
    for (t0, step), (t1, _) in zip(starts, starts[1:]):
        covered, cursor = 0.0, t0
        for b0, b1 in busy:
            if b1 <= cursor or b0 >= t1:
                continue
            lo, hi = max(b0, cursor), min(b1, t1)
            if hi > lo:
                covered += hi - lo
                cursor = hi
        periods.append(t1 - t0)
        idle.append(t1 - t0 - covered)
        if decode_steps and step in decode_steps:
            decode.append(t1 - t0 - covered)
    if not idle:
        return {"steps": 0}
    per_decode = {
        "decode_steps": len(decode),
        "idle_us_median_decode": round(statistics.median(decode), 1) if decode else None,
        "idle_us_p90_decode": round(_p90(decode), 1) if decode else None,
    }
    return {
        "steps": len(idle),
        "steps_profiled": f"{starts[0][1]}..{starts[-1][1]}",
        "idle_us_median": round(statistics.median(idle), 1),
        "idle_us_p90": round(_p90(idle), 1),
        "period_us_median": round(statistics.median(periods), 1),
        "idle_pct": round(100.0 * sum(idle) / sum(periods), 1),
        "device_events": len(busy),
        **per_decode,
    }


def _site(stack) -> str:
    """The innermost frames of the engine's code (vLLM, vllm-ascend, zb-patch, the emulation) of a stack."""
    engine = ("vllm", "zb_patch", "npu_ops", "npu_standin", "npu_graphs")
    keep = [f for f in stack if any(k in f.filename for k in engine)]
    keep = [f for f in keep if not f.filename.endswith("bench_engine_gpu.py")][-3:]
    return " < ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(keep)) or "?"


def _short(path: str) -> str:
    for marker in ("/vllm_ascend/", "/vllm/", "/zb_patch/", "/tests/support/"):
        if marker in path:
            return marker.strip("/") + "/" + path.split(marker, 1)[1]
    return path


def _spin_cycles(ms: float) -> int:
    """Cycles of torch.cuda._sleep that take ``ms`` on this device (measured once with CUDA events)."""
    import torch

    from npu_standin import runtime

    event = runtime.resolve("Event")  # torch.cuda.Event (vllm-ascend rebinds the torch.cuda name)
    probe = 20_000_000
    torch.cuda._sleep(probe // 10)  # warm the kernel
    start, end = event(enable_timing=True), event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return max(1, int(probe * ms / start.elapsed_time(end)))


def _p90(values):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _spread(v: dict | None) -> str:
    return "-" if v is None else f"{v['median']:g} [{v['min']:g}..{v['max']:g}]"


def _ms(values, fn=statistics.median):
    return round(1000.0 * fn(values), 3) if values else None


def _jsonable(step: dict) -> dict:
    return {k: (dict(v) if isinstance(v, collections.Counter) else v) for k, v in step.items()}


if __name__ == "__main__":
    if "--reference" in sys.argv:
        i = sys.argv.index("--reference")
        sys.exit(reference_main(*sys.argv[i + 1 : i + 4]))
    if {"--bench", "--check-device", "--warmup"} & set(sys.argv[1:]):
        sys.exit(child_main(sys.argv[1:]))
    sys.exit(main(sys.argv[1:]))
