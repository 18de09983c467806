"""Megatron-core ``torch_dist`` checkpoints against megatron-core itself: a GPT saved by
``dist_checkpointing.save`` from a TP 2 run (two gloo ranks) is read by mt with mcore's
logits; an mt Llama written with ``--to mcore`` is loaded by ``dist_checkpointing.load``
into mcore's ``GPTModel`` with mt's logits.

megatron-core targets CUDA; on these CPU ranks it runs with three shims that only move
CUDA housekeeping to the CPU (``torch.cuda.current_device`` answers "cpu" for its scratch
buffers, ``torch.cuda.synchronize`` is a no-op, the inference RNG tracker replaces the CUDA
one: dropout is 0) and an explicit causal mask (its default is built on "cuda")."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mt_dist.testing import run_distributed
from mt_formats import ConvertError, convert_checkpoint, load_model, open_checkpoint, save_model
from mt_model import GPT, GPTConfig

# Only the ranks import megatron.core: importing it adds argparse.Namespace, numpy arrays and
# more to torch's weights-only allow-list for the whole process.
if importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is a pinned test dependency", allow_module_level=True)

GPT2 = GPTConfig(n_layers=2, hidden=64, n_heads=4, vocab_size=128, seq_len=32,
                 layernorm_eps=1e-5)
LLAMA = GPTConfig(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, vocab_size=96, seq_len=32,
                  ffn_hidden=80, position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                  tied_embeddings=False, layernorm_eps=1e-6, rope_theta=10000.0)


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(9))


def _mcore_model(config: GPTConfig, tp: int) -> Any:
    """megatron-core's GPTModel for ``config`` on this CPU rank (see the module docstring)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    parallel_state.initialize_model_parallel(tp, 1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(1)
    llama = config.mlp == "swiglu"
    norm = "RMSNorm" if config.norm == "rmsnorm" else "LayerNorm"
    transformer = TransformerConfig(
        num_layers=config.n_layers, hidden_size=config.hidden,
        num_attention_heads=config.n_heads, num_query_groups=config.n_kv_heads,
        ffn_hidden_size=config.ffn_hidden, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, normalization=norm, layernorm_epsilon=config.layernorm_eps,
        gated_linear_unit=llama, activation_func=F.silu if llama else F.gelu,
        add_bias_linear=config.bias, init_method_std=0.05)
    return GPTModel(config=transformer, vocab_size=config.vocab_size,
                    transformer_layer_spec=get_gpt_layer_local_spec(normalization=norm),
                    max_sequence_length=config.seq_len,
                    position_embedding_type="rope" if llama else "learned_absolute",
                    rotary_base=int(config.rope_theta),
                    share_embeddings_and_output_weights=config.tied_embeddings,
                    parallel_output=False).eval()


def _logits(model: Any, vocab: int | None = None) -> torch.Tensor:
    tokens = _tokens(vocab or model.vocab_size)
    seq = tokens.shape[1]
    positions = torch.arange(seq)[None].expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, seq, seq), diagonal=1).bool()
    with torch.no_grad():
        return model(tokens, positions, attention_mask=mask)


def _megatron_lm_args(config: GPTConfig, tp: int, vocab: int) -> Any:
    """The ``args`` Megatron-LM puts in a checkpoint's common state (the settings that
    describe the model and layout, and a real Megatron-core enum and torch dtype)."""
    import argparse

    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=config.n_layers, hidden_size=config.hidden,
        num_attention_heads=config.n_heads, ffn_hidden_size=config.ffn_hidden,
        max_position_embeddings=config.seq_len, seq_length=config.seq_len,
        norm_epsilon=config.layernorm_eps, normalization="LayerNorm", swiglu=False,
        position_embedding_type="learned_absolute", group_query_attention=False,
        add_bias_linear=True, untie_embeddings_and_output_weights=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        padded_vocab_size=config.vocab_size, vocab_size=vocab, make_vocab_size_divisible_by=64,
        params_dtype=torch.float32, attention_backend=AttnBackend.auto, init_method_std=0.05)


def _save_tp2(directory: str, vocab: int | None = None) -> torch.Tensor:
    """GPT2 at TP 2 saved by ``dist_checkpointing.save``; with ``vocab``, as Megatron-LM
    saves it: ``args`` and the iteration in the common state, the vocabulary padded from
    ``vocab`` to the model's rows."""
    from megatron.core import dist_checkpointing

    model = _mcore_model(GPT2, tp=2)
    with torch.no_grad():  # biases and norms away from their initial 0 / 1, so they count
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(
                    len(name))) * 0.1)
    state = model.sharded_state_dict()
    if vocab is not None:
        state.update(args=_megatron_lm_args(GPT2, 2, vocab), checkpoint_version=3.0,
                     iteration=10)
    dist_checkpointing.save(state, directory)
    return _logits(model, vocab)


def _load(directory: str, config: dict[str, Any]) -> torch.Tensor:
    from megatron.core import dist_checkpointing

    model = _mcore_model(GPTConfig.from_dict(config), tp=1)
    for tensor in model.state_dict().values():
        if isinstance(tensor, torch.Tensor):
            tensor.zero_()
    state = dist_checkpointing.load(model.sharded_state_dict(), directory)
    model.load_state_dict(state)
    return _logits(model)


def test_mcore_tp2_save_reads_with_mcore_logits(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    logits = run_distributed(_save_tp2, 2, str(tmp_path / "ckpt"), timeout=300)
    assert torch.equal(logits[0], logits[1])
    with pytest.raises(ConvertError, match="records no model config.*--model"):
        open_checkpoint(tmp_path / "ckpt")
    fields = tmp_path / "fields.json"
    fields.write_text(json.dumps({"n_heads": 4, "n_layers": 1, "hidden": 64, "vocab_size": 8,
                                  "seq_len": 8, "layernorm_eps": 1e-5}))
    with open_checkpoint(tmp_path / "ckpt", model=str(fields)) as reader:
        assert reader.format == "mcore" and reader.config == GPT2.replace(
            init_std=reader.config.init_std)
        assert "files" in reader.sources("blocks.1.attn.qkv.weight")[0].file
    chunks = dcp.FileSystemReader(tmp_path / "ckpt").read_metadata().state_dict_metadata[
        "decoder.layers.self_attention.linear_qkv.weight"].chunks
    assert sorted(tuple(c.offsets) for c in chunks) == [  # layer x TP rank: rows split in 2
        (0, 0, 0), (0, 96, 0), (1, 0, 0), (1, 96, 0)]
    convert_checkpoint(tmp_path / "ckpt", tmp_path / "mt", model=str(fields))
    model = load_model(tmp_path / "mt").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens(GPT2.vocab_size)), logits[0], atol=1e-5,
                                   rtol=0)


def test_mt_llama_to_mcore_loads_into_megatron_core(tmp_path: Path) -> None:
    model = GPT(LLAMA, seed=4).eval()
    save_model(model, tmp_path / "mcore", to="mcore")
    theirs = run_distributed(_load, 1, str(tmp_path / "mcore"), LLAMA.to_dict(), timeout=300)[0]
    with torch.no_grad():
        torch.testing.assert_close(theirs, model(_tokens(LLAMA.vocab_size)), atol=1e-5, rtol=0)
    back = load_model(tmp_path / "mcore")  # mt.json: the config travels; checksums checked
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_megatron_lm_torch_dist_reads_its_args(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    logits = run_distributed(_save_tp2, 2, str(tmp_path / "ckpt"), 120, timeout=300)[0]
    with open_checkpoint(tmp_path / "ckpt") as reader:  # no --model: Megatron-LM's args
        assert reader.config == GPT2.replace(vocab_size=120, init_std=0.05)
    model = load_model(tmp_path / "ckpt").eval()
    tokens = _tokens(120)
    with torch.no_grad():  # the 8 padding rows of Megatron's vocabulary are dropped
        torch.testing.assert_close(model(tokens), logits[..., :120], atol=1e-5, rtol=0)
