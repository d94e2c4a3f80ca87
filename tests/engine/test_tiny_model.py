"""Properties of the tiny target model, shown with transformers' own Llama (no vLLM, no NPU emulation)."""

from __future__ import annotations

import pytest
import torch

from zb_patch.check.engine import model as tiny_model
from zb_patch.check.engine.workload import Workload

transformers = pytest.importorskip(
    "transformers", reason="the tiny-model reference needs transformers (va013-e2e / va018-e2e / va023-e2e envs)"
)


@pytest.fixture(scope="module", params=["eagle", "mtp"])
def target(request, tmp_path_factory):
    """The EAGLE pair's Llama target, or the MTP model's MiMo target as transformers' Qwen2 (MiMo's base)."""
    root = str(tmp_path_factory.mktemp("tiny"))
    if request.param == "mtp":
        return transformers.Qwen2ForCausalLM.from_pretrained(
            tiny_model.write_mtp_model(root), dtype=torch.float32
        ).eval()
    target_dir, _ = tiny_model.write_models(root)
    return transformers.LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


def test_tokens_depend_on_attention_over_the_kv_cache(target):
    """Changing only the FIRST prompt token (the oldest KV-cache entry) changes the greedy continuation of most
    requests: a wrong slot or a stale sequence length in the KV cache would change the output."""
    changed = 0
    reqs = Workload().requests(tiny_model.VOCAB)
    for prompt, n in reqs:
        if len(prompt) < 2:
            continue
        other = [
            tiny_model.FIRST_ID + (prompt[0] - tiny_model.FIRST_ID + 1) % (tiny_model.VOCAB - tiny_model.FIRST_ID),
            *prompt[1:],
        ]
        changed += greedy(target, prompt, n) != greedy(target, other, n)
    assert changed >= len(reqs) // 2, f"only {changed} of {len(reqs)} continuations depend on the first token"


def reference_tokens(model, wl: Workload) -> dict[str, list[int]]:
    return {str(i): greedy(model, p, n) for i, (p, n) in enumerate(wl.requests(tiny_model.VOCAB))}
