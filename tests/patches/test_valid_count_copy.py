"""valid-count-copy-order (#9456) and valid-count-int64 (#10205) of adapter ascend-0.19-0.25 on the REAL classes of
this env's release (0.19.1rc1 in va019: the patches apply; later releases: native), one test for both: a real
`NPUModelRunner` (tiny Llama + EAGLE configs, async scheduling, no weights) runs `_copy_valid_sampled_token_count`;
the order of stream / event calls and the dtypes of the D2H copy are recorded. The NPU stand-in's CPU streams order
nothing, so the test records explicitly: `torch.npu.current_stream` / `torch.npu.stream` are replaced for the test by
a stream stack (monkeypatch; the stand-in's declared surface is unchanged) and copies are seen through a
TorchFunctionMode. Where the patches apply, the release's own code is shown to have both bugs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from later_fixes import RELEASE, applies
from torch.overrides import TorchFunctionMode

from zb_patch import registry as R
from zb_patch.detect import detect


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


def test_valid_count_copy_waits_for_the_default_stream_and_does_not_cast(later_patch_set, make_npu_runner, stream_log):
    assert later_patch_set.apply(detect()).verdict == R.APPLIED
    runner = make_npu_runner()
    assert runner.use_async_scheduling and runner.num_spec_tokens == 2
    assert runner.valid_sampled_token_count_cpu.dtype == torch.int64
    assert runner.valid_sampled_token_count_cpu.shape == (runner.max_num_reqs,)
    _assert_fixed_order(_copy_counts(runner, stream_log))


@pytest.mark.skipif(
    not (applies("valid-count-copy-order") and applies("valid-count-int64")),
    reason=f"vllm-ascend {RELEASE} already carries #9456 and #10205",
)
def test_release_without_the_patches_has_both_bugs(later_patch_set, make_npu_runner, stream_log):
    """What the two patches change on this release: unpatched, the copy stream waits on itself (#9456) and the
    copy casts int64 -> int32 (#10205: a blocking copy on NPU)."""
    runner = make_npu_runner()
    assert runner.valid_sampled_token_count_cpu.dtype == torch.int32
    assert _copy_counts(runner, stream_log) == [
        ("wait_stream", "copy", "copy"),
        ("copy", "copy", torch.int64, torch.int32, True),
        ("event.record", "copy"),
    ]


def test_int64_buffer_only_with_async_spec_decode(later_patch_set, make_npu_runner):
    """#10205's condition: without async scheduling vLLM allocates no CPU valid-count buffer, nor does the patch."""
    later_patch_set.apply(detect())
    runner = make_npu_runner(async_scheduling=False)
    assert not runner.use_async_scheduling
    assert runner.valid_sampled_token_count_cpu is None
