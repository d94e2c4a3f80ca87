"""Checkpoints zb-patch did not write, for ``zb-patch selftest --engine --model`` on the CPU stand-in: a tiny
Llama-style target saved by ``transformers`` (``LlamaConfig``, random weights, ``save_pretrained``) with a
word-level tokenizer saved beside it (``PreTrainedTokenizerFast``), and an EAGLE head for it in its own directory;
a DeepSeek-V3-style target (``DeepseekV3ForCausalLM``, MLA) saved the same way, with the MTP layer vLLM's DeepSeek MTP
reads added to its checkpoint (:func:`write_deepseek_mtp`).

Random weights, scaled so that drafting is partly right: the embedding and LM head are drawn large and the decoder
layer small, so the target's next token is mostly a function of the current token (its "bigram") and sometimes not;
the EAGLE head passes the token's embedding through (``fc``) and its own layer adds little, so it drafts that bigram.
"""

from __future__ import annotations

import functools
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


def environ_kept(write):
    """``write`` leaves ``os.environ`` as it found it. transformers' modelling imports torch's inductor, which sets
    ``TORCHINDUCTOR_CACHE_DIR`` in the process; in the tests' process that variable would then differ from the engine
    zygote's environment, and the zygote refuses every later engine process of the session (each then imports vLLM
    itself: tests/support/engine_zygote.py)."""

    @functools.wraps(write)
    def wrapper(*args, **kwargs):
        saved = dict(os.environ)
        try:
            return write(*args, **kwargs)
        finally:
            for key in set(os.environ) - set(saved):
                del os.environ[key]
            os.environ.update(saved)

    return wrapper


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


@environ_kept
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


# -- DeepSeek-V3-style: MLA target saved by transformers + its MTP layer added to the checkpoint -------------------

# The widths the emulated NPU MLA ops take (as zb_patch.check.engine.model's DeepSeek target): latent 512, RoPE 64,
# no-RoPE query / key and value heads of 128, 32 query heads.
DS_HIDDEN = 512
DS_HEADS = 32
DS_LAYERS = 1  # target layers; the MTP layer is model.layers.{DS_LAYERS}


def _deepseek_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=VOCAB,
        hidden_size=DS_HIDDEN,
        intermediate_size=INTER,
        moe_intermediate_size=INTER,
        num_hidden_layers=DS_LAYERS,
        num_attention_heads=DS_HEADS,
        num_key_value_heads=DS_HEADS,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        head_dim=64,
        # dense MLPs everywhere: the MoE starts past the last layer, the MTP layer's (index DS_LAYERS) included
        first_k_dense_replace=DS_LAYERS + 2,
        n_routed_experts=2,
        n_shared_experts=1,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_interleave=True,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
        # not a DeepseekV3Config field: kept as an extra attribute and written to config.json, where vLLM's
        # DeepSeek MTP (method "mtp") reads how many MTP layers follow the target's
        num_nextn_predict_layers=1,
    )


@environ_kept
def write_deepseek_mtp(root: str, seed: int = 0) -> str:
    """``root/deepseek``: a ``DeepseekV3ForCausalLM`` (MLA, dense MLP) saved by transformers' save_pretrained with
    random weights and the word-level tokenizer, then its MTP layer added to the checkpoint as vLLM's DeepSeek MTP
    reads it (transformers' model has no MTP layer and writes none): ``model.layers.{num_hidden_layers}.*``, a
    transformers ``DeepseekV3DecoderLayer``'s weights plus ``enorm``, ``hnorm``, ``eh_proj``, ``embed_tokens`` and
    ``shared_head.{norm,head}``, in a second safetensors file listed in the index. The embedding and LM head are drawn
    large and the layers small, as the Llama target's; ``eh_proj`` passes the input token's embedding and the head is
    the target's, so the MTP layer drafts the target's "bigram" of its input token: partly right. Returns the model
    directory."""
    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    torch.manual_seed(seed)
    model_dir = os.path.join(root, "deepseek")
    config = _deepseek_config()
    model = DeepseekV3ForCausalLM(config)
    mtp = DeepseekV3DecoderLayer(config, layer_idx=DS_LAYERS)
    with torch.no_grad():
        for module in (model, mtp):
            for name, p in module.named_parameters():
                if name.endswith("norm.weight"):
                    continue
                std = 1.0 if ("embed_tokens" in name or "lm_head" in name) else LAYER_STD
                p.normal_(0.0, std)
    model.to(torch.bfloat16).save_pretrained(model_dir, safe_serialization=True)
    write_tokenizer(model_dir)

    p = f"model.layers.{DS_LAYERS}"
    state = model.state_dict()
    weights = {f"{p}.{k}": v for k, v in mtp.state_dict().items()}
    eh = torch.zeros(DS_HIDDEN, 2 * DS_HIDDEN)
    eh[:, :DS_HIDDEN] = torch.eye(DS_HIDDEN)  # cat([enorm(embedding), hnorm(previous hidden)]): the embedding passes
    weights.update({
        f"{p}.embed_tokens.weight": state["model.embed_tokens.weight"],
        f"{p}.enorm.weight": torch.ones(DS_HIDDEN),
        f"{p}.hnorm.weight": torch.ones(DS_HIDDEN),
        f"{p}.eh_proj.weight": eh,
        f"{p}.shared_head.norm.weight": torch.ones(DS_HIDDEN),
        f"{p}.shared_head.head.weight": state["lm_head.weight"],
    })  # fmt: skip
    mtp_file = "model-mtp.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, os.path.join(model_dir, mtp_file))
    _index_with(model_dir, mtp_file, list(weights))
    return model_dir


def _index_with(model_dir: str, extra_file: str, names: list[str]) -> None:
    """``model.safetensors.index.json`` listing the checkpoint's files: save_pretrained's (its index, or its one
    ``model.safetensors``) and ``extra_file`` with ``names``."""
    from safetensors import safe_open

    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
    else:
        with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
            index = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), "model.safetensors")}
    index["weight_map"].update(dict.fromkeys(names, extra_file))
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)
