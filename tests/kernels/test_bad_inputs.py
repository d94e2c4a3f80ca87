"""Bad inputs to the public kernel API: the torch reference path and the Triton path reject the same
ones (``ValueError`` whose message starts with the argument's name, nothing written), and give
identical results on valid edge cases.

Every row of ``TABLE`` runs through both paths: the reference with CPU tensors, Triton on the
kernel device (the interpreter under ``TRITON_INTERPRET=1``, else CUDA).  A per-call row first makes
one valid call (on CUDA that compiles the kernel, so the bad call meets the direct-launch path), then
snapshots the outputs and makes the bad call.  Print the table (input, reference result, Triton
result) with::

    TRITON_INTERPRET=1 python tests/kernels/test_bad_inputs.py
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_env import KERNEL_DEVICE, KERNEL_SKIP_REASON  # noqa: E402

from zb_patch import kernels  # noqa: E402

POISON = -777
I32, I64, F32 = torch.int32, torch.int64, torch.float32
PAD = kernels.PAD_SLOT_ID


class Probe:
    """The output buffers of one run, and their content just before the call under test."""

    def __init__(self, dev: str) -> None:
        self.dev = dev
        self.outputs: dict[str, torch.Tensor] = {}
        self.before: dict[str, list] = {}

    def t(self, values: Any, dtype: torch.dtype = I64) -> torch.Tensor:
        return torch.tensor(list(values), dtype=dtype, device=self.dev)

    def watch(self, **tensors: torch.Tensor) -> None:
        self.outputs.update(tensors)

    def arm(self) -> None:
        self.before = self.snapshot()

    def snapshot(self) -> dict[str, list]:
        return {name: tensor.cpu().tolist() for name, tensor in self.outputs.items()}


@dataclass
class Case:
    api: str
    what: str  # the input, in words
    run: Callable[[Probe], None]
    rejects: str | None  # the argument a ValueError must name; None: a valid edge case
    expect: dict | None = None  # for edge cases: expected output values (a prefix per buffer)


# ------------------------------------------------------------------------------------------------
# slot mapping: 4 x 8 block table, block 16, block_table[r, c] = 100 * (r + 1) + c
# request 0 = positions [0, 1, 17], request 1 = [5, 6]
# ------------------------------------------------------------------------------------------------
QSL, POS = [0, 3, 5], [0, 1, 17, 5, 6]
SLOTS = [1600, 1601, 1617, 3205, 3206]


def _block_table(p: Probe) -> torch.Tensor:
    return (100 * torch.arange(1, 5, dtype=I32)[:, None] + torch.arange(8, dtype=I32)).to(p.dev)


def slot_run(
    *, out: Callable | None = None, bt: Callable | None = None, cfg: dict | None = None, call: Callable | None = None
) -> Callable[[Probe], None]:
    """A mapper built from (overridden) buffers / config, one valid call, then ``call(p)``'s arguments."""

    def run(p: Probe) -> None:
        slot_mapping = out(p) if out else torch.full((12,), POISON, dtype=I64, device=p.dev)
        p.watch(slot_mapping=slot_mapping._base if slot_mapping._base is not None else slot_mapping)
        p.arm()
        mapper = kernels.slot_mapper(
            bt(p) if bt else _block_table(p), slot_mapping, **{"block_size": 16, "max_num_tokens": 8, **(cfg or {})}
        )
        mapper(2, p.t(QSL, I32), p.t(POS))
        p.arm()
        mapper(*(call(p) if call else (2, p.t(QSL, I32), p.t(POS))))

    return run


def one_shot_run(out: Callable) -> Callable[[Probe], None]:
    def run(p: Probe) -> None:
        slot_mapping = out(p)
        p.watch(slot_mapping=slot_mapping._base if slot_mapping._base is not None else slot_mapping)
        p.arm()
        kernels.compute_slot_mapping(
            p.t(QSL, I32), p.t(POS), _block_table(p), slot_mapping, block_size=16, max_num_tokens=8
        )

    return run


def _strided(p: Probe, values: list, dtype: torch.dtype = I64) -> torch.Tensor:
    base = torch.full((2 * len(values),), 0, dtype=dtype, device=p.dev)
    base[::2] = torch.tensor(values, dtype=dtype)
    return base[::2]


def _offset_view(p: Probe, values: list, dtype: torch.dtype = I64) -> torch.Tensor:
    return p.t([0] + values, dtype)[1:]  # contiguous, 8 bytes past the allocation's start


SLOT_CASES = [
    # --- buffers, checked when the mapper is built
    Case(
        "slot_mapper",
        "slot_mapping = base[::2] (non-contiguous)",
        slot_run(out=lambda p: torch.full((24,), POISON, dtype=I64, device=p.dev)[::2]),
        "slot_mapping",
    ),
    Case(
        "slot_mapper",
        "slot_mapping float32",
        slot_run(out=lambda p: torch.zeros(12, dtype=F32, device=p.dev)),
        "slot_mapping",
    ),
    Case(
        "slot_mapper",
        "slot_mapping 2-D (3, 4)",
        slot_run(out=lambda p: torch.zeros(3, 4, dtype=I64, device=p.dev)),
        "slot_mapping",
    ),
    Case("slot_mapper", "block_table int64", slot_run(bt=lambda p: _block_table(p).long()), "block_table"),
    Case(
        "slot_mapper",
        "block_table column stride 2",
        slot_run(bt=lambda p: torch.zeros(4, 16, dtype=I32, device=p.dev)[:, ::2]),
        "block_table",
    ),
    Case(
        "slot_mapper",
        "max_num_tokens 13 > len(slot_mapping) 12",
        slot_run(cfg={"max_num_tokens": 13}),
        "max_num_tokens",
    ),
    Case("slot_mapper", "max_num_tokens -1", slot_run(cfg={"max_num_tokens": -1}), "max_num_tokens"),
    Case("slot_mapper", "block_size 0", slot_run(cfg={"block_size": 0}), "block_size"),
    Case("slot_mapper", "block_size 16.0 (float)", slot_run(cfg={"block_size": 16.0}), "block_size"),
    Case(
        "slot_mapper",
        "block_table_stride 9 != stride(0) 8",
        slot_run(cfg={"block_table_stride": 9}),
        "block_table_stride",
    ),
    Case(
        "slot_mapper", "dcp_rank 2 of dcp_world_size 2", slot_run(cfg={"dcp_world_size": 2, "dcp_rank": 2}), "dcp_rank"
    ),
    Case(
        "slot_mapper",
        "physical_block_size 24 (block 16)",
        slot_run(cfg={"physical_block_size": 24}),
        "physical_block_size",
    ),
    Case("slot_mapper", "pad_slot_id 2**40", slot_run(cfg={"pad_slot_id": 2**40}), "pad_slot_id"),
    Case(
        "compute_slot_mapping",
        "slot_mapping = base[::2] (one-shot API)",
        one_shot_run(lambda p: torch.full((24,), POISON, dtype=I64, device=p.dev)[::2]),
        "slot_mapping",
    ),
    # --- per-step arguments, checked at each call
    Case(
        "slot_mapper(...)()",
        "positions = base[::2] (non-contiguous)",
        slot_run(call=lambda p: (2, p.t(QSL, I32), _strided(p, POS))),
        "positions",
    ),
    Case(
        "slot_mapper(...)()",
        "query_start_loc = base[::2] (non-contiguous)",
        slot_run(call=lambda p: (2, _strided(p, QSL, I32), p.t(POS))),
        "query_start_loc",
    ),
    Case(
        "slot_mapper(...)()",
        "positions float32",
        slot_run(call=lambda p: (2, p.t(QSL, I32), p.t(POS, F32))),
        "positions",
    ),
    Case(
        "slot_mapper(...)()",
        "query_start_loc float32",
        slot_run(call=lambda p: (2, p.t(QSL, F32), p.t(POS))),
        "query_start_loc",
    ),
    Case(
        "slot_mapper(...)()",
        "positions 2-D (5, 1)",
        slot_run(call=lambda p: (2, p.t(QSL, I32), p.t(POS)[:, None])),
        "positions",
    ),
    Case("slot_mapper(...)()", "positions a list", slot_run(call=lambda p: (2, p.t(QSL, I32), list(POS))), "positions"),
    Case("slot_mapper(...)()", "num_reqs -1", slot_run(call=lambda p: (-1, p.t(QSL, I32), p.t(POS))), "num_reqs"),
    Case(
        "slot_mapper(...)()",
        "num_reqs 5 > 4 block-table rows",
        slot_run(call=lambda p: (5, p.t([0, 1, 2, 3, 4, 5], I32), p.t(POS))),
        "num_reqs",
    ),
    Case(
        "slot_mapper(...)()",
        "num_reqs 2.0 (float)",
        slot_run(call=lambda p: (2.0, p.t(QSL, I32), p.t(POS))),
        "num_reqs",
    ),
    Case(
        "slot_mapper(...)()",
        "num_reqs 3, len(query_start_loc) 3",
        slot_run(call=lambda p: (3, p.t(QSL, I32), p.t(POS))),
        "query_start_loc",
    ),
    Case(
        "slot_mapper(...)()",
        "13 positions > len(slot_mapping) 12",
        slot_run(call=lambda p: (2, p.t([0, 3, 13], I32), p.t(range(13)))),
        "positions",
    ),
    # --- valid edge cases: identical results
    Case(
        "slot_mapper(...)()",
        "positions 2**31 - 1, 2**31, 2**32 + 5, -2**32 + 5, -1 (int64)",
        slot_run(call=lambda p: (2, p.t(QSL, I32), p.t([2**31 - 1, 2**31, 2**32 + 5, -(2**32) + 5, -1]))),
        None,
        {"slot_mapping": [PAD] * 8},
    ),
    Case(
        "slot_mapper(...)()",
        "positions int32, query_start_loc int64",
        slot_run(call=lambda p: (2, p.t(QSL), p.t(POS, I32))),
        None,
        {"slot_mapping": SLOTS + [PAD] * 3},
    ),
    Case(
        "slot_mapper(...)()",
        "positions / query_start_loc 8 bytes past their allocation",
        slot_run(call=lambda p: (2, _offset_view(p, QSL, I32), _offset_view(p, POS))),
        None,
        {"slot_mapping": SLOTS + [PAD] * 3},
    ),
    Case(
        "slot_mapper(...)()",
        "num_reqs numpy.int64(2)",
        slot_run(call=lambda p: (np.int64(2), p.t(QSL, I32), p.t(POS))),
        None,
        {"slot_mapping": SLOTS},
    ),
    Case(
        "slot_mapper(...)()",
        "num_reqs 0 (all padding)",
        slot_run(call=lambda p: (0, p.t([0], I32), p.t(POS))),
        None,
        {"slot_mapping": [PAD] * 8},
    ),
    Case(
        "slot_mapper(...)()",
        "no tokens",
        slot_run(call=lambda p: (0, p.t([0], I32), p.t([]))),
        None,
        {"slot_mapping": [PAD] * 8 + [POISON] * 4},
    ),
    Case(
        "slot_mapper(...)()",
        "10 tokens > max_num_tokens 8 (<= len(slot_mapping))",
        slot_run(call=lambda p: (1, p.t([0, 10], I32), p.t(range(10)))),
        None,
        {"slot_mapping": list(range(1600, 1610)) + [POISON] * 2},
    ),
    Case(
        "slot_mapper(...)()",
        "num_reqs 1 < len(query_start_loc) - 1",
        slot_run(call=lambda p: (1, p.t(QSL, I32), p.t(POS))),
        None,
        {"slot_mapping": SLOTS[:3] + [PAD] * 5},
    ),
]


# ------------------------------------------------------------------------------------------------
# token counts: 8-row buffers, a batch of 4 requests (7 tokens) after a previous batch of 3
# ------------------------------------------------------------------------------------------------
def _counts_args(p: Probe) -> dict:
    args = dict(
        num_computed_tokens=p.t(range(500, 508), I32),
        num_accepted_tokens=p.t([1] * 8, I32),
        prev_positions=p.t([1, 0, -1, 2, 0, 0, 0, 0]),
        valid_sampled_token_count=p.t([2, 3, 1]),
        prev_num_draft_tokens=p.t([2, 2, 0, 0, 0, 0, 0, 0], I32),
        cpu_num_computed_tokens=p.t([50, 60, 70, 80], I32),
        num_scheduled_tokens=p.t([2, 1, 3, 1, 0, 0, 0, 0], I32),
        seq_lens=p.t([POISON] * 8, I32),
        req_indices=p.t([0, 0, 1, 2, 2, 2, 3] + [0] * 9),
        query_pos=p.t([0, 1, 0, 0, 1, 2, 0] + [0] * 9),
        positions=p.t([POISON] * 16),
        num_reqs=4,
        num_tokens=7,
        num_positions=9,
        num_prev_reqs=3,
    )
    p.watch(**{k: args[k] for k in ("num_computed_tokens", "num_accepted_tokens", "seq_lens", "positions")})
    return args


def counts_run(change: Callable[[Probe, dict], None] | None = None) -> Callable[[Probe], None]:
    """``update_token_counts`` on the batch above, with ``change`` applied to its arguments."""

    def run(p: Probe) -> None:
        args = _counts_args(p)
        if change:
            change(p, args)
        p.arm()
        kernels.update_token_counts(**args)

    return run


_BOUND = (
    "num_computed_tokens",
    "seq_lens",
    "num_scheduled_tokens",
    "prev_positions",
    "prev_num_draft_tokens",
    "num_accepted_tokens",
    "req_indices",
    "query_pos",
    "positions",
)


def launcher_run(
    change: Callable[[Probe, dict], None] | None = None, *, call: Callable[[Probe, dict], dict] | None = None
) -> Callable[[Probe], None]:
    """``token_counts_launcher`` bound to the buffers above (``change``d), one valid call, then the call
    ``call(p, args)`` returns the keyword arguments of."""

    def run(p: Probe) -> None:
        args = _counts_args(p)
        if change:
            change(p, args)
        p.arm()
        launcher = kernels.token_counts_launcher(**{k: args[k] for k in _BOUND})
        step = {
            k: args[k]
            for k in (
                "num_reqs",
                "cpu_num_computed_tokens",
                "valid_sampled_token_count",
                "num_tokens",
                "num_positions",
                "num_prev_reqs",
            )
        }
        launcher(**step)
        p.arm()
        launcher(**(call(p, args) if call else step))

    return run


def _step(args: dict, **changes: Any) -> dict:
    step = {
        k: args[k]
        for k in (
            "num_reqs",
            "cpu_num_computed_tokens",
            "valid_sampled_token_count",
            "num_tokens",
            "num_positions",
            "num_prev_reqs",
        )
    }
    step.update(changes)
    return step


def _set(**changes: Callable[[Probe, dict], Any]) -> Callable[[Probe, dict], None]:
    def change(p: Probe, args: dict) -> None:
        for name, make in changes.items():
            args[name] = make(p, args)

    return change


def _int32_token_buffers(p: Probe, args: dict) -> None:
    for name in ("positions", "req_indices", "query_pos"):
        args[name] = args[name].to(I32)
    p.watch(positions=args["positions"])


# num_computed 500.., prev rows 1, 0, -, 2: rows 0 and 1 participate (drafts 2): 501 + 3, 500 + 2
COUNTS_OK = {
    "num_computed_tokens": [504, 502, 70, 80, 504, 505, 506, 507],
    "seq_lens": [506, 503, 73, 81, 0, 0, 0, 0],
    "positions": [504, 505, 502, 70, 71, 72, 80, 0, 0, POISON],
}

COUNT_CASES = [
    # --- update_token_counts (every argument checked per call)
    Case(
        "update_token_counts",
        "num_computed / seq_lens / num_accepted = 2-element views of 8, num_reqs 4",
        counts_run(
            _set(
                num_computed_tokens=lambda p, a: a["num_computed_tokens"][:2],
                seq_lens=lambda p, a: a["seq_lens"][:2],
                num_accepted_tokens=lambda p, a: a["num_accepted_tokens"][:2],
            )
        ),
        "num_computed_tokens",
    ),
    Case(
        "update_token_counts",
        "cpu_num_computed_tokens 2 elements, num_reqs 4",
        counts_run(_set(cpu_num_computed_tokens=lambda p, a: a["cpu_num_computed_tokens"][:2])),
        "cpu_num_computed_tokens",
    ),
    Case(
        "update_token_counts",
        "prev_positions 2 elements, num_reqs 4",
        counts_run(_set(prev_positions=lambda p, a: a["prev_positions"][:2])),
        "prev_positions",
    ),
    Case(
        "update_token_counts",
        "num_scheduled_tokens 2 elements, num_reqs 4",
        counts_run(_set(num_scheduled_tokens=lambda p, a: a["num_scheduled_tokens"][:2])),
        "num_scheduled_tokens",
    ),
    Case(
        "update_token_counts",
        "num_tokens 20 > 16 (positions, req_indices, query_pos)",
        counts_run(_set(num_tokens=lambda p, a: 20, num_positions=lambda p, a: None)),
        "num_tokens",
    ),
    Case(
        "update_token_counts",
        "num_tokens 12 > len(positions) 10, num_positions default",
        counts_run(
            _set(
                positions=lambda p, a: a["positions"][:10], num_tokens=lambda p, a: 12, num_positions=lambda p, a: None
            )
        ),
        "num_tokens",
    ),
    Case(
        "update_token_counts",
        "num_positions 20 > len(positions) 16",
        counts_run(_set(num_positions=lambda p, a: 20)),
        "num_positions",
    ),
    Case(
        "update_token_counts",
        "num_positions 5 < num_tokens 7",
        counts_run(_set(num_positions=lambda p, a: 5)),
        "num_positions",
    ),
    Case("update_token_counts", "num_reqs -1", counts_run(_set(num_reqs=lambda p, a: -1)), "num_reqs"),
    Case("update_token_counts", "num_reqs 4.0 (float)", counts_run(_set(num_reqs=lambda p, a: 4.0)), "num_reqs"),
    Case(
        "update_token_counts",
        "seq_lens = base[::2] (non-contiguous)",
        counts_run(_set(seq_lens=lambda p, a: torch.zeros(16, dtype=I32, device=p.dev)[::2])),
        "seq_lens",
    ),
    Case(
        "update_token_counts",
        "num_computed_tokens int64",
        counts_run(_set(num_computed_tokens=lambda p, a: p.t(range(500, 508)))),
        "num_computed_tokens",
    ),
    Case(
        "update_token_counts",
        "cpu_num_computed_tokens float32",
        counts_run(_set(cpu_num_computed_tokens=lambda p, a: p.t([50, 60, 70, 80], F32))),
        "cpu_num_computed_tokens",
    ),
    Case(
        "update_token_counts",
        "valid_sampled_token_count 2-D (3, 1)",
        counts_run(_set(valid_sampled_token_count=lambda p, a: a["valid_sampled_token_count"][:, None])),
        "valid_sampled_token_count",
    ),
    Case(
        "update_token_counts", "positions without query_pos", counts_run(_set(query_pos=lambda p, a: None)), "query_pos"
    ),
    Case("update_token_counts", "num_prev_reqs -1", counts_run(_set(num_prev_reqs=lambda p, a: -1)), "num_prev_reqs"),
    # --- token_counts_launcher: buffers when built, the step's arguments per call
    Case(
        "token_counts_launcher",
        "seq_lens = base[::2] (non-contiguous)",
        launcher_run(_set(seq_lens=lambda p, a: torch.zeros(16, dtype=I32, device=p.dev)[::2])),
        "seq_lens",
    ),
    Case(
        "token_counts_launcher",
        "req_indices float32",
        launcher_run(_set(req_indices=lambda p, a: torch.zeros(16, dtype=F32, device=p.dev))),
        "req_indices",
    ),
    Case(
        "token_counts_launcher(...)()",
        "num_reqs 9 > 8 rows",
        launcher_run(call=lambda p, a: _step(a, num_reqs=9, cpu_num_computed_tokens=p.t(range(9), I32))),
        "num_reqs",
    ),
    Case(
        "token_counts_launcher(...)()", "num_reqs -1", launcher_run(call=lambda p, a: _step(a, num_reqs=-1)), "num_reqs"
    ),
    Case(
        "token_counts_launcher(...)()",
        "cpu_num_computed_tokens = base[::2]",
        launcher_run(call=lambda p, a: _step(a, cpu_num_computed_tokens=_strided(p, [50, 60, 70, 80], I32))),
        "cpu_num_computed_tokens",
    ),
    Case(
        "token_counts_launcher(...)()",
        "cpu_num_computed_tokens a list",
        launcher_run(call=lambda p, a: _step(a, cpu_num_computed_tokens=[50, 60, 70, 80])),
        "cpu_num_computed_tokens",
    ),
    Case(
        "token_counts_launcher(...)()",
        "num_tokens 17 > 16 (req_indices)",
        launcher_run(call=lambda p, a: _step(a, num_tokens=17, num_positions=None)),
        "num_tokens",
    ),
    Case(
        "token_counts_launcher(...)()",
        "valid_sampled_token_count float32",
        launcher_run(call=lambda p, a: _step(a, valid_sampled_token_count=p.t([2, 3, 1], F32))),
        "valid_sampled_token_count",
    ),
    # one per term of the launcher's per-step fast check: a bad value must fail it and reach the full check
    *(
        Case("token_counts_launcher(...)()", what, launcher_run(call=call), name)
        for what, call, name in (
            ("num_reqs 4.0 (a float)", lambda p, a: _step(a, num_reqs=4.0), "num_reqs"),
            ("num_tokens 7.0 (a float)", lambda p, a: _step(a, num_tokens=7.0), "num_tokens"),
            ("num_positions 9.0 (a float)", lambda p, a: _step(a, num_positions=9.0), "num_positions"),
            ("num_positions 6 < num_tokens 7", lambda p, a: _step(a, num_positions=6), "num_positions"),
            ("num_positions 17 > 16 (positions)", lambda p, a: _step(a, num_positions=17), "num_positions"),
            ("num_prev_reqs -1", lambda p, a: _step(a, num_prev_reqs=-1), "num_prev_reqs"),
            ("num_prev_reqs 3.0 (a float)", lambda p, a: _step(a, num_prev_reqs=3.0), "num_prev_reqs"),
            (
                "cpu_num_computed_tokens 2-D",
                lambda p, a: _step(a, cpu_num_computed_tokens=p.t([50, 60, 70, 80], I32).reshape(2, 2)),
                "cpu_num_computed_tokens",
            ),
            (
                "cpu_num_computed_tokens 3 rows for 4 requests",
                lambda p, a: _step(a, cpu_num_computed_tokens=p.t([50, 60, 70], I32)),
                "cpu_num_computed_tokens",
            ),
            (
                "cpu_num_computed_tokens float32",
                lambda p, a: _step(a, cpu_num_computed_tokens=p.t([50, 60, 70, 80], F32)),
                "cpu_num_computed_tokens",
            ),
            (
                "valid_sampled_token_count 2-D",
                lambda p, a: _step(a, valid_sampled_token_count=p.t([2, 3, 1, 1]).reshape(2, 2)),
                "valid_sampled_token_count",
            ),
            (
                "valid_sampled_token_count = base[::2]",
                lambda p, a: _step(a, valid_sampled_token_count=_strided(p, [2, 3, 1])),
                "valid_sampled_token_count",
            ),
        )
    ),
    # --- valid edge cases: identical results
    Case("update_token_counts", "the batch as it is", counts_run(), None, COUNTS_OK),
    Case("token_counts_launcher(...)()", "the batch twice (bound buffers)", launcher_run(), None, None),
    Case(
        "update_token_counts",
        "num_reqs 0",
        counts_run(_set(num_reqs=lambda p, a: 0, num_tokens=lambda p, a: 0)),
        None,
        {"seq_lens": [0] * 8, "positions": [0] * 9 + [POISON]},
    ),
    Case(
        "update_token_counts",
        "req_indices -1 and 99 (outside the batch) -> position 0",
        counts_run(_set(req_indices=lambda p, a: p.t([0, -1, 1, 2, 99, 2, 3] + [0] * 9))),
        None,
        {"positions": [504, 0, 502, 70, 0, 72, 80, 0, 0, POISON]},
    ),
    Case(
        "update_token_counts",
        "req_indices 2**32 (row 0 if cast to int32 first)",
        counts_run(_set(req_indices=lambda p, a: p.t([0, 2**32, 1, 2, 2, 2, 3] + [0] * 9))),
        None,
        {"positions": [504, 0, 502, 70, 71, 72, 80, 0, 0, POISON]},
    ),
    Case(
        "update_token_counts",
        "int32 positions / req_indices / query_pos",
        counts_run(_int32_token_buffers),
        None,
        {"positions": COUNTS_OK["positions"]},
    ),
    Case(
        "update_token_counts",
        "num_prev_reqs 0 (nobody participates)",
        counts_run(_set(num_prev_reqs=lambda p, a: 0)),
        None,
        {"num_computed_tokens": [50, 60, 70, 80, 504, 505, 506, 507]},
    ),
    Case(
        "update_token_counts",
        "empty valid_sampled_token_count",
        counts_run(_set(valid_sampled_token_count=lambda p, a: p.t([]))),
        None,
        {"num_computed_tokens": [50, 60, 70, 80, 504, 505, 506, 507]},
    ),
    Case(
        "token_counts_launcher(...)()",
        "num_reqs numpy.int64(4), num_tokens numpy.int64(7)",
        launcher_run(call=lambda p, a: _step(a, num_reqs=np.int64(4), num_tokens=np.int64(7))),
        None,
        None,
    ),
]


# ------------------------------------------------------------------------------------------------
# correct_optimistic_seq_lens_cpu: host only (no Triton twin); both columns run the same function
# ------------------------------------------------------------------------------------------------
def seq_lens_run(**changes: Any) -> Callable[[Probe], None]:
    def run(p: Probe) -> None:
        seq = np.array([10, 20, 30, 0], dtype=np.int32)
        p.watch(optimistic_seq_lens=torch.from_numpy(seq))
        args = dict(
            optimistic_seq_lens=seq,
            prev_positions=np.array([1, -1, 0]),
            prev_num_draft_tokens=np.array([2, 3], dtype=np.int32),
            valid_sampled_token_count=np.array([1, 4]),
            num_reqs=3,
        )
        args.update({k: (v(seq) if callable(v) else v) for k, v in changes.items()})
        p.arm()
        kernels.correct_optimistic_seq_lens_cpu(**args)

    return run


SEQ_LENS_CASES = [
    Case(
        "correct_optimistic_seq_lens_cpu",
        "optimistic_seq_lens a list",
        seq_lens_run(optimistic_seq_lens=lambda seq: seq.tolist()),
        "optimistic_seq_lens",
    ),
    Case("correct_optimistic_seq_lens_cpu", "num_reqs 5 > len 4", seq_lens_run(num_reqs=5), "num_reqs"),
    Case("correct_optimistic_seq_lens_cpu", "num_reqs -1", seq_lens_run(num_reqs=-1), "num_reqs"),
    Case(
        "correct_optimistic_seq_lens_cpu",
        "prev_positions float",
        seq_lens_run(prev_positions=[1.0, -1.0, 0.0]),
        "prev_positions",
    ),
    Case(
        "correct_optimistic_seq_lens_cpu",
        "lists for the read-only arguments",
        seq_lens_run(prev_positions=[1, -1, 0], prev_num_draft_tokens=[2, 3], valid_sampled_token_count=[1, 4]),
        None,
        {"optimistic_seq_lens": [10, 20, 28, 0]},
    ),
]

TABLE = SLOT_CASES + COUNT_CASES + SEQ_LENS_CASES


# ------------------------------------------------------------------------------------------------
# running a row through a path
# ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def path(triton: bool):
    """Send the public API to the Triton kernels or to the torch reference, whatever the device."""
    original = kernels.uses_triton
    kernels.uses_triton = lambda device: triton
    try:
        yield
    finally:
        kernels.uses_triton = original


@dataclass
class Outcome:
    error: ValueError | None
    outputs: dict[str, list]
    untouched: bool  # on error: the outputs are what they were before the rejected call

    def summary(self, width: int = 60) -> str:
        if self.error is not None:
            name = str(self.error).split("=", 1)[0]
            return f"ValueError({name})" + ("" if self.untouched else " AFTER WRITING")
        text = "; ".join(f"{k} {v}" for k, v in self.outputs.items())
        return "ok: " + (text if len(text) <= width else text[: width - 3] + "...")


def run_case(case: Case, triton: bool) -> Outcome:
    probe = Probe(KERNEL_DEVICE if triton else "cpu")
    with path(triton):
        try:
            case.run(probe)
        except ValueError as exc:
            after = probe.snapshot()
            return Outcome(exc, after, after == probe.before)
    return Outcome(None, probe.snapshot(), True)


def _id(case: Case) -> str:
    return f"{case.api}: {case.what}"


@pytest.mark.parametrize("case", TABLE, ids=[_id(c) for c in TABLE])
def test_both_paths_reject_or_agree(case: Case):
    ref = run_case(case, triton=False)
    host_only = case.api == "correct_optimistic_seq_lens_cpu"
    if KERNEL_DEVICE is None and not host_only:
        pytest.skip(KERNEL_SKIP_REASON)
    tri = ref if host_only else run_case(case, triton=True)
    for label, outcome in (("reference", ref), ("triton", tri)):
        if case.rejects is None:
            assert outcome.error is None, f"{label}: {outcome.error}"
        else:
            assert outcome.error is not None, f"{label} accepted it: {outcome.outputs}"
            message = str(outcome.error)
            assert message.startswith(case.rejects + "="), f"{label}: {message}"
            assert outcome.untouched, f"{label} wrote before rejecting: {outcome.outputs}"
    if case.rejects is None:
        assert tri.outputs == ref.outputs
        for name, prefix in (case.expect or {}).items():
            assert ref.outputs[name][: len(prefix)] == prefix, (name, ref.outputs[name])
    elif KERNEL_DEVICE == "cpu":  # the interpreter: same device on both paths, so the very same message
        assert str(tri.error) == str(ref.error)


def test_messages_name_value_and_allowed_range():
    with path(False), pytest.raises(ValueError) as info:
        kernels.slot_mapper(_block_table(Probe("cpu")), torch.zeros(12, dtype=I64), block_size=16, max_num_tokens=8)(
            5, torch.zeros(6, dtype=I32), torch.zeros(3, dtype=I64)
        )
    assert str(info.value) == "num_reqs=5: allowed: 0 <= num_reqs <= 4 (the block table's rows)"


def main() -> None:
    """Print the table (markdown): input, reference result, Triton result."""
    print(f"Triton path on: {KERNEL_DEVICE or 'unavailable: ' + KERNEL_SKIP_REASON}")
    print("| API | input | reference | Triton |")
    print("|---|---|---|---|")
    for case in TABLE:
        ref = run_case(case, triton=False)
        if case.api == "correct_optimistic_seq_lens_cpu":
            tri_text = "(host only: same function)"
        elif KERNEL_DEVICE is None:
            tri_text = "(no kernel device)"
        else:
            tri = run_case(case, triton=True)
            tri_text = (
                "identical"
                if case.rejects is None and tri.error is None and tri.outputs == ref.outputs
                else tri.summary()
            )
        print(f"| {case.api} | {case.what} | {ref.summary()} | {tri_text} |")


if __name__ == "__main__":
    main()
