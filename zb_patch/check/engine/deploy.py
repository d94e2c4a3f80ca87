"""``zb-patch selftest --engine --model PATH ... -- <vLLM engine arguments>``: the engine self-test on the operator's
own model and engine arguments.

The tiny-model self-test (:func:`.run.run_engine_selftest`, the strict check) first, then each configuration of
``--configs`` in its own engine process (:func:`.child.run_model`, each ``--repeats`` times), then the verdict of
:mod:`.model_verdict` and a report (markdown + JSON). Progress goes through zb-patch's logger (:data:`LOGGER`, a
child of vLLM's: the CLI's handler writes it to stderr); stdout carries the report only.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import model_verdict
from .run import CONFIGS as TINY_CONFIGS
from .run import LOGGER, Run, _tail, _versions, check_device, child_command, stop_reason

SCHEMA = "zb-patch-selftest-engine-model/1"
DEFAULT_CONFIGS = ("async+fixes", "async+fixes", "async+zb")
FIXED_CONFIGS = ("sync", "async", "async+fixes", "async+zb")
OPT_IN_PREFIX = model_verdict.OPT_IN_PREFIX
GENERATED_PROMPT_TOKENS = (16, 256)  # generated prompts: this many token ids, uniformly, seeded


def config_env(name: str) -> tuple[list[str], dict[str, str]]:
    """The child flags and environment of configuration ``name`` (``async+zb+<id>``: ZB_PATCH=1 with
    ``ZB_PATCH_ENABLE=<id>``)."""
    if name in TINY_CONFIGS:
        flags, env = TINY_CONFIGS[name]
        return list(flags), dict(env)
    if name.startswith(OPT_IN_PREFIX) and len(name) > len(OPT_IN_PREFIX):
        return ["--async"], {"ZB_PATCH": "1", "ZB_PATCH_ENABLE": name[len(OPT_IN_PREFIX) :]}
    raise ValueError(f"unknown configuration {name!r}: one of {', '.join(FIXED_CONFIGS)} or {OPT_IN_PREFIX}<opt-in id>")


def run_names(configs: Sequence[str]) -> list[str]:
    """The runs of ``configs`` in order, a configuration named again getting ``#2``, ``#3``...; ValueError unless
    async+fixes is named twice (the noise floor) and every name is a configuration."""
    names: list[str] = []
    seen: dict[str, int] = {}
    for c in configs:
        config_env(c)
        seen[c] = seen.get(c, 0) + 1
        names.append(c if seen[c] == 1 else f"{c}#{seen[c]}")
    if seen.get(model_verdict.REFERENCE, 0) < 2:
        raise ValueError(f"--configs must name {model_verdict.REFERENCE} twice (the noise floor)")
    return names


def load_prompts(path: str | None, num: int, vocab: int, seed: int = 0, max_len: int | None = None) -> list[dict]:
    """``[{"id", "prompt" | "prompt_token_ids"}]``: from ``path`` (a line per prompt, or JSONL with ``"prompt"``;
    ``num`` of them, 0 = all) or, without a file, ``num`` prompts of random token ids (seeded, ids in
    ``[3, 0.9 * vocab)``: clear of the special ids at either end of common vocabularies)."""
    if path:
        with open(path) as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        prompts: list[dict] = []
        for line in lines:
            text = line
            if line.lstrip().startswith("{"):
                text = json.loads(line)["prompt"]
            prompts.append({"id": str(len(prompts)), "prompt": text})
        return prompts[:num] if num else prompts
    rng = random.Random(seed)
    lo, hi = GENERATED_PROMPT_TOKENS
    if max_len is not None:
        hi = max(lo, min(hi, max_len))
    top = max(4, int(0.9 * vocab))
    return [
        {"id": str(i), "prompt_token_ids": [rng.randrange(3, top) for _ in range(rng.randint(lo, hi))]}
        for i in range(num)
    ]


def model_config(model: str) -> dict:
    """``model``'s config.json."""
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)


def model_vocab(model: str) -> int:
    """The vocabulary size in ``model``'s config.json (or its ``text_config``)."""
    config = model_config(model)
    return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))


@dataclass
class Setup:
    """What every run of one ``--model`` self-test shares."""

    model: str
    engine_args: list[str]
    speculative_config: str
    prompts_file: str
    max_tokens: int
    out_dir: str
    timeout: float = 7200.0


def run_model_config(
    name: str, setup: Setup, tag: str, extra_args: Sequence[str] = (), env_overrides: dict[str, str] | None = None
) -> Run:
    """One engine process of configuration ``name`` (a run name: ``#n`` suffixes are dropped), its result in
    ``<out_dir>/<tag>.json``; ``extra_args`` go to the child (the tests' launcher takes its plants there)."""
    flags, extra_env = config_env(name.split("#")[0])
    out = os.path.join(setup.out_dir, f"{tag}.json")
    drop = ("ZB_PATCH", "ZB_PATCH_DISABLE", "ZB_PATCH_ENABLE", "ZB_SELFTEST_ENGINE_CHILD")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra_env)
    env.update(env_overrides or {})
    cmd = [*child_command(), "--model", setup.model, "--out", out, "--prompts-file", setup.prompts_file]
    cmd += ["--max-tokens", str(setup.max_tokens), "--engine-args", json.dumps(setup.engine_args)]
    if setup.speculative_config:
        cmd += ["--speculative-config", setup.speculative_config]
    start = time.monotonic()
    proc = subprocess.run(
        [*cmd, *flags, *extra_args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=setup.timeout,
    )
    result = None
    if proc.returncode == 0:
        with open(out) as f:
            result = json.load(f)
    return Run(name, tag, result, time.monotonic() - start, proc.returncode, proc.stdout)


DP_FLAGS = ("--data-parallel-size", "-dp")


def split_data_parallel(engine_args: list[str]) -> tuple[int, list[str]]:
    """(data-parallel size, the engine arguments without it): each rank runs as vLLM's offline data-parallel form
    (one engine process per rank, ``VLLM_DP_*`` in its environment), so the size leaves the ranks' arguments; the
    other ``--data-parallel-*`` arguments (a server's) are refused."""
    size, rest, i = 1, [], 0
    while i < len(engine_args):
        arg = engine_args[i]
        name, eq, value = arg.partition("=")
        if name in DP_FLAGS:
            if not eq:
                i += 1
                value = engine_args[i] if i < len(engine_args) else ""
            size = int(value)
        elif arg.startswith("--data-parallel"):
            raise ValueError(f"{name}: only --data-parallel-size is taken (each rank is an engine process here)")
        else:
            rest.append(arg)
        i += 1
    return size, rest


def rank_env(rank: int, size: int, port: int, devices_per_rank: int) -> dict[str, str]:
    """vLLM's offline data-parallel environment of ``rank``, and the NPUs it sees: the rank's ``devices_per_rank``
    of the visible ones (``ASCEND_RT_VISIBLE_DEVICES`` as set, else 0..), as vllm-ascend's worker takes device
    ``npu:<local rank>`` within them."""
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(size * devices_per_rank)]
    mine = ids[rank * devices_per_rank : (rank + 1) * devices_per_rank]
    return {
        "VLLM_DP_RANK": str(rank),
        "VLLM_DP_RANK_LOCAL": str(rank),
        "VLLM_DP_SIZE": str(size),
        "VLLM_DP_MASTER_IP": "127.0.0.1",
        "VLLM_DP_MASTER_PORT": str(port),
        "ASCEND_RT_VISIBLE_DEVICES": ",".join(mine),
    }


def run_ranks(name: str, setup: Setup, tag: str, size: int, devices_per_rank: int, extra_args=()) -> Run:
    """``size`` engine processes of ``name`` together, one per data-parallel rank, each with every ``size``-th
    prompt (rank r: prompts r, r + size, ...); one Run with the ranks' results merged (:func:`merge_ranks`)."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    if size == 1:
        return run_model_config(name, setup, tag, extra_args)
    with open(setup.prompts_file) as f:
        prompts = json.load(f)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    jobs = []
    for rank in range(size):
        path = os.path.join(setup.out_dir, f"{tag}-dp{rank}-prompts.json")
        with open(path, "w") as f:
            json.dump(prompts[rank::size], f)
        rank_setup = Setup(**{**vars(setup), "prompts_file": path})
        env = rank_env(rank, size, port, devices_per_rank)
        jobs.append(lambda s=rank_setup, r=rank, e=env: run_model_config(name, s, f"{tag}-dp{r}", extra_args, e))
    with ThreadPoolExecutor(max_workers=size) as pool:
        runs = list(pool.map(lambda job: job(), jobs))
    failed = [r for r in runs if r.result is None]
    log = "\n".join(f"--- rank {i} (rc {r.returncode}) ---\n{r.log}" for i, r in enumerate(runs))
    seconds = max(r.seconds for r in runs)
    if failed:
        return Run(name, tag, None, seconds, failed[0].returncode, log)
    return Run(name, tag, merge_ranks([r.result for r in runs]), seconds, 0, log)


def merge_ranks(results: list[dict]) -> dict:
    """One result of the data-parallel ranks' results: per-request fields joined (request ids are global), steps
    listed rank after rank, counts summed, zero-bubble active only if active on every rank, rank 0's statuses."""
    merged = dict(results[0])
    for field in ("tokens", "prompt_tokens", "metrics", "drafted", "accepted", "preemptions", "drafted_in_prefill",
                  "accepted_in_prefill", "verifications", "preempted_at"):  # fmt: skip
        merged[field] = {k: v for res in results for k, v in res.get(field, {}).items()}
    for field in ("drafted_per_pos", "accepted_per_pos"):
        merged[field] = [sum(x) for x in zip(*(res.get(field, []) for res in results))]
    merged["steps"] = [dict(step, rank=i) for i, res in enumerate(results) for step in res.get("steps", [])]
    merged["generate_seconds"] = max(res.get("generate_seconds") or 0.0 for res in results)
    merged["scheduling"] = {
        "scheduler": results[0]["scheduling"]["scheduler"],
        **{k: sum(res["scheduling"][k] for res in results) for k in ("steps", "overlapped", "after_drafts")},
    }
    zbs = [res["zero_bubble"] for res in results]
    merged["zero_bubble"] = dict(zbs[0])
    for key in ("steps", "corrected_steps", "host_waits", "fallback_uploads"):
        if all(key in z for z in zbs):
            merged["zero_bubble"][key] = sum(z[key] for z in zbs)
    merged["zero_bubble"]["active"] = all(z.get("active") for z in zbs)
    if not merged["zero_bubble"]["active"]:
        merged["zero_bubble"]["reason"] = "; ".join(
            f"rank {i}: {z.get('reason')}" for i, z in enumerate(zbs) if not z.get("active")
        )
    for field in ("graph_replays", "host_drains", "task_group_updates"):
        total: dict[str, int] = {}
        for res in results:
            for k, v in res.get(field, {}).items():
                total[k] = total.get(k, 0) + v
        merged[field] = total
    merged["graphs_captured"] = min(res.get("graphs_captured", 0) for res in results)
    merged["workers"] = [w for res in results for w in res.get("workers", [])]
    merged["ranks"] = len(results)
    return merged


def tiny_check_args(speculative_config: dict | None, graph_mode: str, model_type: str = "") -> dict:
    """The tiny-model self-test matching the deployment: its drafter (an MTP method: ``deepseek-mtp`` for a DeepSeek
    model type, else ``mtp``; every other method: ``eagle``), k, and the graph mode (PIECEWISE / FULL_DECODE_ONLY
    as asked; every other mode: eager)."""
    spec = speculative_config or {}
    method = str(spec.get("method", "eagle"))
    drafter = ("deepseek-mtp" if model_type.startswith("deepseek") else "mtp") if "mtp" in method else "eagle"
    return {"ks": [int(spec.get("num_speculative_tokens", 2))], "drafter": drafter, "graph_mode": graph_mode}


def describe_engine_args(model: str, engine_args: list[str], timeout: float = 600.0) -> dict:
    """The engine arguments parsed by vLLM's parser in a child process (where vLLM and the platform import):
    :func:`.child.describe_engine_args`'s answer; ValueError with vLLM's or the self-test's refusal."""
    cmd = [*child_command(), "--describe-engine-args", "--model", model, "--engine-args", json.dumps(engine_args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    try:
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        why = f"the engine arguments could not be parsed (rc {proc.returncode}): {_tail(proc.stderr, 800)}"
        raise ValueError(why) from None
    if not answer["ok"]:
        raise ValueError(answer["error"])
    return answer


def run_model_selftest(args, log: logging.Logger = LOGGER) -> dict:
    """The whole ``--model`` self-test; returns the report (:data:`SCHEMA`); progress lines go to ``log``."""
    from .run import run_engine_selftest
    from .workload import Workload

    engine_args = list(args.engine_args or [])
    speculative = json.loads(args.speculative_config) if args.speculative_config else None
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "versions": _versions(),
        "model": args.model,
        "speculative_config": speculative,
        "engine_args": engine_args,
        "configs": list(args.configs),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "greedy": True,
        "margins": {"requests": model_verdict.REQUEST_MARGIN, "acceptance": model_verdict.ACCEPTANCE_MARGIN},
    }
    try:
        names = run_names(args.configs)
        dp, rank_args = split_data_parallel(engine_args)
    except ValueError as exc:
        report.update(verdict="REFUSED", failures=[str(exc)])
        return report
    device = check_device()
    report["device"] = device
    if not device["available"]:
        report.update(verdict="NO-DEVICE", failures=[f"no NPU: {device.get('reason', '')}"])
        return report
    try:
        ea = describe_engine_args(args.model, rank_args)
    except ValueError as exc:
        report.update(verdict="REFUSED", failures=[str(exc)])
        return report
    graph_mode = ea["graph_mode"]
    report["graph_mode_of_tiny_check"] = graph_mode
    report["data_parallel_size"] = dp
    root = args.report or tempfile.mkdtemp(prefix="zb-patch-model-")
    runs_dir = os.path.join(root, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    tiny = None
    if args.skip_tiny_check:
        report["tiny"] = {"verdict": "NOT-RUN", "reason": "--skip-tiny-check"}
        log.info("zb-patch selftest --engine --model: tiny-model strict check skipped (--skip-tiny-check)")
    else:
        log.info("zb-patch selftest --engine --model: tiny-model strict check (exact rules) first")
        t = tiny_check_args(speculative, graph_mode, str(model_config(args.model).get("model_type", "")))
        tiny = run_engine_selftest(
            Workload(),
            t["ks"],
            parallel=getattr(args, "jobs", 1),
            keep=os.path.join(root, "tiny"),
            log=log,
            drafter=t["drafter"],
            classic=False,
            graph_mode=t["graph_mode"],
        )
        report["tiny"] = {k: tiny.get(k) for k in ("verdict", "failures", "drafter", "graph_mode")} | {"k": t["ks"]}
        log.info("zb-patch selftest --engine --model: tiny-model strict check: %s", tiny["verdict"])
    max_len = ea["max_model_len"] - args.max_tokens if ea["max_model_len"] else None
    prompts = load_prompts(args.prompts, args.num_prompts, model_vocab(args.model), max_len=max_len)
    prompts_file = os.path.join(root, "prompts.json")
    with open(prompts_file, "w") as f:
        json.dump(prompts, f)
    report["prompts"] = {"source": args.prompts or "generated token ids", "count": len(prompts)}
    if len(prompts) < dp:
        report.update(verdict="REFUSED", failures=[f"{len(prompts)} prompts for {dp} data-parallel ranks"])
        return report
    setup = Setup(args.model, rank_args, args.speculative_config or "", prompts_file, args.max_tokens, runs_dir)
    per_rank = ea["tensor_parallel_size"] * ea["pipeline_parallel_size"]
    results: dict[str, dict] = {}
    figures: dict[str, list[dict]] = {}
    report["runs"] = {}
    crashed = []
    for repeat in range(1, args.repeats + 1):
        for name in names:
            tag = name.replace("#", "-") + (f"-r{repeat}" if args.repeats > 1 else "")
            log.info("zb-patch selftest --engine --model: run %s starting", tag)
            run = run_ranks(name, setup, tag, dp, per_rank, getattr(args, "child_args", ()) or ())
            log.info("zb-patch selftest --engine --model: run %s: %.0f s, rc %d", tag, run.seconds, run.returncode)
            entry: dict[str, Any] = {"name": name, "repeat": repeat, "seconds": round(run.seconds, 1)}
            entry["returncode"] = run.returncode
            if run.result is None:
                entry["error"] = stop_reason(run.log)
                crashed.append(f"{tag}: engine process failed (rc {run.returncode}): {_tail(run.log, 800)}")
            else:
                entry["summary"] = summary(run.result)
                entry["speed"] = model_verdict.speed(run.result)
                figures.setdefault(name.split("#")[0], []).append(entry["speed"])
                if repeat == 1:
                    results[name] = run.result
            report["runs"][tag] = entry
    report["speed"] = {c: model_verdict.speed_over_repeats(f) for c, f in figures.items()}
    if crashed or not all(n in results for n in names):
        report.update(verdict="FAIL", failures=crashed or ["a run left no result"], notes=[])
    else:
        report.update(model_verdict.judge(results, tiny))
    report["results"] = root
    return report


def summary(res: dict) -> dict:
    drafted, accepted = sum(res["drafted"].values()), sum(res["accepted"].values())
    return {
        "requests": len(res["tokens"]),
        "tokens": sum(len(t) for t in res["tokens"].values()),
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": round(accepted / drafted, 4) if drafted else 0.0,
        "preemptions": sum(res["preemptions"].values()),
        "steps": res["scheduling"]["steps"],
        "zero_bubble": res["zero_bubble"],
        "cudagraph_mode": res.get("cudagraph_mode"),
        "graph_replays": res.get("graph_replays", {}),
        "host_drains": res.get("host_drains", {}),
        "task_group_updates": res.get("task_group_updates", {}),
    }


def render(report: dict) -> str:
    """The markdown report."""
    lines = ["# zb-patch selftest --engine --model", ""]
    lines.append(f"- versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items())}")
    device = report.get("device", {})
    lines.append(f"- device: {device.get('name') or device.get('reason', 'not checked')} (count {device.get('count')})")
    lines.append(f"- model: `{report['model']}`")
    lines.append(f"- speculative config: `{json.dumps(report['speculative_config'])}`")
    lines.append(f"- engine arguments: `{' '.join(report['engine_args'])}`")
    lines.append(f"- configurations: {', '.join(report['configs'])}; repeats {report['repeats']}")
    if "prompts" in report:
        lines.append(f"- prompts: {report['prompts']['count']} ({report['prompts']['source']}), greedy, ")
        lines[-1] += f"{report['max_tokens']} output tokens each (ignore_eos)"
    margins = report["margins"]
    lines.append(
        f"- margins beyond a noise floor that is not exact: {margins['requests']:.0%} of the requests, "
        f"acceptance rate {margins['acceptance']}"
    )
    tiny = report.get("tiny")
    if tiny:
        if tiny["verdict"] == "NOT-RUN":
            lines.append(f"- tiny-model strict check: NOT RUN ({tiny['reason']})")
        else:
            lines.append(
                f"- tiny-model strict check: {tiny['verdict']} (drafter {tiny['drafter']}, k {tiny['k']}, "
                f"graph mode {tiny['graph_mode']})"
            )
    if report.get("runs"):
        lines += ["", "## Runs", ""]
        cols = ["run", "s", "tokens", "drafted", "accepted", "acceptance", "zero-bubble", "graph replays"]
        cols += ["TPOT ms", "ITL ms (p90)", "out tok/s"]
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for tag, e in report["runs"].items():
            if "summary" not in e:
                lines.append(f"| {tag} | {e['seconds']} | failed: {e.get('error', '')} |")
                continue
            s, sp = e["summary"], e["speed"]
            zb = s["zero_bubble"]
            zb_text = f"active, {zb.get('corrected_steps')} corrected" if zb.get("active") else zb.get("kind", "none")
            row = [tag, e["seconds"], s["tokens"], s["drafted"], s["accepted"], s["acceptance"], zb_text]
            row += [s["graph_replays"] or "-", sp["tpot_ms_median"], f"{sp['itl_ms_median']} ({sp['itl_ms_p90']})"]
            row += [sp["output_tokens_per_s"]]
            lines.append("| " + " | ".join(str(x) for x in row) + " |")
    if report.get("speed") and report["repeats"] > 1:
        lines += ["", "## Speed over repeats (median, [min, max])", ""]
        for c, sp in report["speed"].items():
            lines.append(
                f"- {c}: TPOT {sp['tpot_ms_median']} ms {sp['tpot_ms_median_spread']}, ITL {sp['itl_ms_median']} ms "
                f"{sp['itl_ms_median_spread']}, {sp['output_tokens_per_s']} tok/s {sp['output_tokens_per_s_spread']}"
            )
    floor = report.get("floor")
    if floor:
        lines += ["", "## Noise floor (async+fixes twice)", ""]
        lines.append(
            f"- exact: {floor['exact']}; diverging requests {len(floor['diverged'])} of {floor['requests']}; "
            f"acceptance {floor['acceptance']}; identical-schedule steps compared {floor['identical_schedule_steps']}, "
            f"with different outputs {len(floor['schedule_mismatches'])}"
        )
    for name, p in (report.get("pairs") or {}).items():
        lines.append(
            f"- {name} vs async+fixes: diverging requests {len(p['diverged'])} of {p['requests']}; acceptance "
            f"{p['acceptance']}; identical-schedule steps compared {p['identical_schedule_steps']}, with different "
            f"outputs {len(p['schedule_mismatches'])}"
        )
    if report.get("opt_in"):
        lines += ["", "## Opt-in patches", ""]
        lines += [f"- {pid}: {v['verdict']}" for pid, v in report["opt_in"].items()]
    lines += ["", "## Verdict", ""]
    lines += [f"- FAIL {f}" for f in report.get("failures", [])]
    lines += [f"- note {n}" for n in report.get("notes", [])]
    lines.append(f"\nVerdict: {report['verdict']}")
    return "\n".join(lines)


def run_cli(args) -> int:
    """``zb-patch selftest --engine --model``: progress through :data:`LOGGER` (stderr), the report on stdout
    (``--json``: the JSON object), both files under ``--report``."""
    report = run_model_selftest(args)
    text = render(report)
    if args.report:
        os.makedirs(args.report, exist_ok=True)
        with open(os.path.join(args.report, "report.json"), "w") as f:
            json.dump(report, f, indent=2)
        with open(os.path.join(args.report, "report.md"), "w") as f:
            f.write(text + "\n")
    print(json.dumps(report, indent=2) if args.json else text, file=args.out)
    return {"PASS": 0, "PASS-WITHOUT-STRICT-CHECK": 0, "FAIL": 1}.get(report["verdict"], 2)
