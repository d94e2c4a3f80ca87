"""Patch specs as data, and the machinery that verifies, applies, rolls back and undoes them.

Vocabulary
----------
* **Target** ``"package.module:Qual.name.attr"``: an attribute of a module or class in an upstream package.
  It is resolved through the owner's ``__dict__`` (never ``getattr``), so an inherited attribute is *not*
  found on a subclass: a patch must name the class that defines what it replaces.
* **Fingerprint**: hash of the normalised AST of the target's source (docstrings, comments and layout
  dropped; decorators, names and code kept). :func:`fingerprint_object` computes it from a live object,
  :func:`fingerprint_source` from a source file that was never imported (used to compute fingerprints for
  releases that are not installed, e.g. from a git tag). Both give the same answer for the same code.
* **Guard**: a target the adapter relies on without replacing it (a caller whose behaviour the patch
  assumes). Its fingerprint is verified like a patch's.
* **Patch**: a target, a factory ``make(original) -> replacement``, the accepted fingerprints of the
  original, and the reasons (why / upstream PRs / remove-when).

Apply is all-or-nothing: every target of the set is resolved and fingerprinted first; only if all match is
anything written, and an exception while writing rolls back what was written. Unpatch restores the exact
original objects (identity). Whether a target is patched is read from the live object (marker attributes
on the replacement), never from a process-global flag, so it stays true after ``fork``.
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import copy
import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import linecache
import os
import sys
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

FINGERPRINT_ALGO = "ast311-sha256-16"  # sha256 of 3.11's ast.dump text (canonical_dump), 16 hex digits

# Marker attributes set on every replacement object.
MARK_ID = "__zb_patch_id__"
MARK_ORIGINAL = "__zb_patch_original__"
MARK_PID = "__zb_patch_pid__"

ROLES = ("frontend", "engine", "worker")
ENGINE_ROLE = "engine"  # a patch of the scheduler (EngineCore process): its own part of the set (PatchSet.parts)


class PatchError(RuntimeError):
    """A patch set could not be verified or applied (the message says which target and why)."""


# ----------------------------------------------------------------------------------------------------
# Targets and fingerprints
# ----------------------------------------------------------------------------------------------------


def split_target(spec: str) -> tuple[str, tuple[str, ...]]:
    """``"pkg.mod:Cls.meth"`` -> ``("pkg.mod", ("Cls", "meth"))``."""
    if spec.count(":") != 1:
        raise ValueError(f"target {spec!r} must look like 'package.module:Qualified.name'")
    module, qual = spec.split(":")
    parts = tuple(qual.split("."))
    if not module or not all(parts):
        raise ValueError(f"target {spec!r} must look like 'package.module:Qualified.name'")
    return module, parts


def _strip_docstrings(node: ast.AST) -> None:
    for sub in ast.walk(node):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = sub.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                sub.body = body[1:] or [ast.Pass()]


def fingerprint_node(node: ast.AST) -> str:
    """Fingerprint of one ``FunctionDef`` / ``ClassDef`` node (it is modified: docstrings dropped)."""
    _strip_docstrings(node)
    return hashlib.sha256(canonical_dump(node).encode("utf-8")).hexdigest()[:16]


# Fields that Python 3.12+ added to nodes older code already parses to; left out while empty.
_ADDED_FIELDS = frozenset({"type_params"})


def canonical_dump(node: Any) -> str:
    """The text ``ast.dump(node)`` gives on Python 3.8-3.11, on any Python 3.8+: the recorded fingerprints hash it,
    and the same source must fingerprint alike on every Python a vLLM release supports. Newer Pythons dump the same
    code differently: 3.12 adds ``type_params=[]`` to every def / class and ends an f-string format spec that ends
    in a replacement field with ``Constant('')``; 3.13 leaves out empty lists. Kept as 3.11 prints it: a field
    whose value is None and whose node class defaults it to None is left out, an added field is left out while
    empty, and an f-string's parts are its non-empty literal runs (adjacent ones joined) and its fields."""
    if isinstance(node, ast.AST):
        parts = []
        for name in node._fields:
            try:
                value = getattr(node, name)
            except AttributeError:
                continue
            if value is None and getattr(type(node), name, ...) is None:
                continue
            if name in _ADDED_FIELDS and not value:
                continue
            if isinstance(node, ast.JoinedStr) and name == "values":
                value = _fstring_parts(value)
            parts.append(f"{name}={canonical_dump(value)}")
        return f"{type(node).__name__}({', '.join(parts)})"
    if isinstance(node, list):
        return f"[{', '.join(canonical_dump(item) for item in node)}]"
    return repr(node)


def _fstring_parts(values: list) -> list:
    parts: list = []
    for value in values:
        literal = isinstance(value, ast.Constant) and isinstance(value.value, str)
        if literal and not value.value:
            continue
        if literal and parts and isinstance(parts[-1], ast.Constant) and isinstance(parts[-1].value, str):
            parts[-1] = ast.Constant(value=parts[-1].value + value.value)
        else:
            parts.append(value)
    return parts


def underlying_function(obj: Any) -> Any:
    """The plain function behind descriptors and well-known wrappers (staticmethod, classmethod,
    property getter, functools.wraps chains, Triton ``JITFunction``, torch.compile wrappers)."""
    seen = set()
    while id(obj) not in seen:
        seen.add(id(obj))
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        elif isinstance(obj, property):
            obj = obj.fget
        elif hasattr(obj, MARK_ORIGINAL):
            # our own replacement: the fingerprint that matters is the original's
            obj = getattr(obj, MARK_ORIGINAL)
        elif type(obj).__name__ in ("JITFunction", "Autotuner", "Heuristics") and hasattr(obj, "fn"):
            obj = obj.fn
        elif isinstance(obj, types.FunctionType) and hasattr(obj, "_torchdynamo_orig_callable"):
            obj = obj._torchdynamo_orig_callable
        elif not isinstance(obj, type) and hasattr(obj, "__wrapped__"):
            # functools.wraps decorators (torch.inference_mode, ...): the decorated def holds the code and
            # its decorator list, which the fingerprint includes
            obj = obj.__wrapped__
        else:
            break
    return obj


@functools.lru_cache(maxsize=16)
def _module_tree(filename: str, mtime: float, size: int) -> ast.Module:
    lines = linecache.getlines(filename)
    if not lines:
        raise PatchError(f"no source lines for {filename}")
    return ast.parse("".join(lines))


def _first_line(node: ast.stmt) -> int:
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def fingerprint_object(obj: Any) -> str:
    """Fingerprint of a live function / method / class, from the def/class node in its module's source.

    A function's node is parsed from its own lines only (:func:`_function_fingerprint`: the activation cost
    is dominated by parsing, and the upstream runner modules are thousands of lines long); a class's node, or a
    function whose lines cannot be isolated that way, is located in the parsed source file (by the code
    object's first line for functions, by qualified name for classes). Both give the node the whole-file
    parse gives. Never by re-parsing a dedented snippet: dedenting would alter the contents of multi-line
    string literals and so the fingerprint.
    """
    fn = underlying_function(obj)
    try:
        filename = inspect.getsourcefile(fn)
    except TypeError as exc:
        raise PatchError(f"no source for {fn!r}: {exc}") from exc
    if not filename:
        raise PatchError(f"no source file for {fn!r}")
    fp = _function_fingerprint(fn, filename) if isinstance(fn, types.FunctionType) else None
    if fp is not None:
        return fp
    try:
        st = os.stat(filename)
        tree = _module_tree(filename, st.st_mtime, st.st_size)
    except (OSError, SyntaxError) as exc:
        raise PatchError(f"cannot read source of {fn!r}: {exc}") from exc
    if isinstance(fn, types.FunctionType):
        node = _node_at(tree, fn.__code__)
        if node is not None and not _file_compiles_to(fn.__code__, filename, linecache.getlines(filename)):
            raise PatchError(
                f"the source of {fn.__qualname__} in {filename} is not the code running in this "
                f"process (the file changed after it was imported)"
            )
    elif isinstance(fn, type):
        node = find_node(tree, fn.__qualname__.split("."))
    if node is None:
        raise PatchError(f"cannot locate the definition of {fn!r} in {filename}")
    return fingerprint_node(copy.deepcopy(node))


def _node_at(tree: ast.AST, code: types.CodeType) -> ast.AST | None:
    """The def node whose first line (decorators included) is the code object's, with its name."""
    for sub in ast.walk(tree):
        if (
            isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef))
            and _first_line(sub) == code.co_firstlineno
            and sub.name == code.co_name
        ):
            return sub
    return None


_MAX_BLOCK_TRIES = 64
_FUTURE_FLAGS = functools.reduce(
    lambda acc, name: acc | getattr(__future__, name).compiler_flag, __future__.all_feature_names, 0
)


def _function_fingerprint(fn: types.FunctionType, filename: str) -> str | None:
    """The fingerprint of ``fn`` from the function's own lines, or None when they cannot be isolated (the
    caller then parses the whole file).

    The block starts at ``co_firstlineno`` (the first decorator) and ends before the first line after the
    code's last line that starts a statement at the def's indentation or less: each such line is tried in
    turn, and the first prefix that parses is the block (a cut inside a string, a bracket or a backslash
    continuation does not parse, and a cut that parses ends the def in the whole file too). An indented def
    is parsed under a ``class <owner>:`` (or ``if 1:``) header, with its lines unchanged and padded to their
    line numbers.

    The lines read must be the code running in this process: they are compiled and must give exactly the
    function's code object (bytecode, constants, names, line and column table), else PatchError -- the file
    changed after the module was imported, and its text must not vouch for code that is not running. (The
    decorator expressions and default values run in the enclosing scope: the fingerprint covers them, this
    check cannot.) A block that passed is remembered in the fingerprint cache under the digest of its text
    and of the code it compiled to (:class:`_FingerprintCache`), so the same text and code are not parsed and
    compiled again.
    """
    code = fn.__code__
    if set(code.co_freevars) - {"__class__"}:
        return None  # a closure: its free variables need the enclosing function's scope
    lines = linecache.getlines(filename)
    first = code.co_firstlineno
    if not 0 < first <= len(lines):
        return None
    head = lines[first - 1]
    indent = len(head) - len(head.lstrip())
    owner = fn.__qualname__.split(".")[-2:-1]
    if owner == ["<locals>"]:
        return None
    if indent == 0:
        header = ""
    elif first > 1:
        # the class name matters to the compiled code (private-name mangling); an `if` keeps the def's scope
        header = f"class {owner[0]}:\n" if owner else "if 1:\n"
    else:
        return None
    padding = "\n" * (first - 1 - bool(header))
    cache = _fingerprint_cache()
    code_digest = _code_digest(code)
    tries = 0
    end = max(first, _last_code_line(code))  # the block ends after the last line holding code
    while end <= len(lines) and tries < _MAX_BLOCK_TRIES:
        end = _next_statement_at_or_left_of(lines, end, indent)
        tries += 1
        block = "".join(lines[first - 1 : end - 1])
        key = _cache_key(header + block, code_digest)
        fp = cache.get(key)
        if fp is not None:
            return fp
        try:
            tree = ast.parse(padding + header + block)
        except SyntaxError:
            continue  # cut inside a string, a bracket or a continuation: try the next candidate line
        body = getattr(tree.body[0], "body", []) if header else tree.body
        node = body[0] if len(body) == 1 else None
        if (
            not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            or node.name != code.co_name
            or _first_line(node) != first
        ):
            return None
        if not (
            _block_compiles_to(code, filename, lines, padding, header, block)
            or _file_compiles_to(code, filename, lines)
        ):
            raise PatchError(
                f"the source of {fn.__qualname__} in {filename} is not the code running in this "
                f"process (the file changed after it was imported)"
            )
        fp = fingerprint_node(node)
        cache.put(key, fp)
        return fp
    return None


def _block_compiles_to(
    code: types.CodeType, filename: str, lines: Sequence[str], padding: str, header: str, block: str
) -> bool:
    """Whether the def's own lines compile to ``code``.

    What the compiler emits for ``name.attr(...)`` also depends on whether a module-level import binds
    ``name`` (CPython 3.11+ then loads the attribute instead of a method), so the names that the file's import
    statements bind are declared on the first padding line. A name bound by an import elsewhere than at module
    level is declared too: the code then differs, and :func:`_file_compiles_to` decides.
    """
    imported = _imported_names(filename, lines)
    if imported:
        if not padding:
            return False
        padding = "import " + ", ".join(sorted(imported)) + padding
    flags = code.co_flags & _FUTURE_FLAGS
    try:
        compiled = compile(padding + header + block, filename, "exec", flags=flags, dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return _find_code(compiled, code.co_name, code.co_firstlineno) == code


_IMPORTED: dict[str, tuple[Sequence[str], frozenset[str]]] = {}  # filename -> (its lines, the names)


def _imported_names(filename: str, lines: Sequence[str]) -> frozenset[str]:
    """Names bound by the import statements of a file (anywhere in it: a hint for the compile only)."""
    cached = _IMPORTED.get(filename)
    if cached is not None and cached[0] is lines:  # the very list linecache holds: same text
        return cached[1]
    names = set()
    statement = ""
    for line in lines:
        if statement:  # inside `from x import (...)`
            statement += line
        else:
            stripped = line.lstrip()
            if not stripped.startswith(("import ", "from ")):
                continue
            statement = stripped
        if "(" in statement and ")" not in statement:
            continue
        words = statement.split("#", 1)[0].replace("(", " ").replace(")", " ").split(None, 1)
        statement = ""
        if len(words) < 2:
            continue
        if words[0] == "from":
            if " import " not in words[1]:
                continue
            items, first_word = words[1].split(" import ", 1)[1], False
        else:
            items, first_word = words[1], True
        for item in items.split(";", 1)[0].split(","):
            parts = item.split()
            if parts and parts[0] != "*":
                names.add(
                    parts[-1]
                    if len(parts) == 3 and parts[1] == "as"
                    else parts[0].split(".")[0]
                    if first_word
                    else parts[0]
                )
    found = frozenset(n for n in names if n.isidentifier())
    _IMPORTED[filename] = (lines, found)
    return found


@functools.lru_cache(maxsize=4)
def _compiled_file(filename: str, source: str, flags: int) -> types.CodeType:
    return compile(source, filename, "exec", flags=flags, dont_inherit=True)


def _file_compiles_to(code: types.CodeType, filename: str, lines: Sequence[str]) -> bool:
    """Whether the whole file compiles to a module containing ``code`` (the slow, exact check)."""
    try:
        compiled = _compiled_file(filename, "".join(lines), code.co_flags & _FUTURE_FLAGS)
    except (SyntaxError, ValueError):
        return False
    return _find_code(compiled, code.co_name, code.co_firstlineno) == code


def _last_code_line(code: types.CodeType) -> int:
    last = max((line for _, _, line in code.co_lines() if line is not None), default=0)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            last = max(last, _last_code_line(const))
    return last


def _next_statement_at_or_left_of(lines: Sequence[str], start: int, indent: int) -> int:
    """1-based number of the first line after line ``start`` that is not blank or a comment and is indented
    ``indent`` or less; one past the last line if none."""
    for number in range(start + 1, len(lines) + 1):
        text = lines[number - 1]
        stripped = text.lstrip()
        if stripped and not stripped.startswith("#") and len(text) - len(stripped) <= indent:
            return number
    return len(lines) + 1


def _find_code(code: types.CodeType, name: str, first: int) -> types.CodeType | None:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_name == name and const.co_firstlineno == first:
                return const
            found = _find_code(const, name, first)
            if found is not None:
                return found
    return None


def _code_digest(code: types.CodeType) -> str:
    """sha256 of everything CPython compares when it compares two code objects (nested ones included)."""
    return hashlib.sha256(repr(_code_fields(code)).encode("utf-8", "surrogatepass")).hexdigest()


def _code_fields(code: types.CodeType) -> tuple:
    return (
        code.co_name,
        code.co_argcount,
        code.co_posonlyargcount,
        code.co_kwonlyargcount,
        code.co_flags,
        code.co_firstlineno,
        code.co_code,
        code.co_names,
        code.co_varnames,
        code.co_freevars,
        code.co_cellvars,
        code.co_linetable,
        getattr(code, "co_exceptiontable", b""),
        tuple(_const_fields(c) for c in code.co_consts),
    )


def _const_fields(const: Any) -> tuple:
    if isinstance(const, types.CodeType):
        return ("code", _code_fields(const))
    if isinstance(const, tuple):
        return ("tuple", tuple(_const_fields(c) for c in const))
    if isinstance(const, frozenset):  # iteration order depends on the hash seed
        return ("frozenset", tuple(sorted(repr(_const_fields(c)) for c in const)))
    return (type(const).__name__, repr(const))


def _cache_key(text: str, code_digest: str) -> str:
    # the Python version is part of the key: ast.dump's output and the compiled code depend on it
    ident = "\0".join((FINGERPRINT_ALGO, sys.implementation.cache_tag or sys.version, code_digest, text))
    return hashlib.sha256(ident.encode("utf-8", "surrogatepass")).hexdigest()


class _FingerprintCache:
    """Fingerprints of function blocks already parsed, compiled and checked, shared by this machine's
    processes through one small JSON file (every vLLM process runs the same activation).

    A key is the sha256 of the block's text, of the digest of the code object it compiled to, of the Python
    version and of the fingerprint algorithm: an entry is found only for the very text and the very code it
    was computed from, so it can never vouch for changed code. The file lives in ``$XDG_CACHE_HOME/zb-patch``
    (default ``~/.cache/zb-patch``, directory mode 0700, file 0600). It is read once per process; new entries
    are merged into what is on disk and written to a temporary file that replaces it (``os.replace``), so a
    reader never sees a partial file and concurrent writers lose at most each other's new entries (recomputed
    later). An unreadable or corrupt file counts as empty; an unwritable directory only means no caching.
    """

    MAX_ENTRIES = 4096  # beyond this (many releases or source trees seen), the file restarts from this process's

    def __init__(self, path: str | None):
        self.path = path
        self.entries = self._read()
        self.new: dict[str, str] = {}

    def _read(self) -> dict[str, str]:
        if self.path is None:
            return {}
        try:
            with open(self.path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {
            k: v for k, v in data.items() if isinstance(k, str) and len(k) == 64 and isinstance(v, str) and len(v) == 16
        }

    def get(self, key: str) -> str | None:
        return self.entries.get(key)

    def put(self, key: str, fingerprint: str) -> None:
        self.entries[key] = fingerprint
        self.new[key] = fingerprint
        if self.path is None:
            return
        import tempfile  # here: its import costs more than a process that finds everything cached needs

        try:
            directory = os.path.dirname(self.path)
            os.makedirs(directory, mode=0o700, exist_ok=True)
            merged = {**self._read(), **self.new}
            if len(merged) > self.MAX_ENTRIES:
                merged = dict(self.new)
            fd, tmp = tempfile.mkstemp(prefix=".fingerprints-", dir=directory)  # mode 0600
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    json.dump(merged, fh)
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError:
            pass  # a read-only home or a full disk: fingerprints are computed, just not remembered


_CACHE: _FingerprintCache | None = None


def fingerprint_cache_path() -> str | None:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if not os.path.isabs(base):
        return None
    return os.path.join(base, "zb-patch", f"fingerprints-{FINGERPRINT_ALGO}.json")


def _fingerprint_cache() -> _FingerprintCache:
    global _CACHE
    path = fingerprint_cache_path()
    if _CACHE is None or _CACHE.path != path:
        _CACHE = _FingerprintCache(path)
    return _CACHE


def find_node(tree: ast.Module, qualname: Sequence[str]) -> ast.AST | None:
    """Find a def/class by qualified name in a module AST (last definition wins, as at run time)."""
    scope: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in qualname:
        found = None
        for stmt in scope:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == part:
                found = stmt
        if found is None:
            return None
        node = found
        scope = getattr(found, "body", [])
    return node


def fingerprint_source(source: str, qualname: str | Sequence[str]) -> str | None:
    """Fingerprint of ``qualname`` in a module's source text, without importing it. None if absent."""
    parts = tuple(qualname.split(".")) if isinstance(qualname, str) else tuple(qualname)
    node = find_node(ast.parse(source), parts)
    return None if node is None else fingerprint_node(node)


# ----------------------------------------------------------------------------------------------------
# Specs
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Guard:
    """A target the adapter relies on and verifies, but does not replace."""

    target: str
    fingerprints: Mapping[str, str]  # label (where it was computed) -> fingerprint
    why: str = ""
    roles: tuple[str, ...] = ("worker",)  # ("engine",): verified with the first engine part (PatchSet.parts)

    @property
    def id(self) -> str:
        return "guard:" + self.target


@dataclasses.dataclass(frozen=True)
class Advisory:
    """A known upstream bug zb-patch does not (yet) carry a fix for: when ``target`` has one of the
    ``affected`` fingerprints, one WARNING says so (never blocks the adapter)."""

    id: str
    target: str
    affected: Mapping[str, str]  # label -> fingerprint of the target in releases with the bug
    message: str
    upstream: tuple[str, ...] = ()


# What a patch's correctness rests on (``Patch.rests_on``). Every kind but NPU_CONTRACT applies with ZB_PATCH=1;
# an NPU_CONTRACT patch applies only when named in ZB_PATCH_ENABLE (opt-in).
HOST = "host"
ONE_STREAM = "one-stream"
UPSTREAM = "upstream"
BACKPORT = "backport"
NPU_CONTRACT = "npu-contract"
RESTS_ON_KINDS: Mapping[str, str] = {
    HOST: "host code only: true on every accelerator",
    ONE_STREAM: "program order within one device stream (and host waits on events of that stream): true on every "
    "accelerator",
    UPSTREAM: "the same change ships in a vLLM / vllm-ascend release that runs on NPUs",
    BACKPORT: "upstream's design ported onto this release's code; the port verified on the stand-ins (CPU emulation, "
    "CUDA standing in for the NPU)",
    NPU_CONTRACT: "a CANN / torch_npu behaviour that no NPU run has shown and no NPU release relies on: opt-in "
    "(ZB_PATCH_ENABLE)",
}


@dataclasses.dataclass(frozen=True)
class RestsOn:
    """What a patch's correctness rests on: one of :data:`RESTS_ON_KINDS` and the evidence, written out (the PR and
    first release for ``upstream``, the design and how the port was verified for ``backport``, the runtime behaviour
    relied on for ``npu-contract``)."""

    kind: str
    evidence: str

    def __post_init__(self) -> None:
        if self.kind not in RESTS_ON_KINDS:
            raise ValueError(f"rests_on kind {self.kind!r} is not one of {', '.join(RESTS_ON_KINDS)}")
        if not self.evidence.strip():
            raise ValueError(f"rests_on {self.kind}: the evidence must be written out")

    def line(self) -> str:
        return f"{self.kind} -- {self.evidence}"


@dataclasses.dataclass(frozen=True)
class Patch:
    """One replacement of one target.

    ``make(original)`` returns the replacement object; it is called at apply time with the exact original
    (so a replacement can delegate to it). ``native`` receives the detected :class:`~zb_patch.detect.Versions`
    and returns a reason string when the installed release already carries the fix (verdict "native").
    """

    id: str
    target: str
    make: Callable[[Any], Any]
    fingerprints: Mapping[str, str]
    why: str
    upstream: tuple[str, ...]
    remove_when: str
    how: str = ""
    roles: tuple[str, ...] = ("worker",)
    aliases: tuple[str, ...] = ()  # "module:name" bindings made by ``from x import f``
    native: Callable[[Any], str | None] | None = None
    # fingerprints of the target in releases that already carry the fix: verdict "native", nothing applied
    # (decided by the code actually installed, so a nightly that picked the fix up is recognised too)
    native_fingerprints: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # patches that only work together share a group: disabling one (ZB_PATCH_DISABLE) disables the group, so a
    # half of an interdependent change is never applied
    group: str = ""
    # ids of patches of the same set this one acts through: when one of them is not applied (disabled, native), this
    # one is not either (one direction only: disabling this one leaves them applied)
    requires: tuple[str, ...] = ()
    # what its correctness rests on (required, by keyword)
    rests_on: RestsOn = dataclasses.field(kw_only=True)
    # ids of patches of the same set with the same target that this one stands in for when it is enabled: they are
    # not applied then (verdict "superseded"), and what requires them is served by this one
    supersedes: tuple[str, ...] = ()

    @property
    def opt_in(self) -> bool:
        """Applied only when named in ZB_PATCH_ENABLE: its correctness rests on an unshown NPU contract."""
        return self.rests_on.kind == NPU_CONTRACT

    def __post_init__(self) -> None:
        if not isinstance(self.rests_on, RestsOn):
            raise ValueError(f"patch {self.id}: rests_on (a RestsOn of kind {', '.join(RESTS_ON_KINDS)}) is required")
        split_target(self.target)
        for alias in self.aliases:
            split_target(alias)
        if not self.fingerprints:
            raise ValueError(f"patch {self.id}: at least one fingerprint of the original is required")
        for role in self.roles:
            if role not in ROLES:
                raise ValueError(f"patch {self.id}: unknown role {role!r} (valid: {', '.join(ROLES)})")


# ----------------------------------------------------------------------------------------------------
# Resolution
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Resolved:
    """A target looked up in the running process."""

    target: str
    found: bool
    owner: Any = None
    attr: str = ""
    raw: Any = None  # the value in owner.__dict__ (possibly our replacement)
    original: Any = None  # the upstream object (unwrapped from our replacement if patched)
    patched_by: str | None = None  # patch id when our replacement is live
    patched_pid: int | None = None
    fingerprint: str | None = None
    reason: str = ""

    @property
    def module(self) -> str:
        return split_target(self.target)[0]


# Modules whose code has fully executed although importlib still flags them as initializing: a post-import
# hook runs inside the loader's exec_module, before importlib clears ``__spec__._initializing``.
_JUST_EXECUTED: set[str] = set()


@contextlib.contextmanager
def module_executed(name: str):
    """Within this block, treat ``name`` as fully imported (used by post-import hooks)."""
    _JUST_EXECUTED.add(name)
    try:
        yield
    finally:
        _JUST_EXECUTED.discard(name)


def _module_ready(name: str) -> bool:
    """True when ``name`` is imported and its code finished executing (not a partial, circular import)."""
    mod = sys.modules.get(name)
    if mod is None:
        return False
    if name in _JUST_EXECUTED:
        return True
    spec = getattr(mod, "__spec__", None)
    return not getattr(spec, "_initializing", False)


def _defined_in(module_name: str, name: str, obj: Any) -> Any:
    """The class ``module_name`` defines as ``name``: ``obj`` (the module's attribute), or, where another module rebound
    that attribute to a subclass of it (vllm-ascend's platform patch sets ``vllm.v1.core.sched.scheduler.Scheduler =
    BalanceScheduler``), the base class of that name defined in ``module_name``. A target names the code of the
    module's own source, which is what its fingerprints were read from; the subclass still reaches it (``super()``)."""
    if isinstance(obj, type) and obj.__module__ != module_name:
        for base in obj.__mro__[1:]:
            if base.__module__ == module_name and base.__qualname__ == name:
                return base
    return obj


def resolve(target: str, *, import_missing: bool = False) -> Resolved:
    module_name, parts = split_target(target)
    if import_missing and module_name not in sys.modules:
        try:
            importlib.import_module(module_name)
        except Exception as exc:
            return Resolved(target, False, reason=f"cannot import {module_name}: {type(exc).__name__}: {exc}")
    if not _module_ready(module_name):
        return Resolved(target, False, reason=f"module {module_name} is not imported")
    owner: Any = sys.modules[module_name]
    for i, part in enumerate(parts[:-1]):
        nxt = owner.__dict__.get(part) if hasattr(owner, "__dict__") else None
        if nxt is None:
            where = module_name + (":" + ".".join(parts[:i]) if i else "")
            return Resolved(target, False, reason=f"{part!r} not defined in {where}")
        owner = _defined_in(module_name, part, nxt) if i == 0 else nxt
    attr = parts[-1]
    d = getattr(owner, "__dict__", {})
    if attr not in d:
        inherited = ""
        if isinstance(owner, type):
            for base in owner.__mro__[1:]:
                if attr in base.__dict__:
                    inherited = f" (inherited from {base.__module__}.{base.__qualname__})"
                    break
        where = target.split(":")[1].rsplit(".", 1)[0] if len(parts) > 1 else module_name
        return Resolved(
            target,
            False,
            owner=owner,
            attr=attr,
            reason=f"{attr!r} not defined in {where}{inherited}",
        )
    raw = d[attr]
    original = raw
    patched_by = getattr(raw, MARK_ID, None)
    patched_pid = getattr(raw, MARK_PID, None)
    if patched_by is not None:
        original = getattr(raw, MARK_ORIGINAL)
    res = Resolved(
        target, True, owner=owner, attr=attr, raw=raw, original=original, patched_by=patched_by, patched_pid=patched_pid
    )
    try:
        res.fingerprint = fingerprint_object(original)
    except Exception as exc:
        res.reason = f"cannot fingerprint: {exc}"
    return res


# ----------------------------------------------------------------------------------------------------
# Verification, application, rollback, unpatch
# ----------------------------------------------------------------------------------------------------

APPLIED = "applied"
ALREADY = "already-applied"
NATIVE = "native"
DISABLED = "disabled"
OPT_IN = "opt-in"  # an npu-contract patch not named in ZB_PATCH_ENABLE
SUPERSEDED = "superseded"  # an enabled patch of the same target stands in for it
REFUSED = "refused"
PENDING = "pending"
OK = "ok"
ADVISORY = "advisory"  # a known bug of the installed release that zb-patch does not fix


@dataclasses.dataclass
class ItemReport:
    id: str
    target: str
    kind: str  # "patch" | "guard"
    verdict: str  # ok / applied / already-applied / native / disabled / opt-in / superseded / refused / pending
    found: bool = False
    fingerprint: str | None = None
    expected: dict = dataclasses.field(default_factory=dict)
    matched: str | None = None  # label of the matching fingerprint
    reason: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_fingerprint(res: Resolved, expected: Mapping[str, str]) -> tuple[str | None, str]:
    """Return (matching label, "") or (None, reason)."""
    if not res.found:
        return None, f"target not found: {res.reason}"
    if res.fingerprint is None:
        return None, res.reason or "no fingerprint"
    for label, fp in expected.items():
        if fp == res.fingerprint:
            return label, ""
    exp = ", ".join(f"{fp} ({label})" for label, fp in expected.items())
    return None, f"fingerprint mismatch: found {res.fingerprint}, expected {exp}"


def _check_aliases(patch: Patch, original: Any) -> list[tuple[Any, str, str]]:
    """Aliases to rebind, as (module object, name, spec). Raises PatchError on drift."""
    out = []
    for alias in patch.aliases:
        mod_name, parts = split_target(alias)
        if len(parts) != 1:
            raise PatchError(f"alias {alias} must be a module-level name")
        mod = sys.modules.get(mod_name)
        if mod is None:
            continue  # imported later: its `from x import f` will bind the replacement
        if parts[0] not in mod.__dict__:
            raise PatchError(f"alias {alias} not found")
        current = mod.__dict__[parts[0]]
        if current is not original and getattr(current, MARK_ORIGINAL, None) is not original:
            raise PatchError(f"alias {alias} is bound to {current!r}, not to the original of {patch.target}")
        out.append((mod, parts[0], alias))
    return out


def _mark(replacement: Any, patch: Patch, original: Any) -> Any:
    try:
        setattr(replacement, MARK_ID, patch.id)
        setattr(replacement, MARK_ORIGINAL, original)
        setattr(replacement, MARK_PID, os.getpid())
        if isinstance(replacement, types.FunctionType):
            replacement.__wrapped__ = original  # type: ignore[attr-defined]
    except AttributeError as exc:
        raise PatchError(f"patch {patch.id}: replacement {replacement!r} cannot carry markers: {exc}") from exc
    return replacement


@dataclasses.dataclass
class SetReport:
    """Outcome of verifying or applying one adapter's patch set in this process."""

    name: str
    verdict: str  # ok / applied / already-applied / refused / pending / disabled
    items: list[ItemReport]
    reason: str = ""
    pid: int = dataclasses.field(default_factory=os.getpid)

    def by_verdict(self, verdict: str) -> list[str]:
        return [i.id for i in self.items if i.kind == "patch" and i.verdict == verdict]

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "verdict": self.verdict,
            "reason": self.reason,
            "pid": self.pid,
            "items": [i.as_dict() for i in self.items],
        }


class PatchSet:
    """The patches and guards of one adapter, applied together or not at all."""

    def __init__(
        self, name: str, patches: Iterable[Patch], guards: Iterable[Guard] = (), advisories: Iterable[Advisory] = ()
    ):
        self.name = name
        self.patches = tuple(patches)
        self.guards = tuple(guards)
        self.advisories = tuple(advisories)
        self._parts: tuple[PatchSet, ...] | None = None
        ids = [p.id for p in self.patches]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{name}: duplicate patch ids")
        by_target: dict[str, list[Patch]] = {}
        for p in self.patches:
            by_target.setdefault(p.target, []).append(p)
        for target, same in by_target.items():
            if len(same) > 1 and not all(
                q.id in p.supersedes or p.id in q.supersedes for i, p in enumerate(same) for q in same[i + 1 :]
            ):
                raise ValueError(
                    f"{name}: two patches replace the same target {target} and neither supersedes the other"
                )

        def part_of(p: Patch) -> str:
            return split_target(p.target)[0] if ENGINE_ROLE in p.roles else "worker"

        for i, p in enumerate(self.patches):
            for r in p.requires + p.supersedes:
                if r not in ids[:i]:
                    raise ValueError(f"{name}: {p.id} names {r}, which is not listed before it")
                if part_of(self.patches[ids.index(r)]) != part_of(p):
                    raise ValueError(f"{name}: {p.id} names {r}, which is applied in another part (PatchSet.parts)")
            for r in p.supersedes:
                if self.patches[ids.index(r)].target != p.target:
                    raise ValueError(f"{name}: {p.id} supersedes {r}, whose target is another")
                if not p.opt_in:
                    raise ValueError(f"{name}: {p.id} supersedes {r} but is applied by default (only opt-in may)")

    # -- where it is applied -------------------------------------------------------------------
    def parts(self) -> tuple[PatchSet, ...]:
        """The set as it is applied, in order. First the worker part: the patches of role ``worker`` (the runner's,
        in the worker processes), the guards and the advisories, applied all or nothing once all of its modules are
        imported. Then one part per target module of the ``engine`` patches (the scheduler's, in the EngineCore
        process; a module such as vllm-ascend's recompute scheduler is imported only when configured), each applied
        all or nothing once its modules are imported and only after the parts before it were; the engine guards are
        verified with the first. An engine patch's fix is correct without the worker part, so a process that hosts
        the scheduler and no runner gets it too."""
        if self._parts is None:
            self._parts = self._split()
        return self._parts

    def _split(self) -> tuple[PatchSet, ...]:
        engine = [p for p in self.patches if ENGINE_ROLE in p.roles]
        if not engine:
            return (self,)
        engine_guards = [g for g in self.guards if ENGINE_ROLE in g.roles]
        worker = PatchSet(
            self.name,
            [p for p in self.patches if p not in engine],
            [g for g in self.guards if g not in engine_guards],
            self.advisories,
        )
        by_module: dict[str, tuple[list[Patch], list[Guard]]] = {}
        for p in engine:
            by_module.setdefault(split_target(p.target)[0], ([], []))[0].append(p)
        next(iter(by_module.values()))[1].extend(engine_guards)  # verified with the first engine part
        return (worker, *(PatchSet(f"{self.name} engine:{m}", ps, gs) for m, (ps, gs) in by_module.items()))

    def with_groups(self, disabled: Iterable[str]) -> set[str]:
        """``disabled`` (ZB_PATCH_DISABLE) with every patch of a group one of them is in: what a part of this set
        leaves out (a group can span parts)."""
        disabled = set(disabled)
        off = {p.group for p in self.patches if p.group and (p.id in disabled or "*" in disabled)}
        return disabled | {p.id for p in self.patches if p.group in off}

    # -- what is needed --------------------------------------------------------------------------
    def modules(self, enabled: Iterable[str] | None = None) -> list[str]:
        enabled = None if enabled is None else set(enabled)
        mods = []
        for p in self.patches:
            if enabled is None or p.id in enabled:
                mods.append(split_target(p.target)[0])
        for g in self.guards:
            mods.append(split_target(g.target)[0])
        return sorted(set(mods))

    def opted_in(self, enabled: Iterable[str]) -> dict[str, str]:
        """The opt-in patches of this set that ``enabled`` (ZB_PATCH_ENABLE: ids or ``*``) switches on, each with the
        id that named it: a named patch brings its group (patches that only work together) and the opt-in patches
        it requires."""
        enabled = set(enabled)
        by_id = {p.id: p for p in self.patches}
        on: dict[str, str] = {}
        todo = [(p.id, p.id) for p in self.patches if p.opt_in and ("*" in enabled or p.id in enabled)]
        while todo:
            pid, named_by = todo.pop()
            if pid in on:
                continue
            on[pid] = named_by
            p = by_id[pid]
            todo += [(q.id, named_by) for q in self.patches if p.group and q.group == p.group and q.opt_in]
            todo += [(r, named_by) for r in p.requires if by_id[r].opt_in]
        return on

    def select(
        self, versions: Any, disabled: Iterable[str], enabled: Iterable[str] = ()
    ) -> tuple[list[Patch], dict[str, tuple[str, str]]]:
        """Split patches into (to apply, {id: (verdict, reason)} for native / disabled / opt-in / superseded ones)."""
        disabled = set(disabled)
        opted_in = self.opted_in(enabled)
        chosen, skipped = [], {}
        off_groups = {p.group: p.id for p in self.patches if p.group and (p.id in disabled or "*" in disabled)}
        for p in self.patches:
            if "*" in disabled or p.id in disabled:
                skipped[p.id] = (DISABLED, "disabled by ZB_PATCH_DISABLE")
                continue
            if p.group in off_groups:
                skipped[p.id] = (
                    DISABLED,
                    f"disabled with {off_groups[p.group]} (group {p.group!r}: these patches only work together)",
                )
                continue
            if p.opt_in and p.id not in opted_in:
                skipped[p.id] = (
                    OPT_IN,
                    f"opt-in, rests on an NPU contract no NPU run has shown: ZB_PATCH_ENABLE={p.id} applies it",
                )
                continue
            why_native = p.native(versions) if (p.native and versions is not None) else None
            if why_native:
                skipped[p.id] = (NATIVE, why_native)
                continue
            chosen.append(p)
        # a required or superseded patch is listed before the patches that name it
        stands_in = {}  # superseded id -> the chosen patch that stands in for it
        for p in list(chosen):
            missing = [r for r in p.requires if r in skipped and r not in stands_in]
            if missing:
                chosen.remove(p)
                verdict = skipped[missing[0]][0]
                skipped[p.id] = (verdict, f"needs {missing[0]}, which is not applied ({verdict}): it acts through it")
                continue
            for r in p.supersedes:
                stands_in[r] = p.id
                superseded = next((q for q in chosen if q.id == r), None)
                if superseded is not None:
                    chosen.remove(superseded)
                    skipped[r] = (SUPERSEDED, f"superseded by {p.id} (ZB_PATCH_ENABLE), which replaces the same target")
        return chosen, skipped

    # -- verification --------------------------------------------------------------------------
    def verify(
        self,
        versions: Any = None,
        disabled: Iterable[str] = (),
        enabled: Iterable[str] = (),
        *,
        import_missing: bool = False,
    ) -> tuple[SetReport, list[tuple[Patch, Resolved]]]:
        chosen, skipped = self.select(versions, disabled, enabled)
        items: list[ItemReport] = []
        resolved: list[tuple[Patch, Resolved]] = []
        problems: list[str] = []
        pending: list[str] = []
        for g in self.guards:
            res = resolve(g.target, import_missing=import_missing)
            label, why = check_fingerprint(res, g.fingerprints)
            if not res.found and "is not imported" in res.reason:
                verdict = PENDING
                pending.append(g.target)
            else:
                verdict = OK if label else REFUSED
                if not label:
                    problems.append(f"{g.target}: {why}")
            items.append(
                ItemReport(
                    g.id, g.target, "guard", verdict, res.found, res.fingerprint, dict(g.fingerprints), label, why
                )
            )
        for p in self.patches:
            if p.id in skipped:
                verdict, why = skipped[p.id]
                res = resolve(p.target, import_missing=import_missing)
                label, _ = check_fingerprint(res, p.fingerprints)  # reported (doctor's "fp ok"), never required
                items.append(
                    ItemReport(
                        p.id, p.target, "patch", verdict, res.found, res.fingerprint, dict(p.fingerprints), label, why
                    )
                )
                continue
            res = resolve(p.target, import_missing=import_missing)
            label, why = check_fingerprint(res, p.fingerprints)
            native_label = next(
                (
                    lb
                    for lb, fp in p.native_fingerprints.items()
                    if res.found and fp == res.fingerprint and res.patched_by is None
                ),
                None,
            )
            if native_label is not None:
                items.append(
                    ItemReport(
                        p.id,
                        p.target,
                        "patch",
                        NATIVE,
                        True,
                        res.fingerprint,
                        dict(p.fingerprints),
                        native_label,
                        f"the installed code already carries the fix ({native_label})",
                    )
                )
                continue
            if not res.found and "is not imported" in res.reason:
                verdict = PENDING
                pending.append(p.target)
            elif not label:
                verdict = REFUSED
                problems.append(f"{p.target}: {why}")
            else:
                verdict = ALREADY if res.patched_by == p.id else OK
                if res.patched_by and res.patched_by != p.id:
                    verdict, why = REFUSED, f"already replaced by another zb-patch patch {res.patched_by}"
                    problems.append(f"{p.target}: {why}")
            if verdict in (OK, ALREADY):
                try:
                    _check_aliases(p, res.original)
                except PatchError as exc:
                    verdict, why = REFUSED, str(exc)
                    problems.append(f"{p.target}: {why}")
            items.append(
                ItemReport(
                    p.id, p.target, "patch", verdict, res.found, res.fingerprint, dict(p.fingerprints), label, why
                )
            )
            resolved.append((p, res))
        for adv in self.advisories:
            res = resolve(adv.target, import_missing=import_missing)
            hit = next((lb for lb, fp in adv.affected.items() if fp == res.fingerprint), None) if res.found else None
            if hit:
                verdict, why = ADVISORY, adv.message
            elif not res.found and "is not imported" in res.reason:
                verdict, why = PENDING, res.reason
            else:
                verdict, why = OK, "not affected" if res.found else res.reason
            items.append(
                ItemReport(
                    adv.id, adv.target, "advisory", verdict, res.found, res.fingerprint, dict(adv.affected), hit, why
                )
            )
        if problems:
            report = SetReport(self.name, REFUSED, items, "; ".join(problems))
        elif pending:
            report = SetReport(
                self.name, PENDING, items, "waiting for " + ", ".join(sorted(set(split_target(t)[0] for t in pending)))
            )
        else:
            report = SetReport(self.name, OK, items)
        return report, resolved

    # -- application --------------------------------------------------------------------------
    def apply(self, versions: Any = None, disabled: Iterable[str] = (), enabled: Iterable[str] = ()) -> SetReport:
        """Verify everything, then apply everything or nothing (``enabled``: the opt-in patches switched on)."""
        report, resolved = self.verify(versions, disabled, enabled)
        if report.verdict != OK:
            for item in report.items:
                if item.kind == "patch" and item.verdict in (OK, ALREADY):
                    item.verdict = REFUSED if report.verdict == REFUSED else PENDING
                    item.reason = item.reason or f"not applied: {report.reason}"
            return report
        done: list[tuple[Any, str, Any, list]] = []  # (owner, attr, raw original, [(mod, name, old)])
        items = {i.id: i for i in report.items}
        try:
            for patch, res in resolved:
                if res.patched_by == patch.id:
                    items[patch.id].verdict = ALREADY
                    pid = res.patched_pid
                    items[patch.id].reason = (
                        "applied earlier in this process"
                        if pid == os.getpid()
                        else f"inherited from parent process {pid}"
                    )
                    continue
                aliases = _check_aliases(patch, res.original)
                replacement = _mark(patch.make(res.original), patch, res.raw)
                setattr(res.owner, res.attr, replacement)
                rebound: list[tuple[Any, str, Any]] = []
                done.append((res.owner, res.attr, res.raw, rebound))
                for mod, name, _spec in aliases:
                    rebound.append((mod, name, mod.__dict__[name]))
                    setattr(mod, name, replacement)
                items[patch.id].verdict = APPLIED
        except Exception as exc:
            for owner, attr, raw, rebound in reversed(done):
                setattr(owner, attr, raw)
                for mod, name, old in rebound:
                    setattr(mod, name, old)
            for item in report.items:
                if item.kind == "patch" and item.verdict in (APPLIED, OK):
                    item.verdict = REFUSED
                    item.reason = "rolled back"
            report.verdict = REFUSED
            report.reason = f"apply failed and was rolled back: {type(exc).__name__}: {exc}"
            return report
        verdicts = {i.verdict for i in report.items if i.kind == "patch"}
        report.verdict = APPLIED if APPLIED in verdicts else (ALREADY if ALREADY in verdicts else OK)
        return report

    def unpatch(self) -> list[str]:
        """Restore every original this set replaced (wherever it was applied). Returns ids restored."""
        restored = []
        for p in self.patches:
            module_name, parts = split_target(p.target)
            if module_name not in sys.modules:
                continue
            res = resolve(p.target)
            if not res.found or res.patched_by != p.id:
                continue
            original_raw = getattr(res.raw, MARK_ORIGINAL)
            setattr(res.owner, res.attr, original_raw)
            for alias in p.aliases:
                mod_name, (name,) = split_target(alias)
                mod = sys.modules.get(mod_name)
                if mod is not None and mod.__dict__.get(name) is res.raw:
                    setattr(mod, name, original_raw)
            restored.append(p.id)
        return restored
