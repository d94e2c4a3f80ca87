"""Properties of the tiny DeepSeek-V3-style target and its MTP layer (``model.write_deepseek_model``: MLA attention
with q / kv LoRA and a 64-dim interleaved RoPE part, dense MLPs, one MTP layer), shown with transformers' own
DeepseekV3 on the written bfloat16 checkpoint (no vLLM, no NPU emulation), on the engine workloads -- the same
properties test_tiny_model.py shows for the Llama target:

(a) the next token is read through the (MLA) KV cache: one decode step with an unwritten slot, a sequence length one
    short or one long changes the continuation of every request;
(b) the MTP layer's drafts agree with the target 20-80 % of the time at k = 1..3, differently per request and per
    draft position (on CI's workload; E2E_BIG=1: on BIG);
(c) every greedy choice (target and MTP drafts) wins by the constructed logit margin (at least MARGIN_FLOOR) and by
    at least NOISE_RATIO times the largest change of any logit between batch compositions / chunkings.

The target's greedy tokens are the Llama target's (the same successor tables): ``sequences`` checks the target's
argmax against the tables' continuation at every output position.
"""

from __future__ import annotations

import pytest
import torch

from zb_patch.check.engine import model as tiny_model

transformers = pytest.importorskip(
    "transformers", reason="the tiny-model reference needs transformers (va013-e2e / va018-e2e / va023-e2e envs)"
)

# the machinery of test_tiny_model.py, driven by this module's target / drafter fixtures; importing it skips this
# module where it skips (outside va018-e2e unless E2E_BIG=1: the model does not depend on the release)
from test_tiny_model import (  # noqa: E402
    ACCEPTANCE_WORKLOAD,
    DRAFTED_WORKLOADS,
    DTYPE,
    FAULT_STEPS,
    MARGIN_FLOOR,
    MARGIN_WORKLOADS,
    NOISE_RATIO,
    _decode,
    _draft_chains,
    _margins,
    _one_thread,  # noqa: F401  (autouse fixture)
    _spec_decode,
    noise,  # noqa: F401  (fixture)
    sequences,  # noqa: F401  (fixture)
)

K = (1, 2, 3)  # the tutorial's k = 3 and below
MTP = f"model.layers.{tiny_model.DS_LAYERS}."


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    return tiny_model.write_deepseek_model(str(tmp_path_factory.mktemp("tiny_deepseek")))


@pytest.fixture(scope="module")
def target(ds_dir):
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(
        ds_dir, dtype=tiny_model.DTYPE, attn_implementation="eager"
    ).eval()
    assert model.config.kv_lora_rank == 512 and model.config.qk_rope_head_dim == 64
    assert model.config.num_attention_heads in (32, 64, 128) and model.config.rope_interleave
    return model


@pytest.fixture(scope="module")
def drafter(ds_dir, target):
    """vLLM's ``DeepSeekMultiTokenPredictorLayer`` as transformers modules: its block (``model.layers.{DS_LAYERS}``,
    a DeepSeek-V3 decoder layer) as a one-layer DeepseekV3 without final norm, so that the hidden state a later draft
    continues from is the block's pre-norm output as vLLM's; logits ``shared_head.head(shared_head.norm(h))``; the
    step input ``eh_proj(cat([enorm(embedding, zero at position 0), hnorm(previous hidden)]))``."""
    from safetensors.torch import load_file

    cfg = transformers.DeepseekV3Config.from_pretrained(ds_dir)
    model = transformers.DeepseekV3ForCausalLM(cfg).to(DTYPE).eval()
    weights = {k[len(MTP) :]: v for k, v in load_file(f"{ds_dir}/model.safetensors").items() if k.startswith(MTP)}
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = type(model.model.norm)(cfg.hidden_size, cfg.rms_norm_eps).to(DTYPE)
        norms[name].weight.data = weights.pop(f"{name}.weight")
    eh = weights.pop("eh_proj.weight")
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).to(DTYPE)
    head.weight.data = weights.pop("shared_head.head.weight")
    embed = weights.pop("embed_tokens.weight")
    assert torch.equal(embed, target.model.embed_tokens.weight.detach())
    state = {f"model.layers.0.{k}": v for k, v in weights.items()}
    state["model.embed_tokens.weight"] = embed
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) == {"model.norm.weight", "lm_head.weight"}, (missing, unexpected)
    model.model.norm = torch.nn.Identity()
    model.lm_head = torch.nn.Sequential(norms["shared_head.norm"], head)
    emb = model.model.embed_tokens

    def step_input(tokens, hidden, positions):
        e = emb(tokens) * (positions != 0)[:, None]
        return torch.cat([norms["enorm"](e), norms["hnorm"](hidden)], -1) @ eh.T

    return "mtp", model, step_input  # "mtp": the embedding is zeroed at position 0 (its draft is not scored)


@pytest.fixture(scope="module")
def drafts(drafter, sequences):  # noqa: F811
    """Per workload and request: (sequence, prompt length, k = max(K) draft chains from every output position's
    start, their smallest logit margin)."""
    out = {}
    for name in DRAFTED_WORKLOADS:
        out[name] = []
        for seq, n, _, hidden in sequences[name]:
            starts = list(range(n - 1, len(seq) - 1))
            out[name].append((seq, n, *_draft_chains(drafter, seq, hidden, starts, max(K))))
    return out


@pytest.mark.parametrize("name", MARGIN_WORKLOADS)
def test_every_greedy_choice_wins_by_a_wide_margin(sequences, noise, drafts, name):  # noqa: F811
    """(c) for the DeepSeek target and its MTP layer."""
    rows = sequences[name]
    target_min = min(_margins(logits[n - 1 : -1]).min().item() for _, n, logits, _ in rows)
    draft_min = min(margin for *_, margin in drafts[name])
    print(f"\n{name}: min margin target {target_min:.4f}, MTP drafts {draft_min:.4f}; logit noise {noise[name]:.2e}")
    for margin in (target_min, draft_min):
        assert margin >= MARGIN_FLOOR and margin >= NOISE_RATIO * noise[name], (margin, noise[name])


def test_deepseek_target_is_the_llama_target(sequences, tmp_path_factory):  # noqa: F811
    """The DeepSeek target chooses the Llama target's greedy tokens (``sequences`` checked them against the tables);
    here against the Llama checkpoint itself, so the MLA runs check the same token sequences as the dense ones."""
    llama_dir, _ = tiny_model.write_models(str(tmp_path_factory.mktemp("tiny_llama")))
    llama = transformers.LlamaForCausalLM.from_pretrained(llama_dir, dtype=tiny_model.DTYPE).eval()
    for seq, n, _, _ in sequences["ci"]:
        with torch.no_grad():
            got = llama(torch.tensor([seq])).logits[0]
        assert got[n - 1 : -1].argmax(-1).tolist() == seq[n:]


@pytest.mark.parametrize("fault", ["slot-off-by-one", "length-one-short", "length-one-long"])
def test_one_faulty_decode_step_changes_the_continuation(target, sequences, fault):  # noqa: F811
    """(a): the MLA head 0 reads the current token (distance 0), head 1 the previous token's class (distance 1),
    both through the KV cache (transformers keeps the decompressed keys / values; the latent the NPU cache holds
    maps to them one to one)."""
    changed, total = 0, 0
    for seq, n, *_ in sequences["ci"]:
        m = min(FAULT_STEPS, len(seq) - n)
        if n < 2:
            continue
        expected = seq[n : n + m]
        assert _decode(target, seq[:n], m, "none") == expected
        changed += _decode(target, seq[:n], m, fault) != expected
        total += 1
    print(f"\n{fault}: continuation changed in {changed} of {total} requests")
    assert total and changed == total


@pytest.mark.parametrize("k", K)
def test_mtp_drafts_are_partly_right_varying_per_request(drafts, k):
    """(b): overall acceptance 20-80 % and differing between requests."""
    per_request = [_spec_decode(seq, n, chains, k) for seq, n, chains, _ in drafts[ACCEPTANCE_WORKLOAD]]
    drafted, accepted = sum(d for d, _ in per_request), sum(a for _, a in per_request)
    rates = [a / d for d, a in per_request if d >= 10]
    rate = accepted / drafted
    print(f"\nk = {k}: acceptance {accepted}/{drafted} = {rate:.3f}, per request {min(rates):.2f}..{max(rates):.2f}")
    assert 0.2 <= rate <= 0.8
    assert max(rates) - min(rates) >= 0.2


def test_mtp_agreement_differs_per_draft_position(drafts):
    """(b): a draft position's agreement given the earlier drafts were right: the first draft reads the previous
    token's class from the target's hidden state, later ones fall back to SUCCESSOR[0]."""
    hits, trials = [0] * max(K), [0] * max(K)
    for seq, _, chains, _ in drafts[ACCEPTANCE_WORKLOAD]:
        for q, chain in chains.items():
            for j, token in enumerate(chain):
                if q + 2 + j >= len(seq):
                    break
                trials[j] += 1
                if token != seq[q + 2 + j]:
                    break
                hits[j] += 1
    rates = [h / t for h, t in zip(hits, trials)]
    print(f"\nMTP agreement per draft position (given the earlier ones right): {[round(r, 3) for r in rates]}")
    assert all(0.2 <= r <= 0.9 for r in rates)
    assert rates[0] - max(rates[1:]) >= 0.1
