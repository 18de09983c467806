"""Pure performance model of one training layout: memory, FLOPs, bubble, communication, time.

Memory per GPU: weights, gradients and optimizer states sharded by ZeRO stage (Rajbhandari et
al. 2020), activations by Korthikanti et al. 2022 (with / without sequence parallelism, none /
selective / full recomputation) times the chunk forwards a stage holds at once in the chosen
schedule (a fused attention kernel, what mt runs, stores no s x s scores). Time: per-stage
forward / backward matmuls and attention (a causal fused kernel skips the masked half of the
scores and recomputes them in backward: :func:`attention_flops`) at ``efficiency`` x peak
FLOP/s, or at the rates a calibration measured (``mt plan --calibrate``:
:mod:`mt_plan.calibrate`), plus
elementwise memory traffic at the memory bandwidth and the tensor-parallel collectives, fed
to mt-pipeline's simulator (the code that checks the schedules mt-pipeline runs) with the P2P
time; then the data-parallel gradient reduction and the
memory-bound optimizer step; tensor-parallel, context-parallel and pipeline communication
is on the critical path, the data-parallel part overlaps as mt-zero runs it
(:func:`dp_overlap`: buckets during the last backward, ZeRO-3's prefetch). One calibrated
constant, :data:`EFFICIENCY` (fraction of peak reached by the matmuls), is fitted to MT-NLG's
published iteration times (on :data:`MTNLG_GPU`) by :func:`calibrate_efficiency`; it serves
data-sheet planning. Fixed costs (per layer, per
message, per optimizer tensor, and the training framework's own per-step, per-micro-batch and
per-parameter-tensor work) come from the :class:`~mt_plan.gpus.GPUSpec`: zero for
the data-sheet GPUs, measured for a calibrated machine such as a CPU (``benchmarks/plan.py``).
The peak memory adds to the persistent states the largest short-lived phase (backward
buffers, the shard all-gather), see :func:`_memory`.

Context parallelism (``layout.cp``): each rank holds ``s / cp`` tokens of every sequence, so
its activations, matmuls, elementwise traffic and tensor-parallel messages are those of
``s / cp`` tokens, its causal attention a ``1 / cp`` share (the chunks balance it), and it
keeps the whole sequence's gathered keys and values for backward; every layer all-gathers keys
and values over the CP group in forward and reduce-scatters their gradients in backward (not
overlapped with compute: mt runs the exchange before the attention), and gradients are reduced
and ZeRO-sharded over ``dp x cp`` ranks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import cache

from mt_model import (
    GPTConfig,
    block_matmul_parameters,
    count_parameters,
    model_flops_per_iteration,
)
from mt_pipeline import SCHEDULES, checked_schedule, simulate
from mt_plan.gpus import GPUS, GPUSpec
from mt_plan.layout import RECOMPUTE, LayoutError, ParallelLayout, stage_layers
from mt_zero.precision import PRECISIONS

__all__ = ["EFFICIENCY", "MTNLG_GPU", "MTNLG_PUBLISHED", "Estimate", "LayoutError",
           "ParallelLayout", "activation_bytes_per_layer", "attention_flops",
           "Zero3Units", "calibrate_efficiency", "dp_overlap", "estimate", "peak_in_flight",
           "stage_memory", "zero_bytes"]

#: Fraction of peak bf16 FLOP/s the GEMMs reach; fitted by :func:`calibrate_efficiency` to
#: MT-NLG 530B on A100-80GB (TP 8, PP 35, DP 8/10/12); the only tuned number of the model.
EFFICIENCY = 0.505

#: MT-NLG 530B (Smith et al. 2022, table 1): (dp, iteration seconds, TFLOP/s per GPU).
MTNLG_PUBLISHED: tuple[tuple[int, float, float], ...] = (
    (8, 60.1, 126.0), (10, 50.2, 121.0), (12, 44.4, 113.0))

#: The machine of that fit: A100-80GB running Megatron's 2021 kernels, which stored the
#: attention scores (no fused attention).
MTNLG_GPU = replace(GPUS["a100-80gb"], name="a100-80gb (Megatron 2021)", fused_attention=False)




@cache
def bucket_numel() -> int:
    """Elements per gradient-reduction bucket of mt-zero (``ZeroConfig.bucket_numel``); a
    tensor larger than that is a bucket of its own. (mt-zero and mt-tensor-parallel are
    imported where their numbers are needed: they load torch, which planning never runs.)"""
    from mt_zero import ZeroConfig

    return ZeroConfig().bucket_numel


def grad_width(precision: str, main_grads: bool) -> int:
    """Bytes of one gradient element: fp32 main gradients take 4 whatever the precision."""
    return 4 if main_grads else PRECISIONS[precision].bytes


def zero_bytes(psi: float, dp: int, stage: int, precision: str = "bf16",
               main_grads: bool = False) -> dict[str, float]:
    """Bytes per rank of weights, gradients and Adam states for ``psi`` parameters.

    Mixed precision: 16-bit weights and gradients, fp32 master weights + two moments
    (K = 12 bytes, the ZeRO paper's figure); fp32: 4 + 4 bytes and two moments (K = 8).
    ``main_grads``: fp32 gradients (4 bytes) with 16-bit weights.
    Stage 1 shards the optimizer states over ``dp``, stage 2 also the gradients, stage 3 also
    the weights.
    """
    if stage not in (0, 1, 2, 3) or dp < 1 or psi < 0:
        raise LayoutError(f"need psi {psi} >= 0, dp {dp} >= 1, ZeRO stage {stage} in 0..3")
    width = PRECISIONS[precision].bytes
    k = 8 if precision == "fp32" else 12
    weights = width * psi / (dp if stage >= 3 else 1)
    grads = grad_width(precision, main_grads) * psi / (dp if stage >= 2 else 1)
    optimizer = k * psi / (dp if stage >= 1 else 1)
    return {"weights": weights, "grads": grads, "optimizer": optimizer,
            "total": weights + grads + optimizer}


def activation_bytes_per_layer(gpt: GPTConfig, micro_batch: int, tp: int,
                               sequence_parallel: bool, recompute: str,
                               precision: str = "bf16", *, fused_attention: bool = False,
                               dropout_masks: bool = True, cp: int = 1) -> float:
    """Activation bytes one transformer layer keeps per micro-batch (Korthikanti et al.).

    16-bit: ``sbh(10 + 24/t + 5as/(ht))`` with TP, ``sbh/t (34 + 5as/h)`` with TP + SP (the
    ``24`` is the GPT-2 block's; grouped-query attention and SwiGLU change it, see
    :func:`_sharded_activation_units`);
    selective recomputation (mt-pipeline's) drops the ``5as/h`` attention term (the core runs
    again), the two norm outputs (``4``; ``/t`` with SP) and the activation output (``2f/h``,
    ``8`` for GPT-2; ``/t``); full recomputation
    keeps only the layer input ``2sbh`` (``/t`` with SP). fp32 doubles everything.

    ``dropout_masks=False`` (no dropout: torch keeps no mask at p = 0) drops the two 1-byte
    hidden dropout masks (``2sbh`` of the replicated ``10sbh``) and the attention-dropout mask
    and output (``3as/h`` of the ``5as/h``); ``fused_attention`` (a kernel that recomputes
    the scores in backward) drops the attention term as selective recomputation does.

    ``cp``: context parallelism: ``s`` becomes the rank's ``s / cp`` tokens but for the keys
    (scores ``[s / cp, s]``), and the gathered keys and values of the whole sequence are kept
    (``4kv/h`` of the ``24`` at ``s`` instead of ``s / cp``: ``(cp - 1) 4kv/h`` more).
    """
    if recompute not in RECOMPUTE:
        raise LayoutError(f"recompute {recompute!r} is not one of {RECOMPUTE}")
    s, b, h, a = gpt.seq_len, micro_batch, gpt.hidden, gpt.n_heads
    sbh = float(s // cp * b * h)
    scores = 5.0 if dropout_masks else 2.0
    attention = 0.0 if recompute == "selective" or fused_attention else scores * a * s / h
    replicated = 10.0 if dropout_masks else 8.0
    sharded = _sharded_activation_units(gpt, tp)
    if cp > 1:
        sharded += (cp - 1) * _kv_units(gpt, tp)
    if recompute == "selective":  # recomputed from what other ops keep anyway
        sharded -= 2.0 * gpt.ffn_hidden / h
        replicated -= 4.0
    if recompute == "full":
        per_layer = 2.0 * sbh / (tp if sequence_parallel else 1)
    elif sequence_parallel:
        per_layer = sbh / tp * (replicated + sharded + attention)
    else:
        per_layer = sbh * (replicated + sharded / tp + attention / tp)
    return per_layer * PRECISIONS[precision].bytes / 2


def _layer_activations(gpt: GPTConfig, layout: ParallelLayout, gpu: GPUSpec,
                       recompute: str) -> float:
    """:func:`activation_bytes_per_layer` for this layout, model dropout and attention kernel."""
    return activation_bytes_per_layer(
        gpt, layout.micro_batch, layout.tp, layout.sequence_parallel, recompute,
        layout.precision, fused_attention=gpu.fused_attention,
        dropout_masks=gpt.dropout > 0 or gpt.attention_dropout > 0, cp=layout.cp)


@dataclass(frozen=True)
class Estimate:
    """The figures of one layout (``mt plan --json`` prints :meth:`to_dict`)."""

    layout: ParallelLayout
    gpu: str
    efficiency: float
    parameters: int
    parameters_per_gpu: int
    memory_per_gpu_gb: float
    memory_weights_gb: float
    memory_grads_gb: float
    memory_optimizer_gb: float
    memory_activations_gb: float
    memory_temporaries_gb: float
    gpu_memory_gb: float
    fits: bool
    model_flops_per_iteration: float
    bubble_fraction: float
    pipeline_time_s: float
    tp_comm_time_s: float
    p2p_time_s: float
    dp_comm_time_s: float
    optimizer_time_s: float
    framework_time_s: float
    iteration_time_s: float
    tflops_per_gpu: float
    tokens_per_s: float
    simulated: bool
    calibrated: bool = False
    cp_comm_time_s: float = 0.0
    """Seconds per step of the context-parallel key/value exchange (inside the pipeline
    time; not overlapped with compute)."""
    dp_exposed_s: float = 0.0
    """The part of ``dp_comm_time_s`` not hidden under compute (:func:`dp_overlap`)."""
    tp_hidden_s: float = 0.0
    """The part of ``tp_comm_time_s`` run under the column-parallel layers' backward GEMMs
    (each one's input-gradient collective, and with sequence parallelism its input's second
    gather)."""
    exposed_comm_s: float = 0.0
    """Communication seconds per step on the critical path of the fullest rank: the
    tensor-parallel collectives not hidden, the context-parallel exchange, the pipeline's
    sends, the tied embedding's sum and the exposed data-parallel part (what ``mt pretrain
    --trace-collectives`` measures as ``comm_exposed_s``)."""
    hidden_comm_s: float = 0.0
    """Communication seconds per step modelled as running under compute (data-parallel
    buckets during the last backward, ZeRO-3's prefetched gathers, ``tp_hidden_s``)."""

    def to_dict(self) -> dict[str, object]:
        """Flat JSON-ready dict: the layout's fields first, then the figures."""
        out: dict[str, object] = dict(asdict(self.layout))
        out.update({k: v for k, v in asdict(self).items() if k != "layout"})
        out["num_micro_batches"] = self.layout.num_micro_batches
        out["world_size"] = self.layout.world_size
        return out

    def report(self) -> str:
        """The figures as the lines ``mt plan`` prints."""
        lay = self.layout
        cp = f" x cp {lay.cp}" if lay.cp > 1 else ""
        lines = [
            f"layout      tp {lay.tp} x pp {lay.pp} x dp {lay.dp}{cp} = {lay.world_size} x "
            f"{self.gpu}; "
            f"global batch {lay.global_batch} = micro {lay.micro_batch} x dp {lay.dp} x "
            f"{lay.num_micro_batches} micro-batches; {lay.schedule}"
            + (f" v={lay.virtual_stages}" if lay.virtual_stages > 1 else "")
            + f", ZeRO {lay.zero_stage}, recompute {lay.recompute}"
            + (", sequence parallel" if lay.sequence_parallel else ""),
            f"parameters  {self.parameters:,} total, {self.parameters_per_gpu:,} on the fullest "
            "GPU",
            f"memory      {self.memory_per_gpu_gb:.2f} GB per GPU (weights "
            f"{self.memory_weights_gb:.2f}, grads {self.memory_grads_gb:.2f}, optimizer "
            f"{self.memory_optimizer_gb:.2f}, activations {self.memory_activations_gb:.2f}, "
            f"temporaries {self.memory_temporaries_gb:.2f}) of "
            f"{self.gpu_memory_gb:.1f} GB: " + ("fits" if self.fits else "DOES NOT FIT"),
            f"flops       {self.model_flops_per_iteration:.4g} model FLOPs per iteration",
            f"pipeline    bubble fraction {self.bubble_fraction:.3f}; pipeline "
            f"{self.pipeline_time_s:.3f} s (TP comm {self.tp_comm_time_s:.3f} s, "
            + (f"CP key/value exchange {self.cp_comm_time_s:.3f} s, " if lay.cp > 1 else "")
            + f"P2P {self.p2p_time_s:.3f} s inside), DP comm {self.dp_comm_time_s:.3f} s "
            f"({self.dp_exposed_s:.3f} s exposed), optimizer {self.optimizer_time_s:.3f} s"
            + (f", framework {self.framework_time_s:.3f} s" if self.framework_time_s else ""),
            f"speed       {self.iteration_time_s:.3f} s per iteration, {self.tflops_per_gpu:.1f} "
            f"TFLOP/s per GPU, {self.tokens_per_s:,.0f} tokens/s",
            f"comm        {self.exposed_comm_s:.3f} s exposed per iteration"
            + (f" ({100 * self.exposed_comm_s / self.iteration_time_s:.0f}% of it)"
               if self.iteration_time_s > 0 else "")
            + f", {self.hidden_comm_s:.3f} s hidden under compute",
            (f"assumes     matmuls and attention at the rates measured on {self.gpu}"
             if self.calibrated else
             f"assumes     matmuls at {self.efficiency} x peak bf16 FLOP/s (one constant, "
             "calibrated on MT-NLG 530B)") + "; TP, CP and P2P communication not "
            "overlapped, DP overlapped as mt-zero does it",
        ]
        return "\n".join(lines)


def _sharded_activation_units(gpt: GPTConfig, tp: int) -> float:
    """Korthikanti's tensor-parallel activation term (``24`` in units of sbh for the GPT-2
    block) for this block: q (2), k and v (4 kv/h, kv the key/value width; a rank whose
    key/value heads are replicated keeps one head's), the output projection's input (2), the
    MLP's fc output and activation output (4 f/h with GeLU; 8 f/h with SwiGLU, whose fc is
    twice as wide and whose activation keeps silu(gate) and the product)."""
    h, f = gpt.hidden, gpt.ffn_hidden
    return 4.0 + _kv_units(gpt, tp) + (8.0 if gpt.mlp == "swiglu" else 4.0) * f / h


def _kv_width(gpt: GPTConfig, tp: int) -> int:
    """Key (or value) width summed over a TP group: a rank whose key/value heads are
    replicated computes one head of tp / n_kv ranks."""
    kv = gpt.n_kv_heads * gpt.head_dim
    return max(kv, gpt.head_dim * tp) if gpt.n_kv_heads % tp else kv


def _kv_units(gpt: GPTConfig, tp: int) -> float:
    """Keys and values in Korthikanti's units (16-bit bytes per sbh, before / t)."""
    return 4.0 * _kv_width(gpt, tp) / gpt.hidden


def _block_params(gpt: GPTConfig, tp: int) -> tuple[int, int]:
    """(replicated, TP-sharded) parameters of one block: the norms, the row-parallel biases
    and key/value projections replicated over TP (fewer kv heads than tp) stay whole."""
    h, f, b = gpt.hidden, gpt.ffn_hidden, int(gpt.bias)
    kv = gpt.n_kv_heads * gpt.head_dim
    fc = 2 * f if gpt.mlp == "swiglu" else f
    kv_params = 2 * h * kv + b * 2 * kv
    kv_split = gpt.n_kv_heads % tp == 0
    sharded = h * h + b * h + h * h + h * fc + b * fc + f * h + (kv_params if kv_split else 0)
    replicated = 2 * _norm_params(gpt) + 2 * b * h + (0 if kv_split else kv_params)
    return replicated, sharded


def _norm_params(gpt: GPTConfig) -> int:
    return gpt.hidden * (2 if gpt.norm == "layernorm" and gpt.bias else 1)


def _layer_matmul_flops(gpt: GPTConfig) -> float:
    """Forward matmul FLOPs of one block per token, attention scores aside: 2 x weights."""
    return 2.0 * block_matmul_parameters(gpt)


def _params_of(gpt: GPTConfig, layout: ParallelLayout, stage: int, layers: int) -> int:
    """Parameters one TP rank of ``stage`` holds with ``layers`` transformer layers
    (padded vocabulary; the tied embedding's copy on the last stage, or the untied head)."""
    h, t = gpt.hidden, layout.tp
    replicated, sharded = _block_params(gpt, t)
    block = replicated + sharded // t
    from mt_tensor_parallel import padded_vocab_size

    vocab = padded_vocab_size(gpt.vocab_size, t) if t > 1 else gpt.vocab_size
    first, last = stage == 0, stage == layout.pp - 1
    n = layers * block
    if first:
        n += vocab // t * h + (gpt.seq_len * h if gpt.position == "learned" else 0)
    if last and (not first or not gpt.tied_embeddings):
        n += vocab // t * h  # the tied copy, or the untied head
    if last:
        n += _norm_params(gpt)
    return n


def _stage_params(gpt: GPTConfig, layout: ParallelLayout) -> list[int]:
    """Parameters one TP rank of each pipeline stage holds (uniform split)."""
    return [_params_of(gpt, layout, i, n)
            for i, n in enumerate(stage_layers(gpt.n_layers, layout))]


def peak_in_flight(layout: ParallelLayout) -> list[int]:
    """Closed-form peak of chunk forwards alive per stage (the schedule's own trait)."""
    return SCHEDULES[layout.schedule].peak(layout.pp, layout.num_micro_batches,
                                           layout.virtual_stages)


def _largest_param(gpt: GPTConfig, layout: ParallelLayout, stage: int) -> float:
    """Elements of the largest parameter tensor one TP rank of ``stage`` holds."""
    t = layout.tp
    fc = 2 * gpt.ffn_hidden if gpt.mlp == "swiglu" else gpt.ffn_hidden
    qkv = gpt.hidden + 2 * gpt.n_kv_heads * gpt.head_dim
    big = gpt.hidden * max(fc, qkv) / t
    if stage in (0, layout.pp - 1):
        big = max(big, gpt.hidden * gpt.vocab_size / t)
    return big


#: Bytes of float32 logits one chunk of the chunked loss holds: mt-tensor-parallel's
#: ``loss.CHUNK_BYTES`` (not imported: it would import torch into `mt plan`'s start;
#: tests/test_plan_estimate.py checks the two agree).
LOSS_CHUNK_BYTES = 64 << 20


def loss_chunk_tokens(vocab_local: int) -> int:
    """Tokens per chunk of the chunked loss (mt-tensor-parallel's ``loss.chunk_tokens``)."""
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab_local))


def _temporaries(gpt: GPTConfig, layout: ParallelLayout, gpu: GPUSpec, stage: int,
                 params: float) -> dict[str, float]:
    """Short-lived bytes of the two phases that can set a stage's peak (beyond the stored
    activations, which only the backward phase adds to)."""
    b, t, d = layout.micro_batch, layout.tp, layout.dp * layout.cp
    s = gpt.seq_len // layout.cp  # this rank's tokens of a sequence
    width = PRECISIONS[layout.precision].bytes
    last, first = stage == layout.pp - 1, stage == 0
    # Backward: unchunked, the loss keeps fp32 logits / log-softmax, their gradient and the
    # gradient of the logits (three [b, s, V/t] fp32 buffers at the start of backward);
    # chunked (the head and the loss in one), two chunks' fp32 logits at most, and the head's
    # weight gradient summed in fp32 beside its copy in the parameters' dtype. Autograd
    # creates a full gradient of the tied embedding for each use (lookup, head) before
    # adding it into .grad: on a stage holding both ends the two and their sum (three tables)
    # are alive together, on a stage holding either end one.
    vocab_local = gpt.vocab_size / t
    table = gpt.hidden * vocab_local
    backward = 0.0
    if last and layout.chunked_loss:
        chunk = min(b * s, loss_chunk_tokens(math.ceil(vocab_local))) * vocab_local
        backward = 2.0 * 4.0 * chunk + (4.0 * table if width < 4 else 0.0)
    elif last:
        backward = 3.0 * 4.0 * s * b * vocab_local
    tables = 3 if first and last else int(first) + int(last)
    backward += tables * table * width
    # The optimizer step adds nothing: fused AdamW (mt pretrain's) updates in place.
    # Publishing the updated shards (ZeRO 1-2, dp x cp > 1): a send copy of every shard in the
    # compute dtype, launched together, plus the all-gather's own staging of the largest
    # bucket's output (gloo on CPU).
    publish = 0.0
    if d > 1 and layout.zero_stage in (1, 2):
        bucket = max(_largest_param(gpt, layout, stage), float(bucket_numel()))
        publish = params / d * width + gpu.gather_scratch * bucket * width
    return {"backward": backward, "publish": publish}


def stage_memory(gpt: GPTConfig, layout: ParallelLayout, gpu: GPUSpec, stage: int, layers: int,
                 in_flight: int) -> dict[str, float]:
    """Bytes on one rank of pipeline ``stage`` (``layers`` transformer layers, ``in_flight``
    chunk forwards alive at its peak), by part: ``weights``, ``grads``, ``optimizer``,
    ``activations``, ``temporaries`` (what the peak phase adds), ``total``; and ``params``.

    The peak is the persistent states (:func:`zero_bytes`) plus the larger of two phases:
    backward (stored activations of the in-flight micro-batches plus the loss and
    tied-gradient buffers) and publishing the shards (the fused AdamW step adds nothing).
    ``mt plan`` and ``mt pretrain --dry-run`` both use it.
    """
    per_layer = _layer_activations(gpt, layout, gpu, layout.recompute)
    # While recomputing, one layer's full activations exist again (the working set).
    working = (_layer_activations(gpt, layout, gpu, "none")
               if layout.recompute == "full" else 0.0)
    params = _params_of(gpt, layout, stage, layers)
    parts = zero_bytes(params, layout.dp * layout.cp, layout.zero_stage, layout.precision,
                       layout.main_grads)
    if layout.zero_stage >= 2 and (layout.num_micro_batches > 1 or layout.pp > 1):
        # mt-zero accumulates micro-batches in full gradients (p.grad, or the fp32 main
        # gradient buffer) and reduce-scatters them once: held in full through backward.
        full = params * grad_width(layout.precision, layout.main_grads)
        parts["total"] += full - parts["grads"]
        parts["grads"] = full
    acts = per_layer * layers / layout.virtual_stages * in_flight + working
    temps = _temporaries(gpt, layout, gpu, stage, float(params))
    peak = max(acts + temps["backward"], temps["publish"])
    parts["activations"] = acts
    parts["temporaries"] = peak - acts if peak > acts else 0.0
    parts["total"] += acts + parts["temporaries"]
    parts["params"] = float(params)
    return parts


def _memory(gpt: GPTConfig, layout: ParallelLayout, gpu: GPUSpec,
            in_flight: list[int]) -> dict[str, float]:
    """:func:`stage_memory` of the fullest stage."""
    stages = [stage_memory(gpt, layout, gpu, i, n, in_flight[i])
              for i, n in enumerate(stage_layers(gpt.n_layers, layout))]
    return max(stages, key=lambda parts: parts["total"])


def _stage_tensors(gpt: GPTConfig, layout: ParallelLayout) -> list[int]:
    """Parameter tensors of each stage (12 per layer, 2 embeddings, final LayerNorm 2)."""
    out = []
    for i, layers in enumerate(stage_layers(gpt.n_layers, layout)):
        out.append(12 * layers + (2 if i == 0 else 0) + (3 if i == layout.pp - 1 else 0))
    return out


def attention_flops(gpt: GPTConfig, micro_batch: int, fused: bool) -> tuple[float, float]:
    """(forward, backward) FLOPs the attention kernel of one layer executes per micro-batch.

    The scores and the weighted sum are two ``2bs^2h`` matmuls. A fused causal kernel
    (flash attention) skips the masked upper half of the score blocks and recomputes the
    scores in backward (five matmuls there: 2.5x its forward); an unfused one computes all
    of them and its backward is twice its forward (the model FLOPs convention).
    """
    full = 4.0 * micro_batch * gpt.seq_len * gpt.seq_len * gpt.hidden
    return (full / 2, full / 2 * 2.5) if fused else (full, 2.0 * full)


def _layer_seconds(gpt: GPTConfig, layout: ParallelLayout, gpu: GPUSpec,
                   efficiency: float) -> tuple[float, float]:
    """Matmul and attention seconds of one layer on one micro-batch: forward, and backward
    with what recomputation adds to it."""
    c, b, t = layout.cp, layout.micro_batch, layout.tp
    s = gpt.seq_len // c
    # Matmul rates of the t GPUs of a tensor-parallel group (measured or planned).
    gemm_f, gemm_b, attn_f, attn_b = (t * r for r in gpu.rates(efficiency))
    # Causal attention of the whole sequence, a 1 / cp share per rank (balanced chunks).
    attn_fwd, attn_bwd = (x / c for x in attention_flops(gpt, b, gpu.fused_attention))
    layer_fwd = b * s * _layer_matmul_flops(gpt) / gemm_f + attn_fwd / attn_f
    layer_bwd = 2.0 * b * s * _layer_matmul_flops(gpt) / gemm_b + attn_bwd / attn_b
    # Selective: the norms and the activation once more (read the input, write the output:
    # twice the bytes it no longer keeps), and the attention core where a kernel does not
    # fuse it (a fused kernel already recomputes the scores).
    dropped = (_layer_activations(gpt, layout, gpu, "none")
               - _layer_activations(gpt, layout, gpu, "selective"))
    recompute = {"full": layer_fwd,
                 "selective": 2.0 * dropped / gpu.memory_bytes_per_s
                 + (0.0 if gpu.fused_attention else attn_fwd / attn_f),
                 "none": 0.0}
    return layer_fwd, layer_bwd + recompute[layout.recompute]


def _times(gpt: GPTConfig, layout: ParallelLayout, gpu: GPUSpec, efficiency: float) -> dict:
    """Per-stage chunk forward / backward seconds, P2P, TP, CP and DP communication."""
    c = layout.cp
    s, b, h, t = gpt.seq_len // c, layout.micro_batch, gpt.hidden, layout.tp
    width = PRECISIONS[layout.precision].bytes
    lat = gpu.link_latency_s
    layer_fwd, layer_bwd = _layer_seconds(gpt, layout, gpu, efficiency)
    gemm_f, gemm_b = (t * r for r in gpu.rates(efficiency)[:2])  # the LM head's matmuls
    message = float(b * s * h * width)
    intra = t <= gpu.gpus_per_node
    tp_bw = gpu.nvlink_bytes_per_s if intra else gpu.ib_bytes_per_s
    # TP collectives of a layer pass: two all-reduces of the [b, s, h] activation (attention
    # and MLP outputs in forward, their inputs' gradients in backward) or, with sequence
    # parallelism, an all-gather and a reduce-scatter in their place (each moves half an
    # all-reduce's bytes, and pays the fixed cost: twice the collectives).
    sp = layout.sequence_parallel and t > 1
    half = (t - 1) / t * message / tp_bw if t > 1 else 0.0
    lat_tp = gpu.tp_latency_s or lat
    one = half + lat_tp if sp else 2.0 * half + lat_tp if t > 1 else 0.0  # one collective
    tp_pass = (4 if sp else 2) * one
    # In backward each column-parallel layer (qkv, the MLP's first) launches its input
    # gradient's collective (one of the pass's) and computes its weight gradient (half of
    # its backward GEMMs) meanwhile; with sequence parallelism it keeps only its input's
    # sequence slice and gathers the input again (one more collective, ``regather``) while
    # it computes the input gradient (the other half). What a GEMM covers at the rate a
    # collective moves under compute is hidden.
    regather = 2 * one if sp else 0.0
    rate = gpu.comm_rate_under_compute or 1.0
    fc = (2 if gpt.mlp == "swiglu" else 1) * gpt.ffn_hidden
    # (Key / value heads replicated over TP have a layer of their own, not overlapped.)
    qkv = h + (0 if gpt.n_kv_heads % t else 2 * gpt.n_kv_heads * gpt.head_dim)
    tp_hidden = (1 + sp) * sum(min(one, 2.0 * b * s * h * width_out / gemm_b * rate)
                               for width_out in (qkv, fc)) if t > 1 else 0.0
    n_recomp = 1 if layout.recompute == "full" else 0  # passes run again in backward
    # Outside the layers, per micro-batch: the vocabulary-parallel embedding sums its
    # partial output (forward; with SP a reduce-scatter, whose backward all-gathers), the
    # head takes the replicated input (its backward all-reduces the input's gradient; with
    # SP an all-gather, whose backward reduce-scatters), the vocabulary-parallel loss
    # all-reduces the row maxima and the sums (forward, [b, s] values).
    small_tp = 2.0 * (t - 1) / t * b * s * 4 * 2 / tp_bw + lat if t > 1 else 0.0
    embed_f, embed_b = (one, one if sp else 0.0)
    head_f, head_b = (one if sp else 0.0, one)
    loss_f = 2.0 * small_tp
    # Context parallelism: keys and values all-gathered over cp ranks in forward (again when
    # recomputing), their gradients reduce-scattered in backward: (cp - 1) / cp of the whole
    # sequence's [b, s, kv / t] pair each time.
    cp_bw = gpu.nvlink_bytes_per_s if t * c <= gpu.gpus_per_node else gpu.ib_bytes_per_s
    exchange = ((c - 1) * 2.0 * b * s * _kv_width(gpt, t) / t * width / cp_bw + 2 * lat
                if c > 1 else 0.0)
    # Elementwise ops (LayerNorm, GeLU, softmax, dropout, residuals) are memory bound: the
    # forward writes about the bytes Korthikanti counts as stored, backward reads and writes
    # them again (twice the traffic), a full recompute writes them once more.
    traffic = _layer_activations(gpt, layout, gpu, "none") / gpu.memory_bytes_per_s
    ew_bwd = 2.0 + (1.0 if layout.recompute == "full" else 0.0)
    # Fixed costs (operator dispatch): a third in forward, the rest in backward; a full
    # recompute runs the layer's forward once more.
    over_f = gpu.layer_overhead_s / 3.0
    over_b = 2.0 * over_f + (over_f if layout.recompute == "full" else 0.0)
    # The loss reads the fp32 logits and writes the log-softmax (about 3 passes over
    # [b, s, V/t] in forward, 4 in backward).
    logits = 4.0 * b * s * gpt.vocab_size / t / gpu.memory_bytes_per_s
    # Every backward builds a dense gradient of the tied embedding for each use (the lookup:
    # zero-fill; the head: a GEMM output) and adds it into .grad (read, read, write); with
    # both uses on one stage autograd first sums the two (3 more passes).
    # Each of those dense gradients is a fresh buffer of the table's size (first touch).
    table_bytes = gpt.vocab_size / t * h * width
    table = table_bytes / gpu.memory_bytes_per_s
    fresh = gpu.first_touch_s(table_bytes)
    fwd, bwd = [], []
    for i, layers in enumerate(stage_layers(gpt.n_layers, layout)):
        n = layers / layout.virtual_stages
        first, last = i == 0, i == layout.pp - 1
        head = 2.0 * b * s * h * gpt.vocab_size if last else 0.0
        head_over = gpu.head_overhead_s if last else 0.0
        tied = (table * (4.0 * first + 3.0 * last + 3.0 * (first and last))
                + fresh * (first + last + (first and last)))
        # Framework work per micro-batch (loading, executor): a third in forward.
        micro = gpu.micro_batch_overhead_s
        ends_f = embed_f * first + (head_f + loss_f) * last
        ends_b = embed_b * first + head_b * last
        fwd.append(n * layer_fwd + head / gemm_f
                   + n * (tp_pass + exchange + traffic + over_f) + ends_f
                   + (head_over + micro) / 3.0 + 3.0 * logits * last)
        # A chunked loss computes each chunk's logits again in backward (one more head GEMM).
        again = head / gemm_f if layout.chunked_loss else 0.0
        bwd.append(n * layer_bwd + 2 * head / gemm_b + again
                   + n * ((1 + n_recomp) * tp_pass + regather - tp_hidden
                          + (1 + n_recomp) * exchange
                          + ew_bwd * traffic + over_b) + ends_b
                   + (head_over + micro) * 2.0 / 3.0 + 4.0 * logits * last + tied)
    one_node = layout.world_size <= gpu.gpus_per_node
    p2p_bw = gpu.nvlink_bytes_per_s if one_node else gpu.ib_bytes_per_s
    # scatter-gather: 1/t per TP rank
    p2p = message / t / p2p_bw + lat if layout.pp > 1 else 0.0
    # Bucket-sized collectives (DP gradients and shards, the tied gradient) may have a fixed
    # cost of their own (gloo: more rounds than a tiny message).
    bulk = gpu.bulk_latency_s or lat
    # Tied embedding: its gradient is summed over the first and last stage every step.
    tied = (gpt.vocab_size / t * h * width / p2p_bw + bulk) if layout.pp > 1 else 0.0
    m = layout.num_micro_batches
    layers_per_stage = sum(stage_layers(gpt.n_layers, layout)) / layout.pp
    ends = (embed_f + embed_b + head_f + head_b + loss_f) / layout.pp  # a stage's share
    tp_total = m * (layers_per_stage * ((2 + n_recomp) * tp_pass + regather) + ends)
    cp_total = m * layers_per_stage * (2 + n_recomp) * exchange
    return {"fwd": fwd, "bwd": bwd, "p2p": p2p, "tp": tp_total, "cp": cp_total, "tied": tied,
            "tp_hidden": m * layers_per_stage * tp_hidden,
            **_step_costs(gpt, layout, gpu)}


def _step_costs(gpt: GPTConfig, layout: ParallelLayout, gpu: GPUSpec) -> dict:
    """Seconds of the once-per-step work: the data-parallel collectives (``dp``), the Adam
    step (``optimizer``) and the framework's bookkeeping (``framework``)."""
    c, t = layout.cp, layout.tp
    width = PRECISIONS[layout.precision].bytes
    lat = gpu.link_latency_s
    bulk = gpu.bulk_latency_s or lat
    d = layout.dp * c  # gradients are reduced over data and context parallelism
    dp_bw = gpu.nvlink_bytes_per_s if t * d <= gpu.gpus_per_node else gpu.ib_bytes_per_s
    stage_params = max(_stage_params(gpt, layout))
    # Passes over the gradients or weights per step: stage 0 all-reduces the gradients;
    # stage 1 all-reduces them and all-gathers the updated weights; stage 2 reduce-scatters
    # and all-gathers; stage 3 also gathers the weights for forward and backward. An
    # all-reduce moves 2 (d-1)/d of the data, the others (d-1)/d, unless they are themselves
    # run as all-reduces. Gradients travel in their own width (fp32 main gradients: 4).
    # Stage 3 frees each unit's weights after use, so every micro-batch gathers them again,
    # for its forward and for its backward.
    gathers = {0: 0, 1: 1, 2: 1, 3: 2 * layout.num_micro_batches}[layout.zero_stage]
    grad_volume = {0: 2.0, 1: 2.0, 2: 1.0, 3: 1.0}[layout.zero_stage]
    weight_volume = float(gathers)
    if gpu.gather_via_all_reduce:
        grad_volume, weight_volume = 2.0, 2.0 * gathers
    buckets = max(1.0, stage_params / bucket_numel())
    if layout.zero_stage == 3:  # one bucket per unit: each layer, and the stage's rest
        buckets = max(stage_layers(gpt.n_layers, layout)) + 1.0
    share = (d - 1) / d / dp_bw
    grad_bytes = stage_params * grad_volume * grad_width(layout.precision, layout.main_grads)
    grads = grad_bytes * share + buckets * bulk if d > 1 else 0.0
    weights = stage_params * weight_volume * width * share + gathers * buckets * bulk \
        if d > 1 else 0.0
    units = None
    if layout.zero_stage == 3 and d > 1:
        # A pass gathers the stage's rest (embedding, positions, final norm, head) first,
        # then each layer as the one before it arrives (the prefetch), and the last backward
        # reduces each unit's gradients as its backward ends: collectives the ranks reach
        # in step, at that fixed cost (the skew of the ranks' compute is another matter:
        # the bucket's fixed cost). ``units``, for dp_overlap: a pass's first two gathers,
        # a layer's gather, a layer's reduction, the rest's reduction.
        layers = max(stage_layers(gpt.n_layers, layout))
        worst = _stage_params(gpt, layout).index(stage_params)
        rest = _params_of(gpt, layout, worst, 0)
        layer = (stage_params - rest) / max(layers, 1)
        unit_bw = gpu.gather_bytes_per_s or dp_bw
        stepped = gpu.stepped_latency_s or lat
        per_byte = weight_volume / gathers * width * (d - 1) / d / unit_bw
        g_rest, g_layer = rest * per_byte + stepped, layer * per_byte + stepped
        weights = gathers * (g_rest + layers * g_layer)
        reduce_byte = grad_volume * grad_width(layout.precision, layout.main_grads) * share
        r_rest, r_layer = rest * reduce_byte + stepped, layer * reduce_byte + stepped
        grads = r_rest + layers * r_layer
        units = Zero3Units(g_rest + g_layer, g_layer, r_layer, r_rest)
    # Small collectives every step: the loss mean, the gradient norm, the loss broadcast;
    # with sequence parallelism also the gradients of the TP-replicated parameters (norms,
    # row-parallel biases, learned positions), summed over TP once per step in one bucket.
    small = 3.0 * lat if layout.world_size > 1 else 0.0
    if layout.sequence_parallel and t > 1:
        stage = max(stage_layers(gpt.n_layers, layout))
        replicated = (6 * stage + 2) * gpt.hidden + (
            gpt.seq_len * gpt.hidden if gpt.position == "learned" else 0)
        tp_bw = gpu.nvlink_bytes_per_s if t <= gpu.gpus_per_node else gpu.ib_bytes_per_s
        small += 2.0 * (t - 1) / t * replicated * 4 / tp_bw + lat
    # Adam step: throughput per parameter of the rank's shard, plus a fixed cost per tensor.
    shard_div = d if layout.zero_stage >= 1 else 1
    shard = max(_stage_params(gpt, layout)) / shard_div
    # Sharding splits the tensors over the ranks; a tensor cut by a shard edge counts twice.
    tensors = max(_stage_tensors(gpt, layout)) / shard_div + (shard_div > 1) * buckets
    optimizer = shard / gpu.adam_params_per_s + tensors * gpu.tensor_overhead_s
    # Framework work per step and per parameter tensor (hooks, bucket bookkeeping).
    framework = (gpu.step_overhead_s
                 + max(_stage_tensors(gpt, layout)) * gpu.param_overhead_s)
    return {"dp": grads + weights + small, "dp_grads": grads, "dp_weights": weights,
            "dp_small": small, "buckets": buckets, "units": units, "optimizer": optimizer,
            "framework": framework}


@dataclass(frozen=True)
class Zero3Units:
    """Seconds of ZeRO-3's per-unit collectives (:func:`dp_overlap`): the stage's rest (its
    embedding, positions, final norm and head) and each of its layers is a unit."""

    first: float
    """A pass's first two gathers: the rest's, then the first layer's."""
    layer: float
    """One further layer's gather."""
    layer_reduce: float
    """One layer's gradient reduction."""
    rest_reduce: float
    """The rest's gradient reduction (the last: the embedding's backward ends the pass)."""


def dp_overlap(layout: ParallelLayout, grads_s: float, weights_s: float, small_s: float,
               buckets: float, forward_s: float, backward_s: float, rate: float = 1.0,
               units: Zero3Units | None = None) -> tuple[float, float]:
    """(exposed, hidden) seconds of one step's data-parallel communication, as mt-zero
    overlaps it with a micro-batch's ``forward_s`` / ``backward_s`` (a pure model).
    ``rate``: how fast a collective progresses while the rank computes, as a share of its
    speed alone (1: a GPU's copy engines and NICs; gloo on CPU cores that all compute: less).

    - With pipeline parallelism mt reduces the gradients at the optimizer step, after the
      schedule: nothing is hidden. So is everything with one data-parallel rank.
    - Stages 0-2: the last micro-batch's backward launches each gradient bucket as soon as
      its gradients exist (taken as evenly spread over the backward) and the buckets reduce
      one after another: what is still reducing when the backward ends is exposed (at
      least the last bucket). Stages 1-2 then gather the updated weights after the
      optimizer step: exposed.
    - Stage 3: each unit's weights are gathered while the unit before it computes (the
      prefetch), in forward and again in backward for every micro-batch, and the last
      backward also reduce-scatters each unit's gradients: per pass the first gather is
      exposed and each further unit exposes what its collectives take beyond the previous
      unit's compute (``buckets``: the units, each layer and the stage's rest). With
      ``units`` (:class:`Zero3Units`) the stage's rest is gathered first and the first
      layer is not hidden either (the rest's compute, an embedding lookup, is too short to
      hide it), the other layers as above; the last backward's last two reductions, the
      first layer's and the rest's, are exposed whole (the embedding's backward between
      them is as short).
    - The step's small collectives (loss mean, gradient norm) are exposed.
    """
    total = grads_s + weights_s + small_s
    if layout.pp > 1 or total == small_s:
        return total, 0.0
    k = max(1, round(buckets))
    if layout.zero_stage < 3:
        per, done = grads_s / k, 0.0
        for i in range(k):
            start = max(backward_s * (i + 1) / k, done)
            under = max(0.0, backward_s - start) * rate  # its progress under the backward
            done = start + per / rate if under >= per else max(start, backward_s) + per - under
        exposed = max(per, done - backward_s) + weights_s + small_s
        return exposed, total - exposed
    m = layout.num_micro_batches
    gather = weights_s / (2 * m * k)  # one unit's weights, once
    reduce = grads_s / k
    f, b = forward_s / k * rate, backward_s / k * rate  # collective-seconds a unit covers
    if units is None:
        first, each, n, tail = gather, gather, k - 1, reduce
    else:  # layers 2.. hide under the layer before; layer 1's and the rest's reductions not
        first, each, n = units.first, units.layer, k - 2
        reduce, tail = units.layer_reduce, units.layer_reduce + units.rest_reduce
    per_forward = first + n * max(0.0, each - f)
    per_backward = first + n * max(0.0, each - b)
    last_backward = first + n * max(0.0, each + reduce - b) + tail
    exposed = m * per_forward + (m - 1) * per_backward + last_backward + small_s
    return min(exposed, total), max(0.0, total - exposed)


def estimate(gpt: GPTConfig, layout: ParallelLayout, gpu: GPUSpec, efficiency: float = EFFICIENCY,
             simulate_pipeline: bool = True) -> Estimate:
    """Estimate memory and speed of ``layout`` for ``gpt`` on ``gpu``.

    With ``simulate_pipeline`` the schedule is built and simulated by mt-pipeline (exact
    bubble and in-flight micro-batches); without, closed forms are used (fast, for search).
    """
    if not 0 < efficiency <= 1:
        raise LayoutError(f"efficiency {efficiency} must be in (0, 1]")
    layout.check(gpt)
    times = _times(gpt, layout, gpu, efficiency)
    p, m, v = layout.pp, layout.num_micro_batches, layout.virtual_stages
    if simulate_pipeline:
        schedule = checked_schedule(layout.schedule, p, m, v)
        sim = simulate(schedule, forward_time=times["fwd"], backward_time=times["bwd"],
                       p2p_time=times["p2p"], reduce_time=times["tied"])
        pipeline_time, in_flight = sim.pipeline_time, list(sim.peak_in_flight)
        bubble = max(sim.bubble_fraction)
    else:
        step = max(times["fwd"]) + max(times["bwd"])
        bubble = (p - 1) / (v * m)
        pipeline_time = (m * v * step * (1 + bubble) + 2 * (p - 1) * times["p2p"] * v
                         + times["tied"])
        in_flight = peak_in_flight(layout)
    mem = _memory(gpt, layout, gpu, in_flight)
    dp_exposed, dp_hidden = dp_overlap(layout, times["dp_grads"], times["dp_weights"],
                                       times["dp_small"], times["buckets"], times["fwd"][0],
                                       times["bwd"][0], gpu.comm_rate_under_compute or 1.0,
                                       times["units"])
    iteration = pipeline_time + dp_exposed + times["optimizer"] + times["framework"]
    p2p = times["p2p"] * 2 * (m * v + p - 1) if p > 1 else 0.0
    flops = model_flops_per_iteration(gpt, layout.global_batch)
    gb = 1e9
    return Estimate(
        layout=layout, gpu=gpu.name, efficiency=efficiency,
        parameters=count_parameters(gpt), parameters_per_gpu=int(mem["params"]),
        memory_per_gpu_gb=mem["total"] / gb, memory_weights_gb=mem["weights"] / gb,
        memory_grads_gb=mem["grads"] / gb, memory_optimizer_gb=mem["optimizer"] / gb,
        memory_activations_gb=mem["activations"] / gb,
        memory_temporaries_gb=mem["temporaries"] / gb, gpu_memory_gb=gpu.memory_bytes / gb,
        fits=mem["total"] <= gpu.memory_bytes, model_flops_per_iteration=flops,
        bubble_fraction=bubble, pipeline_time_s=pipeline_time, tp_comm_time_s=times["tp"],
        p2p_time_s=p2p, dp_comm_time_s=times["dp"], optimizer_time_s=times["optimizer"],
        framework_time_s=times["framework"],
        iteration_time_s=iteration,
        tflops_per_gpu=flops / (iteration * layout.world_size) / 1e12,
        tokens_per_s=layout.global_batch * gpt.seq_len / iteration,
        simulated=simulate_pipeline, calibrated=gpu.calibrated, cp_comm_time_s=times["cp"],
        dp_exposed_s=dp_exposed,
        tp_hidden_s=times["tp_hidden"],
        exposed_comm_s=(times["tp"] - times["tp_hidden"] + times["cp"] + p2p + times["tied"]
                        + dp_exposed),
        hidden_comm_s=dp_hidden + times["tp_hidden"])


def calibrate_efficiency(gpt: GPTConfig, cases: list[tuple[ParallelLayout, float]], gpu: GPUSpec,
                         iterations: int = 6) -> float:
    """The efficiency whose predicted iteration times match ``cases`` (layout, seconds)
    on average in log space (secant method; time is ~ a / efficiency + b)."""
    def error(eff: float) -> float:
        return sum(math.log(estimate(gpt, lay, gpu, eff).iteration_time_s / sec)
                   for lay, sec in cases) / len(cases)

    x0, x1 = 0.4, 0.6
    f0, f1 = error(x0), error(x1)
    for _ in range(iterations):
        if abs(f1) < 1e-6 or f1 == f0:
            break
        x0, x1, f0 = x1, min(1.0, max(0.01, x1 - f1 * (x1 - x0) / (f1 - f0))), f1
        f1 = error(x1)
    return x1
