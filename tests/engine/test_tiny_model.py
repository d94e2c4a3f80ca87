"""Properties of the tiny target model, its EAGLE head and the MiMo checkpoint's MTP layer, shown with
transformers' own Llama / Qwen2 on the written weights (no vLLM, no NPU emulation), on the engine workloads:

(a) the next token is read through the KV cache: one decode step with a slot off by one, a sequence length one
    short or one long changes the continuation of every request;
(b) the drafts (EAGLE head, MTP layer) agree with the target 20-80 % of the time, differently per request and per draft
    position (on CI's workload; E2E_BIG=1: on BIG);
(c) every greedy choice (target and drafts) wins by the constructed logit margin (LOGIT_MARGIN, less bfloat16's
    rounding: at least MARGIN_FLOOR) and by at least NOISE_RATIO times the largest change of any logit between batch
    compositions / chunkings of the same tokens (measured on CI's workload; E2E_BIG=1: on BIG too).

Everything runs in the engine's dtype (``model.DTYPE``, bfloat16), on the checkpoints as written.
"""

from __future__ import annotations

import os
from importlib.metadata import version

import pytest
import torch

from zb_patch.check.engine import model as tiny_model
from zb_patch.check.engine.workload import BIG, CI

transformers = pytest.importorskip(
    "transformers", reason="the tiny-model reference needs transformers (va013-e2e / va018-e2e / va023-e2e envs)"
)

E2E_BIG = bool(os.environ.get("E2E_BIG"))
# this module's and test_deepseek_model.py's (which imports this one first) one skip
if version("vllm-ascend") != "0.18.0" and not E2E_BIG:
    pytest.skip("the model does not depend on the release: CI checks it in va018-e2e", allow_module_level=True)

WORKLOADS = {"ci": CI, "big": BIG}
# (c)'s logit noise feeds every request one token at a time: minutes on BIG per model on two cores, so CI measures
# it on CI's workload and E2E_BIG=1 on both
MARGIN_WORKLOADS = WORKLOADS if E2E_BIG else {"ci": CI}
# (b)'s acceptance needs every output position's draft chain: minutes on BIG for the DeepSeek model, so CI checks it on
# CI's workload (its 10 requests hold the same properties: docs/e2e.md, "Model") and E2E_BIG=1 on BIG
ACCEPTANCE_WORKLOAD = "big" if E2E_BIG else "ci"
DRAFTED_WORKLOADS = set(MARGIN_WORKLOADS) | {ACCEPTANCE_WORKLOAD}
DTYPE = getattr(torch, tiny_model.DTYPE)  # what the engine computes in
MARGIN_FLOOR = 0.95 * tiny_model.LOGIT_MARGIN  # bfloat16 rounds the constructed 10.0 to 9.81-9.88 (docs/e2e.md)
NOISE_RATIO = 100
FAULT_STEPS = 8  # tokens compared after a faulty decode step
DECODE_STEPS = 64  # positions per request fed one token at a time in the noise measurement
DRAFTS = 4  # k = 1..4


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """This model's forwards gain nothing from threads; on a loaded 2-core box the extra ones only spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_model.write_models(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def target(dirs):
    return transformers.LlamaForCausalLM.from_pretrained(
        dirs[0], dtype=tiny_model.DTYPE, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return tiny_model.write_mtp_model(str(tmp_path_factory.mktemp("tiny_mtp")))


def _eagle(dirs, target):
    """The EAGLE head as transformers modules: its one Llama layer without input norm, no final norm, the target's
    embedding and LM head, and the step input cat([embedding, hidden]) @ fc (vLLM's EagleLlamaForCausalLM computes
    the same)."""
    from safetensors.torch import load_file

    cfg = transformers.LlamaConfig.from_pretrained(dirs[1])
    model = transformers.LlamaForCausalLM(cfg).to(DTYPE).eval()
    weights = load_file(f"{dirs[1]}/model.safetensors")
    fc = weights.pop("fc.weight")
    state = {f"model.{k}": v for k, v in weights.items()}
    state["model.embed_tokens.weight"] = target.model.embed_tokens.weight.detach()
    state["lm_head.weight"] = target.lm_head.weight.detach()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) == {"model.layers.0.input_layernorm.weight", "model.norm.weight"}
    model.model.layers[0].input_layernorm = torch.nn.Identity()
    model.model.norm = torch.nn.Identity()
    emb = model.model.embed_tokens

    def step_input(tokens, hidden, positions):
        return torch.cat([emb(tokens), hidden], -1) @ fc.T

    return model, step_input


def _mtp(mtp_dir, target):
    """The MiMo checkpoint's MTP layer as transformers modules (vLLM's MiMoMultiTokenPredictorLayer): its block as
    a one-layer Qwen2 whose final norm is the layer's final_layernorm, and the step input
    input_proj(cat([hidden_layernorm(hidden), token_layernorm(embedding, zero at position 0)]))."""
    from safetensors.torch import load_file

    cfg = transformers.Qwen2Config.from_pretrained(mtp_dir)
    model = transformers.Qwen2ForCausalLM(cfg).to(DTYPE).eval()
    p = "model.mtp_layers.0."
    weights = {k[len(p) :]: v for k, v in load_file(f"{mtp_dir}/model.safetensors").items() if k.startswith(p)}
    proj = weights.pop("input_proj.weight")
    norms = {}
    for name in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        norms[name] = type(model.model.norm)(cfg.hidden_size, cfg.rms_norm_eps).to(DTYPE)
        norms[name].weight.data = weights.pop(f"{name}.weight")
    state = {f"model.layers.0.{k}": v for k, v in weights.items()}
    state["model.norm.weight"] = norms["final_layernorm"].weight.data
    state["model.embed_tokens.weight"] = target.model.embed_tokens.weight.detach()
    state["lm_head.weight"] = target.lm_head.weight.detach()
    model.load_state_dict(state, strict=True)
    emb = model.model.embed_tokens

    def step_input(tokens, hidden, positions):
        e = emb(tokens) * (positions != 0)[:, None]
        return torch.cat([norms["hidden_layernorm"](hidden), norms["token_layernorm"](e)], -1) @ proj.T

    return model, step_input


@pytest.fixture(scope="module", params=["eagle", "mtp"])
def drafter(request, dirs, mtp_dir, target):
    """(name, model, step input) of the EAGLE head or the MiMo checkpoint's MTP layer."""
    model, step_input = _eagle(dirs, target) if request.param == "eagle" else _mtp(mtp_dir, target)
    return request.param, model, step_input


@pytest.fixture(scope="module")
def sequences(target):
    """Per workload: (prompt + greedy output, prompt length, target logits, final hidden states) per request. The
    output is proposed by the model's successor tables and verified: the target's argmax (one full forward) must
    be the next token at every output position, so the sequence is exactly the target's greedy continuation."""
    succ, cls = tiny_model.tables()
    out = {}
    for name, wl in WORKLOADS.items():
        rows = []
        for prompt, n in wl.requests(tiny_model.VOCAB):
            seq = list(prompt)
            while len(seq) < len(prompt) + n:
                seq.append(int(succ[cls[seq[-2] if len(seq) > 1 else seq[-1]], seq[-1]]))
            with torch.no_grad():
                res = target.model(torch.tensor([seq]))
                logits = target.lm_head(res.last_hidden_state)[0]
            assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == seq[len(prompt) :], "not the greedy output"
            rows.append((seq, len(prompt), logits, res.last_hidden_state[0]))
        out[name] = rows
    return out


def _margins(logits: torch.Tensor) -> torch.Tensor:
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def _logit_noise(target, rows) -> float:
    """Largest |change| of an output position's logits over: all requests in one right-padded batch, and each
    request fed through the KV cache in chunks of 13 tokens, the last DECODE_STEPS one at a time (chunked prefill,
    decode)."""
    worst = 0.0
    width = max(len(seq) for seq, *_ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (seq, *_) in enumerate(rows):
        ids[i, : len(seq)], mask[i, : len(seq)] = torch.tensor(seq), 1
    with torch.no_grad():
        batched = target(ids, attention_mask=mask).logits
    for i, (seq, n, logits, _) in enumerate(rows):
        worst = max(worst, (batched[i, n - 1 : len(seq) - 1] - logits[n - 1 : -1]).abs().max().item())
        cache, parts, at = transformers.DynamicCache(), [], 0
        while at < len(seq):
            step = 13 if at < len(seq) - DECODE_STEPS else 1
            with torch.no_grad():
                parts.append(target(torch.tensor([seq[at : at + step]]), past_key_values=cache).logits[0])
            at += step
        chunked = torch.cat(parts)
        worst = max(worst, (chunked[n - 1 : -1] - logits[n - 1 : -1]).abs().max().item())
    return worst


@pytest.fixture(scope="module")
def noise(target, sequences):
    return {name: _logit_noise(target, sequences[name]) for name in MARGIN_WORKLOADS}


@pytest.mark.parametrize("name", MARGIN_WORKLOADS)
def test_every_greedy_choice_wins_by_a_wide_margin(sequences, noise, drafter, drafts, name):
    """(c): the smallest top-1 / top-2 logit gap over all greedy choices of the workload -- the target's at every
    output position, the drafter's at every draft position of every chain -- against the logit noise of
    batching / chunking the same tokens."""
    rows = sequences[name]
    target_min = min(_margins(logits[n - 1 : -1]).min().item() for _, n, logits, _ in rows)
    draft_min = min(margin for *_, margin in drafts[name])
    print(
        f"\n{name}: min margin target {target_min:.4f}, {drafter[0]} drafts {draft_min:.4f}; "
        f"logit noise {noise[name]:.2e}"
    )
    for margin in (target_min, draft_min):
        assert margin >= MARGIN_FLOOR and margin >= NOISE_RATIO * noise[name], (margin, noise[name])


def test_mimo_target_is_the_llama_target(sequences, mtp_dir):
    """The MTP checkpoint's target (transformers' Qwen2: MiMo's base; zero q/k/v biases) chooses the Llama target's
    greedy tokens, so the MTP runs check the same token sequences."""
    mimo = transformers.Qwen2ForCausalLM.from_pretrained(mtp_dir, dtype=tiny_model.DTYPE).eval()
    for seq, n, logits, _ in sequences["ci"]:
        with torch.no_grad():
            got = mimo(torch.tensor([seq])).logits[0]
        assert got[n - 1 : -1].argmax(-1).tolist() == seq[n:]
        assert torch.allclose(got, logits, atol=1e-4)


# -- (a): faults in one decode step, emulated on transformers' KV cache ---------------------------------------


def _decode(target, prompt: list[int], n: int, fault: str) -> list[int]:
    """Greedy tokens after the prompt; the first decode step (the last prompt token's) runs with ``fault``:
    - "slot-off-by-one": its KV overwrites the previous token's entry, its own slot stays unwritten (zeros);
    - "length-one-short": it does not see the newest cache entry (its own);
    - "length-one-long": it also sees a stale entry one position ahead (a rejected draft's, another token);
    - "none": no fault (the harness itself)."""
    cache = transformers.DynamicCache()
    pos = len(prompt) - 1
    with torch.no_grad():
        if pos:
            target(torch.tensor([prompt[:-1]]), past_key_values=cache)
        mask = None
        if fault == "slot-off-by-one" and pos:
            # the visible set is what matters (RoPE puts positions in the keys): previous entry gone, a zero slot
            for layer in cache.layers:
                layer.keys[..., -1, :] = 0
                layer.values[..., -1, :] = 0
        elif fault == "length-one-short":
            mask = torch.zeros(1, 1, 1, pos + 1, dtype=DTYPE)
            mask[..., -1] = torch.finfo(DTYPE).min
        elif fault == "length-one-long":
            wrong = tiny_model.FIRST_ID + (prompt[-1] - tiny_model.FIRST_ID + 1) % (
                tiny_model.VOCAB - tiny_model.FIRST_ID
            )
            target(torch.tensor([[wrong]]), position_ids=torch.tensor([[pos + 1]]), past_key_values=cache)
        logits = target(
            torch.tensor([[prompt[-1]]]), position_ids=torch.tensor([[pos]]), past_key_values=cache, attention_mask=mask
        ).logits
        if fault == "length-one-long":  # the stale entry is gone again after this step
            for layer in cache.layers:
                layer.keys = torch.cat([layer.keys[..., :-2, :], layer.keys[..., -1:, :]], dim=-2)
                layer.values = torch.cat([layer.values[..., :-2, :], layer.values[..., -1:, :]], dim=-2)
        out = [int(logits[0, -1].argmax())]
        while len(out) < n:
            pos += 1
            logits = target(torch.tensor([[out[-1]]]), position_ids=torch.tensor([[pos]]), past_key_values=cache).logits
            out.append(int(logits[0, -1].argmax()))
    return out


@pytest.mark.parametrize("fault", ["slot-off-by-one", "length-one-short", "length-one-long"])
def test_one_faulty_decode_step_changes_the_continuation(target, sequences, fault):
    """(a): the target reads the current token (distance 0) and the previous token's class (distance 1) through
    the KV cache; a lost entry, an unwritten slot or a stale entry in one step's view changes the continuation."""
    changed, total = 0, 0
    for seq, n, *_ in sequences["big"]:
        m = min(FAULT_STEPS, len(seq) - n)
        if n < 2:
            continue  # the step would have no other entry to lose or to be compared with
        expected = seq[n : n + m]
        assert _decode(target, seq[:n], m, "none") == expected
        changed += _decode(target, seq[:n], m, fault) != expected
        total += 1
    print(f"\n{fault}: continuation changed in {changed} of {total} requests")
    assert changed == total


# -- (b): the drafts (EAGLE head, MTP layer) --------------------------------------------------------------------------


def _draft_chains(
    drafter, seq: list[int], hidden: torch.Tensor, starts: list[int], k: int
) -> tuple[dict[int, list[int]], float]:
    """k drafts from every start q (the token seq[q + 1] just sampled from position q), as vLLM's EAGLE proposer
    makes them: the first from (seq[q + 1], target hidden at q) at position q, each next from (the previous draft,
    the head's own hidden state) one position further, attending to the head's cache entries of the accepted
    positions <= q and to its own chain. All chains in one forward per depth (a 4-D mask keeps them apart).
    Also returns the smallest top-1 / top-2 logit gap of all drafts."""
    name, model, step_input = drafter
    base = step_input(torch.tensor(seq[1:]), hidden[:-1], torch.arange(len(seq) - 1))  # rows 0 .. len(seq) - 2
    nb, ns = base.shape[0], len(starts)
    q = torch.tensor(starts)
    inputs, positions = [base], [torch.arange(nb)]
    drafts, margin = [], float("inf")
    with torch.no_grad():
        for depth in range(1, k + 1):
            rows = torch.cat(inputs)
            size = rows.shape[0]
            visible = torch.zeros(size, size, dtype=torch.bool)
            visible[:nb, :nb] = torch.ones(nb, nb, dtype=torch.bool).tril()
            for d in range(1, depth):  # chain rows of depth d + 1: their start's accepted prefix and own chain
                at = nb + (d - 1) * ns + torch.arange(ns)
                visible[at] = torch.arange(size)[None, :] <= q[:, None]
                for e in range(1, d + 1):
                    visible[at, nb + (e - 1) * ns + torch.arange(ns)] = True
            mask = torch.zeros(size, size, dtype=DTYPE).masked_fill(~visible, torch.finfo(DTYPE).min)
            out = model.model(
                inputs_embeds=rows[None], position_ids=torch.cat(positions)[None], attention_mask=mask[None, None]
            ).last_hidden_state[0]
            last = out[q] if depth == 1 else out[nb + (depth - 2) * ns :]
            logits = model.lm_head(last)
            drafts.append(logits.argmax(-1))
            # vLLM's MTP layer zeroes the embedding at position 0: no feature there, every logit 0 (draft token 0)
            scored = logits[q + depth - 1 != 0] if name == "mtp" else logits
            margin = min(margin, _margins(scored).min().item())
            inputs.append(step_input(drafts[-1], last, q + depth))
            positions.append(q + depth)
    return {start: [int(d[i]) for d in drafts] for i, start in enumerate(starts)}, margin


@pytest.fixture(scope="module")
def drafts(drafter, sequences):
    """Per workload and request: (sequence, prompt length, draft chains of DRAFTS from every output position's
    start, their smallest logit margin)."""
    out = {}
    for name in DRAFTED_WORKLOADS:
        out[name] = []
        for seq, n, _, hidden in sequences[name]:
            starts = list(range(n - 1, len(seq) - 1))
            out[name].append((seq, n, *_draft_chains(drafter, seq, hidden, starts, DRAFTS)))
    return out


def _spec_decode(seq: list[int], n: int, chains: dict[int, list[int]], k: int) -> tuple[int, int]:
    """(drafted, accepted) of greedy speculative decoding with k drafts per step over the output (drafts past the
    last output token not counted)."""
    drafted = accepted = 0
    q = n - 1
    while q < len(seq) - 2:
        room = min(k, len(seq) - 2 - q)
        a = 0
        while a < room and chains[q][a] == seq[q + 2 + a]:
            a += 1
        drafted, accepted, q = drafted + room, accepted + a, q + a + 1
    return drafted, accepted


@pytest.mark.parametrize("k", range(1, DRAFTS + 1))
def test_drafts_are_partly_right_varying_per_request(drafts, k):
    """(b): overall acceptance 20-80 % and differing between requests."""
    per_request = [_spec_decode(seq, n, chains, k) for seq, n, chains, _ in drafts[ACCEPTANCE_WORKLOAD]]
    drafted, accepted = sum(d for d, _ in per_request), sum(a for _, a in per_request)
    rates = [a / d for d, a in per_request if d >= 10]
    rate = accepted / drafted
    print(f"\nk = {k}: acceptance {accepted}/{drafted} = {rate:.3f}, per request {min(rates):.2f}..{max(rates):.2f}")
    assert 0.2 <= rate <= 0.8
    assert max(rates) - min(rates) >= 0.2


def test_draft_agreement_differs_per_draft_position(drafts):
    """(b): a draft position's agreement given the earlier drafts were right: the first draft uses the target's
    hidden state (the previous token's class), later ones fall back to SUCCESSOR[0]."""
    hits, trials = [0] * DRAFTS, [0] * DRAFTS
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
    print(f"\nagreement per draft position (given the earlier ones right): {[round(r, 3) for r in rates]} of {trials}")
    assert all(0.2 <= r <= 0.9 for r in rates)
    assert rates[0] - max(rates[1:]) >= 0.1
