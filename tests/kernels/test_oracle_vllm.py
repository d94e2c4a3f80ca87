"""Installed vLLM / vllm-ascend as independent oracles for the kernels (release-family envs, e.g. va023).

Skipped, with the reason, where vLLM (0.19+) is not importable (the ``kernels`` envs have no vLLM).
In an env that has vllm-ascend installed, importing vLLM needs either the NPU stand-in the contract
tests install or ``VLLM_PLUGINS=``; running vLLM's Triton kernel under the interpreter needs
``TRITON_INTERPRET=1`` and ``CUDA_VISIBLE_DEVICES=`` (otherwise ``vllm.triton_utils`` reports
``HAS_TRITON=False`` and hands out placeholders) — see feasibility.md section 6.

What is compared:
* vLLM's ``update_num_computed_tokens_for_batch_change`` (its Python body, unwrapped from
  ``torch.compile``, whose CPU inductor build would only add minutes) against
  :func:`zb_patch.kernels.update_token_counts` (the Triton kernel under the interpreter when
  ``TRITON_INTERPRET=1``, else the reference) on batches whose previous positions are in range —
  the domain where upstream is defined;
* vllm-ascend's plain copy of that function and its ``correct_optimistic_seq_lens_cpu``;
* vLLM's generic ``_compute_slot_mapping_kernel`` (run by the interpreter) against our slot mapping
  where the interleave size divides the kernel block size (where the generic kernel is right).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from kernel_env import INTERPRET

from zb_patch import kernels
from zb_patch.kernels.reference import PAD_SLOT_ID


def _import(module: str, attr: str):
    try:
        if module.startswith("vllm_ascend"):
            try:  # the contract tests' NPU stand-in (tests/support), when this env has it
                from npu_standin.ascend_imports import import_worker_modules
            except ImportError:
                importlib.import_module("vllm_ascend.platform")  # the real worker's import order
            else:
                import_worker_modules()  # installs the stand-in, imports in the real worker's order
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure to import means: no oracle here
        pytest.skip(f"{module} is not importable here ({type(exc).__name__}: {exc})"[:300])
    if not hasattr(mod, attr):
        pytest.skip(f"{module}.{attr} does not exist in this release (it appeared in vLLM 0.19)")
    return getattr(mod, attr)


def _eager(fn):
    """The Python function under a ``torch.compile`` wrapper (upstream decorates it)."""
    return getattr(fn, "_torchdynamo_orig_callable", None) or getattr(fn, "__wrapped__", None) or fn


def _random_batch_changes(count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n_prev = int(rng.integers(1, 16))
        n = int(rng.integers(0, 16))
        carried = rng.permutation(n_prev)[: min(n, n_prev)]
        prev = np.full(n, -1, dtype=np.int64)
        prev[: len(carried)] = carried
        prev = rng.permutation(prev)
        drafts = rng.integers(0, 4, 20).astype(np.int32)
        valid = np.array([rng.integers(1, d + 2) for d in drafts[:n_prev]], dtype=np.int64)
        nc = rng.integers(0, 1000, 20).astype(np.int32)
        acc = rng.integers(1, 4, n).astype(np.int32)
        cpu = rng.integers(0, 1000, n).astype(np.int32)
        yield tuple(torch.from_numpy(a.copy()) for a in (nc, acc, prev, valid, drafts, cpu))


@pytest.mark.parametrize("module", ["vllm.v1.spec_decode.utils", "vllm_ascend.spec_decode.utils"])
def test_update_num_computed_tokens_for_batch_change_oracle(module):
    upstream = _eager(_import(module, "update_num_computed_tokens_for_batch_change"))
    for i, (nc, acc, prev, valid, drafts, cpu) in enumerate(_random_batch_changes(40)):
        a_nc, a_acc = nc.clone(), acc.clone()
        upstream(a_nc, a_acc, prev, valid, drafts, cpu)
        b_nc, b_acc = nc.clone(), acc.clone()
        n = prev.numel()
        seq = torch.zeros(20, dtype=torch.int32)
        kernels.update_token_counts(
            b_nc, b_acc, prev, valid, drafts, cpu, torch.ones(n, dtype=torch.int32), seq, num_reqs=n
        )
        assert torch.equal(a_nc, b_nc), (i, a_nc.tolist(), b_nc.tolist())
        assert torch.equal(a_acc, b_acc), (i, a_acc.tolist(), b_acc.tolist())


def test_correct_optimistic_seq_lens_cpu_oracle():
    upstream = _import("vllm_ascend.spec_decode.utils", "correct_optimistic_seq_lens_cpu")
    for i, (_, _, prev, valid, drafts, _) in enumerate(_random_batch_changes(40, seed=1)):
        n = prev.numel()
        valid_buf = np.zeros(20, dtype=np.int64)  # vllm-ascend passes its whole max_num_reqs buffer
        valid_buf[: valid.numel()] = valid.numpy()
        opt = np.random.default_rng(i).integers(50, 500, 20).astype(np.int32)
        a, b = opt.copy(), opt.copy()
        upstream(a, prev.numpy(), drafts.numpy(), valid_buf, n)
        kernels.correct_optimistic_seq_lens_cpu(b, prev.numpy(), drafts.numpy(), valid_buf, n)
        assert a.tolist() == b.tolist(), i


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (4, 16)])
@pytest.mark.parametrize("out_dtype", [torch.int32, torch.int64])
def test_vllm_generic_slot_mapping_kernel_oracle(world, interleave, out_dtype):
    if not INTERPRET:
        pytest.skip("vLLM's Triton kernel runs here only under TRITON_INTERPRET=1")
    triton_utils = _import("vllm.triton_utils", "HAS_TRITON")  # noqa: F841
    if not importlib.import_module("vllm.triton_utils").HAS_TRITON:
        pytest.skip("vllm.triton_utils.HAS_TRITON is False (set CUDA_VISIBLE_DEVICES= with TRITON_INTERPRET=1)")
    upstream = _import("vllm.v1.worker.block_table", "_compute_slot_mapping_kernel")
    g = torch.Generator().manual_seed(world * 7 + interleave)
    lens = [3, 1, 40, 7, 1]
    qsl = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip([0, 9, 20, 200, 63], lens)]).long()
    block_table = torch.randint(0, 5000, (8, 32), dtype=torch.int32, generator=g)
    max_num_tokens = 64
    for rank in range(world):
        theirs = torch.full((max_num_tokens,), -7, dtype=out_dtype)
        upstream[(len(lens) + 1,)](
            positions.numel(),
            max_num_tokens,
            qsl,
            positions,
            block_table,
            block_table.stride(0),
            16,
            theirs,
            TOTAL_CP_WORLD_SIZE=world,
            TOTAL_CP_RANK=rank,
            CP_KV_CACHE_INTERLEAVE_SIZE=interleave,
            PAD_ID=PAD_SLOT_ID,
            BLOCK_SIZE=1024,
        )
        ours = torch.full((max_num_tokens,), -7, dtype=out_dtype)
        kernels.compute_slot_mapping(
            qsl,
            positions,
            block_table,
            ours,
            block_size=16,
            max_num_tokens=max_num_tokens,
            dcp_world_size=world,
            dcp_rank=rank,
            cp_kv_cache_interleave_size=interleave,
        )
        assert torch.equal(theirs, ours), (rank, (theirs != ours).nonzero().flatten().tolist()[:8])
