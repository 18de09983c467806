"""Megatron-core ``torch_dist`` checkpoints against megatron-core itself: a GPT saved by
``dist_checkpointing.save`` from a TP 2 run (two gloo ranks) is read by mt with mcore's
logits; an mt Llama written with ``--to mcore`` is loaded by ``dist_checkpointing.load``
into mcore's ``GPTModel`` with mt's logits.

megatron-core targets CUDA; on these CPU ranks it runs with three shims that only move
CUDA housekeeping to the CPU (``torch.cuda.current_device`` answers "cpu" for its scratch
buffers, ``torch.cuda.synchronize`` is a no-op, the inference RNG tracker replaces the CUDA
one: dropout is 0) and an explicit causal mask (its default is built on "cuda"). Its
DistributedOptimizer (benchmarks/mcore_peer.py runs it the same way) also needs
:class:`_CudaOnCpu` while it is built, steps and gathers its state."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.overrides import TorchFunctionMode

from mt_dist.testing import run_distributed
from mt_formats import ConvertError, convert_checkpoint, load_model, open_checkpoint, save_model
from mt_formats.mcore import LAYERS, mcore_parts, state_key
from mt_formats.megatron_args import load_megatron_file
from mt_formats.pretrain import PretrainReader
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
    """megatron-core's GPTModel for ``config`` on this CPU rank at TP ``tp`` (see the module
    docstring), its logits gathered over TP."""
    return _mcore_chunks(config, tp)[0]


def _mcore_chunks(config: GPTConfig, tp: int, pp: int = 1, virtual: int | None = None,
                  first_layers: int | None = None, parallel_output: bool = False) -> list[Any]:
    """megatron-core's GPTModel for ``config`` on this CPU rank at TP ``tp`` x PP ``pp``: this
    rank's stage, or with ``virtual`` (interleaved) stages per rank its model chunk of each
    (``first_layers`` in the first stage, else even stages); logits gathered over TP unless
    ``parallel_output``."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=virtual)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(1)
    llama = config.mlp == "swiglu"
    norm = "RMSNorm" if config.norm == "rmsnorm" else "LayerNorm"
    transformer = TransformerConfig(
        num_layers=config.n_layers, hidden_size=config.hidden,
        num_attention_heads=config.n_heads, num_query_groups=config.n_kv_heads,
        ffn_hidden_size=config.ffn_hidden, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=virtual,
        pipeline_dtype=torch.float32,
        num_layers_in_first_pipeline_stage=first_layers, use_cpu_initialization=True,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        normalization=norm, layernorm_epsilon=config.layernorm_eps,
        gated_linear_unit=llama, activation_func=F.silu if llama else F.gelu,
        add_bias_linear=config.bias, init_method_std=0.05)
    chunks = [None] if virtual is None else list(range(virtual))
    with _CudaOnCpu():  # a later stage's copy of tied embeddings is moved to "cuda"
        return [GPTModel(
            config=transformer, vocab_size=config.vocab_size,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization=norm),
            max_sequence_length=config.seq_len,
            position_embedding_type="rope" if llama else "learned_absolute",
            rotary_base=int(config.rope_theta),
            share_embeddings_and_output_weights=config.tied_embeddings,
            parallel_output=parallel_output, vp_stage=chunk,
            pre_process=parallel_state.is_pipeline_first_stage(False, vp_stage=chunk),
            post_process=parallel_state.is_pipeline_last_stage(False, vp_stage=chunk)).eval()
            for chunk in chunks]


class _CudaOnCpu(TorchFunctionMode):
    """While active: ``device="cuda"`` arguments become the CPU, ``Tensor.cuda()`` keeps a CPU
    tensor where it is, and ``Tensor.type()`` of a CPU tensor answers its CUDA name (by which
    megatron-core's optimizers tell fp32 parameters from fp16 / bf16 ones)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" \
                else name
        return func(*args, **kwargs)


OPTIM_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


#: Adam settings of the megatron-core run that saves (its loader's are megatron-core's
#: defaults), and the keys of its param groups that carry them.
ADAM = {"lr": 1e-2, "adam_beta1": 0.8, "adam_beta2": 0.9, "adam_eps": 1e-6,
        "weight_decay": 0.05}
GROUP_SETTINGS = ("wd_mult", "lr", "betas", "eps", "weight_decay", "max_lr")


def _group_settings(optimizer: Any) -> list[dict[str, Any]]:
    return [{key: group.get(key) for key in GROUP_SETTINGS}
            for group in optimizer.state_dict()["optimizer"]["param_groups"]]


def _adam(config: GPTConfig, bucket_size: int | None = None, tp: int = 1, bf16: bool = False,
          **settings: float) -> tuple[Any, Any, Any]:
    """megatron-core's GPTModel, its DistributedDataParallel and its DistributedOptimizer
    (torch AdamW: no apex / Transformer Engine here) at TP ``tp`` x DP world size / tp, with
    Adam ``settings`` (OptimizerConfig's; default lr 1e-3); with ``bucket_size``, gradients
    reduced in buckets of about that many elements while the backward runs (else one);
    ``bf16``: the model in bf16 as Megatron-LM's ``--bf16`` runs it (``Float16Module``, fp32
    main params, gradients reduced in fp32)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    model = _mcore_model(config, tp=tp).train()
    model.config.bf16 = bf16
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=bucket_size is not None,
        bucket_size=bucket_size, grad_reduce_in_fp32=bf16),
        Float16Module(model.config, model) if bf16 else model)
    with _CudaOnCpu():
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", use_distributed_optimizer=True, bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            **{"lr": 1e-3, **settings}), [ddp])
    return model, ddp, optimizer


def _optimizer_state(model: Any, optimizer: Any, loading: bool = False,
                     sharding: str = OPTIM_FORMAT["distrib_optim_sharding_type"]) -> Any:
    with _CudaOnCpu():
        return optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=loading,
                                            metadata={"distrib_optim_sharding_type": sharding})


def _states(state: Any) -> dict[str, torch.Tensor]:
    """Key -> whole tensor of an optimizer sharded state dict's ``fully_reshardable``
    states (gathered on every DP rank: megatron-core's own view of its Adam state); the
    state dict is used up."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    apply_factories(state)  # swiglu's linear_fc1: its gate and up halves as two pieces
    whole: dict[str, torch.Tensor] = {}
    for piece in nested_values(state["param_state"]):  # stacked tensors: a piece per layer
        tensor = whole.setdefault(piece.key, torch.empty(piece.global_shape,
                                                         dtype=piece.dtype))
        extent = (1,) * piece.prepend_axis_num + tuple(piece.local_shape)
        tensor[tuple(slice(start, start + size) for start, size in
                     zip(piece.global_offset, extent, strict=True))] = piece.data.reshape(extent)
    return whole


def _train_save(directory: str, steps: int, sharding: str = "fully_reshardable",
                bucket_size: int | None = None, tp: int = 1, bf16: bool = False,
                legacy: str | None = None, **settings: float
                ) -> tuple[dict[str, torch.Tensor], float, list[dict[str, Any]], Any]:
    """LLAMA trained ``steps`` Adam steps at TP ``tp`` (each DP rank its own batch, settings
    :data:`ADAM` and ``settings``, gradients in buckets of ``bucket_size``; in ``bf16`` as
    :func:`_adam` says), saved with its
    distributed optimizer's state in layout ``sharding`` by ``dist_checkpointing.save`` as
    Megatron-LM saves it (``model`` and ``optimizer``; with ``legacy``, in Megatron-LM's
    per-rank files there too: :func:`_save_legacy`); returns megatron-core's states (its
    gathered ``fully_reshardable`` view; at TP 1 only), step count, param groups' settings
    and the state as this rank holds it (:func:`_pieces`)."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import finalize_model_grads

    model, ddp, optimizer = _adam(LLAMA, bucket_size, tp, bf16, **ADAM, **settings)
    tokens = torch.randint(0, LLAMA.vocab_size, (2, 16), generator=torch.Generator()
                           .manual_seed(parallel_state.get_data_parallel_rank()))
    positions = torch.arange(16)[None].expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, 16, 16), diagonal=1).bool()
    for _ in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        logits = ddp(tokens, positions, attention_mask=mask).float()
        torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                          tokens.roll(-1, 1).flatten()).backward()
        finalize_model_grads([ddp])
        with _CudaOnCpu():
            optimizer.step()
    state = {"model": model.sharded_state_dict(),
             "optimizer": _optimizer_state(model, optimizer, sharding=sharding),
             "iteration": steps}  # Megatron-LM's training step, in the common state
    dist_checkpointing.save(state, directory)
    if legacy is not None:  # the same model in Megatron-LM's per-rank files too
        _save_legacy(legacy, [model], optimizer,
                     _megatron_lm_args(LLAMA, tp, LLAMA.vocab_size), steps)
    states = _states(_optimizer_state(model, optimizer)) if tp == 1 else {}
    step = optimizer.state_dict()["optimizer"]["param_groups"][0]["step"]
    return states, float(step), _group_settings(optimizer), _pieces(model, optimizer)


#: The local spec's norms and the keys they are saved under.
_NORM_KEYS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
              "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _pieces(model: Any, optimizer: Any) -> dict[tuple[int, str, int], dict[str, Any]]:
    """This rank's pieces of the distributed optimizer's state straight from its memory (no
    checkpoint code): per TP rank, stored key and layer (-1: not stacked), per state, the
    first element of the piece in the flattened shard of the parameter and its values."""
    from megatron.core import parallel_state

    inner = optimizer.chained_optimizers[0]
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    layers = getattr(model.decoder, "layers", [])
    pieces: dict[tuple[int, str, int], dict[str, Any]] = {}
    for name, param in model.named_parameters():
        if param not in inner.model_param_gbuf_map:  # all of it on the other rank
            continue
        buffer, dtypes, bucket = inner.model_param_gbuf_map[param]
        ranges = inner.gbuf_ranges[buffer][dtypes][bucket]["param_map"][param]
        layer, key = -1, name
        if (match := re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)) is not None:
            rest = match[2]
            for module, saved in _NORM_KEYS.items():
                rest = rest.replace(module, saved)
            layer, key = layers[int(match[1])].layer_number - 1, LAYERS + rest  # global
        tensors = inner._get_main_param_and_optimizer_states(param)
        pieces[tp_rank, key, layer] = {state: (ranges["param"].start,
                                               tensors[state].detach().clone())
                                       for state in ("param", "exp_avg", "exp_avg_sq")}
    return pieces


def _set_states_but_step(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
    """megatron-core 0.16.1's ``DistributedOptimizer._set_main_param_and_optimizer_states``
    (its non-precision-aware branch) without ``step``: loading ``fully_reshardable`` state
    hands it no ``step`` while it copies every key of torch AdamW's state, which has one
    (KeyError 'step', for megatron-core's own checkpoints too); ``load_state_dict`` already
    set torch's ``step`` from the param groups."""
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    for key, target in {"param": main_param, **self.optimizer.state[main_param]}.items():
        if key != "step":
            target.copy_(tensors[key])


def _load_adam(directory: str) -> tuple[dict[str, torch.Tensor], list[float],
                                        list[dict[str, Any]], Any]:
    """A fresh LLAMA + DistributedOptimizer (default settings) loaded from ``directory`` as
    Megatron-LM loads it; returns its states (gathered again), its param groups' steps,
    their settings and the common state's ``iteration`` (Megatron-LM's training step)."""
    from megatron.core import dist_checkpointing
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    DistributedOptimizer._set_main_param_and_optimizer_states = _set_states_but_step
    model, _, optimizer = _adam(LLAMA)
    # Its state_dict() (which sharded_state_dict(is_loading=True) calls) asserts one step
    # count over torch AdamW's state, empty before the first step: megatron-core's own
    # zero-gradient step allocates it (what it does before loading an fsdp_dtensor state);
    # loading then overwrites moments, main params, weights and step.
    optimizer.chained_optimizers[0]._init_optimizer_states_with_dummy_values()
    request = {"model": model.sharded_state_dict(),
               "optimizer": _optimizer_state(model, optimizer, loading=True)}
    loaded = dist_checkpointing.load(request, directory)
    model.load_state_dict(loaded["model"])
    with _CudaOnCpu():
        optimizer.load_state_dict(loaded["optimizer"])
    steps = [float(group["step"]) for group in
             optimizer.state_dict()["optimizer"]["param_groups"]]
    return (_states(_optimizer_state(model, optimizer)), steps, _group_settings(optimizer),
            loaded.get("iteration"))


def _row_order(theirs: torch.Tensor, ours: torch.Tensor) -> Any:
    """Indices ``i`` with ``ours == theirs[i]`` row by row (each row matched exactly once:
    how mt permuted megatron-core's rows), or all of it for a vector."""
    if ours.dim() == 1:
        assert torch.equal(ours, theirs)
        return slice(None)
    same = (ours[:, None, :] == theirs[None, :, :]).all(-1)
    assert (same.sum(1) == 1).all(), "a row of mt's weight is not one of megatron-core's"
    return same.int().argmax(1)


def _logits(model: Any, vocab: int | None = None) -> torch.Tensor:
    tokens = _tokens(vocab or model.vocab_size)
    seq = tokens.shape[1]
    positions = torch.arange(seq)[None].expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, seq, seq), diagonal=1).bool()
    with torch.no_grad():
        return model(tokens, positions, attention_mask=mask)


def _megatron_lm_args(config: GPTConfig, tp: int, vocab: int, pp: int = 1,
                      first_layers: int | None = None, virtual: int | None = None) -> Any:
    """The ``args`` Megatron-LM puts in a checkpoint's common state (the settings that
    describe the model and layout, and a real Megatron-core enum and torch dtype)."""
    import argparse

    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=config.n_layers, hidden_size=config.hidden,
        num_attention_heads=config.n_heads, ffn_hidden_size=config.ffn_hidden,
        max_position_embeddings=config.seq_len, seq_length=config.seq_len,
        norm_epsilon=config.layernorm_eps,
        normalization="RMSNorm" if config.norm == "rmsnorm" else "LayerNorm",
        swiglu=config.mlp == "swiglu",
        position_embedding_type="rope" if config.position == "rope" else "learned_absolute",
        rotary_base=int(config.rope_theta), group_query_attention=config.n_kv_heads is not None,
        num_query_groups=config.n_kv_heads, add_bias_linear=config.bias,
        untie_embeddings_and_output_weights=not config.tied_embeddings,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        decoder_first_pipeline_num_layers=first_layers,
        virtual_pipeline_model_parallel_size=virtual,
        padded_vocab_size=config.vocab_size, vocab_size=vocab, make_vocab_size_divisible_by=64,
        params_dtype=torch.float32, attention_backend=AttnBackend.auto, init_method_std=0.05)


def _save_legacy(folder: str, chunks: list[Any], optimizer: Any, args: Any,
                 iteration: int) -> None:
    """This rank's files of Megatron-LM's per-rank format (``--ckpt-format torch``) as its
    ``save_checkpoint`` writes them for megatron-core models with the distributed optimizer,
    from the data-parallel rank 0 of each model-parallel rank: ``model_optim_rng.pt``
    (``model``, or ``model0``, ``model1``, ... with interleaved stages: the chunks'
    ``state_dict_for_save_checkpoint()``; the optimizer's state dict, ``args``, the
    scheduler's and the RNG states) and ``distrib_optim.pt`` (``save_parameter_state``,
    gathered over the data-parallel ranks)."""
    import argparse
    import random

    import numpy as np
    from megatron.core import parallel_state

    rank = f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        rank += f"_{parallel_state.get_pipeline_model_parallel_rank():03d}"
    path = Path(folder) / f"iter_{iteration:07d}" / rank / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    with _CudaOnCpu():
        optimizer.save_parameter_state(str(path.parent / "distrib_optim.pt"))
    if parallel_state.get_data_parallel_rank() != 0:
        return
    models = {"model": chunks[0].state_dict_for_save_checkpoint()} if len(chunks) == 1 else {
        f"model{index}": chunk.state_dict_for_save_checkpoint()
        for index, chunk in enumerate(chunks)}
    with _CudaOnCpu():
        state = optimizer.state_dict()
    args = argparse.Namespace(**vars(args), rank=torch.distributed.get_rank(),
                              world_size=torch.distributed.get_world_size())  # as Megatron-LM's
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration, **models,
                "optimizer": state, "opt_param_scheduler": {"max_lr": 1e-2, "num_steps": 2},
                "rng_state": [{"random_rng_state": random.getstate(),
                               "np_rng_state": np.random.get_state(),
                               "torch_rng_state": torch.get_rng_state(),
                               "rng_tracker_states": {}}],
                "num_floating_point_operations_so_far": 0}, path)
    if torch.distributed.get_rank() == 0:
        (Path(folder) / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")


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


def test_mcore_distributed_adam_state_round_trip(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    theirs, step, settings, _ = run_distributed(_train_save, 2, str(tmp_path / "ckpt"), 2,
                                             timeout=300)[0]
    assert step == 2.0 and [group["wd_mult"] for group in settings] == [1.0, 0.0]
    fields = tmp_path / "llama.json"
    fields.write_text(json.dumps(LLAMA.to_dict()))
    result = convert_checkpoint(tmp_path / "ckpt", tmp_path / "pretrain", to="pretrain",
                                model=str(fields))
    assert any("had trained 2 steps" in note for note in result.notes)  # the iteration
    with PretrainReader(tmp_path / "pretrain") as reader:
        assert reader.names() and reader.config.n_kv_heads == 2
        for name in reader.names():  # the moments move with the rows of their weight
            part = mcore_parts(name)
            layer = part.layer if part.layer >= 0 else slice(None)
            weight = theirs[state_key("param", part.key)][layer]
            order = _row_order(weight, reader.read(name))
            state = reader.optimizer_state(name)
            assert state is not None and float(state["step"]) == 2.0
            for moment in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[moment],
                                   theirs[state_key(moment, part.key)][layer][order]), name
    convert_checkpoint(tmp_path / "pretrain", tmp_path / "mcore", to="mcore")
    loaded, steps, groups, iteration = run_distributed(_load_adam, 2, str(tmp_path / "mcore"),
                                                       timeout=300)[0]
    assert steps == [2.0, 2.0] and sorted(loaded) == sorted(theirs)
    assert iteration == 0  # mt's step folder starts a new schedule (Megatron-LM's loader)
    convert_checkpoint(tmp_path / "ckpt", tmp_path / "again", to="mcore", model=str(fields))
    assert run_distributed(_load_adam, 2, str(tmp_path / "again"), timeout=300)[0][3] == 2
    assert groups == settings  # lr, betas, eps, weight decay, peak: through mt's groups
    for key, tensor in theirs.items():  # megatron-core -> mt -> megatron-core: bit for bit
        assert torch.equal(loaded[key], tensor), key
    convert_checkpoint(tmp_path / "pretrain", tmp_path / "weights", to="mcore",
                       drop_optimizer=True)
    stored = dcp.FileSystemReader(tmp_path / "weights").read_metadata().state_dict_metadata
    assert not [key for key in stored if key.startswith("optimizer.")]
    with open_checkpoint(tmp_path / "weights") as reader:
        assert reader.optimizer_state("blocks.0.attn.q.weight") is None


def test_a_decoupled_learning_rate_group_is_not_guessed(tmp_path: Path) -> None:
    """megatron-core with a decoupled learning rate (its embedding and output layer in a
    third group of their own peak): ``common.pt`` keeps the groups' settings, not which
    parameters each holds, so mt reads no settings for the matrices (two groups of
    ``wd_mult`` 1 that differ) and says so, while the norms' group is read; the moments
    and the step still travel."""
    (tmp_path / "ckpt").mkdir()
    _, step, settings, _ = run_distributed(_train_save, 2, str(tmp_path / "ckpt"), 1,
                                        decoupled_lr=5e-2, timeout=300)[0]
    assert sorted((g["wd_mult"], g["max_lr"]) for g in settings) == [  # megatron-core's
        (0.0, 1e-2), (1.0, 1e-2), (1.0, 5e-2)]
    fields = tmp_path / "llama.json"
    fields.write_text(json.dumps(LLAMA.to_dict()))
    with open_checkpoint(tmp_path / "ckpt", model=str(fields)) as reader:
        assert reader.optimizer_settings("blocks.0.attn.q.weight") is None
        assert reader.optimizer_settings("embed.tokens.weight") is None
        norm = reader.optimizer_settings("blocks.0.ln1.weight")
        assert norm is not None and norm["initial_lr"] == 1e-2  # its max_lr: the peak
        assert float(reader.optimizer_state("head.weight")["step"]) == step == 1.0
    result = convert_checkpoint(tmp_path / "ckpt", tmp_path / "dcp", to="dcp",
                                model=str(fields))
    assert any("no Adam hyperparameters" in note for note in result.notes), result.notes


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP folder, whole."""
    meta = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    state = {key: torch.empty(m.size, dtype=m.properties.dtype)
             for key, m in meta.items() if hasattr(m, "size")}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state


Held = dict[tuple[int, str, int], dict[str, torch.Tensor]]


def _bucketed_run(root: Path, tp: int, bf16: bool = False, legacy: bool = False
                  ) -> tuple[Path, Held, Path]:
    """LLAMA trained 2 steps on two ranks (DP 2, or TP 2; in ``bf16`` as :func:`_adam`
    says), its gradients reduced in buckets of about 20,000 elements, saved as Megatron-LM
    saves it by default ('dp_reshardable'; with ``legacy``, in its per-rank files under
    ``root / "legacy"`` too);
    with the optimizer's state as its ranks held it (per TP rank, stored key and layer, per
    state: the whole flattened shard, from its DP ranks' pieces) and the model config file."""
    (root / "ckpt").mkdir(parents=True)
    ranks = run_distributed(_train_save, 2, str(root / "ckpt"), 2, "dp_reshardable", 20_000,
                            tp, bf16, str(root / "legacy") if legacy else None, timeout=300)
    assert ranks[0][1] == 2.0
    found: dict[tuple[tuple[int, str, int], str], list[tuple[int, torch.Tensor]]] = {}
    for *_, pieces in ranks:
        for param, states in pieces.items():
            for state, piece in states.items():
                found.setdefault((param, state), []).append(piece)
    held: Held = {}
    for (param, state), parts in found.items():  # in order, the pieces make the whole shard
        parts.sort(key=lambda piece: piece[0])
        assert [start for start, _ in parts] == list(itertools.accumulate(
            [0] + [values.numel() for _, values in parts[:-1]]))
        held.setdefault(param, {})[state] = torch.cat([values for _, values in parts])
    fields = root / "llama.json"
    fields.write_text(json.dumps(LLAMA.to_dict()))
    return root / "ckpt", held, fields


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Held, Path]:
    return _bucketed_run(tmp_path_factory.mktemp("bucketed"), tp=1, legacy=True)


def _cut(key: str, tensor: torch.Tensor, rank: int, tp: int, gated: bool = True
         ) -> torch.Tensor:
    """Megatron-core's TP ``rank`` shard of stored tensor ``key`` (one layer of it): rows of
    the column-parallel ones (of a ``gated`` ``linear_fc1``, its gate rows' and its up
    rows'), columns of the row-parallel ones, all of a replicated one."""
    leaf = key.removeprefix(LAYERS)
    if gated and leaf == "mlp.linear_fc1.weight":
        gate, up = tensor.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    if leaf in ("embedding.word_embeddings.weight", "output_layer.weight",
                "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                "mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
        return tensor.chunk(tp)[rank]
    if leaf in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        return tensor.chunk(tp, dim=1)[rank]
    return tensor


def _same_as_held(ours: dict[str, torch.Tensor], held: Held, tp: int) -> None:
    """mt's fully_reshardable tensors, cut as each TP rank holds them, equal what the ranks
    held, bit for bit: moments, fp32 main params, and the weights (those main params, in the
    weights' dtype)."""
    assert len(held) == 15 * tp  # the embedding, 2 x 6 in the layers, the final norm, the head
    for (rank, key, layer), states in held.items():
        for state, values in states.items():
            tensor = ours[state_key(state, key)]
            tensor = tensor if layer < 0 else tensor[layer]
            assert torch.equal(_cut(key, tensor, rank, tp).flatten(), values), (
                rank, key, layer, state)
        weight = ours[key] if layer < 0 else ours[key][layer]
        assert torch.equal(_cut(key, weight, rank, tp).flatten(),
                           states["param"].to(weight.dtype)), (rank, key, layer)


def test_megatron_lm_s_default_bucketed_optimizer_state_reads_bit_for_bit(
        bucketed: tuple[Path, Held, Path], tmp_path: Path) -> None:
    """Megatron-LM's default layout of the distributed optimizer's state ('dp_reshardable':
    per gradient bucket, flat buffers laid out by megatron-core's DistributedDataParallel;
    here three buckets over DP 2) converts to the 'fully_reshardable' layout bit for bit as
    the ranks held the state: moments and fp32 main params, which are the weights; the step
    travels. (megatron-core 0.16.1's own gathered 'fully_reshardable' view of this
    optimizer is off past its first bucket, with a warning that a parameter's range
    "exceeds unpadded buffer by 64 elements": with one bucket it equals this.)"""
    ckpt, held, fields = bucketed
    stored = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    assert len({key.rpartition(".")[0] for key in stored if ".bucket_idx_" in key}) == 3
    convert_checkpoint(ckpt, tmp_path / "mcore", to="mcore", model=str(fields))
    _same_as_held(_tensors(tmp_path / "mcore"), held, tp=1)
    with open_checkpoint(tmp_path / "mcore") as reader:
        assert float(reader.optimizer_state("blocks.1.mlp.fc.weight")["step"]) == 2.0
    _same_weights(ckpt.parent / "legacy", ckpt, str(fields))  # gathered over DP 2


def test_bucketed_optimizer_state_of_a_bf16_tp2_run_joins_its_ranks_shards(
        tmp_path: Path) -> None:
    """At TP 2 each rank's buffers (dp_group_idx 0 and 1) hold its own shards, laid out from
    the shards' sizes: mt joins them (rows, columns, a gated MLP's gate and up halves), and
    each rank's shard of the result is what that rank held, bit for bit. The run is bf16
    as Megatron-LM's ``--bf16`` runs it: bf16 weights, fp32 main params and gradients (its
    buffers' dtype pair); mt writes bf16 weights and the fp32 main params beside them.
    The same model in Megatron-LM's per-rank files (``--ckpt-format torch``: the local
    spec's norms under their module names, each rank's shards, a gated MLP's halves cut)
    reads as the same tensors; tampered ones (a replicated norm that differs, an extra
    tensor, args off the grid, a shard of another dtype, another iteration, a rank's
    distrib_optim.pt gone or empty, a rank folder twice, the TP ranks' folders swapped) are
    refused in one line."""
    import shutil

    ckpt, held, fields = _bucketed_run(tmp_path / "tp2", tp=2, bf16=True, legacy=True)
    stored = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    assert {key.split(".")[2] for key in stored if ".bucket_idx_" in key} == {
        "dp_group_idx_0", "dp_group_idx_1"}
    assert all("dtype_(torch.bfloat16, torch.float32)" in key for key in stored
               if ".bucket_idx_" in key)
    assert stored["output_layer.weight"].properties.dtype == torch.bfloat16
    convert_checkpoint(ckpt, tmp_path / "mcore", to="mcore", model=str(fields))
    ours = _tensors(tmp_path / "mcore")
    assert ours["output_layer.weight"].dtype == torch.bfloat16
    assert ours[state_key("param", "output_layer.weight")].dtype == torch.float32
    _same_as_held(ours, held, tp=2)
    _same_weights(tmp_path / "tp2" / "legacy", ckpt, str(fields))
    tampered = run_distributed(_tamper, 1, str(tmp_path / "tp2" / "legacy"), timeout=120)[0]
    alone = tmp_path / "tp2" / "alone"  # one rank's distrib_optim.pt gone
    shutil.copytree(tmp_path / "tp2" / "legacy", alone)
    (alone / "iter_0000002" / "mp_rank_01" / "distrib_optim.pt").unlink()
    tampered[str(alone)] = "mp_rank_01/distrib_optim.pt: absent, while"
    empty = tmp_path / "tp2" / "empty"  # one rank's distrib_optim.pt of no bytes
    shutil.copytree(tmp_path / "tp2" / "legacy", empty)
    (empty / "iter_0000002" / "mp_rank_01" / "distrib_optim.pt").write_bytes(b"")
    tampered[str(empty)] = "mp_rank_01/distrib_optim.pt: empty, while"
    with open_checkpoint(tmp_path / "tp2" / "legacy") as reader:
        reader.check_optimizer_files()
    for folder in (alone, empty):  # from the headers, as `mt convert --dry-run` asks
        with open_checkpoint(folder) as reader, pytest.raises(ConvertError, match=", while"):
            reader.check_optimizer_files()
    twice = tmp_path / "tp2" / "twice"  # TP rank 0's folder under a pipeline rank's name too
    shutil.copytree(tmp_path / "tp2" / "legacy", twice)
    shutil.copytree(twice / "iter_0000002" / "mp_rank_00", twice / "iter_0000002" /
                    "mp_rank_00_000")
    tampered[str(twice)] = "holds TP rank 0 of stage 0, as"
    swapped = tmp_path / "tp2" / "swapped"  # the TP ranks' folders swapped, model and optimizer
    shutil.copytree(tmp_path / "tp2" / "legacy", swapped)
    ranks = swapped / "iter_0000002"
    (ranks / "mp_rank_00").rename(ranks / "mp_rank_xx")
    (ranks / "mp_rank_01").rename(ranks / "mp_rank_00")
    (ranks / "mp_rank_xx").rename(ranks / "mp_rank_01")
    tampered[str(swapped)] = ("mp_rank_00/model_optim_rng.pt: saved by global rank 1 of 2, "
                              "which does not hold TP rank 0 of pipeline stage 0")
    for folder, expected in tampered.items():
        with pytest.raises(ConvertError) as refused:
            convert_checkpoint(folder, tmp_path / "out", to="mcore")
        message = str(refused.value)
        assert "\n" not in message and expected in message, (folder, message)
        assert not (tmp_path / "out").exists()


def _tamper(legacy: str) -> dict[str, str]:
    """Copies of a TP 2 run's per-rank files (``legacy``) each spoilt one way (in a rank
    process: their args unpickle megatron-core's enum), and the words their refusal names."""
    import shutil

    def spoil(name: str, change: Callable[[dict[str, Any]], Any], rank: int = 1) -> str:
        folder = Path(legacy).parent / name
        shutil.copytree(legacy, folder)
        path = folder / "iter_0000002" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"
        data = torch.load(path, weights_only=False)
        change(data)
        torch.save(data, path)
        return str(folder)

    def norm(data: dict[str, Any]) -> None:
        data["model"]["decoder.layers.1.input_layernorm.weight"] += 1

    def router(data: dict[str, Any]) -> None:
        data["model"]["decoder.layers.0.mlp.router.weight"] = torch.zeros(4, 64)

    def grid(data: dict[str, Any]) -> None:
        data["args"].tensor_model_parallel_size = 4

    def dtype(data: dict[str, Any]) -> None:
        key = "decoder.layers.0.self_attention.linear_qkv.weight"
        data["model"][key] = data["model"][key].float()

    def iteration(data: dict[str, Any]) -> None:
        data["iteration"] = 3

    return {spoil("norm", norm): "'decoder.layers.1.input_layernorm.weight' differs from",
            spoil("router", router): "holds other tensors than",
            spoil("grid", grid, rank=0): "not the TP 4 x PP 1 grid Megatron-LM's args record",
            spoil("dtype", dtype): "linear_qkv.weight is torch.float32 [64, 64], ",
            spoil("iteration", iteration): "iteration 3, in the folder of iteration 2"}


def test_a_coalesced_buffer_s_layout_is_the_one_whose_main_params_round_to_the_weights(
        ) -> None:
    """distrib_optim.pt records no bucket sizes: after each parameter its bucket may go on
    (the next one at the next multiple of 64) or end (the next one right after it); the
    main parameters found there must round to the weights, and the buffer be filled."""
    from mt_formats.mcore_buckets import coalesced_starts

    sizes = {"a": 100, "b": 30, "c": 50}  # registration order; laid out c, b, a
    params = [((name, -1), numel, False) for name, numel in sizes.items()]
    buffer = torch.zeros(300)
    truth = {"c": 0, "b": 50, "a": 114}  # b opens a bucket at 50; a follows, 64 after it
    for name, start in truth.items():
        buffer[start:start + sizes[name]] = float(ord(name))

    def rounds(param: tuple[str, int], start: int) -> bool:
        return bool((buffer[start:start + sizes[param[0]]] == ord(param[0])).all())

    assert coalesced_starts(params, 214, rounds) == [{(n, -1): s for n, s in truth.items()}]
    assert coalesced_starts(params, 215, rounds) == []  # the buffer not filled
    # Where every position rounds (all-zero state), two layouts put d at 178: b at 64, c at
    # 128 and d opening a bucket; b opening one at 50, c at 114 and d following: refused.
    both = [(("d", -1), 10, False), (("c", -1), 50, False), (("b", -1), 14, False),
            (("a", -1), 50, False)]
    assert len(coalesced_starts(both, 188, lambda param, start: True)) == 2


def _same_weights(legacy: Path, ckpt: Path, model: str | None = None) -> None:
    """Megatron-LM's per-rank files of a megatron-core model (``--ckpt-format torch``) read
    as the same tensors, bit for bit, as its ``torch_dist`` checkpoint (read against
    megatron-core's logits and state above): the weights, and Adam's state from its
    ``distrib_optim.pt`` files (moments, fp32 main params, step, settings)."""
    with open_checkpoint(legacy) as files, open_checkpoint(ckpt, model=model) as folder:
        assert files.format == "megatron"  # init_std: the args' (0.05), not --model's
        assert files.config == folder.config.replace(init_std=0.05)
        assert files.names() == folder.names()
        for name in files.names():
            ours = files.read(name)
            assert ours.dtype == folder.spec(name).dtype, name
            assert torch.equal(ours, folder.read(name)), name
            state, theirs = files.optimizer_state(name), folder.optimizer_state(name)
            assert state is not None and theirs is not None and state.keys() == theirs.keys()
            for key, tensor in state.items():
                assert torch.equal(tensor, theirs[key]), (name, key)
            assert files.optimizer_settings(name) == folder.optimizer_settings(name), name
        assert files.notes == ()


#: GPT-2-shaped, 3 layers: over two pipeline stages, 1 in the first and 2 in the last.
GPT3 = GPTConfig(n_layers=3, hidden=64, n_heads=4, vocab_size=128, seq_len=32,
                 layernorm_eps=1e-5)


def _train_save_pipelined(directory: str, config: GPTConfig, tp: int, pp: int,
                          virtual: int | None = None, first_layers: int | None = None) -> Any:
    """``config`` (tied embeddings) trained 2 Adam steps at TP ``tp`` x PP ``pp`` (with
    ``virtual`` interleaved stages per rank; ``first_layers`` in the first stage) by
    megatron-core's pipeline schedule (2 micro-batches per stage), gradients in buckets of
    about 20,000 elements (megatron-core buckets the first stage's first model chunk only)
    and reduced as Megatron-LM's training loop does (``finalize_model_grads``: the two
    copies of the embeddings summed), saved as Megatron-LM saves it by default
    ('dp_reshardable', with its args and iteration) and in its per-rank files under
    ``directory``'s sibling ``legacy`` (:func:`_save_legacy`); returns this rank's state
    (:func:`_pieces`)."""
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks = [chunk.train() for chunk in _mcore_chunks(
        config, tp, pp, virtual, first_layers=first_layers, parallel_output=True)]
    ddps = [DistributedDataParallel(chunk.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=20_000), chunk,
        disable_bucketing=index > 0) for index, chunk in enumerate(chunks)]
    chunks[0].config.finalize_model_grads_func = finalize_model_grads
    with _CudaOnCpu():
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", use_distributed_optimizer=True, **ADAM), ddps)
    tokens = _tokens(config.vocab_size)
    positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, tokens.shape[1], tokens.shape[1]), diagonal=1).bool()

    def forward_step(_: Any, chunk: Any) -> Any:
        losses = chunk(tokens, positions, attention_mask=mask, labels=tokens.roll(-1, 1))
        return losses, lambda out: (out.mean(), {"loss": out.mean().detach()})

    for _ in range(2):
        for ddp in ddps:
            ddp.zero_grad_buffer()
        optimizer.zero_grad()
        with _CudaOnCpu():
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=[None] * len(ddps),
                model=ddps, num_microbatches=2 * pp, seq_length=tokens.shape[1],
                micro_batch_size=2)
            optimizer.step()
    state: dict[str, Any] = {f"model{index}": chunk.sharded_state_dict()
                             for index, chunk in enumerate(chunks)}
    with _CudaOnCpu():
        state["optimizer"] = optimizer.sharded_state_dict(
            state, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    args = _megatron_lm_args(config, tp, config.vocab_size, pp, first_layers, virtual)
    dist_checkpointing.save({**state, "args": args, "checkpoint_version": 3.0,
                             "iteration": 2}, directory)
    _save_legacy(str(Path(directory).parent / "legacy"), chunks, optimizer, args, 2)
    return {key: states for chunk in chunks for key, states in
            _pieces(chunk, optimizer).items()}


def _pipelined_run(root: Path, config: GPTConfig, tp: int, pp: int, **layout: Any
                   ) -> tuple[Path, Held]:
    """:func:`_train_save_pipelined` on ``tp * pp`` ranks (DP 1: each rank's pieces are its
    whole shards): its folder and the state its ranks held."""
    (root / "ckpt").mkdir(parents=True)
    ranks = run_distributed(_train_save_pipelined, tp * pp, str(root / "ckpt"), config, tp,
                            pp, timeout=300, **layout)
    held: Held = {}
    for pieces in ranks:
        for param, states in pieces.items():
            assert all(start == 0 for start, _ in states.values())
            held[param] = {state: values for state, (_, values) in states.items()}
    return root / "ckpt", held


def _same_as_held_pipelined(ours: dict[str, torch.Tensor], held: Held, tp: int,
                            where: str) -> None:
    """mt's fully_reshardable tensors of a GPT-2-shaped model, cut as each TP rank holds
    them, equal what the ranks held bit for bit; the last stage's copy of the tied
    embeddings equal to the embeddings."""
    for (rank, key, layer), states in held.items():
        key = key.replace("output_layer.weight", "embedding.word_embeddings.weight")
        for state, values in states.items():
            tensor = ours[state_key(state, key)]
            tensor = tensor if layer < 0 else tensor[layer]
            assert torch.equal(_cut(key, tensor, rank, tp, gated=False).flatten(), values), (
                where, rank, key, layer, state)


def test_bucketed_optimizer_state_of_a_tp2_pp2_run_reads_bit_for_bit(tmp_path: Path) -> None:
    """At TP 2 x PP 2 model-parallel rank ``pp_rank * 2 + tp_rank`` holds its shards of its
    stage's parameters; with tied embeddings the last stage holds a copy of the word
    embeddings as its output layer, each copy in a bucket of its own, and the first stage's
    buckets only are cut by size. mt finds how many layers each stage holds (1 and 2) from
    the buckets' sizes and reads the state bit for bit as the ranks held it (the last
    stage's copy equal to the first's): from the run's args, and without them (every split
    of the 4 ranks tried). The same model in Megatron-LM's per-rank files reads as the same
    weights and state; with its stages' folders swapped it is refused: by the ranks the
    files record, and where they record one rank (a converter's files) by the stages'
    roles."""
    import shutil

    ckpt, held = _pipelined_run(tmp_path, GPT3, 2, 2, first_layers=1)
    assert len(held) == 2 * (2 + 3 * 12 + 2 + 1)  # per TP rank: + the tied copy
    stored = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    assert {key.split(".")[2] for key in stored if ".bucket_idx_" in key} == {
        f"dp_group_idx_{rank}" for rank in range(4)}
    bare = tmp_path / "bare"  # the same run without Megatron-LM's args
    shutil.copytree(ckpt, bare)
    common = load_megatron_file(bare / "common.pt")  # not megatron-core's enum: see above
    del common["args"]
    torch.save(common, bare / "common.pt")
    fields = tmp_path / "gpt3.json"
    fields.write_text(json.dumps(GPT3.to_dict()))
    for source, model in ((ckpt, None), (bare, str(fields))):
        convert_checkpoint(source, tmp_path / f"{source.name}-mcore", to="mcore", model=model)
        _same_as_held_pipelined(_tensors(tmp_path / f"{source.name}-mcore"), held, 2,
                                source.name)
    _same_weights(tmp_path / "legacy", ckpt)  # the last stage's copy of the embeddings too
    swapped = tmp_path / "swapped" / "iter_0000002"  # the stages' folders swapped
    shutil.copytree(tmp_path / "legacy", swapped.parent)
    for rank in ("mp_rank_00", "mp_rank_01"):
        (swapped / f"{rank}_000").rename(swapped / "first")
        (swapped / f"{rank}_001").rename(swapped / f"{rank}_000")
        (swapped / "first").rename(swapped / f"{rank}_001")
    with pytest.raises(ConvertError, match=r"mp_rank_00_000/model_optim_rng\.pt: saved by "
                                           r"global rank 2 of 4, which does not hold TP rank 0 "
                                           r"of pipeline stage 0"):
        convert_checkpoint(swapped.parent, tmp_path / "out", to="mcore")
    run_distributed(_one_saver, 1, str(swapped), timeout=120)
    with pytest.raises(ConvertError, match=r"mp_rank_00_000/model_optim_rng\.pt: model\."
                                           r"decoder\.final_layernorm\.weight belongs to the "
                                           r"last pipeline stage"):
        convert_checkpoint(swapped.parent, tmp_path / "out", to="mcore")


def _one_saver(folder: str) -> None:
    """Every rank file's ``args.rank`` made 0, as a converter that writes all ranks from one
    process records it (in a rank process: the args unpickle megatron-core's enum)."""
    for path in Path(folder).rglob("model_optim_rng.pt"):
        data = torch.load(path, weights_only=False)
        data["args"].rank = 0
        torch.save(data, path)


def test_bucketed_optimizer_state_of_interleaved_pipeline_stages_reads_bit_for_bit(
        tmp_path: Path) -> None:
    """With 2 interleaved (virtual) stages per rank at PP 2, each rank holds two model
    chunks, each in a buffer of its own (``gbuf_idx`` 0 and 1): buffer ``c`` of pipeline
    rank ``p`` is virtual stage ``c * 2 + p``, one layer each here. mt reads the state bit
    for bit as the ranks held it."""
    config = dataclasses.replace(GPT3, n_layers=4)
    ckpt, held = _pipelined_run(tmp_path, config, 1, 2, virtual=2)
    stored = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    assert {tuple(key.split(".")[2:4]) for key in stored if ".bucket_idx_" in key} == {
        (f"dp_group_idx_{rank}", f"gbuf_idx_{chunk}") for rank in (0, 1) for chunk in (0, 1)}
    convert_checkpoint(ckpt, tmp_path / "mcore", to="mcore")
    _same_as_held_pipelined(_tensors(tmp_path / "mcore"), held, 1, "interleaved")
    assert len(held) == 2 + 4 * 12 + 2 + 1
    _same_weights(tmp_path / "legacy", ckpt)  # model0 and model1 in each rank's file


def test_a_bucket_layout_that_does_not_fit_the_weights_is_refused(
        bucketed: tuple[Path, Held, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The buckets record their sizes, not where each parameter lies: of the layer orders
    mt knows, the one that fills the sizes and whose main parameters round to the weights is
    read. Given only orders that do not (Transformer Engine's, for a run of the local spec),
    the conversion is refused in one line naming what was tried and --drop-optimizer, which
    converts the weights."""
    from mt_formats import mcore_buckets

    ckpt, held, fields = bucketed
    monkeypatch.setattr(mcore_buckets, "LAYER_ORDERS", {
        name: order for name, order in mcore_buckets.LAYER_ORDERS.items() if name != "local"})
    with pytest.raises(ConvertError) as refused:
        convert_checkpoint(ckpt, tmp_path / "out", to="pretrain", model=str(fields))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{ckpt / '.metadata'}:"), message
    assert "transformer_engine: fills them, but its main parameters do not round" in message
    assert "fit none of the layer orders" in message and "--drop-optimizer" in message, message
    assert not (tmp_path / "out").exists()
    convert_checkpoint(ckpt, tmp_path / "out", to="mcore", model=str(fields),
                       drop_optimizer=True)
    ours = _tensors(tmp_path / "out")
    assert torch.equal(ours[LAYERS + "mlp.linear_fc2.weight"][1].flatten(),
                       held[0, LAYERS + "mlp.linear_fc2.weight", 1]["param"])


def test_buckets_whose_args_disagree_with_them_are_refused_in_one_line(
        bucketed: tuple[Path, Held, Path], tmp_path: Path) -> None:
    """Buckets of one model-parallel rank with one buffer whose Megatron-LM args record 2
    pipeline stages, or 2 interleaved (virtual) stages, are refused in one line naming the
    file and --drop-optimizer; with --drop-optimizer the weights convert."""
    import argparse
    import shutil

    ckpt, _, fields = bucketed
    for args, expected in (
            (argparse.Namespace(pipeline_model_parallel_size=2),
             "buckets are of 1 model-parallel ranks, but the run's args record "
             "tensor_model_parallel_size None and pipeline_model_parallel_size 2"),
            (argparse.Namespace(virtual_pipeline_model_parallel_size=2),
             "args record 2 model chunk(s) per pipeline rank "
             "(virtual_pipeline_model_parallel_size), but each rank holds 1 buffer(s)")):
        staged = tmp_path / f"staged-{len(expected)}"
        shutil.copytree(ckpt, staged)
        common = torch.load(staged / "common.pt", weights_only=False)
        common["args"] = args
        torch.save(common, staged / "common.pt")
        with pytest.raises(ConvertError) as refused:
            convert_checkpoint(staged, tmp_path / "out", to="pretrain", model=str(fields))
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"{staged / '.metadata'}:"), message
        assert expected in message and "--drop-optimizer" in message, message
        assert not (tmp_path / "out").exists()
    convert_checkpoint(staged, tmp_path / "out", to="pretrain", model=str(fields),
                       drop_optimizer=True)


def test_a_bf16_model_s_fp32_main_params_become_the_masters(tmp_path: Path) -> None:
    """A bf16 Megatron-core model whose distributed optimizer keeps fp32 main params
    (``optimizer.state.param.*``): --to pretrain takes them, not the bf16 weights, as
    mt's fp32 weights and masters (bit for bit the fp32 model), with the moments; --to mcore
    writes them back as the main params."""
    from mt_formats.mcore import optimizer_common

    config = LLAMA
    fp32 = GPT(config, seed=0)
    save_model(fp32, tmp_path / "fp32", to="mcore")
    save_model(GPT(config, seed=0).to(torch.bfloat16), tmp_path / "bf16", to="mcore")

    masters, crafted = _tensors(tmp_path / "fp32"), _tensors(tmp_path / "bf16")
    for key, master in masters.items():
        crafted[state_key("param", key)] = master
        crafted[state_key("exp_avg", key)] = master * 0.5
        crafted[state_key("exp_avg_sq", key)] = master.square()
    (tmp_path / "mixed").mkdir()
    dcp.save(crafted, checkpoint_id=str(tmp_path / "mixed"), no_dist=True)
    (tmp_path / "mixed" / "metadata.json").write_bytes(
        (tmp_path / "bf16" / "metadata.json").read_bytes())
    torch.save(optimizer_common(3.0), tmp_path / "mixed" / "common.pt")
    fields = tmp_path / "llama.json"
    fields.write_text(json.dumps(config.to_dict()))
    convert_checkpoint(tmp_path / "mixed", tmp_path / "pretrain", to="pretrain",
                       model=str(fields))
    with PretrainReader(tmp_path / "pretrain") as reader:
        for name, weight in fp32.state_dict().items():
            if name == "head.weight" and config.tied_embeddings:
                continue
            assert torch.equal(reader.read(name), weight), name  # not its bf16 rounding
            state = reader.optimizer_state(name)
            assert state is not None and float(state["step"]) == 3.0
            assert torch.equal(state["exp_avg"], weight * 0.5), name
            assert torch.equal(state["exp_avg_sq"], weight.square()), name
    convert_checkpoint(tmp_path / "mixed", tmp_path / "again", to="mcore", model=str(fields))
    again = _tensors(tmp_path / "again")
    for key, master in masters.items():
        assert torch.equal(again[state_key("param", key)], master), key


def test_two_threads_reading_at_once_each_get_their_own_tensor(tmp_path: Path) -> None:
    """`mt convert` reads the next tensor in one thread while the writer asks the source for
    the current one's optimizer state in another, both through the reader's one-layer
    cache. Each read gets its own layer, never the one the other thread loaded (which would
    write, e.g., a 64 x 64 weight as a layer norm's Adam state)."""
    import sys
    from concurrent.futures import ThreadPoolExecutor

    save_model(GPT(LLAMA, seed=0), tmp_path / "ckpt", to="mcore")
    with open_checkpoint(tmp_path / "ckpt") as reader:
        names = [name for name in reader.names() if mcore_parts(name).layer >= 0]
        expected = {name: reader.read(name) for name in names}
        wrong: list[str] = []

        def read_all(order: list[str]) -> None:
            for _ in range(200):
                wrong.extend(name for name in order
                             if not torch.equal(reader.read(name), expected[name]))

        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # switch threads between nearly any two bytecodes
        try:
            with ThreadPoolExecutor(2) as pool:  # result() raises what a thread raised
                for done in [pool.submit(read_all, order) for order in (names, names[::-1])]:
                    done.result()
        finally:
            sys.setswitchinterval(interval)
    assert len(names) >= 8 and wrong == []
