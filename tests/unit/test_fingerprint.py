import ast
import inspect
import json
import linecache
import os
import subprocess
import sys
import textwrap

import pytest

from zb_patch import registry as R
from zb_patch.registry import (
    Patch,
    PatchError,
    PatchSet,
    fingerprint_node,
    fingerprint_object,
    fingerprint_source,
    underlying_function,
)


def _fp(src, qual):
    return fingerprint_source(textwrap.dedent(src), qual)


def test_layout_comments_and_docstrings_do_not_matter():
    a = _fp(
        '''
    def f(x, y=1):
        """Doc."""
        return x + y  # comment
    ''',
        "f",
    )
    b = _fp(
        """
    def f(x,
          y=1):
        # another comment
        return (x + y)
    """,
        "f",
    )
    assert a == b and len(a) == 16


@pytest.mark.parametrize(
    "changed",
    [
        "def f(x, y=2):\n    return x + y\n",  # default
        "def f(x, y=1):\n    return x - y\n",  # operator
        "def f(x, z=1):\n    return x + z\n",  # name
        "@staticmethod\ndef f(x, y=1):\n    return x + y\n",  # decorator
    ],
)
def test_code_changes_change_the_fingerprint(changed):
    assert _fp("def f(x, y=1):\n    return x + y\n", "f") != _fp(changed, "f")


def test_nested_qualname_and_absent_names():
    src = "class A:\n    def m(self):\n        return 1\n    class B:\n        def m(self):\n            return 2\n"
    assert _fp(src, "A.m") != _fp(src, "A.B.m")
    assert _fp(src, "A.nope") is None
    assert _fp(src, "Z") is None


def test_last_definition_wins_as_at_runtime():
    src = "def f():\n    return 1\n\ndef f():\n    return 2\n"
    assert _fp(src, "f") == _fp("def f():\n    return 2\n", "f")


def test_live_object_and_source_agree(upstream):
    mod = upstream.load()
    src = (upstream.root / upstream.pkg / "runner.py").read_text()
    for qual, obj in [
        ("helper", mod.helper),
        ("Runner.step", mod.Runner.__dict__["step"]),
        ("Runner.pure", mod.Runner.__dict__["pure"]),
        ("Runner.build", mod.Runner.__dict__["build"]),
    ]:
        assert fingerprint_object(obj) == fingerprint_source(src, qual), qual


def test_bom_source_file(upstream):
    upstream.write("bom", "\ufeffdef g():\n    return 3\n")
    mod = upstream.load("bom")
    assert fingerprint_object(mod.g) == fingerprint_source("def g():\n    return 3\n", "g")


def test_underlying_function_unwraps_descriptors(upstream):
    mod = upstream.load()
    raw = mod.Runner.__dict__["pure"]
    assert isinstance(raw, staticmethod)
    assert underlying_function(raw) is raw.__func__


def test_object_without_source_is_a_patch_error():
    with pytest.raises(PatchError):
        fingerprint_object(len)


def test_method_with_multiline_string_agrees_with_source(upstream):
    # Regression: re-parsing a dedented getsource() snippet changes multi-line string constants
    # (dedent strips their indentation too) and so gave a different fingerprint than the source tree.
    src = (
        "class K:\n"
        "    def m(self):\n"
        "        msg = '''first\n"
        "continued at column 0\n"
        "        indented'''\n"
        "        return msg\n"
        "\n"
        "    @staticmethod\n"
        "    def s():\n"
        "        return 1\n"
    )
    upstream.write("strings", src)
    mod = upstream.load("strings")
    assert fingerprint_object(mod.K.__dict__["m"]) == fingerprint_source(src, "K.m")
    assert fingerprint_object(mod.K.__dict__["s"]) == fingerprint_source(src, "K.s")
    assert fingerprint_object(mod.K) == fingerprint_source(src, "K")


def test_functools_wraps_decorated_method_agrees_with_source(upstream):
    src = (
        "import functools\n"
        "def deco(f):\n"
        "    @functools.wraps(f)\n"
        "    def inner(*a, **k):\n"
        "        return f(*a, **k)\n"
        "    return inner\n"
        "class K:\n"
        "    @deco\n"
        "    def m(self):\n"
        "        return 1\n"
    )
    upstream.write("decorated", src)
    mod = upstream.load("decorated")
    assert fingerprint_object(mod.K.__dict__["m"]) == fingerprint_source(src, "K.m")
    # the decorator is part of the fingerprint
    assert fingerprint_source(src, "K.m") != fingerprint_source(src.replace("    @deco\n", ""), "K.m")


def test_fingerprint_in_tree_follows_reexports_like_the_running_process(tmp_path):
    """A module that re-exports a class (``from x import K``) resolves to the defining module at run time
    (registry.resolve goes through the module namespace); fingerprint_in_tree does the same."""
    from zb_patch.versions import fingerprint_in_tree

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "base.py").write_text("class K:\n    def m(self):\n        return 1\n")
    (pkg / "absolute.py").write_text("from pkg.base import K\n")
    (pkg / "relative.py").write_text("from .base import K as L\n")
    (pkg / "shadowed.py").write_text("from pkg.base import K\n\nclass K:\n    def m(self):\n        return 2\n")
    want = fingerprint_in_tree(str(tmp_path), "pkg.base:K.m")
    assert want is not None
    assert fingerprint_in_tree(str(tmp_path), "pkg.absolute:K.m") == want
    assert fingerprint_in_tree(str(tmp_path), "pkg.relative:L.m") == want
    assert fingerprint_in_tree(str(tmp_path), "pkg.shadowed:K.m") == _fp("def m(self):\n    return 2\n", "m")
    assert fingerprint_in_tree(str(tmp_path), "pkg.absolute:K.m", follow_reexports=False) is None
    assert fingerprint_in_tree(str(tmp_path), "pkg.absolute:K.nope") is None
    assert fingerprint_in_tree(str(tmp_path), "pkg.relative:K.m") is None


# --- the fast path: a function's own lines, not the whole file --------------------------------------------

TRICKY_SRC = '''\
from __future__ import annotations

import functools


def deco(*args, **kw):
    def wrap(f):
        @functools.wraps(f)
        def inner(*a, **k):
            return f(*a, **k)
        return inner
    return wrap


FLAG = True


@deco(
    1,
    2,
)
@deco()
def decorated(x: int) -> int:
    return x


def one_liner(x): return x + 1


def column_0_continuations(a):
    text = """
column 0 inside a string
"""
    total = (a +
1)
    other = a + \\
2
# a comment at column 0 inside the body
    return text, total, other


if FLAG:
    def in_if(x):
        return x * 2
else:
    def in_if(x):
        return x * 3

try:
    def in_try():
        return "t"
except Exception:
    pass


class Outer:
    class Inner:
        def mangled(self):
            return self.__secret

        class Deepest:
            async def am(self):
                return 1

    if FLAG:
        def conditional(self):
            return super().conditional()

    @property
    def prop(self):
        return 1

    @prop.setter
    def prop(self, value):
        self._v = value

    @staticmethod
    def s(): return 2

    @classmethod
    @deco()
    def c(cls):
        return cls

    def __private(self):
        return self.__x
def after_class_at_column_0():
    return 1


def make_closure(n):
    def closure():
        return n
    return closure


lam = lambda x: x


def last_without_newline():
    return 9'''


def whole_file_fingerprint(src, fn):
    """The reference: the def in the whole parsed file that starts (decorators included) at the code
    object's first line, with its name."""
    code = fn.__code__
    for node in ast.walk(ast.parse(src)):
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name == code.co_name
            and min([node.lineno] + [d.lineno for d in node.decorator_list]) == code.co_firstlineno
        ):
            return fingerprint_node(node)
    raise AssertionError(f"no def of {fn.__qualname__}")


def _tricky(upstream, src=TRICKY_SRC, name="tricky"):
    (upstream.root / upstream.pkg / f"{name}.py").write_text(src)  # as is: no dedent, no trailing newline
    return upstream.load(name)


def _tricky_functions(mod):
    outer = mod.Outer
    return {
        "decorated": mod.decorated,
        "one_liner": mod.one_liner,
        "column_0_continuations": mod.column_0_continuations,
        "in_if": mod.in_if,
        "in_try": mod.in_try,
        "Inner.mangled": outer.Inner.__dict__["mangled"],
        "Deepest.am": outer.Inner.Deepest.__dict__["am"],
        "conditional": outer.__dict__["conditional"],
        "prop.fget": outer.__dict__["prop"].fget,
        "prop.fset": outer.__dict__["prop"].fset,
        "s": outer.__dict__["s"],
        "c": outer.__dict__["c"],
        "__private": outer.__dict__["_Outer__private"],
        "after_class_at_column_0": mod.after_class_at_column_0,
        "make_closure": mod.make_closure,
        "last_without_newline": mod.last_without_newline,
    }


def test_fast_path_equals_the_whole_file_parse_on_tricky_definitions(upstream):
    mod = _tricky(upstream)
    path = inspect.getsourcefile(mod)
    for label, obj in _tricky_functions(mod).items():
        fn = underlying_function(obj)
        assert R._function_fingerprint(fn, path) is not None, f"{label}: fast path not taken"
        assert fingerprint_object(obj) == whole_file_fingerprint(TRICKY_SRC, fn), label
    assert mod.in_if(1) == 2  # the `if` branch is the one that runs, and the one fingerprinted


def test_tab_indented_methods_take_the_fast_path(upstream):
    src = "class T:\n\tdef m(self):\n\t\treturn '''a\nb'''\n\n\tdef n(self):\n\t\treturn 2\n"
    mod = _tricky(upstream, src, "tabs")
    for name in ("m", "n"):
        fn = mod.T.__dict__[name]
        assert R._function_fingerprint(fn, inspect.getsourcefile(mod)) is not None
        assert fingerprint_object(fn) == fingerprint_source(src, f"T.{name}")


def test_closures_and_lambdas_use_the_whole_file_as_before(upstream):
    mod = _tricky(upstream)
    closure = mod.make_closure(3)
    assert (
        R._function_fingerprint(closure, inspect.getsourcefile(mod)) is None
    )  # its free variable needs the enclosing scope
    assert fingerprint_object(closure) == whole_file_fingerprint(TRICKY_SRC, closure)
    with pytest.raises(PatchError, match="cannot locate the definition"):
        fingerprint_object(mod.lam)


# --- a source file that changed after the import must not vouch for the running code ----------------------

GOOD = "class Runner:\n    def step(self, x):\n        return x + 1\n\n    def other(self):\n        return 0\n"
DRIFTED = GOOD.replace("x + 1", "x + 2")


def _rewrite(mod, src):
    path = inspect.getsourcefile(mod)
    with open(path, "w") as fh:
        fh.write(src)
    linecache.checkcache(path)  # as in a fresh process: the lines are read from the file as it is now
    return path


def test_body_changed_after_import_raises(upstream):
    mod = _tricky(upstream, GOOD, "changed")
    before = fingerprint_object(mod.Runner.__dict__["step"])
    _rewrite(mod, DRIFTED)
    with pytest.raises(PatchError, match="is not the code running in this process"):
        fingerprint_object(mod.Runner.__dict__["step"])
    assert fingerprint_object(mod.Runner.__dict__["other"]) == fingerprint_source(GOOD, "Runner.other")
    assert before == fingerprint_source(GOOD, "Runner.step")


def test_file_restored_to_the_recorded_code_does_not_let_running_drifted_code_pass(upstream):
    """The running code drifted; the file on disk now holds the recorded version: refused, nothing applied."""
    mod = _tricky(upstream, DRIFTED, "restored")
    running = mod.Runner.__dict__["step"]
    _rewrite(mod, GOOD)
    patch = Patch(
        id="p",
        target=upstream.target("Runner.step", "restored"),
        make=lambda orig: orig,
        fingerprints={"recorded": fingerprint_source(GOOD, "Runner.step")},
        why="t",
        upstream=("#0",),
        remove_when="never",
        rests_on=R.RestsOn(R.HOST, "the test's own code"),
    )
    report = PatchSet("t", [patch]).apply()
    assert report.verdict == R.REFUSED
    assert "is not the code running in this process" in report.reason
    assert mod.Runner.__dict__["step"] is running


def test_lines_shifted_after_import_refuse(upstream):
    mod = _tricky(upstream, GOOD, "shifted")
    _rewrite(mod, "# a new first line\n" + GOOD)
    with pytest.raises(PatchError, match="cannot locate the definition"):
        fingerprint_object(mod.Runner.__dict__["step"])


def test_drifted_function_is_refused_by_fingerprint(upstream):
    mod = _tricky(upstream, DRIFTED, "drifted")
    patch = Patch(
        id="p",
        target=upstream.target("Runner.step", "drifted"),
        make=lambda orig: orig,
        fingerprints={"recorded": fingerprint_source(GOOD, "Runner.step")},
        why="t",
        upstream=("#0",),
        remove_when="never",
        rests_on=R.RestsOn(R.HOST, "the test's own code"),
    )
    report = PatchSet("t", [patch]).apply()
    assert report.verdict == R.REFUSED and "fingerprint mismatch" in report.reason
    assert R._function_fingerprint(mod.Runner.__dict__["step"], inspect.getsourcefile(mod)) is not None


# --- the fingerprint cache --------------------------------------------------------------------------------


def _cache_file():
    return R.fingerprint_cache_path()


def test_cache_hit_skips_parsing_and_gives_the_same_fingerprint(upstream, monkeypatch):
    mod = _tricky(upstream)
    fn = mod.Outer.__dict__["c"]
    computed = fingerprint_object(fn)
    with open(_cache_file()) as fh:
        assert computed in json.load(fh).values()
    R._CACHE = None  # as a fresh process: read from the file

    parsed = []
    with monkeypatch.context() as m:
        m.setattr(R, "fingerprint_node", lambda node: parsed.append(node))
        assert fingerprint_object(fn) == computed
    assert parsed == []  # nothing parsed and dumped: read from the cache
    assert computed == whole_file_fingerprint(TRICKY_SRC, underlying_function(fn))
    assert oct(os.stat(_cache_file()).st_mode & 0o777) == "0o600"


def test_cache_entry_never_vouches_for_changed_code(upstream):
    """The recorded fingerprint is cached; the file then changes: a new key, computed, refused."""
    mod = _tricky(upstream, GOOD, "cached_then_changed")
    step = mod.Runner.__dict__["step"]
    assert fingerprint_object(step) == fingerprint_source(GOOD, "Runner.step")
    _rewrite(mod, DRIFTED)
    R._CACHE = None
    with pytest.raises(PatchError, match="is not the code running in this process"):
        fingerprint_object(step)


def test_cache_key_covers_the_code_the_text_compiled_to():
    text = "def f():\n    return 1\n"
    one, two = compile(text, "a.py", "exec").co_consts[0], compile("\n" + text, "a.py", "exec").co_consts[0]
    assert R._code_digest(one) == R._code_digest(compile(text, "b.py", "exec").co_consts[0])
    assert R._cache_key(text, R._code_digest(one)) != R._cache_key(text, R._code_digest(two))  # line numbers
    other = compile(text.replace("1", "2"), "a.py", "exec").co_consts[0]
    assert R._code_digest(one) != R._code_digest(other)


def test_unwritable_cache_directory_only_means_no_caching(upstream, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "below-a-file"))  # makedirs fails, even as root
    mod = _tricky(upstream, GOOD, "uncached")
    assert fingerprint_object(mod.Runner.__dict__["step"]) == fingerprint_source(GOOD, "Runner.step")
    assert not os.path.exists(R.fingerprint_cache_path())


def test_corrupt_cache_file_counts_as_empty_and_is_rewritten(upstream):
    path = R.fingerprint_cache_path()
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as fh:
        fh.write('{"truncated": ')
    mod = _tricky(upstream, GOOD, "corrupt")
    assert fingerprint_object(mod.Runner.__dict__["step"]) == fingerprint_source(GOOD, "Runner.step")
    with open(path) as fh:
        assert list(json.load(fh).values()) == [fingerprint_source(GOOD, "Runner.step")]


def test_concurrent_writers_leave_a_valid_file(tmp_path):
    """Processes that write at the same moment: the file is always complete JSON, each entry one of theirs."""
    script = (
        "import sys\n"
        "from zb_patch import registry as R\n"
        "cache = R._FingerprintCache(sys.argv[1])\n"
        "for i in range(40):\n"
        "    cache.put(f'{sys.argv[2]}{i:02d}'.ljust(64, '0'), f'{i:016x}')\n"
    )
    path = str(tmp_path / "zb-patch" / "fingerprints.json")
    procs = [subprocess.Popen([sys.executable, "-c", script, path, str(n)]) for n in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    with open(path) as fh:
        entries = json.load(fh)
    assert entries and all(k[0] in "0123" and v == f"{int(k[1:3]):016x}" for k, v in entries.items())
    assert not [f for f in os.listdir(os.path.dirname(path)) if f.startswith(".fingerprints-")]


def _zb_patch_sources():
    pkg = os.path.dirname(R.__file__)
    for dirpath, _, files in os.walk(pkg):
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name)) as fh:
                    yield name, ast.parse(fh.read())


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="ast.dump's own text is the reference only up to 3.11")
def test_canonical_dump_is_ast_dump_up_to_python_311():
    """The recorded fingerprints hash 3.11's ast.dump: canonical_dump must print exactly that (zb-patch's own sources
    as the corpus: every node kind it uses, f-strings with format specs included)."""
    for name, tree in _zb_patch_sources():
        assert R.canonical_dump(tree) == ast.dump(tree, annotate_fields=True, include_attributes=False), name


def test_canonical_dump_ignores_what_newer_pythons_add(monkeypatch):
    """Python 3.12 gives every def / class a `type_params` field (empty without `def f[T]`) and ends an f-string's
    format spec that ends in a field with `Constant('')`. Built here as 3.12 builds them: the dump, and so the
    fingerprint, is the 3.11 one."""
    src = 'def f(x, w):\n    return f"a{{b{x!r:>{w}}}}c" + f"{x:{w}}"\n'
    reference = R.canonical_dump(ast.parse(src))
    for cls in (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef):
        if "type_params" not in cls._fields:  # Python < 3.12: the node classes as 3.12 declares them
            monkeypatch.setattr(cls, "_fields", (*cls._fields, "type_params"))
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            node.type_params = []
        if isinstance(node, ast.JoinedStr):
            node.values = [*node.values, ast.Constant(value="")]
            # a literal run split in two, as a different tokenizer may deliver it
            for i, value in enumerate(node.values):
                if isinstance(value, ast.Constant) and len(value.value) > 1:
                    node.values[i : i + 1] = [ast.Constant(value=value.value[:1]), ast.Constant(value=value.value[1:])]
                    break
    assert R.canonical_dump(tree) == reference
    # a type parameter list that is there changes the code, and the dump
    tree.body[0].type_params = [ast.Name(id="T", ctx=ast.Load())]
    assert "type_params=[Name(id='T', ctx=Load())]" in R.canonical_dump(tree)


@pytest.mark.parametrize(
    "changed",
    ["def f(x) -> int:\n    return f'a{x}'\n", "def f(x):\n    return f'b{x}'\n", "def f(x):\n    return f'a{x!r}'\n"],
)
def test_canonical_dump_keeps_what_changes_the_code(changed):
    """A return annotation (an optional field that is set), an f-string's literal text, a conversion."""
    assert R.canonical_dump(ast.parse("def f(x):\n    return f'a{x}'\n")) != R.canonical_dump(ast.parse(changed))
