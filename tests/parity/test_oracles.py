"""zb_patch.zero_bubble (and the harness's sampler semantics) against the installed upstream code.

Differential tests on random inputs, in the release-family envs (va018 / va023: real vLLM and
vllm-ascend, NPU stand-in from tests/conftest.py).  Each test skips, with the reason, where the
upstream piece does not exist in the installed release (most appeared in vLLM 0.19 / vllm-ascend
0.19.1rc1-0.23).  Not repeated here: the device correction and slot-mapping *kernels* against vLLM /
vllm-ascend (tests/kernels/test_oracle_vllm.py does that element for element); this file checks the
host-side pieces around them and the whole chain.

Upstream pieces used as oracles (called as plain functions on a stand-in ``self`` that has only the
attributes they read):

* vLLM ``GPUModelRunner._compute_prev_positions``                  -> ``compute_prev_positions``
* vllm-ascend ``NPUModelRunner._remap_num_accepted_tokens`` (#13865) -> ``remap_accepted_counts``
* vllm-ascend ``AscendSpecDecodeBaseProposer.prepare_next_token_ids_padded`` (#8461 backup index)
  -> ``backup_next_token_ids`` + the harness's ``fakemodel.next_tokens``
* vLLM ``update_num_computed_tokens_for_batch_change`` (device) + vllm-ascend
  ``correct_optimistic_seq_lens_cpu`` -> ``optimistic_advance`` + ``deferred_cpu_corrections`` +
  ``apply_cpu_corrections`` + ``correct_seq_lens_cpu`` (the host side must land on the device's
  numbers, every row, every batch change)
"""

from __future__ import annotations

import importlib
import inspect
from types import SimpleNamespace

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here", allow_module_level=True)

from zb_patch import zero_bubble as zb  # noqa: E402
from zb_patch.check.selftest import fakemodel  # noqa: E402

CASES = 300


def _import(module: str, attr: str):
    try:
        if module.startswith("vllm_ascend"):
            try:  # the NPU stand-in (tests/support) installs itself and imports in worker order
                from npu_standin.ascend_imports import import_worker_modules
            except ImportError:
                importlib.import_module("vllm_ascend.platform")
            else:
                import_worker_modules()
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - not importable here: no oracle
        pytest.skip(f"{module} is not importable here ({type(exc).__name__}: {exc})"[:300])
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            pytest.skip(f"{module}.{attr} does not exist in this release")
        obj = getattr(obj, part)
    return obj


def _eager(fn):
    return getattr(fn, "_torchdynamo_orig_callable", None) or getattr(fn, "__wrapped__", None) or fn


def _batch_change(rng, max_prev=12, max_new=4):
    """A previous batch (ids p0..), and the current rows: a random subset of it, shuffled, plus new ids."""
    n_prev = int(rng.integers(0, max_prev + 1))
    prev_ids = [f"p{i}" for i in range(n_prev)]
    keep = [i for i in range(n_prev) if rng.random() < 0.7]
    cur = [prev_ids[i] for i in keep] + [f"n{j}" for j in range(int(rng.integers(0, max_new + 1)))]
    rng.shuffle(cur)
    prev_map = {rid: i for i, rid in enumerate(prev_ids)}
    if rng.random() < 0.15:  # discarded rows of the previous step are not in the map
        for rid in list(prev_map)[: int(rng.integers(0, 3))]:
            prev_map.pop(rid)
    return n_prev, prev_ids, prev_map, cur


def test_prev_positions_vs_vllm():
    fn = _import("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._compute_prev_positions")
    rng = np.random.default_rng(0)
    for _ in range(CASES):
        _, _, prev_map, cur = _batch_change(rng)
        if rng.random() < 0.1:
            prev_map = None if rng.random() < 0.5 else {}
        n = len(cur)
        fake = SimpleNamespace(
            input_batch=SimpleNamespace(prev_req_id_to_index=prev_map, req_ids=cur),
            prev_positions=SimpleNamespace(np=np.full(20, 5, dtype=np.int64)),
        )
        fn(fake, n)
        ours = zb.compute_prev_positions(cur, prev_map, n, np.full(20, 5, dtype=np.int64))
        assert ours.tolist() == fake.prev_positions.np[:n].tolist()


def test_remap_accepted_counts_vs_vllm_ascend():
    fn = _import("vllm_ascend.worker.model_runner_v1", "NPUModelRunner._remap_num_accepted_tokens")
    rng = np.random.default_rng(1)
    R = 16
    for _ in range(CASES):
        n_prev, _, prev_map, cur = _batch_change(rng)
        n = len(cur)
        prev_pos = zb.compute_prev_positions(cur, prev_map, n, np.zeros(R, dtype=np.int64))
        snapshot = rng.integers(1, 5, R).astype(np.int32)  # accepted counts in the previous row order
        fake = SimpleNamespace(
            prev_positions=SimpleNamespace(np=prev_pos.copy()),
            num_accepted_tokens=SimpleNamespace(np=snapshot.copy()),
            input_batch=SimpleNamespace(num_accepted_tokens_cpu=np.zeros(R, dtype=np.int32)),
        )
        fn(fake, n)
        ours = zb.remap_accepted_counts(prev_pos, snapshot, n, np.zeros(R, dtype=np.int32))
        assert ours.tolist() == fake.input_batch.num_accepted_tokens_cpu[:n].tolist()


class _Req:
    def __init__(self, prompt, output):
        self.prompt, self.output = prompt, output

    def get_token_id(self, idx):
        if idx < len(self.prompt):
            return self.prompt[idx]
        if idx - len(self.prompt) < len(self.output):
            return self.output[idx - len(self.prompt)]
        return -1


class _Buf:
    def __init__(self, n):
        self.np = np.zeros(n, dtype=np.int64)
        self.cpu = torch.from_numpy(self.np)
        self.gpu = torch.zeros(n, dtype=torch.int64)

    def copy_to_gpu(self, n=None):
        self.gpu[:n].copy_(self.cpu[:n])
        return self.gpu[:n]


def test_backup_and_next_tokens_vs_vllm_ascend():
    cls = _import("vllm_ascend.spec_decode.llm_base_proposer", "AscendSpecDecodeBaseProposer")
    fn = cls.prepare_next_token_ids_padded
    params = list(inspect.signature(fn).parameters)
    if params[1] != "sampled_token_ids":
        pytest.skip(f"this vllm-ascend has the pre-#8461 signature {params} (backup from seq_lens)")
    rng = np.random.default_rng(2)
    vocab, k, R = 97, 3, 12
    for _ in range(CASES):
        n = int(rng.integers(1, R))
        req_ids = [f"r{i}" for i in range(n)]
        reqs, ntns = {}, np.zeros(R, dtype=np.int32)
        table = np.full((R, 64), -1, dtype=np.int32)
        for i, rid in enumerate(req_ids):
            prompt = rng.integers(0, vocab, int(rng.integers(1, 20))).tolist()
            out = rng.integers(0, vocab, int(rng.integers(0, 10))).tolist()
            placeholders = [-1] * int(rng.integers(0, k + 1))  # optimistic placeholders past the committed ones
            reqs[rid] = _Req(prompt, out + placeholders)
            ntns[i] = len(prompt) + len(out)
            toks = prompt + out + placeholders
            table[i, : len(toks)] = toks
        sampled = np.full((n, k + 1), -1, dtype=np.int64)
        for i in range(n):
            a = int(rng.integers(0, k + 1))
            sampled[i, : a + 1] = rng.integers(0, vocab, a + 1)
        discard = rng.random(n) < 0.3
        fake = SimpleNamespace(backup_next_token_ids=_Buf(R))
        batch = SimpleNamespace(num_reqs=n, num_tokens_no_spec=ntns, req_ids=req_ids, vocab_size=vocab)
        idx = torch.from_numpy(np.nonzero(discard)[0].astype(np.int64))
        nxt, valid = fn(fake, torch.from_numpy(sampled.copy()), reqs, batch, idx, int(discard.sum()))
        backup = zb.backup_next_token_ids(table, ntns, n, np.zeros(R, dtype=np.int64))
        assert backup.tolist() == fake.backup_next_token_ids.np[:n].tolist()
        assert -1 not in backup.tolist() or any(ntns[:n] == 0)
        ours_nxt, ours_valid = fakemodel.next_tokens(sampled, discard, backup, vocab, n)
        assert ours_nxt.tolist() == nxt.tolist()
        assert ours_valid.tolist() == valid.tolist()


def test_host_corrections_land_on_the_device_numbers():
    """Random batch changes: vLLM's device correction is the oracle for the deferred CPU correction,
    and vllm-ascend's CPU seq_lens correction for ours."""
    update = _eager(_import("vllm.v1.spec_decode.utils", "update_num_computed_tokens_for_batch_change"))
    ascend_seq = _import("vllm_ascend.spec_decode.utils", "correct_optimistic_seq_lens_cpu")
    rng = np.random.default_rng(3)
    R = 16
    for _ in range(CASES):
        n_prev, prev_ids, prev_map, cur = _batch_change(rng)
        n = len(cur)
        k = int(rng.integers(1, 5))
        exact_prev = rng.integers(0, 300, R).astype(np.int32)  # device counts of the previous step
        drafts = rng.integers(0, k + 1, R).astype(np.int64)  # drafts each previous row verified
        valid = np.array([rng.integers(1, d + 2) for d in drafts], dtype=np.int64)
        valid[n_prev:] = 0
        # the scheduler's (optimistic) count for this step, and the exact one
        optimistic = np.zeros(R, dtype=np.int32)
        queued_rows, queued_prev, queued_d = [], [], []
        for r, rid in enumerate(cur):
            p = prev_map.get(rid, -1)
            if p >= 0 and drafts[p] > 0:
                optimistic[r] = exact_prev[p] + 1 + drafts[p]
                queued_rows.append(r)
                queued_prev.append(p)
                queued_d.append(int(drafts[p]))
            else:
                optimistic[r] = int(rng.integers(0, 300))
        prev_pos = zb.compute_prev_positions(cur, prev_map, n, np.zeros(R, dtype=np.int64))
        prev_drafts = np.zeros(R, dtype=np.int32)
        zb.optimistic_advance(np.array(queued_prev, dtype=np.int64), np.array(queued_d, dtype=np.int64), prev_drafts)

        dev = torch.from_numpy(exact_prev.copy())
        acc = torch.ones(n, dtype=torch.int64)
        update(
            dev,
            acc,
            torch.from_numpy(prev_pos.copy()),
            torch.from_numpy(valid[: max(n_prev, 1)].copy()),
            torch.from_numpy(prev_drafts.copy()),
            torch.from_numpy(optimistic[:n].copy()),
        )

        cpu = optimistic.copy()
        corr = zb.deferred_cpu_corrections(
            np.array(queued_prev, dtype=np.int64), np.array(queued_d), valid, num_prev=n_prev
        )
        zb.apply_cpu_corrections(cpu, np.array(queued_rows, dtype=np.int64), corr)
        assert cpu[:n].tolist() == dev[:n].tolist()

        nst = rng.integers(1, k + 2, R).astype(np.int32)
        ours = np.zeros(R, dtype=np.int32)
        zb.optimistic_seq_lens(optimistic, nst, n, ours)
        theirs = ours.copy()
        zb.correct_seq_lens_cpu(ours, prev_pos, prev_drafts, valid, n, num_prev=n_prev)
        ascend_seq(theirs, prev_pos, prev_drafts, valid, n)
        assert ours[:n].tolist() == theirs[:n].tolist()
        assert ours[:n].tolist() == (dev[:n].numpy() + nst[:n]).tolist()
