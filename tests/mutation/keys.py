"""Mutants by content: what a mutant changes, independent of mutmut's numbering.

mutmut names a mutant ``<module>.x_<function>__mutmut_<N>`` (methods: ``xǁ<Class>ǁ<method>``), with ``N`` counted
in the function's source order: any edit to a function renumbers its mutants, so a name recorded once can later
denote another mutation. Everything zb-patch records about single mutants (the CI sample, the equivalent and
device-only survivors in ``tests/mutation/classes.toml``) names them by content instead:

* ``where``: ``<file>::<Class.method>`` or ``<file>::<function>``;
* ``was`` / ``now``: the source lines the mutation removes and adds, each stripped, joined by newlines;
* ``nth``: 2, 3, ... only where one function holds the same mutation more than once (counted in source order).

``content_keys`` generates a file's mutants with mutmut's own generator (the configuration of the current
directory's ``pyproject.toml``: what the run mutates) and maps each name to its key.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, order=True)
class Key:
    where: str
    was: str
    now: str
    nth: int = 1

    def describe(self) -> str:
        nth = f" (#{self.nth})" if self.nth > 1 else ""
        return f"{self.where}: {self.was!r} -> {self.now!r}{nth}"

    @classmethod
    def from_entry(cls, entry: dict) -> Key:
        return cls(entry["where"], entry["was"].strip(), entry["now"].strip(), int(entry.get("nth", 1)))


def _changed_lines(diff: str) -> tuple[str, str]:
    lines = diff.splitlines()[2:]  # past the ---/+++ header
    was = [line[1:].strip() for line in lines if line.startswith("-")]
    now = [line[1:].strip() for line in lines if line.startswith("+")]
    return "\n".join(was), "\n".join(now)


def _where(path: str, mutant: str) -> str:
    from mutmut.utils.format_utils import orig_function_and_class_names_from_key

    function, cls = orig_function_and_class_names_from_key(mutant)
    return f"{path}::{cls}.{function}" if cls else f"{path}::{function}"


def file_keys(path: str) -> dict[str, Key]:
    """Every mutant of ``path`` (relative to the current directory, which holds the run's ``pyproject.toml``):
    mutmut's name -> its content key."""
    import libcst as cst
    from mutmut.mutation.diff_apply import generated_function_names
    from mutmut.mutation.file_mutation import mutate_file_contents
    from mutmut.utils.format_utils import get_mutant_name

    mutated = mutate_file_contents(path, Path(path).read_text())
    functions = {}  # every generated function by name, from one parse of the mutated file
    for node in cst.parse_module(mutated.code).body:
        members = node.body.body if isinstance(node, cst.ClassDef) else [node]
        functions.update({f.name.value: f for f in members if isinstance(f, cst.FunctionDef)})

    def source(name: str) -> list[str]:
        neutral = functions[name].with_changes(name=cst.Name("f"), leading_lines=[])
        return cst.Module([neutral]).code.strip().splitlines()

    seen: dict[tuple[str, str, str], int] = {}
    out = {}
    for short in mutated.mutant_names:  # source order within each function
        name = get_mutant_name(Path(path), short)
        original, mutant = generated_function_names(name)
        diff = difflib.unified_diff(source(original), source(mutant), lineterm="")
        was, now = _changed_lines("\n".join(diff))
        base = (_where(path, name), was, now)
        seen[base] = seen.get(base, 0) + 1
        out[name] = Key(*base, seen[base])
    return out


def content_keys(paths: list[str], cache: Path | None = None) -> dict[str, Key]:
    """``file_keys`` of several files; ``cache`` (a JSON file) keeps each file's keys by the hash of its source and
    of the mutmut configuration."""
    config = hashlib.sha256(Path("pyproject.toml").read_bytes()).hexdigest()
    stored = json.loads(cache.read_text()) if cache and cache.exists() else {}
    out: dict[str, Key] = {}
    for path in paths:
        digest = hashlib.sha256(Path(path).read_bytes() + config.encode()).hexdigest()
        entry = stored.get(path)
        if not entry or entry["sha"] != digest:
            entry = {"sha": digest, "keys": {n: k.__dict__ for n, k in file_keys(path).items()}}
            stored[path] = entry
        out.update({name: Key(**fields) for name, fields in entry["keys"].items()})
    if cache:
        cache.write_text(json.dumps(stored))
    return out
