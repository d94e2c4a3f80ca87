"""Dispatch: Triton for device tensors (and CPU tensors under TRITON_INTERPRET=1), reference otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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
