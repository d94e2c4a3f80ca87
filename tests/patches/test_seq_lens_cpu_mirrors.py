"""seq-lens-cpu-unpadded / seq-lens-cpu-prepare-inputs-padded (#8749) of adapter ascend-0.19-0.25 on the REAL classes
of this env's release (0.19.1rc1 in va019: the patches apply; later releases: native): real
`AscendCommonAttentionMetadata` and the runner's real drafter (`prepare_inputs_padded`, torch branch). Where the
patches apply, the release's own code is shown to drop the CPU mirrors.
"""

from __future__ import annotations

import dataclasses

import torch
from later_fixes import applies

from zb_patch import registry as R
from zb_patch.detect import detect
from zb_patch.versions import ascend_0_19_0_25 as A


def _padded_metadata():
    """Async + spec mode as the runner builds it: 3 real requests padded to 4, seq_lens_cpu None (GPU is
    authoritative), only the private CPU mirrors set."""
    from vllm_ascend.attention.utils import AscendCommonAttentionMetadata

    qsl = torch.tensor([0, 3, 6, 9, 12], dtype=torch.int32)
    return AscendCommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor([10, 20, 30, 0]),
        num_reqs=4,
        num_actual_tokens=12,
        max_query_len=3,
        max_seq_len=30,
        block_table_tensor=torch.arange(32, dtype=torch.int32).view(4, 8),
        slot_mapping=torch.arange(12),
        seq_lens_cpu=None,
        num_computed_tokens_cpu=None,
        _seq_lens_cpu=torch.tensor([10, 20, 30, 0]),
        _num_computed_tokens_cpu=torch.tensor([7, 17, 27, 0]),
        dcp_local_seq_lens=torch.tensor([5, 10, 15, 0]),
        dcp_local_seq_lens_cpu=torch.tensor([5, 10, 15, 0]),
        is_prefilling=torch.tensor([False, False, True, False]),
        actual_seq_lengths_q=[3, 6, 9, 12],
        positions=torch.arange(12),
        num_input_tokens=12,
        decode_token_per_req=3,
        logits_indices_padded=torch.tensor([2, 5, 8, 11]),
        num_logits_indices=3,
    )


def _same(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


CARRIED_BY_8749 = {
    "_seq_lens_cpu",
    "_num_computed_tokens_cpu",
    "dcp_local_seq_lens",
    "dcp_local_seq_lens_cpu",
    "is_prefilling",
    "encoder_seq_lens",
    "encoder_seq_lens_cpu",
    "logits_indices_padded",
    "num_logits_indices",
}


def test_unpadded_keeps_the_cpu_mirrors(later_patch_set):
    release_unpadded = R.resolve(A.SEQ_LENS_CPU_UNPADDED.target).original
    before = release_unpadded(_padded_metadata(), 9, 3)
    assert later_patch_set.apply(detect()).verdict == R.APPLIED
    after = _padded_metadata().unpadded(9, 3)
    assert after.num_reqs == 3 and after.num_actual_tokens == 9 and after.seq_lens_cpu is None
    assert after._seq_lens_cpu.tolist() == [10, 20, 30]
    assert after._num_computed_tokens_cpu.tolist() == [7, 17, 27]
    assert after.dcp_local_seq_lens.tolist() == [5, 10, 15]
    assert after.is_prefilling.tolist() == [False, False, True]
    # vLLM's fields the Ascend view drops as released, carried as they are (not per request)
    assert after.logits_indices_padded.tolist() == [2, 5, 8, 11] and after.num_logits_indices == 3
    if applies("seq-lens-cpu-unpadded"):
        assert before._seq_lens_cpu is None, "the release itself drops the mirror (the bug #8749 fixes)"
        # every other field is what the release's own unpadded() gives
        for f in dataclasses.fields(after):
            if f.name not in CARRIED_BY_8749:
                assert _same(getattr(after, f.name), getattr(before, f.name)), f.name


def test_prepare_inputs_padded_keeps_the_cpu_mirrors(later_patch_set, make_npu_runner, monkeypatch):
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    assert later_patch_set.apply(detect()).verdict == R.APPLIED
    runner = make_npu_runner()
    drafter = runner.drafter
    target_cls = R.resolve(A.SEQ_LENS_CPU_PREPARE_INPUTS_PADDED.target).owner
    assert isinstance(drafter, target_cls) and "prepare_inputs_padded" not in type(drafter).__dict__
    release_method = R.resolve(A.SEQ_LENS_CPU_PREPARE_INPUTS_PADDED.target).original
    # the torch branch (the Triton one needs triton-ascend's vector-core count)
    monkeypatch.setitem(release_method.__globals__, "HAS_TRITON", False)
    cam = _padded_metadata().unpadded(9, 3)
    spec = SpecDecodeMetadata.make_dummy([[1, 2], [3, 4], [5, 6]], torch.device("cpu"))
    valid = torch.tensor([3, 1, 2], dtype=torch.int64)

    out = drafter.prepare_inputs_padded(cam, spec, valid)
    # the wrapper passes arguments named as the release's signature names them too
    by_name = drafter.prepare_inputs_padded(
        _padded_metadata().unpadded(9, 3), spec_decode_metadata=spec, valid_sampled_tokens_count=valid
    )
    assert by_name[0]._seq_lens_cpu.tolist() == [10, 20, 30] and by_name[2].tolist() == [2, 3, 7]
    meta = out[0]
    assert meta._seq_lens_cpu is not None and meta._seq_lens_cpu.tolist() == [10, 20, 30]
    assert meta._num_computed_tokens_cpu.tolist() == [7, 17, 27]
    assert out[2].tolist() == [2, 3, 7]  # token_indices_to_sample
    if applies("seq-lens-cpu-prepare-inputs-padded"):
        ref = release_method(drafter, _padded_metadata().unpadded(9, 3), spec, valid)
        assert ref[0]._seq_lens_cpu is None, "the release itself drops the mirror (the bug #8749 fixes)"
        for a, b in zip(out[1:], ref[1:]):
            assert _same(a, b)
        for f in dataclasses.fields(meta):
            if f.name not in ("_seq_lens_cpu", "_num_computed_tokens_cpu"):
                assert _same(getattr(meta, f.name), getattr(ref[0], f.name)), f.name
