"""vllm-ascend 0.18.0's part of the runner-parity harness (:mod:`runner_harness`): the mirror of its
``execute_model`` up to the forward.

0.18's ``_prepare_inputs`` only prepares the inputs (positions, seq_lens, slot mapping, input ids, spec-decode
metadata, discard indices); the attention metadata is built afterwards from the runner's buffers, inside
``synchronize_input_prep``. The step's inputs are queued when ``_prepare_inputs`` returns.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import numpy as np
import runner_harness as H

from zb_patch.versions.ascend_0_18 import ADAPTER, ZERO_BUBBLE  # noqa: F401  (the release table)

FAMILY = "0.18"


class Driver(H.Driver):
    inputs_queued = ("vllm_ascend.worker.model_runner_v1", "NPUModelRunner", "_prepare_inputs")

    def prepare_step(self, runner: Any, so: Any) -> H.StepInputs | None:
        if runner.use_async_scheduling and runner.num_spec_tokens and runner._draft_token_ids is None:
            so = copy.deepcopy(so)
        with runner.synchronize_input_prep():
            with self.in_phase("update_states"):
                runner._update_states(so)
            if not so.total_num_scheduled_tokens:
                return None
            req_ids = list(runner.input_batch.req_ids)
            nst = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
            with self.in_phase("prepare_inputs:release"):
                _, spec_meta, total = runner._prepare_inputs(so, nst)
            # _build_attention_metadata: what Ascend attention and the proposer are handed
            n = runner.input_batch.num_reqs
            seq_lens_cpu = [int(x) for x in runner.seq_lens.cpu[:n]]
            self._spec_common = SimpleNamespace(seq_lens_cpu=runner.seq_lens.cpu[:n])
        # _preprocess (input_ids.gpu / positions.gpu), _model_forward
        bt = runner.input_batch.block_table[0]
        return H.StepInputs(
            spec_meta=spec_meta,
            query_start_loc=runner.query_start_loc.gpu[: n + 1].numpy().copy(),
            input_ids=runner.input_ids.gpu[:total].numpy().copy(),
            positions=runner.positions.gpu[:total].numpy().copy(),
            slots=bt.slot_mapping.gpu[:total].numpy().copy(),
            block_table=bt.block_table.gpu[:n].numpy(),
            seq_lens_cpu=seq_lens_cpu,
            seq_lens_gpu=[int(x) for x in runner.seq_lens.gpu[:n]],
            num_computed_cpu=[int(x) for x in runner.input_batch.num_computed_tokens_cpu[:n]],
        )

    def spec_common_metadata(self, runner: Any) -> Any:
        return self._spec_common
