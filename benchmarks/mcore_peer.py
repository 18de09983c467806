"""megatron-core's own GPT training on CPU gloo ranks: the ``mcore`` peer of benchmarks/comm.py.

``build(shape, tp, sequence_parallel, distributed_optimizer, bucket_numel)``, called inside
already-initialized gloo ranks, returns a :class:`McorePeer`; its ``step(batches)`` trains
megatron-core's ``GPTModel`` (GPT-2 style: LayerNorm, learned positions, gelu MLP of 4x hidden,
biases, tied embeddings, no dropout; weights from ``torch.manual_seed(0)``) one optimizer step
over this data-parallel rank's micro-batches. Everything that communicates is megatron-core's:

- ``DistributedDataParallel(overlap_grad_reduce=True)``: the micro-batches but the last run
  under ``no_sync()``; in the last one's backward each full bucket's all-reduce (with the
  distributed optimizer: reduce-scatter) is launched asynchronously from the gradient hooks
  (in the first step, which records when the buckets fill, from ``finalize_model_grads``);
  ``finalize_model_grads`` waits for them and sums the sequence-parallel LayerNorm / bias
  gradients over the TP group;
- ``get_megatron_optimizer``: without apex or Transformer Engine, megatron-core itself falls back
  to ``torch.optim.AdamW``, wrapped in its ``FP32Optimizer`` (``.grad = .main_grad``) or, with
  ``distributed_optimizer``, its ``DistributedOptimizer`` (ZeRO-1: each DP rank steps its shard,
  then all-gathers the parameters); gradient clipping at 1.0; weight decay 0.1 on matrices only
  (its ``OptimizerParamScheduler``, constant, applies the groups' ``wd_mult``);
- the tensor-parallel layers and the vocabulary-parallel cross-entropy. Even at ``tp=1`` the
  cross-entropy calls ``all_reduce`` three times per micro-batch on the one-rank TP group.

megatron-core targets CUDA. These shims only move its CUDA housekeeping to the CPU; none
changes what is computed or communicated:

1. ``torch.cuda.current_device`` answers ``"cpu"`` (process-wide): DDP allocates its gradient
   and parameter buffers, and the distributed optimizer its shards, on it.
2. The inference RNG tracker replaces the CUDA one, whose ``fork()`` (entered by the TP layers)
   needs CUDA generator states: dropout is 0 and the weights come from the CPU generator
   (``use_cpu_initialization``).
3. ``_CudaOnCpu``, a torch function mode active only while the optimizer is built and while it
   steps (measured: about 2 ms per step): a ``device="cuda"`` argument becomes the CPU (the
   optimizers' unit loss scale, the gradient-norm scratch tensors), and ``Tensor.type()`` of a
   CPU tensor answers its CUDA name (``torch.cuda.FloatTensor``), the name by which the
   optimizers and the clipping tell fp32 parameters from fp16 / bf16 ones (anything else is a
   ``TypeError`` or ``AssertionError``).
4. The causal attention mask is passed explicitly (megatron-core's default is built on "cuda").
5. ``_TaggedLayerNorm``: ``torch.nn.LayerNorm`` whose parameters carry the ``sequence_parallel``
   tag that megatron's apex ``FusedLayerNorm`` sets (``finalize_model_grads`` sums the tagged
   gradients over the TP group). Without apex, megatron-core's local spec builds
   ``WrappedTorchNorm``, which asserts ``not config.sequence_parallel`` for want of that tag.

For tracers of collectives (``mt_dist.trace.CollectiveTrace`` wraps torch.distributed's
functions): megatron-core binds ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and
``_coalescing_manager`` to its modules' globals at import; :func:`_late_bound` makes them look
the functions up on ``torch.distributed`` at each call. DDP's gradient reductions and the
distributed optimizer's all-gathers run inside ``_coalescing_manager``: there the
``torch.distributed`` call only records the collective and returns an ``_IllegalWork`` (every
attribute access raises ``ValueError``, ``hasattr`` included); the process group runs it when
the block ends (``allreduce_coalesced``, ``reduce_scatter_single_coalesced``,
``all_gather_single_coalesced``) and the manager's ``wait()`` waits for it.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = ["McorePeer", "build"]


class _CudaOnCpu(TorchFunctionMode):
    """Shim 3: ``device="cuda"`` -> CPU; ``Tensor.type()`` of a CPU tensor -> its CUDA name."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" \
                else name
        return func(*args, **kwargs)


def _late_bound() -> None:
    """megatron-core's import-time references to torch.distributed functions, replaced by
    look-ups on torch.distributed at call time (see the module docstring)."""
    from megatron.core import utils
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.tensor_parallel import layers, mappings
    from megatron.core.tensor_parallel import utils as tp_utils

    def all_gather_into_tensor(*args: Any, **kwargs: Any) -> Any:
        return dist.all_gather_into_tensor(*args, **kwargs)

    def reduce_scatter_tensor(*args: Any, **kwargs: Any) -> Any:
        return dist.reduce_scatter_tensor(*args, **kwargs)

    def coalescing_manager(*args: Any, **kwargs: Any) -> Any:
        return dist._coalescing_manager(*args, **kwargs)

    for module in (param_and_grad_buffer, layers, mappings, tp_utils, utils):
        module.dist_all_gather_func = all_gather_into_tensor
        if hasattr(module, "dist_reduce_scatter_func"):
            module.dist_reduce_scatter_func = reduce_scatter_tensor
    param_and_grad_buffer._coalescing_manager = coalescing_manager


class _TaggedLayerNorm(torch.nn.LayerNorm):
    """Shim 5: ``torch.nn.LayerNorm`` built from megatron-core's norm arguments, its parameters
    tagged ``sequence_parallel`` as megatron-core's own norms tag theirs."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


class McorePeer:
    """megatron-core's GPTModel in its DistributedDataParallel (``model``), with its optimizer."""

    def __init__(self, model: Any, optimizer: Any, seq_len: int) -> None:
        self.model, self.optimizer = model, optimizer
        self._mask = torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool), 1)
        self._positions = torch.arange(seq_len)[None]

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Forward and backward each micro-batch (tokens, targets) of this data-parallel rank,
        reduce the gradients, step the optimizer; returns the micro-batches' mean loss."""
        from megatron.core.distributed import finalize_model_grads

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        total = 0.0
        for i, (tokens, targets) in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                seq = tokens.shape[1]
                loss = self.model(tokens, self._positions[:, :seq].expand_as(tokens),
                                  self._mask[..., :seq, :seq], labels=targets).mean()
                (loss / len(batches)).backward()
            total += float(loss.detach()) / len(batches)
        finalize_model_grads([self.model])
        with _CudaOnCpu():
            self.optimizer.step()
        return total


def build(shape: dict[str, int], tp: int, sequence_parallel: bool,
          distributed_optimizer: bool, bucket_numel: int | None,
          lr: float = 1e-4) -> McorePeer:
    """megatron-core's GPT of ``shape`` (n_layers, hidden, n_heads, vocab_size, seq_len) at TP
    ``tp`` x DP ``world_size / tp`` on these gloo ranks, in its
    ``DistributedDataParallel(overlap_grad_reduce=True)`` with buckets of ``bucket_numel``
    elements (None: megatron-core's default), and its Adam (see the module docstring)."""
    import torch.nn.functional as F

    # Its warnings of absent CUDA extensions (apex, Transformer Engine) and of torch's
    # renamed collectives, once per rank: noise in the benchmark's table.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*is deprecated")
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not dist.is_initialized() or dist.get_world_size() % tp:
        raise ValueError(f"build needs initialized ranks, a multiple of tp={tp} of them")
    torch.cuda.current_device = lambda: "cpu"  # shim 1
    _late_bound()
    if (parallel_state.model_parallel_is_initialized()
            and parallel_state.get_tensor_model_parallel_world_size() != tp):
        parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, 1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)  # shim 2
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=shape["n_layers"], hidden_size=shape["hidden"],
        num_attention_heads=shape["n_heads"], ffn_hidden_size=4 * shape["hidden"],
        tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel and tp > 1,
        use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, normalization="LayerNorm", layernorm_epsilon=1e-5,
        activation_func=F.gelu, add_bias_linear=True, init_method_std=0.02)
    layer = get_gpt_layer_local_spec()
    layer.submodules.input_layernorm = _TaggedLayerNorm  # shim 5
    layer.submodules.pre_mlp_layernorm = _TaggedLayerNorm
    block = TransformerBlockSubmodules(layer_specs=[layer] * shape["n_layers"],
                                       layer_norm=_TaggedLayerNorm)
    model = GPTModel(config=config, transformer_layer_spec=block,
                     vocab_size=shape["vocab_size"], max_sequence_length=shape["seq_len"],
                     position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=True, parallel_output=True)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=distributed_optimizer,
        bucket_size=bucket_numel), model)
    with _CudaOnCpu():  # shim 3
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=lr, weight_decay=0.1, clip_grad=1.0,
            use_distributed_optimizer=distributed_optimizer), [ddp])
    OptimizerParamScheduler(optimizer, init_lr=lr, max_lr=lr, min_lr=lr, lr_warmup_steps=0,
                            lr_decay_steps=1, lr_decay_style="constant", start_wd=0.1,
                            end_wd=0.1, wd_incr_steps=1, wd_incr_style="constant")
    return McorePeer(ddp, optimizer, shape["seq_len"])
