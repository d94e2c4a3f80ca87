"""Rows back in the batch with scheduled drafts, recorded on the release's real runner (the runner-parity harness,
tests/parity/runner_harness.py): what the tests of ``stale-draft-placeholders`` and ``readded-request-drafts`` read.
A test module imports this after it has skipped releases without the harness (vllm-ascend 0.13 / 0.18 only)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parity"))

# k = 4, seed 4: requests at max_model_len skip a step with placeholders (both releases), and preempted requests
# resume with stale placeholders (0.13); found by running the workload, ~40 s per run on 2 cores
K, SEED, ITERATIONS = 4, 4, 1100


class Recorder:
    """Per step: the drafts proposed for each request sampled in that step (what the scheduler's placeholders stand
    for), and every row handed to the model with scheduled drafts while not in the previous step's batch."""

    def __init__(self, release):
        self.proposed: dict[str, list[int]] = {}  # req_id -> drafts proposed when it was last sampled
        self.returns: list[dict] = []  # rows back with scheduled drafts
        self.release = release

    def install(self, monkeypatch):
        driver_cls = self.release.Driver
        prepare_step, sample_tokens = driver_cls.prepare_step, driver_cls.sample_tokens
        rec = self

        def prepare(driver, runner, so):
            in_batch = set(runner.input_batch.req_id_to_index)  # the persistent batch before this step's update
            inputs = prepare_step(driver, runner, so)
            if inputs is None:
                return inputs
            prev = runner.input_batch.prev_req_id_to_index or {}
            spec = so.scheduled_spec_decode_tokens
            for r, rid in enumerate(runner.input_batch.req_ids):
                d = len(spec.get(rid, ()))
                if d and rid not in prev:
                    end = int(inputs.query_start_loc[r + 1])
                    rec.returns.append(
                        dict(
                            step=driver.step,
                            req=rid,
                            scheduled=list(spec[rid]),
                            ids=inputs.input_ids[end - d : end].tolist(),
                            expected=rec.proposed.get(rid, [None] * d)[:d],
                            readded=rid not in in_batch,  # else the row stayed and the release wrote its drafts
                        )
                    )
            return inputs

        def sample(driver, so):
            out = sample_tokens(driver, so)
            runner = driver.runner
            drafts = runner._draft_token_ids
            for rid, row in (runner.input_batch.prev_req_id_to_index or {}).items():  # sampled rows only
                rec.proposed[rid] = [int(x) for x in drafts[row].tolist()]
            return out

        monkeypatch.setattr(driver_cls, "prepare_step", prepare)
        monkeypatch.setattr(driver_cls, "sample_tokens", sample)


def run(H, release, sess, monkeypatch, *, patched, disabled=(), seed=SEED):
    from zb_patch.check.selftest.compat import EngineShape
    from zb_patch.check.selftest.workload import make_workload

    rec = Recorder(release)
    rec.install(monkeypatch)
    shape = EngineShape(num_spec_tokens=K)
    specs = make_workload(seed, shape, ITERATIONS)
    with H.reference_kernels():
        res = H.run_mode(sess, shape, specs, ITERATIONS, release=release, seed=seed, patched=patched, disabled=disabled)
    monkeypatch.undo()
    return res, rec


def zero_bubble_ids(H, release):
    return H.zero_bubble_and_fix_ids(release.ADAPTER)[0]
