"""Adapter ascend-0.18 (zero-bubble backport): runner-level parity on vllm-ascend 0.18.0's real NPUModelRunner.

vLLM 0.18's real AsyncScheduler drives the release's real runner methods (tests/parity/runner018.py says exactly
which are real and which are mirrored) UNPATCHED and then PATCHED with the adapter, on the same seeded workload
(arrivals, chunked prefill, prefix-cache hits, preemption + resumption, stop tokens, max_model_len, aborts;
acceptance none / all / partial per request and position). Asserted:

* identical per-step, per-request positions, slot mapping, input ids, CPU and device seq_lens, CPU
  num_computed_tokens, max_seq_len, discard flags, sampled tokens, drafted / accepted counts, drafter next-token
  inputs and req_state.num_computed_tokens after execute_model; identical token streams and finish reasons;
* the accepted-count wait: >= 1 per spec-decode step before input preparation unpatched; 0 before input
  preparation on every step patched (its one wait per corrected step comes after the step's inputs are prepared
  and enqueued: Ascend attention's exact CPU seq_lens);
* >= 10,000 engine steps in total (k = 1..4), on the kernels' pure-torch twins; a shorter run on the Triton kernels
  (Triton's CPU interpreter); one without batch reordering;
* planted mistakes in the glue are caught; unsupported combinations fall through to the release with one WARNING.

Cost on the 2-core CI box: ~1 minute after the vLLM import.
"""

from __future__ import annotations

import logging
import os
import sys

import pytest

npu_standin = pytest.importorskip("npu_standin", reason="tests/support must be on PYTHONPATH (tox sets it)")
if npu_standin.detect_family() != "0.18":
    pytest.skip(f"adapter ascend-0.18 targets vllm-ascend 0.18.x; this env has {npu_standin.detect_family()}",
                allow_module_level=True)

import numpy as np  # noqa: E402

from zb_patch import registry as R  # noqa: E402
from zb_patch.versions import by_id  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parity"))

ADAPTER = by_id("ascend-0.18")
PARITY_ITERATIONS = 2900   # engine iterations per k = 1..4: ~10,500 engine steps (schedule() calls) in total
MIN_TOTAL_STEPS = 10_000


@pytest.fixture(scope="module")
def H(cpu_worker):
    import runner018

    return runner018


@pytest.fixture(scope="module")
def sess(H):
    with H.session() as s:
        yield s


def _shape(k):
    from zb_patch.check.selftest.compat import EngineShape

    return EngineShape(num_spec_tokens=k)


def _check_waits(res, *, patched_corrects=True):
    u, p = res["unpatched"], res["patched"]
    # unpatched: the classic blocking sync before input preparation on every spec-decode step
    assert u["spec_steps"] > 0
    assert u["min_before_prep_per_spec_step"] >= 1, u
    assert set(u["waits"]) == {"update_states"}, u["waits"]
    # patched: never before input preparation; at most one wait per step, after the inputs were prepared
    assert p["max_before_prep_per_step"] == 0, p
    assert set(p["waits"]) <= {"prepare_inputs:after"}, p["waits"]
    assert p["max_waits_per_step"] <= 1, p
    zb = p["zb"]
    assert zb["active"] and zb["fallback_uploads"] == 0, zb
    if patched_corrects:
        assert zb["corrected_steps"] > 0 and p["waits"]["prepare_inputs:after"] == zb["corrected_steps"]


def test_parity_10k_steps(H, sess, capsys):
    total = 0
    lines = []
    for k in (1, 2, 3, 4):
        res = H.parity(sess, _shape(k), PARITY_ITERATIONS, seed=k, adapter=ADAPTER)
        assert res["divergences"] == 0, res["examples"]
        _check_waits(res)
        u, p = res["unpatched"], res["patched"]
        assert 0 < u["accepted"] < u["drafted"]          # partial acceptance overall
        assert u["preemptions"] > 0 and u["aborted"] > 0   # batch changes of every kind happened
        total += u["steps"]
        lines.append(f"k={k}: {u['steps']} steps ({u['spec_steps']} spec), {u['requests']} requests, "
                     f"{u['preemptions']} preemptions, {u['aborted']} aborts, drafted {u['drafted']} / accepted "
                     f"{u['accepted']}; accepted-count waits before input prep per spec step: unpatched "
                     f"{u['before_prep_per_spec_step']:.2f}, patched {p['max_before_prep_per_step']} (max per step); "
                     f"patched waits after input prep: {p['waits'].get('prepare_inputs:after', 0)} on "
                     f"{p['zb']['corrected_steps']} corrected steps; {u['seconds']}s / {p['seconds']}s")
    assert total >= MIN_TOTAL_STEPS
    with capsys.disabled():
        print("\nrunner-level parity (ascend-0.18), 0 divergences:\n  " + "\n  ".join(lines))


def test_parity_on_triton_kernels(H, sess):
    from zb_patch.kernels._launch import interpret_mode

    if not interpret_mode():
        pytest.skip("TRITON_INTERPRET=1 is not set: CPU tensors use the reference twins")
    res = H.parity(sess, _shape(3), 120, seed=11, adapter=ADAPTER, triton=True)
    assert res["divergences"] == 0, res["examples"]
    _check_waits(res)
    state = res["runners"][1].__dict__["_zb_patch_018"]
    assert type(state.buffers.token_counts).__name__ == "TokenCountsLauncher"
    assert all(type(m).__name__ == "SlotMappingLauncher" for _, m in state.buffers.slot_mappers.values())


def test_parity_without_batch_reordering(H, sess):
    res = H.parity(sess, _shape(2), 700, seed=5, adapter=ADAPTER, reorder=False)
    assert res["divergences"] == 0, res["examples"]
    _check_waits(res)


def test_backup_token_buffers_alternate(H, sess):
    res = H.parity(sess, _shape(2), 60, seed=3, adapter=ADAPTER)
    assert res["divergences"] == 0, res["examples"]
    unpatched, patched = res["runners"]
    pair = patched.drafter.__dict__["_zb_patch_018_backup_pair"]
    assert pair[0] is not pair[1] and patched.drafter.backup_next_token_ids in pair
    assert "_zb_patch_018_backup_pair" not in unpatched.drafter.__dict__


# -- planted mistakes: each must be caught ------------------------------------------------------------------


def _plant(monkeypatch, name):
    from zb_patch.versions import ascend_0_18_glue as G

    if name == "no-device-correction":  # positions / seq_lens / slot mapping left at the optimistic values
        original = G._device_correction

        def device_correction(runner, st, nst, total):
            queue, st.queue = st.queue, []
            original(runner, st, nst, total)
            st.queue = queue

        monkeypatch.setattr(G, "_device_correction", device_correction)
    elif name == "no-host-seq-lens-correction":  # Ascend attention gets optimistic CPU seq_lens (#8461 / #10506)
        def exact_host_counts(runner, st):
            if st.queue and st.valid_host is None:
                st.valid_host = runner._get_valid_sampled_token_count()

        monkeypatch.setattr(G, "_exact_host_counts", exact_host_counts)
    elif name == "no-deferred-correction":
        def apply_deferred(runner):
            st = G._active(runner)
            if st is not None:
                st.queue, st.valid_host = [], None

        monkeypatch.setattr(G, "apply_deferred", apply_deferred)
    elif name == "no-slot-mapping":
        monkeypatch.setattr(G, "_computes_slot_mapping", lambda table: False)
    elif name == "counts-by-current-row":  # previous-step values read at the current row (vLLM #38556 fix 2)
        def by_row(req_ids, prev_map, n, out):
            out[:n] = np.arange(n)
            return out[:n]

        monkeypatch.setattr(G.zero_bubble, "compute_prev_positions", by_row)
    elif name == "read-counts-without-wait":  # host correction reads the count buffer without the event
        def exact_host_counts(runner, st):
            if not st.queue:
                return
            n_prev = st.num_prev
            st.valid_host = runner.valid_sampled_token_count_cpu[:n_prev].tolist()
            for host in (runner.seq_lens.np, runner.input_batch.num_computed_tokens_cpu):
                G.zero_bubble.correct_seq_lens_cpu(host, st.buffers.prev_positions.np, st.buffers.prev_drafts.np,
                                                   np.asarray(st.valid_host), runner.input_batch.num_reqs,
                                                   num_prev=n_prev)

        monkeypatch.setattr(G, "_exact_host_counts", exact_host_counts)
    else:
        raise KeyError(name)


PLANTS = ("no-device-correction", "no-host-seq-lens-correction", "no-deferred-correction", "no-slot-mapping",
          "counts-by-current-row", "read-counts-without-wait")


@pytest.mark.parametrize("plant", PLANTS)
def test_planted_mistake_is_caught(H, sess, monkeypatch, plant):
    _plant(monkeypatch, plant)
    try:
        res = H.parity(sess, _shape(2), 300, seed=0, adapter=ADAPTER)
    except Exception:  # a crash of the patched run is a detection too (poisoned counts, bad indices)
        assert R.resolve("vllm_ascend.worker.model_runner_v1:NPUModelRunner._prepare_inputs").patched_by is None
        return
    assert res["divergences"] > 0, f"planted mistake {plant!r} went unnoticed"


# -- activation scope ------------------------------------------------------------------------------------------


def test_unsupported_combination_falls_through_with_one_warning(H, sess, caplog):
    from zb_patch.versions import ascend_0_18_glue as G

    def hybrid(runner):  # what initialize_kv_cache sets for Mamba / GDN models
        runner.need_accepted_tokens = True

    G._warned.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.zb_patch"):
        res = H.parity(sess, _shape(2), 200, seed=2, adapter=ADAPTER, runner_hook=hybrid)
        H.parity(sess, _shape(2), 20, seed=2, adapter=ADAPTER, runner_hook=hybrid)  # a second runner: no new line
    assert res["divergences"] == 0, res["examples"]
    p = res["patched"]
    assert p["zb"]["active"] is False and "hybrid" in p["zb"]["reason"]
    assert set(p["waits"]) == {"update_states"} and p["min_before_prep_per_spec_step"] >= 1  # the classic path
    lines = [r for r in caplog.records if "zero-bubble NOT active" in r.getMessage()]
    assert len(lines) == 1 and "hybrid" in lines[0].getMessage()


def test_async_scheduling_off_is_left_alone(H, sess, caplog):
    from zb_patch.versions import ascend_0_18_glue as G

    shape = _shape(2)
    vc = H.build_config(sess, shape, async_scheduling=False)
    runner = H.make_runner(vc, H.kv_cache_config(vc, shape))
    G._warned.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.zb_patch"):
        st = G.state_of(runner)
    assert not st.active and st.buffers is None and "off" in st.reason
    assert not [r for r in caplog.records if "zero-bubble" in r.getMessage()]


@pytest.mark.parametrize("attr,value,needle", [
    ("pcp_size", 2, "context parallelism"),
    ("uses_mrope", True, "M-RoPE"),
    ("is_pooling_model", True, "pooling"),
])
def test_unsupported_reasons(H, sess, attr, value, needle):
    from zb_patch.versions import ascend_0_18_glue as G

    shape = _shape(2)
    vc = H.build_config(sess, shape)
    runner = H.make_runner(vc, H.kv_cache_config(vc, shape))
    assert G.unsupported_reason(runner) == (True, "")
    setattr(runner, attr, value)
    wanted, reason = G.unsupported_reason(runner)
    assert wanted and needle in reason
