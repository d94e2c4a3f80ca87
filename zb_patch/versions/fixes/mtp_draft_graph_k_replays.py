"""mtp-draft-graph-k-replays (vllm-ascend 0.18.0; upstream's form is #6860, 0.19.1rc1): with synchronous scheduling the
MTP drafter's FULL graph holds one draft pass and is replayed k times per task-group update, so at k >= 2 its captured
event waits outnumber the update's records. Adapter ascend-0.18; spec: :func:`patch`.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping

from ...registry import HOST, Patch, RestsOn

ID = "mtp-draft-graph-k-replays"


def make_init(original: Callable) -> Callable:
    """Wrap ``SpecDecodeBaseProposer.__init__``: after the release's body, an MTP proposer with k >= 2 that the release
    gave a FULL draft graph (``use_cuda_graph`` on a FULL cudagraph mode: synchronous scheduling) drafts eagerly, as
    the release decides under async scheduling: ``use_cuda_graph`` off, and ``maybe_eager_context`` as the release
    sets it for a proposer without graphs. ``load_model`` then wraps nothing, ``dummy_run`` and ``_propose`` run the
    draft passes with mode NONE. Parallel drafting (one pass per proposal) and k = 1 keep the graph."""

    @functools.wraps(original)
    def __init__(proposer, vllm_config, *args, **kwargs):
        original(proposer, vllm_config, *args, **kwargs)
        if (
            proposer.method == "mtp"
            and proposer.num_speculative_tokens >= 2
            and not proposer.parallel_drafting  # set by vLLM's EagleProposer.__init__, which the release calls
            and proposer.use_cuda_graph
            and vllm_config.compilation_config.cudagraph_mode.has_full_cudagraphs()
        ):
            proposer.use_cuda_graph = False
            release = importlib.import_module(original.__module__)
            if release.enable_sp(vllm_config):
                proposer.maybe_eager_context = release._maybe_eager_context(vllm_config)

    return __init__


def patch(fingerprints: Mapping[str, str], *, remove_when: str) -> Patch:
    """The fix for an adapter on vllm-ascend 0.18 (``fingerprints`` of ``SpecDecodeBaseProposer.__init__``)."""
    return Patch(
        id=ID,
        rests_on=RestsOn(
            HOST,
            "a start-up decision of the proposer (use_cuda_graph, maybe_eager_context), set to what the release "
            "decides for MTP under async scheduling before load_model reads it; no device op",
        ),
        target="vllm_ascend.spec_decode.eagle_proposer:SpecDecodeBaseProposer.__init__",
        make=make_init,
        fingerprints=fingerprints,
        why="vllm-ascend 0.18.0, MTP, k >= 2, FULL cudagraph mode, async scheduling off: the proposer captures the MTP "
        "module alone in a FULL graph (spec_decode/eagle_proposer.py:136-142, :326-333; MTP drafts eagerly under async "
        "scheduling), replays it k times per proposal (:770, :913), then updates its task groups once, with draft step "
        "0's lengths (:737; attention_v1.py:507-527, mla_v1.py:801-835). CANN pairs each captured ExternalEvent wait "
        "with one record: the draft stream waits for a later proposal's record and replays run with another step's "
        "parameters.",
        how="Wrapper. After the release's body, for method mtp, k >= 2, no parallel drafting, a FULL cudagraph mode "
        "and use_cuda_graph on: use_cuda_graph off and, with sequence parallelism, the release's _maybe_eager_context, "
        "as the release sets both under async scheduling. The drafter drafts eagerly (no draft graph, no draft "
        "task-group update); the target's graphs are unchanged. Host only, at start-up. Left to the release: k = 1, "
        "parallel drafting, EAGLE / EAGLE3, PIECEWISE-only modes. With or without zero-bubble (only synchronous "
        "scheduling has the graph).",
        upstream=("vllm-ascend#6860",),
        remove_when=remove_when,
    )
