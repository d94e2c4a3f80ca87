"""Dispatch: Triton for device tensors (and CPU tensors under TRITON_INTERPRET=1), reference otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from kernel_env import HAVE_TRITON, INTERPRET, requires_kernels

from zb_patch import kernels

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, full_env.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True, text=True, timeout=300
    )


def test_cpu_tensors_use_the_reference_without_importing_triton():
    proc = _run("""
        import importlib.abc, sys
        class NoTriton(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton blocked by the test")
        sys.meta_path.insert(0, NoTriton())
        import torch
        from zb_patch import kernels
        bt = torch.arange(32, dtype=torch.int32).reshape(4, 8)
        out = torch.zeros(8, dtype=torch.int64)
        m = kernels.slot_mapper(bt, out, block_size=4, max_num_tokens=6)
        m(2, torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([0, 5, 1]))
        assert out.tolist() == [0, 5, 33, -1, -1, -1, 0, 0], out.tolist()
        nc = torch.tensor([7, 9], dtype=torch.int32); seq = torch.zeros(2, dtype=torch.int32)
        kernels.update_token_counts(nc, None, None, None, None, torch.tensor([3, 4], dtype=torch.int32),
                                    torch.tensor([1, 1], dtype=torch.int32), seq, num_reqs=2)
        assert nc.tolist() == [3, 4] and seq.tolist() == [4, 5]
        assert "triton" not in sys.modules
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_uses_triton():
    assert kernels.uses_triton("cuda")
    assert kernels.uses_triton("npu")
    assert kernels.uses_triton(torch.device("meta"))
    assert kernels.uses_triton("cpu") == INTERPRET


@pytest.mark.parametrize("interpret", [False, True])
def test_uses_triton_on_the_cpu_follows_the_interpreter(monkeypatch, interpret):
    """The CPU, named or as a device, goes to Triton only under its interpreter; any other device always does."""
    monkeypatch.setattr(kernels, "interpret_mode", lambda: interpret)
    assert kernels.uses_triton("cpu") is interpret
    assert kernels.uses_triton(torch.device("cpu")) is interpret
    assert kernels.uses_triton(torch.device("meta")) and kernels.uses_triton("npu")


@requires_kernels
def test_interpret_mode_sends_cpu_tensors_to_triton():
    if not INTERPRET:  # pragma: no cover - GPU run
        return
    bt = torch.zeros(2, 4, dtype=torch.int32)
    mapper = kernels.slot_mapper(bt, torch.zeros(4, dtype=torch.int64), block_size=4, max_num_tokens=4)
    assert type(mapper).__name__ == "SlotMappingLauncher"
    assert HAVE_TRITON


def test_launcher_classes_are_imported_lazily():
    if not HAVE_TRITON:
        pytest.skip("triton is not importable here")
    from zb_patch.kernels import slot_mapping, token_counts

    assert kernels.SlotMappingLauncher is slot_mapping.SlotMappingLauncher
    assert kernels.TokenCountsLauncher is token_counts.TokenCountsLauncher
    with pytest.raises(AttributeError):
        kernels.NoSuchLauncher  # noqa: B018


def test_one_shot_slot_mapping_keeps_one_mapper_per_buffer_layout(monkeypatch):
    """compute_slot_mapping caches a mapper per (buffers, configuration): the same buffers reuse it, other output
    buffers get their own, the cache starts again at 64 entries; an empty batch only pads; arguments that are no
    tensors are rejected by name."""
    monkeypatch.setattr(kernels, "_MAPPERS", {})
    bt = torch.arange(32, dtype=torch.int32).reshape(4, 8)
    out_a, out_b = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    qsl, pos = torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([0, 5, 1])
    kernels.compute_slot_mapping(qsl, pos, bt, out_a, block_size=4, max_num_tokens=6)
    (first,) = kernels._MAPPERS.values()
    assert callable(first)
    kernels.compute_slot_mapping(qsl, pos, bt, out_a, block_size=4, max_num_tokens=6)
    assert len(kernels._MAPPERS) == 1 and next(iter(kernels._MAPPERS.values())) is first
    kernels.compute_slot_mapping(qsl, pos, bt, out_b, block_size=4, max_num_tokens=6)
    assert out_a.tolist() == out_b.tolist() == [0, 5, 33, -1, -1, -1, 0, 0]
    assert len(kernels._MAPPERS) == 2
    out_c = torch.full((8,), 5, dtype=torch.int64)
    empty = torch.zeros(0, dtype=torch.int64)
    kernels.compute_slot_mapping(torch.zeros(1, dtype=torch.int32), empty, bt, out_c, block_size=4, max_num_tokens=6)
    assert out_c.tolist() == [-1] * 6 + [5, 5]
    monkeypatch.setattr(kernels, "_MAPPERS", {i: None for i in range(64)})
    kernels.compute_slot_mapping(qsl, pos, bt, out_a, block_size=4, max_num_tokens=6)
    assert len(kernels._MAPPERS) == 1
    with pytest.raises(ValueError, match="query_start_loc"):
        kernels.compute_slot_mapping([0, 2, 3], pos, bt, out_a, block_size=4, max_num_tokens=6)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.compute_slot_mapping(qsl, pos, bt, [0] * 8, block_size=4, max_num_tokens=6)


# -- zb_patch.kernels._launch: the CUDA-only launch plumbing, with stand-ins for the device and driver -------------
def test_hook_set():
    from zb_patch.kernels._launch import _hook_set

    class Chain:  # Triton >= 3.6 keeps an always-present HookChain
        def __init__(self, calls):
            self.calls = calls

    assert not _hook_set(None) and _hook_set(lambda *a: None)
    assert not _hook_set(Chain([])) and _hook_set(Chain([print]))


def test_triton_version(monkeypatch):
    triton = pytest.importorskip("triton")
    from zb_patch.kernels import _launch

    for text, want in (("3.4.0", (3, 4)), ("3.2.0+git5f1e", (3, 2)), ("12.10", (12, 10)), ("nightly", (0, 0))):
        monkeypatch.setattr(triton, "__version__", text)
        assert _launch._triton_version() == want


def test_direct_launch_is_cuda_triton_3_3_or_later_only(monkeypatch):
    pytest.importorskip("triton")
    from zb_patch.kernels import _launch

    try:
        from triton import knobs  # noqa: F401

        knobs_present = True
    except ImportError:
        knobs_present = False
    monkeypatch.setattr(_launch, "_interpret", False)
    monkeypatch.delenv("ZB_PATCH_KERNELS_NO_DIRECT_LAUNCH", raising=False)
    for version, want in (((3, 2), False), ((3, 3), knobs_present), ((4, 0), knobs_present)):
        monkeypatch.setattr(_launch, "_triton_version", lambda v=version: v)
        assert _launch._direct_launch_supported("cuda") is want
    assert not _launch._direct_launch_supported("npu") and not _launch._direct_launch_supported("cpu")
    monkeypatch.setenv("ZB_PATCH_KERNELS_NO_DIRECT_LAUNCH", "1")
    assert not _launch._direct_launch_supported("cuda")
    for off in ("0", ""):
        monkeypatch.setenv("ZB_PATCH_KERNELS_NO_DIRECT_LAUNCH", off)
        assert _launch._direct_launch_supported("cuda") is knobs_present
    # a Triton >= 3.3 without triton.knobs (where 3.4+ keep the launch hooks): no direct launch
    import triton

    monkeypatch.setattr(_launch, "_triton_version", lambda: (3, 3))
    monkeypatch.delattr(triton, "knobs", raising=False)
    monkeypatch.setitem(sys.modules, "triton.knobs", None)  # makes `from triton import knobs` raise ImportError
    assert not _launch._direct_launch_supported("cuda")
    monkeypatch.setattr(_launch, "_interpret", True)
    assert not _launch._direct_launch_supported("cuda")


@pytest.mark.parametrize("value,want", [(None, False), ("", False), ("0", False), ("1", True), ("yes", True)])
def test_interpret_mode_reads_triton_interpret_once(monkeypatch, value, want):
    """TRITON_INTERPRET unset, empty or "0": compiled kernels; any other value: the interpreter. Read at the first
    call of the process (as Triton reads it when a kernel module is imported), not again."""
    from zb_patch.kernels import _launch

    monkeypatch.setattr(_launch, "_interpret", None)  # this process's answer: restored after the test
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert _launch.interpret_mode() is want
    monkeypatch.setenv("TRITON_INTERPRET", "0" if want else "1")
    assert _launch.interpret_mode() is want


def _set_active(monkeypatch, driver, value):
    """Stand in for Triton's active driver (DriverConfig keeps it in _active; reading .active would create one)."""
    if "_active" not in vars(driver):
        pytest.skip("this Triton keeps its active driver elsewhere")
    monkeypatch.setattr(driver, "_active", value)


def test_multiprocessor_count(monkeypatch):
    pytest.importorskip("triton")
    from triton.runtime import driver

    from zb_patch.kernels import _launch

    seen = []

    class CudaProps:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: seen.append(index) or CudaProps())
    assert _launch.multiprocessor_count("cuda", None) == 132 and _launch.multiprocessor_count("cuda", 1) == 132
    assert seen == [3, 1]

    class Active:  # Triton's active driver (triton-ascend's reports the NPU's vector cores)
        def __init__(self, props):
            self.utils = self
            self.props = props

        def get_device_properties(self, index):
            seen.append(index)
            if self.props is None:
                raise RuntimeError("no device")
            return self.props

    cases = [({"num_vectorcore": 48, "num_aicore": 24}, 48), ({"num_vectorcore": 0, "num_aicore": 24}, 24)]
    cases += [({"num_vectorcore": 1}, 1), ({"multiprocessor_count": 7}, 7), ({}, 40)]
    for props, want in cases:
        _set_active(monkeypatch, driver, Active(props))
        assert _launch.multiprocessor_count("npu", 2) == want
    seen.clear()
    _launch.multiprocessor_count("npu", None)
    assert seen == [0]
    _set_active(monkeypatch, driver, Active(None))  # a driver that cannot tell: the safe default
    assert _launch.multiprocessor_count("npu", 0) == 40


def test_direct_launcher_calls_the_compiled_launcher(monkeypatch):
    pytest.importorskip("triton")
    try:
        from triton import knobs
    except ImportError:
        pytest.skip("Triton < 3.4 has no knobs (no direct launch)")
    from triton.runtime import driver

    from zb_patch.kernels import _launch

    calls = []

    class Compiled:  # what Triton's launch returns on CUDA
        packed_metadata, function = "metadata", "function"

        def __init__(self, fail=False):
            self.fail = fail

        @property
        def run(self):
            def run(*args):
                if self.fail:
                    raise TypeError("another calling convention")
                calls.append(args)

            return run

    class Active:
        def get_current_stream(self, device):
            return f"stream-{device}"

        def get_current_device(self):
            return 5

    class Kernel:
        arg_names = ["x", "n", "B", "A"]

    _set_active(monkeypatch, driver, Active())
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None)
    launcher = _launch.FastLauncher(Kernel(), {"A": 1, "B": 2}, device_type="cuda", tensor_slots=(0,))
    launcher.direct_supported = True
    call = launcher.direct_launcher(Compiled())
    assert call(7, 100, 3) is True and launcher.direct_launches == 1
    assert calls == [(7, 1, 1, "stream-5", "function", "metadata", None, None, None, 100, 3, 2, 1)]
    assert launcher.direct_launcher(Compiled(), 2)(1) and calls[-1][3] == "stream-2"
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)  # a profiler's hook: normal path
    assert call(7, 100, 3) is False and len(calls) == 2
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", lambda *a: None)
    assert call(7, 100, 3) is False and len(calls) == 2
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None)
    assert launcher.direct_launcher(Compiled(fail=True))(1) is False and launcher.direct_supported is False
    assert launcher.direct_launches == 2 and launcher.direct_launcher(Compiled()) is None  # switched off now
    launcher.direct_supported = True
    assert launcher.direct_launcher(None) is None and launcher.direct_launcher(object()) is None


def test_next_power_of_2_against_a_naive_loop():
    from zb_patch.kernels._launch import next_power_of_2

    def naive(n):
        p = 1
        while p < n:
            p *= 2
        return p

    assert [next_power_of_2(n) for n in range(-2, 70)] == [naive(n) for n in range(-2, 70)]
