import json
import subprocess
import sys
from pathlib import Path

import pytest
from _versions import vers

from zb_patch import versions as V


@pytest.mark.parametrize(
    "vllm, ascend, verdict, adapter",
    [
        ("0.18.0", "0.18.0", V.SELECTED, "ascend-0.18"),
        ("0.18.1", "0.18.0", V.SELECTED, "ascend-0.18"),
        ("0.13.0", "0.13.0", V.SELECTED, "ascend-0.13"),
        ("0.23.0", "0.23.0", V.SELECTED, "ascend-0.19-0.25"),
        ("0.23.0", "0.23.0.post1", V.SELECTED, "ascend-0.19-0.25"),
        ("0.19.1", "0.19.1rc1", V.SELECTED, "ascend-0.19-0.25"),
        ("0.18.1.dev45+g35141a7", "0.18.1.dev3+gabcdef1", V.SELECTED, "ascend-0.18"),
        # 0.24.0rc1 / 0.25.1rc1 still launch vLLM's generic slot-mapping kernel: the adapter, not "native"
        ("0.24.0", "0.24.0rc1", V.SELECTED, "ascend-0.19-0.25"),
        ("0.25.1", "0.25.1rc1", V.SELECTED, "ascend-0.19-0.25"),
        ("0.11.0", "0.11.0", V.REFUSED, None),
        ("0.9.1", "0.9.1", V.REFUSED, None),
        ("0.18.0", None, V.REFUSED, None),
        (None, None, V.REFUSED, None),
    ],
)
def test_selection_table(vllm, ascend, verdict, adapter):
    sel = V.select(vers(vllm, ascend))
    assert sel.verdict == verdict, sel.reason
    assert (sel.adapter.id if sel.adapter else None) == adapter
    assert sel.reason


def test_refusal_reasons_are_precise():
    assert "vllm-ascend is not installed" in V.select(vers("0.18.0", None)).reason
    assert "vLLM is not installed" in V.select(vers(None, "0.18.0")).reason
    r = V.select(vers("0.11.0", "0.11.0")).reason
    assert "0.11.0" in r and "older than 0.13" in r


def test_the_range_table_is_each_adapters():
    """adapter.ASCEND_RANGES, which selection reads before importing an adapter, lists every adapter in order."""
    assert [a.id for a in V.adapters()] == list(V.ASCEND_RANGES)
    assert all(a.vllm_ascend == V.ASCEND_RANGES[a.id] for a in V.adapters())


_IMPORTED = """
import json, sys
sys.path.insert(0, sys.argv[1])
from _versions import vers
from zb_patch import versions as V
sel = V.select(vers(sys.argv[2], sys.argv[3]))
print(json.dumps([sel.verdict, [a.id for a in sel.candidates],
                  sorted(m for m in sys.modules if m.startswith("zb_patch.versions."))]))
"""


@pytest.mark.parametrize(
    "vllm, ascend, adapters",
    [
        ("0.13.0", "0.13.0", ["ascend-0.13"]),
        ("0.18.0", "0.18.0", ["ascend-0.18"]),
        ("0.23.0", "0.23.0", ["ascend-0.19-0.25"]),
        ("0.19.0", "0.18.0", ["ascend-0.13", "ascend-0.18", "ascend-0.19-0.25"]),  # a probe tries every adapter
        ("0.11.0", "0.11.0", []),
    ],
)
def test_selection_imports_only_the_family_of_the_installed_release(vllm, ascend, adapters):
    """Every vLLM process pays for what register() imports: a release in an adapter's range imports that adapter's
    module only (with its fixes), and nothing imports the native forms (only a release past the adapters needs them)."""
    here = str(Path(__file__).parent)
    out = subprocess.run([sys.executable, "-c", _IMPORTED, here, vllm, ascend], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    verdict, candidates, modules = json.loads(out.stdout)
    assert sorted(candidates) == adapters, verdict
    loaded = {m.split(".")[2] for m in modules}
    module_of = {"ascend-0.13": "ascend_0_13", "ascend-0.18": "ascend_0_18", "ascend-0.19-0.25": "ascend_0_19_0_25"}
    assert loaded & set(module_of.values()) == {module_of[a] for a in adapters}
    assert "native" not in loaded


def test_mismatched_pairing_is_probed_family_first():
    sel = V.select(vers("0.19.0", "0.18.0"))
    assert sel.verdict == V.PROBE
    assert sel.candidates[0].id == "ascend-0.18"
    assert {a.id for a in sel.candidates} == {a.id for a in V.adapters()}
    assert "outside ascend-0.18" in sel.reason and "fingerprints" in sel.reason


def test_gap_release_is_probed():
    sel = V.select(vers("0.15.0", "0.15.0rc1"))
    assert sel.verdict == V.PROBE and "matches no adapter" in sel.reason


def test_unparsable_versions_refuse():
    assert V.select(vers("garbage!", "0.18.0")).verdict == V.REFUSED
    assert V.select(vers("0.18.0", "garbage!")).verdict == V.REFUSED


def test_adapter_table_is_well_formed():
    ids = [a.id for a in V.adapters()]
    assert len(ids) == len(set(ids))
    for a in V.adapters():
        assert a.patch_set.guards or a.patch_set.patches, a.id
        for g in a.patch_set.guards:
            assert g.fingerprints and all(len(fp) == 16 for fp in g.fingerprints.values()), g.target
        for p in a.patch_set.patches:
            assert p.why and p.upstream and p.remove_when, p.id
            fps = list(p.fingerprints.values()) + list(p.native_fingerprints.values())
            assert all(len(fp) == 16 for fp in fps), p.id
            # one installed form is either "needs the patch" or "already fixed", never both
            assert not set(p.fingerprints.values()) & set(p.native_fingerprints.values()), p.id
        for adv in a.patch_set.advisories:
            assert adv.affected and all(len(fp) == 16 for fp in adv.affected.values()), adv.id
            assert adv.message and adv.upstream, adv.id
        lo, hi = a.vllm_ascend
        assert lo < hi
    # ranges of different adapters never overlap
    spans = sorted(a.vllm_ascend for a in V.adapters())
    for (_lo1, hi1), (lo2, _hi2) in zip(spans, spans[1:]):
        assert hi1 <= lo2
    with pytest.raises(KeyError):
        V.by_id("nope")


def test_supported_table_rows():
    rows = V.supported_table()
    assert {r["adapter"] for r in rows if r["verdict"] == "adapter"} == {a.id for a in V.adapters()}
    assert any(r["verdict"] == "refused" and r["vllm_ascend"] == "not installed" for r in rows)
    assert rows[0]["verdict"] == "checked" and ">= 0.26" in rows[0]["vllm_ascend"]
    spans = [r["vllm_ascend"] for r in rows[1:-1] if r.get("form") != "commit"]
    assert spans[0] == "0.26.0rc1 - 0.30.0rc2" and spans[-1] == "0.9.1 - 0.12.0rc1"
    assert {r["vllm_ascend"]: r["patches"] for r in rows}["0.21.0rc1 - 0.24.0rc1"] == ", ".join(
        ("slot-mapping-kernel", *STALE_DRAFTS, *MLA_ROPE_ROWS, *RESET_IN_FLIGHT)
    )


def test_published_releases_each_get_one_recorded_verdict():
    """Every published release 0.9.1 .. 0.30.0rc2 falls in exactly one table row, in order, none twice."""
    rows = [r for r in V.supported_table()[1:-1] if r.get("form") != "commit"]
    covered = []
    for r in reversed(rows):
        first, _, last = r["vllm_ascend"].partition(" - ")
        i, j = V.PUBLISHED.index(first), V.PUBLISHED.index(last or first)
        covered += V.PUBLISHED[i : j + 1]
    assert tuple(covered) == V.PUBLISHED
    assert V.PUBLISHED[0] == "0.9.1" and V.PUBLISHED[-1] == "0.30.0rc2"


STALE_DRAFTS = ("stale-draft-placeholders", "stale-draft-placeholders-rows")  # vLLM #37159: no vLLM in range fixes it
# the EAGLE draft graph's stale sample indices (#9867 / #10080): native from 0.21.0rc1
SAMPLE_INDICES = ("draft-sample-indices-past-batch",)
# the draft positions' shared decode RoPE rows: no release of the range gives each position its own
MLA_ROPE_ROWS = ("mla-draft-rope-rows", "mla-draft-rope-rows-propose", "mla-draft-rope-rows-dummy-run")
# reset_prefix_cache under async scheduling (vLLM #42117 / #46066 / #49620): the loops skip a marked request from vLLM
# 0.25.0 / vllm-ascend 0.25.1rc1 on (#46066), so there only the reset wrapper
RESET_IN_FLIGHT = (
    "reset-prefix-cache-in-flight",
    "reset-prefix-cache-in-flight-update",
    "reset-prefix-cache-in-flight-recompute",
)


@pytest.mark.parametrize(
    "release, verdict, adapter, patches",
    [
        ("0.12.0rc1", V.REFUSED, None, ()),
        ("0.13.0", V.SELECTED, "ascend-0.13", None),
        ("0.13.0rc3", V.REFUSED, None, ()),  # in ascend-0.13's range, but no recorded fingerprint names it
        ("0.16.0rc1", V.REFUSED, None, ()),  # between adapters: no adapter's forms
        (
            "0.19.1rc1",
            V.SELECTED,
            "ascend-0.19-0.25",
            tuple(p.id for p in V.by_id("ascend-0.19-0.25").patch_set.patches),
        ),
        (
            "0.20.2rc1",
            V.SELECTED,
            "ascend-0.19-0.25",
            (
                "slot-mapping-kernel",
                "valid-count-int64",
                *STALE_DRAFTS,
                *SAMPLE_INDICES,
                *MLA_ROPE_ROWS,
                *RESET_IN_FLIGHT,
            ),
        ),
        (
            "0.24.0rc1",
            V.SELECTED,
            "ascend-0.19-0.25",
            ("slot-mapping-kernel", *STALE_DRAFTS, *MLA_ROPE_ROWS, *RESET_IN_FLIGHT),
        ),
        (
            "0.25.1rc1",
            V.SELECTED,
            "ascend-0.19-0.25",
            ("slot-mapping-kernel", *STALE_DRAFTS, *MLA_ROPE_ROWS, RESET_IN_FLIGHT[0]),
        ),
        ("0.26.0rc1", V.NATIVE, None, ()),
        ("0.30.0rc2", V.NATIVE, None, ()),
        ("0.31.0", V.REFUSED, None, ()),  # newer than every recorded release: never native by number
    ],
)
def test_release_verdicts(release, verdict, adapter, patches):
    rv = V.release_verdict(release)
    assert (rv.verdict, rv.adapter) == (verdict, adapter)
    if patches is not None:
        assert rv.patches == patches


# ---- native by code: a release past every adapter is checked from its source files ----------------------

_BLOCK_TABLE = """
from vllm_ascend.ops.triton.compute_slot_mapping import _compute_slot_mapping_kernel


class BlockTable:
    def compute_slot_mapping(self, num_reqs, query_start_loc, positions):
        _compute_slot_mapping_kernel[(num_reqs + 1,)](positions, self.slot_mapping.gpu)
"""
_KERNEL = """
def _compute_slot_mapping_kernel(positions, out):
    out[0] = positions[0] * 2
"""
_RUNNER = """
class NPUModelRunner:
    def _prepare_inputs(self, scheduler_output):
        return self.optimistic_seq_lens_cpu

    def _correct_optimistic_seq_lens_cpu(self, num_reqs):
        return num_reqs
"""
_SPEC_UTILS = """
def correct_optimistic_seq_lens_cpu(opt, prev, drafts, valid, num_reqs):
    return opt
"""


def _tree(root, **changes):
    files = {
        "worker/block_table.py": _BLOCK_TABLE,
        "ops/triton/compute_slot_mapping.py": _KERNEL,
        "worker/model_runner_v1.py": _RUNNER,
        "spec_decode/utils.py": _SPEC_UTILS,
    }
    files.update({k.replace("__", "/") + ".py": v for k, v in changes.items()})
    for rel, text in files.items():
        if text is None:
            continue
        path = root / "vllm_ascend" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """native.FORMS recorded from a small tree (the real forms are recomputed from PyPI by tests/sources)."""
    from zb_patch.versions import native

    base = _tree(tmp_path / "recorded")
    forms = tuple(
        native.NativeForm(f.concern, f.target, {"vllm-ascend 9.9.9rc1": V.fingerprint_in_tree(base, f.target)})
        for f in native.FORMS
    )
    assert all(f.fingerprints["vllm-ascend 9.9.9rc1"] for f in forms)
    monkeypatch.setattr(native, "FORMS", forms)
    return tmp_path


def test_native_when_every_recorded_form_is_installed(recorded):
    sel = V.select(vers("0.31.0", "0.31.0rc1"), tree=_tree(recorded / "same"))
    assert sel.verdict == V.NATIVE, sel.reason
    assert "5 targets checked" in sel.reason and "9.9.9rc1" in sel.reason
    assert all(c.matched for c in sel.checks) and sel.as_dict()["checks"]


def test_generic_kernel_is_not_native(recorded):
    """The 0.24.0rc1 / 0.25.1rc1 shape: the method launches vLLM's kernel (absent from the vllm-ascend tree)."""
    generic = _BLOCK_TABLE.replace("vllm_ascend.ops.triton.compute_slot_mapping", "vllm.v1.worker.block_table")
    sel = V.select(vers("0.31.0", "0.31.0rc1"), tree=_tree(recorded / "generic", worker__block_table=generic))
    assert sel.verdict == V.REFUSED
    kernel = next(c for c in sel.checks if c.target.endswith(":_compute_slot_mapping_kernel"))
    assert kernel.fingerprint is None and kernel.matched is None
    assert "vllm_ascend.worker.block_table:_compute_slot_mapping_kernel absent (no recorded native form)" in sel.reason
    assert "1 of 5 unknown" in sel.reason


def test_drifted_runner_names_what_was_checked(recorded):
    drifted = _RUNNER.replace("return self.optimistic_seq_lens_cpu", "return None")
    sel = V.select(vers("0.31.0", "0.31.0"), tree=_tree(recorded / "drift", worker__model_runner_v1=drifted))
    assert sel.verdict == V.REFUSED
    bad = [c for c in sel.checks if c.matched is None]
    assert [c.target for c in bad] == ["vllm_ascend.worker.model_runner_v1:NPUModelRunner._prepare_inputs"]
    assert bad[0].fingerprint and f"_prepare_inputs {bad[0].fingerprint} (no recorded native form)" in sel.reason
    assert "past every adapter (>= 0.26)" in sel.reason and "cannot tell" in sel.reason
    # every check is named, the matching ones with their recorded release
    assert sel.reason.count("9.9.9rc1") == 4


def test_missing_sources_refuse(recorded):
    sel = V.select(vers("0.27.1", "0.27.1rc1"), tree=None)  # the unit env has no vllm_ascend installed
    assert sel.verdict == V.REFUSED and "cannot be found" in sel.reason


def test_a_recorded_release_number_is_not_enough(tmp_path):
    """0.26.0rc1 is a recorded native release, but installed code that is none of the recorded forms is refused."""
    sel = V.select(vers("0.26.0", "0.26.0rc1"), tree=_tree(tmp_path, ops__triton__compute_slot_mapping=None))
    assert sel.verdict == V.REFUSED and "0.26.0rc1 is past every adapter" in sel.reason


def test_unknown_newer_release_logs_one_line_and_applies_nothing(recorded, caplog):
    """A release past every adapter whose code matches nothing known: one ERROR line from the plugin saying what
    was checked and that nothing was applied; never a silent "native"."""
    import logging

    from zb_patch import plugin

    drifted = _BLOCK_TABLE.replace("(num_reqs + 1,)", "(4,)")
    versions = vers("0.31.0", "0.31.0rc1")
    sel = V.select(versions, tree=_tree(recorded / "newer", worker__block_table=drifted))
    with caplog.at_level(logging.DEBUG, logger="vllm.zb_patch"):
        act = plugin._activate(plugin.Settings({"ZB_PATCH": "1"}), "worker", selection=sel, versions=versions)
    lines = [r for r in caplog.records if r.name.startswith("vllm.zb_patch")]
    assert act.state == "refused" and act.adapter_id is None
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR, [r.getMessage() for r in lines]
    msg = lines[0].getMessage()
    assert "REFUSED" in msg and "nothing applied" in msg and "0.31.0rc1" in msg
    assert "BlockTable.compute_slot_mapping" in msg and "no recorded native form" in msg
