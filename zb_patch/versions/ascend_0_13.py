"""Adapter ascend-0.13: vllm-ascend 0.13.0 + vLLM 0.13.x (classic async + spec decode, no zero-bubble).

vllm-ascend 0.13.0 supports async scheduling with EAGLE/MTP (padded drafter) in the classic form; its
NPU runner's ``_prepare_inputs`` is monolithic (it also builds attention metadata). The zero-bubble backport for
this family replaces the methods guarded below. ``vllm_ascend.patch.worker.patch_model_runner`` (a global
``GPUModelRunner._update_states`` replacement used only on PD decode nodes with the recompute scheduler) is not
guarded here because it is imported conditionally; a later patch of ``_update_states`` must compose with it.
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
        {'vllm 0.13.0': '6e1ca3fff01ce8a8'},
        'B-a1: zero-bubble state',
    ),
    Guard(
        'vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states',
        {'vllm 0.13.0': '71f7c9676bb77930'},
        'B-a2: the blocking accepted-count sync becomes a deferred correction',
    ),
    Guard(
        'vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_cumsum_and_arange',
        {'vllm 0.13.0': '4373960af72d1454'},
        'B-a3: new (num_tokens, arange_out) form',
    ),
    Guard(
        'vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_input_ids',
        {'vllm 0.13.0': '5932e601684fdc7a'},
        'B-a5: iterates prev_positions (num_reqs argument)',
    ),
    Guard(
        'vllm.v1.worker.gpu_model_runner:GPUModelRunner._copy_valid_sampled_token_count',
        {'vllm 0.13.0': '1defdf40921fa49a'},
        'B-a6: stash the device valid count',
    ),
    Guard(
        'vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_valid_sampled_token_count',
        {'vllm 0.13.0': '26d90667e22b8057'},
        'B-a7: the sync, called only from the deferred correction',
    ),
    Guard(
        'vllm.v1.worker.gpu_model_runner:GPUModelRunner._init_model_kwargs',
        {'vllm 0.13.0': '252092b39911bd67'},
        'B-a8: reads seq_lens.gpu',
    ),
    Guard(
        'vllm.v1.worker.gpu_model_runner:GPUModelRunner._pool',
        {'vllm 0.13.0': '1a1819b0e2befa4c'},
        'B-a9: reads seq_lens.cpu',
    ),
    Guard(
        'vllm.v1.worker.gpu_input_batch:InputBatch.update_async_output_token_ids',
        {'vllm 0.13.0': '2593129b2e22f2e9'},
        'B-a12: 0.13 replaces only the last placeholder',
    ),
    Guard(
        'vllm_ascend.worker.model_runner_v1:NPUModelRunner.__init__',
        {'vllm-ascend 0.13.0': '8d9ac47259e3fe63'},
        'B-b1',
    ),
    Guard(
        'vllm_ascend.worker.model_runner_v1:NPUModelRunner._prepare_inputs',
        {'vllm-ascend 0.13.0': '3f2160eb21592eb2'},
        'B-b2: monolithic: positions, slot mapping, seq_lens and attention metadata',
    ),
    Guard(
        'vllm_ascend.worker.model_runner_v1:NPUModelRunner._build_dummy_attn_metadata',
        {'vllm-ascend 0.13.0': '9440377f829b9e58'},
        'B-b3',
    ),
    Guard(
        'vllm_ascend.worker.model_runner_v1:NPUModelRunner._dummy_run',
        {'vllm-ascend 0.13.0': '5d4162b1c1d0234a'},
        'B-b4',
    ),
    Guard(
        'vllm_ascend.worker.model_runner_v1:NPUModelRunner.execute_model',
        {'vllm-ascend 0.13.0': '57d4b56dcef2d872'},
        'B-b5: deferred correction after the forward launch',
    ),
    Guard(
        'vllm_ascend.worker.model_runner_v1:NPUModelRunner.sample_tokens',
        {'vllm-ascend 0.13.0': '4a7d6cf7b2fe1407'},
        'B-b6',
    ),
    Guard(
        'vllm_ascend.worker.model_runner_v1:NPUModelRunner.propose_draft_token_ids',
        {'vllm-ascend 0.13.0': '08a0f995a61d0d7d'},
        'B-b7',
    ),
    Guard(
        'vllm_ascend.spec_decode.eagle_proposer:EagleProposer.prepare_next_token_ids_padded',
        {'vllm-ascend 0.13.0': 'b04a2a09323e2c31'},
        'B-b8: backup token index (vLLM #38098)',
    ),
    Guard(
        'vllm_ascend.spec_decode.eagle_proposer:EagleProposer.prepare_inputs_padded',
        {'vllm-ascend 0.13.0': 'd6b4172b92252aa7'},
        'B-b9: _seq_lens_cpu pass-through (#8749)',
    ),
    Guard(
        'vllm_ascend.spec_decode.eagle_proposer:EagleProposer.dummy_run',
        {'vllm-ascend 0.13.0': 'd528d7e1457e9c15'},
        'B-b10',
    ),
    Guard(
        'vllm_ascend.spec_decode.eagle_proposer:EagleProposer._propose',
        {'vllm-ascend 0.13.0': 'f0ab0b1e0a8a7030'},
        'B-b11',
    ),
    Guard(
        'vllm_ascend.spec_decode.eagle_proposer:EagleProposer.attn_update_stack_num_spec_norm',
        {'vllm-ascend 0.13.0': '75f8e995cd684ac4'},
        'B-b11',
    ),
    Guard(
        'vllm_ascend.spec_decode.mtp_proposer:MtpProposer.dummy_run',
        {'vllm-ascend 0.13.0': '03b4503c3ca7c269'},
        'B-b12',
    ),
    Guard(
        'vllm_ascend.spec_decode.mtp_proposer:MtpProposer._propose',
        {'vllm-ascend 0.13.0': '97cc12b8c7e3a7b1'},
        'B-b12',
    ),
    Guard(
        'vllm_ascend.worker.block_table:BlockTable.compute_slot_mapping',
        {'vllm-ascend 0.13.0': 'ab181c2789fafa53'},
        'B-b13: numpy slot mapping becomes the device kernel',
    ),
    Guard(
        'vllm_ascend.worker.block_table:BlockTable.commit_slot_mapping',
        {'vllm-ascend 0.13.0': '7ecb26d2b557ccfa'},
        'B-b13',
    ),
    Guard(
        'vllm_ascend.worker.block_table:MultiGroupBlockTable.compute_slot_mapping',
        {'vllm-ascend 0.13.0': '9b098020be5b986e'},
        'B-b13',
    ),
    Guard(
        'vllm_ascend.attention.utils:AscendCommonAttentionMetadata.unpadded',
        {'vllm-ascend 0.13.0': '45c4d912f875ffac'},
        'B-b15',
    ),

)

PATCHES: tuple = ()

ADAPTER = Adapter(
    id='ascend-0.13',
    title='vllm-ascend 0.13.0 + vLLM 0.13.x (classic async + spec decode, no zero-bubble)',
    vllm_ascend=((0, 13, 0), (0, 14)),
    vllm=((0, 13, 0), (0, 14)),
    patch_set=PatchSet('ascend-0.13', PATCHES, GUARDS),
    preload=("vllm_ascend.platform", "vllm_ascend.worker.worker"),
    releases=("0.13.0",),
    notes='vllm-ascend 0.13.0 pins vLLM 0.13.0 (the only 0.13.x on PyPI).',
)
