#!/usr/bin/env python3
"""Recompute the fingerprint matrix of docs/releases/ascend-0.19-0.25.md from source trees.

Nothing is imported from the trees: every fingerprint is ``zb_patch.versions.fingerprint_in_tree`` (the
same normalised-AST hash the adapters record and ``zb-patch fingerprints`` prints). A cell is ``null``
when the module or the definition is absent from that tree (for a method: not defined *in that class*,
e.g. still inherited from vLLM).

Usage (from a venv with zb-patch installed; S a folder of unpacked release trees, see the .md):

    python docs/releases/fingerprint_matrix.py \\
        --tree v0.19.1rc1=$S/vllm_ascend-v0.19.1rc1:$S/vllm-0.19.1 \\
        ... \\
        --json docs/releases/ascend-0.19-0.25-fingerprints.json --md -

``--tree LABEL=ROOT[:ROOT...]``: each ROOT is a directory that contains ``vllm_ascend/`` and/or ``vllm/``;
a target is looked up in the first ROOT that has its module. Put the release's pinned vLLM tree after
the vllm-ascend tree so the vLLM targets of a column are those of the vLLM that release runs on.
"""

from __future__ import annotations

import argparse
import json
import sys

from zb_patch.registry import split_target
from zb_patch.versions import fingerprint_in_tree, module_file

RUNNER = "vllm_ascend.worker.model_runner_v1:NPUModelRunner"
BT = "vllm_ascend.worker.block_table"
PROP_OLD = "vllm_ascend.spec_decode.eagle_proposer:AscendSpecDecodeBaseProposer"  # <= v0.19.1rc1
PROP_NEW = "vllm_ascend.spec_decode.llm_base_proposer:AscendSpecDecodeBaseProposer"  # >= v0.20.2rc1 (#9251)
GMR = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"

# (group, target, role) -- role: "core" = the function a backport replaces; "also" = touched by the same
# upstream commit but not needed for the fix itself (see the .md); "vllm" = vLLM code the fix interacts with.
TARGETS: list[tuple[str, str, str]] = [
    # the adapter's current guards (slot-mapping kernel patch)
    ("adapter", f"{BT}:BlockTable.compute_slot_mapping", "core"),
    ("adapter", f"{BT}:BlockTable.__init__", "core"),
    ("adapter", f"{BT}:MultiGroupBlockTable.compute_slot_mapping", "core"),
    ("adapter", f"{BT}:BlockTable._compute_pcp_dcp_slot_mapping", "also"),
    ("adapter", f"{BT}:BlockTable.compute_slot_mapping_draft", "also"),
    ("adapter", f"{BT}:MultiGroupBlockTable.__init__", "also"),
    ("adapter", "vllm.v1.worker.block_table:_compute_slot_mapping_kernel", "vllm"),
    ("adapter", "vllm.v1.worker.block_table:BlockTable.compute_slot_mapping", "vllm"),
    # #9456 (P2): copy stream must wait on the *default* stream
    ("#9456", f"{RUNNER}._copy_valid_sampled_token_count", "core"),
    ("#9456", f"{RUNNER}._build_attention_metadata", "also"),
    ("#9456", f"{RUNNER}.execute_model", "also"),
    ("#9456", f"{RUNNER}._dummy_run", "also"),
    ("#9456", f"{GMR}._copy_valid_sampled_token_count", "vllm"),
    ("#9456", f"{GMR}._get_valid_sampled_token_count", "vllm"),
    # #10205 (P1): int64 CPU valid-count buffer (+ revert of #9656's copy placement)
    ("#10205", f"{RUNNER}.__init__", "core"),
    ("#10205", f"{RUNNER}.propose_draft_token_ids", "core"),
    ("#10205", f"{GMR}.__init__", "vllm"),
    # #8749 (P5b): _seq_lens_cpu carried through unpadded() / prepare_inputs(_padded)
    ("#8749", "vllm_ascend.attention.utils:AscendCommonAttentionMetadata.unpadded", "core"),
    ("#8749", f"{PROP_OLD}.prepare_inputs_padded", "core"),
    ("#8749", f"{PROP_NEW}.prepare_inputs_padded", "core"),
    ("#8749", f"{PROP_OLD}.prepare_inputs", "core"),
    ("#8749", f"{PROP_NEW}.prepare_inputs", "core"),
    ("#8749", f"{PROP_OLD}.set_inputs_first_pass", "core"),
    ("#8749", f"{PROP_NEW}.set_inputs_first_pass", "core"),
    ("#8749", f"{PROP_OLD}._propose", "core"),
    ("#8749", f"{PROP_NEW}._propose", "core"),
    ("#8749", "vllm_ascend.attention.context_parallel.attention_cp:AscendAttentionCPMetadataBuilder.build", "core"),
    ("#8749", "vllm.v1.attention.backend:CommonAttentionMetadata", "vllm"),
    ("#8749", "vllm.v1.spec_decode.eagle:SpecDecodeBaseProposer.prepare_inputs_padded", "vllm"),
    ("#8749", "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.prepare_inputs_padded", "vllm"),
    ("#8749", "vllm.v1.spec_decode.utils:extend_all_queries_by_N", "vllm"),
    # #13865 (P3b): accepted-token snapshot kept in runner-owned buffers
    ("#13865", f"{RUNNER}._prepare_inputs", "core"),
    ("#13865", f"{RUNNER}._update_states_after_model_execute", "core"),
    ("#13865", f"{RUNNER}._remap_num_accepted_tokens", "core"),
    ("#13865", f"{RUNNER}._sync_num_accepted_tokens", "core"),
    ("#13865", "vllm_ascend._310p.model_runner_310p:NPUModelRunner310._prepare_inputs", "also"),
    ("#13865", f"{GMR}._update_states_after_model_execute", "vllm"),
    ("#13865", "vllm.v1.worker.gpu_input_batch:InputBatch.condense", "vllm"),
]


def lookup(roots: list[str], target: str) -> str | None:
    module, _ = split_target(target)
    for root in roots:
        if module_file(root, module) is not None:
            return fingerprint_in_tree(root, target, follow_reexports=False)  # "defined in that file"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, metavar="LABEL=ROOT[:ROOT...]")
    ap.add_argument("--json", help="write {target: {label: fingerprint|null}} here ('-' = stdout)")
    ap.add_argument("--md", help="write a markdown table here ('-' = stdout)")
    ap.add_argument("--group", action="append", help="only these groups (adapter, #9456, ...)")
    args = ap.parse_args(argv)

    trees: list[tuple[str, list[str]]] = []
    for spec in args.tree:
        label, _, roots = spec.partition("=")
        trees.append((label, roots.split(":")))
    targets = [t for t in TARGETS if not args.group or t[0] in args.group]

    matrix = {target: {label: lookup(roots, target) for label, roots in trees} for _, target, _ in targets}
    if args.json:
        _write(args.json, json.dumps(matrix, indent=2) + "\n")
    if args.md:
        labels = [label for label, _ in trees]
        lines = ["| fix | role | target | " + " | ".join(labels) + " |", "|---|---|---|" + "---|" * len(labels)]
        for group, target, role in targets:
            cells = [matrix[target][label] or "—" for label in labels]
            lines.append(f"| {group} | {role} | `{target}` | " + " | ".join(cells) + " |")
        _write(args.md, "\n".join(lines) + "\n")
    return 0


def _write(dest: str, text: str) -> None:
    if dest == "-":
        sys.stdout.write(text)
    else:
        with open(dest, "w", encoding="utf-8") as fh:
            fh.write(text)


if __name__ == "__main__":
    sys.exit(main())
