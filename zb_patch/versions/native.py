"""What makes a vllm-ascend release "native": its installed code, never its version number.

Past the newest adapter's range zb-patch has nothing to apply, but only when the installed release really ships
what the adapters carry. That is decided by fingerprint (the normalised-AST hash the adapters use) of the
release's own source files, read from disk without importing anything (selection runs in every process, before
fork, and must stay cheap):

* slot mapping: ``BlockTable.compute_slot_mapping`` is a recorded form that launches vllm-ascend's own
  Ascend-shaped kernel, and the ``_compute_slot_mapping_kernel`` that ``block_table`` binds is a recorded form of
  that kernel (re-exported from ``vllm_ascend.ops.triton.compute_slot_mapping``; in 0.24.0rc1 / 0.25.1rc1 the
  same name is vLLM's generic kernel, absent from the vllm-ascend tree);
* zero-bubble async scheduling + spec decode: the runner's optimistic CPU seq-lens bookkeeping
  (``_prepare_inputs``, ``_correct_optimistic_seq_lens_cpu`` and the helper it calls) is a recorded form.

Any target absent or of an unrecorded form -> the release is unknown: nothing is applied and the refusal names
every check (``zb-patch doctor``, one log line). Forms were read from the PyPI artifacts of :data:`RELEASES`
(tests/sources recomputes them; docs/releases/native.md lists them per release).

:data:`ADVISORIES`: known upstream bugs the native releases still have (zb-patch carries their fixes only inside the
adapters' ranges). ``zb-patch doctor`` checks them on a native verdict, from the installed vLLM's source files
(fingerprints, nothing imported), and lists each with its upstream issue.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Mapping

from ..registry import Advisory
from .fixes import min_tokens_draft_placeholders

SLOT_MAPPING = "slot mapping"
ZERO_BUBBLE = "zero-bubble"

BT = "vllm_ascend.worker.block_table"
RUNNER = "vllm_ascend.worker.model_runner_v1:NPUModelRunner"


@dataclasses.dataclass(frozen=True)
class NativeForm:
    concern: str
    target: str
    fingerprints: Mapping[str, str]  # release label -> fingerprint of the form that release ships


FORMS: tuple[NativeForm, ...] = (
    NativeForm(
        SLOT_MAPPING,
        f"{BT}:BlockTable.compute_slot_mapping",
        {
            "vllm-ascend 0.26.0rc1, 0.27.1rc1": "5250ceb1fbacc2b0",
            "vllm-ascend 0.28.0rc1": "f135df3afd3916ef",
            "vllm-ascend 0.29.0rc1, 0.30.0rc1, 0.30.0rc2": "bbc3c06f3fe997a9",
        },
    ),
    NativeForm(
        SLOT_MAPPING,
        f"{BT}:_compute_slot_mapping_kernel",
        {
            "vllm-ascend 0.26.0rc1, 0.27.1rc1": "49b4d57f338f45be",
            "vllm-ascend 0.28.0rc1, 0.29.0rc1, 0.30.0rc1, 0.30.0rc2": "e5131bc402724f50",
        },
    ),
    NativeForm(
        ZERO_BUBBLE,
        f"{RUNNER}._prepare_inputs",
        {
            "vllm-ascend 0.26.0rc1": "e7d04da1543e2abc",
            "vllm-ascend 0.27.1rc1": "dcfe97b5eaf78b71",
            "vllm-ascend 0.28.0rc1": "ccf7394137186f18",
            "vllm-ascend 0.29.0rc1": "911158504153eb11",
            "vllm-ascend 0.30.0rc1, 0.30.0rc2": "a19e044a1a5587cb",
        },
    ),
    NativeForm(
        ZERO_BUBBLE,
        f"{RUNNER}._correct_optimistic_seq_lens_cpu",
        {
            "vllm-ascend 0.26.0rc1, 0.27.1rc1, 0.28.0rc1, 0.29.0rc1, 0.30.0rc1, 0.30.0rc2": "29fe0ebc8096798a",
        },
    ),
    NativeForm(
        ZERO_BUBBLE,
        "vllm_ascend.spec_decode.utils:correct_optimistic_seq_lens_cpu",
        {
            "vllm-ascend 0.26.0rc1, 0.27.1rc1, 0.28.0rc1, 0.29.0rc1, 0.30.0rc1, 0.30.0rc2": "7db625ecada16444",
        },
    ),
)

# vLLM's own guards against a '-1' draft placeholder, by vLLM release (read from each release's sdist; both arrive in
# vLLM 0.25.0, neither is in 0.19.0 .. 0.24.0):
# * vllm#47029: GPUModelRunner._preprocess (vllm/v1/worker/gpu_model_runner.py) clamps the step's input ids to >= 0
#   before the embedding when a speculative config is set (`self.input_ids.gpu[:num_input_tokens].clamp_(min=0)`);
# * vllm#46533: the rejection kernels of vllm/v1/sample/rejection_sampler.py reject a negative draft id
#   (rejection_greedy_sample_kernel's synthetic branch `and draft_token_id >= 0`, rejection_random_sample_kernel
#   `if draft_token_id < 0: accepted = False`).
# The draft ids the rejection sampler verifies are gathered from the input ids in _prepare_inputs, before the clamp:
# with both guards a stale placeholder is embedded as token 0 and its draft rejected (wasted verification, tokens
# unchanged); without #47029 the '-1' reaches the embedding as an out-of-range index.
PLACEHOLDER_GUARDS: Mapping[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("0.19.0", "0.19.1", "0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0"), ()
    ),
    **dict.fromkeys(
        ("0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0"), ("vllm#46533", "vllm#47029")
    ),
}

# Known bugs of the native releases zb-patch does not fix there (the adapters that carry a fix say so in its spec).
# Affected fingerprints of vLLM targets: read from the sdists of the vLLM releases the native vllm-ascend releases pair
# with (vllm-ascend X.Y.ZrcN runs on vLLM X.Y.*).
ADVISORIES: tuple[Advisory, ...] = (
    Advisory(
        id="stale-draft-placeholders",
        target="vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_input_ids",
        affected={
            "vllm 0.26.0, 0.27.0, 0.27.1": "887b8f1b462d5be5",
            "vllm 0.28.0, 0.29.0, 0.30.0": "080b9baafd67775e",
        },
        message="async scheduling + speculative decoding: a request that holds '-1' draft placeholders and is not "
        "scheduled for a step (vLLM's max_model_len clamp on the optimistic count does that to a request at the "
        "limit) comes back with them, and _prepare_input_ids replaces drafts only for rows of the previous step's "
        "batch. On vLLM 0.26.0, 0.27.0, 0.27.1, 0.28.0, 0.29.0 and 0.30.0 (every vLLM the native releases pair with) "
        "that costs acceptance, not a crash: GPUModelRunner._preprocess clamps the '-1' to token 0 before the "
        "embedding (vllm#47029; vllm-ascend's NPUModelRunner inherits it) and the rejection sampler rejects a "
        "negative draft (vllm#46533 in vLLM's kernels; vllm-ascend's AscendRejectionSampler rejects it too), so the "
        "request's drafts of that step are verified for nothing: wasted verification, one token instead of up to "
        "k + 1 for that step, the tokens themselves unchanged. zb-patch fixes it for vllm-ascend 0.13.0-0.25.1rc1 "
        "(patch stale-draft-placeholders) but applies nothing to native releases. Avoid: leave headroom below "
        "max_model_len (requests whose prompt + max_tokens stay under max_model_len - k), or run speculative "
        "decoding without async scheduling.",
        upstream=("vllm#37159", "vllm#36906", "vllm#44734", "vllm#43434", "vllm#47029", "vllm#46533"),
    ),
    Advisory(
        id="reset-prefix-cache-in-flight",
        target="vllm.v1.core.sched.scheduler:Scheduler.reset_prefix_cache",
        # the placeholder-count form of vLLM 0.22.0-0.25.1 (adapter ascend-0.19-0.25's patch replaces it there)
        affected={"vllm 0.26.0": "dcec71f68792268b"},
        message="reset_prefix_cache(reset_running_requests=True) (LLM.reset_prefix_cache, /reset_prefix_cache, "
        "pause_scheduler(clear_cache=True); weight updates, sleep) under async scheduling + speculative decoding: "
        "vLLM 0.26.0 marks each running request to drop as many outputs as it has output placeholders (1 + drafts for "
        "its one output in flight), so the first outputs of its resumed life are dropped too: tokens missing from the "
        "stream (vllm#49620). zb-patch fixes it for vllm-ascend 0.13.0-0.25.1rc1 (patch reset-prefix-cache-in-flight) "
        "but applies nothing to native releases; vLLM 0.27.0 counts the stale tokens of each output in flight instead. "
        "Avoid: upgrade to vllm-ascend >= 0.27.1rc1, or reset the prefix cache only when no request is running.",
        upstream=("vllm#49620", "vllm#42117"),
    ),
    min_tokens_draft_placeholders.advisory(
        {
            "vllm 0.26.0": "5df6c317c4a4d1a9",
            "vllm 0.27.0, 0.27.1, 0.28.0, 0.29.0": "af021b847899669d",
            "vllm 0.30.0": "2eb2df8682212b24",
        },
        "vLLM 0.26.0, 0.27.0, 0.27.1, 0.28.0, 0.29.0 and 0.30.0 (every vLLM the native releases pair with)",
    ),
)


@dataclasses.dataclass(frozen=True)
class AdvisoryCheck:
    id: str
    target: str
    fingerprint: str | None  # None: absent from the tree
    matched: str | None  # label of the affected form it equals; None: not affected (or an unrecorded form)
    message: str
    upstream: tuple[str, ...]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_advisories(vllm_root: str | None) -> tuple[AdvisoryCheck, ...]:
    """Every native advisory against the vLLM sources under ``vllm_root`` (the directory holding ``vllm/``)."""
    from .source import _parsed, fingerprint_in_tree

    out = []
    for adv in ADVISORIES:
        fp = fingerprint_in_tree(vllm_root, adv.target) if vllm_root else None
        hit = next((lb for lb, v in adv.affected.items() if v == fp), None) if fp else None
        out.append(AdvisoryCheck(adv.id, adv.target, fp, hit, adv.message, adv.upstream))
    _parsed.cache_clear()
    return tuple(out)


def installed_vllm_root() -> str | None:
    """Directory holding the installed ``vllm`` package (found, not imported)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.dirname(os.path.abspath(list(spec.submodule_search_locations)[0]))


# the releases the forms were read from (newest last)
RELEASES: tuple[str, ...] = ("0.26.0rc1", "0.27.1rc1", "0.28.0rc1", "0.29.0rc1", "0.30.0rc1", "0.30.0rc2")


@dataclasses.dataclass(frozen=True)
class Check:
    concern: str
    target: str
    fingerprint: str | None  # None: absent from the tree
    matched: str | None  # label of the recorded form it equals, None: unknown

    @property
    def text(self) -> str:
        found = self.fingerprint or "absent"
        return f"{self.target} {found} ({self.matched or 'no recorded native form'})"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_tree(root: str) -> tuple[Check, ...]:
    """Every native form checked against the vllm-ascend sources under ``root`` (the directory that holds
    ``vllm_ascend/``)."""
    from .source import _parsed, fingerprint_in_tree

    out = []
    for form in FORMS:
        fp = fingerprint_in_tree(root, form.target)
        label = next((lb for lb, v in form.fingerprints.items() if v == fp), None) if fp else None
        out.append(Check(form.concern, form.target, fp, label))
    _parsed.cache_clear()  # selection runs in every server process: keep none of the parsed modules
    return tuple(out)


def installed_root() -> str | None:
    """Directory holding the installed ``vllm_ascend`` package (found, not imported)."""
    try:
        spec = importlib.util.find_spec("vllm_ascend")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.dirname(os.path.abspath(list(spec.submodule_search_locations)[0]))
