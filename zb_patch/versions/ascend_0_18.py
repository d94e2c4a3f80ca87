"""Adapter ascend-0.18: vllm-ascend 0.18.0 + vLLM 0.18.x (classic async + spec decode, no zero-bubble).

vllm-ascend 0.18.0 runs async scheduling with EAGLE/MTP in the classic (#24799) form: every step blocks on
the device->host copy of the accepted-token count inside the inherited vLLM 0.18 ``GPUModelRunner._update_states``.
The zero-bubble backport (issue 6) replaces the methods guarded below; until then the adapter verifies them.
"""

from __future__ import annotations

from ..registry import Guard, PatchSet
from . import Adapter

# Upstream functions this adapter's patches replace or rely on, with the fingerprints of the release
# sources they were read from (``zb-patch fingerprints`` recomputes them from any source tree).
# Ids like A-a2 / B-b13 refer to ../shared/reference/blueprint.md (method-by-method backport plan).
GUARDS = (
    Guard(
        'vllm.v1.worker.gpu_model_runner:GPUModelRunner.__init__',
        {'vllm 0.18.0, 0.18.1': '5153d645b5659849'},
        'A-a1: zero-bubble state (device num_computed_tokens, plain positions/seq_lens, optimistic_seq_lens_cpu, prev_positions, prev_num_draft_tokens)',
    ),
    Guard(
        'vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states',
        {'vllm 0.18.0, 0.18.1': '6f40a2feaa48b4bd'},
        'A-a2: the blocking accepted-count sync (_get_valid_sampled_token_count) becomes a deferred correction',
    ),
    Guard(
        'vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_cumsum_and_arange',
        {'vllm 0.18.0, 0.18.1': '4373960af72d1454'},
        'A-a3: new (num_tokens, arange_out) form used by the zero-bubble _prepare_inputs',
    ),
    Guard(
        'vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_input_ids',
        {'vllm 0.18.0, 0.18.1': '9485308c065f0754'},
        'A-a5: iterates prev_positions (num_reqs argument)',
    ),
    Guard(
        'vllm.v1.worker.gpu_model_runner:GPUModelRunner._copy_valid_sampled_token_count',
        {'vllm 0.18.0, 0.18.1': 'b4e8438fae13f315'},
        'A-a6: stash the device valid count; side-stream ordering',
    ),
    Guard(
        'vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_valid_sampled_token_count',
        {'vllm 0.18.0, 0.18.1': '20784bf355208845'},
        'A-a7: the sync itself, called only from the deferred correction',
    ),
    Guard(
        'vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_positions',
        {'vllm 0.18.0, 0.18.1': '4030980b29de1f18'},
        'A-a8: reads positions.gpu (becomes a plain tensor)',
    ),
    Guard(
        'vllm.v1.worker.gpu_model_runner:GPUModelRunner._init_model_kwargs',
        {'vllm 0.18.0, 0.18.1': '9aff01701dfef106'},
        'A-a9: reads seq_lens.gpu',
    ),
    Guard(
        'vllm.v1.worker.gpu_model_runner:GPUModelRunner._preprocess',
        {'vllm 0.18.0, 0.18.1': 'c1c70d453ceb51c9'},
        'A-a10: reads positions.gpu',
    ),
    Guard(
        'vllm.v1.worker.gpu_model_runner:GPUModelRunner._pool',
        {'vllm 0.18.0, 0.18.1': '626acdd8449236a7'},
        'A-a11: reads seq_lens.cpu',
    ),
    Guard(
        'vllm.v1.worker.gpu_input_batch:InputBatch.update_async_output_token_ids',
        {'vllm 0.18.0, 0.18.1': '8806d04d65401d50'},
        'A-a13: must replace the whole optimistic -1 tail',
    ),
    Guard(
        'vllm_ascend.worker.model_runner_v1:NPUModelRunner.__init__',
        {'vllm-ascend 0.18.0': '0f3a79171e3bf24f'},
        'A-b1: PCP positions buffer, _needs_seq_lens_cpu_sync',
    ),
    Guard(
        'vllm_ascend.worker.model_runner_v1:NPUModelRunner._prepare_inputs',
        {'vllm-ascend 0.18.0': '72f01a8e67691f0d'},
        'A-b2: device positions / seq_lens / slot mapping from corrected counts',
    ),
    Guard(
        'vllm_ascend.worker.model_runner_v1:NPUModelRunner._build_attention_metadata',
        {'vllm-ascend 0.18.0': '590425dd3212fbe8'},
        'A-b3: exact CPU seq_lens for Ascend attention',
    ),
    Guard(
        'vllm_ascend.worker.model_runner_v1:NPUModelRunner.execute_model',
        {'vllm-ascend 0.18.0': '9eca449f8a01d727'},
        'A-b4: calls the deferred correction after the forward launch',
    ),
    Guard(
        'vllm_ascend.worker.model_runner_v1:NPUModelRunner.sample_tokens',
        {'vllm-ascend 0.18.0': 'f1284b38c8dc9ad2'},
        'A-b5: resets valid_sampled_token_count_gpu before proposing',
    ),
    Guard(
        'vllm_ascend.worker.model_runner_v1:NPUModelRunner.propose_draft_token_ids',
        {'vllm-ascend 0.18.0': '08404fc38be7261e'},
        'A-b6: padded drafter path without the metadata argument',
    ),
    Guard(
        'vllm_ascend.worker.model_runner_v1:NPUModelRunner._dummy_run',
        {'vllm-ascend 0.18.0': 'f4ea71c058d74a77'},
        'A-b7: fills optimistic_seq_lens_cpu / plain positions',
    ),
    Guard(
        'vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer.prepare_next_token_ids_padded',
        {'vllm-ascend 0.18.0': 'b04a2a09323e2c31'},
        'A-b8: backup token index num_tokens_no_spec - 1 (vLLM #38098)',
    ),
    Guard(
        'vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer.prepare_inputs_padded',
        {'vllm-ascend 0.18.0': 'bec28bfc8a735b99'},
        'A-b9: pass _seq_lens_cpu through (#8749)',
    ),
    Guard(
        'vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer._propose',
        {'vllm-ascend 0.18.0': 'd468b07a805b3f0d'},
        'A-b10: FULL-graph pad branch reads runner.seq_lens.gpu/.cpu',
    ),
    Guard(
        'vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer.attn_update_stack_num_spec_norm',
        {'vllm-ascend 0.18.0': '066043ae9710cf9f'},
        'A-b11: per-draft-step CPU seq_lens +1 must tolerate None',
    ),
    Guard(
        'vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer.dummy_run',
        {'vllm-ascend 0.18.0': '57dbd331e0623e17'},
        'A-b12: reads runner.seq_lens / positions buffers',
    ),
    Guard(
        'vllm_ascend.worker.block_table:BlockTable.compute_slot_mapping',
        {'vllm-ascend 0.18.0': 'ab181c2789fafa53'},
        'A-b14: numpy slot mapping becomes the device kernel',
    ),
    Guard(
        'vllm_ascend.worker.block_table:BlockTable.commit_slot_mapping',
        {'vllm-ascend 0.18.0': '7ecb26d2b557ccfa'},
        'A-b14: H2D commit removed',
    ),
    Guard(
        'vllm_ascend.worker.block_table:MultiGroupBlockTable.compute_slot_mapping',
        {'vllm-ascend 0.18.0': '9b098020be5b986e'},
        'A-b14: per-group dispatch',
    ),
    Guard(
        'vllm_ascend.attention.utils:AscendCommonAttentionMetadata.unpadded',
        {'vllm-ascend 0.18.0': '45c4d912f875ffac'},
        'A-b16: tolerate None CPU seq_lens, propagate _seq_lens_cpu',
    ),
    Guard(
        'vllm_ascend.worker.npu_input_batch:NPUInputBatch.__init__',
        {'vllm-ascend 0.18.0': '50be08c3f1e79a4e'},
        'A-b18: num_accepted_tokens_cpu_tensor dtype',
    ),

)

PATCHES: tuple = ()

ADAPTER = Adapter(
    id='ascend-0.18',
    title='vllm-ascend 0.18.0 + vLLM 0.18.x (classic async + spec decode, no zero-bubble)',
    vllm_ascend=((0, 18, 0), (0, 19)),
    vllm=((0, 18, 0), (0, 19)),
    patch_set=PatchSet('ascend-0.18', PATCHES, GUARDS),
    preload=("vllm_ascend.platform", "vllm_ascend.worker.worker"),
    releases=("0.18.0",),
    notes='vllm-ascend 0.18.0 pins vLLM 0.18.0; vLLM 0.18.1 has identical targets.',
)
