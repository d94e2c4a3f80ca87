"""Advisories of the native releases (zb_patch/versions/native.py ADVISORIES): known upstream bugs that vllm-ascend
>= 0.26 still has and zb-patch applies nothing for; ``zb-patch doctor`` lists them on a native verdict, checked by
fingerprint from the installed vLLM's sources (nothing imported)."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from zb_patch.registry import fingerprint_source
from zb_patch.versions import ascend_0_19_0_25 as A
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


# the vLLM each native vllm-ascend release (native.RELEASES) is built for (its Dockerfile VLLM_TAG) and the other
# releases of that vLLM minor it runs on
NATIVE_VLLM = ("0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0")
BOTH_GUARDS = {"vllm#46533", "vllm#47029"}
_NAMED = re.compile(r"(?<![\w.])(\d+\.\d+\.\d+)(?![\w.])(?:-(\d+\.\d+\.\d+)(?![\w.]))?")


def _release(text):
    return tuple(int(x) for x in text.split("."))


def _names(sentence, release):
    """Whether ``sentence`` names ``release`` (exactly, or inside an ``A-B`` range; ``0.25.1rc1`` names nothing)."""
    for low, high in _NAMED.findall(sentence):
        if release == low or (high and _release(low) <= _release(release) <= _release(high)):
            return True
    return False


def _outcome(text, release):
    """What ``text`` says a stale placeholder does on vLLM ``release``: "acceptance loss" (the sentence naming it says
    no crash and wasted verification, and names both guards), "crash", or every sentence naming it when neither or
    both."""
    said = [s for s in re.split(r"(?<=\.) ", text) if _names(s, release)]
    loss = [s for s in said if re.search(r"\b(no|not a) crash\b", s) and "wasted verification" in s]
    crash = [s for s in said if "crash" in s and s not in loss]
    if loss and not crash and all(g in " ".join(loss) for g in BOTH_GUARDS):
        return "acceptance loss"
    if crash and not loss:
        return "crash"
    return said


def _expected(release):
    guards = set(native.PLACEHOLDER_GUARDS[release])
    assert guards in (set(), BOTH_GUARDS), (release, guards)  # no vLLM read has one guard without the other
    return "acceptance loss" if guards == BOTH_GUARDS else "crash"


def test_the_stale_draft_placeholder_advisory_is_recorded_for_every_native_vllm():
    (adv,) = [a for a in native.ADVISORIES if a.id == "stale-draft-placeholders"]
    assert adv.target == "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_input_ids"
    assert "vllm#37159" in adv.upstream
    named = " ".join(adv.affected)
    for vllm in NATIVE_VLLM:
        assert _names(named, vllm), vllm
    # every native release's vLLM minor has a release named (vllm-ascend X.Y.ZrcN runs on vLLM X.Y.*)
    for release in native.RELEASES:
        minor = ".".join(release.split(".")[:2]) + "."
        assert any(v.startswith(minor) for v in NATIVE_VLLM), release


def test_guards_recorded_for_every_vllm_the_placeholder_texts_name():
    """native.PLACEHOLDER_GUARDS: read from the sdists; #46533 and #47029 arrive together in vLLM 0.25.0."""
    adapter_patch = A.STALE_DRAFT_PLACEHOLDERS
    vllms = [v for label in adapter_patch.fingerprints for v in re.findall(r"vllm ([\d., ]+)", label)[0].split(", ")]
    vllms = [v.strip() for v in vllms if v.strip()]
    assert vllms[0] == "0.19.0" and vllms[-1] == "0.25.1"
    for v in [*vllms, *NATIVE_VLLM]:
        assert v in native.PLACEHOLDER_GUARDS, v
        assert _expected(v) == ("acceptance loss" if _release(v) >= (0, 25, 0) else "crash"), v


@pytest.mark.parametrize("vllm", NATIVE_VLLM)
def test_native_advisory_words_each_vllm_by_its_guards(vllm):
    """vLLM 0.26.0 .. 0.30.0 have #47029 (GPUModelRunner._preprocess clamps the placeholder before the embedding) and
    #46533 (the rejection kernels reject a negative draft): the advisory says wasted verification, not a crash."""
    (adv,) = [a for a in native.ADVISORIES if a.id == "stale-draft-placeholders"]
    assert _outcome(adv.message, vllm) == _expected(vllm) == "acceptance loss"
    assert {"vllm#46533", "vllm#47029"} <= set(adv.upstream)


@pytest.mark.parametrize("vllm", sorted({v for v in native.PLACEHOLDER_GUARDS if _release(v) < (0, 26, 0)}))
def test_ascend_0_19_0_25_why_words_each_vllm_by_its_guards(vllm):
    """stale-draft-placeholders on vllm-ascend 0.19.1rc1 .. 0.25.1rc1: vLLM 0.19.0 .. 0.24.0 have neither guard (the
    -1 reaches the embedding: a crash), vLLM 0.25.0 / 0.25.1 both (wasted verification)."""
    assert _outcome(A.STALE_DRAFT_PLACEHOLDERS.why, vllm) == _expected(vllm)


def test_outcome_reads_the_wording_it_is_given():
    """The reader above on texts that say the wrong thing (a wording test that cannot fail would prove nothing)."""
    crash = "On vLLM 0.26.0 the -1 reaches the embedding: a crash."
    loss = "On vLLM 0.26.0 no crash (vllm#47029, vllm#46533): wasted verification."
    assert _outcome(crash, "0.26.0") == "crash"
    assert _outcome(loss, "0.26.0") == "acceptance loss"
    assert _outcome(loss.replace("vllm#46533", "vllm#1"), "0.26.0") != "acceptance loss"
    assert _outcome("vLLM 0.19.0-0.24.0 crash. vLLM 0.25.0 no crash, wasted verification.", "0.25.0") != "crash"
    assert _outcome("vLLM 0.19.0-0.24.0: a crash.", "0.21.0") == "crash"
    assert _outcome("vllm-ascend 0.19.1rc1-0.24.0rc1: a crash.", "0.21.0") == []


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
