"""Incremental decoding with the key/value cache computes what the full forward computes.

For GPT-2 (learned positions, fused qkv) and the Llama family (rotary positions, grouped-query
heads, untied head): a left-padded batch of prompts of different lengths, prefilled and then
decoded token by token, gives at every step the logits of a full forward over that row's
tokens alone (fp32, 1e-5; in bf16 and fp16 as accurate as the full 16-bit forward); greedy
completions are the same batched or alone, and equal transformers' ``generate`` on the same
weights; sampling is reproducible per seed whatever the batch, and temperature / top-k /
top-p / stop ids behave as documented.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from mt_model import (
    GPT,
    DecodeBatch,
    DecodeRequest,
    GPTConfig,
    KVCache,
    Sampling,
    WholeModel,
    generate,
    interleave,
    preset,
)
from mt_model.decoding import pick

CONFIGS = {
    "gpt2": GPTConfig(2, 32, 4, 97, 48),
    "llama": GPTConfig(2, 32, 4, 97, 48, ffn_hidden=40, n_kv_heads=2, position="rope",
                       norm="rmsnorm", mlp="swiglu", bias=False, tied_embeddings=False),
}
PROMPTS = [[5, 9, 14], [1, 2, 3, 4, 5, 6, 7], [42, 17, 8, 90, 33]]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_steps_equal_the_full_forward(name: str) -> None:
    model = GPT(CONFIGS[name], seed=3).eval()
    longest = max(map(len, PROMPTS))
    pad = [longest - len(p) for p in PROMPTS]
    cache = KVCache(len(model.blocks), pad, longest + 6)
    ids = torch.zeros(len(PROMPTS), longest, dtype=torch.int64)
    for row, prompt in enumerate(PROMPTS):
        ids[row, pad[row]:] = torch.tensor(prompt)
    rows = [list(p) for p in PROMPTS]
    with torch.no_grad():
        logits = model(ids, cache=cache)[:, -1]
        for step in range(6):
            for row, tokens in enumerate(rows):
                full = model(torch.tensor([tokens]))[0, -1]
                assert torch.allclose(logits[row], full, atol=1e-5, rtol=0), (name, step, row)
            nxt = [(7 * step + 3 * row) % 97 for row in range(len(rows))]
            for row, token in enumerate(nxt):
                rows[row].append(token)
            logits = model(torch.tensor(nxt).unsqueeze(1), cache=cache)[:, -1]
    assert cache.length == longest + 6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_16_bit_cached_steps_are_as_accurate_as_the_full_forward(name: str,
                                                                 dtype: torch.dtype) -> None:
    """In 16 bits the cached steps round differently from a full forward, so they are held
    to the 16-bit forward's own accuracy: against the float32 model's logits, the cached
    steps' error is at most twice the full 16-bit forward's (a wrong position or mask costs
    orders of magnitude more), and both pick the same greedy tokens wherever float32's choice
    leads by more than that error."""
    exact = GPT(CONFIGS[name], seed=3).eval()
    model = GPT(CONFIGS[name], seed=3).to(dtype).eval()
    longest, steps = max(map(len, PROMPTS)), 8
    pad = [longest - len(p) for p in PROMPTS]
    cache = KVCache(len(model.blocks), pad, longest + steps)
    ids = torch.zeros(len(PROMPTS), longest, dtype=torch.int64)
    for row, prompt in enumerate(PROMPTS):
        ids[row, pad[row]:] = torch.tensor(prompt)
    rows = [list(p) for p in PROMPTS]
    cached_err = full_err = 0.0
    with torch.no_grad():
        logits = model(ids, cache=cache)[:, -1].float()
        for step in range(steps):
            for row, tokens in enumerate(rows):
                want = exact(torch.tensor([tokens]))[0, -1]
                full = model(torch.tensor([tokens]))[0, -1].float()
                cached_err = max(cached_err, float((logits[row] - want).abs().max()))
                full_err = max(full_err, float((full - want).abs().max()))
                top2 = want.topk(2).values
                if float(top2[0] - top2[1]) > 4 * max(cached_err, full_err):
                    assert int(logits[row].argmax()) == int(want.argmax()), (step, row)
            nxt = [(7 * step + 3 * row) % 97 for row in range(len(rows))]
            for row, token in enumerate(nxt):
                rows[row].append(token)
            logits = model(torch.tensor(nxt).unsqueeze(1), cache=cache)[:, -1].float()
    assert 0 < full_err < 0.1
    assert cached_err <= 2 * full_err, (cached_err, full_err)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_batched_equals_alone_and_transformers(name: str) -> None:
    model = GPT(CONFIGS[name], seed=5).eval()
    rule = Sampling(max_new_tokens=10)
    batched = generate(model, PROMPTS, rule)
    for prompt, completion in zip(PROMPTS, batched, strict=True):
        alone = generate(model, [prompt], rule)[0]
        assert completion.tokens == alone.tokens
        assert completion.logprobs == pytest.approx(alone.logprobs, abs=1e-5, rel=0)
        assert len(completion.tokens) == 10 and completion.finish_reason == "length"
        assert all(lp <= 0 for lp in completion.logprobs)
    hf = _transformers_twin(model, CONFIGS[name])
    for prompt, completion in zip(PROMPTS, batched, strict=True):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                          pad_token_id=0)
        assert out[0, len(prompt):].tolist() == completion.tokens, name


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_requests_join_and_leave_a_running_batch(name: str) -> None:
    """Continuous batching: requests that join a running batch (longer or shorter than it),
    leave it at different steps or are cancelled get the tokens they get alone."""
    model = GPT(CONFIGS[name], seed=5).eval()
    prompts = [*PROMPTS, [11, 12]]
    rules = [Sampling(max_new_tokens=9), Sampling(max_new_tokens=4, temperature=1.0, seed=3),
             Sampling(max_new_tokens=7, temperature=0.8, top_k=20, seed=4),
             Sampling(max_new_tokens=9)]
    alone = [generate(model, [p], r)[0] for p, r in zip(prompts, rules, strict=True)]
    batch = DecodeBatch(WholeModel(model))
    got: dict[int, list[tuple[int, float]]] = {i: [] for i in range(4)}
    finish: dict[int, str] = {}

    def step() -> None:
        for event in batch.step():
            if event.token is not None:
                got[event.key].append((event.token, event.logprob))
            if event.finish:
                finish[event.key] = event.finish

    batch.add([DecodeRequest(tuple(prompts[0]), rules[0])], [0])
    step()
    step()
    batch.add([DecodeRequest(tuple(prompts[1]), rules[1])], [1])  # longer than the batch so far
    step()
    batch.add([DecodeRequest(tuple(p), r) for p, r in zip(prompts[2:], rules[2:], strict=True)],
              [2, 3])
    step()
    batch.cancel([3])
    while batch:
        step()
    assert batch.cache is None and len(got[3]) == 1
    for i in range(3):
        assert [t for t, _ in got[i]] == alone[i].tokens, (name, i)
        assert [lp for _, lp in got[i]] == pytest.approx(alone[i].logprobs, abs=1e-5, rel=0)
        assert finish[i] == "length"


def test_interleaved_batches_decode_as_one() -> None:
    """interleave (one batch per pipeline stage, in turn) gives each request its own tokens;
    the keys it returns are cancelled at once."""
    model = GPT(CONFIGS["gpt2"], seed=5).eval()
    rule = Sampling(max_new_tokens=6)
    alone = [generate(model, [p], rule)[0].tokens for p in PROMPTS]
    batches = [DecodeBatch(WholeModel(model)) for _ in range(2)]
    batches[0].add([DecodeRequest(tuple(PROMPTS[0]), rule), DecodeRequest(tuple(PROMPTS[2]), rule)],
                   [0, 2])
    batches[1].add([DecodeRequest(tuple(PROMPTS[1]), rule)], [1])
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def on_tokens(events: list) -> list[int]:
        for event in events:
            got[event.key].append(event.token)
        return [e.key for e in events if e.key == 2 and len(got[2]) == 3]

    interleave(batches, 0, 1, on_tokens)
    assert got[0] == alone[0] and got[1] == alone[1] and got[2] == alone[2][:3]
    with pytest.raises(ValueError, match="2 batches cannot keep 3 stages busy"):
        interleave(batches, 0, 3, on_tokens)


def test_echo_scores_the_prompt() -> None:
    model = GPT(CONFIGS["llama"], seed=5).eval()
    batch = DecodeBatch(WholeModel(model))
    scores = batch.add([DecodeRequest(tuple(p), Sampling(max_new_tokens=1), echo=i != 1,
                                top_logprobs=2) for i, p in enumerate(PROMPTS)], [0, 1, 2])
    assert scores[1] is None
    for prompt, score in zip(PROMPTS[::2], scores[::2], strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt]))[0], dim=-1)
        want = [float(logp[i, t]) for i, t in enumerate(prompt[1:])]
        assert list(score.logprobs) == pytest.approx(want, abs=1e-5, rel=0)
        best = logp[:-1].max(dim=-1)
        assert [top[0][0] for top in score.top] == best.indices.tolist()
        assert [len(top) for top in score.top] == [2] * (len(prompt) - 1)


def test_sampling_is_reproducible_and_filters() -> None:
    model = GPT(CONFIGS["llama"], seed=7).eval()
    rules = [Sampling(max_new_tokens=8, temperature=1.0, seed=s) for s in (1, 2, 3)]
    batched = generate(model, PROMPTS, rules)
    for prompt, rule, completion in zip(PROMPTS, rules, batched, strict=True):
        assert generate(model, [prompt], rule)[0].tokens == completion.tokens
    other = generate(model, PROMPTS, [Sampling(max_new_tokens=8, temperature=1.0, seed=9)] * 3)
    assert [c.tokens for c in other] != [c.tokens for c in batched]
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])
    gen = torch.Generator().manual_seed(0)
    assert {pick(logits, Sampling(temperature=5.0, top_k=2), gen) for _ in range(200)} == {1, 2}
    assert {pick(logits, Sampling(temperature=1.0, top_p=0.01), gen) for _ in range(50)} == {1}
    assert pick(logits, Sampling(), None) == 1  # greedy
    # The nucleus of p = 0.75 over probabilities (.05, .5, .3, .1, .05) is tokens 1 and 2
    # (the likelier tokens hold 0 and .5, under .75; token 3's hold .8), drawn 5 : 3.
    probs = torch.tensor([0.05, 0.5, 0.3, 0.1, 0.05])
    draws = [pick(probs.log(), Sampling(temperature=1.0, top_p=0.75), gen) for _ in range(4000)]
    assert set(draws) == {1, 2}
    assert draws.count(1) / len(draws) == pytest.approx(0.625, abs=0.03)  # sd 0.008
    first = generate(model, [PROMPTS[0]], Sampling(max_new_tokens=5))[0]
    stopped = generate(model, [PROMPTS[0]], Sampling(max_new_tokens=5,
                                                     stop_ids=(first.tokens[2],)))[0]
    assert stopped.finish_reason == "stop" and stopped.tokens == first.tokens[:2]


def _draws_used(generator: torch.Generator, seed: int, most: int) -> int:
    """How many numbers ``generator`` (seeded with ``seed``) has drawn, up to ``most``."""
    after = float(torch.rand((), generator=generator, dtype=torch.float64))
    reference = torch.Generator().manual_seed(seed)
    for used in range(most + 1):
        if float(torch.rand((), generator=reference, dtype=torch.float64)) == after:
            return used
    return most + 1


def test_sampling_takes_bounded_time_at_any_top_p_and_temperature() -> None:
    """A nucleus of p = 5e-324 holds only the likeliest token: drawn from all 50k tokens until
    one lands in it took about 1 / p(top) draws per token (a request that stalled every other
    in mt serve's batch); a few draws, then a sort, gives it. A temperature so small that the
    scaled logits overflow gives the greedy token (the limit), not a draw from NaNs."""
    logits = torch.randn(50257, generator=torch.Generator().manual_seed(1)) * 0.5
    generator = torch.Generator().manual_seed(5)
    token = pick(logits, Sampling(temperature=1.9, top_p=5e-324), generator)
    assert token == int(logits.argmax())
    assert _draws_used(generator, 5, 200) <= 65
    for rule in (Sampling(temperature=5e-324), Sampling(temperature=5e-324, top_p=0.5)):
        assert pick(logits, rule, torch.Generator().manual_seed(0)) == int(logits.argmax())


def test_bad_requests_name_the_numbers() -> None:
    model = GPT(CONFIGS["gpt2"], seed=0)
    with pytest.raises(ValueError, match="prompt of 40 tokens \\+ 10 new tokens exceed the "
                                         "model's 48 positions"):
        generate(model, [[1] * 40], Sampling(max_new_tokens=10))
    with pytest.raises(ValueError, match="top_p must be in \\(0, 1\\], got 0"):
        Sampling(top_p=0)
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        generate(model, [[]], Sampling())


def _transformers_twin(model: GPT, config: GPTConfig) -> transformers.PreTrainedModel:
    """The same weights in transformers' GPT-2 or Llama."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if config.position == "learned":
        hf_config = transformers.GPT2Config(
            vocab_size=config.vocab_size, n_positions=config.seq_len, n_embd=config.hidden,
            n_layer=config.n_layers, n_head=config.n_heads, activation_function="gelu",
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            layer_norm_epsilon=config.layernorm_eps)
        hf = transformers.GPT2LMHeadModel(hf_config).eval()
        out = {"transformer.wte.weight": sd["embed.tokens.weight"],
               "transformer.wpe.weight": sd["embed.positions.weight"],
               "transformer.ln_f.weight": sd["ln_f.weight"], "transformer.ln_f.bias":
               sd["ln_f.bias"], "lm_head.weight": sd["embed.tokens.weight"]}
        for i in range(config.n_layers):
            p, q = f"blocks.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
                out[q + theirs + ".weight"] = sd[p + ours + ".weight"]
                out[q + theirs + ".bias"] = sd[p + ours + ".bias"]
            for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                                 ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
                out[q + theirs + ".weight"] = sd[p + ours + ".weight"].t()  # Conv1D
                out[q + theirs + ".bias"] = sd[p + ours + ".bias"]
        missing = set(hf.state_dict()) - set(out)
        assert all(k.endswith(".attn.bias") or k.endswith("masked_bias") for k in missing)
        hf.load_state_dict(out, strict=False)
        return hf
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden,
        intermediate_size=config.ffn_hidden, num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
        max_position_embeddings=config.seq_len, rms_norm_eps=config.layernorm_eps,
        rope_theta=config.rope_theta, tie_word_embeddings=False, attention_bias=False,
        mlp_bias=False)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    out = {"model.embed_tokens.weight": sd["embed.tokens.weight"],
           "model.norm.weight": sd["ln_f.weight"], "lm_head.weight": sd["head.weight"]}
    kv = config.n_kv_heads * config.head_dim
    for i in range(config.n_layers):
        p, q = f"blocks.{i}.", f"model.layers.{i}."
        out[q + "self_attn.q_proj.weight"] = sd[p + "attn.q.weight"]
        out[q + "self_attn.k_proj.weight"] = sd[p + "attn.kv.weight"][:kv]
        out[q + "self_attn.v_proj.weight"] = sd[p + "attn.kv.weight"][kv:]
        out[q + "self_attn.o_proj.weight"] = sd[p + "attn.proj.weight"]
        out[q + "input_layernorm.weight"] = sd[p + "ln1.weight"]
        out[q + "post_attention_layernorm.weight"] = sd[p + "ln2.weight"]
        gate, up = sd[p + "mlp.fc.weight"].chunk(2)
        out[q + "mlp.gate_proj.weight"], out[q + "mlp.up_proj.weight"] = gate, up
        out[q + "mlp.down_proj.weight"] = sd[p + "mlp.proj.weight"]
    hf.load_state_dict(out, strict=True)
    return hf


def test_the_tiny_preset_decodes() -> None:
    model = GPT(preset("tiny"), seed=0)
    completion = generate(model, [[1, 2, 3]], Sampling(max_new_tokens=4))[0]
    assert len(completion.tokens) == 4
