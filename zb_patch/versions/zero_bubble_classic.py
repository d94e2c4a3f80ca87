"""The specs of the zero-bubble patches vllm-ascend 0.13 and 0.18 share (:func:`patches`): the wrappers of
:class:`~zb_patch.versions.npu_runner.ZeroBubble` around the methods both releases have alike. Where the correction
runs (the release's input-preparation hook) differs, so each adapter declares those specs itself and hands them in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..registry import Patch, RestsOn
from .npu_runner import BACKUP_STAGING_ONE_STREAM, ZERO_BUBBLE_BACKPORT, ZeroBubble

UPSTREAM = ("vllm#32951", "vllm-ascend#7640", "vllm-ascend#8461", "vllm-ascend#10506")
_RUNNER = "vllm_ascend.worker.model_runner_v1:NPUModelRunner"
_GPU_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"


def patches(
    zero_bubble: ZeroBubble,
    *,
    fingerprints: Mapping[str, Mapping[str, str]],
    proposer: str,
    input_preparation: tuple[Patch, ...],
    remove_when: str,
) -> tuple[Patch, ...]:
    """The zero-bubble group of an adapter in its order: ``_update_states``, the adapter's ``input_preparation``
    specs, ``execute_model``, ``_copy_valid_sampled_token_count``, the proposer's ``prepare_next_token_ids_padded``,
    ``initialize_kv_cache``. ``fingerprints``: the release's, by method name; ``proposer``: the proposer class
    (``"module:Class"``) that defines ``prepare_next_token_ids_padded``."""
    zb = zero_bubble
    tag = "zb" + zb.release.replace(".", "")  # zb013-..., zb018-...
    group = f"zero-bubble-{zb.release}"

    def spec(
        name: str,
        target: str,
        make: Callable,
        why: str,
        how: str,
        upstream: tuple[str, ...] = UPSTREAM,
        rests_on: RestsOn = ZERO_BUBBLE_BACKPORT,
    ) -> Patch:
        return Patch(
            id=f"{tag}-{name}",
            rests_on=rests_on,
            group=group,
            target=target,
            make=make,
            fingerprints=fingerprints[target.rpartition(".")[2]],
            why=why,
            how=how,
            upstream=upstream,
            remove_when=remove_when,
        )

    return (
        spec(
            "optimistic-update-states",
            f"{_GPU_RUNNER}._update_states",
            zb.make_update_states,
            "The release's _update_states (vLLM 0.13 / 0.18) calls _get_valid_sampled_token_count() in its middle: the "
            "host blocks on step N's accepted-draft counts (event.synchronize) before it can prepare step N+1, so the "
            "NPU idles while the host prepares every step.",
            "Wrapper. For the duration of the release's call, _get_valid_sampled_token_count answers from the host with "
            "optimistic counts (drafts scheduled + 1 at every previous row): the release keeps the scheduler's "
            "optimistic num_computed_tokens and appends one output placeholder per draft, as vLLM 0.19 does. The rows "
            "it looks up are recorded as this step's corrections (request, drafts, previous row). Falls through "
            "unchanged when zero-bubble is not active on the runner. On vllm-ascend 0.13 it first waits on "
            "prepare_inputs_event (vLLM's synchronize_input_prep wait, which vllm-ascend 0.13 never makes: the classic "
            "sync ordered the reused host buffers).",
        ),
        *input_preparation,
        spec(
            "deferred-correction",
            f"{_RUNNER}.execute_model",
            zb.make_execute_model,
            "After _update_states req_state.num_computed_tokens is optimistic and output_token_ids ends in a -1 per "
            "rejected draft, which MinTokensLogitsProcessor counts (its mask ends up to k tokens early); both must be "
            "exact before sample_tokens.",
            "Wrapper. After the release's execute_model returned (the forward is launched; also after its early "
            "returns), subtract the rejected drafts from each corrected request's num_computed_tokens, with the counts "
            "the host already waited for during input preparation (vLLM 0.19's deferred "
            "correct_spec_decode_token_counts closure), and trim their placeholders off its output_token_ids (to its "
            "length before _update_states plus the accepted drafts: classic async's list). A request the release's "
            "refresh_metadata dropped from MinTokensLogitsProcessor because of those placeholders (optimistic length "
            ">= min_tokens > exact length) is added again at its row with a BatchUpdate, the processor's own "
            "interface (its usual non-blocking host-to-device copy of the mask indices). No wait. vLLM 0.19+ keeps the "
            "placeholders until the next _update_states (gpu_model_runner.py:1310-1311, :1447, :1463-1491 in vLLM "
            "0.23): the same over-count, not fixed there.",
            ("vllm#32951",),
        ),
        spec(
            "device-valid-count",
            f"{_GPU_RUNNER}._copy_valid_sampled_token_count",
            zb.make_copy_valid_sampled_token_count,
            "The device correction of the next step needs this step's valid sampled counts on the device; the release "
            "only copies them to the host.",
            "Wrapper. After the release's copy (side stream, event; vllm-ascend 0.13 captures the default stream before "
            "the side-stream context, so its copy waits for the sampler), keep a reference to the device count tensor "
            "(int64 from the Ascend proposer; the host buffer is int64 too, so the D2H copy has no dtype cast). "
            "Consumed once by the next step's correction.",
            ("vllm#32951", "vllm-ascend#8766", "vllm-ascend#10205"),
        ),
        spec(
            "backup-token-staging",
            f"{proposer}.prepare_next_token_ids_padded",
            zb.make_prepare_next_token_ids_padded,
            "The drafter's backup tokens are written to a reused pinned buffer and copied to the device non-blocking. "
            "The classic path waited every step on an event recorded after that copy; without that wait the next step "
            "can rewrite the buffer while this step's copy is still queued (found by zb-patch's engine-loop harness; "
            "docs/selftest.md).",
            "Wrapper (on vllm-ascend 0.13 MtpProposer inherits the method). Alternate two backup buffers between calls; "
            "a buffer is rewritten two steps later, after the wait on an input-preparation event recorded behind its "
            "copy (synchronize_input_prep on vllm-ascend 0.18, the _update_states wrapper on 0.13). The backup index "
            "itself is unchanged: it reads the metadata's seq_lens_cpu, which the correction makes exact (vLLM #38098 "
            "cannot occur).",
            ("vllm#38098", "vllm#38556"),
            rests_on=BACKUP_STAGING_ONE_STREAM,
        ),
        spec(
            "compile-kernels-at-start",
            f"{_RUNNER}.initialize_kv_cache",
            zb.make_initialize_kv_cache,
            "Triton compiles zb-patch's token-count and slot-mapping kernels at their first launch, which is inside the "
            "first corrected step of the first request: a stall of that request (triton-ascend compiles far slower than "
            "Triton on CUDA), and again in every process whose Triton cache is empty (a fresh container).",
            "Wrapper. After the release's initialize_kv_cache (the block tables are final), decide zero-bubble's "
            "activation on the runner and, when active, launch the device correction's kernels once on no request: the "
            "same launchers, constants and argument types as a corrected step, so the first step finds them compiled. "
            "The launches write only padding (seq_lens.gpu, slot_mapping.gpu), which every step rewrites first.",
            ("vllm#32951",),
        ),
    )
