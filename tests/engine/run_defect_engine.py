"""Test launcher of one engine configuration for tests/engine/test_defect_*.py: tests/engine/run_engine.py's
(NPU emulation, worker double, the product's engine child) plus recorders that watch the release's defects where
they happen, installed once ``LLM(...)`` is built (zb-patch's patches are in place by then) and reported in the
result's ``defects`` entry (live objects, filled while generating):

* ``kv-owners`` (vllm-ascend 0.13 MTP, k >= 2): every KV write of a later MTP draft step (steps 1 .. k-1 of
  ``MtpProposer._propose``) is checked against the block tables of the step's scheduled requests: a slot in a block
  of another scheduled request is a *foreign write* (recorded: writer, slot, block, owner); a slot past the cache is
  recorded before the emulated op raises. Each such slot is also compared with the one its position has in the
  writer's own blocks (position from the draft model's call, blocks from the request's block list, block size from the
  cache): ``wrong_slots``, with ``slots_checked`` / ``block_starts_checked`` (positions at a block's first slot, where
  ``+= 1`` goes wrong) and ``padded`` (rows the release masked past max_model_len).
* ``draft-lengths`` (vllm-ascend 0.18 EAGLE / MTP): after every ``attn_update_stack_num_spec_norm`` (draft steps
  1 .. k-1), the draft rows whose device and host sequence lengths differ, and (``wrong_values``) those whose lengths
  are not vllm-ascend #10112's, computed from the pass's first-step lengths alone: one more per step, 1 once past
  max_model_len (``at_limit`` / ``masked``: rows expected at max_model_len / at 1).
* ``saved-drafts`` (any release): the counters of zb-patch's stale-draft-placeholders fix on the runner.
* ``returning-rows`` (any release): every row handed to the model with scheduled drafts while it was not in the
  previous step's sampled rows, with the draft input ids it got and the drafts proposed for that request when it was
  last sampled (``sample_tokens``: the proposal's row of each sampled request).
* ``sample-indices`` (EAGLE, any release): at every draft-model call of the drafter (``_runnable``: the merged draft,
  what a FULL draft graph replays), the rows of its persistent sample-index buffer past the call's real requests, up
  to ``max_num_seqs``: those a graph captured for a padded batch reads. Recorded: calls, calls with such rows that an
  earlier, wider call wrote, rows holding an index other than 0, and those holding an index past every padded decode
  batch's tokens (``>= max_num_seqs * (1 + k)``).

    python tests/engine/run_defect_engine.py --record kv-owners,draft-lengths --models DIR --out result.json ...
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "support"))
sys.path.insert(0, HERE)

import run_engine  # noqa: E402  (the device report and the conventions of the tests' launcher)

RECORDERS = ("kv-owners", "draft-lengths", "saved-drafts", "returning-rows", "sample-indices")


def _runner(llm):
    """The engine's one model runner (uni executor, EngineCore in this process: the child checks both)."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def record_kv_owners(runner, out: dict) -> None:
    import torch_npu
    from vllm_ascend.spec_decode.mtp_proposer import MtpProposer

    out.update(draft_writes=0, foreign_writes=[], past_cache=[], propose_calls=0)
    out.update(slots_checked=0, block_starts_checked=0, padded=0, wrong_slots=[])
    step = {"inside": False, "calls": 0, "positions": []}
    model = runner.drafter.model

    def count_call(module, args, kwargs):
        step["calls"] += 1
        positions = kwargs["positions"] if "positions" in kwargs else args[1]
        step["positions"] = positions[: runner.input_batch.num_reqs].tolist()

    model.register_forward_pre_hook(count_call, with_kwargs=True)
    propose = MtpProposer.__dict__["_propose"]  # zb-patch's wrapper when its fix is applied

    def _propose(self, *args, **kwargs):
        step.update(inside=True, calls=0)
        out["propose_calls"] += 1
        try:
            return propose(self, *args, **kwargs)
        finally:
            step["inside"] = False

    MtpProposer._propose = _propose
    write = torch_npu._npu_reshape_and_cache

    def _npu_reshape_and_cache(**kwargs):
        if step["inside"] and step["calls"] >= 2:  # a later draft step: one token per row of the batch
            batch = runner.input_batch
            block_size = kwargs["key_cache"].shape[1]
            num_slots = kwargs["key_cache"].shape[0] * block_size
            out["block_size"] = block_size
            owner = {}
            for req_id in batch.req_id_to_index:
                for block in runner.requests[req_id].block_ids[0]:
                    owner[int(block)] = req_id
            slots = kwargs["slot_indices"][: batch.num_reqs].tolist()
            for row, slot in enumerate(slots):
                if slot < 0:
                    out["padded"] += 1
                    continue
                writer = batch.req_ids[row]
                out["draft_writes"] += 1
                # the slot the draft token's position has in the writer's own blocks, enumerated from the scheduler's
                # block list and the cache's block size (not the runner's block table nor the release's arithmetic)
                position = step["positions"][row]
                own_slots = [
                    b * block_size + o for b in runner.requests[writer].block_ids[0] for o in range(block_size)
                ]
                expected = own_slots[position] if position < len(own_slots) else None
                out["slots_checked"] += 1
                out["block_starts_checked"] += position % block_size == 0
                if slot != expected:
                    out["wrong_slots"].append(
                        dict(
                            writer=writer, draft_step=step["calls"] - 1, position=position, slot=slot, expected=expected
                        )
                    )
                if slot >= num_slots:
                    out["past_cache"].append(dict(writer=writer, slot=slot, num_slots=num_slots))
                    continue
                block = slot // block_size
                if owner.get(block, writer) != writer:
                    out["foreign_writes"].append(
                        dict(
                            writer=writer,
                            draft_step=step["calls"] - 1,
                            slot=slot,
                            block=block,
                            offset=slot % block_size,
                            owner=owner[block],
                            writer_blocks=list(runner.requests[writer].block_ids[0]),
                        )
                    )
        return write(**kwargs)

    torch_npu._npu_reshape_and_cache = _npu_reshape_and_cache


def record_draft_lengths(runner, out: dict) -> None:
    from vllm_ascend.spec_decode.eagle_proposer import SpecDecodeBaseProposer

    out.update(draft_steps=0, mismatches=[], max_model_len=runner.model_config.max_model_len)
    out.update(wrong_values=[], at_limit=0, masked=0)
    update = SpecDecodeBaseProposer.__dict__["attn_update_stack_num_spec_norm"]

    limit = out["max_model_len"]
    expected: list[int] = []  # this draft pass's lengths by #10112's rule, from its first step's alone

    def attn_update_stack_num_spec_norm(self, draft_step, *args, **kwargs):
        rows = args[2] if len(args) > 2 else kwargs["batch_size"]
        if draft_step == 1:
            old = args[1] if len(args) > 1 else kwargs["old_common_metadata"]
            expected[:] = old.seq_lens_cpu[:rows].tolist()
        common, attn = update(self, draft_step, *args, **kwargs)
        device = common.seq_lens[:rows].tolist()
        host = common.seq_lens_cpu[:rows].tolist()
        out["draft_steps"] += 1
        # one more token per step; a length past max_model_len (not one equal to it) becomes 1
        expected[:] = [1 if n + 1 > limit else n + 1 for n in expected]
        for row, (d, h, want) in enumerate(zip(device, host, expected)):
            position = int(common.positions[row])
            if d != h:
                out["mismatches"].append(dict(draft_step=draft_step, row=row, device=d, host=h, position=position))
            if (d, h) != (want, want):
                out["wrong_values"].append(
                    dict(draft_step=draft_step, row=row, device=d, host=h, expected=want, position=position)
                )
            out["at_limit"] += want == limit
            out["masked"] += want == 1
        return common, attn

    SpecDecodeBaseProposer.attn_update_stack_num_spec_norm = attn_update_stack_num_spec_norm


def record_saved_drafts(runner, out: dict) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    prepare = GPUModelRunner.__dict__["_prepare_input_ids"]

    def _prepare_input_ids(self, *args, **kwargs):
        result = prepare(self, *args, **kwargs)
        st = self.__dict__.get("_zb_patch_saved_drafts")
        if st is not None:
            out.update(saved=st.saved, filled=st.filled, filled_tokens=st.filled_tokens, unknown=st.unknown)
        return result

    GPUModelRunner._prepare_input_ids = _prepare_input_ids


def record_returning_rows(runner, out: dict) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

    out.update(rows=[])
    proposed: dict = {}
    prepare = GPUModelRunner.__dict__["_prepare_input_ids"]  # zb-patch's wrapper when its fix is applied
    sample = NPUModelRunner.__dict__["sample_tokens"]

    def _prepare_input_ids(self, scheduler_output, *args, **kwargs):
        prev = dict(self.input_batch.prev_req_id_to_index or {})
        result = prepare(self, scheduler_output, *args, **kwargs)
        cu_num_tokens = args[-1]
        spec = scheduler_output.scheduled_spec_decode_tokens
        for req_id, row in self.input_batch.req_id_to_index.items():
            d = len(spec.get(req_id, ()))
            if d and req_id not in prev and self.input_batch.prev_sampled_token_ids is not None:
                end = int(cu_num_tokens[row])
                out["rows"].append(
                    dict(
                        req=req_id,
                        scheduled=list(spec[req_id]),
                        ids=self.input_ids.gpu[end - d : end].tolist(),
                        proposed=proposed.get(req_id, [None] * d)[:d],
                    )
                )
        return result

    def sample_tokens(self, *args, **kwargs):
        output = sample(self, *args, **kwargs)
        drafts = self._draft_token_ids
        if drafts is not None and not isinstance(drafts, list):
            for req_id, row in (self.input_batch.prev_req_id_to_index or {}).items():
                proposed[req_id] = [int(x) for x in drafts[row].tolist()]
        return output

    GPUModelRunner._prepare_input_ids = _prepare_input_ids
    NPUModelRunner.sample_tokens = sample_tokens


def record_sample_indices(runner, out: dict) -> None:
    drafter = runner.drafter
    # the buffer and its keyword: vllm-ascend 0.13's EagleProposer names both last_token_indices
    name = "token_indices_to_sample" if hasattr(drafter, "token_indices_to_sample") else "last_token_indices"
    buffer = getattr(drafter, name)
    max_num_seqs = runner.scheduler_config.max_num_seqs
    past_every_batch = max_num_seqs * (1 + drafter.num_speculative_tokens)
    out.update(calls=0, after_wider=0, stale_rows=0, past_every_batch=0, largest=0, bound=past_every_batch)
    widest = [0]  # the most rows a call has written so far
    run = drafter._runnable  # the bound merged-draft method (eager)

    def _runnable(*args, **kwargs):
        real = kwargs[name].shape[0]
        rows = buffer[real:max_num_seqs].tolist()
        out["calls"] += 1
        out["after_wider"] += real < min(widest[0], max_num_seqs)  # rows past the batch that an earlier call wrote
        widest[0] = max(widest[0], real)
        out["stale_rows"] += sum(1 for i in rows if i != 0)
        out["past_every_batch"] += sum(1 for i in rows if i >= past_every_batch)
        out["largest"] = max([out["largest"], *rows])
        return run(*args, **kwargs)

    drafter._runnable = _runnable


RECORD = {
    "kv-owners": record_kv_owners,
    "draft-lengths": record_draft_lengths,
    "saved-drafts": record_saved_drafts,
    "returning-rows": record_returning_rows,
    "sample-indices": record_sample_indices,
}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--record", default="", help=f"comma-separated recorders: {', '.join(RECORDERS)}")
    args, rest = ap.parse_known_args(argv)
    wanted = [r for r in args.record.split(",") if r]
    for name in wanted:
        if name not in RECORDERS:
            ap.error(f"unknown recorder {name!r} (known: {', '.join(RECORDERS)})")

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import npu_engine

    npu_engine.install()
    from zb_patch.check.engine import child

    def after_build() -> dict:
        # child.main calls this right after it built ``llm`` (its local): the one handle on the engine's runner
        runner = _runner(sys._getframe(1).f_locals["llm"])
        defects: dict = {}
        for name in wanted:
            defects[name] = {}
            RECORD[name](runner, defects[name])
        return {"defects": defects}

    return child.main(
        rest,
        llm_overrides={"worker_cls": npu_engine.WORKER_CLS},
        after_build=after_build,
        device=lambda: run_engine.EMULATED_DEVICE,
    )


if __name__ == "__main__":
    import engine_zygote

    engine_zygote.delegate(__file__)  # forked from the tests' pre-imported interpreter when one serves
    sys.exit(main(sys.argv[1:]))
