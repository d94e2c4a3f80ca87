"""The verdict of every patch and advisory of adapter ascend-0.19-0.25 on the REAL classes of this env's release
(vllm-ascend 0.19.1rc1 in va019: the fixes apply; 0.23.0 in va023 and 0.25.1rc1 in va025: native), from the table
in later_fixes.py. Each fix's behaviour: tests/patches/test_<fix>.py.
"""

from __future__ import annotations

from later_fixes import ADVISORY_ON, APPLIED_ON, RELEASE

from zb_patch import registry as R
from zb_patch.detect import detect


def test_verdicts_per_release(later_patch_set):
    report = later_patch_set.apply(detect())
    assert report.verdict == R.APPLIED, report.reason  # the slot-mapping kernel applies everywhere
    verdicts = {i.id: i.verdict for i in report.items if i.kind in ("patch", "advisory")}
    assert verdicts["slot-mapping-kernel"] == R.APPLIED
    for pid, releases in APPLIED_ON.items():
        assert verdicts[pid] == (R.APPLIED if RELEASE in releases else R.NATIVE), (pid, RELEASE)
    assert {i.id for i in report.items if i.kind == "advisory"} == set(ADVISORY_ON)
    for aid, releases in ADVISORY_ON.items():
        assert verdicts[aid] == (R.ADVISORY if RELEASE in releases else R.OK), (aid, RELEASE)
    later_patch_set.unpatch()
    assert all(R.resolve(p.target).patched_by is None for p in later_patch_set.patches)
