"""The engine tests' reference tokens: transformers' own greedy generation on the written checkpoint."""

from __future__ import annotations

import torch

from zb_patch.check.engine import model as tiny_model
from zb_patch.check.engine.workload import Workload


def greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


def reference_tokens(model, wl: Workload) -> dict[str, list[int]]:
    """Per request id: the greedy continuation of its prompt, as many tokens as the workload asks."""
    return {str(i): greedy(model, p, n) for i, (p, n) in enumerate(wl.requests(tiny_model.VOCAB))}
