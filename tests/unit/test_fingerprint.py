import textwrap

import pytest

from zb_patch.registry import PatchError, fingerprint_object, fingerprint_source, underlying_function


def _fp(src, qual):
    return fingerprint_source(textwrap.dedent(src), qual)


def test_layout_comments_and_docstrings_do_not_matter():
    a = _fp('''
    def f(x, y=1):
        """Doc."""
        return x + y  # comment
    ''', "f")
    b = _fp('''
    def f(x,
          y=1):
        # another comment
        return (x + y)
    ''', "f")
    assert a == b and len(a) == 16


@pytest.mark.parametrize("changed", [
    "def f(x, y=2):\n    return x + y\n",          # default
    "def f(x, y=1):\n    return x - y\n",          # operator
    "def f(x, z=1):\n    return x + z\n",          # name
    "@staticmethod\ndef f(x, y=1):\n    return x + y\n",  # decorator
])
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
    for qual, obj in [("helper", mod.helper), ("Runner.step", mod.Runner.__dict__["step"]),
                      ("Runner.pure", mod.Runner.__dict__["pure"]), ("Runner.build", mod.Runner.__dict__["build"])]:
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
