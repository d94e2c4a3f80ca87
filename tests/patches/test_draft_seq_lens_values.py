"""``draft-seq-lens-max-model-len`` (ascend-0.18; ascend-0.19-0.25 on 0.19.1rc1, native from 0.20.2rc1): the draft
rows' sequence lengths of draft steps 1 .. k-1 as values, not only as device == host.

The release's own ``attn_update_stack_num_spec_norm`` runs (the patch's wrapper around it where the patch applies, the
release's body alone where the fix is native) on real ``AscendCommonAttentionMetadata``, chained over the draft steps
as ``_propose`` chains it, for rows whose lengths reach, sit at and pass ``max_model_len``; what the metadata builder is
handed at each step is compared with lengths computed here from the first step's alone, by vllm-ascend #10112 /
#10147's rule: each step adds one, a length *greater than* ``max_model_len`` becomes 1 (a length equal to it is a full
context, kept). The expected values are also written out for the boundary rows, so a ``>=`` in place of ``>`` (the
release's host mask on 0.18.0) fails on either side. The engine-level effect (tokens, acceptance) is
tests/engine/test_defect_draft_seq_lens_max_model_len.py's.
"""

from __future__ import annotations

import copy
import importlib.metadata
import inspect
import re
import types

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
FAMILY = npu_standin.detect_family()
if FAMILY not in ("0.18", "0.23"):
    pytest.skip(
        f"the proposer's attn_update_stack_num_spec_norm: vllm-ascend 0.18 / 0.19+; this env has {FAMILY}",
        allow_module_level=True,
    )

import numpy as np  # noqa: E402
import torch  # noqa: E402

RELEASE = importlib.metadata.version("vllm-ascend")
MAX_MODEL_LEN, BLOCK_SIZE, K = 64, 16, 4
# the first draft step's lengths (the padded drafter's count the step's rejected drafts, so some pass the limit)
FIRST = [10, MAX_MODEL_LEN - 3, MAX_MODEL_LEN - 2, MAX_MODEL_LEN - 1, MAX_MODEL_LEN, MAX_MODEL_LEN + 2]
# draft steps 1 .. K-1 of the boundary rows, written out: max_model_len itself is kept, one past it is 1
WRITTEN_OUT = {
    MAX_MODEL_LEN - 2: [63, 64, 1],
    MAX_MODEL_LEN - 1: [64, 1, 2],
    MAX_MODEL_LEN: [1, 2, 3],
}


def expected_lengths(first: list[int], steps: int, max_model_len: int) -> list[list[int]]:
    """#10112 / #10147: ``seq_lens += 1`` then ``seq_lens[seq_lens > max_model_len] = 1``, per step, in plain ints."""
    out, lengths = [], list(first)
    for _ in range(steps):
        lengths = [n + 1 for n in lengths]
        lengths = [1 if n > max_model_len else n for n in lengths]
        out.append(lengths)
    return out


def test_the_expected_values_are_the_written_out_ones():
    steps = expected_lengths(FIRST, K - 1, MAX_MODEL_LEN)
    for row, first in enumerate(FIRST):
        if first in WRITTEN_OUT:
            assert [s[row] for s in steps] == WRITTEN_OUT[first], first
    # the rule the reference implements is not `>=`: a length of max_model_len is kept at least once
    assert any(MAX_MODEL_LEN in s for s in steps)


@pytest.fixture(scope="module")
def target(cpu_worker):
    """(the patch spec of this env's adapter, the release's function, whether the patch applies here)."""
    from zb_patch import registry as R
    from zb_patch.versions import fingerprint_in_tree, native

    if FAMILY == "0.18":
        from zb_patch.versions.ascend_0_18 import ADAPTER
    else:
        from zb_patch.versions.ascend_0_19_0_25 import ADAPTER
    # the adapter's spec: its native forms include those of the recorded commits (a maintenance-branch head)
    (patch,) = [p for p in ADAPTER.patch_set.patches if p.id == "draft-seq-lens-max-model-len"]
    resolved = R.resolve(patch.target, import_missing=True)
    assert resolved.found, resolved.reason
    fp = fingerprint_in_tree(native.installed_root(), patch.target)
    applies = fp in patch.fingerprints.values()
    assert applies or fp in patch.native_fingerprints.values(), (RELEASE, fp)
    return patch, resolved.original, applies


class _Builder:
    def __init__(self, seen):
        self.seen = seen

    def _record(self, args, kwargs):
        common = kwargs.get("common_attn_metadata") or next(a for a in args if hasattr(a, "seq_lens_cpu"))
        rows = len(FIRST)
        host, internal = common.seq_lens_cpu, common._seq_lens_cpu
        self.seen.append(
            (
                common.seq_lens[:rows].tolist(),
                None if host is None else host[:rows].tolist(),
                None if internal is None else internal[:rows].tolist(),
            )
        )
        return types.SimpleNamespace(kind="draft attention metadata")

    def build_for_drafting(self, *args, **kwargs):
        return self._record(args, kwargs)

    def build(self, *args, **kwargs):
        return self._record(args, kwargs)


class _Group:
    def __init__(self):
        self.seen = []

    def get_metadata_builder(self, *args, **kwargs):
        return _Builder(self.seen)


def _first_step_metadata(internal_host_copy=False, host_copy=True):
    """``internal_host_copy``: vLLM's ``_seq_lens_cpu`` set as well, as 0.19.1rc1's runner sets it (its attention
    builders prefer it); None otherwise (0.18.0 never sets it). ``host_copy=False``: no ``seq_lens_cpu``, as
    0.19.1rc1's runner builds the metadata under async scheduling with drafts (``use_async_spec_decode``)."""
    from vllm_ascend.attention.utils import AscendCommonAttentionMetadata

    n = len(FIRST)
    lengths = torch.tensor(FIRST, dtype=torch.int32)
    blocks = MAX_MODEL_LEN // BLOCK_SIZE + 1
    metadata = AscendCommonAttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        query_start_loc_cpu=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=lengths.clone(),
        seq_lens_cpu=lengths.clone() if host_copy else None,
        num_computed_tokens_cpu=lengths.clone() - 1,
        num_reqs=n,
        num_actual_tokens=n,
        max_query_len=1,
        max_seq_len=int(lengths.max()),
        block_table_tensor=torch.arange(n * blocks, dtype=torch.int32).view(n, blocks),
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        positions=(lengths - 1).to(torch.int64),
    )
    if internal_host_copy:
        metadata._seq_lens_cpu = lengths.clone()
    return metadata


def _proposer():
    """What the release's method reads of its proposer on the eager, non-CP path."""
    n = len(FIRST)
    return types.SimpleNamespace(
        shallow_copy_metadata=copy.copy,
        arange=torch.arange(n + 1, dtype=torch.int32),
        token_arange_np=np.arange(n + 1, dtype=np.int32),
        method="mtp",
        uses_mrope=False,
        max_model_len=MAX_MODEL_LEN,
        pcp_size=1,
        dcp_size=1,
        kernel_block_size=BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        slot_mapping_group=[torch.zeros(n, dtype=torch.int32) for _ in range(K)],
        seq_lens_group=[torch.zeros(n, dtype=torch.int32) for _ in range(K)],  # 0.19.1rc1
        query_start_loc_group=[torch.zeros(n + 1, dtype=torch.int32) for _ in range(K)],
        runner=types.SimpleNamespace(pcp_manager=None),  # 0.23.0+: no context parallelism
        has_gdn=False,
        use_compress=False,
        draft_window_size=None,  # 0.25.1rc1: no sliding-window drafter
    )


def _draft_steps(fn, internal_host_copy=False, host_copy=True) -> list[tuple[list[int], list[int], list[int] | None]]:
    """Draft steps 1 .. K-1 as ``_propose`` runs them: each step's common metadata is the next step's old one; what
    the builder was handed at each step, (device lengths, host lengths, ``_seq_lens_cpu`` or None)."""
    from vllm.config import CUDAGraphMode

    params = list(inspect.signature(fn).parameters)
    group, proposer = _Group(), _proposer()
    common = _first_step_metadata(internal_host_copy, host_copy)
    positions = common.positions.clone()
    for step in range(1, K):
        kwargs = {
            params[1]: step,  # draft_step / draft_index
            "old_common_metadata": common,
            "batch_size": len(FIRST),
            "input_batch_size": len(FIRST),
            "used_update_positions": positions,
            "aclgraph_runtime_mode": CUDAGraphMode.NONE,
            "attn_group": group,
        }
        if "old_attn_metadata" in params:
            kwargs["old_attn_metadata"] = None
        common, _ = fn(proposer, **kwargs)
    return group.seen


def _check(seen, expected):
    assert len(seen) == K - 1
    for step, ((device, host, _), want) in enumerate(zip(seen, expected), start=1):
        assert device == want, f"draft step {step}: device lengths {device}, #10112's {want}"
        assert host == want, f"draft step {step}: host lengths {host}, #10112's {want}"


def test_draft_lengths_are_10112_s_at_and_past_max_model_len(target):
    """The patched method where the patch applies (0.18.0, 0.19.1rc1), the release's own where the fix is native."""
    patch, original, applies = target
    fn = patch.make(original) if applies else original
    seen = _draft_steps(fn)
    _check(seen, expected_lengths(FIRST, K - 1, MAX_MODEL_LEN))
    for row, first in enumerate(FIRST):
        if first in WRITTEN_OUT:
            assert [s[0][row] for s in seen] == WRITTEN_OUT[first], first


def test_the_release_without_the_patch_gets_other_values(target):
    """Where the patch applies, the release's own method hands the builder other lengths (the test sees the bug)."""
    patch, original, applies = target
    if not applies:
        pytest.skip(f"vllm-ascend {RELEASE} carries the fix")
    seen = _draft_steps(original)
    with pytest.raises(AssertionError):
        _check(seen, expected_lengths(FIRST, K - 1, MAX_MODEL_LEN))
    row = FIRST.index(MAX_MODEL_LEN - 1)
    assert seen[0][1][row] == 1  # the host mask `>=`: a length of max_model_len set to 1


def test_the_internal_host_copy_gets_10112_s_lengths_too(target):
    """Where the first step's metadata carries vLLM's ``_seq_lens_cpu`` (0.19.1rc1's runner sets it and its attention
    builders read it before ``seq_lens_cpu``; 0.18.0's class has the field, nothing sets it), the builder is handed
    #10112's lengths there as well."""
    patch, original, applies = target
    if not applies and FAMILY == "0.18":
        # the releases/v0.18.0 head's native fix masks seq_lens / seq_lens_cpu and carries _seq_lens_cpu over as
        # handed; nothing on 0.18's draft path sets it (the proposer overrides the vLLM methods that do)
        assert not re.search(r"\b_seq_lens_cpu\b", inspect.getsource(inspect.getmodule(original)))
        pytest.skip(f"vllm-ascend {RELEASE}: its proposer neither sets nor reads _seq_lens_cpu")
    fn = patch.make(original) if applies else original
    seen = _draft_steps(fn, internal_host_copy=True)
    expected = expected_lengths(FIRST, K - 1, MAX_MODEL_LEN)
    _check(seen, expected)
    for step, ((_, _, internal), want) in enumerate(zip(seen, expected), start=1):
        assert internal == want, f"draft step {step}: _seq_lens_cpu {internal}, #10112's {want}"


def test_without_seq_lens_cpu_the_internal_host_copy_gets_10112_s_lengths(target):
    """0.19.1rc1 under async scheduling with drafts: the metadata has no ``seq_lens_cpu``, only ``_seq_lens_cpu``;
    the builder is handed #10112's lengths there and on the device, and still no ``seq_lens_cpu``."""
    if FAMILY == "0.18":
        pytest.skip(f"vllm-ascend {RELEASE}'s runner always sets seq_lens_cpu (its proposer clones it unconditionally)")
    patch, original, applies = target
    fn = patch.make(original) if applies else original
    seen = _draft_steps(fn, internal_host_copy=True, host_copy=False)
    expected = expected_lengths(FIRST, K - 1, MAX_MODEL_LEN)
    assert [s[0] for s in seen] == expected
    assert [s[1] for s in seen] == [None] * (K - 1)
    assert [s[2] for s in seen] == expected


def test_a_call_without_attn_group_is_the_release_s_own(target):
    """No attention group to stand in for: the call reaches the release's body as it was made (draft step by
    position, the rest by name), and the release refuses it as it does unpatched."""
    patch, original, applies = target
    if not applies:
        pytest.skip(f"vllm-ascend {RELEASE} carries the fix: nothing is wrapped")
    from vllm.config import CUDAGraphMode

    common = _first_step_metadata()
    kwargs = dict(
        old_common_metadata=common,
        batch_size=len(FIRST),
        input_batch_size=len(FIRST),
        used_update_positions=common.positions.clone(),
        aclgraph_runtime_mode=CUDAGraphMode.NONE,
        attn_group=None,
    )
    if "old_attn_metadata" in inspect.signature(original).parameters:
        kwargs["old_attn_metadata"] = None
    for fn in (original, patch.make(original)):
        with pytest.raises(AssertionError, match="requires attn_group"):
            fn(_proposer(), 1, **kwargs)


def test_the_mask_fills_the_internal_host_copy_where_seq_lens_cpu_is_none():
    """The masking step on its own, on metadata as 0.19.1rc1's runner builds it under async scheduling with drafts
    (``_seq_lens_cpu``, no ``seq_lens_cpu``): the device lengths and ``_seq_lens_cpu`` of the first ``rows`` rows get
    #10112's next step, the rows past them are left as they were, and the missing host copy stays missing."""
    from zb_patch.versions.fixes.draft_seq_lens_max_model_len import mask_draft_lengths

    previous = _first_step_metadata(internal_host_copy=True, host_copy=False)
    common = _first_step_metadata(internal_host_copy=True, host_copy=False)
    common.seq_lens.fill_(-7)
    common._seq_lens_cpu.fill_(-7)
    rows = len(FIRST) - 1
    mask_draft_lengths(common, previous, rows, MAX_MODEL_LEN)
    want = expected_lengths(FIRST, 1, MAX_MODEL_LEN)[0][:rows] + [-7]
    assert common.seq_lens.tolist() == want
    assert common._seq_lens_cpu.tolist() == want
    assert common.seq_lens_cpu is None
