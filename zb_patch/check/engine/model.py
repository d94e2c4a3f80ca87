"""A tiny Llama-style target and its EAGLE head, and a tiny MiMo target carrying its own MTP layer
(write_mtp_model), written to a directory as config.json + safetensors.

The weights are constructed, not trained or random, so that three properties hold by design (docs/e2e.md,
"Model"; shown by tests/engine/test_tiny_model.py):

- the next token is read through the KV cache: attention head 0 fetches the current token from the cache entry
  at distance 0, head 1 the "class" (one of CLASSES) of the token at distance 1, both by position alone (RoPE
  query / key built from a constant feature, scores peaked at that distance); the LM head sees neither token
  through the residual stream. A slot off by one, a missing or stale entry, a wrong position change the output.
- the next token is ``SUCCESSOR[class of previous token][current token]``: a lookup in the MLP (one SwiGLU unit
  per (token, class) pair, an AND of two one-hot features) that writes a one-hot vote the LM head reads. Every
  greedy choice wins by LOGIT_MARGIN; everything else sits at (nearly) 0.
- the EAGLE head knows the successor tables of classes EAGLE_CLASSES only, and learns the class from the
  target's hidden state, which it finds at full strength only in the first draft position (its own hidden state
  carries the class feature 1/NORM_FINAL as strong): first drafts are right for classes 0 and 1, later drafts
  only for class 0 (its "bigram" fallback, SUCCESSOR[0]).

Plain config dicts + torch tensors (safetensors writes them): the same files serve ``zb-patch selftest --engine``
on an NPU and the tests' CPU emulation.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

import torch

VOCAB = 128
FIRST_ID = 3  # token ids below are special (bos 1, eos 2); prompts and SUCCESSOR use ids >= FIRST_ID
CLASSES = 4  # class 0 (about half the tokens) selects SUCCESSOR[0], the EAGLE head's fallback guess
EAGLE_CLASSES = (0, 1)  # successor tables the EAGLE head knows
# head 0's value is the one-hot token (>= VOCAB dims). Not 128: at head size 128 vllm-ascend 0.13 applies RoPE with
# cos / sin precomputed per step (npu_apply_rotary_pos_emb), which its MTP proposer never refreshes
HEAD_DIM = 256
HEADS = 2
MAX_POS = 1024
ROPE_THETA = 10000.0
RMS_EPS = 1e-5
LOGIT_MARGIN = 10.0
# The dtype the checkpoints are written in and the engine runs in: the NPU attention and KV-cache ops take float16 /
# bfloat16 (npu_fused_infer_attention_score, ATB ReshapeAndCache and Rope refuse float32), and bfloat16 is what the
# Ascend deployments of these model families run. The construction keeps every greedy margin near LOGIT_MARGIN at
# bfloat16's precision (tests/engine/test_tiny_model.py asserts it).
DTYPE = "bfloat16"

# Residual stream layout: one-hot features of magnitude 1 in disjoint subspaces.
EMB = 0  # token embedding (one-hot), the residual's copy of the current token
BIAS = EMB + VOCAB  # constant 1: source of the positional queries / keys, the MLP's thresholds
CUR = BIAS + 1  # current token as read from the KV cache (head 0)
PREV = CUR + VOCAB  # class of the previous token as read from the KV cache (head 1)
VOTE = PREV + CLASSES  # the vote for the next token, read by the LM head
# vLLM's Qwen2 (the MiMo target and its MTP block) derives head_dim as hidden_size / heads
HIDDEN = HEADS * HEAD_DIM  # >= VOTE + VOCAB
TARGET_INTER = VOCAB * CLASSES
EAGLE_INTER = VOCAB * (len(EAGLE_CLASSES) + 1)

# Attention scores depend on the distance d = query position - key position alone (queries and keys are built
# from the constant BIAS feature; RoPE rotates them): SCORE_GAP * g(d), with g the smallest (L1) combination of
# the RoPE frequencies' cos / sin that is 0 at the head's distance and <= -1 at every other d in [0, MAX_POS)
# (score_kernel). All but ~e^-SCORE_GAP of the softmax weight sits on the one key at that distance; a zero key
# (a never-written slot) ties with it.
SCORE_GAP = 25.0
# The target's head 0 (distance 0) also scores keys from up to FUTURE positions ahead -- stale entries past the
# sequence's end, e.g. rejected drafts -- at >= 0: read with a too-long sequence length they take half the
# weight or more.
FUTURE = 16
# SwiGLU unit = AND of two one-hot features: gate pre-activation GATE * (a + b - 1.5) is +-GATE/2 or below, so
# silu leaks GATE/2 * e^-(GATE/2) ~ 4e-8 of a firing unit's output.
GATE = 40.0


def _rope_theta(rope_dim: int = HEAD_DIM) -> torch.Tensor:
    return ROPE_THETA ** (-torch.arange(rope_dim // 2, dtype=torch.float64) * 2 / rope_dim)


def score_kernel(
    distance: int, peak: float, future: int = 0, future_wins: bool = False, rope_dim: int = HEAD_DIM
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b): g(d) = sum_i a_i cos(theta_i d) + b_i sin(theta_i d) over the RoPE frequencies theta_i with
    g(distance) = peak, g(d) <= peak - 1 for the other d in [0, MAX_POS), and for d in [-future, 0) (keys ahead of
    the query) g(d) >= peak if ``future_wins`` else g(d) <= peak - 1; the one with the smallest sum |a| + |b| (a
    linear program, scipy's HiGHS: deterministic)."""
    import numpy as np
    from scipy.optimize import linprog

    theta = _rope_theta(rope_dim).numpy()
    d = np.arange(-future, MAX_POS, dtype=np.float64)
    basis = np.hstack([np.cos(np.outer(d, theta)), np.sin(np.outer(d, theta))])
    other, ahead = d != distance, np.zeros_like(d, dtype=bool)
    if future_wins:
        other, ahead = (d >= 0) & (d != distance), d < 0
    a_ub = np.vstack([basis[other], -basis[ahead]])
    b_ub = np.concatenate([np.full(other.sum(), peak - 1.0), np.full(ahead.sum(), -peak)])
    a_eq = basis[d == distance]
    # coefficients x+ - x-, both >= 0, minimising sum(x+ + x-)
    res = linprog(
        np.ones(2 * basis.shape[1]),
        A_ub=np.hstack([a_ub, -a_ub]),
        b_ub=b_ub,
        A_eq=np.hstack([a_eq, -a_eq]),
        b_eq=[peak],
        bounds=(0, None),
        method="highs",
    )
    assert res.status == 0, res.message
    coef = torch.from_numpy(res.x[: basis.shape[1]] - res.x[basis.shape[1] :])
    return coef[: len(theta)], coef[len(theta) :]


def _rms_scale(active: float) -> float:
    """What RMSNorm (weight 1) multiplies a residual with ``active`` unit one-hot features by."""
    return 1.0 / math.sqrt(active / HIDDEN + RMS_EPS)


NORM_IN = _rms_scale(2)  # layer input: EMB, BIAS
NORM_MLP = _rms_scale(4)  # + CUR, PREV
NORM_FINAL = _rms_scale(5)  # + VOTE


def tables(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(SUCCESSOR [CLASSES, VOCAB], CLASS [VOCAB]). SUCCESSOR[0] is a permutation of the ordinary ids; the other
    classes give each token a different successor; half the ordinary ids are class 0, the rest split evenly."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.arange(FIRST_ID, VOCAB)
    n = len(ids)
    succ = torch.empty(CLASSES, VOCAB, dtype=torch.long)
    succ[0] = ids[torch.randint(n, (VOCAB,), generator=g)]
    succ[0, FIRST_ID:] = ids[torch.randperm(n, generator=g)]
    for t in range(VOCAB):
        others = ids[ids != succ[0, t]]
        succ[1:, t] = others[torch.randperm(len(others), generator=g)[: CLASSES - 1]]
    cls = torch.zeros(VOCAB, dtype=torch.long)
    order = ids[torch.randperm(n, generator=g)]
    for j, chunk in enumerate(order[n // 2 :].chunk(CLASSES - 1), start=1):
        cls[chunk] = j
    return succ, cls


def _llama_config(layers: int, arch: str, inter: int) -> dict:
    return {
        "architectures": [arch],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": MAX_POS,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        # "dtype": transformers >= 4.56 (4.57 for vLLM 0.18, 5.x for 0.23) reads it; "torch_dtype" is deprecated
        "dtype": DTYPE,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def write_models(root: str, seed: int = 0) -> tuple[str, str]:
    """Write target and EAGLE draft under ``root``; returns (target_dir, draft_dir)."""
    target_dir = os.path.join(root, "target")
    draft_dir = os.path.join(root, "eagle")
    os.makedirs(target_dir, exist_ok=True)
    os.makedirs(draft_dir, exist_ok=True)
    with open(os.path.join(target_dir, "config.json"), "w") as f:
        json.dump(_llama_config(1, "LlamaForCausalLM", TARGET_INTER), f)
    with open(os.path.join(draft_dir, "config.json"), "w") as f:
        json.dump(_llama_config(1, "EagleLlamaForCausalLM", EAGLE_INTER), f)
    succ, cls = tables(seed)
    _save(target_weights(succ, cls), target_dir)
    _save(eagle_weights(succ, cls), draft_dir)
    return target_dir, draft_dir


def _save(weights: dict[str, torch.Tensor], model_dir: str) -> None:
    """The constructed (float32) weights rounded to DTYPE: the checkpoint holds what the engine computes with."""
    from safetensors.torch import save_file

    dtype = getattr(torch, DTYPE)
    save_file({name: w.to(dtype) for name, w in weights.items()}, os.path.join(model_dir, "model.safetensors"))


def _positional_qk(distance: int, peak: float, future: int, future_wins: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(query, key) of one head, to be multiplied by the constant feature: after RoPE at positions m, n (rotate-half
    pairs (i, i + D/2), a complex number z_i each, rotated by theta_i * position) the score q.k / sqrt(HEAD_DIM)
    is Re(sum_i z_q,i conj(z_k,i) e^(i theta_i (m - n))) = SCORE_GAP * g(m - n), g from score_kernel."""
    a, b = score_kernel(distance, peak, future, future_wins)
    w = torch.complex(a, -b) * SCORE_GAP * math.sqrt(HEAD_DIM)
    zk = w.abs().sqrt()
    zq = torch.where(zk > 0, w / zk.clamp_min(1e-300), 0)
    return torch.cat([zq.real, zq.imag]).float(), torch.cat([zk, torch.zeros_like(zk)]).float()


def _attention(prefix: str, norm: float, heads: list[tuple[tuple[int, float, int, bool], torch.Tensor, int]]):
    """One entry per head: (score_kernel's arguments, value rows [VOCAB] (which value dim each token
    id's EMB feature goes to), the residual dim its value dim 0 is added to). ``norm``: the scale of the layer's
    (normalised) input features."""
    q = torch.zeros(HEADS * HEAD_DIM, HIDDEN)
    k = torch.zeros(HEADS * HEAD_DIM, HIDDEN)
    v = torch.zeros(HEADS * HEAD_DIM, HIDDEN)
    o = torch.zeros(HIDDEN, HEADS * HEAD_DIM)
    for h, (scores, rows, out) in enumerate(heads):
        at = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
        qh, kh = _positional_qk(*scores)
        q[at, BIAS], k[at, BIAS] = qh / norm, kh / norm
        v[h * HEAD_DIM + rows, EMB + torch.arange(VOCAB)] = 1 / norm
        width = int(rows.max()) + 1
        o[out + torch.arange(width), h * HEAD_DIM + torch.arange(width)] = 1
    return {
        f"{prefix}.self_attn.q_proj.weight": q,
        f"{prefix}.self_attn.k_proj.weight": k,
        f"{prefix}.self_attn.v_proj.weight": v,
        f"{prefix}.self_attn.o_proj.weight": o,
        f"{prefix}.post_attention_layernorm.weight": torch.ones(HIDDEN),
    }


def _and_unit(gate, up, down, unit: int, features: Sequence[tuple[int, float]], threshold: float, out: int):
    """SwiGLU unit writing 1 into residual dim ``out`` iff sum(weight * feature) > threshold, where features are
    0 or 1 (normalised by NORM_MLP) and the sum sits at least 0.5 away from the threshold."""
    for dim, weight in features:
        gate[unit, dim] = GATE * weight / NORM_MLP
    gate[unit, BIAS] = -GATE * threshold / NORM_MLP
    up[unit, BIAS] = 1 / NORM_MLP
    down[out, unit] = 1 / torch.nn.functional.silu(torch.tensor(GATE / 2)).item()


def target_weights(succ: torch.Tensor, cls: torch.Tensor) -> dict[str, torch.Tensor]:
    tok = torch.arange(VOCAB)
    embed = torch.zeros(VOCAB, HIDDEN)
    embed[tok, EMB + tok] = 1
    embed[:, BIAS] = 1
    lm_head = torch.zeros(VOCAB, HIDDEN)
    lm_head[tok, VOTE + tok] = LOGIT_MARGIN / NORM_FINAL
    gate, up, down = (
        torch.zeros(TARGET_INTER, HIDDEN),
        torch.zeros(TARGET_INTER, HIDDEN),
        torch.zeros(HIDDEN, TARGET_INTER),
    )
    for t in range(VOCAB):
        for j in range(CLASSES):
            _and_unit(gate, up, down, t * CLASSES + j, [(CUR + t, 1), (PREV + j, 1)], 1.5, VOTE + int(succ[j, t]))
    return {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": lm_head,
        "model.layers.0.input_layernorm.weight": torch.ones(HIDDEN),
        **_attention(
            "model.layers.0",
            NORM_IN,
            [((0, 0.0, FUTURE, True), torch.arange(VOCAB), CUR), ((1, 0.0, 0, False), cls, PREV)],
        ),
        "model.layers.0.mlp.gate_proj.weight": gate,
        "model.layers.0.mlp.up_proj.weight": up,
        "model.layers.0.mlp.down_proj.weight": down,
    }


def _draft_vote_mlp(succ: torch.Tensor, inter: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A drafter's MLP (gate, up, down; ``inter`` units): for the input token t (CUR) and a class j of EAGLE_CLASSES
    in PREV it votes SUCCESSOR[j][t], for any other class SUCCESSOR[0][t]. Shared by the EAGLE head and the MTP
    layer."""
    gate, up, down = torch.zeros(inter, HIDDEN), torch.zeros(inter, HIDDEN), torch.zeros(HIDDEN, inter)
    known = len(EAGLE_CLASSES)
    for t in range(VOCAB):
        for i, j in enumerate(EAGLE_CLASSES):
            _and_unit(gate, up, down, t * (known + 1) + i, [(CUR + t, 1), (PREV + j, 1)], 1.5, VOTE + int(succ[j, t]))
        fallback = [(CUR + t, 1)] + [(PREV + j, -1) for j in EAGLE_CLASSES]
        _and_unit(gate, up, down, t * (known + 1) + known, fallback, 0.5, VOTE + int(succ[0, t]))
    return gate, up, down


def eagle_weights(succ: torch.Tensor, cls: torch.Tensor) -> dict[str, torch.Tensor]:
    """EAGLE checkpoints name weights without the "model." prefix; embed_tokens and lm_head are shared with the
    target (vLLM shares them when the checkpoint has none); layer 0 has no input_layernorm and there is no final
    norm, so the layer sees fc's output unnormalised and the LM head the layer's output.

    fc: the embedding (EMB, BIAS) passes through; the hidden state's CUR (the target's current token, at NORM_FINAL
    after its final norm) becomes the class one-hot in PREV at strength 1 -- or 1 / NORM_FINAL from the head's own
    output (CUR at 1), too weak for the class units. Head 0 reads the input token through the head's own KV cache
    into CUR; the MLP votes SUCCESSOR[j][token] for a class j in EAGLE_CLASSES, else SUCCESSOR[0][token] (scaled so
    the shared LM head gives LOGIT_MARGIN)."""
    tok = torch.arange(VOCAB)
    fc = torch.zeros(HIDDEN, 2 * HIDDEN)
    fc[EMB + tok, EMB + tok] = 1
    fc[BIAS, BIAS] = 1
    fc[PREV + cls, HIDDEN + CUR + tok] = 1 / NORM_FINAL
    # the layer's MLP input: EMB, BIAS, CUR, PREV at 1 -- the same normalisation as the target's
    gate, up, down = _draft_vote_mlp(succ, EAGLE_INTER)
    down *= NORM_FINAL
    w = {"fc.weight": fc}
    # head 0 scores its key 1 above every other, keys ahead included: the head's drafting passes see entries of
    # rejected positions past their query (docs/e2e.md, "Model"); a never-written slot takes no weight either
    w.update(_attention("layers.0", 1.0, [((0, 1.0, FUTURE, False), torch.arange(VOCAB), CUR)]))
    w.update(
        {
            "layers.0.mlp.gate_proj.weight": gate,
            "layers.0.mlp.up_proj.weight": up,
            "layers.0.mlp.down_proj.weight": down,
        }
    )
    return w


# -- MTP: a MiMo-style pair (dense Qwen2 target + one MTP layer in one checkpoint), docs/e2e.md "MTP drafter" ------


def write_mtp_model(root: str, seed: int = 0) -> str:
    """Write a ``MiMoForCausalLM`` target with one MTP layer (``model.mtp_layers.0.*``) under ``root``/mimo; vLLM's
    ``method="mtp"`` reads the draft from the target's own checkpoint. The target is the Llama target's weights
    (Qwen2's q/k/v biases zero): the same tokens. Returns the model directory."""
    model_dir = os.path.join(root, "mimo")
    os.makedirs(model_dir, exist_ok=True)
    config = _llama_config(1, "MiMoForCausalLM", TARGET_INTER)
    # MiMo's own config class (remote code) is Qwen2Config plus num_nextn_predict_layers; vLLM picks the model by
    # architecture and the MTP draft by it too (SpeculativeConfig.hf_config_override), so plain qwen2 suffices.
    config.update(model_type="qwen2", num_nextn_predict_layers=1, use_sliding_window=False)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    succ, cls = tables(seed)
    w = {}
    for name, t in target_weights(succ, cls).items():
        w[name] = t
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):  # Qwen2 attention has qkv biases
            w[name.replace(".weight", ".bias")] = torch.zeros(t.shape[0])
    w.update(mtp_weights(succ, cls))
    _save(w, model_dir)
    return model_dir


def mtp_weights(succ: torch.Tensor, cls: torch.Tensor) -> dict[str, torch.Tensor]:
    """The EAGLE head's construction in vLLM's ``MiMoMultiTokenPredictorLayer``: ``input_proj`` acts on
    cat([hidden_layernorm(previous hidden), token_layernorm(embedding)]); it passes the embedding's EMB, BIAS through
    and turns the previous hidden state's CUR into the class one-hot in PREV. The block (a Qwen2 decoder layer,
    names as vLLM's MiMoMTP.load_weights maps them: it inserts "mtp_block.") reads the input token through its own
    KV cache into CUR and votes as the EAGLE head's MLP; ``final_layernorm`` has weight 0 on CUR, so the layer's own
    output -- the previous hidden state of every later draft -- carries no class: later drafts fall back to
    SUCCESSOR[0]. The MiMo target's hidden state carries CUR: first drafts are right for classes EAGLE_CLASSES.
    vLLM zeroes the embedding at position 0: no feature, all logits 0 there (draft token 0, rejected).
    embed_tokens and lm_head are the target's (shared)."""
    p = "model.mtp_layers.0"
    tok = torch.arange(VOCAB)
    proj = torch.zeros(HIDDEN, 2 * HIDDEN)
    proj[EMB + tok, HIDDEN + EMB + tok] = 1 / NORM_IN
    proj[BIAS, HIDDEN + BIAS] = 1 / NORM_IN
    proj[PREV + cls, CUR + tok] = 1 / NORM_FINAL  # hidden_layernorm: the target's 5 features at NORM_FINAL
    final = torch.ones(HIDDEN)
    final[CUR : CUR + VOCAB] = 0
    gate, up, down = _draft_vote_mlp(succ, TARGET_INTER)
    w = {
        f"{p}.token_layernorm.weight": torch.ones(HIDDEN),
        f"{p}.hidden_layernorm.weight": torch.ones(HIDDEN),
        f"{p}.input_proj.weight": proj,
        f"{p}.final_layernorm.weight": final,
        f"{p}.input_layernorm.weight": torch.ones(HIDDEN),
        # the block's input: EMB, BIAS, PREV at 1
        **_attention(p, _rms_scale(3), [((0, 1.0, FUTURE, False), torch.arange(VOCAB), CUR)]),
        f"{p}.mlp.gate_proj.weight": gate,
        f"{p}.mlp.up_proj.weight": up,
        f"{p}.mlp.down_proj.weight": down,
    }
    for proj_name in ("q_proj", "k_proj", "v_proj"):
        rows = w[f"{p}.self_attn.{proj_name}.weight"].shape[0]
        w[f"{p}.self_attn.{proj_name}.bias"] = torch.zeros(rows)
    return w


# -- DeepSeek-V3-style: MLA + its MTP layer (write_deepseek_model), docs/e2e.md "MLA (DeepSeek-style) + MTP" -----

# The widths the NPU MLA ops take (FIA's MLA mode, Ring MLA, npu_kv_rmsnorm_rope_cache): latent 512, RoPE 64, no-RoPE
# query / key and value heads of 128, 32 query heads. The construction uses two heads; the other 30 have zero weights.
DS_HEADS = 32
DS_KV_LORA = 512
DS_Q_LORA = 64
DS_NOPE = 128
DS_ROPE = 64
DS_V = 128
DS_QK = DS_NOPE + DS_ROPE
# The residual stream of the Llama target plus CUR_MTP: the MTP block reads its input token there (not into CUR), so
# the MTP layer's own output -- the previous hidden state of every later draft -- carries no CUR for eh_proj to turn
# into a class (later drafts fall back to SUCCESSOR[0], as the EAGLE head's do).
CUR_MTP = VOTE + VOCAB
DS_HIDDEN = 640  # >= CUR_MTP + VOCAB
DS_LAYERS = 1  # target layers; the MTP layer is model.layers.{DS_LAYERS}


def _ds_rms(active: float, width: int = DS_HIDDEN) -> float:
    """What RMSNorm (weight 1) multiplies ``active`` unit one-hot features of a ``width``-wide vector by."""
    return 1.0 / math.sqrt(active / width + RMS_EPS)


DS_NORM_IN = _ds_rms(2)  # EMB, BIAS
DS_NORM_MLP = _ds_rms(4)  # + CUR, PREV
DS_NORM_FINAL = _ds_rms(5)  # + VOTE


def _ds_config() -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": VOCAB,
        "hidden_size": DS_HIDDEN,
        "intermediate_size": TARGET_INTER,
        "moe_intermediate_size": VOCAB,
        "num_hidden_layers": DS_LAYERS,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": DS_HEADS,
        "num_key_value_heads": DS_HEADS,
        "q_lora_rank": DS_Q_LORA,
        "kv_lora_rank": DS_KV_LORA,
        "qk_nope_head_dim": DS_NOPE,
        "qk_rope_head_dim": DS_ROPE,
        "v_head_dim": DS_V,
        # dense MLPs everywhere: the MoE starts past the last layer, the MTP layer's (index DS_LAYERS) included
        "first_k_dense_replace": DS_LAYERS + 2,
        "n_routed_experts": 2,
        "n_shared_experts": 1,
        "num_experts_per_tok": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POS,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "rope_interleave": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "dtype": DTYPE,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def write_deepseek_model(root: str, seed: int = 0) -> str:
    """Write a ``DeepseekV3ForCausalLM`` target (one MLA layer, dense MLP) with one MTP layer
    (``model.layers.{DS_LAYERS}.*``, vLLM's ``method="mtp"`` reads it from the target's checkpoint) under
    ``root``/deepseek. The same tables as the Llama target: the same greedy tokens. Returns the model directory."""
    model_dir = os.path.join(root, "deepseek")
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(_ds_config(), f)
    succ, cls = tables(seed)
    w = deepseek_target_weights(succ, cls)
    w.update(deepseek_mtp_weights(succ, cls, w))
    _save(w, model_dir)
    return model_dir


def _ds_rope_query(distance: int, peak: float, future: int, future_wins: bool) -> torch.Tensor:
    """One head's RoPE query (64 dims, interleaved pairs) against the shared RoPE key (1, 0, 1, 0, ...): after RoPE
    at positions m, n the score q . k * DS_QK^-0.5 is SCORE_GAP * g(m - n), g from score_kernel over the 32 RoPE
    frequencies. The pair (2i, 2i + 1) is the complex number z_i; the score is Re(sum_i z_i e^(i theta_i (m - n)))
    * scale, so z_i = (a_i - i b_i) * SCORE_GAP / scale."""
    a, b = score_kernel(distance, peak, future, future_wins, rope_dim=DS_ROPE)
    q = torch.zeros(DS_ROPE, dtype=torch.float64)
    q[0::2], q[1::2] = a, -b
    return (q * SCORE_GAP * math.sqrt(DS_QK)).float()


def _ds_attention(prefix: str, norm: float, heads: list[tuple[tuple[int, float, int, bool], torch.Tensor, int]]):
    """MLA weights (vLLM / transformers names) for heads reading by position: per head (score_kernel's arguments,
    value rows [VOCAB] (which value dim each token id goes to), the residual dim its value dim 0 is added to).
    The query comes from BIAS alone (q_a -> one q-LoRA feature -> q_a_layernorm -> q_b_proj: the RoPE part; the no-RoPE
    part is 0), the shared RoPE key from BIAS (kv_a_proj_with_mqa's last 64 rows: (1, 0, 1, 0, ...)), the latent
    from EMB (the token one-hot in its first VOCAB dims; kv_a_layernorm scales it back to 1), the values from the
    latent (kv_b_proj's value rows). ``norm``: the scale of the layer's normalised input features."""
    q_a = torch.zeros(DS_Q_LORA, DS_HIDDEN)
    q_a[0, BIAS] = 1 / norm
    q_b = torch.zeros(DS_HEADS * DS_QK, DS_Q_LORA)
    kv_a = torch.zeros(DS_KV_LORA + DS_ROPE, DS_HIDDEN)
    kv_a[torch.arange(VOCAB), EMB + torch.arange(VOCAB)] = 1 / norm
    kv_a[DS_KV_LORA + torch.arange(0, DS_ROPE, 2), BIAS] = 1 / norm
    kv_b = torch.zeros(DS_HEADS * (DS_NOPE + DS_V), DS_KV_LORA)
    o = torch.zeros(DS_HIDDEN, DS_HEADS * DS_V)
    for h, (scores, rows, out) in enumerate(heads):
        q_b[h * DS_QK + DS_NOPE : (h + 1) * DS_QK, 0] = _ds_rope_query(*scores)
        kv_b[h * (DS_NOPE + DS_V) + DS_NOPE + rows, torch.arange(VOCAB)] = 1
        width = int(rows.max()) + 1
        o[out + torch.arange(width), h * DS_V + torch.arange(width)] = 1
    p = f"{prefix}.self_attn"
    return {
        f"{p}.q_a_proj.weight": q_a,
        f"{p}.q_a_layernorm.weight": torch.full((DS_Q_LORA,), 1 / _ds_rms(1, DS_Q_LORA)),
        f"{p}.q_b_proj.weight": q_b,
        f"{p}.kv_a_proj_with_mqa.weight": kv_a,
        f"{p}.kv_a_layernorm.weight": torch.full((DS_KV_LORA,), 1 / _ds_rms(1, DS_KV_LORA)),
        f"{p}.kv_b_proj.weight": kv_b,
        f"{p}.o_proj.weight": o,
        f"{prefix}.input_layernorm.weight": torch.ones(DS_HIDDEN),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(DS_HIDDEN),
    }


def _ds_and_unit(gate, up, down, unit: int, features, threshold: float, out: int, norm: float) -> None:
    """_and_unit on the DeepSeek residual (its own normalisation)."""
    for dim, weight in features:
        gate[unit, dim] = GATE * weight / norm
    gate[unit, BIAS] = -GATE * threshold / norm
    up[unit, BIAS] = 1 / norm
    down[out, unit] = 1 / torch.nn.functional.silu(torch.tensor(GATE / 2)).item()


def deepseek_target_weights(succ: torch.Tensor, cls: torch.Tensor) -> dict[str, torch.Tensor]:
    """The Llama target's construction (docs/e2e.md "Model") with MLA attention: head 0 reads the current token
    (distance 0) into CUR, head 1 the previous token's class (distance 1) into PREV, the MLP looks up
    SUCCESSOR[class][token], the LM head reads VOTE."""
    tok = torch.arange(VOCAB)
    embed = torch.zeros(VOCAB, DS_HIDDEN)
    embed[tok, EMB + tok] = 1
    embed[:, BIAS] = 1
    lm_head = torch.zeros(VOCAB, DS_HIDDEN)
    lm_head[tok, VOTE + tok] = LOGIT_MARGIN / DS_NORM_FINAL
    gate, up = torch.zeros(TARGET_INTER, DS_HIDDEN), torch.zeros(TARGET_INTER, DS_HIDDEN)
    down = torch.zeros(DS_HIDDEN, TARGET_INTER)
    for t in range(VOCAB):
        for j in range(CLASSES):
            features = [(CUR + t, 1), (PREV + j, 1)]
            _ds_and_unit(gate, up, down, t * CLASSES + j, features, 1.5, VOTE + int(succ[j, t]), DS_NORM_MLP)
    return {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": torch.ones(DS_HIDDEN),
        "lm_head.weight": lm_head,
        **_ds_attention(
            "model.layers.0",
            DS_NORM_IN,
            [((0, 0.0, FUTURE, True), torch.arange(VOCAB), CUR), ((1, 0.0, 0, False), cls, PREV)],
        ),
        "model.layers.0.mlp.gate_proj.weight": gate,
        "model.layers.0.mlp.up_proj.weight": up,
        "model.layers.0.mlp.down_proj.weight": down,
    }


def deepseek_mtp_weights(
    succ: torch.Tensor, cls: torch.Tensor, target: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """vLLM's ``DeepSeekMultiTokenPredictorLayer`` (names as ``DeepSeekMTP.load_weights`` reads them): ``eh_proj`` on
    cat([enorm(embedding), hnorm(previous hidden)]) passes the embedding's EMB, BIAS and turns the previous hidden
    state's CUR into the class one-hot in PREV; the block (a DeepSeek decoder layer, dense MLP) reads its input token
    through its own KV cache into CUR_MTP and votes SUCCESSOR[j][token] for the classes j in EAGLE_CLASSES, else
    SUCCESSOR[0][token]; ``shared_head`` = a norm and the target's LM head. The layer returns its pre-norm hidden
    state, which carries CUR_MTP but no CUR: later drafts find no class (SUCCESSOR[0]). vLLM zeroes the embedding at
    position 0 (that draft is token 0, rejected). ``embed_tokens`` is the target's."""
    p = f"model.layers.{DS_LAYERS}"
    tok = torch.arange(VOCAB)
    eh = torch.zeros(DS_HIDDEN, 2 * DS_HIDDEN)
    eh[EMB + tok, EMB + tok] = 1 / DS_NORM_IN  # enorm(embedding): EMB, BIAS at DS_NORM_IN
    eh[BIAS, BIAS] = 1 / DS_NORM_IN
    eh[PREV + cls, DS_HIDDEN + CUR + tok] = 1 / DS_NORM_FINAL  # hnorm(target hidden): 5 features at DS_NORM_FINAL
    inter = TARGET_INTER  # the config's intermediate size (the MTP block's MLP has it too); the last VOCAB units idle
    gate, up, down = torch.zeros(inter, DS_HIDDEN), torch.zeros(inter, DS_HIDDEN), torch.zeros(DS_HIDDEN, inter)
    norm = _ds_rms(4)  # the block's MLP input: EMB, BIAS, PREV, CUR_MTP (3 without a class: every unit scales alike)
    known = len(EAGLE_CLASSES)
    for t in range(VOCAB):
        for i, j in enumerate(EAGLE_CLASSES):
            features = [(CUR_MTP + t, 1), (PREV + j, 1)]
            _ds_and_unit(gate, up, down, t * (known + 1) + i, features, 1.5, VOTE + int(succ[j, t]), norm)
        fallback = [(CUR_MTP + t, 1)] + [(PREV + j, -1) for j in EAGLE_CLASSES]
        _ds_and_unit(gate, up, down, t * (known + 1) + known, fallback, 0.5, VOTE + int(succ[0, t]), norm)
    w = {
        f"{p}.embed_tokens.weight": target["model.embed_tokens.weight"],
        f"{p}.enorm.weight": torch.ones(DS_HIDDEN),
        f"{p}.hnorm.weight": torch.ones(DS_HIDDEN),
        f"{p}.eh_proj.weight": eh,
        f"{p}.shared_head.norm.weight": torch.ones(DS_HIDDEN),
        f"{p}.shared_head.head.weight": target["lm_head.weight"],
        # the block's input: EMB, BIAS, PREV at 1 (2 features without a class; the heads' scores scale, not flip)
        **_ds_attention(p, _ds_rms(3), [((0, 1.0, FUTURE, False), torch.arange(VOCAB), CUR_MTP)]),
        f"{p}.mlp.gate_proj.weight": gate,
        f"{p}.mlp.up_proj.weight": up,
        f"{p}.mlp.down_proj.weight": down,
    }
    return w
