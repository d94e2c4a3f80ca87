import pytest

from zb_patch import versions as V
from zb_patch.detect import Versions, parse


def vers(vllm=None, ascend=None):
    return Versions(vllm=parse("vllm", vllm), vllm_ascend=parse("vllm_ascend", ascend),
                    torch=parse("torch", "2.13.0+cpu"), torch_npu=parse("torch_npu", None),
                    triton=parse("triton", None), triton_ascend=parse("triton_ascend", None))


@pytest.mark.parametrize("vllm, ascend, verdict, adapter", [
    ("0.18.0", "0.18.0", V.SELECTED, "ascend-0.18"),
    ("0.18.1", "0.18.0", V.SELECTED, "ascend-0.18"),
    ("0.13.0", "0.13.0", V.SELECTED, "ascend-0.13"),
    ("0.23.0", "0.23.0", V.SELECTED, "ascend-0.19-0.23"),
    ("0.23.0", "0.23.0.post1", V.SELECTED, "ascend-0.19-0.23"),
    ("0.19.1", "0.19.1rc1", V.SELECTED, "ascend-0.19-0.23"),
    ("0.18.1.dev45+g35141a7", "0.18.1.dev3+gabcdef1", V.SELECTED, "ascend-0.18"),
    ("0.24.0", "0.24.0rc1", V.NATIVE, None),
    ("0.27.1", "0.27.1rc1", V.NATIVE, None),
    ("0.11.0", "0.11.0", V.REFUSED, None),
    ("0.9.1", "0.9.1", V.REFUSED, None),
    ("0.18.0", None, V.REFUSED, None),
    (None, None, V.REFUSED, None),
])
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
    assert "already ships" in V.select(vers("0.24.0", "0.24.0")).reason


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
    for (lo1, hi1), (lo2, hi2) in zip(spans, spans[1:]):
        assert hi1 <= lo2
    with pytest.raises(KeyError):
        V.by_id("nope")


def test_supported_table_rows():
    rows = V.supported_table()
    assert rows[0]["verdict"] == "native"
    assert {r["adapter"] for r in rows if r["verdict"] == "adapter"} == {a.id for a in V.adapters()}
    assert any(r["verdict"] == "refused" and r["vllm_ascend"] == "not installed" for r in rows)
