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
    stale, reset, min_tokens = native.check_advisories(root)
    assert stale.fingerprint is not None and stale.matched is None
    assert reset.fingerprint is None and reset.matched is None  # no scheduler in that tree
    assert min_tokens.fingerprint is None and min_tokens.matched is None  # no _update_states in that tree
    for check in native.check_advisories(str(tmp_path / "nowhere")):
        assert check.fingerprint is None and check.matched is None
    assert all(c.matched is None for c in native.check_advisories(None))


def test_installed_vllm_root_finds_without_importing(monkeypatch, tmp_path):
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import sys

    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    assert native.installed_vllm_root() == os.path.abspath(str(tmp_path))
    assert "vllm" not in sys.modules


# min-tokens-draft-placeholders: vLLM's GPUModelRunner._update_states counts the optimistic '-1' draft placeholders for
# MinTokensLogitsProcessor. Its fingerprint per vLLM release, read from each sdist (the same normalised-AST hash
# zb_patch.versions.source computes; tests/contract/test_min_tokens_placeholders.py recomputes the installed one).
UPDATE_STATES = {
    **dict.fromkeys(("0.19.0", "0.19.1", "0.20.0", "0.20.1", "0.20.2"), "bb69005e6cd0712f"),
    "0.21.0": "2dd121af1b133430",
    **dict.fromkeys(("0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1"), "c6e56a5fb0956d14"),
    "0.26.0": "5df6c317c4a4d1a9",
    **dict.fromkeys(("0.27.0", "0.27.1", "0.28.0", "0.29.0"), "af021b847899669d"),
    "0.30.0": "2eb2df8682212b24",
}
MIN_TOKENS = "min-tokens-draft-placeholders"
MIN_TOKENS_TARGET = "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states"


def _min_tokens_advisory(advisories):
    (adv,) = [a for a in advisories if a.id == MIN_TOKENS]
    return adv


def _on_sentence(message):
    (on,) = [s for s in re.split(r"(?<=\.) ", message) if s.startswith("On vLLM")]
    return on


@pytest.mark.parametrize("vllm", sorted(UPDATE_STATES, key=_release))
def test_min_tokens_advisory_recorded_for_each_vllm(vllm):
    """vLLM 0.19.0 .. 0.25.1 (adapter ascend-0.19-0.25) and 0.26.0 .. 0.30.0 (native): the one label naming the
    release records its sdist's _update_states, and the message's "On vLLM ..." sentence names the release."""
    adv = _min_tokens_advisory(native.ADVISORIES if _release(vllm) >= (0, 26, 0) else A.ADVISORIES)
    other = _min_tokens_advisory(A.ADVISORIES if _release(vllm) >= (0, 26, 0) else native.ADVISORIES)
    assert adv.target == other.target == MIN_TOKENS_TARGET
    named = [fp for label, fp in adv.affected.items() if _names(label.split(" (")[0], vllm)]
    assert named == [UPDATE_STATES[vllm]], (vllm, named)
    assert not [label for label in other.affected if _names(label.split(" (")[0], vllm)], vllm
    assert _names(_on_sentence(adv.message), vllm) and not _names(_on_sentence(other.message), vllm)


def test_min_tokens_advisory_records_every_form_read():
    """Every _update_states form read from the sdists is an affected form of exactly one of the two advisories."""
    adapter = _min_tokens_advisory(A.ADVISORIES).affected.values()
    ours = _min_tokens_advisory(native.ADVISORIES).affected.values()
    assert not set(adapter) & set(ours)
    assert sorted([*adapter, *ours]) == sorted(set(UPDATE_STATES.values()))


@pytest.mark.parametrize("where", ["native", "ascend-0.19-0.25"])
def test_min_tokens_advisory_says_effect_fix_and_workaround(where):
    adv = _min_tokens_advisory(native.ADVISORIES if where == "native" else A.ADVISORIES)
    text = adv.message
    assert "len(output_token_ids)" in text and "refresh_metadata" in text
    assert "up to k positions early" in text and "within the first min_tokens tokens" in text
    assert "vllm#26317" in text and "only that mask is affected" in text
    assert "vllm-ascend 0.13.0 / 0.18.0" in text and "applies nothing here" in text
    assert "without async scheduling or without speculative decoding" in text
    assert set(adv.upstream) == {"vllm#32951", "vllm#26317"}


def test_the_reset_advisory_is_the_placeholder_count_form_the_adapter_fixes():
    """vLLM 0.26.0 (vllm-ascend 0.26.0rc1) has vLLM 0.22.0-0.25.1's reset_prefix_cache (the count of #42117, vLLM
    #49620); vLLM 0.27.0 and later have another form, not recorded as affected."""
    (adv,) = [a for a in native.ADVISORIES if a.id == "reset-prefix-cache-in-flight"]
    (reset,) = [p for p in A.PATCHES if p.id == "reset-prefix-cache-in-flight"]
    assert adv.target == reset.target and "vllm#49620" in adv.upstream
    assert list(adv.affected) == ["vllm 0.26.0"]
    count_form = [label for label, fp in reset.fingerprints.items() if fp == adv.affected["vllm 0.26.0"]]
    assert len(count_form) == 1 and "0.22.0" in count_form[0] and "0.25.1" in count_form[0]
