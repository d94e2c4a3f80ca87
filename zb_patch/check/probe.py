"""``zb-patch doctor --probe``: start a real (tiny) vLLM engine and report what zb-patch did in each process.

The most common way a patch layer fails in the field is process topology: the patch is active in the process
the user looked at but not in the EngineCore subprocess or in a forked / spawned worker, or it is applied
twice, or the switch never reaches a worker. The probe answers that question with the installed vLLM
itself, without guessing:

* it runs the smallest engine the installed vLLM allows in a child process (the *front end*): a 2-layer
  Llama with random weights, created from a ``config.json`` written to a temporary directory
  (``load_format="dummy"``, ``skip_tokenizer_init=True``: nothing is downloaded or read from disk), the
  multiprocess executor and the V1 EngineCore in its own process, async scheduling requested;
* the **front end** reports in-process (:func:`process_report`);
* every **worker** reports through vLLM's own ``collective_rpc``: the engine is started with
  ``worker_extension_cls="zb_patch.check.probe.ProbeWorkerExtension"``, whose one method returns
  :func:`process_report` from inside the worker;
* the **EngineCore** cannot run arbitrary code on request, so it reports through the one line zb-patch
  logs in every process (``zb-patch: pid=<pid> role=<role> ...``), read from the engine's output. vLLM's
  own line prefix (``(EngineCore pid=N) ...``) and the process tree confirm which process wrote it.

Every process of the engine (front end, EngineCore(s), workers; from the process tree and vLLM's process
objects) must then show: with ``ZB_PATCH=1``, exactly one decision of its own (one log line; an activation
that existed *before* the probe asked, under the process's own pid); with ``ZB_PATCH`` unset or ``0``, no
trace (no log line, no activation, no post-import hooks, no zb-patch module beyond the entry point).

Nothing here imports vLLM at module import time: this module is also what the workers import for the
extension class.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

PROBE_SCHEMA = "zb-patch-probe/1"
RESULT_SCHEMA = "zb-patch-probe-engine/1"

# exit codes (0 and 2 mean what they mean for `zb-patch doctor`)
EXIT_OK = 0  # every process agrees; zb-patch applied / native / off
EXIT_SETTINGS = 1  # invalid ZB_PATCH* settings
EXIT_REFUSED = 2  # ZB_PATCH=1 and zb-patch refused (or is not applicable) - the same in every process
EXIT_TOPOLOGY = 3  # a process of the engine disagrees: no decision, two decisions, stale state, env missing
EXIT_ENGINE = 4  # the engine did not start (other than a ZB_PATCH_STRICT refusal) or the probe timed out

# The tiny model: 2 layers, 2 heads of 64 (head_dim 16 is rejected by vLLM's CPU attention), vocab 256.
TINY_LLAMA: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
KV_CACHE_BYTES = 64 << 20  # explicit and tiny: no memory profiling, no large reservation
PROMPT = [1, 17, 33, 49, 65, 81, 97, 113]
MAX_TOKENS = 8

_ENV_KEYS_SHOWN = ("VLLM_PLUGINS", "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_ENABLE_V1_MULTIPROCESSING")


# ----------------------------------------------------------------------------------------------------
# Per-process report: runs inside every process of the engine (front end directly, workers via RPC)
# ----------------------------------------------------------------------------------------------------


def _zb_modules() -> list[str]:
    return sorted(m for m in list(sys.modules) if m == "zb_patch" or m.startswith("zb_patch."))


def process_report(reregister: bool = False) -> dict:
    """What zb-patch is and did in *this* process, JSON-able.

    Reads the state before touching it: ``decided_before_probe`` is whether this process had its own
    activation before anything here called :func:`zb_patch.plugin.status` (which adopts a forked parent's
    settings lazily). With ``reregister=True``, zb-patch's ``register()`` and vLLM's
    ``load_general_plugins()`` are called again afterwards and the report says whether that changed
    anything (it must not: registering twice in one process applies once).
    """
    import multiprocessing

    pid = os.getpid()
    rep: dict[str, Any] = {
        "pid": pid,
        "ppid": os.getppid(),
        "process_name": multiprocessing.current_process().name,
        # the method multiprocessing used to start this process (None for a process not started by it)
        "start_method": (
            multiprocessing.get_start_method(allow_none=True) if multiprocessing.parent_process() is not None else None
        ),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("ZB_PATCH") or k in _ENV_KEYS_SHOWN},
        "zb_patch_modules": _zb_modules(),
        "wrapt_imported": "wrapt" in sys.modules,
    }
    vplugins = sys.modules.get("vllm.plugins")
    rep["vllm_plugins_loaded"] = getattr(vplugins, "plugins_loaded", None)
    plugin = sys.modules.get("zb_patch.plugin")
    rep["entry_point_loaded"] = plugin is not None
    if plugin is None:
        # vLLM never imported zb-patch's entry point here (VLLM_PLUGINS excludes it, or no plugins loaded)
        rep["status"] = {"pid": pid, "state": "not-loaded"}
        rep["decided_before_probe"] = False
        rep["activation_pids"] = []
        rep["hooked_modules"] = []
        return rep
    acts = getattr(plugin, "_ACTIVATIONS", {})
    rep["activation_pids"] = sorted(acts)
    rep["decided_before_probe"] = pid in acts
    rep["hooked_modules"] = sorted(getattr(plugin, "_HOOKED", ()))
    status = plugin.status()
    rep["status"] = status
    if reregister:
        before = plugin.current()
        plugin.register()
        if vplugins is not None:
            vplugins.load_general_plugins()
        after = plugin.current()
        rep["reregister"] = {
            "same_activation": before is after,
            "state_after": plugin.status().get("state"),
            "activation_pids_after": sorted(getattr(plugin, "_ACTIVATIONS", {})),
        }
    return rep


class ProbeWorkerExtension:
    """Mixed into vLLM's worker class via ``worker_extension_cls``; called with ``collective_rpc``."""

    def zb_patch_probe_report(self, reregister: bool = False) -> dict:
        rep = process_report(reregister=reregister)
        rep["rank"] = getattr(self, "rank", None)
        rep["local_rank"] = getattr(self, "local_rank", None)
        rep["worker_class"] = f"{type(self).__module__}.{type(self).__qualname__}"
        return rep


# ----------------------------------------------------------------------------------------------------
# The engine (runs in the probe's child process, which is the engine's front end)
# ----------------------------------------------------------------------------------------------------


def write_tiny_model(directory: str, overrides: dict | None = None) -> str:
    """Write the tiny model's config.json (no weights, no tokenizer: load_format=dummy, skip_tokenizer_init)."""
    os.makedirs(directory, exist_ok=True)
    cfg = dict(TINY_LLAMA, **(overrides or {}))
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=1)
    return directory


def _engine_kwargs(spec: dict, model_dir: str, is_cpu: bool) -> tuple[dict, list[str]]:
    """EngineArgs for the smallest engine, restricted to the fields the installed vLLM has."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    wanted = {
        "model": model_dir,
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "dtype": "float32" if is_cpu else "float16",
        "enforce_eager": True,
        "max_model_len": 128,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 128,
        "seed": 0,
        "async_scheduling": True,
        "distributed_executor_backend": "mp",
        "tensor_parallel_size": int(spec.get("tp", 1)),
        "worker_extension_cls": f"{__name__}.ProbeWorkerExtension",
        "disable_log_stats": True,
    }
    if "kv_cache_memory_bytes" in fields:
        wanted["kv_cache_memory_bytes"] = KV_CACHE_BYTES
    else:  # older vLLM: a small fraction of device memory
        wanted["gpu_memory_utilization"] = 0.2
    dropped = sorted(k for k in wanted if k not in fields)
    if "worker_extension_cls" in dropped:
        raise RuntimeError("this vLLM has no worker_extension_cls: workers cannot be asked for their report")
    return {k: v for k, v in wanted.items() if k in fields}, dropped


def _run_frontend_hook(spec: dict) -> list[str]:
    """Call the ``frontend_hook`` of :func:`run_probe` (``"module:function"``) in the front end before the
    engine is built; it returns what it changed, shown in the report. The e2e tests use it to undo what
    vLLM's CPU build forces; `zb-patch doctor --probe` never sets one."""
    hook = spec.get("frontend_hook")
    if not hook:
        return []
    import importlib

    module, _, func = hook.partition(":")
    return list(getattr(importlib.import_module(module), func)())


def _engine_processes(llm) -> list[dict]:
    """EngineCore process objects as vLLM holds them (version-dependent attribute chain; best effort)."""
    out = []
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    resources = getattr(core, "resources", None)
    manager = getattr(resources, "engine_manager", None)
    for proc in getattr(manager, "processes", None) or []:
        out.append(
            {
                "pid": proc.pid,
                "name": proc.name,
                "start_method": getattr(proc, "_start_method", None),
                "class": type(proc).__name__,
            }
        )
    return out


def _process_tree() -> list[dict]:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a vLLM dependency
        return []
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            out.append(
                {
                    "pid": child.pid,
                    "ppid": child.ppid(),
                    "name": child.name(),
                    "cmdline": " ".join(child.cmdline())[:200],
                }
            )
        except psutil.Error:
            continue
    return out


def _engine_main(spec_path: str, result_path: str) -> int:
    """Child-process entry: start the engine, collect every report, write them as JSON, shut down."""
    t0 = time.monotonic()
    with open(spec_path, encoding="utf-8") as fh:
        spec = json.load(fh)
    result: dict[str, Any] = {"schema": RESULT_SCHEMA, "spec": spec, "frontend_pid": os.getpid()}

    def dump() -> None:
        result["elapsed_s"] = round(time.monotonic() - t0, 1)
        with open(result_path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1, sort_keys=True, default=str)
        os.replace(result_path + ".tmp", result_path)

    llm = None
    try:
        import vllm
        from vllm.platforms import current_platform

        result["vllm_import_s"] = round(time.monotonic() - t0, 1)
        result["vllm_version"] = getattr(vllm, "__version__", None)
        result["platform"] = type(current_platform).__name__
        result["frontend_hook"] = _run_frontend_hook(spec)
        model_dir = write_tiny_model(spec["model_dir"])
        kwargs, dropped = _engine_kwargs(spec, model_dir, current_platform.is_cpu())
        result["engine_kwargs"] = kwargs
        result["engine_kwargs_unsupported"] = dropped
        from vllm import LLM, SamplingParams

        t1 = time.monotonic()
        llm = LLM(**kwargs)
        result["engine_init_s"] = round(time.monotonic() - t1, 1)
        cfg = llm.llm_engine.vllm_config
        result["engine_config"] = {
            "async_scheduling": getattr(cfg.scheduler_config, "async_scheduling", None),
            "executor": str(cfg.parallel_config.distributed_executor_backend),
            "tensor_parallel_size": cfg.parallel_config.tensor_parallel_size,
            "worker_cls": str(cfg.parallel_config.worker_cls),
            "multiproc_method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"),
        }
        t1 = time.monotonic()
        out = llm.generate(
            [{"prompt_token_ids": PROMPT}],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        result["generated_token_ids"] = list(out[0].outputs[0].token_ids)
        result["generate_s"] = round(time.monotonic() - t1, 2)
        t1 = time.monotonic()
        result["engine_processes"] = _engine_processes(llm)
        result["workers"] = llm.collective_rpc(
            "zb_patch_probe_report", kwargs={"reregister": bool(spec.get("reregister", True))}
        )
        result["frontend"] = process_report(reregister=bool(spec.get("reregister", True)))
        result["reports_s"] = round(time.monotonic() - t1, 2)
        result["process_tree"] = _process_tree()
        result["ok"] = True
        return 0
    except BaseException as exc:  # the report says why the engine did not start
        import traceback

        result["ok"] = False
        result["error"] = {
            "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": str(exc),
            "traceback": traceback.format_exc()[-6000:],
        }
        # the front end's own state still says what zb-patch decided here
        try:
            result["frontend"] = process_report()
        except Exception:  # pragma: no cover
            pass
        return 1
    finally:
        dump()
        sys.stdout.flush()
        sys.stderr.flush()
        if llm is not None:
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            try:
                core.shutdown()
            except Exception:  # pragma: no cover - best effort; the parent kills the process group anyway
                pass


# ----------------------------------------------------------------------------------------------------
# Reading zb-patch's log lines (EngineCore; cross-check for everyone else)
# ----------------------------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_VLLM_PREFIX = re.compile(r"^\((?P<label>[^()]*?) pid=(?P<pid>\d+)\)\s*")
_LEVEL = re.compile(
    r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s*"
)
_ZB_LINE = re.compile(r"zb-patch: pid=(?P<pid>\d+) role=(?P<role>\S+) (?P<text>.*)$")
_ZB_ANY = re.compile(r"zb-patch[:\[]")


def _state_from_text(text: str, level: str | None) -> str:
    """The decision a zb-patch log line states (mirrors zb_patch.plugin.Activation's messages)."""
    if text.startswith("REFUSED:"):
        # Activation._refuse logs at WARNING ("not-applicable") exactly when vllm-ascend is not installed
        if level == "WARNING" or (level is None and "vllm_ascend=-" in text):
            return "not-applicable"
        return "refused"
    if text.startswith("native:"):
        return "native"
    if text.startswith("armed "):
        return "armed"
    if text.startswith("adapter="):
        return "applied"
    return "?"


def parse_log(lines: list[str]) -> dict:
    """zb-patch decision lines by pid, the engine parts' lines by pid (``Activation._log_engine_part``), plus the
    label vLLM prints for each pid (``(EngineCore pid=N)``)."""
    by_pid: dict[int, list[dict]] = {}
    parts: dict[int, list[str]] = {}
    labels: dict[int, str] = {}
    other: list[str] = []
    for raw in lines:
        line = _ANSI.sub("", raw.rstrip("\n"))
        rest = line
        m = _VLLM_PREFIX.match(rest)
        prefix_pid = None
        if m:
            prefix_pid = int(m.group("pid"))
            labels.setdefault(prefix_pid, m.group("label"))
            rest = rest[m.end() :]
        lm = _LEVEL.match(rest)
        level = lm.group("level") if lm else None
        z = _ZB_LINE.search(rest)
        if z and z.group("text").startswith("part "):  # an engine part's own line, not the process's decision
            parts.setdefault(int(z.group("pid")), []).append(z.group("text"))
        elif z:
            pid = int(z.group("pid"))
            text = z.group("text")
            by_pid.setdefault(pid, []).append(
                {
                    "pid": pid,
                    "role": z.group("role"),
                    "level": level,
                    "text": text,
                    "state": _state_from_text(text, level),
                    "vllm_label": labels.get(pid),
                    "prefix_pid": prefix_pid,
                    "handler": "vllm" if lm else "python-default",
                }
            )
        elif _ZB_ANY.search(rest) and "zb_patch_probe" not in rest:
            other.append(line)
    return {"by_pid": by_pid, "parts": parts, "labels": labels, "other": other}


# ----------------------------------------------------------------------------------------------------
# Assembling the per-process report
# ----------------------------------------------------------------------------------------------------


def assemble(result: dict, log_lines: list[str], env: dict) -> dict:
    """Join the engine's result file and its output into one row per process, and check them."""
    logs = parse_log(log_lines)
    by_pid = logs["by_pid"]
    zb_env = {k: v for k, v in env.items() if k.startswith("ZB_PATCH")}
    from zb_patch.plugin import Settings

    settings = Settings(env)
    mode = "invalid" if settings.errors else ("on" if settings.enabled else "off")
    rows: list[dict] = []
    problems: list[str] = []
    # ZB_PATCH_STRICT=1: the refusal is raised (the engine does not start), not logged, in the process it names
    engine_error = result.get("error") or {}
    message = engine_error.get("message") or ""
    strict = re.search(r"zb-patch: pid=(\d+) role=\S+ .*\(ZB_PATCH_STRICT=1\)", message)
    strict_refusal = bool(strict)
    strict_pid = int(strict.group(1)) if strict else None

    def add(kind: str, label: str, pid: int, via: str, rep: dict | None) -> dict:
        lines = by_pid.get(pid, [])
        row = {"kind": kind, "label": label, "pid": pid, "report_via": via, "log_lines": lines, "report": rep}
        if rep is not None:
            st = rep.get("status") or {}
            row["state"] = st.get("state")
            row["role"] = st.get("role")
            row["reason"] = st.get("reason")
            row["start_method"] = rep.get("start_method")
        elif lines:
            row["state"] = lines[0]["state"]
            row["role"] = lines[0]["role"]
            row["reason"] = lines[0]["text"]
        else:
            row["state"] = "off" if mode == "off" else None
            row["role"] = None
            row["reason"] = None
        rows.append(row)
        return row

    fe = result.get("frontend")
    fe_pid = result.get("frontend_pid")
    add("frontend", "front end (LLM)", fe_pid, "in-process", fe)
    tree = {p["pid"]: p for p in result.get("process_tree") or []}
    engines = result.get("engine_processes") or []
    for proc in engines:
        r = add("engine", proc["name"], proc["pid"], "log line", None)
        r["start_method"] = proc.get("start_method")
    for rep in result.get("workers") or []:
        label = f"worker rank {rep.get('rank')} ({rep.get('process_name')})"
        add("worker", label, rep["pid"], "collective_rpc", rep)
    known = {r["pid"] for r in rows}
    # any other process of the engine that vLLM labelled in its output or that is in the process tree
    for pid, lbl in sorted(logs["labels"].items()):
        if pid not in known and (pid in tree or pid in by_pid):
            add("other", f"{lbl} (from vLLM's log prefix)", pid, "log line", None)
            known.add(pid)
    for pid in sorted(by_pid):
        if pid not in known:
            add("other", f"pid {pid} (zb-patch line only)", pid, "log line", None)
            known.add(pid)
    helpers = [p for pid, p in sorted(tree.items()) if pid not in known]

    # ---- checks -----------------------------------------------------------------------------
    if not result.get("ok"):
        pass  # the engine did not start: the rows that exist are still checked below
    elif not engines:
        problems.append("vLLM reported no EngineCore process (expected the V1 EngineCore in its own process)")
    if result.get("ok") and not result.get("workers"):
        problems.append("no worker answered collective_rpc")
    for row in rows:
        rep, lines, pid = row["report"], row["log_lines"], row["pid"]
        who = f"{row['label']} pid {pid}"
        if rep is not None:
            if rep.get("pid") != pid:
                problems.append(f"{who}: report came from pid {rep.get('pid')}")
            renv = {k: v for k, v in (rep.get("env") or {}).items() if k.startswith("ZB_PATCH")}
            if renv != zb_env:
                problems.append(f"{who}: sees ZB_PATCH* = {renv}, the probe set {zb_env}")
            if not rep.get("entry_point_loaded"):
                problems.append(f"{who}: vLLM never loaded the zb_patch entry point here")
            rr = rep.get("reregister")
            if rr and mode == "on" and not rr.get("same_activation"):
                problems.append(f"{who}: registering again created a new activation")
        if mode == "on":
            expected = 0 if pid == strict_pid else 1  # a strict refusal is the raised error instead
            if len(lines) != expected:
                problems.append(f"{who}: {len(lines)} zb-patch decision lines (expected exactly {expected})")
            for ln in lines:
                if ln["pid"] != pid:  # pragma: no cover - lines are keyed by pid
                    problems.append(f"{who}: line of pid {ln['pid']}")
            if rep is not None:
                st = rep.get("status") or {}
                if st.get("pid") != pid:
                    problems.append(f"{who}: zb-patch status is of pid {st.get('pid')} (stale state)")
                if not rep.get("decided_before_probe"):
                    problems.append(
                        f"{who}: zb-patch had not decided anything in this process until the probe "
                        f"asked (a forked child that adopted its parent's settings only lazily)"
                    )
                if lines and lines[0]["state"] != st.get("state") and pid != strict_pid:
                    problems.append(f"{who}: log says {lines[0]['state']}, status says {st.get('state')}")
        elif mode == "off":
            if lines:
                problems.append(f"{who}: ZB_PATCH is off but zb-patch logged: {lines[0]['text'][:120]}")
            if rep is not None:
                st = rep.get("status") or {}
                if st.get("state") not in ("off", "not-loaded"):
                    problems.append(f"{who}: ZB_PATCH is off but state is {st.get('state')}")
                if rep.get("activation_pids") or rep.get("hooked_modules"):
                    problems.append(
                        f"{who}: ZB_PATCH is off but zb-patch holds state "
                        f"(activations {rep.get('activation_pids')}, hooks {rep.get('hooked_modules')})"
                    )
                extra = [
                    m
                    for m in rep.get("zb_patch_modules", [])
                    if m not in ("zb_patch", "zb_patch.plugin", "zb_patch.check", __name__)
                ]
                if extra:
                    problems.append(f"{who}: ZB_PATCH is off but zb-patch imported {', '.join(extra)}")
    if logs["other"] and mode == "off":
        problems.append(f"zb-patch output with ZB_PATCH off: {logs['other'][0][:160]}")

    states = sorted({r["state"] for r in rows if r["state"]})
    if settings.errors:
        exit_code = EXIT_SETTINGS
    elif strict_refusal:
        exit_code = EXIT_REFUSED
    elif not result.get("ok"):
        exit_code = EXIT_ENGINE
    elif problems:
        exit_code = EXIT_TOPOLOGY
    elif mode == "on" and any(s in ("refused", "not-applicable") for s in states):
        exit_code = EXIT_REFUSED
    else:
        exit_code = EXIT_OK
    reasons = sorted({r["reason"] for r in rows if r.get("reason")})
    return {
        "schema": PROBE_SCHEMA,
        "mode": mode,
        "zb_patch_env": zb_env,
        "vllm": result.get("vllm_version"),
        "platform": result.get("platform"),
        "engine": {
            k: result.get(k)
            for k in (
                "ok",
                "engine_init_s",
                "vllm_import_s",
                "generate_s",
                "reports_s",
                "elapsed_s",
                "engine_config",
                "engine_kwargs",
                "engine_kwargs_unsupported",
                "frontend_hook",
                "generated_token_ids",
                "error",
            )
        },
        "processes": rows,
        "helper_processes": helpers,
        "states": states,
        "reasons": reasons,
        "strict_refusal": message if strict_refusal else None,
        "problems": problems,
        "unparsed_zb_patch_output": logs["other"],
        "exit_code": exit_code,
    }


# ----------------------------------------------------------------------------------------------------
# Running it
# ----------------------------------------------------------------------------------------------------


def run_probe(
    *,
    tp: int = 1,
    timeout: float = 300.0,
    env: dict | None = None,
    echo=None,
    frontend_hook: str | None = None,
    reregister: bool = True,
    keep_log: bool = True,
) -> dict:
    """Start the engine in a child process with ``env`` (default: this environment) and return the report.

    ``frontend_hook``: ``"module:function"`` importable with ``env``, called in the front end before the
    engine is built (see :func:`_run_frontend_hook`). ``echo``: callable receiving each output line as it
    arrives.
    """
    env = dict(os.environ if env is None else env)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the EngineCore in its own process
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        # vLLM's CPU backend binds each rank to a NUMA node and refuses TP > #nodes; give each rank its own
        # cores instead (ignored by every other platform)
        env["VLLM_CPU_OMP_THREADS_BIND"] = _cpu_bind(tp)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zb-patch-probe-") as tmp:
        spec = {
            "tp": tp,
            "model_dir": os.path.join(tmp, "model"),
            "frontend_hook": frontend_hook,
            "reregister": reregister,
        }
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w", encoding="utf-8") as fh:
            json.dump(spec, fh)
        code = f"import sys; from {__name__} import _engine_main; sys.exit(_engine_main(sys.argv[1], sys.argv[2]))"
        proc = subprocess.Popen(
            [sys.executable, "-c", code, spec_path, result_path],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        lines: list[str] = []

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if echo is not None:
                    echo(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        # the front end has exited (or timed out): end whatever of the engine is left, by process group
        _kill_group(proc)
        reader.join(timeout=10)
        result: dict = {"ok": False}
        if os.path.exists(result_path):
            with open(result_path, encoding="utf-8") as fh:
                result = json.load(fh)
        if timed_out:
            result["ok"] = False
            result.setdefault(
                "error", {"type": "timeout", "message": f"no result within {timeout:.0f} s", "traceback": ""}
            )
        elif "schema" not in result:
            result["error"] = {
                "type": "crash",
                "message": f"engine process exited with {proc.returncode} and wrote no result",
                "traceback": "",
            }
    report = assemble(result, lines, env)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    report["probe_exit"] = proc.returncode
    if keep_log:
        report["log"] = [_ANSI.sub("", x.rstrip("\n")) for x in lines]
    return report


def _cpu_bind(tp: int) -> str:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per = max(1, len(cores) // tp)
    groups = [cores[i * per : (i + 1) * per] or cores[-1:] for i in range(tp)]
    return "|".join(",".join(map(str, g)) for g in groups)


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid  # the leader is gone; the group may live on
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.1)
    if proc.poll() is None:  # pragma: no cover
        proc.kill()


# ----------------------------------------------------------------------------------------------------
# Text output
# ----------------------------------------------------------------------------------------------------


def render_text(r: dict) -> str:
    out: list[str] = []
    w = out.append
    eng = r["engine"]
    cfg = eng.get("engine_config") or {}
    env_text = " ".join(f"{k}={v}" for k, v in sorted(r["zb_patch_env"].items())) or "ZB_PATCH unset"
    w(f"zb-patch doctor --probe  ({env_text})")
    head = f"vLLM {r.get('vllm') or '?'} on {r.get('platform') or '?'}"
    if eng.get("ok"):
        head += (
            f"; engine up in {eng.get('engine_init_s')} s (executor {cfg.get('executor')}, "
            f"TP={cfg.get('tensor_parallel_size')}, start method {cfg.get('multiproc_method') or 'fork'}, "
            f"async_scheduling={cfg.get('async_scheduling')}); generated {len(eng.get('generated_token_ids') or [])} "
            f"tokens"
        )
    else:
        head += "; the engine did NOT start"
    w(head)
    if eng.get("frontend_hook"):
        w("front-end hook: " + "; ".join(eng["frontend_hook"]))
    w("")
    w(f"  {'process':<34} {'pid':>7}  {'start':<6} {'report via':<15} {'zb-patch lines':>14}  state")
    for p in r["processes"]:
        sm = p.get("start_method") or ("-" if p["kind"] == "frontend" else "?")
        w(
            f"  {p['label'][:34]:<34} {p['pid'] if p['pid'] is not None else '?':>7}  {sm:<6} {p['report_via']:<15} "
            f"{len(p['log_lines']):>14}  {p.get('state') or '-'}" + (f" (role {p['role']})" if p.get("role") else "")
        )
    for h in r.get("helper_processes") or []:
        name = "resource_tracker" if "resource_tracker" in h.get("cmdline", "") else h["name"]
        w(f"  {('helper: ' + name)[:34]:<34} {h['pid']:>7}  {'':<6} {'(not vLLM)':<15} {'':>14}  -")
    w("")
    for p in r["processes"]:
        for ln in p["log_lines"]:
            w(
                f"  [{p['label']}] {ln['level'] or '(no vLLM handler yet)'} zb-patch: pid={ln['pid']} "
                f"role={ln['role']} {ln['text']}"
            )
    if r["mode"] == "off":
        w(
            "ZB_PATCH is off: no process logged anything from zb-patch or holds zb-patch state"
            if not r["problems"]
            else "ZB_PATCH is off"
        )
    if eng.get("error") and not r.get("strict_refusal"):
        e = eng["error"]
        w(f"engine error: {e.get('type')}: {e.get('message')}")
    w("")
    if r.get("strict_refusal"):
        w("ZB_PATCH_STRICT=1: the engine refused to start:")
        w(f"  {r['strict_refusal']}")
    if r["problems"]:
        w("PROBLEMS:")
        for p in r["problems"]:
            w(f"  - {p}")
    elif not eng.get("ok") and not r.get("strict_refusal"):
        w("Checks: incomplete (the engine did not start)")
    else:
        w(
            "Checks: every process of the engine "
            + (
                "that started decided exactly once, on its own"
                if r.get("strict_refusal")
                else "decided exactly once, on its own, and agrees"
                if r["mode"] == "on"
                else "shows no trace of zb-patch"
                if r["mode"] == "off"
                else "was inspected"
            )
        )
    refused = "/".join(x for x in r["states"] if x in ("refused", "not-applicable")) or "refused"
    verdict = {
        EXIT_OK: "ok",
        EXIT_SETTINGS: "invalid ZB_PATCH* settings",
        EXIT_REFUSED: f"ZB_PATCH=1 but zb-patch {refused} (reason above)",
        EXIT_TOPOLOGY: "process topology problem",
        EXIT_ENGINE: "engine did not start",
    }[r["exit_code"]]
    w(f"Verdict: {verdict} (exit {r['exit_code']}); probe wall time {r.get('wall_s')} s")
    return "\n".join(out) + "\n"


def run_cli(args) -> int:
    """``zb-patch doctor --probe``: the report goes to ``args.out`` (stdout; the CLI's --json keeps it clean)."""
    verbose = bool(getattr(args, "verbose", False))
    echo = (lambda line: sys.stderr.write(line)) if verbose else None
    if not getattr(args, "json", False):
        sys.stderr.write("zb-patch: starting a tiny vLLM engine (this takes about a minute on CPU)...\n")
    report = run_probe(
        tp=int(getattr(args, "probe_tp", 1) or 1),
        timeout=float(getattr(args, "timeout", 300.0)),
        echo=echo,
        keep_log=verbose,
    )
    out = args.out
    if getattr(args, "json", False):
        json.dump(report, out, indent=2, sort_keys=True, default=str)
        out.write("\n")
    else:
        out.write(render_text(report))
        if report["exit_code"] == EXIT_ENGINE and not verbose and report["engine"].get("error"):
            out.write(report["engine"]["error"].get("traceback", "")[-3000:] + "\n")
    return report["exit_code"]
