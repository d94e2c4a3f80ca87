"""min-tokens-draft-placeholders: an advisory, no patch (vLLM 0.19.0 - 0.33.0; zb-patch's own zero-bubble on
vllm-ascend 0.13 / 0.18 trims the placeholders, ``ZeroBubble.trim_placeholders``). Used by adapter ascend-0.19-0.25 and
the native releases (``versions.native``), each with its vLLMs' fingerprints.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...registry import Advisory

# vLLM's GPUModelRunner._update_states under async scheduling + spec decode (every vLLM from 0.19.0 to 0.33.0, read from
# the sdists, and vLLM main at 000fc94b): `req_state.output_token_ids.extend([-1] * optimistic_num_accepted)`
# (vLLM 0.23.0 gpu_model_runner.py:1311), then `self.input_batch.refresh_metadata()` (:1447), whose
# MinTokensLogitsProcessor.update_state counts len(output_token_ids) (logits_processor/builtin.py); the deferred
# correct_spec_decode_token_counts closure (:1463-1491) corrects num_computed_tokens only, and the rejected drafts'
# placeholders are deleted by the next step's _update_states (:1356-1360). vllm-ascend's NPUModelRunner runs it (no
# override through 0.20.2rc1, super() after a rewind guard from 0.21.0rc1 on). One text for the native releases and
# adapter ascend-0.19-0.25 (which names its own vLLMs and fingerprints).
UPSTREAM = ("vllm#32951", "vllm#26317")


def advisory(affected: Mapping[str, str], on: str) -> Advisory:
    """The min-tokens-draft-placeholders advisory for the vLLM releases ``on`` names (``affected``: their
    ``GPUModelRunner._update_states`` fingerprints)."""
    return Advisory(
        id="min-tokens-draft-placeholders",
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states",
        affected=affected,
        message="min_tokens + async scheduling + speculative decoding: MinTokensLogitsProcessor counts "
        "len(output_token_ids) in refresh_metadata, after _update_states appended one '-1' per draft: the stop-token "
        "mask is lifted up to k positions early, so a stop or EOS token can be "
        "sampled within the first min_tokens tokens and stays in the output (vllm#26317); only that mask is affected. "
        f"On {on}. zb-patch fixes it for vllm-ascend 0.13.0 / 0.18.0 and applies nothing here. Avoid: for requests "
        "that rely on min_tokens, run without async scheduling or without speculative decoding.",
        upstream=UPSTREAM,
    )
