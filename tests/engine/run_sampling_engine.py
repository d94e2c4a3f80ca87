"""Test launcher of one engine configuration for tests/engine/test_sampling_engine.py: tests/engine/run_defect_engine.py
(NPU emulation, worker double, the product's engine child, the recorders) with the workload's requests sampled beyond
greedy: ``--sampling JSON`` holds the ``SamplingParams`` fields every request gets; with ``seed_base`` request ``i``
also gets its own ``seed`` (``seed_base + i``; a device generator, which the CPU emulation cannot make), and, where
``greedy_every`` is set, every ``greedy_every``-th request is greedy (mixed batches).

    python tests/engine/run_sampling_engine.py --sampling '{"temperature": 0.8, "seed_base": 1000}' --models DIR ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "support"))
sys.path.insert(0, HERE)


def sampled_generate(fields: dict):
    """``child.generate`` with ``fields`` for every request (see the module docstring)."""
    fields = dict(fields)
    seed_base = fields.pop("seed_base", None)
    greedy_every = fields.pop("greedy_every", 0)

    def generate(llm, wl) -> list:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from zb_patch.check.engine.model import VOCAB

        reqs = wl.requests(VOCAB)
        params = []
        for i, (_, n) in enumerate(reqs):
            own = dict(fields) if seed_base is None else {**fields, "seed": seed_base + i}
            if greedy_every and i % greedy_every == greedy_every - 1:
                own["temperature"] = 0.0
            own["min_tokens"] = min(own.get("min_tokens", 0), n)
            params.append(SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False, **own))
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs]
        return llm.generate(prompts, params, use_tqdm=False)

    return generate


def unpinned_host_tensors() -> None:
    """vllm-ascend's random-sampling path makes host tensors with a hard-coded ``pin_memory=True``
    (``sample/rejection_sampler.py``: ``expand_pytorch``, ``rejection_random_sample_pytorch``), which a CPU-only
    torch can only do with an accelerator's hooks registered; the emulation has none, so host tensors are made
    unpinned here (pinning changes no value)."""
    import functools

    import torch

    def unpinned(make):
        @functools.wraps(make)
        def call(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return make(*args, **kwargs)

        return call

    for name in ("tensor", "arange", "full", "ones", "zeros", "empty"):
        setattr(torch, name, unpinned(getattr(torch, name)))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--sampling", default="{}", help="SamplingParams fields as JSON (+ seed_base, greedy_every)")
    args, rest = ap.parse_known_args(argv)
    from zb_patch.check.engine import child

    generate = sampled_generate(json.loads(args.sampling))
    unpinned_host_tensors()
    import run_defect_engine

    child.generate = generate  # child.main calls the module's generate
    return run_defect_engine.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
