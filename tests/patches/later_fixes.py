"""Where each fix of adapter ascend-0.19-0.25 applies (the installed code lacks it) and where it is native, by release
(docs/releases/ascend-0.19-0.25.md section 2, from the code of each release): what the tests of its fixes read.
Importing it skips the importing test module outside the adapter's envs (npu_standin family "0.23")."""

from __future__ import annotations

import importlib.metadata

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
if npu_standin.detect_family() != "0.23":
    pytest.skip(
        f"adapter ascend-0.19-0.25 covers vllm-ascend 0.19.1rc1-0.25.1rc1; this env has {npu_standin.detect_family()}",
        allow_module_level=True,
    )

from zb_patch.versions import ascend_0_19_0_25 as A  # noqa: E402

RELEASE = importlib.metadata.version("vllm-ascend")

ALL_RELEASES = set(A.ADAPTER.releases)
APPLIED_ON = {
    "valid-count-copy-order": {"0.19.1rc1"},
    "valid-count-int64": {"0.19.1rc1", "0.20.2rc1"},
    "seq-lens-cpu-unpadded": {"0.19.1rc1"},
    "seq-lens-cpu-prepare-inputs-padded": {"0.19.1rc1"},
    # vLLM #37159: no vLLM in the adapter's range fixes it (vLLM-side targets)
    "stale-draft-placeholders": ALL_RELEASES,
    "stale-draft-placeholders-rows": ALL_RELEASES,
    # native from 0.20.2rc1 (#9221's drafter gate) and 0.21.0rc1 (#10147's masks)
    "draft-seq-lens-max-model-len": {"0.19.1rc1"},
    # #9867 / #10080 (the draft graph's stale sample indices) in 0.21.0rc1
    "draft-sample-indices-past-batch": {"0.19.1rc1", "0.20.2rc1"},
    # no release of the adapter's range gives the draft positions RoPE rows of their own
    "mla-draft-rope-rows": ALL_RELEASES,
    "mla-draft-rope-rows-propose": ALL_RELEASES,
    "mla-draft-rope-rows-dummy-run": ALL_RELEASES,
}
ADVISORY_ON = {
    "dcp-cp-builder-seq-lens-cpu": {"0.19.1rc1"},
    # #10307 (the forward's ids sanitised after the spec-decode metadata) is in 0.21.0rc1 and later
    "pd-decode-placeholders-in-forward": {"0.19.1rc1", "0.20.2rc1"},
    # #13865 is on the releases/v0.23.0 branch only: 0.24.0rc1 / 0.25.1rc1 (cut from main) lack it again
    "stale-accepted-counts": {
        "0.19.1rc1",
        "0.20.2rc1",
        "0.21.0rc1",
        "0.22.1rc1",
        "0.23.0rc1",
        "0.24.0rc1",
        "0.25.1rc1",
    },
    # vLLM's _update_states counts the optimistic draft placeholders for min_tokens: no vLLM in the range fixes it
    "min-tokens-draft-placeholders": ALL_RELEASES,
}


def applies(patch_id: str) -> bool:
    return RELEASE in APPLIED_ON[patch_id]
