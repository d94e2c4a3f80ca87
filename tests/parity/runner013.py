"""Runner-level parity harness for adapter ascend-0.13: vLLM 0.13's real ``AsyncScheduler`` drives vllm-ascend
0.13.0's real ``NPUModelRunner`` on CPU tensors (NPU runtime stand-in), unpatched vs patched.

The 0.18 harness (:mod:`runner018`) is the template; this module reuses its release-independent parts (process
session, adversarial :class:`runner018.LazyCountEvent`, engine loop, comparison) and differs where vllm-ascend 0.13
differs:

* ``NPUModelRunner._prepare_inputs(scheduler_output, intermediate_tensors)`` is **monolithic** and runs here for
  real, end to end: positions, slot mapping, seq_lens, input ids (host gather + the device scatter of last step's
  sampled and draft tokens), discard indices, DP sync (a world of one), ACL-graph dispatch, spec-decode metadata
  **and the per-KV-group attention-metadata loop** that builds ``AscendCommonAttentionMetadata``. Only the
  attention *builder* is replaced (:class:`RecordingBuilder`): it records the common metadata the release hands
  it at ``builder.build`` time -- the CPU ``seq_lens_cpu`` (what Ascend FIA / paged attention reads),
  ``num_computed_tokens_cpu``, the slot mapping, the block table -- and the fake model reads those.
* vLLM 0.13's ``_update_states`` (real) holds the classic blocking sync; ``prev_num_draft_len`` is set inside it.
* The mirrored ``execute_model`` / ``sample_tokens`` follow vllm-ascend 0.13.0 (L1485-1653 / L1656-1795): no
  ``synchronize_input_prep`` and no scheduler-output copy in the release; the padded drafter's
  ``prepare_next_token_ids_padded(common_attn_metadata, ...)`` reads the backup index from the metadata's
  ``seq_lens_cpu``.

Wait phases: ``update_states`` (before input preparation: the classic sync), ``prepare_inputs:release`` (inside
``_prepare_inputs`` before its device input preparation is queued), ``prepare_inputs:after`` (inside
``_prepare_inputs``, from ``_init_model_kwargs`` on: positions / seq_lens / slot mapping / input ids are queued, the
attention metadata is not built yet), ``forward``, ``sample``.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Iterator

import numpy as np

import runner018 as base
from runner018 import RowRecord, Session, StepState, compare, reference_kernels, session  # noqa: F401
from zb_patch.check.selftest import compat, fakemodel
from zb_patch.check.selftest.compat import EngineShape
from zb_patch.check.selftest.workload import RequestSpec, make_workload

STATE_ATTR = "_zb_patch_013"
LAYER = "model.layers.0.self_attn.attn"


def build_config(sess: Session, shape: EngineShape, *, async_scheduling: bool = True, method: str = "eagle",
                 **spec_extra: Any) -> Any:
    vc = base.build_config(sess, shape, async_scheduling=async_scheduling, method=method, **spec_extra)
    # vLLM 0.13 leaves the capture sizes unset with enforce_eager (the Ascend platform's config hook, not run
    # here, would fill them); the EAGLE proposer sorts them at construction
    if vc.compilation_config.cudagraph_capture_sizes is None:
        vc.compilation_config.cudagraph_capture_sizes = []
    return vc


kv_cache_config = base.kv_cache_config
make_scheduler = base.make_scheduler


class RecordingBuilder:
    """Stands in for the Ascend attention metadata builder of the one KV-cache group: records what the release
    hands ``builder.build`` (CPU values as the builder reads them at build time)."""

    def __init__(self) -> None:
        self.calls = 0
        self.last: dict | None = None

    def build(self, common_prefix_len: int, common_attn_metadata: Any, **kwargs: Any) -> Any:
        cm = common_attn_metadata
        n = cm.num_reqs
        self.calls += 1
        self.last = dict(num_reqs=n, seq_lens_cpu=[int(x) for x in cm.seq_lens_cpu[:n]],
                         num_computed_cpu=[int(x) for x in cm.num_computed_tokens_cpu[:n]],
                         seq_lens_gpu=[int(x) for x in cm.seq_lens[:n]], metadata=cm)
        return ("zb-runner013-attn", self.calls)


class _AttnGroup:
    def __init__(self, builder: RecordingBuilder) -> None:
        self.builder = builder
        self.layer_names = [LAYER]

    def get_metadata_builder(self, ubatch_id: int = 0) -> RecordingBuilder:
        return self.builder


def make_runner(vllm_config: Any, kvc: Any, *, reorder: bool = True) -> Any:
    runner = base.make_runner(vllm_config, kvc, reorder=reorder)
    runner.attn_groups = [[_AttnGroup(RecordingBuilder())]]
    return runner


UNFILLED = "unfilled-draft"


class Driver(base.Driver):
    """One runner + its fake model; ``execute_model`` / ``sample_tokens`` mirror vllm-ascend 0.13.0.

    UNFILLED_DRAFTS: vLLM 0.13's async scheduler can schedule draft placeholders for a request that was not in the
    previous batch (unscheduled for a step, then scheduled again); the runner has no draft ids for it and the host
    gather reads its token table at the draft positions. That table's content there is junk in both modes, and it
    differs: the optimistic placeholders make vLLM 0.13's ``_update_states`` take its output-trimming branch, which
    moves ``num_tokens_no_spec`` (where the async bookkeeping writes its ``-1`` placeholders) to the true length,
    while the classic path leaves it behind. Those input ids are recorded as ``UNFILLED`` (their count is
    reported); every other input id, and everything the junk feeds into (acceptance, tokens), is compared.
    """

    unfilled_drafts = 0
    negative_input_ids = 0   # token ids < 0 handed to the model (a -1 would index the embedding out of range)

    def execute_model_body(self, runner: Any, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        """Mirror of vllm-ascend 0.13.0 ``NPUModelRunner.execute_model`` (L1485-1653), supported paths."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        so = scheduler_output
        if runner.execute_model_state is not None:  # L1490
            raise RuntimeError("sample_tokens() must be called after execute_model() returns None")
        with self.in_phase("update_states"):
            runner._update_states(so)  # L1495
        if not so.total_num_scheduled_tokens:  # L1505
            return EMPTY_MODEL_RUNNER_OUTPUT
        builder = runner.attn_groups[0][0].builder
        builder.last = None
        with self.in_phase("prepare_inputs:release"):
            (attn_metadata, positions_t, nst_np, num_input_tokens, _, _, logits_indices, spec_meta, input_ids_t,
             _, _, max_query_len, _, _) = runner._prepare_inputs(so, None)  # L1515
        meta = builder.last
        if meta is None:
            raise AssertionError("the release built no attention metadata")
        n = runner.input_batch.num_reqs
        total = so.total_num_scheduled_tokens
        cm = meta["metadata"]
        seq_lens_cpu = meta["seq_lens_cpu"][:n]
        # L1569 forward: the fake model reads what the release handed the model and the attention builder
        qsl = cm.query_start_loc[: n + 1].numpy().copy()
        input_ids = input_ids_t[:total].numpy().copy()
        self.negative_input_ids += int((input_ids < 0).sum())
        positions = positions_t[:total].numpy().copy()
        slots = cm.slot_mapping[:total].numpy().copy()
        block_table = cm.block_table_tensor[:n].numpy()
        with self.in_phase("forward"):
            target, hidden = fakemodel.forward(self.kv, input_ids, positions, slots, qsl, seq_lens_cpu, block_table,
                                               n, self.shape.block_size, self.shape.vocab_size)
        req_ids = list(runner.input_batch.req_ids)
        spec = so.scheduled_spec_decode_tokens
        num_drafts = [len(spec.get(r, ())) for r in req_ids]
        discarded = set(int(i) for i in runner.discard_request_indices.np[: runner.num_discarded_requests])
        max_seq_len = max(seq_lens_cpu) if seq_lens_cpu else 0
        prev_rows = runner.input_batch.prev_req_id_to_index or {}
        rows = {}
        for r, rid in enumerate(req_ids):
            s, e = int(qsl[r]), int(qsl[r + 1])
            ids = input_ids[s:e].tolist()
            if num_drafts[r] and rid not in prev_rows:
                # A row (re-)added this step but scheduled with draft placeholders: the release has no draft ids for
                # it (the device scatter covers rows of the previous batch only) and feeds whatever its host token
                # table holds there -- junk the rejection sampler rejects. Not compared (see UNFILLED_DRAFTS).
                self.unfilled_drafts += num_drafts[r]
                ids[len(ids) - num_drafts[r]:] = [UNFILLED] * num_drafts[r]
            rows[rid] = dict(positions=tuple(positions[s:e].tolist()), slots=tuple(slots[s:e].tolist()),
                             input_ids=tuple(ids), seq_len_cpu=seq_lens_cpu[r],
                             seq_len_gpu=meta["seq_lens_gpu"][r], num_computed_cpu=meta["num_computed_cpu"][r],
                             max_seq_len=max_seq_len, discarded=r in discarded, drafted=num_drafts[r])
        self.state = StepState(so, n, req_ids, qsl, input_ids, num_drafts, seq_lens_cpu, target, hidden, spec_meta,
                               total, rows)
        if spec_meta is not None:
            self.spec_steps += 1
            self.spec_step_ids.add(self.step)
        runner.execute_model_state = ("zb-runner013", so)
        self.phase = "forward"  # the patch's work after this body returns happens after the forward launch
        return None

    def sample_tokens(self, so: Any) -> base.PendingOutput | None:
        """Mirror of vllm-ascend 0.13.0 ``NPUModelRunner.sample_tokens`` (L1656-1795), padded EAGLE / MTP path."""
        import torch
        from vllm.v1.outputs import SamplerOutput

        self.phase = "sample"
        runner, st = self.runner, self.state
        self.state = None
        runner.execute_model_state = None
        n = st.n
        for rid in st.req_ids:
            st.rows[rid]["req_num_computed"] = int(runner.requests[rid].num_computed_tokens)
        sampled, accepted = fakemodel.rejection_sample(st.target, st.input_ids, st.qsl, st.num_drafts, n, self.k)
        if st.spec_meta is None:
            sampled = sampled[:, :1]
        sampler_output = SamplerOutput(sampled_token_ids=torch.tensor(sampled, dtype=torch.int32),
                                       logprobs_tensors=None)
        hidden_t = torch.zeros((st.total, 1))
        (_, _, _, req_ids_copy, req_id_to_index_copy, invalid) = runner._bookkeeping_sync(  # L1728
            st.so, sampler_output, None, hidden_t, st.total, st.spec_meta)
        # L1745 -> propose_draft_token_ids, padded path L1362-1372
        next_ids, valid = runner.drafter.prepare_next_token_ids_padded(
            runner.spec_decode_common_attn_metadata, sampler_output.sampled_token_ids, runner.requests,
            runner.input_batch, runner.discard_request_indices.gpu, runner.num_discarded_requests)
        runner._copy_valid_sampled_token_count(next_ids, valid)
        nxt, valid_np = next_ids.numpy().astype(np.int64), valid.numpy().astype(np.int64)
        drafts = fakemodel.propose(st.hidden, nxt, valid_np, st.qsl, st.num_drafts, st.seq_lens_cpu,
                                   [fakemodel.req_key(r) for r in st.req_ids], n, self.k, self.shape.vocab_size,
                                   self.pattern)
        runner._draft_token_ids = torch.tensor(drafts[:, : self.k], dtype=torch.int64)
        invalid_set = set(int(i) for i in invalid)
        out_tokens = []
        recs = {}
        for r, rid in enumerate(st.req_ids):
            toks = [] if r in invalid_set else [int(t) for t in sampled[r, : int(accepted[r]) + 1]]
            out_tokens.append(toks)
            row = st.rows[rid]
            recs[rid] = RowRecord(sampled=tuple(toks), accepted=int(accepted[r]) if toks else 0,
                                  next_token=int(nxt[r]), **row)
        self.records[self.step] = recs
        self.phase = "other"
        return base.PendingOutput(compat.model_runner_output(req_ids_copy, req_id_to_index_copy, out_tokens))


class Run(base.Run):
    def add(self, specs: list[RequestSpec]) -> None:
        for s in specs:
            self.scheduler.add_request(compat.make_request(
                s.req_id, list(s.prompt), max_tokens=s.max_tokens, stop_token_ids=list(s.stop_token_ids),
                arrival_time=float(s.arrival), block_size=self.shape.block_size))
            self.streams[s.req_id] = []
            self.requests += 1


@contextlib.contextmanager
def phase_spy(driver_ref: list) -> Iterator[None]:
    """A ``functools.wraps`` spy on ``GPUModelRunner._init_model_kwargs`` (below any patch: fingerprints see through
    it). vllm-ascend 0.13's ``_prepare_inputs`` calls it after it has queued the step's positions, seq_lens, slot
    mapping and input ids and before it builds attention metadata: from there on the driver is in phase
    ``prepare_inputs:after``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.__dict__["_init_model_kwargs"]

    @functools.wraps(original)
    def _init_model_kwargs(self, *args: Any, **kwargs: Any) -> Any:
        if driver_ref and driver_ref[0].phase == "prepare_inputs:release":
            driver_ref[0].phase = "prepare_inputs:after"
        return original(self, *args, **kwargs)

    GPUModelRunner._init_model_kwargs = _init_model_kwargs
    try:
        yield
    finally:
        GPUModelRunner._init_model_kwargs = original


def run_mode(sess: Session, shape: EngineShape, specs: list[RequestSpec], iterations: int, *, seed: int,
             patched: bool, adapter: Any = None, reorder: bool = True, method: str = "eagle",
             runner_hook: Any = None) -> base.RunResult:
    from zb_patch import registry as R

    vc = build_config(sess, shape, method=method)
    kvc = kv_cache_config(vc, shape)
    driver_ref: list = []
    t0 = time.time()
    with phase_spy(driver_ref):
        execute_patch = None
        if patched:
            report = adapter.patch_set.apply()
            if report.verdict != R.APPLIED:
                raise RuntimeError(f"adapter did not apply: {report.reason}")
            execute_patch = next(p for p in adapter.patch_set.patches
                                 if p.target.endswith("NPUModelRunner.execute_model"))
        try:
            runner = make_runner(vc, kvc, reorder=reorder)
            if runner_hook is not None:
                runner_hook(runner)
            driver = Driver(runner, shape, seed=seed, execute_patch=execute_patch)
            driver_ref.append(driver)
            runner._zb_driver = driver
            run = Run(make_scheduler(vc, kvc, shape), driver, shape)
            base.drive(run, specs, iterations)
        finally:
            if patched:
                adapter.patch_set.unpatch()
    free = run.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    if free != shape.num_blocks - 1:
        raise AssertionError(f"KV pool not returned: {free}/{shape.num_blocks - 1} free")
    if runner.requests:
        raise AssertionError(f"runner still holds requests: {sorted(runner.requests)[:5]}")
    before = [driver.step_waits[s].get("update_states", 0) for s in driver.spec_step_ids]
    zb_state = runner.__dict__.get(STATE_ATTR)
    zb = {} if zb_state is None else {"active": zb_state.active, "reason": zb_state.reason,
                                      "steps": zb_state.steps, "corrected_steps": zb_state.corrected_steps,
                                      "host_waits": zb_state.host_waits, "fallback_uploads": zb_state.fallback_uploads}
    all_before = [driver.step_waits[s].get("update_states", 0) for s in range(1, run.step + 1)]
    return base.RunResult(
        mode="patched" if patched else "unpatched", steps=run.step, spec_steps=driver.spec_steps,
        requests=run.requests, finished=len(run.finish), aborted=len(run.aborted), preemptions=run.preemptions,
        tokens=sum(len(s) for s in run.streams.values()), drafted=run.drafted, accepted=run.accepted,
        waits=dict(driver.waits), blocking_waits=dict(driver.blocking_waits),
        before_prep_per_spec_step=(sum(before) / len(before)) if before else 0.0,
        min_before_prep_per_spec_step=min(before) if before else 0,
        max_before_prep_per_step=max(all_before) if all_before else 0,
        max_waits_per_step=max((sum(w.values()) for w in driver.step_waits.values()), default=0),
        seconds=round(time.time() - t0, 2), streams=run.streams, finish=run.finish, records=driver.records, zb=zb,
        runner=runner)


def parity(sess: Session, shape: EngineShape, iterations: int, *, seed: int, adapter: Any, reorder: bool = True,
           triton: bool = False, method: str = "eagle", runner_hook: Any = None) -> dict:
    specs = make_workload(seed, shape, iterations)
    ctx = contextlib.nullcontext() if triton else reference_kernels()
    with ctx:
        ref = run_mode(sess, shape, specs, iterations, seed=seed, patched=False, reorder=reorder, method=method)
        got = run_mode(sess, shape, specs, iterations, seed=seed, patched=True, adapter=adapter, reorder=reorder,
                       method=method, runner_hook=runner_hook)
    diffs, examples = compare(ref, got)
    return {"k": shape.num_spec_tokens, "iterations": iterations, "divergences": diffs, "examples": examples,
            "unfilled_drafts": (ref.runner._zb_driver.unfilled_drafts, got.runner._zb_driver.unfilled_drafts),
            "negative_input_ids": (ref.runner._zb_driver.negative_input_ids, got.runner._zb_driver.negative_input_ids),
            "unpatched": ref.summary(), "patched": got.summary(), "runners": (ref.runner, got.runner)}
