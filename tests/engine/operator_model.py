"""Checkpoints zb-patch did not write, for ``zb-patch selftest --engine --model`` on the CPU stand-in: a tiny
Llama-style target saved by ``transformers`` (``LlamaConfig``, random weights, ``save_pretrained``) with a
word-level tokenizer saved beside it (``PreTrainedTokenizerFast``), and an EAGLE head for it.

Random weights, scaled so that drafting is partly right: the embedding and LM head are drawn large and the decoder
layer small, so the target's next token is mostly a function of the current token (its "bigram") and sometimes not;
the EAGLE head passes the token's embedding through (``fc``) and its own layer adds little, so it drafts that bigram.
"""

from __future__ import annotations

import json
import os

VOCAB = 128
HIDDEN = 512
HEADS = 2
HEAD_DIM = 256  # as zb_patch.check.engine.model: vllm-ascend 0.13's RoPE path at head size 128 is left alone
INTER = 512
LAYER_STD = 0.025  # decoder layers: small against the embedding (std 1): the context moves some greedy choices
SPECIAL = ("<unk>", "<s>", "</s>")


def _config(arch: str, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        architectures=[arch],
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )


def write_tokenizer(path: str) -> None:
    """A word-level tokenizer: ``<unk> <s> </s>`` then ``w3`` .. ``w127``, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)


def write_llama_eagle(root: str, seed: int = 0) -> tuple[str, str]:
    """``root/target`` (transformers' save_pretrained + tokenizer) and ``root/eagle``; returns both paths."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    target_dir, eagle_dir = os.path.join(root, "target"), os.path.join(root, "eagle")
    model = LlamaForCausalLM(_config("LlamaForCausalLM", 1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            std = 1.0 if ("embed_tokens" in name or "lm_head" in name) else LAYER_STD
            p.normal_(0.0, std)
    model.to(torch.bfloat16).save_pretrained(target_dir, safe_serialization=True)
    write_tokenizer(target_dir)

    os.makedirs(eagle_dir, exist_ok=True)
    layer = {k.removeprefix("model."): v for k, v in model.state_dict().items() if k.startswith("model.layers.0.")}
    weights = {k: torch.randn_like(v.float()) * 0.01 for k, v in layer.items() if "input_layernorm" not in k}
    weights["layers.0.post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    fc = torch.zeros(HIDDEN, 2 * HIDDEN)
    fc[:, :HIDDEN] = torch.eye(HIDDEN)  # the token's embedding passes; the target's hidden state is not read
    weights["fc.weight"] = fc
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, os.path.join(eagle_dir, "model.safetensors")
    )
    config = _config("EagleLlamaForCausalLM", 1).to_dict()
    with open(os.path.join(eagle_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return target_dir, eagle_dir
