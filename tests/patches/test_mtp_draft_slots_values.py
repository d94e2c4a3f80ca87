"""``mtp-draft-slots`` (ascend-0.13) as values: the KV slot each later MTP draft step hands the attention backend is
the one its position has in its own request's blocks.

0.13.0's ``MtpProposer._propose`` moves every draft token's slot on with ``slot_mapping += 1`` after the first draft
step and masks rows past ``max_model_len`` with the padding slot; the patch's stand-in for the proposer's model
(``fixes.mtp_draft_slots._SlotsFromBlockTable``) rewrites, before each later model call, the slots of the real
attention metadata in vLLM's forward context from the positions the model is handed and the step's block table. Here
the release's later steps are played as the release plays them (positions clamped at ``max_model_len``, slots
``+= 1`` and masked) around the stand-in, and the slots the model sees are compared with slots enumerated from each
request's own block list (``[b * block_size + o for b in blocks for o in range(block_size)][position]``), not from
the block table tensor or the patch's arithmetic. The requests' blocks are not consecutive ids, so a draft at a
block's first position is where ``+= 1`` lands in another block. The engine-level checks (every later draft write on
the real ``_propose``) are tests/engine/test_defect_mtp_draft_slots_and_lengths.py's."""

from __future__ import annotations

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
if npu_standin.detect_family() != "0.13":
    pytest.skip("mtp-draft-slots: ascend-0.13 (0.16.0rc1+ have no MtpProposer)", allow_module_level=True)

import torch  # noqa: E402

from zb_patch.versions.fixes import mtp_draft_slots  # noqa: E402

BLOCK_SIZE, MAX_MODEL_LEN, K = 16, 64, 4
PADDING_SLOT_ID = -1
# per row: the request's blocks (scheduler order, not consecutive ids) and the first draft step's position
BLOCKS = [[3, 9, 1, 14], [7, 2, 12, 4], [5, 11, 0, 8], [6, 10, 13, 15]]
FIRST = [14, 31, 40, MAX_MODEL_LEN - 2]  # rows crossing into a new block at draft step 2 / 1 / none; past the limit


def own_slot(row: int, position: int) -> int:
    """The slot of ``position`` in row ``row``'s own blocks, by enumeration of the request's block list."""
    slots = [b * BLOCK_SIZE + o for b in BLOCKS[row] for o in range(BLOCK_SIZE)]
    return slots[position]


def expected_slots(step: int) -> list[int]:
    """Draft step ``step``'s slots: the position's own slot; the padding slot past max_model_len (the release's)."""
    out = []
    for row, first in enumerate(FIRST):
        position = first + step
        out.append(PADDING_SLOT_ID if position >= MAX_MODEL_LEN else own_slot(row, position))
    return out


def _metadata():
    from vllm_ascend.attention.attention_v1 import AscendMetadata

    n = len(FIRST)
    step0 = torch.tensor([own_slot(r, p) for r, p in enumerate(FIRST)], dtype=torch.int32)  # the runner's, correct
    return AscendMetadata(
        seq_lens=torch.tensor([p + 1 for p in FIRST], dtype=torch.int32),
        seq_lens_list=[p + 1 for p in FIRST],
        actual_seq_lengths_q=list(range(1, n + 1)),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        num_actual_tokens=n,
        slot_mapping=step0,
    )


def _draft_pass(model_for_the_pass) -> list[list[int]]:
    """The release's k draft-model calls of one ``_propose`` (eager, no CP) around ``model_for_the_pass(model)``;
    returns the slots the model saw at each call."""
    return _draft_pass_around(lambda model, draft_calls: draft_calls(model_for_the_pass(model)))


def _draft_pass_around(around, k: int = K) -> list[list[int]]:
    """As :func:`_draft_pass`, the k calls made by ``around(model, draft_calls)`` (``draft_calls(called)`` plays them
    on ``called``)."""
    from vllm.forward_context import ForwardContext

    seen = []
    metadata = _metadata()
    n = len(FIRST)

    def model(input_ids=None, positions=None, hidden_states=None):
        seen.append(metadata.slot_mapping[:n].tolist())
        return hidden_states

    context = ForwardContext(no_compile_layers={}, attn_metadata={"mtp.attn": metadata}, virtual_engine=0)
    around(model, lambda called: _draft_calls(called, context, metadata, k))
    return seen


def _draft_calls(called, context, metadata, k: int) -> None:
    from vllm.forward_context import override_forward_context

    n = len(FIRST)
    positions = torch.tensor(FIRST, dtype=torch.int64)
    with override_forward_context(context):
        for step in range(k):
            if step > 0:  # mtp_proposer.py:486-512: positions on by one, clamped past the limit; slots += 1, masked
                positions = positions + 1
                exceeds = positions >= MAX_MODEL_LEN
                metadata.slot_mapping += 1
                metadata.slot_mapping.masked_fill_(exceeds, PADDING_SLOT_ID)
                model_positions = torch.where(exceeds, 0, positions)
            else:
                model_positions = positions
            called(input_ids=torch.zeros(n, dtype=torch.int64), positions=model_positions, hidden_states=None)


def _patched(model):
    block_table = torch.tensor(BLOCKS, dtype=torch.int32)
    return mtp_draft_slots._SlotsFromBlockTable(model, block_table, len(FIRST), BLOCK_SIZE)


def test_expected_slots_cross_blocks_and_the_limit():
    """The workload has what the check needs: later drafts at a block's first position, whose next block id is not
    the request's next block, and a row the release pads past max_model_len."""
    later = [(r, p + s) for s in range(1, K) for r, p in enumerate(FIRST)]
    starts = [(r, p) for r, p in later if p % BLOCK_SIZE == 0 and p < MAX_MODEL_LEN]
    assert len(starts) >= 2 and all(own_slot(r, p) != own_slot(r, p - 1) + 1 for r, p in starts)
    assert PADDING_SLOT_ID in expected_slots(K - 1)


def test_every_later_draft_gets_its_position_s_own_slot():
    seen = _draft_pass(_patched)
    assert len(seen) == K
    for step in range(K):
        assert seen[step] == expected_slots(step), f"draft step {step}"


def test_the_release_alone_gives_other_slots():
    """Without the stand-in (the release's ``+= 1``) the later drafts at a block's first position get the slot after
    the previous one: another block id's."""
    seen = _draft_pass(lambda model: model)
    assert seen[0] == expected_slots(0)
    wrong = [(s, r) for s in range(1, K) for r in range(len(FIRST)) if seen[s][r] != expected_slots(s)[r]]
    assert wrong and all(
        (FIRST[r] + s) % BLOCK_SIZE == 0 or seen[s - 1][r] != expected_slots(s - 1)[r] for s, r in wrong
    )


@pytest.mark.parametrize(
    "k, pcp, dcp, shared_expert_dp, fixed",
    [
        pytest.param(2, 1, 1, False, True, id="k2"),
        pytest.param(K, 1, 1, False, True, id="k4"),
        pytest.param(K, 2, 1, False, False, id="pcp2"),
        pytest.param(K, 1, 2, False, False, id="dcp2"),
        pytest.param(K, 1, 1, True, False, id="shared-expert-dp"),
    ],
)
def test_the_wrapped_propose_gives_own_slots_where_the_release_adds_one(k, pcp, dcp, shared_expert_dp, fixed):
    """``make_mtp_propose`` around a stand-in for the release's ``_propose`` (its k draft-model calls on
    ``drafter.model``, played as :func:`_draft_pass` plays them), called as the release's runner calls it (keywords):
    for k >= 2 without context parallelism or shared-expert DP the model sees each position's own slot; with PCP /
    DCP or shared-expert DP the slots are the release's own (``+= 1``); the drafter's model is its own again after.
    The drafter is the release's MtpProposer class with the attributes its __init__ sets (no model loaded)."""
    import functools
    import types

    from test_readded_request_drafts import _batch_of
    from vllm_ascend.spec_decode.mtp_proposer import MtpProposer

    drafter = MtpProposer.__new__(MtpProposer)
    drafter.num_speculative_tokens, drafter.pcp_size, drafter.dcp_size = k, pcp, dcp
    drafter.enable_shared_expert_dp = shared_expert_dp
    drafter.runner = types.SimpleNamespace(input_batch=_batch_of({}))  # the runner's block tables: BLOCK_SIZE
    assert drafter.runner.input_batch.block_table.block_tables[0].block_size == BLOCK_SIZE

    def around(model, draft_calls):
        @functools.wraps(MtpProposer._propose)  # the release's signature, which the wrapper binds
        def release_propose(self, **kwargs):
            draft_calls(lambda **inputs: self.model(**inputs))

        drafter.model = model
        mtp_draft_slots.make_mtp_propose(release_propose)(
            drafter,
            target_token_ids=torch.zeros(len(FIRST), dtype=torch.int64),
            target_positions=torch.tensor(FIRST),
            target_hidden_states=None,
            next_token_ids=torch.zeros(len(FIRST), dtype=torch.int64),
            last_token_indices=None,
            common_attn_metadata=types.SimpleNamespace(block_table_tensor=torch.tensor(BLOCKS, dtype=torch.int32)),
            sampling_metadata=None,
        )
        assert drafter.__dict__["model"] is model

    seen = _draft_pass_around(around, k)
    if fixed:
        assert seen == [expected_slots(step) for step in range(k)]
    else:
        assert seen == _draft_pass(lambda model: model)[:k] != [expected_slots(step) for step in range(k)]
