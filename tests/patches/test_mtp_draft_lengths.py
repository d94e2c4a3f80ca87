"""``mtp-draft-lengths`` (ascend-0.13) on the release's own dense attention metadata (``attention_v1.AscendMetadata``)
and the calls 0.13.0's ``MtpProposer._propose`` makes: the first draft step's metadata as built, then the later steps'
(the release adds one to the host ``seq_lens`` and nothing else). The wrapped ``set_ascend_forward_context`` gives a
later step one query token per request and the moved-on lengths; the first step, MLA metadata, the target's calls and
FULL graph replays stay as released. The defect and the engine-level effect (acceptance per draft position, with and
without the patch) are tests/engine/test_defect_mtp_draft_slots_and_lengths.py's."""

from __future__ import annotations

import contextlib

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
if npu_standin.detect_family() != "0.13":
    pytest.skip("mtp-draft-lengths: ascend-0.13 (0.16.0rc1+ have no MtpProposer)", allow_module_level=True)

import torch  # noqa: E402

from zb_patch.versions.fixes import mtp_draft_lengths  # noqa: E402

keywords: list[dict] = []  # the keyword arguments each call of the stand-in got


@pytest.fixture
def entered():
    """The patch's wrapper around a stand-in for the release's context manager that records the metadata's lists as
    the model would read them inside the context."""
    seen = []
    keywords.clear()

    @contextlib.contextmanager
    def set_ascend_forward_context(attn_metadata, vllm_config, **kwargs):
        keywords.append(kwargs)
        seen.append(
            {n: (m.seq_lens_list, m.actual_seq_lengths_q) for n, m in (attn_metadata or {}).items()}
            if isinstance(attn_metadata, dict)
            else None
        )
        yield

    return mtp_draft_lengths.make_mtp_draft_forward_context(set_ascend_forward_context), seen


def _dense(seq_lens: list[int], query_lens: list[int]):
    """Dense metadata of a first draft step as the release's builder makes it (host seq_lens, lists from them)."""
    from vllm_ascend.attention.attention_v1 import AscendMetadata

    ends = torch.tensor(query_lens).cumsum(0).tolist()
    return AscendMetadata(
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_list=list(seq_lens),
        actual_seq_lengths_q=ends,
        query_start_loc=torch.tensor([0, *ends], dtype=torch.int32),
        num_actual_tokens=ends[-1],
    )


def _draft_steps(wrapped, metadata, k: int, mode=None) -> None:
    """The release's draft loop as far as these lists go: step 0 as built, each later step ``seq_lens + 1``."""
    for step in range(k):
        if step > 0:
            metadata.seq_lens = metadata.seq_lens + 1  # mtp_proposer.py:495
        with wrapped({"layer.0": metadata, "layer.1": metadata}, None, aclgraph_runtime_mode=mode, is_draft_model=True):
            pass


def test_each_attention_group_s_metadata_follows(entered):
    """Layers of two attention groups (two metadata objects): each group's lists follow its own lengths."""
    wrapped, seen = entered
    first, second = _dense([40, 17], [2, 2]), _dense([9, 30], [2, 2])
    for step in range(2):
        if step > 0:
            first.seq_lens, second.seq_lens = first.seq_lens + 1, second.seq_lens + 1
        with wrapped({"layer.0": first, "layer.1": second}, None, aclgraph_runtime_mode=None, is_draft_model=True):
            pass
    assert seen[1] == {"layer.0": ([41, 18], [1, 2]), "layer.1": ([10, 31], [1, 2])}
    assert keywords == [dict(aclgraph_runtime_mode=None, is_draft_model=True)] * 2  # the call's own reach the release


def test_later_draft_steps_get_one_query_token_per_request_and_the_moved_on_lengths(entered):
    wrapped, seen = entered
    metadata = _dense([40, 17, 90], [4, 4, 4])  # three decode requests verifying k = 3 drafts
    _draft_steps(wrapped, metadata, k=3)
    assert [s["layer.0"] for s in seen] == [
        ([40, 17, 90], [4, 8, 12]),  # the first step: as built
        ([41, 18, 91], [1, 2, 3]),
        ([42, 19, 92], [1, 2, 3]),
    ]
    assert all(s["layer.0"] == s["layer.1"] for s in seen)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(dict(aclgraph_runtime_mode="FULL", is_draft_model=True), id="full-graph-replay"),
        pytest.param(dict(aclgraph_runtime_mode=None, is_draft_model=False), id="the-target"),
    ],
)
def test_full_graph_replays_and_the_target_are_left_as_released(entered, call):
    wrapped, seen = entered
    mode = type("Mode", (), {"name": call["aclgraph_runtime_mode"]})() if call["aclgraph_runtime_mode"] else None
    metadata = _dense([40, 17], [4, 4])
    metadata.seq_lens = metadata.seq_lens + 1
    with wrapped({"layer.0": metadata}, None, aclgraph_runtime_mode=mode, is_draft_model=call["is_draft_model"]):
        pass
    assert seen == [{"layer.0": ([40, 17], [4, 8])}]


def test_mla_metadata_is_left_to_the_release(entered):
    """MLA metadata (its own class, with a decode part the release updates itself) is not touched."""
    from vllm_ascend.attention.mla_v1 import AscendMLAMetadata

    wrapped, seen = entered
    metadata = AscendMLAMetadata.__new__(AscendMLAMetadata)
    metadata.seq_lens, metadata.seq_lens_list, metadata.actual_seq_lengths_q = torch.tensor([41]), [40], [4]
    with wrapped({"layer.0": metadata}, None, is_draft_model=True):
        pass
    assert seen == [{"layer.0": ([40], [4])}]


@pytest.mark.parametrize(
    "seq_lens",
    [
        pytest.param(None, id="no-host-lengths"),  # the dataclass default
        pytest.param(torch.tensor([41, 18], device="meta"), id="lengths-off-the-host"),  # reading would fail
    ],
)
def test_metadata_without_host_lengths_is_left_as_it_is(entered, seq_lens):
    """Dense metadata whose seq_lens are no host tensor (none set, or on another device: reading them there would
    wait for it) is not read and keeps its lists."""
    wrapped, seen = entered
    metadata = _dense([40, 17], [4, 4])
    metadata.seq_lens = seq_lens
    with wrapped({"layer.0": metadata}, None, is_draft_model=True):
        pass
    assert seen == [{"layer.0": ([40, 17], [4, 8])}]
