"""PD decode + speculative decoding, a request's first step (vllm-ascend #10045 / #10305), through the release's real
scheduler and runner: vllm-ascend's ``AsyncRecomputeScheduler`` on a kv-consumer (what the tutorials' PD decode nodes
run) hands the release's real ``NPUModelRunner`` its first step; patch ``draft-placeholders-after-metadata``.

``RecomputeScheduler.add_request`` gives every new request on a kv-consumer with a speculative config
``spec_token_ids = [-1] * k`` (v0.13.0 ``core/recompute_scheduler.py:110``, v0.18.0 ``:152``) and its waiting branch
schedules them as drafts with the request's first chunk (``num_tokens_with_spec``). The only stand-in here is the
KV connector, a consumer whose remote KV never hits (its scheduler side returns 0 external tokens): the placeholders
are scheduled either way. Without the fix the runner hands the forward the ``-1`` drafts (an out-of-range embedding
index: the GatherV2 fault of #10305 on NPUs); with it the forward sees 0 there while the rejection sampler's drafts
stay ``-1`` (a ``-1`` draft is never accepted). Zero-bubble is left out (ascend-0.13 refuses a PD decode node with
the recompute scheduler; the fix applies without it).
"""

from __future__ import annotations

import os
import sys

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
HARNESS = {"0.13": "runner013", "0.18": "runner018"}
FAMILY = npu_standin.detect_family()
if FAMILY not in HARNESS:
    pytest.skip(f"the runner harness covers vllm-ascend 0.13 / 0.18; this env has {FAMILY}", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parity"))

FIX = "draft-placeholders-after-metadata"
K = 2
CONNECTOR = "ZbPatchTestNoHitConsumer"


def _connector_class():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    class NoHitConsumer(KVConnectorBase_V1):
        """A kv-consumer whose remote KV never hits: scheduler side only (the runner is not given the connector)."""

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            pass

        def build_connector_meta(self, scheduler_output):
            return KVConnectorMetadata()

        def start_load_kv(self, forward_context, **kwargs):
            pass

        def wait_for_layer_load(self, layer_name):
            pass

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            pass

        def wait_for_save(self):
            pass

    return NoHitConsumer


def _first_step(H, release, sess, *, patched, disabled=()):
    """Schedule one new request on the release's AsyncRecomputeScheduler (kv-consumer) and prepare its step on the
    release's runner. Returns (scheduled drafts, drafts handed to the sampler, ids handed to the forward at the draft
    positions, patch verdicts)."""
    import copy

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm_ascend.core.recompute_scheduler import AsyncRecomputeScheduler

    from zb_patch import registry as R
    from zb_patch.check.selftest import compat
    from zb_patch.check.selftest.compat import EngineShape

    shape = EngineShape(num_spec_tokens=K)
    vc = H.build_config(sess, shape)
    kvc = H.kv_cache_config(vc, shape)
    if CONNECTOR not in KVConnectorFactory._registry:
        sys.modules[__name__].NoHitConsumer = _connector_class()
        KVConnectorFactory.register_connector(CONNECTOR, __name__, "NoHitConsumer")
    decode_vc = copy.copy(vc)  # the scheduler's: a PD decode node's kv-consumer config; the runner keeps vc
    decode_vc.kv_transfer_config = KVTransferConfig(kv_connector=CONNECTOR, kv_role="kv_consumer")
    scheduler = AsyncRecomputeScheduler(
        vllm_config=decode_vc,
        kv_cache_config=kvc,
        structured_output_manager=StructuredOutputManager(decode_vc),
        block_size=shape.block_size,
        log_stats=False,
    )
    prompt = list(range(40, 40 + 21))
    scheduler.add_request(
        compat.make_request(
            "pd-0", prompt, max_tokens=8, stop_token_ids=[], arrival_time=0.0, block_size=shape.block_size
        )
    )
    so = scheduler.schedule()
    scheduled = list(so.scheduled_spec_decode_tokens.get("pd-0", ()))
    verdicts: dict = {}
    if patched:
        report = release.ADAPTER.patch_set.apply(disabled=disabled)
        assert report.verdict == R.APPLIED, report.reason
        verdicts = {p: v for v in (R.APPLIED, R.DISABLED) for p in report.by_verdict(v)}
    try:
        runner = H.make_runner(vc, kvc)
        driver = release.Driver(runner, shape, seed=0)
        inputs = driver.prepare_step(runner, so)
    finally:
        if patched:
            release.ADAPTER.patch_set.unpatch()
    total = so.num_scheduled_tokens["pd-0"]
    forward = [int(x) for x in inputs.input_ids[total - len(scheduled) : total]] if scheduled else []
    sampler = [int(x) for x in inputs.spec_meta.draft_token_ids] if inputs.spec_meta is not None else []
    return scheduled, sampler, forward, verdicts


def _fix_only(H, release):
    """ZB_PATCH=1 with zero-bubble left out (its group, by one id)."""
    return H.zero_bubble_and_fix_ids(release.ADAPTER)[0][:1]


def test_the_first_step_schedules_placeholder_drafts(H, release, sess):
    """The release as it is: the first step schedules the prompt with ``[-1] * k`` drafts. vLLM 0.18 writes them
    into the row's tokens (``update_req_spec_token_ids``): the sampler gets -1 (as it should) and so does the
    forward. vLLM 0.13 writes a new row's drafts nowhere (nor does vllm-ascend 0.13's PD-decode ``_update_states``,
    patch/worker/patch_model_runner.py:283-295): the sampler and the forward get what the row held before (zeros in
    this fresh batch; another request's tokens or a ``-1`` placeholder in a used one), drafts the sampler can
    accept."""
    scheduled, sampler, forward, _ = _first_step(H, release, sess, patched=False)
    assert scheduled == [-1] * K
    if FAMILY == "0.18":
        assert sampler == [-1] * K and forward == [-1] * K
    else:
        assert sampler == forward == [0] * K


def test_with_the_fix_the_forward_sees_no_placeholder(H, release, sess):
    """ZB_PATCH=1 (zero-bubble left out): the sampler gets the scheduled -1 drafts (never accepted; on 0.13 through
    ``readded-request-drafts``, which writes a row's scheduled drafts when the release did not), the forward 0."""
    scheduled, sampler, forward, verdicts = _first_step(H, release, sess, patched=True, disabled=_fix_only(H, release))
    assert verdicts.get(FIX) == "applied", verdicts
    assert scheduled == [-1] * K
    assert sampler == [-1] * K
    assert forward == [0] * K


def test_disabling_the_fix_brings_the_placeholder_back(H, release, sess):
    """ZB_PATCH_DISABLE=draft-placeholders-after-metadata (zero-bubble off as well): the forward gets the -1."""
    disabled = (*_fix_only(H, release), FIX)
    scheduled, sampler, forward, verdicts = _first_step(H, release, sess, patched=True, disabled=disabled)
    assert verdicts.get(FIX) == "disabled", verdicts
    assert sampler == [-1] * K and forward == [-1] * K
