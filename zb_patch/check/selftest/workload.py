"""Seeded workloads: when requests arrive, what they ask for, and when they are aborted.

Everything is decided up front from the seed (arrival iteration, prompt, max_tokens, stop tokens,
abort point), so every mode sees the same requests at the same engine iteration whatever happens in
it.  The mix is chosen to hit, in a few thousand steps: short and long prompts (chunked prefill at a
64-token budget; a quiet phase every 400 iterations where a lone long prompt is prefilled chunk by
chunk with nothing else running), shared prompt prefixes (prefix-cache hits), a small KV pool (preemption and
resumption), stop tokens (random finishes), requests that run into ``max_model_len``, and aborts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .compat import EngineShape

NUM_STOP_TOKENS = 6


@dataclass(frozen=True)
class RequestSpec:
    req_id: str
    arrival: int  # engine iteration
    prompt: tuple[int, ...]
    max_tokens: int
    stop_token_ids: tuple[int, ...]
    abort_after: int | None  # abort once this many output tokens were delivered


def make_workload(seed: int, shape: EngineShape, iterations: int, *, tag: str = "") -> list[RequestSpec]:
    rng = random.Random(seed * 7919 + shape.num_spec_tokens)
    vocab = shape.vocab_size
    prefixes = [tuple(rng.randrange(NUM_STOP_TOKENS, vocab) for _ in range(shape.block_size * 2)) for _ in range(3)]
    specs: list[RequestSpec] = []
    n = 0
    for it in range(iterations):
        phase = (it + 150) % 400
        sparse = phase >= 250  # a quiet phase: drain, then pairs of long prompts prefilled side by side
        if sparse:
            burst = 2 if phase >= 300 and rng.random() < 0.04 else 0
        else:
            burst = 3 if rng.random() < 0.01 else (1 if rng.random() < 0.25 else 0)
        for _ in range(burst):
            u = 0.8 if sparse else rng.random()
            if u < 0.4:
                plen = rng.randint(1, 16)
            elif u < 0.75:
                plen = rng.randint(17, 64)
            elif u < 0.95:
                plen = rng.randint(65, 150)
            else:
                plen = rng.randint(150, shape.max_model_len - 2)
            prompt = [rng.randrange(NUM_STOP_TOKENS, vocab) for _ in range(plen)]
            if plen > shape.block_size * 2 + 2 and rng.random() < 0.6:
                pre = rng.choice(prefixes)
                prompt[: len(pre)] = pre
            v = rng.random()
            if v < 0.55:
                max_tokens = rng.randint(1, 40)
            elif v < 0.9:
                max_tokens = rng.randint(41, 120)
            else:
                max_tokens = shape.max_model_len + 64  # runs into max_model_len unless it stops first
            stops = tuple(range(NUM_STOP_TOKENS)) if rng.random() < 0.5 else ()
            abort_after = rng.randint(0, 30) if rng.random() < 0.08 else None
            specs.append(RequestSpec(f"{tag}r{n}", it, tuple(prompt), max_tokens, stops, abort_after))
            n += 1
    return specs
