"""A checkpoint as Megatron-DeepSpeed (the framework MT-NLG was trained in) writes it, made
universal by DeepSpeed's own ``ds_to_universal``, read by mt.

Megatron-DeepSpeed is not on PyPI, so the model here is written in its shape: its
``GPTModelPipe`` layer list ([a cast, the tied embedding, the transformer layers, the final
LayerNorm, the tied head]) as a DeepSpeed ``PipelineModule`` split by
``type:ParallelTransformerLayerPipe``, its parameter names, its tensor slicing
(vocabulary-parallel word embeddings padded to a multiple of 128 x tp, ``query_key_value``
rows per head, row-parallel dense layers with replicated biases), and what its checkpoints
carry beside DeepSpeed's state: ``args`` (an ``argparse.Namespace``) and the
``universal_checkpoint_info`` of ``GPTModelPipe``'s own patterns. 4 gloo ranks (TP 2 x PP 2),
ZeRO-1, fp32, 2 AdamW steps; each rank also saves its own slices. Then ``ds_to_universal``
(no ``--inject_missing_state``) and mt's conversion: mt's weights equal the rank slices
joined here (an independent join and qkv reordering), bit for bit; mt's logits equal this
model's forward on one process (tp 1) with those weights (fp32, 1e-5, the tolerance of the
other format tests).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mt_dist.testing import run_distributed
from mt_formats import convert_checkpoint, load_model

deepspeed = pytest.importorskip("deepspeed")

HIDDEN, HEADS, LAYERS, SEQ, VOCAB, PADDED, TP, PP = 64, 4, 4, 16, 200, 256, 2, 2
FIRST = 2  # GPTModelPipe: layer 0 casts, layer 1 embeds, then the transformer layers
ARGS = argparse.Namespace(
    num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
    ffn_hidden_size=4 * HIDDEN, max_position_embeddings=SEQ, seq_length=SEQ,
    padded_vocab_size=PADDED, make_vocab_size_divisible_by=128, normalization="layernorm",
    layernorm_epsilon=1e-5, openai_gelu=False, add_bias_linear=True, swiglu=False,
    untie_embeddings_and_output_weights=False, position_embedding_type="learned_absolute",
    tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP, init_method_std=0.02)
UNIVERSAL_INFO = {  # GPTModelPipe.universal_checkpoint_info(), with layernorm and biases
    "universal_checkpoint_version": 0.2, "original_vocab_size": VOCAB,
    "padded_vocab_size": PADDED,
    "vocabulary_parameter_patterns": [r"tied_modules.embed.word_embeddings.weight"],
    "pipeline_replicated_parameter_patterns": [
        r"tied_modules.embed.word_embeddings.weight",
        r"tied_modules.embed.position_embeddings.weight"],
    "tp_replicated_parameter_patterns": [
        r"\d+.input_layernorm.weight", r"\d+.post_attention_layernorm.weight", r"\d+.weight",
        r"tied_modules.embed.position_embeddings.weight", r"\d+.self_attention.dense.bias",
        r"\d+.mlp.dense_4h_to_h.bias", r"\d+.input_layernorm.bias",
        r"\d+.post_attention_layernorm.bias", r"\d+.bias"],
    "parameter_with_row_parallelism_patterns": [
        r"\d+.mlp.dense_4h_to_h.weight", r"\d+.self_attention.dense.weight"],
    "parameter_with_2_sub_params_cat_dim_0": [],
}


# ------------------------------------------------ Megatron's tensor-parallel communication
class _Copy(torch.autograd.Function):
    """Into a column-parallel layer: identity forward, gradients summed over TP."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    """Out of a row-parallel layer: partial results summed over TP, gradient as is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Gather(torch.autograd.Function):
    """Vocabulary-parallel logits gathered along the last dimension; each rank's gradient
    is its own columns."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None


def _copy(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _Copy.apply(x, group)


def _reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if group is None else _Reduce.apply(x, group)


def _param(gen: torch.Generator, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=gen) * 0.02)


# ------------------------------------------------------------- the model, in its shape
class EmbeddingPipe(nn.Module):
    """Vocabulary-parallel word embeddings (padded rows included) and positions."""

    def __init__(self, vocab: int, tp: int, tp_rank: int, group: Any) -> None:
        super().__init__()
        self.group, self.part, self.start = group, vocab // tp, tp_rank * (vocab // tp)
        full = torch.randn(vocab, HIDDEN, generator=torch.Generator().manual_seed(1)) * 0.02
        self.word_embeddings = nn.Embedding(self.part, HIDDEN)
        self.word_embeddings.weight = nn.Parameter(full[self.start:self.start + self.part])
        self.position_embeddings = nn.Embedding(SEQ, HIDDEN)
        self.position_embeddings.weight = _param(torch.Generator().manual_seed(2), SEQ, HIDDEN)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.start + self.part)
        local = self.word_embeddings((ids - self.start).masked_fill(outside, 0))
        words = _reduce(local.masked_fill(outside[..., None], 0.0), self.group)
        return words + self.position_embeddings(torch.arange(ids.shape[1]))


class _Linear(nn.Module):
    """A weight and a bias under Megatron's names; ``row``: the input is split, the output
    summed over TP, the (replicated) bias added after the sum."""

    def __init__(self, rows: int, cols: int, gen: torch.Generator, group: Any,
                 row: bool = False) -> None:
        super().__init__()
        self.weight, self.bias = _param(gen, rows, cols), nn.Parameter(torch.zeros(rows))
        self.group, self.row = group, row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row:
            return _reduce(F.linear(x, self.weight), self.group) + self.bias
        return F.linear(_copy(x, self.group), self.weight, self.bias)


class ParallelTransformerLayerPipe(nn.Module):
    """A pre-LayerNorm GPT-2 layer; ``query_key_value`` rows are [local heads, 3, head_dim]."""

    def __init__(self, index: int, tp: int, tp_rank: int, group: Any) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(100 * index + tp_rank)  # each rank's slices
        self.heads = HEADS // tp
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attention = nn.Module()
        self.self_attention.query_key_value = _Linear(3 * HIDDEN // tp, HIDDEN, gen, group)
        self.self_attention.dense = _Linear(HIDDEN, HIDDEN // tp, gen, group, row=True)
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Module()
        self.mlp.dense_h_to_4h = _Linear(4 * HIDDEN // tp, HIDDEN, gen, group)
        self.mlp.dense_4h_to_h = _Linear(HIDDEN, 4 * HIDDEN // tp, gen, group, row=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.self_attention.query_key_value(self.input_layernorm(x))
        q, k, v = qkv.view(b, s, self.heads, 3, -1).permute(3, 0, 2, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.self_attention.dense(attn.transpose(1, 2).reshape(b, s, -1))
        hidden = F.gelu(self.mlp.dense_h_to_4h(self.post_attention_layernorm(x)))
        return x + self.mlp.dense_4h_to_h(hidden)


def _logits(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    local = F.linear(_copy(hidden, embedding.group), embedding.word_embeddings.weight)
    return local if embedding.group is None else _Gather.apply(local, embedding.group)


def _cast(x: torch.Tensor) -> torch.Tensor:  # GPTModelPipe's _to_float16 (fp32 here)
    return x


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (steps * 2, 2, SEQ + 1), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


# ------------------------------------------------------------------------ the run
def _train_and_save(folder: str, extensions: str) -> None:
    """One rank: GPTModelPipe's shape on DeepSpeed's pipeline engine, 2 steps, saved."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from mt_zero.deepspeed_engine import deepspeed_environ, init_deepspeed_distributed

    rank = dist.get_rank()
    os.environ.update(deepspeed_environ(rank, dist.get_world_size(), rank))
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions
    init_deepspeed_distributed(deepspeed)
    # DeepSpeed's rank order is (pipe, data, model): TP groups are consecutive ranks.
    groups = [dist.new_group([s * TP + r for r in range(TP)]) for s in range(PP)]
    tp_rank, group = rank % TP, groups[rank // TP]
    embed = TiedLayerSpec("embed", EmbeddingPipe, PADDED, TP, tp_rank, group,
                          tied_weight_attr=["word_embeddings.weight"])
    layers = [_cast, embed,
              *(LayerSpec(ParallelTransformerLayerPipe, i, TP, tp_rank, group)
                for i in range(LAYERS)),
              LayerSpec(nn.LayerNorm, HIDDEN),
              TiedLayerSpec("embed", EmbeddingPipe, PADDED, TP, tp_rank, group,
                            forward_fn=_logits, tied_weight_attr=["word_embeddings.weight"])]
    module = PipelineModule(layers=layers, loss_fn=_loss,
                            topology=PipeModelDataParallelTopology(num_pp=PP, num_mp=TP,
                                                                   num_dp=1),
                            partition_method="type:ParallelTransformerLayerPipe")
    for name, param in module.named_parameters():  # sliced: counted on every TP rank
        param.model_parallel = (  # type: ignore[attr-defined]
            param.dim() == 2 and "position_embeddings" not in name)
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
              "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(
        model=module, optimizer=torch.optim.AdamW(module.parameters(), lr=1e-2),
        config=config)
    batches = _batches(2)
    for step in range(2):
        engine.train_batch(iter(batches[2 * step:2 * step + 2]))
    engine.save_checkpoint(folder, tag="global_step2", client_state={
        "args": ARGS, "universal_checkpoint_info": UNIVERSAL_INFO, "checkpoint_version": 3.0,
        "iteration": 2})
    torch.save({n: p.detach().clone() for n, p in module.named_parameters()},
               Path(folder) / f"slices-{rank}.pt")


def _joined(folder: Path) -> dict[str, torch.Tensor]:
    """The full tensors (Megatron-DeepSpeed's names, its row orders) from the rank slices."""
    stages: dict[str, list[torch.Tensor]] = {}
    for rank in range(TP * PP):
        for name, tensor in torch.load(folder / f"slices-{rank}.pt").items():
            if rank // TP == 0 or not name.startswith("tied_modules"):  # stage 0's copy
                stages.setdefault(name, []).append(tensor)
    full = {}
    for name, parts in stages.items():
        if "word_embeddings" in name:
            full[name] = torch.cat(parts)[:VOCAB]
        elif name.endswith(("dense.weight", "dense_4h_to_h.weight")):
            full[name] = torch.cat(parts, dim=1)
        elif name.endswith(("query_key_value.weight", "query_key_value.bias",
                            "dense_h_to_4h.weight", "dense_h_to_4h.bias")):
            full[name] = torch.cat(parts)
        else:
            assert all(torch.equal(parts[0], p) for p in parts), name
            full[name] = parts[0]
    return full


def _mt_name(name: str) -> str:
    leaves = {"input_layernorm": "ln1", "self_attention.query_key_value": "attn.qkv",
              "self_attention.dense": "attn.proj", "post_attention_layernorm": "ln2",
              "mlp.dense_h_to_4h": "mlp.fc", "mlp.dense_4h_to_h": "mlp.proj"}
    if name.startswith("tied_modules.embed."):
        return {"word_embeddings": "embed.tokens", "position_embeddings": "embed.positions"}[
            name.split(".")[2]] + ".weight"
    index, rest = name.split(".", 1)
    if int(index) == FIRST + LAYERS:
        return "ln_f." + rest
    module, leaf = rest.rsplit(".", 1)
    return f"blocks.{int(index) - FIRST}.{leaves[module]}.{leaf}"


def test_megatron_deepspeed_universal_checkpoint_reads_exactly(tmp_path: Path) -> None:
    run_distributed(_train_and_save, TP * PP, str(tmp_path / "ckpt"),
                    str(tmp_path / "extensions"), timeout=300)
    step = tmp_path / "ckpt" / "global_step2"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                    "--input_folder", str(step), "--output_folder", str(tmp_path / "universal"),
                    "--num_extract_workers", "1", "--num_merge_workers", "1"],
                   check=True, capture_output=True, timeout=180, env=env)
    convert_checkpoint(tmp_path / "universal", tmp_path / "mt")  # the config from its args
    model = load_model(tmp_path / "mt").eval()
    assert (model.config.n_layers, model.config.n_heads, model.config.vocab_size) == (
        LAYERS, HEADS, VOCAB)

    full = _joined(tmp_path / "ckpt")
    state = model.state_dict()
    assert sorted(state) == sorted(_mt_name(n) for n in full)
    for name, tensor in full.items():
        if "query_key_value" in name:  # Megatron's [heads, 3, d] rows -> mt's [3, heads, d]
            tensor = tensor.view(HEADS, 3, -1, *tensor.shape[1:]).transpose(0, 1).reshape(
                tensor.shape)
        assert torch.equal(state[_mt_name(name)], tensor), name

    # The same model on one process (tp 1) with the joined weights: the same logits.
    embed = EmbeddingPipe(VOCAB, 1, 0, None)
    layers = [ParallelTransformerLayerPipe(i, 1, 0, None) for i in range(LAYERS)]
    final = nn.LayerNorm(HIDDEN)
    for name, tensor in full.items():
        if name.startswith("tied_modules.embed."):
            embed.get_parameter(name.removeprefix("tied_modules.embed.")).data = tensor
        elif int(name.split(".")[0]) == FIRST + LAYERS:
            final.get_parameter(name.split(".", 1)[1]).data = tensor
        else:
            index, rest = name.split(".", 1)
            layers[int(index) - FIRST].get_parameter(rest).data = tensor
    probe = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden = embed(probe)
        for layer in layers:
            hidden = layer(hidden)
        want = _logits(embed, final(hidden))
        assert (model(probe) - want).abs().max() <= 1e-5
