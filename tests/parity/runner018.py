"""vllm-ascend 0.18.0's part of the runner-parity harness (:mod:`runner_harness`): the mirror of its
``execute_model`` up to the forward.

0.18's ``_prepare_inputs`` only prepares the inputs (positions, seq_lens, slot mapping, input ids, spec-decode
metadata, discard indices); the attention metadata is built afterwards from the runner's buffers, inside
``synchronize_input_prep``. The step's inputs are queued when ``_prepare_inputs`` returns.

With the MLA target (``method="mtp"``, :mod:`mla_harness`) the mirror goes on as the release does: the batch's
execution mode and padding (``_determine_batch_execution_and_padding``, with :class:`mla_harness.FullDecodeDispatcher`
as an engine with FULL_DECODE_ONLY graphs dispatches), ``_pad_query_start_loc_for_fia`` on a FULL step, and the
release's ``_build_attention_metadata`` with the real ``AscendMLAMetadataBuilder``; on a FULL step the
parameter update of the captured graph (``update_full_graph_params`` -> ``AscendMLAImpl.update_graph_params``) runs
against :class:`mla_harness.GraphUpdateRecorder`. The drafter runs the release's ``propose_draft_token_ids`` ->
``AscendEagleProposer._propose`` (method ``mtp``) up to its model, which a recorder replaces (``_runnable``).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import mla_harness as M
import numpy as np
import runner_harness as H

from zb_patch.versions.ascend_0_18 import ADAPTER, ZERO_BUBBLE  # noqa: F401  (the release table)

FAMILY = "0.18"


class Driver(H.Driver):
    inputs_queued = ("vllm_ascend.worker.model_runner_v1", "NPUModelRunner", "_prepare_inputs")
    release_sample = True

    def __init__(self, runner: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(runner, *args, **kwargs)
        self.mla = runner.model_config.use_mla
        if self.mla:
            self._install_mla(runner)

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
                logits_indices, spec_meta, total = runner._prepare_inputs(so, nst)
            # _build_attention_metadata: what Ascend attention and the proposer are handed
            n = runner.input_batch.num_reqs
            seq_lens_cpu = [int(x) for x in runner.seq_lens.cpu[:n]]
            self._spec_common = SimpleNamespace(seq_lens_cpu=runner.seq_lens.cpu[:n])
            if self.mla:
                self._spec_common = self._build_mla(runner, so, nst, logits_indices, total)
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

    # -- the MLA group (mla_harness) ---------------------------------------------------------------------------
    def _install_mla(self, runner: Any) -> None:
        """What ``initialize_kv_cache`` / the proposer's ``load_model`` set up for a DeepSeek-V3 target with its MTP
        layer, without a model: one attention group of the target's layers and the drafter's own, each with the
        release's ``AscendMLAMetadataBuilder``; the FULL_DECODE_ONLY dispatcher stand-in."""
        import torch
        from vllm.forward_context import BatchDescriptor
        from vllm.v1.worker.utils import AttentionGroup
        from vllm_ascend.attention.mla_v1 import AscendMLABackend, AscendMLAMetadataBuilder

        kvc, vc = runner.kv_cache_config, runner.vllm_config
        spec = kvc.kv_cache_groups[0].kv_cache_spec
        target = M.make_builder(AscendMLAMetadataBuilder, vc, kvc, list(M.TARGET_LAYERS))
        runner.attn_groups = [[AttentionGroup(AscendMLABackend, list(M.TARGET_LAYERS), spec, 0, [target])]]
        runner.attn_backend = AscendMLABackend
        draft = M.make_builder(AscendMLAMetadataBuilder, vc, kvc, [M.DRAFT_LAYER])
        draft_build = draft.build

        def build(*args: Any, **kwargs: Any) -> Any:  # the drafter's metadata as it is at build time
            meta = draft_build(*args, **kwargs)
            self._draft_built.append(M.flatten(meta))
            return meta

        draft.build = build
        drafter = runner.drafter
        drafter.draft_attn_groups = [AttentionGroup(AscendMLABackend, [M.DRAFT_LAYER], spec, 0, [draft])]
        drafter.attn_layer_names = [M.DRAFT_LAYER]
        drafter.kernel_block_size = AscendMLABackend.get_supported_kernel_block_sizes()[0]
        drafter._runnable = self._record_drafts
        runner.model = torch.nn.Module()  # the drafter hands the builder runner.get_model() (unused by MLA)
        M.triton_core_counts()
        runner.cudagraph_dispatcher = M.FullDecodeDispatcher(
            runner.uniform_decode_query_len, runner.max_num_reqs, BatchDescriptor
        )
        self.graph_updates = M.GraphUpdateRecorder("npu_fused_infer_attention_score_v2", 18)
        self._draft_built: list = []

    def _build_mla(self, runner: Any, so: Any, nst: np.ndarray, logits_indices: Any, total: int) -> Any:
        """The release's execute_model from its batch-execution decision to ``_build_attention_metadata``; records
        the target's metadata and, on a FULL step, the graph parameter update. Returns the proposer's common
        metadata."""
        import torch
        from vllm.config import CUDAGraphMode
        from vllm_ascend.ascend_forward_context import set_ascend_forward_context
        from vllm_ascend.compilation.acl_graph import update_full_graph_params

        n = runner.input_batch.num_reqs
        max_q = int(nst.max())
        mode, desc, _, _, _ = runner._determine_batch_execution_and_padding(
            num_tokens=total,
            num_reqs=n,
            num_scheduled_tokens_np=nst,
            max_num_scheduled_tokens=max_q,
            use_cascade_attn=False,
            force_eager=False,  # the dispatcher stand-in decides, as in a FULL_DECODE_ONLY engine
            num_encoder_reqs=0,
        )
        tokens_padded = desc.num_tokens
        reqs_padded = desc.num_reqs if desc.num_reqs is not None else n
        if mode == CUDAGraphMode.FULL:
            reqs_padded = runner._pad_query_start_loc_for_fia(tokens_padded, reqs_padded, n, mode, desc.num_reqs)
        attn_metadata, spec_cm = runner._build_attention_metadata(
            num_tokens=total,
            num_tokens_padded=tokens_padded,
            num_reqs=n,
            num_reqs_padded=reqs_padded,
            max_query_len=max_q,
            ubatch_slices=None,
            logits_indices=logits_indices,
            use_spec_decode=len(so.scheduled_spec_decode_tokens) > 0,
            num_scheduled_tokens=so.num_scheduled_tokens,
            num_scheduled_tokens_np=nst,
            cascade_attn_prefix_lens=None,
        )
        metas = {id(attn_metadata[layer]) for layer in M.TARGET_LAYERS}
        assert len(metas) == 1 and set(attn_metadata) == set(M.TARGET_LAYERS), sorted(attn_metadata)
        record = {"target": M.flatten(attn_metadata[M.TARGET_LAYERS[0]])}
        if mode == CUDAGraphMode.FULL:  # _model_forward: replay, then _update_full_graph_params_if_needed
            graph_params = self.graph_updates.graph_params(tokens_padded, list(attn_metadata))
            self.graph_updates.calls = []
            with (
                set_ascend_forward_context(
                    attn_metadata,
                    runner.vllm_config,
                    num_tokens=tokens_padded,
                    aclgraph_runtime_mode=mode,
                    batch_descriptor=desc,
                ),
                self.graph_updates.recording(),
                _graph_params(graph_params),
            ):
                from vllm.forward_context import get_forward_context

                update_full_graph_params(
                    runner.attn_backend,
                    torch.npu.current_stream(),  # runner.update_stream exists once graphs are captured
                    get_forward_context(),
                    tokens_padded,
                    runner.vllm_config,
                    runner.speculative_config,
                    tokens_padded,
                )
            record["graph_update"] = list(self.graph_updates.calls)
        self.mla_records[self.step] = record
        return spec_cm

    def run_drafter(self, runner: Any, st: H.StepState, sampler_output: Any) -> tuple[Any, Any]:
        """The release's ``propose_draft_token_ids`` with its own MLA metadata: ``prepare_next_token_ids_padded``
        (its results kept for the fake drafts), the valid counts' copy, ``prepare_inputs_padded`` and ``_propose``
        up to the model (``_record_drafts``)."""
        if not self.mla:
            return super().run_drafter(runner, st, sampler_output)
        import torch

        drafter = runner.drafter
        prepare = type(drafter).prepare_next_token_ids_padded
        kept: list = []

        def prepare_kept(*args: Any, **kwargs: Any) -> Any:
            kept.append(prepare(drafter, *args, **kwargs))
            return kept[-1]

        drafter.prepare_next_token_ids_padded = prepare_kept
        self._draft_built = []
        try:
            runner.propose_draft_token_ids(
                sampler_output.sampled_token_ids,
                runner.input_batch.sampling_metadata,
                st.so,
                st.spec_meta,
                self._spec_common,
                runner.positions.gpu[: st.total],
                st.total,
                torch.zeros(st.total, runner.model_config.get_hidden_size()),
            )
        finally:
            del drafter.prepare_next_token_ids_padded
        self.mla_records[self.step]["draft_built"] = list(self._draft_built)
        return kept[0]

    def _record_drafts(self, **inputs: Any) -> Any:
        """Stands in for the proposer's merged draft model run (``_run_merged_draft``): records the metadata of every
        draft position as the model would read it; the drafts come from the fake model."""
        import torch

        steps = inputs["multi_steps_attn_metadata"]
        self.mla_records[self.step]["draft"] = [M.flatten(per_layer[M.DRAFT_LAYER]) for per_layer in steps]
        return torch.zeros(inputs["batch_size"], self.k, dtype=torch.int64)


class _graph_params:
    """``get_graph_params()`` (as ``mla_v1`` imported it) answers the recorder's captured-graph parameters."""

    def __init__(self, params: Any) -> None:
        self.params = params

    def __enter__(self) -> None:
        import vllm_ascend.attention.mla_v1 as mla_v1

        self.saved = mla_v1.get_graph_params
        mla_v1.get_graph_params = lambda: self.params

    def __exit__(self, *exc: Any) -> None:
        import vllm_ascend.attention.mla_v1 as mla_v1

        mla_v1.get_graph_params = self.saved
