"""vLLM general-plugin entry point (``vllm.general_plugins: zb_patch = zb_patch.plugin:register``).

vLLM calls :func:`register` in every process it starts (front end, EngineCore, each worker) through
``vllm.plugins.load_general_plugins()``. It must be cheap and re-entrant:

* ``ZB_PATCH`` unset / empty / ``0``: return at once; nothing heavy is imported (not even :mod:`zb_patch.detect`).
* ``ZB_PATCH=1``: read the settings, detect versions from package metadata, select the adapter, and *arm* it:
  if every module the adapter touches is already imported, verify and apply now; otherwise register wrapt
  post-import hooks and apply, all or nothing, when the last of those modules finishes importing. Nothing
  CUDA/NPU-heavy is imported by zb-patch itself, so arming before a fork is safe.

"Already applied" is read from the patched objects themselves (see :mod:`zb_patch.registry`), and the
per-process state is keyed by pid, so a forked child that inherited patched classes reports them as
inherited instead of patching twice.

Environment (all validated; an invalid value names the variable and its valid values):

* ``ZB_PATCH``          ``1`` on, ``0`` / unset off.
* ``ZB_PATCH_DISABLE``  comma-separated patch ids to leave out, or ``*`` for all (guards are still verified).
* ``ZB_PATCH_ENABLE``   comma-separated opt-in patch ids to apply, or ``*`` for all: the patches whose correctness
  rests on an NPU runtime contract no NPU run has shown (``rests on: npu-contract``); each one applied logs a WARNING.
* ``ZB_PATCH_STRICT``   ``1``: any refusal or invalid setting raises (the process fails to start) instead of
  being logged.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

LOGGER_NAME = "vllm.zb_patch"  # a child of vLLM's logger: vLLM's handler, format and VLLM_LOGGING_LEVEL apply

ENV_VARS = {
    "ZB_PATCH": "1 to switch zb-patch on; 0 or unset leaves vLLM untouched",
    "ZB_PATCH_DISABLE": "comma-separated patch ids to leave out, or * for all",
    "ZB_PATCH_ENABLE": "comma-separated opt-in patch ids (rests on: npu-contract) to apply, or * for all",
    "ZB_PATCH_STRICT": "1 turns any refusal into a startup error; 0 or unset logs it and runs unpatched",
}
_BOOL_VALUES = ("0", "1")


class _FallbackHandler(logging.StreamHandler):
    """Writes zb-patch's lines to stderr only while neither vLLM's logger nor the root logger has a handler.

    Some vLLM versions call general plugins before they configure logging in that process (vLLM 0.32's front
    end); Python's last-resort handler would then drop INFO lines. Once a handler exists upstream, records
    propagate to it and this one stays silent, so nothing is printed twice.
    """

    def emit(self, record):
        if _other_handlers():
            return
        super().emit(record)


def _other_handlers() -> bool:
    own = logging.getLogger(LOGGER_NAME).handlers
    return bool(
        logging.getLogger("vllm").handlers
        or logging.getLogger().handlers
        or any(not isinstance(h, _FallbackHandler) for h in own)
    )


def _logger():
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, _FallbackHandler) for h in logger.handlers):
        handler = _FallbackHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    if not _other_handlers():
        logger.setLevel(logging.INFO)  # vLLM's default level, while only the fallback handler exists
    elif logger.level == logging.INFO and logger.propagate:
        logger.setLevel(logging.NOTSET)  # vLLM configured logging since: its level (VLLM_LOGGING_LEVEL) rules
    return logger


# ----------------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------------


class Settings:
    """Parsed ``ZB_PATCH*`` environment. ``errors`` lists every invalid value, each naming the variable."""

    def __init__(self, environ: dict | None = None):
        env = os.environ if environ is None else environ
        self.raw = {k: v for k, v in env.items() if k.startswith("ZB_PATCH")}
        self.errors: list[str] = []
        self.enabled = self._bool("ZB_PATCH")
        self.strict = self._bool("ZB_PATCH_STRICT")
        for key in sorted(self.raw):
            if key not in ENV_VARS:
                self.errors.append(f"{key} is not a zb-patch variable (valid: {', '.join(ENV_VARS)})")
        self.disabled = self._ids("ZB_PATCH_DISABLE", opt_in_only=False)
        self.opted_in = self._ids("ZB_PATCH_ENABLE", opt_in_only=True)
        both = sorted((self.disabled & self.opted_in) - {"*"})
        if both:
            self.errors.append(f"ZB_PATCH_ENABLE and ZB_PATCH_DISABLE both name {', '.join(both)}: name each in one")

    def _ids(self, key: str, *, opt_in_only: bool) -> frozenset[str]:
        """The patch ids of a comma-separated variable (``*``: all); an id no adapter has is an error listing the
        valid ones (for ZB_PATCH_ENABLE: the opt-in patches)."""
        value = self.raw.get(key, "").strip()
        ids = frozenset(x.strip() for x in value.split(",") if x.strip())
        if not ids or "*" in ids:
            return ids
        from .versions import adapters

        patches = [p for a in adapters() for p in a.patch_set.patches]
        valid = sorted({p.id for p in patches if p.opt_in or not opt_in_only})
        unknown = sorted(ids - set(valid))
        if unknown:
            by_default = sorted(set(unknown) & {p.id for p in patches})
            note = f"; applied by default, not opt-in: {', '.join(by_default)}" if by_default else ""
            self.errors.append(
                f"{key}={value!r}: unknown {'opt-in ' if opt_in_only else ''}patch id(s) {', '.join(unknown)}{note} "
                f"(valid: * or {', '.join(valid) if valid else '(none defined)'})"
            )
        return ids

    def _bool(self, key: str) -> bool:
        value = self.raw.get(key, "").strip()
        if value == "":
            return False
        if value not in _BOOL_VALUES:
            self.errors.append(f"{key}={value!r} is invalid (valid: {' or '.join(_BOOL_VALUES)}, or unset)")
            return False
        return value == "1"

    def as_dict(self) -> dict:
        return {
            "enabled": self.enabled,
            "strict": self.strict,
            "disabled": sorted(self.disabled),
            "opted_in": sorted(self.opted_in),
            "errors": list(self.errors),
            "raw": dict(self.raw),
        }


# ----------------------------------------------------------------------------------------------------
# Role detection (for reporting: patches are armed everywhere and apply where their modules are imported,
# because vLLM may run the worker inside the EngineCore or the front-end process)
# ----------------------------------------------------------------------------------------------------

_CALLER_ROLES = (
    ("vllm/v1/worker/", "worker"),
    ("vllm/worker/", "worker"),
    ("vllm/v1/engine/core.py", "engine"),
    ("vllm/engine/arg_utils.py", "frontend"),
    ("vllm/entrypoints/", "frontend"),
)


def detect_role() -> str:
    """Best-effort role of this process: the vLLM code that called load_general_plugins(), else the
    multiprocessing process name vLLM gives its processes."""
    try:
        frame = sys._getframe(1)
    except ValueError:  # pragma: no cover
        frame = None
    depth = 0
    while frame is not None and depth < 25:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/vllm/plugins/" not in path:
            for needle, role in _CALLER_ROLES:
                if needle in path:
                    return role
        frame = frame.f_back
        depth += 1
    import multiprocessing

    name = multiprocessing.current_process().name
    named = _role_from_process_name(name)
    if named:
        return named
    if os.environ.get("RAY_RAYLET_PID") and "ray" in sys.modules:
        return "worker"
    return "frontend" if name == "MainProcess" else f"unknown({name})"


def _role_from_process_name(name: str) -> str | None:
    """The role the multiprocessing process name vLLM gives its processes states, else None."""
    if name.startswith("EngineCore"):
        return "engine"
    if "Worker" in name:
        return "worker"
    if name.startswith("ApiServer"):
        return "frontend"
    return None


# ----------------------------------------------------------------------------------------------------
# Activation: one per process (keyed by pid)
# ----------------------------------------------------------------------------------------------------


class Activation:
    """What zb-patch decided and did in this process."""

    def __init__(self, settings: Settings, role: str, selection: Any = None, versions: Any = None):
        from .detect import detect
        from .versions import select

        self.pid = os.getpid()
        self.role = role
        self.settings = settings
        self.versions = versions if versions is not None else detect()
        self.selection = selection if selection is not None else select(self.versions)
        self.state = "armed"  # armed / applied / refused / native / not-applicable / off
        self.adapter_id: str | None = None
        self.report: Any = None  # registry.SetReport of the adapter finally used
        self.tried: dict[str, Any] = {}  # adapter id -> SetReport of a refused candidate
        self.engine_parts: dict[str, Any] = {}  # part name -> SetReport of the selected adapter's engine parts
        self.reason = self.selection.reason
        self._lock = threading.RLock()

    def _inherited_selection(self):
        """The selection a forked child starts from: the parent's (same installed packages)."""
        return self.selection

    # -- reporting -----------------------------------------------------------------------------
    def as_dict(self) -> dict:
        return {
            "pid": self.pid,
            "role": self.role,
            "state": self.state,
            "adapter": self.adapter_id,
            "reason": self.reason,
            "selection": self.selection.as_dict(),
            "settings": self.settings.as_dict(),
            "versions": self.versions.as_dict(),
            "report": self.report.as_dict() if self.report is not None else None,
            "refused_candidates": {k: v.as_dict() for k, v in self.tried.items()},
            "engine_parts": {k: v.as_dict() for k, v in self.engine_parts.items()},
        }

    def _prefix(self) -> str:
        return f"zb-patch: pid={self.pid} role={self.role}"

    def _refuse(self, reason: str, *, level: str = "error") -> None:
        self.state = "refused" if level == "error" else "not-applicable"
        self.reason = reason
        engine = [n for n, r in self.engine_parts.items() if r.by_verdict("applied") or r.by_verdict("already-applied")]
        done = f" but part {', '.join(engine)} (an independent fix)" if engine else ""
        msg = f"{self._prefix()} REFUSED: {reason}; versions {self.versions.summary()}; nothing applied{done}"
        if self.settings.strict:
            from .registry import PatchError

            raise PatchError(msg + " (ZB_PATCH_STRICT=1)")
        getattr(_logger(), level)(msg)

    # -- the decision --------------------------------------------------------------------------
    def start(self) -> None:
        from . import versions as V

        sel = self.selection
        if sel.verdict == V.NATIVE:
            self.state = "native"
            _logger().info("%s native: %s; nothing to apply", self._prefix(), sel.reason)
            return
        if sel.verdict == V.REFUSED:
            not_applicable = not self.versions.vllm_ascend.installed
            self._refuse(sel.reason, level="warning" if not_applicable else "error")
            return
        modules = sorted({m for a in sel.candidates for m in a.patch_set.parts()[0].modules()})
        self._arm(modules + [m for part in self._engine_parts() for m in part.modules()])
        with self._lock:
            if self.state == "armed":
                cands = ", ".join(a.id for a in sel.candidates)
                _logger().info(
                    "%s armed %s (%s); applies when %s are imported",
                    self._prefix(),
                    cands,
                    sel.reason,
                    ", ".join(m for m in modules if m not in sys.modules) or "-",
                )

    def _arm(self, modules: list[str]) -> None:
        missing = [m for m in modules if m not in sys.modules]
        if not missing:
            self.on_import()
            return
        import wrapt

        for name in missing:
            if name not in _HOOKED:
                _HOOKED.add(name)
                wrapt.register_post_import_hook(_post_import_hook, name)
        self.on_import()  # some candidates may already be complete

    def _engine_parts(self) -> tuple:
        """The engine parts (``PatchSet.parts``) of the adapter selected by version; none while adapters are probed
        by fingerprint (an engine part follows the adapter its release is selected for)."""
        from . import versions as V

        if self.selection.verdict != V.SELECTED:
            return ()
        return self.selection.candidates[0].patch_set.parts()[1:]

    def on_import(self) -> None:
        """Called after any watched module finished importing: apply a candidate whose modules are all in, and the
        selected adapter's engine parts whose modules are in."""
        with self._lock:
            self._apply_worker_part()
            self._apply_engine_parts()

    def _apply_engine_parts(self) -> None:
        """Each engine part once its module is imported, in order (a part applies only after the ones before it);
        independent of the worker part, whose outcome this process may never see."""
        from . import registry as R

        parts = self._engine_parts()
        if not parts:
            return
        adapter = self.selection.candidates[0]
        for part in parts:
            report = self.engine_parts.get(part.name)
            if report is None:
                if not all(R._module_ready(m) for m in part.modules()):
                    return
                disabled = adapter.patch_set.with_groups(self.settings.disabled)
                report = self.engine_parts[part.name] = part.apply(self.versions, disabled, self.settings.opted_in)
                self._log_engine_part(adapter, report)
            if report.verdict not in (R.APPLIED, R.ALREADY, R.OK):
                return

    def _log_engine_part(self, adapter, report) -> None:
        from . import registry as R

        if report.verdict in (R.APPLIED, R.ALREADY, R.OK):
            verdicts = (R.APPLIED, R.ALREADY, R.NATIVE, R.DISABLED, R.OPT_IN)
            done = "; ".join(f"{v} [{', '.join(ids)}]" for v in verdicts if (ids := report.by_verdict(v)))
            _logger().info("%s part %s of adapter %s: %s", self._prefix(), report.name, adapter.id, done)
            return
        msg = f"{self._prefix()} part {report.name} of adapter {adapter.id} REFUSED: {report.reason}; nothing of it"
        msg += " applied"
        if self.settings.strict:
            raise R.PatchError(msg + " (ZB_PATCH_STRICT=1)")
        _logger().error(msg)

    def _apply_worker_part(self) -> None:
        from . import registry as R
        from . import versions as V

        if self.state != "armed":
            return
        for adapter in self.selection.candidates:
            if adapter.id in self.tried:
                continue
            worker = adapter.patch_set.parts()[0]
            if not all(R._module_ready(m) for m in worker.modules()):
                continue
            report = worker.apply(self.versions, self.settings.disabled, self.settings.opted_in)
            if report.verdict in (R.APPLIED, R.ALREADY, R.OK):
                self._accepted(adapter, report, probed=self.selection.verdict == V.PROBE)
                return
            self.tried[adapter.id] = report
            if self.selection.verdict == V.SELECTED:
                break
        if all(a.id in self.tried for a in self.selection.candidates) or (
            self.selection.verdict == V.SELECTED and self.tried
        ):
            first = next(iter(self.tried.values()))
            if self.selection.verdict == V.PROBE:
                detail = "; ".join(f"{aid}: {r.reason}" for aid, r in self.tried.items())
                reason = f"{self.selection.reason}; no adapter matches: {detail}"
            else:
                reason = f"adapter {first.name}: {first.reason}"
            if self.selection.form_note:  # which recorded form the version named, or that none is
                reason += f" [{self.selection.form_note}]"
            self._refuse(reason)

    def _accepted(self, adapter, report, probed: bool) -> None:
        from . import registry as R

        self.state = "applied"
        self.adapter_id = adapter.id
        self.report = report
        applied = report.by_verdict(R.APPLIED)
        already = report.by_verdict(R.ALREADY)
        native = report.by_verdict(R.NATIVE)
        disabled = report.by_verdict(R.DISABLED)
        guards = sum(1 for i in report.items if i.kind == "guard")
        how = "accepted by fingerprint (unknown build)" if probed else "selected by version"
        parts = [f"applied [{', '.join(applied)}]"]
        if already:
            inherited = [i for i in report.items if i.verdict == R.ALREADY and "parent" in i.reason]
            parts.append(f"already applied [{', '.join(already)}]" + (" (inherited from parent)" if inherited else ""))
        if native:
            parts.append(f"native [{', '.join(native)}]")
        if disabled:
            parts.append(f"disabled [{', '.join(disabled)}]")
        opt_in = report.by_verdict(R.OPT_IN)
        if opt_in:
            parts.append(f"opt-in, not enabled [{', '.join(opt_in)}]")
        superseded = report.by_verdict(R.SUPERSEDED)
        if superseded:
            parts.append(f"superseded [{', '.join(superseded)}]")
        parts.append(f"{guards} guards verified")
        self.reason = f"{adapter.id} {how}"
        for item in report.items:
            if item.kind == "advisory" and item.verdict == R.ADVISORY:
                _logger().warning(
                    "%s adapter=%s known issue %s not fixed by zb-patch (%s): %s",
                    self._prefix(),
                    adapter.id,
                    item.id,
                    item.matched,
                    item.reason,
                )
        specs = {p.id: p for p in adapter.patch_set.patches}
        for pid in applied + already:
            if specs[pid].opt_in:
                _logger().warning(
                    "%s adapter=%s opt-in patch %s applied (ZB_PATCH_ENABLE): not shown on an NPU; rests on %s; "
                    "check it on this deployment with `zb-patch selftest --engine --graph-mode <the mode it acts in>`",
                    self._prefix(),
                    adapter.id,
                    pid,
                    specs[pid].rests_on.evidence,
                )
        _logger().info(
            "%s adapter=%s %s: %s; versions %s",
            self._prefix(),
            adapter.id,
            how,
            "; ".join(parts),
            self.versions.summary(),
        )


_HOOKED: set[str] = set()  # module names with a post-import hook (inherited over fork, like wrapt's)
_ACTIVATIONS: dict[int, Activation] = {}


def _post_import_hook(module) -> None:
    act = current()
    if act is not None:
        from .registry import module_executed

        with module_executed(module.__name__):
            act.on_import()


def _activate(settings: Settings, role: str, selection: Any = None, versions: Any = None) -> Activation:
    """Create and start this process's activation. ``selection`` / ``versions`` are injected by tests only."""
    act = Activation(settings, role, selection, versions)
    _ACTIVATIONS.clear()  # states of other pids (a parent before fork) are not ours
    _ACTIVATIONS[act.pid] = act
    _watch_forks()
    act.start()
    return act


class _ForkWatch:
    """Weak-referenceable token for ``multiprocessing.util.register_after_fork``."""


_FORK_WATCH = _ForkWatch()
_FORK_WATCHED = False  # inherited over fork together with multiprocessing's registry


def _watch_forks() -> None:
    global _FORK_WATCHED
    if not _FORK_WATCHED:
        import multiprocessing.util

        multiprocessing.util.register_after_fork(_FORK_WATCH, _after_fork_in_child)
        _FORK_WATCHED = True


def _after_fork_in_child(_token) -> None:
    """Run by multiprocessing in every child it *forks* (vLLM's EngineCore and workers with
    VLLM_WORKER_MULTIPROC_METHOD=fork), after the child's process name is set and before its target runs.

    The child inherits vLLM's ``plugins_loaded`` flag, so vLLM never calls :func:`register` there. Adopting
    lazily in :func:`current` is not enough: a forked EngineCore may never call it (no decision, no log
    line), and a stack inherited from the parent names the wrong role. So the child decides here, once,
    with the role its process name states. (Found by ``zb-patch doctor --probe`` on a real engine.)"""
    if _ACTIVATIONS and os.getpid() not in _ACTIVATIONS:
        import multiprocessing

        name = multiprocessing.current_process().name
        parent = next(iter(_ACTIVATIONS.values()))
        _activate(
            parent.settings,
            role=_role_from_process_name(name) or f"unknown({name})",
            selection=parent._inherited_selection(),
            versions=parent.versions,
        )


def current() -> Activation | None:
    """This process's activation (None when zb-patch is off or register() never ran here).

    A forked child inherits its parent's activation object and vLLM's ``plugins_loaded`` flag, so vLLM does
    not call :func:`register` again there. The child adopts the parent's settings on first use (a watched
    module imported, or a status query): its own versions, selection and live-state check, logged once.
    """
    act = _ACTIVATIONS.get(os.getpid())
    if act is None and _ACTIVATIONS:
        parent = next(iter(_ACTIVATIONS.values()))
        act = _activate(
            parent.settings, role=detect_role(), selection=parent._inherited_selection(), versions=parent.versions
        )
    return act


def status() -> dict:
    """JSON-able status of zb-patch in this process (used by `zb-patch doctor --probe` via collective_rpc)."""
    act = current()
    if act is not None:
        return act.as_dict()
    return {"pid": os.getpid(), "state": "off", "zb_patch": os.environ.get("ZB_PATCH")}


def register() -> None:
    """Entry point called by vLLM's ``load_general_plugins()`` in every process."""
    flag = os.environ.get("ZB_PATCH", "").strip()
    if flag in ("", "0"):
        return
    if os.getpid() in _ACTIVATIONS:
        return  # re-entrant: vLLM may call general plugins more than once per process
    settings = Settings()
    role = detect_role()
    if settings.errors:
        msg = "zb-patch: invalid settings, staying off: " + "; ".join(settings.errors)
        if settings.strict:
            from .registry import PatchError

            raise PatchError(msg)
        _logger().error(msg)
        return
    if not settings.enabled:
        return
    _activate(settings, role)
