"""Adapter ascend-0.19-0.25: vllm-ascend 0.19.1rc1 .. 0.25.1rc1 + vLLM 0.19 .. 0.25.

These releases already run zero-bubble async scheduling + spec decode (#7640 / #8461), but
``BlockTable.compute_slot_mapping`` launches vLLM's generic ``_compute_slot_mapping_kernel`` every step, which the
vllm-ascend team measured at 173 us (4 tokens) / 1039 us (8192 tokens) on NPU against 3.0 / 21.2 us for an
Ascend-shaped kernel (#13048), which the releases ship only from 0.26.0rc1 on
(``vllm_ascend/ops/triton/compute_slot_mapping.py``). This adapter swaps in zb-patch's kernel and carries the later
correctness fixes a given release lacks.

Fingerprints: every release in range (0.19.1rc1, 0.20.2rc1, 0.21.0rc1, 0.22.1rc1, 0.23.0rc1, 0.23.0, 0.23.0.post1,
0.24.0rc1, 0.25.1rc1; PyPI has wheels for all but 0.23.0.post1) was read from its wheel and git tag; how, and the
per-release status of the later fixes, is in docs/releases/ascend-0.19-0.25.md (regenerate with
docs/releases/fingerprint_matrix.py or ``zb-patch fingerprints --root <tree> --adapter ascend-0.19-0.25``).
"""

from __future__ import annotations

from ..registry import BACKPORT, Advisory, Guard, Patch, PatchSet, RestsOn
from .adapter import ASCEND_RANGES, Adapter
from .fixes import (
    draft_sample_indices_past_batch,
    draft_seq_lens_max_model_len,
    min_tokens_draft_placeholders,
    mla_draft_rope_rows,
    reset_prefix_cache_in_flight,
    seq_lens_cpu_prepare_inputs_padded,
    seq_lens_cpu_unpadded,
    stale_draft_placeholders,
    valid_count_copy_order,
    valid_count_int64,
)


def _make_compute_slot_mapping(original):
    """Replacement of ``BlockTable.compute_slot_mapping(self, num_reqs, query_start_loc, positions)``.

    Same signature and effect (``self.slot_mapping.gpu[:max_num_batched_tokens]`` written on the device, the
    tail padded with PAD_SLOT_ID), one launch of zb-patch's Ascend-shaped kernel for every CP setting. The
    launcher is built once per BlockTable (its buffers live as long as the table) and kept in the instance
    ``__dict__``; per step the cost is this frame plus the launch.
    """
    from .. import kernels  # torch / triton only when the patch is applied, never at selection time

    def compute_slot_mapping(self, num_reqs, query_start_loc, positions):
        mapper = self.__dict__.get("_zb_slot_mapper")
        if mapper is None:
            mapper = self.__dict__["_zb_slot_mapper"] = kernels.slot_mapper(
                self.block_table.gpu,
                self.slot_mapping.gpu,
                block_size=self.block_size,
                max_num_tokens=self.max_num_batched_tokens,
                physical_block_size=self.physical_block_size,
                # 0.25.1rc1 dropped PCP from the block table (DCP only): one PCP rank
                pcp_world_size=getattr(self, "pcp_world_size", 1),
                pcp_rank=getattr(self, "pcp_rank", 0),
                dcp_world_size=self.dcp_world_size,
                dcp_rank=self.dcp_rank,
                cp_kv_cache_interleave_size=self.cp_kv_cache_interleave_size,
            )
        mapper(num_reqs, query_start_loc, positions)

    return compute_slot_mapping


SLOT_MAPPING_KERNEL = Patch(
    id="slot-mapping-kernel",
    rests_on=RestsOn(
        BACKPORT,
        "vllm-ascend's own Ascend-shaped slot-mapping kernel (#13048, native from 0.26.0rc1) written anew in Triton for triton-ascend (Triton 3.2 language, int32 index math, contiguous loads), on the stream the release launches its kernel on; verified against a pure-torch twin under the Triton and triton-ascend interpreters, compiled on CUDA, and against vLLM's generic kernel",
    ),
    target="vllm_ascend.worker.block_table:BlockTable.compute_slot_mapping",
    make=_make_compute_slot_mapping,
    fingerprints={
        # vLLM's generic kernel in both branches (CP too): the form before #10442
        "vllm-ascend 0.19.1rc1, 0.20.2rc1, 0.21.0rc1 (wheels)": "34770de46cb5927d",
        # #10442: torch _compute_pcp_dcp_slot_mapping for CP > 1
        "vllm-ascend 0.21.0rc1 (sdist), 0.22.1rc1": "86170883d9c748c1",
        "vllm-ascend 0.23.0rc1, 0.23.0, 0.23.0.post1": "96af10d24013ad58",
        # the same generic kernel; passes vLLM #40996's kernel-block constexprs unless vLLM is 0.24.0
        "vllm-ascend 0.24.0rc1": "280b3a35be21e4f0",
        # PCP removed from the block table (DCP only); otherwise as 0.24.0rc1 (vLLM 0.25.1)
        "vllm-ascend 0.25.1rc1": "68de23e30efebce5",
    },
    why="Every step launches vLLM's generic _compute_slot_mapping_kernel (one program per request, int64 "
    "vectors, runtime block size): 173 us for 4 tokens and 1039 us for 8192 tokens on an Atlas A2 per "
    "vllm-ascend #13048, against 3.0 / 21.2 us for an Ascend-shaped kernel. With CP > 1 the release runs a "
    "chain of torch ops instead (#10442).",
    how="Replace the method (same signature) with one launch of zb_patch.kernels.slot_mapper: persistent grid of "
    "few programs over token tiles, int32 index math, constexpr block size / CP, contiguous block-table "
    "window. Every KV-cache group goes through it because MultiGroupBlockTable.compute_slot_mapping calls "
    "this method per group (guarded). compute_slot_mapping_draft (numpy, drafters) is left alone, and so is "
    "310P (vllm_ascend._310p.block_table.BlockTable overrides this method with its numpy path; no Triton). "
    "Behaviour: identical to the release's slot mapping for every configuration, except on releases "
    "before #10442 (0.19.1rc1-0.21.0rc1 wheels) with CP > 1, a kernel block smaller than the interleave "
    "size and hybrid blocks, where the release's generic kernel is wrong and the patch gives #10442's "
    "answer (docs/releases/ascend-0.19-0.25.md).",
    upstream=("vllm-ascend#13048", "vllm-ascend#10442", "vllm#32951"),
    remove_when="vllm-ascend >= 0.26.0rc1 (ships #13048's Ascend kernel, "
    "vllm_ascend/ops/triton/compute_slot_mapping.py; native there by the installed compute_slot_mapping): "
    "the adapter range ends there.",
    roles=("worker",),
)

# ----------------------------------------------------------------------------------------------------
# Later correctness fixes, each applied only where the installed code lacks it. "native" is decided by the
# fingerprint of the installed target (native_fingerprints), never by a version string; a target whose
# fingerprint is in neither map refuses the whole adapter. Pre-/post-fix fingerprints per release:
# docs/releases/ascend-0.19-0.25-fingerprints.json and docs/releases/ascend-0.19-0.25-fixes.json.
# ----------------------------------------------------------------------------------------------------

VALID_COUNT_COPY_ORDER = valid_count_copy_order.patch(
    {"vllm-ascend 0.19.1rc1": "da51ae5effc04135"},
    native_fingerprints={
        "vllm-ascend 0.20.2rc1, 0.21.0rc1, 0.22.1rc1, 0.23.0rc1, 0.23.0, 0.23.0.post1, 0.24.0rc1, 0.25.1rc1": "a84e0bc102b7bda1",
    },
)

VALID_COUNT_INT64 = valid_count_int64.patch(
    {
        "vllm-ascend 0.19.1rc1": "9abd41d70e108d7a",
        "vllm-ascend 0.20.2rc1": "5b5331dc8055da86",
    },
    native_fingerprints={
        "vllm-ascend 0.21.0rc1 (wheels and sdist), 0.22.1rc1": "944a8f07a008165f",
        "vllm-ascend 0.23.0rc1, 0.23.0, 0.23.0.post1": "ac988ef9f9a7745c",
        "vllm-ascend 0.24.0rc1": "881b4462eaba6fd7",
        "vllm-ascend 0.25.1rc1": "2097e2dc7a4a8a12",
    },
)

SEQ_LENS_CPU_UNPADDED = seq_lens_cpu_unpadded.patch(
    {"vllm-ascend 0.19.1rc1": "34cfdda571b64daa"},
    native_fingerprints={
        "vllm-ascend 0.20.2rc1, 0.23.0rc1, 0.23.0, 0.23.0.post1": "d556ed4650dd6861",
        "vllm-ascend 0.21.0rc1 (wheels and sdist), 0.22.1rc1": "e2c1f3dd724c203a",
        "vllm-ascend 0.24.0rc1": "91403d073829939f",
        "vllm-ascend 0.25.1rc1": "4ab92289b12e5508",
    },
)

SEQ_LENS_CPU_PREPARE_INPUTS_PADDED = seq_lens_cpu_prepare_inputs_padded.patch(
    {"vllm-ascend 0.19.1rc1": "bec28bfc8a735b99"},
    native_fingerprints={
        "vllm-ascend 0.20.2rc1": "9970ba8894628732",
        "vllm-ascend 0.21.0rc1 (wheels and sdist), 0.22.1rc1": "3761c8b3feebc565",
        "vllm-ascend 0.23.0rc1, 0.23.0, 0.23.0.post1": "a518d54daa124020",
        "vllm-ascend 0.24.0rc1": "c582f802c7d1b50b",
        "vllm-ascend 0.25.1rc1": "7648b9f1ff7c06ea",
    },
)

# vLLM #37159 (no vLLM release fixes it). vLLM-side targets: one fingerprint per form, read from the sdist of every vLLM
# release from 0.19.0 to 0.25.1; each label also names the vllm-ascend releases that run on those vLLMs (the supported
# table counts a vLLM-side patch by them). The va019 / va023 / va025 contract tests recompute the installed one.
STALE_DRAFT_PLACEHOLDERS, STALE_DRAFT_ROWS = stale_draft_placeholders.patches(
    {
        "vllm 0.19.0, 0.19.1, 0.20.0, 0.20.1, 0.20.2, 0.21.0 (vllm-ascend 0.19.1rc1, 0.20.2rc1, 0.21.0rc1)": (
            "c8cdcefe001f6eb2"
        ),
        # prompt-embeds refresh of is_token_ids moved
        "vllm 0.22.0, 0.22.1, 0.23.0 (vllm-ascend 0.22.1rc1, 0.23.0rc1, 0.23.0, 0.23.0.post1)": "b035d0848bd86e2d",
        # the previous proposal's width is prev_num_spec_tokens (= _draft_token_ids.shape[1])
        "vllm 0.24.0, 0.25.0, 0.25.1 (vllm-ascend 0.24.0rc1, 0.25.1rc1)": "887b8f1b462d5be5",
    },
    {
        "vllm 0.19.0, 0.19.1 (vllm-ascend 0.19.1rc1)": "9425e7ced1a19cb5",
        "vllm 0.20.0, 0.20.1, 0.20.2 (vllm-ascend 0.20.2rc1)": "7052f42ae2f49b7b",
        "vllm 0.21.0, 0.22.0, 0.22.1, 0.23.0, 0.24.0, 0.25.0, 0.25.1 (vllm-ascend 0.21.0rc1, 0.22.1rc1, 0.23.0rc1, "
        "0.23.0, 0.23.0.post1, 0.24.0rc1, 0.25.1rc1)": "4ad52348e5126401",
    },
    release="vLLM 0.19.0-0.24.0 (vllm-ascend 0.19.1rc1-0.24.0rc1, whose NPUModelRunner has a _preprocess of its own) "
    "guard nothing: the `-1` is an out-of-range index of the target's embedding, a crash wherever the embedding "
    "does not mask it (vllm-ascend's VocabParallelEmbedding masks out-of-range ids only with the vocabulary "
    "split, TP > 1). vLLM 0.25.0 / 0.25.1 (vllm-ascend 0.25.1rc1, whose NPUModelRunner inherits vLLM's "
    "_preprocess) clamp it to token 0 before the embedding (vllm#47029, GPUModelRunner._preprocess) and reject a "
    "negative draft (vllm#46533, vllm/v1/sample/rejection_sampler.py; vllm-ascend's AscendRejectionSampler "
    "rejects it too): no crash, wasted verification, one token instead of up to k + 1 for that step. The "
    "releases' own zero-bubble path is vLLM's here.",
    not_covered="a runner whose class overrides _prepare_input_ids (310P)",
    also_upstream=("vllm#44734",),
    remove_when="a vLLM release fixes #37159 (none does as of vLLM 0.33.0); the adapter range ends at vllm-ascend "
    "0.26.0rc1, whose native verdict reports it as an advisory",
    forms="The forms differ in unrelated per-request state only (block-table row clearing, logprob and "
    "thinking-budget bookkeeping).",
)

DRAFT_LENGTHS_AT_MAX_MODEL_LEN = draft_seq_lens_max_model_len.patch(
    # 0.19.1rc1 defines the class in eagle_proposer; from 0.20.2rc1 on eagle_proposer re-exports it from
    # llm_base_proposer, and the target resolves to (and fingerprints) that definition.
    "vllm_ascend.spec_decode.eagle_proposer:AscendSpecDecodeBaseProposer",
    {"vllm-ascend 0.19.1rc1": "28fa1aa462c9076b"},
    native_fingerprints={
        # #9221: input_fits_in_drafter skips the drafter (zero drafts) once max_seq_len + k > max_model_len, so the
        # masks below are never reached with a request at the limit (the DP hang of vLLM #44185 is that gate's)
        "vllm-ascend 0.20.2rc1 (#9221)": "5457a7696522bfed",
        # #10147: both masks by seq_lens > max_model_len
        "vllm-ascend 0.21.0rc1 (wheels and sdist)": "36cec64313e15db5",
        "vllm-ascend 0.22.1rc1": "778302f787160dbb",
        "vllm-ascend 0.23.0rc1, 0.23.0, 0.23.0.post1": "5cd73e17c3259d59",
        "vllm-ascend 0.24.0rc1": "80302239d1b129b7",
        "vllm-ascend 0.25.1rc1": "2a5eb9ff8ecc6e66",
    },
    remove_when="vllm-ascend >= 0.20.2rc1 (native there: #9221's drafter gate in 0.20.2rc1, #10147's masks from "
    "0.21.0rc1).",
)

# The EAGLE draft graph's stale sample indices (vllm-ascend #9867 / #10080, in 0.21.0rc1): the fix of adapter
# ascend-0.18. The fix landed in the proposer (_propose, dummy_run: the mla-draft-rope-rows group's targets); the
# runner method wrapped here differs between 0.20.2rc1 and 0.21.0rc1 as well, and its fingerprints from 0.21.0rc1 on
# name the releases that carry the fix.
DRAFT_SAMPLE_INDICES = draft_sample_indices_past_batch.patch(
    {"vllm-ascend 0.19.1rc1": "5254cc2f522b75a5", "vllm-ascend 0.20.2rc1": "b8c35c76869b8e2c"},
    buffer="token_indices_to_sample",
    release_lines="AscendSpecDecodeBaseProposer._propose, 0.19.1rc1 eagle_proposer.py:810, 0.20.2rc1 "
    "llm_base_proposer.py:858; read by _run_merged_draft, :923 / :982",
    remove_when="vllm-ascend >= 0.21.0rc1 (native there: #9867 / #10080 in the proposer).",
    native_fingerprints={
        "vllm-ascend 0.21.0rc1, 0.22.1rc1": "45534bf142b921f9",
        "vllm-ascend 0.23.0rc1, 0.23.0, 0.23.0.post1": "d07e5bb62179c3ee",
        "vllm-ascend 0.24.0rc1": "406ab0b98abbfc5c",
        "vllm-ascend 0.25.1rc1": "ffca59f4c1e00b46",
    },
)

# The decode RoPE rows every draft position shares (MLA / SFA targets): the group of adapter ascend-0.18.
MLA_DRAFT_ROPE_ROWS = mla_draft_rope_rows.patches(
    # 0.19.1rc1 defines the class in eagle_proposer; later releases re-export it there (as for
    # draft-seq-lens-max-model-len above)
    proposer="vllm_ascend.spec_decode.eagle_proposer:AscendSpecDecodeBaseProposer",
    rope_rows={
        "vllm-ascend 0.19.1rc1, 0.20.2rc1, 0.21.0rc1, 0.22.1rc1, 0.23.0rc1, 0.23.0, 0.23.0.post1, 0.24.0rc1, "
        "0.25.1rc1": "d2a862ac42765291",
    },
    propose={
        "vllm-ascend 0.19.1rc1": "686b2087efe3f0f1",
        "vllm-ascend 0.20.2rc1": "348f2ee0c94e475b",
        "vllm-ascend 0.21.0rc1 (wheels and sdist)": "35ab91194fb96ac4",
        "vllm-ascend 0.22.1rc1": "dd290c2141c0600e",
        "vllm-ascend 0.23.0rc1, 0.23.0, 0.23.0.post1": "03ee9b68650148ad",
        "vllm-ascend 0.24.0rc1": "a45124fb4f1c5261",
        "vllm-ascend 0.25.1rc1": "a6f4138543d70728",
    },
    dummy_run={
        "vllm-ascend 0.19.1rc1": "69b6389d635827fd",
        "vllm-ascend 0.20.2rc1": "7eb1eaa2b41bc335",
        "vllm-ascend 0.21.0rc1 (wheels and sdist)": "a304e6e60e5e48f7",
        "vllm-ascend 0.22.1rc1": "95cd8318dd9bfe58",
        "vllm-ascend 0.23.0rc1, 0.23.0, 0.23.0.post1": "c238fd8ad68d0f12",
        "vllm-ascend 0.24.0rc1": "54eccea7d1048258",
        "vllm-ascend 0.25.1rc1": "5788e16c40a15cac",
    },
    remove_when="a vllm-ascend release gives each draft position RoPE rows of its own (none of this adapter's range "
    "does: spec_decode/llm_base_proposer.py builds every position first, mla_v1.py returns views of _cos_mla through "
    "0.25.1rc1)",
)

# reset_prefix_cache(reset_running_requests=True) under async scheduling: vLLM-side targets, one fingerprint per form
# from the wheel of every vLLM from 0.19.0 to 0.25.1 (the va019 / va023 / va025 contract tests read the installed one).
# Up to 0.21.0 the release flags every preempted request (as 0.18); from 0.22.0 it counts placeholder units (#42117);
# from 0.25.0 its loop skips a marked request (#46066: the update wrapper native there).
_VLLM_0_19_0_21 = "vllm 0.19.0, 0.19.1, 0.20.0, 0.20.1, 0.20.2, 0.21.0 (vllm-ascend 0.19.1rc1, 0.20.2rc1, 0.21.0rc1)"
_VLLM_0_22_0_25 = (
    "vllm 0.22.0, 0.22.1, 0.23.0, 0.24.0, 0.25.0, 0.25.1 (vllm-ascend 0.22.1rc1, 0.23.0rc1, 0.23.0, 0.23.0.post1, "
    "0.24.0rc1, 0.25.1rc1)"
)
RESET_PREFIX_CACHE_IN_FLIGHT = reset_prefix_cache_in_flight.patches(
    {_VLLM_0_19_0_21: "cc9382f6e9070ec6", _VLLM_0_22_0_25: "dcec71f68792268b"},
    {
        "vllm 0.19.0, 0.19.1 (vllm-ascend 0.19.1rc1)": "4f0e2806658988ba",
        "vllm 0.20.0, 0.20.1, 0.20.2 (vllm-ascend 0.20.2rc1)": "251e00a01788547d",
        "vllm 0.21.0 (vllm-ascend 0.21.0rc1)": "edddfb8a39b57ae4",
        "vllm 0.22.0, 0.22.1, 0.23.0 (vllm-ascend 0.22.1rc1, 0.23.0rc1, 0.23.0, 0.23.0.post1)": "16c25d1b10989a65",
        "vllm 0.24.0 (vllm-ascend 0.24.0rc1)": "0320b7293780aacf",
    },
    {
        "vllm-ascend 0.19.1rc1": "408e81e9b3142407",
        "vllm-ascend 0.20.2rc1": "fd03b19d62984171",
        "vllm-ascend 0.21.0rc1 (wheels)": "5816544a96207088",
        "vllm-ascend 0.21.0rc1 (sdist), 0.22.1rc1": "8028f188252b92ad",
        "vllm-ascend 0.23.0rc1, 0.24.0rc1": "d3de3540f3b8b64d",
        "vllm-ascend 0.23.0, 0.23.0.post1": "207883ec6b4dc45c",
    },
    update_native={"vllm 0.25.0, 0.25.1 (vllm-ascend 0.25.1rc1; #46066)": "e8c0d2845f7528cf"},
    recompute_update_native={"vllm-ascend 0.25.1rc1 (#46066)": "1c76950a7ba00a66"},
    release_lines="marks: vLLM 0.19.0 scheduler.py:1887 (flag), 0.22.0 :1923, 0.25.0 :2223 (count); subtracts: "
    "0.19.0 :1379-1383, 0.24.0 :1564-1568, vllm-ascend 0.19.1rc1 core/recompute_scheduler.py:890, 0.24.0rc1 :1016; "
    "drops: async_scheduler.py:40-44 (0.19.0-0.22.0), :54-58 (0.24.0, 0.25.0)",
    remove_when="a vLLM release marks only the outputs in flight (vLLM #49620 is open) and the adapter's releases "
    "run it; the adapter range ends at vllm-ascend 0.26.0rc1",
)

PATCHES = (
    SLOT_MAPPING_KERNEL,
    VALID_COUNT_COPY_ORDER,
    VALID_COUNT_INT64,
    SEQ_LENS_CPU_UNPADDED,
    SEQ_LENS_CPU_PREPARE_INPUTS_PADDED,
    STALE_DRAFT_PLACEHOLDERS,
    STALE_DRAFT_ROWS,
    DRAFT_LENGTHS_AT_MAX_MODEL_LEN,
    DRAFT_SAMPLE_INDICES,
    *MLA_DRAFT_ROPE_ROWS,
    *RESET_PREFIX_CACHE_IN_FLIGHT,
)

# Known bugs of releases in range that zb-patch does not fix: one WARNING where the installed code has them.
ADVISORIES = (
    Advisory(
        id="dcp-cp-builder-seq-lens-cpu",
        target="vllm_ascend.worker.model_runner_v1:NPUModelRunner._build_attention_metadata",
        affected={"vllm-ascend 0.19.1rc1": "6676eefcd28a4cbd"},
        message="with decode context parallelism (DCP > 1) + async scheduling + speculative decoding, "
        "this runner builds attention metadata with seq_lens_cpu=None (only _seq_lens_cpu is set) and "
        "AscendAttentionCPMetadataBuilder.build subscripts seq_lens_cpu: TypeError on the first step. "
        "zb-patch carries #8749's unpadded()/prepare_inputs_padded part, not its CP-builder part (that "
        "module is imported only when CP is on, and a patch set waits for every target module). Upgrade "
        "to vllm-ascend >= 0.20.2rc1, or run DCP without async scheduling.",
        upstream=("vllm-ascend#8749",),
    ),
    Advisory(
        id="pd-decode-placeholders-in-forward",
        target="vllm_ascend.worker.model_runner_v1:NPUModelRunner.execute_model",
        affected={"vllm-ascend 0.19.1rc1": "68a42c0f1d53526a", "vllm-ascend 0.20.2rc1": "2e3aa11fa8da32ee"},
        message="PD disaggregation with MTP on the decode node (the recompute scheduler): each new request's first "
        "step schedules [-1] * k draft placeholders (core/recompute_scheduler.py), and this runner passes them to "
        "the model's forward as input ids: an out-of-range embedding index, the NPU's GatherV2 fault at TP = 1 "
        "(vllm-ascend #10305). zb-patch does not carry the fix (#10307 sanitises the forward's ids after the "
        "spec-decode metadata; in 0.21.0rc1 and later): upgrade to vllm-ascend >= 0.21.0rc1. Other deployments "
        "are not affected.",
        upstream=("vllm-ascend#10307", "vllm-ascend#10305"),
    ),
    Advisory(
        id="stale-accepted-counts",
        target="vllm_ascend.worker.model_runner_v1:NPUModelRunner._prepare_inputs",
        affected={
            "vllm-ascend 0.19.1rc1": "f1af3c1294ee7238",
            "vllm-ascend 0.20.2rc1": "e41ce44ffa1ca1d6",
            "vllm-ascend 0.21.0rc1 (wheels)": "e48a9922e9c25ad9",
            "vllm-ascend 0.21.0rc1 (sdist), 0.22.1rc1": "39dbbacd0f41023f",
            "vllm-ascend 0.23.0rc1, 0.24.0rc1": "1fcb593c20e02607",
            "vllm-ascend 0.25.1rc1": "e7d04da1543e2abc",
        },
        message="hybrid (Mamba/GDN) models with MTP/EAGLE under async scheduling: _prepare_inputs remaps the previous "
        "step's accepted-token counts from InputBatch rows (num_accepted_tokens_cpu) that add_request() and "
        "condense() may already have reused, so a request can use another request's count as its state-copy "
        "offset: repeated, dropped or garbled tokens under load (vllm-ascend #13863). zb-patch does not "
        "carry the fix (#13865 keeps the counts in runner-owned buffers; its backport needs a per-vLLM-form "
        "override of _update_states_after_model_execute). #13865 is in 0.23.0 / 0.23.0.post1 and again from "
        "0.27.1rc1 on (0.24.0rc1-0.26.0rc1 lack it): upgrade to one of those, "
        "or disable async scheduling for hybrid models with speculative decoding. Other models are not "
        "affected.",
        upstream=("vllm-ascend#13865", "vllm-ascend#13863"),
    ),
    # vLLM-side target: one fingerprint per form, read from the sdist of every vLLM from 0.19.0 to 0.25.1 (vllm-ascend
    # X.Y.ZrcN runs on vLLM X.Y.*); the va019 / va023 / va025 contract tests read the installed one.
    min_tokens_draft_placeholders.advisory(
        {
            "vllm 0.19.0, 0.19.1, 0.20.0, 0.20.1, 0.20.2": "bb69005e6cd0712f",
            "vllm 0.21.0": "2dd121af1b133430",
            "vllm 0.22.0, 0.22.1, 0.23.0, 0.24.0, 0.25.0, 0.25.1": "c6e56a5fb0956d14",
        },
        "vLLM 0.19.0-0.25.1 (vllm-ascend 0.19.1rc1-0.25.1rc1 run vLLM's _update_states)",
    ),
)

GUARDS = (
    Guard(
        "vllm_ascend.worker.block_table:BlockTable.__init__",
        {
            "vllm-ascend 0.19.1rc1": "ccce40b9beff96c6",
            "vllm-ascend 0.20.2rc1": "0522c803840a1ba3",
            "vllm-ascend 0.21.0rc1 (wheels)": "eadb2cdfa4acea78",
            "vllm-ascend 0.21.0rc1 (sdist), 0.22.1rc1": "0602c50a9e7c505e",
            "vllm-ascend 0.23.0rc1, 0.24.0rc1": "af34c0a04448d6da",
            "vllm-ascend 0.23.0, 0.23.0.post1": "52eb7caec856b962",
            "vllm-ascend 0.25.1rc1": "24f501dfddb41e64",
        },
        "the kernel patch reads the attributes this constructor sets (block_table, slot_mapping, block sizes, CP ranks)",
    ),
    Guard(
        "vllm_ascend.worker.block_table:MultiGroupBlockTable.compute_slot_mapping",
        {
            "vllm-ascend 0.19.1rc1": "7f076a90095a770e",
            "vllm-ascend 0.20.2rc1, 0.21.0rc1 (wheels)": "4d2ebb1d7af18c41",
            "vllm-ascend 0.21.0rc1 (sdist), 0.22.1rc1, 0.23.0rc1, 0.23.0, 0.23.0.post1, 0.24.0rc1, 0.25.1rc1": "dd72832c4b9fd8bd",
        },
        "dispatches to each group's BlockTable.compute_slot_mapping (every KV-cache group gets the patched kernel)",
    ),
    reset_prefix_cache_in_flight.guard({_VLLM_0_19_0_21: "7f6efa0565f00bd5", _VLLM_0_22_0_25: "f7a5f73e3856bdae"}),
)

ADAPTER = Adapter(
    id="ascend-0.19-0.25",
    title="vllm-ascend 0.19.1rc1-0.25.1rc1 + vLLM 0.19-0.25 (zero-bubble present; generic slot-mapping kernel)",
    vllm_ascend=ASCEND_RANGES["ascend-0.19-0.25"],
    vllm=((0, 19, 0), (0, 26)),
    zero_bubble_ids=("slot-mapping-kernel",),
    patch_set=PatchSet("ascend-0.19-0.25", PATCHES, GUARDS, ADVISORIES),
    preload=("vllm_ascend.platform", "vllm_ascend.worker.worker"),
    releases=(
        "0.19.1rc1",
        "0.20.2rc1",
        "0.21.0rc1",
        "0.22.1rc1",
        "0.23.0rc1",
        "0.23.0",
        "0.23.0.post1",
        "0.24.0rc1",
        "0.25.1rc1",
    ),
    notes="each release runs on the vLLM of the same number (0.23.0.post1: 0.23.0; 0.24.0rc1: 0.24.0; 0.25.1rc1: "
    "0.25.1); 0.23.0.post1 (sdist only) has identical targets to 0.23.0.",
)
