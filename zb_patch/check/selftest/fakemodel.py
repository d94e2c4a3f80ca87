"""A deterministic fake target model, rejection sampler and EAGLE-like drafter that *use* the runner's
device inputs the way a real model does, so that every bookkeeping error shows up in the tokens.

Target model ("attention" over a KV cache of hash-chain states)::

    H(p) = mix(H(p-1), token(p), p)          the state after the token at position p
    next token after position p = token_of(H(p))

For each request row the forward reads ``H(ctx-1)`` from the KV cache through the **block table**,
with ``ctx = seq_len - query_len`` taken from the **seq_lens the attention is given**, then mixes
the row's **input ids** at their **positions** and writes every new state to the cache at its
**slot mapping** entry.  So a wrong count, position, seq_len, slot or block id, or a stale input id,
changes the hash of everything after it: the generated token stream depends on the whole sequence.

Rejection sampling is greedy (a draft is accepted iff it equals the target's token), so the final
token streams do not depend on acceptance at all — they are comparable even with a plain
synchronous scheduler.  The drafter proposes the true continuation from the target's hidden state at
the last accepted position and its next-token input, then spoils drafts past a seeded, per-position
number ``m`` (all / none / partial): acceptance is deterministic per (request, position), the same
in every mode that computes the same positions.  A next-token input outside the vocabulary (the
``-1`` placeholder a bad backup index produces, vLLM #38098) poisons all drafts of that row.
"""

from __future__ import annotations

import zlib

import numpy as np

MASK63 = (1 << 63) - 1
MASK64 = (1 << 64) - 1
SEED_STATE = 0x5EED_0F_2B_B1E
BAD_STATE = 0xBAD_5747E


def mix(h: int, tok: int, pos: int) -> int:
    x = (h ^ ((tok + 0x1234567) * 0xBF58476D1CE4E5B9 + pos * 0x94D049BB133111EB)) & MASK64
    x = (x ^ (x >> 31)) * 0x9E3779B97F4A7C15 & MASK64
    x ^= x >> 29
    return x & MASK63


def token_of(h: int, vocab_size: int) -> int:
    return (h >> 11) % vocab_size


def req_key(req_id: str) -> int:
    return zlib.crc32(req_id.encode())


class AcceptancePattern:
    """How many of a row's k drafts the drafter gets right, by (seed, request, position).

    20 % none, 30 % all, 50 % partial (1..k-1; for k = 1: none or all).
    """

    def __init__(self, seed: int, k: int) -> None:
        self.seed, self.k = seed & 0xFFFFFFFF, k

    def __call__(self, rkey: int, pos: int) -> int:
        u = mix(self.seed * 0x10001 + rkey, 7, pos)
        c = u % 10
        if self.k == 0 or c < 2:
            return 0
        if c < 5:
            return self.k
        if self.k == 1:
            return (u >> 20) & 1
        return 1 + (u >> 8) % (self.k - 1)


def forward(
    kv: np.ndarray,
    input_ids: np.ndarray,
    positions: np.ndarray,
    slot_mapping: np.ndarray,
    qsl: np.ndarray,
    attn_seq_lens: list[int],
    block_table: np.ndarray,
    num_reqs: int,
    block_size: int,
    vocab_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Run the fake target on one batch. Returns (target token per input token, hidden state per token).

    Writes the new states to ``kv`` (flat ``[num_blocks * block_size]``) at ``slot_mapping``.
    """
    total = int(qsl[num_reqs]) if num_reqs else 0
    target = np.zeros(total, dtype=np.int64)
    hidden = np.zeros(total, dtype=np.int64)
    nslots = kv.shape[0]
    max_blocks = block_table.shape[1]
    read_slot: list[int | None] = []
    for r in range(num_reqs):
        ctx = int(attn_seq_lens[r]) - (int(qsl[r + 1]) - int(qsl[r]))
        if ctx <= 0:
            read_slot.append(None)
            continue
        p = ctx - 1
        bi = p // block_size
        read_slot.append(int(block_table[r, bi]) * block_size + p % block_size if bi < max_blocks else None)
    for r in _write_before_read_order(read_slot, slot_mapping, qsl, num_reqs):
        s, e = int(qsl[r]), int(qsl[r + 1])
        ctx = int(attn_seq_lens[r]) - (e - s)
        slot = read_slot[r]
        if ctx == 0:
            h = SEED_STATE
        elif ctx < 0:
            h = BAD_STATE ^ (-ctx)
        else:
            h = int(kv[slot]) if slot is not None and 0 <= slot < nslots else BAD_STATE
        for t in range(s, e):
            h = mix(h, int(input_ids[t]), int(positions[t]))
            slot_t = int(slot_mapping[t])
            if 0 <= slot_t < nslots:
                kv[slot_t] = h
            hidden[t] = h
            target[t] = token_of(h, vocab_size)
    return target, hidden


def _write_before_read_order(
    read_slot: list[int | None], slot_mapping: np.ndarray, qsl: np.ndarray, num_reqs: int
) -> list[int]:
    """Row order in which every row runs after the rows whose new KV it reads in the same step.

    A real forward writes the whole batch's K/V of a layer before that layer's attention reads, so a
    request can attend to cache blocks another request of the same batch is filling (a prefix-cache
    hit on a block whose owner computes it in this very step: vLLM caches blocks at allocation time).
    The chain model is sequential per row, so it orders rows instead.
    """
    writer: dict[int, int] = {}
    for r in range(num_reqs):
        for t in range(int(qsl[r]), int(qsl[r + 1])):
            writer[int(slot_mapping[t])] = r
    deps = {
        r: writer[read_slot[r]]
        for r in range(num_reqs)
        if read_slot[r] is not None and read_slot[r] in writer and writer[read_slot[r]] != r
    }
    if not deps:
        return list(range(num_reqs))
    order: list[int] = []
    state = [0] * num_reqs  # 0 new, 1 visiting, 2 done

    def visit(r: int) -> None:
        if state[r] == 2:
            return
        if state[r] == 1:  # a cycle cannot come from a consistent schedule; keep going deterministically
            return
        state[r] = 1
        if r in deps:
            visit(deps[r])
        state[r] = 2
        order.append(r)

    for r in range(num_reqs):
        visit(r)
    return order


def rejection_sample(
    target: np.ndarray, input_ids: np.ndarray, qsl: np.ndarray, num_drafts: list[int], num_reqs: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy verification. Returns (sampled ``[num_reqs, k+1]`` with -1 padding, accepted drafts per row)."""
    sampled = np.full((num_reqs, k + 1), -1, dtype=np.int64)
    accepted = np.zeros(num_reqs, dtype=np.int64)
    for r in range(num_reqs):
        e = int(qsl[r + 1])
        d = num_drafts[r]
        base = e - 1 - d
        a = 0
        while a < d and int(input_ids[base + 1 + a]) == int(target[base + a]):
            a += 1
        sampled[r, : a + 1] = target[base : base + a + 1]
        accepted[r] = a
    return sampled, accepted


def next_tokens(
    sampled: np.ndarray, discard: np.ndarray, backup: np.ndarray, vocab_size: int, num_reqs: int
) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's ``prepare_next_token_ids_padded``: (next token per row, valid sampled count per row).

    Discarded rows: backup token, count 0. Others: the last valid sampled token, count of valid ones.
    """
    nxt = np.zeros(num_reqs, dtype=np.int64)
    valid = np.zeros(num_reqs, dtype=np.int64)
    for r in range(num_reqs):
        if discard[r]:
            nxt[r] = backup[r]
            continue
        row = sampled[r]
        ok = (row >= 0) & (row < vocab_size)
        c = int(ok.sum())
        valid[r] = c
        nxt[r] = int(row[np.nonzero(ok)[0][-1]]) if c else int(backup[r])
    return nxt, valid


def propose(
    hidden: np.ndarray,
    nxt: np.ndarray,
    valid: np.ndarray,
    qsl: np.ndarray,
    num_drafts: list[int],
    attn_seq_lens: list[int],
    row_keys: list[int],
    num_reqs: int,
    k: int,
    vocab_size: int,
    pattern: AcceptancePattern,
) -> np.ndarray:
    """EAGLE-like padded drafting for every row: ``[num_reqs, k]`` draft tokens."""
    drafts = np.zeros((num_reqs, max(k, 1)), dtype=np.int64)
    for r in range(num_reqs):
        e = int(qsl[r + 1])
        d = num_drafts[r]
        a = int(valid[r]) - 1 if valid[r] > 0 else 0
        idx = e - 1 - d + a
        h = int(hidden[idx]) if 0 <= idx < len(hidden) else BAD_STATE
        pos = int(attn_seq_lens[r]) - d + a
        tok = int(nxt[r])
        if not 0 <= tok < vocab_size:
            drafts[r, :] = [(vocab_size - 1 - j) % vocab_size for j in range(drafts.shape[1])]
            continue
        m = pattern(row_keys[r], pos)
        for j in range(k):
            h = mix(h, tok, pos + j)
            true = token_of(h, vocab_size)
            drafts[r, j] = true if j < m else (true + 1) % vocab_size
            tok = true
    return drafts
