"""Adapter ascend-0.19-0.23: vllm-ascend 0.19.1rc1 .. 0.23.x + vLLM 0.19 .. 0.23.

These releases already run zero-bubble async scheduling + spec decode (#7640 / #8461), but
``BlockTable.compute_slot_mapping`` launches vLLM's generic ``_compute_slot_mapping_kernel`` every step, which the
vllm-ascend team measured at 173 us (4 tokens) / 1039 us (8192 tokens) on NPU against 3.0 / 21.2 us for an
Ascend-shaped kernel that exists only on vllm-ascend main (#13048). This adapter swaps in zb-patch's kernel and
carries the later correctness fixes a given release lacks (issue 4).

Fingerprints: PyPI ships only 0.23.0 and 0.23.0.post1 in this range; fingerprints for the 0.19.1rc1 .. 0.22.1rc1
tags are added from the vllm-ascend git tags (an rc build whose targets are not recorded is refused).
"""

from __future__ import annotations

from ..registry import Guard, PatchSet
from . import Adapter

GUARDS = (
    Guard(
        "vllm_ascend.worker.block_table:BlockTable.compute_slot_mapping",
        {"vllm-ascend 0.23.0, 0.23.0.post1": "96af10d24013ad58"},
        "A-b14 / P7: the per-step slot-mapping launch of vLLM's generic Triton kernel (replaced by the kernel patch)",
    ),
    Guard(
        "vllm_ascend.worker.block_table:BlockTable.__init__",
        {"vllm-ascend 0.23.0, 0.23.0.post1": "52eb7caec856b962"},
        "the kernel patch reads the attributes this constructor sets (block_table, slot_mapping, block sizes, CP ranks)",
    ),
    Guard(
        "vllm_ascend.worker.block_table:MultiGroupBlockTable.compute_slot_mapping",
        {"vllm-ascend 0.23.0, 0.23.0.post1": "dd72832c4b9fd8bd"},
        "dispatches to each group's BlockTable.compute_slot_mapping (every KV-cache group gets the patched kernel)",
    ),
)

PATCHES: tuple = ()

ADAPTER = Adapter(
    id="ascend-0.19-0.23",
    title="vllm-ascend 0.19.1rc1-0.23.x + vLLM 0.19-0.23 (zero-bubble present; generic slot-mapping kernel)",
    vllm_ascend=((0, 19, 0), (0, 24)),
    vllm=((0, 19, 0), (0, 24)),
    patch_set=PatchSet("ascend-0.19-0.23", PATCHES, GUARDS),
    notes="vllm-ascend 0.23.0 pins vLLM 0.23.0; 0.23.0.post1 (sdist only) has identical targets.",
)
