"""The fingerprint fast path (a function's own lines, see ``registry._function_fingerprint``) against the whole-file
parse, on the REAL vLLM + vllm-ascend sources of this tox env: every target of the adapter, and every function
and method defined in the modules the adapters touch (decorators, properties, nested classes, ``if`` blocks,
multi-line strings of real code)."""

from __future__ import annotations

import ast
import inspect
import linecache
import types

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
from npu_standin.ascend_imports import import_worker_modules  # noqa: E402
from zb_patch import registry as R  # noqa: E402
from zb_patch import versions as V  # noqa: E402
from zb_patch.detect import detect  # noqa: E402

if npu_standin.detect_family() is None:
    pytest.skip(
        "vllm-ascend is not installed in this env (contract tests need a va0xx tox env)", allow_module_level=True
    )


def whole_file_fingerprint(fn: types.FunctionType) -> str:
    """The reference: parse the whole source file and take the def that starts (decorators included) at the
    code object's first line with its name."""
    tree = ast.parse("".join(linecache.getlines(inspect.getsourcefile(fn))))
    code = fn.__code__
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name == code.co_name
            and min([node.lineno] + [d.lineno for d in node.decorator_list]) == code.co_firstlineno
        ):
            return R.fingerprint_node(node)
    raise AssertionError(f"no def of {fn.__qualname__} at line {code.co_firstlineno}")


@pytest.fixture(autouse=True)
def empty_fingerprint_cache(tmp_path, monkeypatch):
    """Computed here, not read from an earlier run's cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))


@pytest.fixture(scope="module")
def selection():
    import_worker_modules()
    return V.select(detect())


def _targets(adapter):
    ps = adapter.patch_set
    return [p.target for p in ps.patches] + [g.target for g in ps.guards] + [a.target for a in ps.advisories]


@pytest.fixture
def no_whole_file_compile(monkeypatch):
    """The fast path must not need the whole-file compile (the exact but slow check) on real code."""

    def refuse(code, filename, lines):
        raise AssertionError(f"{code.co_name} ({filename}): its own lines did not compile to the running code")

    monkeypatch.setattr(R, "_file_compiles_to", refuse)


def test_every_target_of_the_selected_adapter_takes_the_fast_path(selection, no_whole_file_compile):
    if not selection.candidates:
        pytest.skip(f"no adapter for this env: {selection.reason}")
    checked = []
    for target in _targets(selection.candidates[0]):
        res = R.resolve(target)
        assert res.found, res.reason
        fn = R.underlying_function(res.original)
        assert isinstance(fn, types.FunctionType), target
        fast = R._function_fingerprint(fn, inspect.getsourcefile(fn))
        assert fast is not None, f"{target}: the fast path could not isolate the def"
        assert fast == res.fingerprint == whole_file_fingerprint(fn), target
        checked.append(target)
    assert len(checked) >= 5, checked


def _functions_of(module: types.ModuleType):
    """Every function and method defined in ``module`` (class attributes unwrapped as the registry does)."""
    seen: set[int] = set()

    def walk(namespace, depth=0):
        for value in list(vars(namespace).values()):
            if isinstance(value, type):
                if value.__module__ == module.__name__ and depth < 3:
                    yield from walk(value, depth + 1)
                continue
            values = [value.fget, value.fset, value.fdel] if isinstance(value, property) else [value]
            for v in values:
                fn = R.underlying_function(v) if v is not None else None
                if (
                    isinstance(fn, types.FunctionType)
                    and id(fn) not in seen
                    and fn.__code__.co_filename == module.__file__
                ):  # not dataclass-generated code
                    seen.add(id(fn))
                    yield fn

    yield from walk(module)


def test_fast_path_equals_whole_file_on_every_function_of_the_upstream_modules(selection, monkeypatch):
    """Every function: the same fingerprint as the whole-file parse. Where the block alone does not compile to
    the running code (the import-name hint is a superset), the exact whole-file compile decides: counted, and
    bounded, since it is the slow path."""
    import sys

    whole_file_compiles = []
    exact = R._file_compiles_to

    def counted(code, filename, lines):
        whole_file_compiles.append(f"{filename}:{code.co_name}")
        return exact(code, filename, lines)

    monkeypatch.setattr(R, "_file_compiles_to", counted)

    modules = sorted({R.split_target(t)[0] for a in V.adapters() for t in _targets(a)} & set(sys.modules))
    assert modules
    compared, fallbacks = 0, []
    for name in modules:
        for fn in _functions_of(sys.modules[name]):
            if R._function_fingerprint(fn, inspect.getsourcefile(fn)) is None:
                fallbacks.append(f"{name}:{fn.__qualname__}")
            assert R.fingerprint_object(fn) == whole_file_fingerprint(fn), f"{name}:{fn.__qualname__}"
            compared += 1
    assert compared >= 100, compared
    assert not fallbacks, fallbacks
    assert len(whole_file_compiles) <= compared // 20, whole_file_compiles
