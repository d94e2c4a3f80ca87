"""The verdict of every patch and advisory of adapter ascend-0.19-0.25 on the REAL classes of this env's release
(vllm-ascend 0.19.1rc1 in va019: the fixes apply; 0.23.0 in va023 and 0.25.1rc1 in va025: native), from the table
in later_fixes.py. Each fix's behaviour: tests/patches/test_<fix>.py.
"""

from __future__ import annotations

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
if npu_standin.detect_family() != "0.23":
    pytest.skip(
        f"adapter ascend-0.19-0.25 covers vllm-ascend 0.19.1rc1-0.25.1rc1; this env has {npu_standin.detect_family()}",
        allow_module_level=True,
    )

from later_fixes import ADVISORY_ON, APPLIED_ON, RELEASE  # noqa: E402

from zb_patch import registry as R  # noqa: E402
from zb_patch.detect import detect  # noqa: E402
from zb_patch.versions import ascend_0_19_0_25 as A  # noqa: E402


@pytest.fixture
def patch_set(cpu_worker):
    ps = A.ADAPTER.patch_set
    yield ps
    ps.unpatch()


def test_verdicts_per_release(patch_set):
    report = patch_set.apply(detect())
    assert report.verdict == R.APPLIED, report.reason  # the slot-mapping kernel applies everywhere
    verdicts = {i.id: i.verdict for i in report.items if i.kind in ("patch", "advisory")}
    assert verdicts["slot-mapping-kernel"] == R.APPLIED
    for pid, releases in APPLIED_ON.items():
        assert verdicts[pid] == (R.APPLIED if RELEASE in releases else R.NATIVE), (pid, RELEASE)
    assert {i.id for i in report.items if i.kind == "advisory"} == set(ADVISORY_ON)
    for aid, releases in ADVISORY_ON.items():
        assert verdicts[aid] == (R.ADVISORY if RELEASE in releases else R.OK), (aid, RELEASE)
    patch_set.unpatch()
    assert all(R.resolve(p.target).patched_by is None for p in patch_set.patches)
