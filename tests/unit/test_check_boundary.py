"""The diagnostics boundary, read from the source: nothing the plugin can reach imports ``zb_patch.check``.

The import graph is built from every ``import`` statement of every module of the package, module level and
inside functions alike (a lazy import on the activation path counts). tests/lifecycle/test_check_boundary.py
checks the same in a real process after activation.
"""

from __future__ import annotations

import ast
from pathlib import Path

import zb_patch

PACKAGE_DIR = Path(zb_patch.__file__).parent
CHECK = "zb_patch.check"


def _module_name(path: Path) -> str:
    parts = ["zb_patch", *path.relative_to(PACKAGE_DIR).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> list[tuple[str, bool]]:
    """(imported zb_patch module, at module level?) for every import statement of module ``name``."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    package = name if _is_package(name) else name.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    found: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            if target in MODULES:
                found.append((target, id(node) in top_level))
    return found


def _reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(target for target, _ in _imports(name))
        parent = name.rpartition(".")[0]
        if parent:  # importing a submodule runs its package's __init__
            todo.append(parent)
    return seen


def test_the_graph_sees_lazy_imports():
    # the CLI reaches the diagnostics only through imports inside its command functions
    assert ("zb_patch.check", False) in _imports("zb_patch.cli")
    assert CHECK in _reachable("zb_patch.cli")


def test_the_activation_path_never_reaches_the_diagnostics():
    reachable = _reachable("zb_patch.plugin")
    assert "zb_patch.versions" in reachable and "zb_patch.registry" in reachable
    assert not [m for m in reachable if m == CHECK or m.startswith(CHECK + ".")]
    assert "zb_patch.cli" not in reachable


def test_only_the_cli_imports_the_diagnostics_and_only_lazily():
    importers = {}
    for name in MODULES:
        if name == CHECK or name.startswith(CHECK + "."):
            continue
        hits = [(t, top) for t, top in _imports(name) if t == CHECK or t.startswith(CHECK + ".")]
        if hits:
            importers[name] = hits
    assert set(importers) == {"zb_patch.cli"}
    assert not [t for t, top in importers["zb_patch.cli"] if top], "zb_patch.cli imports zb_patch.check at module level"


def _names_taken_from_ancestors(name: str) -> list[str]:
    """``package.name`` for every name module ``name`` imports from a package above it (its own package included)
    that is not a submodule: a name defined in that package's ``__init__``, i.e. an import back up."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = f"{anchor}.{base}" if base else anchor
        if base in MODULES and _is_package(base) and (name == base or name.startswith(base + ".")) and base != name:
            found += [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" not in MODULES]
    return found


def test_no_module_imports_a_name_back_up_from_a_package_above_it():
    """An adapter module takes the adapter types from versions.adapter and the source-tree fingerprints from
    versions.source, never from the table in versions/__init__ (which imports the adapters); the diagnostics take
    run_command from zb_patch.console, never from the CLI that imports them. Submodules are fine (``from . import
    fixes``); the package version (``zb_patch.__version__``) is the one name the package root exports. A
    ``__main__`` (an entry point: it runs after its package and nothing imports it) may use its package's API."""
    up = {n: hits for n in MODULES if not n.endswith(".__main__") and (hits := _names_taken_from_ancestors(n))}
    allowed = {"zb_patch.__version__"}
    assert {n: h for n, h in up.items() if set(h) - allowed} == {}
    assert "zb_patch.versions.adapter" in MODULES and "zb_patch.versions.source" in MODULES


def test_the_diagnostics_never_import_the_cli():
    """check/ is imported by the CLI (lazily); it reaches the CLI's helpers through zb_patch.console instead."""
    for name in MODULES:
        if name == CHECK or name.startswith(CHECK + "."):
            assert "zb_patch.cli" not in {t for t, _ in _imports(name)}, name
    assert ("zb_patch.console", True) in _imports("zb_patch.check.selftest.__main__")
