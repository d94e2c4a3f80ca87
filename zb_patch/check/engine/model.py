"""A tiny Llama-style target and its EAGLE head, and a tiny MiMo target carrying its own MTP layer
(write_mtp_model), written to a directory as config.json + safetensors.

Seeded weights: a random embedding and LM head, random layers at a small scale, and an EAGLE head whose fc
passes the sampled token's embedding through (see eagle_weights). Not yet crafted for wide greedy margins.

Plain config dicts + torch tensors (safetensors writes them): the same files serve ``zb-patch selftest --engine``
on an NPU and the tests' CPU emulation.
"""

from __future__ import annotations

import json
import os

import torch

VOCAB = 128
FIRST_ID = 3  # token ids below are special (bos 1, eos 2)
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTER = 128
TARGET_LAYERS = 2
MAX_POS = 1024
# Random layers at this scale perturb the embedding -> LM-head path enough that the context (attention over the
# KV cache) changes many greedy choices, yet the EAGLE head's "bigram" draft (below) is right about half the time
# (measured: 62 % and 73 % on two CI workloads; 0.1 gives 19 %).
TARGET_LAYER_SCALE = 0.06
EAGLE_LAYER_SCALE = 0.01


def _llama_config(layers: int, arch: str) -> dict:
    return {
        "architectures": [arch],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": MAX_POS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        # "dtype": transformers >= 4.56 (4.57 for vLLM 0.18, 5.x for 0.23) reads it; "torch_dtype" is deprecated
        "dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def write_models(root: str, seed: int = 0) -> tuple[str, str]:
    """Write target and EAGLE draft under ``root``; returns (target_dir, draft_dir)."""
    from safetensors.torch import save_file

    target_dir = os.path.join(root, "target")
    draft_dir = os.path.join(root, "eagle")
    os.makedirs(target_dir, exist_ok=True)
    os.makedirs(draft_dir, exist_ok=True)
    with open(os.path.join(target_dir, "config.json"), "w") as f:
        json.dump(_llama_config(TARGET_LAYERS, "LlamaForCausalLM"), f)
    with open(os.path.join(draft_dir, "config.json"), "w") as f:
        json.dump(_llama_config(1, "EagleLlamaForCausalLM"), f)
    g = torch.Generator().manual_seed(seed)
    save_file(target_weights(g), os.path.join(target_dir, "model.safetensors"))
    save_file(eagle_weights(g), os.path.join(draft_dir, "model.safetensors"))
    return target_dir, draft_dir


def _layer(prefix: str, g: torch.Generator, scale: float) -> dict[str, torch.Tensor]:
    def r(*s):
        return (torch.randn(*s, generator=g) * scale).contiguous()

    return {
        f"{prefix}.input_layernorm.weight": torch.ones(HIDDEN),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(HIDDEN),
        f"{prefix}.self_attn.q_proj.weight": r(HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}.self_attn.k_proj.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}.self_attn.v_proj.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}.self_attn.o_proj.weight": r(HIDDEN, HEADS * HEAD_DIM),
        f"{prefix}.mlp.gate_proj.weight": r(INTER, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": r(INTER, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": r(HIDDEN, INTER),
    }


def target_weights(g: torch.Generator) -> dict[str, torch.Tensor]:
    w = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g),
    }
    for i in range(TARGET_LAYERS):
        w.update(_layer(f"model.layers.{i}", g, TARGET_LAYER_SCALE))
    return w


def eagle_weights(g: torch.Generator) -> dict[str, torch.Tensor]:
    # EAGLE checkpoints name weights without the "model." prefix; embed_tokens and lm_head are shared with the
    # target (vLLM shares them when the checkpoint has none); layer 0 has no input_layernorm.
    # fc = [I, 0]: the head starts from the embedding of the token just sampled and (nearly) ignores the target's
    # hidden state, so its draft is the target's "bigram" reading of that token: right where the target's layers
    # do not move the choice away from it.
    fc = torch.cat([torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)], dim=1)
    w = {"fc.weight": fc.contiguous()}
    w.update({k: v for k, v in _layer("layers.0", g, EAGLE_LAYER_SCALE).items() if "input_layernorm" not in k})
    return w


# -- MTP: a MiMo-style pair (dense Qwen2 target + one MTP layer in the same checkpoint), docs/e2e.md "MTP" ---------

MTP_LAYER_SCALE = 0.01


def write_mtp_model(root: str, seed: int = 0) -> str:
    """Write a ``MiMoForCausalLM`` target with one MTP layer (``model.mtp_layers.0.*``) under ``root``/mimo; vLLM's
    ``method="mtp"`` reads the draft from the target's own checkpoint. Returns the model directory."""
    from safetensors.torch import save_file

    model_dir = os.path.join(root, "mimo")
    os.makedirs(model_dir, exist_ok=True)
    config = _llama_config(TARGET_LAYERS, "MiMoForCausalLM")
    # MiMo's own config class (remote code) is Qwen2Config plus num_nextn_predict_layers; vLLM picks the model by
    # architecture and the MTP draft by it too (SpeculativeConfig.hf_config_override), so plain qwen2 suffices.
    config.update(model_type="qwen2", num_nextn_predict_layers=1, use_sliding_window=False)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    g = torch.Generator().manual_seed(seed)
    w = {}
    for name, t in target_weights(g).items():
        w[name] = t
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):  # Qwen2 attention has qkv biases
            w[name.replace(".weight", ".bias")] = (
                torch.randn(t.shape[0], generator=g) * TARGET_LAYER_SCALE
            ).contiguous()
    w.update(mtp_weights(g))
    save_file(w, os.path.join(model_dir, "model.safetensors"))
    return model_dir


def mtp_weights(g: torch.Generator) -> dict[str, torch.Tensor]:
    # Names as vLLM's MiMoMTP.load_weights maps them: the norms and input_proj at model.mtp_layers.0, the decoder
    # block's weights beside them (it inserts "mtp_block."). embed_tokens is shared with the target; the MTP layer
    # reads lm_head.weight from the same checkpoint.
    # input_proj acts on cat([target hidden, token embedding]); [0, I] passes the sampled token's (normalised)
    # embedding through, so the draft is the target's "bigram" reading of that token (as eagle_weights' fc).
    p = "model.mtp_layers.0"
    w = {
        f"{p}.token_layernorm.weight": torch.ones(HIDDEN),
        f"{p}.hidden_layernorm.weight": torch.ones(HIDDEN),
        f"{p}.input_proj.weight": torch.cat([torch.zeros(HIDDEN, HIDDEN), torch.eye(HIDDEN)], dim=1).contiguous(),
        f"{p}.final_layernorm.weight": torch.ones(HIDDEN),
    }
    block = _layer(p, g, MTP_LAYER_SCALE)
    for proj in ("q_proj", "k_proj", "v_proj"):
        rows = block[f"{p}.self_attn.{proj}.weight"].shape[0]
        block[f"{p}.self_attn.{proj}.bias"] = (torch.randn(rows, generator=g) * MTP_LAYER_SCALE).contiguous()
    w.update(block)
    return w
