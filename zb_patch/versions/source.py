"""Fingerprints of upstream functions read from a source tree (site-packages, an unpacked wheel, a git checkout),
without importing it. Used by native-form checks (:mod:`zb_patch.versions.native`), tree verdicts and
``zb-patch fingerprints``. This module imports nothing from its package.
"""

from __future__ import annotations

import ast
import copy
import functools
import os

from ..registry import find_node, fingerprint_node, split_target


def module_file(root: str, module: str) -> str | None:
    base = os.path.join(root, *module.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.exists(path):
            return path
    return None


def fingerprint_in_tree(root: str, target: str, *, follow_reexports: bool = True, _depth: int = 0) -> str | None:
    """Fingerprint of ``target`` in a source tree (site-packages, unpacked wheel, git checkout).

    Resolves like the running process does (through the module's namespace): when the module does not define
    the target's first name but binds it with a module-level ``from X import Name`` (a re-export, e.g.
    ``vllm_ascend.spec_decode.eagle_proposer`` re-exports ``AscendSpecDecodeBaseProposer`` from
    ``llm_base_proposer`` since vllm-ascend 0.20.2rc1), the definition in ``X`` is fingerprinted, as
    ``registry.resolve`` + ``fingerprint_object`` would. ``follow_reexports=False``: only definitions in that
    very file count (docs/releases/fingerprint_matrix.py reports re-exports as absent).
    """
    module, parts = split_target(target)
    path = module_file(root, module)
    if path is None:
        return None
    tree = _parsed(path, os.stat(path).st_mtime_ns)
    node = find_node(tree, parts)
    fp = None if node is None else fingerprint_node(copy.deepcopy(node))  # it strips docstrings in place
    if fp is not None or not follow_reexports or _depth >= 4:
        return fp
    origin = _reexport_origin(tree, module, path.endswith("__init__.py"), parts[0])
    if origin is None:
        return None
    src_module, src_name = origin
    return fingerprint_in_tree(root, f"{src_module}:{'.'.join((src_name, *parts[1:]))}", _depth=_depth + 1)


@functools.lru_cache(maxsize=16)
def _parsed(path: str, mtime_ns: int) -> ast.Module:
    """One parse per file version: a runner module is ~4,000 lines and several targets live in it."""
    with open(path, encoding="utf-8-sig") as fh:
        return ast.parse(fh.read())


def _reexport_origin(tree: ast.Module, module: str, is_package: bool, name: str) -> tuple[str, str] | None:
    """(module, name) that a module-level ``from X import ...`` binds to ``name``, if the last module-level
    binding of ``name`` is such an import (a later def/class would win at run time)."""
    origin: tuple[str, str] | None = None
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
            origin = None
        elif isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if (alias.asname or alias.name) == name and alias.name != "*":
                    if stmt.level:
                        base = module.split(".") if is_package else module.split(".")[:-1]
                        base = base[: len(base) - (stmt.level - 1)] if stmt.level > 1 else base
                        src = ".".join(base + ([stmt.module] if stmt.module else []))
                    else:
                        src = stmt.module or ""
                    origin = (src, alias.name) if src else None
    return origin
