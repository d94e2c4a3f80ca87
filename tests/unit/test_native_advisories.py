"""Advisories of the native releases (zb_patch/versions/native.py ADVISORIES): known upstream bugs that vllm-ascend
>= 0.26 still has and zb-patch applies nothing for; ``zb-patch doctor`` lists them on a native verdict, checked by
fingerprint from the installed vLLM's sources (nothing imported)."""

from __future__ import annotations

import dataclasses
import os

from zb_patch.registry import fingerprint_source
from zb_patch.versions import native

RUNNER = """
class GPUModelRunner:
    def _prepare_input_ids(self, scheduler_output, num_reqs, total, cu_num_tokens):
        for cur_index in range(num_reqs):
            if self.prev_positions.np[cur_index] < 0:
                continue
"""


def _tree(tmp_path, text):
    path = tmp_path / "vllm" / "v1" / "worker"
    path.mkdir(parents=True)
    (path / "gpu_model_runner.py").write_text(text)
    return str(tmp_path)


def test_the_stale_draft_placeholder_advisory_is_recorded_for_every_native_vllm():
    (adv,) = [a for a in native.ADVISORIES if a.id == "stale-draft-placeholders"]
    assert adv.target == "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_input_ids"
    assert "vllm#37159" in adv.upstream
    named = " ".join(adv.affected)
    # the vLLMs the native vllm-ascend releases (native.RELEASES) run on
    for vllm in ("0.26.0", "0.27.1", "0.28.0", "0.29.0"):
        assert vllm in named, vllm


def test_check_advisories_matches_by_fingerprint(tmp_path, monkeypatch):
    root = _tree(tmp_path, RUNNER)
    fp = fingerprint_source(RUNNER, "GPUModelRunner._prepare_input_ids")
    adv = dataclasses.replace(native.ADVISORIES[0], affected={"vllm 9.9.9": fp})
    monkeypatch.setattr(native, "ADVISORIES", (adv,))
    (check,) = native.check_advisories(root)
    assert (check.fingerprint, check.matched) == (fp, "vllm 9.9.9")
    assert check.as_dict()["upstream"] == adv.upstream


def test_check_advisories_not_affected_or_absent(tmp_path, monkeypatch):
    root = _tree(tmp_path, RUNNER.replace("< 0", "< -1"))
    (check,) = native.check_advisories(root)
    assert check.fingerprint is not None and check.matched is None
    (check,) = native.check_advisories(str(tmp_path / "nowhere"))
    assert check.fingerprint is None and check.matched is None
    assert native.check_advisories(None)[0].matched is None


def test_installed_vllm_root_finds_without_importing(monkeypatch, tmp_path):
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import sys

    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    assert native.installed_vllm_root() == os.path.abspath(str(tmp_path))
    assert "vllm" not in sys.modules
