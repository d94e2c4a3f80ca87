"""The over-count the min-tokens-draft-placeholders advisory describes (native.ADVISORIES and adapter
ascend-0.19-0.25's ADVISORIES; the wording per vLLM release is asserted in tests/unit/test_native_advisories.py),
checked against the installed release's own code:

* its ``GPUModelRunner._update_states`` is the recorded affected form of the label that names this vLLM;
* that function extends ``output_token_ids`` with ``[-1] * n`` before ``refresh_metadata()``, and its deferred
  correction (``correct_spec_decode_token_counts``) never touches ``output_token_ids`` (parsed, not imported);
* vllm-ascend's ``NPUModelRunner`` runs it (no ``_update_states`` of its own, or one that calls ``super()``'s);
* vLLM's ``MinTokensLogitsProcessor`` counts the placeholders: a request with fewer generated tokens than
  ``min_tokens`` loses its stop-token mask once its list holds them (the real class, on CPU).
"""

from __future__ import annotations

import ast
import importlib.metadata
import os

import pytest

from zb_patch.versions import ascend_0_19_0_25 as A
from zb_patch.versions import native
from zb_patch.versions.source import fingerprint_in_tree

VLLM = importlib.metadata.version("vllm")
ADVISORY = "min-tokens-draft-placeholders"
ADVISORIES = [a for a in (*native.ADVISORIES, *A.ADVISORIES) if a.id == ADVISORY]
NAMED = {label: fp for a in ADVISORIES for label, fp in a.affected.items() if VLLM in label.split(" (")[0]}
if not NAMED:
    pytest.skip(f"vLLM {VLLM}: no {ADVISORY} label names it", allow_module_level=True)


def _module(root: str, *parts: str) -> ast.Module:
    with open(os.path.join(root, *parts), encoding="utf-8") as fh:
        return ast.parse(fh.read())


def _method(tree: ast.AST, cls: str, name: str) -> ast.FunctionDef | None:
    scope = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if scope is None:
        return None
    return next((n for n in scope.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _is_placeholder_extend(node: ast.AST) -> bool:
    """``<...>.output_token_ids.extend([-1] * n)``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "extend"):
        return False
    if not ast.unparse(node.func.value).endswith("output_token_ids") or len(node.args) != 1:
        return False
    arg = node.args[0]
    return (
        isinstance(arg, ast.BinOp)
        and isinstance(arg.op, ast.Mult)
        and isinstance(arg.left, ast.List)
        and len(arg.left.elts) == 1
        and ast.unparse(arg.left.elts[0]) == "-1"
    )


def _over_counts(fn: ast.FunctionDef | None) -> bool:
    """The optimistic placeholders are appended before ``refresh_metadata()`` and the deferred correction leaves
    ``output_token_ids`` alone."""
    if fn is None:
        return False
    extends = [n.lineno for n in ast.walk(fn) if _is_placeholder_extend(n)]
    refresh = [
        n.lineno
        for n in ast.walk(fn)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "refresh_metadata"
    ]
    closure = [
        n for n in ast.walk(fn) if isinstance(n, ast.FunctionDef) and n.name == "correct_spec_decode_token_counts"
    ]
    if not extends or not refresh or len(closure) != 1:
        return False
    return min(extends) < max(refresh) and "output_token_ids" not in ast.unparse(closure[0])


def _runs_vllm_s(fn: ast.FunctionDef | None) -> bool:
    """No override, or one that calls ``super()._update_states``."""
    if fn is None:
        return True
    return "super()._update_states(" in ast.unparse(fn)


def test_installed_update_states_is_the_recorded_affected_form():
    root = native.installed_vllm_root()
    assert root is not None
    (fp,) = set(NAMED.values())
    assert fingerprint_in_tree(root, ADVISORIES[0].target) == fp, (VLLM, NAMED)


def test_installed_update_states_counts_the_placeholders_before_refresh():
    root = native.installed_vllm_root()
    runner = _module(root, "vllm", "v1", "worker", "gpu_model_runner.py")
    assert _over_counts(_method(runner, "GPUModelRunner", "_update_states"))


def test_the_npu_runner_runs_vllm_s_update_states():
    root = native.installed_root()
    assert root is not None
    runner = _module(root, "vllm_ascend", "worker", "model_runner_v1.py")
    assert _runs_vllm_s(_method(runner, "NPUModelRunner", "_update_states"))


def test_min_tokens_processor_counts_placeholders(monkeypatch):
    """vLLM's MinTokensLogitsProcessor: 2 tokens generated, min_tokens 5; once the list holds 3 optimistic '-1's (as
    _update_states leaves it before refresh_metadata) the request leaves the processor and its stop token is no
    longer masked."""
    import importlib

    import torch
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MinTokensLogitsProcessor, builtin

    # the processor's host-to-device copies pin when vLLM's PIN_MEMORY says so, which it computed from the NPU
    # stand-in's platform (an NPU host pins); this CPU host has no pinned-memory allocator
    h2d = getattr(builtin, "async_tensor_h2d", None)
    if h2d is not None and hasattr(importlib.import_module(h2d.__module__), "PIN_MEMORY"):
        monkeypatch.setattr(importlib.import_module(h2d.__module__), "PIN_MEMORY", False)

    stop = 7
    params = SamplingParams(min_tokens=5, stop_token_ids=[stop], max_tokens=32)
    out = [11, 12]
    proc = MinTokensLogitsProcessor(None, torch.device("cpu"), False)
    proc.update_state(BatchUpdate(batch_size=1, removed=(), added=[(0, params, [1, 2, 3], out)], moved=()))
    assert torch.isneginf(proc.apply(torch.zeros(1, 16))[0, stop])  # 2 < 5: masked
    out.extend([-1] * 3)  # the optimistic placeholders of a step with 3 drafts
    proc.update_state(None)
    assert sum(1 for t in out if t >= 0) < params.min_tokens
    assert not torch.isneginf(proc.apply(torch.zeros(1, 16))[0, stop])  # mask lifted at 2 generated tokens


def test_the_readers_see_what_they_look_for():
    """The AST readers on forms with and without the over-count: a check that cannot fail proves nothing."""
    src = (
        "class GPUModelRunner:\n"
        "    def _update_states(self, so):\n"
        "        req_state.output_token_ids.extend([-1] * optimistic_num_accepted)\n"
        "        self.input_batch.refresh_metadata()\n"
        "        def correct_spec_decode_token_counts():\n"
        "            req_state.num_computed_tokens -= correction\n"
        "        return correct_spec_decode_token_counts\n"
    )
    assert _over_counts(_method(ast.parse(src), "GPUModelRunner", "_update_states"))
    trimmed = src.replace(
        "num_computed_tokens -= correction",
        "num_computed_tokens -= correction\n            del req_state.output_token_ids[n:]",
    )
    assert not _over_counts(_method(ast.parse(trimmed), "GPUModelRunner", "_update_states"))
    after = src.replace("        self.input_batch.refresh_metadata()\n", "").replace(
        "        return correct", "        self.input_batch.refresh_metadata()\n        return correct"
    )
    assert _over_counts(_method(ast.parse(after), "GPUModelRunner", "_update_states"))  # refresh after extend
    extend = "        req_state.output_token_ids.extend([-1] * optimistic_num_accepted)\n"
    refresh = "        self.input_batch.refresh_metadata()\n"
    before = src.replace(extend + refresh, refresh + extend)
    assert not _over_counts(_method(ast.parse(before), "GPUModelRunner", "_update_states"))
    assert not _over_counts(_method(ast.parse(src.replace("[-1]", "[0]")), "GPUModelRunner", "_update_states"))
    own = ast.parse("class NPUModelRunner:\n    def _update_states(self, so):\n        return None\n")
    assert not _runs_vllm_s(_method(own, "NPUModelRunner", "_update_states"))
    guard = ast.parse(
        "class NPUModelRunner:\n    def _update_states(self, so):\n        return super()._update_states(so)\n"
    )
    assert _runs_vllm_s(_method(guard, "NPUModelRunner", "_update_states"))
