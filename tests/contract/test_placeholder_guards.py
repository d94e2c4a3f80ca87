"""The vLLM guards against a ``-1`` draft placeholder that the stale-draft-placeholders texts rest on
(``native.PLACEHOLDER_GUARDS``, read from the sdists; the advisory / why wording per vLLM release is asserted in
tests/unit/test_native_advisories.py), checked against the installed release's own source files (parsed, not
imported):

* vLLM #47029: ``GPUModelRunner._preprocess`` clamps the input ids (``.clamp_(min=0)``) before the embedding;
* vLLM #46533: ``rejection_greedy_sample_kernel`` accepts only ``draft_token_id >= 0`` (synthetic branch) and
  ``rejection_random_sample_kernel`` rejects ``draft_token_id < 0``;
* the NPU runner reaches vLLM's clamp only where it has no ``_preprocess`` of its own (vllm-ascend 0.25.1rc1 on;
  0.19.1rc1 .. 0.24.0rc1 override it, without a clamp).
"""

from __future__ import annotations

import ast
import importlib.metadata
import os

import pytest

from zb_patch.versions import native

VLLM = importlib.metadata.version("vllm")
if VLLM not in native.PLACEHOLDER_GUARDS:
    pytest.skip(f"vLLM {VLLM}: not among the releases native.PLACEHOLDER_GUARDS records", allow_module_level=True)


def _module(root: str, *parts: str) -> ast.Module:
    with open(os.path.join(root, *parts), encoding="utf-8") as fh:
        return ast.parse(fh.read())


def _function(tree: ast.AST, name: str, cls: str | None = None) -> ast.AST | None:
    scope = tree
    if cls is not None:
        scope = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls), None)
        if scope is None:
            return None
        body = scope.body  # the class's own methods, not an inherited one
        return next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    return next((n for n in ast.walk(scope) if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _clamps_input_ids(fn: ast.AST | None) -> bool:
    """A ``<...input_ids...>.clamp_(min=0)`` call in ``fn``."""
    for node in ast.walk(fn) if fn is not None else ():
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "clamp_":
            min_zero = any(
                k.arg == "min" and isinstance(k.value, ast.Constant) and k.value.value == 0 for k in node.keywords
            )
            if min_zero and "input_ids" in ast.unparse(node.func.value):
                return True
    return False


def _compares_draft_id(fn: ast.AST | None, op: type, value: int) -> bool:
    """A ``draft_token_id <op> <value>`` comparison in ``fn``."""
    for node in ast.walk(fn) if fn is not None else ():
        if (
            isinstance(node, ast.Compare)
            and isinstance(node.left, ast.Name)
            and node.left.id == "draft_token_id"
            and len(node.ops) == 1
            and isinstance(node.ops[0], op)
            and isinstance(node.comparators[0], ast.Constant)
            and node.comparators[0].value == value
        ):
            return True
    return False


def _present(vllm_root: str) -> set[str]:
    runner = _module(vllm_root, "vllm", "v1", "worker", "gpu_model_runner.py")
    sampler = _module(vllm_root, "vllm", "v1", "sample", "rejection_sampler.py")
    found = set()
    if _clamps_input_ids(_function(runner, "_preprocess", cls="GPUModelRunner")):
        found.add("vllm#47029")
    greedy = _function(sampler, "rejection_greedy_sample_kernel")
    random = _function(sampler, "rejection_random_sample_kernel")
    if _compares_draft_id(greedy, ast.GtE, 0) and _compares_draft_id(random, ast.Lt, 0):
        found.add("vllm#46533")
    return found


def test_recorded_guards_are_the_installed_vllm_s():
    root = native.installed_vllm_root()
    assert root is not None
    assert _present(root) == set(native.PLACEHOLDER_GUARDS[VLLM]), VLLM


def test_the_npu_runner_reaches_vllm_s_clamp_exactly_where_it_is_recorded():
    """With #47029 recorded the NPU runner must inherit vLLM's _preprocess (else the clamp never runs and the wording
    "wasted verification" is wrong); without it, a _preprocess of the runner's own must not clamp either (else the
    wording "crash" is)."""
    root = native.installed_root()
    assert root is not None
    runner = _module(root, "vllm_ascend", "worker", "model_runner_v1.py")
    own = _function(runner, "_preprocess", cls="NPUModelRunner")
    if "vllm#47029" in native.PLACEHOLDER_GUARDS[VLLM]:
        assert own is None
    else:
        assert not _clamps_input_ids(own)


def test_the_readers_see_what_they_look_for():
    """The AST readers on the two forms each guard takes, with and without it: a check that cannot fail proves
    nothing."""
    with_clamp = ast.parse(
        "class GPUModelRunner:\n"
        "    def _preprocess(self, n):\n"
        "        if self.speculative_config is not None:\n"
        "            self.input_ids.gpu[:n].clamp_(min=0)\n"
    )
    assert _clamps_input_ids(_function(with_clamp, "_preprocess", cls="GPUModelRunner"))
    without = ast.parse(
        "class GPUModelRunner:\n    def _preprocess(self, n):\n        self.positions.gpu.clamp_(min=0)\n"
    )
    assert not _clamps_input_ids(_function(without, "_preprocess", cls="GPUModelRunner"))
    assert _function(with_clamp, "_preprocess", cls="NPUModelRunner") is None
    kernel = ast.parse("def k(draft_token_id):\n    if draft_token_id < 0:\n        pass\n")
    assert _compares_draft_id(_function(kernel, "k"), ast.Lt, 0)
    assert not _compares_draft_id(_function(kernel, "k"), ast.GtE, 0)
    assert not _compares_draft_id(_function(kernel, "k"), ast.Lt, -1)
