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
