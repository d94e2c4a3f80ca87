"""Adapter ascend-0.19-0.23: vllm-ascend 0.19.1rc1 .. 0.23.x + vLLM 0.19 .. 0.23.

These releases already run zero-bubble async scheduling + spec decode (#7640 / #8461), but
``BlockTable.compute_slot_mapping`` launches vLLM's generic ``_compute_slot_mapping_kernel`` every step, which the
vllm-ascend team measured at 173 us (4 tokens) / 1039 us (8192 tokens) on NPU against 3.0 / 21.2 us for an
Ascend-shaped kernel that exists only on vllm-ascend main (#13048). This adapter swaps in zb-patch's kernel and
carries the later correctness fixes a given release lacks (issue 4).

Fingerprints: every release in range (0.19.1rc1, 0.20.2rc1, 0.21.0rc1, 0.22.1rc1, 0.23.0rc1, 0.23.0, 0.23.0.post1;
PyPI has wheels for all, though ``pip index`` lists only finals) was read from its wheel and git tag; how, and the
per-release status of the later fixes, is in docs/releases/ascend-0.19-0.23.md (regenerate with
docs/releases/fingerprint_matrix.py or ``zb-patch fingerprints --root <tree> --adapter ascend-0.19-0.23``).
"""

from __future__ import annotations

from ..registry import Guard, Patch, PatchSet
from . import Adapter


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
            block_table = self.block_table.gpu
            mapper = self.__dict__["_zb_slot_mapper"] = kernels.slot_mapper(
                block_table,
                self.slot_mapping.gpu,
                block_size=self.block_size,
                max_num_tokens=self.max_num_batched_tokens,
                block_table_stride=block_table.stride(0),
                physical_block_size=self.physical_block_size,
                pcp_world_size=self.pcp_world_size,
                pcp_rank=self.pcp_rank,
                dcp_world_size=self.dcp_world_size,
                dcp_rank=self.dcp_rank,
                cp_kv_cache_interleave_size=self.cp_kv_cache_interleave_size,
            )
        mapper(num_reqs, query_start_loc, positions)

    return compute_slot_mapping


SLOT_MAPPING_KERNEL = Patch(
    id="slot-mapping-kernel",
    target="vllm_ascend.worker.block_table:BlockTable.compute_slot_mapping",
    make=_make_compute_slot_mapping,
    fingerprints={
        # vLLM's generic kernel in both branches (CP too): the form before #10442
        "vllm-ascend 0.19.1rc1, 0.20.2rc1, 0.21.0rc1 (wheels)": "34770de46cb5927d",
        # #10442: torch _compute_pcp_dcp_slot_mapping for CP > 1
        "vllm-ascend 0.21.0rc1 (sdist), 0.22.1rc1": "86170883d9c748c1",
        "vllm-ascend 0.23.0rc1, 0.23.0, 0.23.0.post1": "96af10d24013ad58",
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
        "answer (docs/releases/ascend-0.19-0.23.md).",
    upstream=("vllm-ascend#13048", "vllm-ascend#10442", "vllm#32951"),
    remove_when="vllm-ascend >= 0.24 (ships #13048's Ascend kernel): the adapter range ends there.",
    roles=("worker",),
)

PATCHES = (SLOT_MAPPING_KERNEL,)

GUARDS = (
    Guard(
        "vllm_ascend.worker.block_table:BlockTable.__init__",
        {
            "vllm-ascend 0.19.1rc1": "ccce40b9beff96c6",
            "vllm-ascend 0.20.2rc1": "0522c803840a1ba3",
            "vllm-ascend 0.21.0rc1 (wheels)": "eadb2cdfa4acea78",
            "vllm-ascend 0.21.0rc1 (sdist), 0.22.1rc1": "0602c50a9e7c505e",
            "vllm-ascend 0.23.0rc1": "af34c0a04448d6da",
            "vllm-ascend 0.23.0, 0.23.0.post1": "52eb7caec856b962",
        },
        "the kernel patch reads the attributes this constructor sets (block_table, slot_mapping, block sizes, CP ranks)",
    ),
    Guard(
        "vllm_ascend.worker.block_table:MultiGroupBlockTable.compute_slot_mapping",
        {
            "vllm-ascend 0.19.1rc1": "7f076a90095a770e",
            "vllm-ascend 0.20.2rc1, 0.21.0rc1 (wheels)": "4d2ebb1d7af18c41",
            "vllm-ascend 0.21.0rc1 (sdist), 0.22.1rc1, 0.23.0rc1, 0.23.0, 0.23.0.post1": "dd72832c4b9fd8bd",
        },
        "dispatches to each group's BlockTable.compute_slot_mapping (every KV-cache group gets the patched kernel)",
    ),
)

ADAPTER = Adapter(
    id="ascend-0.19-0.23",
    title="vllm-ascend 0.19.1rc1-0.23.x + vLLM 0.19-0.23 (zero-bubble present; generic slot-mapping kernel)",
    vllm_ascend=((0, 19, 0), (0, 24)),
    vllm=((0, 19, 0), (0, 24)),
    patch_set=PatchSet("ascend-0.19-0.23", PATCHES, GUARDS),
    preload=("vllm_ascend.platform", "vllm_ascend.worker.worker"),
    releases=("0.19.1rc1", "0.20.2rc1", "0.21.0rc1", "0.22.1rc1", "0.23.0rc1", "0.23.0", "0.23.0.post1"),
    notes="vllm-ascend 0.23.0 pins vLLM 0.23.0; 0.23.0.post1 (sdist only) has identical targets.",
)
