"""What one data-parallel rank's engine core process reports about itself, for tests/engine/run_dp_engine_core.py:
read in that process (vLLM's ``collective_rpc`` runs :func:`report` on the engine core's worker) from state the
launcher installed before vLLM forked it (:func:`observe_engine_core`)."""

from __future__ import annotations

import os

# in the engine core's process: its class, and its dummy batches (a rank without work while another still steps)
ENGINE_CORE = {"class": "", "dummy_batches": 0}


def observe_engine_core() -> None:
    """Record the class of the engine core and count its ``execute_dummy_batch`` calls, in whatever process runs it
    (installed before vLLM starts that process: the fork inherits the wrappers and this module's record)."""
    from vllm.v1.engine.core import EngineCore

    init, dummy_batch = EngineCore.__init__, EngineCore.execute_dummy_batch

    def __init__(self, *args, **kwargs):
        ENGINE_CORE["class"] = type(self).__name__
        return init(self, *args, **kwargs)

    def execute_dummy_batch(self, *args, **kwargs):
        ENGINE_CORE["dummy_batches"] += 1
        return dummy_batch(self, *args, **kwargs)

    EngineCore.__init__, EngineCore.execute_dummy_batch = __init__, execute_dummy_batch


def report(worker) -> dict:
    """Run on the engine core's worker: its process, zb-patch's state there and what zero-bubble did on its runner."""
    from zb_patch.check.engine import child

    return {
        "pid": os.getpid(),
        "zb_patch_status": child._zb_patch_status(),
        "zero_bubble": child._zero_bubble_state(worker.model_runner),
        "engine_core_class": ENGINE_CORE["class"],
        "dummy_batches": ENGINE_CORE["dummy_batches"],
        "data_parallel_rank": worker.vllm_config.parallel_config.data_parallel_rank,
    }
