"""``readded-request-drafts`` (vLLM #31944's runner half, vLLM 0.13) on the release's real vLLM AsyncScheduler +
vllm-ascend NPUModelRunner (the runner-parity harness), with the workload of ``stale-draft-placeholders``'s test."""

from __future__ import annotations

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
HARNESS = {"0.13": "runner013", "0.18": "runner018"}
FAMILY = npu_standin.detect_family()
if FAMILY not in HARNESS:
    pytest.skip(
        f"the runner harness covers vllm-ascend {' / '.join(HARNESS)}; this env has {FAMILY}", allow_module_level=True
    )

from returning_rows import run, zero_bubble_ids  # noqa: E402


def test_readded_rows_get_their_scheduled_drafts_on_013(H, release, sess, monkeypatch):
    """vLLM 0.13 (patch ``readded-request-drafts``, vLLM #31944's runner half): a row re-added with scheduled drafts
    (a request skipped for a step, or preempted and resumed with the stale spec tokens vLLM 0.13's scheduler keeps)
    never gets them written: its draft input ids are what the row's slot held before (another request's tokens, or
    a ``-1``). With only that fix (zero-bubble and stale-draft-placeholders left out) they are the scheduled ids:
    under async scheduling the ``-1`` placeholders (which stale-draft-placeholders replaces), under synchronous
    scheduling the request's real drafts."""
    if FAMILY != "0.13":
        pytest.skip("vLLM 0.18 writes a re-added row's drafts itself (InputBatch.update_req_spec_token_ids, #31944)")
    bare, rec = run(H, release, sess, monkeypatch, patched=False)
    assert any(r["ids"] != r["scheduled"] for r in rec.returns), rec.returns  # junk from the slot's previous owner
    # draft-placeholders-after-metadata left out too: it clamps the forward's ids after the drafts are gathered
    disabled = (
        zero_bubble_ids(H, release)[0],
        "stale-draft-placeholders",
        "mtp-draft-slots",
        "draft-placeholders-after-metadata",
    )
    res, rec = run(H, release, sess, monkeypatch, patched=True, disabled=disabled)
    assert rec.returns and all(r["ids"] == r["scheduled"] for r in rec.returns), rec.returns
    readded = sum(r["readded"] for r in rec.returns)
    assert readded > 0 and res.runner.__dict__.get("_zb_patch_readded_drafts", 0) == readded, rec.returns


def _batch_of(requests):
    """The release's NPUInputBatch holding ``requests`` ({req_id: prompt}), as the runner adds them (no drafts)."""
    import runner_harness
    import torch
    from vllm import SamplingParams
    from vllm_ascend.worker.npu_input_batch import NPUInputBatch

    batch = NPUInputBatch(
        max_num_reqs=8,
        max_model_len=64,
        max_num_batched_tokens=64,
        device=torch.device("cpu"),
        pin_memory=False,
        vocab_size=100,
        block_sizes=[16],
        kernel_block_sizes=[[16]],
        is_spec_decode=True,
        num_speculative_tokens=2,
    )
    for rid, prompt in requests.items():
        batch.add_request(runner_harness.request_state(rid, prompt, 0, SamplingParams(temperature=0.0)))
    return batch


@pytest.mark.skipif(FAMILY != "0.13", reason="a fix of vllm-ascend 0.13 (its NPUInputBatch: 0.18's differs)")
def test_write_readded_drafts_fills_every_readded_row_only(cpu_worker):
    """Rows with empty spec_token_ids and scheduled drafts get them after their tokens (token_ids_cpu, num_tokens,
    spec_token_ids); a row that stayed (drafts written by the release), a request with no drafts and one not in the
    batch are skipped, whatever their order; the runner's counter adds up the rows over calls."""
    import types

    from zb_patch.versions.fixes import readded_request_drafts as fix

    batch = _batch_of({"stayed": [1, 2, 3], "a": [4, 5], "none": [6], "b": [7, 8, 9, 10], "c": [11]})
    stayed = batch.req_id_to_index["stayed"]
    batch.spec_token_ids[stayed].extend([20, 21])  # the release's path of a row that stayed in the batch
    runner = types.SimpleNamespace(input_batch=batch)  # all the fix reads of the runner: its input batch

    def scheduled(drafts):
        from vllm.v1.core.sched.output import SchedulerOutput

        so = SchedulerOutput.make_empty()
        so.scheduled_spec_decode_tokens = drafts
        return so

    drafts = {"stayed": [20, 21], "gone": [30], "a": [40, 41], "none": [], "b": [50]}
    fix.write_readded_drafts(runner, scheduled(drafts))
    fix.write_readded_drafts(runner, scheduled({"c": [60, 61]}))

    def row(rid):
        i = batch.req_id_to_index[rid]
        return batch.token_ids_cpu[i, : batch.num_tokens[i]].tolist(), batch.spec_token_ids[i]

    assert row("a") == ([4, 5, 40, 41], [40, 41])
    assert row("b") == ([7, 8, 9, 10, 50], [50])
    assert row("c") == ([11, 60, 61], [60, 61])
    assert row("stayed") == ([1, 2, 3], [20, 21])  # left to the release
    assert row("none") == ([6], [])
    assert runner.__dict__[fix.READDED_ATTR] == 3
