"""The later-fix patches of adapter ascend-0.19-0.25 on the REAL classes of this env's release (vllm-ascend
0.19.1rc1 in va019: the patches apply; 0.23.0 in va023: every fix is native). Each test checks the behaviour of
the installed code after `PatchSet.apply` (patched or native alike), and, where the patch applies, that the
release's own code shows the bug the patch fixes (so the test is sensitive to it).

* valid-count-copy-order (#9456) and valid-count-int64 (#10205): a real `NPUModelRunner` (tiny Llama + EAGLE
  configs, async scheduling, no weights) runs `_copy_valid_sampled_token_count`; the order of stream / event
  calls and the dtypes of the D2H copy are recorded. The NPU stand-in's CPU streams order nothing, so the test
  records explicitly: `torch.npu.current_stream` / `torch.npu.stream` are replaced for the test by a stream
  stack (monkeypatch; the stand-in's declared surface is unchanged) and copies are seen through a
  TorchFunctionMode.
* seq-lens-cpu-unpadded / seq-lens-cpu-prepare-inputs-padded (#8749): real `AscendCommonAttentionMetadata` and
  the runner's real drafter (`prepare_inputs_padded`, torch branch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
if npu_standin.detect_family() != "0.23":
    pytest.skip(
        f"adapter ascend-0.19-0.25 covers vllm-ascend 0.19.1rc1-0.25.1rc1; this env has {npu_standin.detect_family()}",
        allow_module_level=True,
    )

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from zb_patch import registry as R  # noqa: E402
from zb_patch.detect import detect  # noqa: E402
from zb_patch.versions import ascend_0_19_0_25 as A  # noqa: E402

RELEASE = importlib.metadata.version("vllm-ascend")

# where each fix patch is applied (installed code lacks the fix); native on every other release of the adapter
# (docs/releases/ascend-0.19-0.25.md section 2, from the code of each release)
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
}


def _applies(patch_id):
    return RELEASE in APPLIED_ON[patch_id]


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
    for aid, releases in ADVISORY_ON.items():
        assert verdicts[aid] == (R.ADVISORY if RELEASE in releases else R.OK), (aid, RELEASE)
    patch_set.unpatch()
    assert all(R.resolve(p.target).patched_by is None for p in patch_set.patches)


# --------------------------------------------------------------------------------------------------------
# A real NPUModelRunner (async scheduling + EAGLE, k=2) on CPU
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_config(tiny_eagle_config, tmp_path_factory):
    return tiny_eagle_config(tmp_path_factory.mktemp("tiny-models"), enforce_eager=True)


@pytest.fixture
def make_runner(vllm_config):
    from vllm.config import set_current_vllm_config
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    def make(async_scheduling=True):
        # vLLM's CPU platform (tests/patches/conftest.py) turns async scheduling off; the runner reads the flag
        # in its constructor, so it is set back here
        vllm_config.scheduler_config.async_scheduling = async_scheduling
        with set_current_vllm_config(vllm_config):
            return NPUModelRunner(vllm_config, torch.device("cpu"))

    return make


class _Log:
    def __init__(self):
        self.calls = []
        self.stack = []


class _RecStream:
    """Records wait_stream; built on the stand-in's CPU Stream (which orders nothing by itself)."""

    def __init__(self, name, log):
        from npu_standin.runtime import Stream

        self._stream, self.name, self.log = Stream(), name, log

    def wait_stream(self, other):
        self.log.calls.append(("wait_stream", self.name, other.name))
        self._stream.wait_stream(other._stream)


class _RecEvent:
    def __init__(self, log):
        from npu_standin.runtime import Event

        self._event, self.log = Event(), log

    def record(self, stream=None):
        self.log.calls.append(("event.record", (stream or self.log.stack[-1]).name))
        self._event.record()

    def synchronize(self):
        self._event.synchronize()


class _CopyLog(TorchFunctionMode):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            self.log.calls.append(
                (
                    "copy",
                    self.log.stack[-1].name,
                    src.dtype,
                    dst.dtype,
                    bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False)),
                )
            )
        return func(*args, **kwargs)


@pytest.fixture
def stream_log(monkeypatch, cpu_worker):
    """A stream stack behind torch.npu.current_stream / torch.npu.stream, for this test only."""
    log = _Log()
    log.stack.append(_RecStream("default", log))

    def current_stream(device=None):
        return log.stack[-1]

    @contextlib.contextmanager
    def stream(s):
        log.stack.append(s if s is not None else log.stack[-1])
        try:
            yield s
        finally:
            log.stack.pop()

    monkeypatch.setattr(torch.npu, "current_stream", current_stream)
    monkeypatch.setattr(torch.npu, "stream", stream)
    return log


def _copy_counts(runner, log):
    runner.valid_sampled_token_count_copy_stream = _RecStream("copy", log)
    runner.valid_sampled_token_count_event = _RecEvent(log)
    # Ascend's prepare_next_token_ids_padded returns valid_mask.sum(dim=1): an int64 device tensor
    counts = torch.tensor([3, 1, 2], dtype=torch.int64)
    with _CopyLog(log):
        runner._copy_valid_sampled_token_count(torch.tensor([11, 12, 13], dtype=torch.int32), counts)
    assert runner.valid_sampled_token_count_cpu[:3].tolist() == [3, 1, 2]
    assert runner.input_batch.prev_sampled_token_ids.tolist() == [[11], [12], [13]]
    if runner.use_async_spec_decode:
        assert runner.valid_sampled_token_count_gpu is counts
    return log.calls


def _assert_fixed_order(calls):
    """#9456 + #10205 semantics, whatever the code's shape: before the D2H copy the side stream has waited on
    the default stream (where the sampler ran); the copy runs on the side stream without a dtype cast; the event
    is recorded on the side stream after it."""
    copies = [i for i, c in enumerate(calls) if c[0] == "copy"]
    assert len(copies) == 1, calls
    at = copies[0]
    assert ("wait_stream", "copy", "default") in calls[:at], calls
    assert calls[at] == ("copy", "copy", torch.int64, torch.int64, True), calls
    assert ("event.record", "copy") in calls[at + 1 :], calls


def test_valid_count_copy_waits_for_the_default_stream_and_does_not_cast(patch_set, make_runner, stream_log):
    assert patch_set.apply(detect()).verdict == R.APPLIED
    runner = make_runner()
    assert runner.use_async_scheduling and runner.num_spec_tokens == 2
    assert runner.valid_sampled_token_count_cpu.dtype == torch.int64
    assert runner.valid_sampled_token_count_cpu.shape == (runner.max_num_reqs,)
    _assert_fixed_order(_copy_counts(runner, stream_log))


@pytest.mark.skipif(
    not (_applies("valid-count-copy-order") and _applies("valid-count-int64")),
    reason=f"vllm-ascend {RELEASE} already carries #9456 and #10205",
)
def test_release_without_the_patches_has_both_bugs(patch_set, make_runner, stream_log):
    """What the two patches change on this release: unpatched, the copy stream waits on itself (#9456) and the
    copy casts int64 -> int32 (#10205: a blocking copy on NPU)."""
    runner = make_runner()
    assert runner.valid_sampled_token_count_cpu.dtype == torch.int32
    assert _copy_counts(runner, stream_log) == [
        ("wait_stream", "copy", "copy"),
        ("copy", "copy", torch.int64, torch.int32, True),
        ("event.record", "copy"),
    ]


def test_int64_buffer_only_with_async_spec_decode(patch_set, make_runner):
    """#10205's condition: without async scheduling vLLM allocates no CPU valid-count buffer, nor does the patch."""
    patch_set.apply(detect())
    runner = make_runner(async_scheduling=False)
    assert not runner.use_async_scheduling
    assert runner.valid_sampled_token_count_cpu is None


# --------------------------------------------------------------------------------------------------------
# #8749: the CPU seq_lens mirrors survive unpadded() and prepare_inputs_padded()
# --------------------------------------------------------------------------------------------------------


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


def test_unpadded_keeps_the_cpu_mirrors(patch_set):
    release_unpadded = R.resolve(A.SEQ_LENS_CPU_UNPADDED.target).original
    before = release_unpadded(_padded_metadata(), 9, 3)
    assert patch_set.apply(detect()).verdict == R.APPLIED
    after = _padded_metadata().unpadded(9, 3)
    assert after.num_reqs == 3 and after.num_actual_tokens == 9 and after.seq_lens_cpu is None
    assert after._seq_lens_cpu.tolist() == [10, 20, 30]
    assert after._num_computed_tokens_cpu.tolist() == [7, 17, 27]
    assert after.dcp_local_seq_lens.tolist() == [5, 10, 15]
    assert after.is_prefilling.tolist() == [False, False, True]
    if _applies("seq-lens-cpu-unpadded"):
        assert before._seq_lens_cpu is None, "the release itself drops the mirror (the bug #8749 fixes)"
        # every other field is what the release's own unpadded() gives
        for f in dataclasses.fields(after):
            if f.name not in CARRIED_BY_8749:
                assert _same(getattr(after, f.name), getattr(before, f.name)), f.name


def test_prepare_inputs_padded_keeps_the_cpu_mirrors(patch_set, make_runner, monkeypatch):
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    assert patch_set.apply(detect()).verdict == R.APPLIED
    runner = make_runner()
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
    meta = out[0]
    assert meta._seq_lens_cpu is not None and meta._seq_lens_cpu.tolist() == [10, 20, 30]
    assert meta._num_computed_tokens_cpu.tolist() == [7, 17, 27]
    assert out[2].tolist() == [2, 3, 7]  # token_indices_to_sample
    if _applies("seq-lens-cpu-prepare-inputs-padded"):
        ref = release_method(drafter, _padded_metadata().unpadded(9, 3), spec, valid)
        assert ref[0]._seq_lens_cpu is None, "the release itself drops the mirror (the bug #8749 fixes)"
        for a, b in zip(out[1:], ref[1:]):
            assert _same(a, b)
        for f in dataclasses.fields(meta):
            if f.name not in ("_seq_lens_cpu", "_num_computed_tokens_cpu"):
                assert _same(getattr(meta, f.name), getattr(ref[0], f.name)), f.name
