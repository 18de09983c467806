"""The Llama-family choices of mt-model compute what transformers' ``LlamaForCausalLM``
computes: a random Llama with grouped-query attention (n_kv_heads < n_heads), an untied head
and a vocabulary that is not a multiple of 128, its weights renamed into mt's module tree,
gives the same logits within 1e-5 (fp32); so does multi-query attention and multi-head
attention through the fused ``qkv``."""

from __future__ import annotations

import pytest
import torch
import transformers

from mt_model import GPT, GPTConfig, count_parameters


def _mt_weights(hf: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """HF Llama state dict -> mt names: q/k/v fused as [q; k; v] (multi-head) or q + [k; v],
    gate/up fused as [gate; up]."""
    out = {"embed.tokens.weight": hf["model.embed_tokens.weight"],
           "ln_f.weight": hf["model.norm.weight"], "head.weight": hf["lm_head.weight"]}
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        q, k, v = (hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        if config.n_kv_heads == config.n_heads:
            out[f"blocks.{i}.attn.qkv.weight"] = torch.cat([q, k, v])
        else:
            out[f"blocks.{i}.attn.q.weight"] = q
            out[f"blocks.{i}.attn.kv.weight"] = torch.cat([k, v])
        out[f"blocks.{i}.attn.proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[f"blocks.{i}.ln1.weight"] = hf[p + "input_layernorm.weight"]
        out[f"blocks.{i}.ln2.weight"] = hf[p + "post_attention_layernorm.weight"]
        out[f"blocks.{i}.mlp.fc.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"],
                                                      hf[p + "mlp.up_proj.weight"]])
        out[f"blocks.{i}.mlp.proj.weight"] = hf[p + "mlp.down_proj.weight"]
    return out


@pytest.mark.parametrize("kv_heads", [2, 1, 4])
def test_llama_logits_equal_transformers(kv_heads: int) -> None:
    hf_config = transformers.LlamaConfig(
        vocab_size=1003, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    config = GPTConfig(3, 64, 4, 1003, 128, ffn_hidden=176, n_kv_heads=kv_heads,
                       position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                       tied_embeddings=False, layernorm_eps=1e-5)
    model = GPT(config, seed=None).eval()
    weights = _mt_weights(hf.state_dict(), config)
    model.load_state_dict(weights, strict=True)  # every mt parameter has its HF tensor
    assert count_parameters(config) == sum(p.numel() for p in hf.parameters())
    idx = torch.randint(0, 1003, (2, 37))
    with torch.no_grad():
        theirs = hf(idx).logits
        ours = model(idx)
    assert ours.shape == theirs.shape == (2, 37, 1003)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
    targets = torch.randint(0, 1003, (2, 37))
    with torch.no_grad():
        loss = model(idx, targets)
        hf_loss = torch.nn.functional.cross_entropy(theirs.reshape(-1, 1003), targets.reshape(-1))
    assert loss.item() == pytest.approx(hf_loss.item(), abs=1e-5)
