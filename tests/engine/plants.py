"""Planted mistakes in zb-patch's paths (test-only switches, issue item 6): ``run_engine.py --plant NAME``
installs one in the engine process after ``LLM(...)`` is built (zb-patch's wrappers are applied by then) and before
any request is generated. Each plant wraps a zb-patch method or a release function at the point where the mistake
would live; zb-patch's own code is not edited. Which plants apply depends on the release's adapter: the zero-bubble
ones on vllm-ascend 0.13 / 0.18 (ascend-0.13 / ascend-0.18), the slot-mapping-kernel one on 0.19-0.25
(ascend-0.19-0.25).

tests/engine/test_engine.py runs the installed release's plants (``EXPECTED[release].plants``) as the async +
ZB_PATCH=1 configuration and asserts what each must do against the unplanted run.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

HITS: collections.Counter = collections.Counter()  # per plant: the calls in which it changed a value


def _zero_bubble():
    """The ZeroBubble instance of the adapter zb-patch applied in this process (ZeroBubble013 / ZeroBubble018)."""
    import importlib

    from zb_patch import plugin

    adapter = plugin.status()["adapter"]  # "ascend-0.13" -> zb_patch.versions.ascend_0_13
    return importlib.import_module("zb_patch.versions." + adapter.replace("-", "_").replace(".", "_")).ZERO_BUBBLE


def applied_zero_bubble():
    """The ZeroBubble instance of zb-patch's applied adapter, or None (zb-patch off, or an adapter without one)."""
    from zb_patch import plugin

    status = plugin.status()
    if status.get("state") != "applied" or not str(status.get("adapter")).startswith(("ascend-0.13", "ascend-0.18")):
        return None
    return _zero_bubble()


def slot_mapping_off_by_one() -> None:
    """The device correction's slot mappings point one slot back: each new token's KV overwrites the previous
    token's (one slot forward runs past the cache's last block: an IndexError, not a wrong token)."""
    zb = _zero_bubble()
    original = zb.device_correction

    def device_correction(runner, st, num_scheduled, total):
        original(runner, st, num_scheduled, total)
        if st.queue:  # a corrected step: zb-patch wrote the slot mappings
            for table in runner.input_batch.block_table.block_tables:
                table.slot_mapping.gpu[:total] -= 1
            HITS["slot-mapping-off-by-one"] += 1

    zb.device_correction = device_correction


def slot_mapping_kernel_off_by_one() -> None:
    """vllm-ascend 0.19-0.25 (adapter ascend-0.19-0.25): zb-patch's slot-mapping kernel, which replaces
    ``BlockTable.compute_slot_mapping``, writes every scheduled token's slot one back (its KV overwrites the previous
    token's; slot 0 becomes the padding id and is not written). Wraps the patched method, so it only changes values
    where zb-patch's kernel wrote them."""
    from vllm_ascend.worker.block_table import BlockTable

    patched = BlockTable.compute_slot_mapping

    def compute_slot_mapping(self, num_reqs, query_start_loc, positions):
        patched(self, num_reqs, query_start_loc, positions)
        if "_zb_slot_mapper" in self.__dict__:  # zb-patch's launcher wrote this table's slots
            self.slot_mapping.gpu[: positions.shape[0]] -= 1
            HITS["slot-mapping-kernel-off-by-one"] += 1

    BlockTable.compute_slot_mapping = compute_slot_mapping


def host_seq_lens_optimistic() -> None:
    """The host correction is skipped: ``seq_lens.cpu`` / ``num_computed_tokens_cpu`` keep the optimistic counts
    (every draft accepted) that Ascend attention and the proposer read."""
    zb = _zero_bubble()

    def exact_host_counts(runner, st):
        if st.queue and st.valid_host is None:
            st.valid_host = runner._get_valid_sampled_token_count()  # still waited for: apply_deferred needs it
            HITS["host-seq-lens-optimistic"] += 1

    zb.exact_host_counts = exact_host_counts


def backup_token_minus_one() -> None:
    """The drafter's backup token (its next input for a request without a valid sampled token, e.g. a partial
    prefill) is -1 -- what ``CachedRequestState.get_token_id`` returns for an index past the known tokens, as an
    optimistic ``seq_len`` would give. In this engine ``prepare_next_token_ids_padded`` is its only caller."""
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    def get_token_id(self, idx):
        HITS["backup-token-minus-one"] += 1
        return -1

    CachedRequestState.get_token_id = get_token_id


def drafter_reads_optimistic_num_computed() -> None:
    """After the forward launch (where zb-patch corrects ``req_state.num_computed_tokens``) the host
    ``num_computed_tokens_cpu`` of the corrected rows is put back to the optimistic value, so the drafter, which
    runs after the forward, reads every draft as accepted."""
    zb = _zero_bubble()
    original = zb.apply_deferred

    def apply_deferred(runner):
        st = zb.active(runner)
        rows = []
        if st is not None and st.queue and st.valid_host is not None:
            index = runner.input_batch.req_id_to_index
            rows = [
                (index[req_id], drafts + 1 - int(st.valid_host[row]))
                for req_id, drafts, row in st.queue
                if req_id in index and row < len(st.valid_host)
            ]
        original(runner)
        for i, rejected in rows:
            runner.input_batch.num_computed_tokens_cpu[i] += rejected
        HITS["drafter-reads-optimistic-num-computed"] += any(rejected for _, rejected in rows)

    zb.apply_deferred = apply_deferred


def stale_padded_seq_lens() -> None:
    """Device ``seq_lens`` rows past ``num_reqs`` keep the previous step's values (FULL-graph padding reads
    ``seq_lens.gpu[:num_reqs_padded]``)."""
    zb = _zero_bubble()
    original = zb.device_correction
    last = []

    def device_correction(runner, st, num_scheduled, total):
        original(runner, st, num_scheduled, total)
        n = runner.input_batch.num_reqs
        if last:
            stale = last[0][n:]
            HITS["stale-padded-seq-lens"] += bool((runner.seq_lens.gpu[n:] != stale).any())
            runner.seq_lens.gpu[n:].copy_(stale)
        last[:] = [runner.seq_lens.gpu.clone()]

    zb.device_correction = device_correction


def zero_bubble_corrects_exact_counts() -> None:
    """Zero-bubble corrects every row the release reads, including rows whose count from the scheduler is already
    exact (the engine core processed the previous step's output before scheduling this one): its own test of
    ``early_output.already_exact`` finds nothing."""
    from zb_patch.versions import npu_runner

    def already_exact(runner, scheduler_output, prev_scheduled):
        HITS["zero-bubble-corrects-exact-counts"] += 1
        return {}

    npu_runner.already_exact = already_exact


OFF_REASON = "planted: switched off at run time"


def zero_bubble_off_at_run_time() -> None:
    """Zero-bubble switches itself off on the runner, as it does for a combination it does not support (one
    WARNING, the release's classic path runs): the runner's state becomes inactive with a reason. Tokens and counts
    then equal classic async's; only the runner's report tells."""
    from zb_patch.versions.npu_runner import State

    zb = _zero_bubble()
    original = zb.state_of

    def state_of(runner):
        st = original(runner)
        if st.active:
            st = runner.__dict__[zb.state_attr] = State(active=False, reason=OFF_REASON)
            zb.logger.warning("zb-patch: zero-bubble NOT active: %s", OFF_REASON)
            HITS["zero-bubble-off-at-run-time"] += 1
        return st

    zb.state_of = state_of


PLANTS: dict[str, Callable[[], None]] = {
    "zero-bubble-corrects-exact-counts": zero_bubble_corrects_exact_counts,
    "zero-bubble-off-at-run-time": zero_bubble_off_at_run_time,
    "slot-mapping-off-by-one": slot_mapping_off_by_one,
    "slot-mapping-kernel-off-by-one": slot_mapping_kernel_off_by_one,
    "host-seq-lens-optimistic": host_seq_lens_optimistic,
    "backup-token-minus-one": backup_token_minus_one,
    "drafter-reads-optimistic-num-computed": drafter_reads_optimistic_num_computed,
    "stale-padded-seq-lens": stale_padded_seq_lens,
}


def install(names: str) -> None:
    """Install the comma-separated plants ``names``."""
    for name in names.split(","):
        PLANTS[name]()
