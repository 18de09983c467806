"""Pure performance model of one training layout: memory, FLOPs, bubble, communication, time.

Memory per GPU: weights, gradients and optimizer states sharded by ZeRO stage (Rajbhandari et
al. 2020), activations by Korthikanti et al. 2022 (with / without sequence parallelism, none /
selective / full recomputation) times the chunk forwards a stage holds at once in the chosen
schedule. Time: per-stage forward / backward matmuls at ``efficiency`` x peak FLOP/s, plus
elementwise memory traffic at the memory bandwidth and the tensor-parallel collectives, fed
to mt-pipeline's simulator (the code that checks the schedules mt-pipeline runs) with the P2P
time; then the data-parallel gradient reduction and the
memory-bound optimizer step; communication is not overlapped with compute. One calibrated
constant, :data:`EFFICIENCY` (fraction of peak reached by the matmuls), is fitted to MT-NLG's
published iteration times by :func:`calibrate_efficiency`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from mt_model import GPTConfig, count_parameters, model_flops_per_iteration
from mt_pipeline import get_schedule, simulate
from mt_pretrain.gpus import GPUSpec
from mt_pretrain.layout import RECOMPUTE, Layout, LayoutError, stage_layers

__all__ = ["EFFICIENCY", "MTNLG_PUBLISHED", "Estimate", "Layout", "LayoutError",
           "activation_bytes_per_layer", "calibrate_efficiency", "estimate", "zero_bytes"]

#: Fraction of peak bf16 FLOP/s the GEMMs reach; fitted by :func:`calibrate_efficiency` to
#: MT-NLG 530B on A100-80GB (TP 8, PP 35, DP 8/10/12); the only tuned number of the model.
EFFICIENCY = 0.506

#: MT-NLG 530B (Smith et al. 2022, table 1): (dp, iteration seconds, TFLOP/s per GPU).
MTNLG_PUBLISHED: tuple[tuple[int, float, float], ...] = (
    (8, 60.1, 126.0), (10, 50.2, 121.0), (12, 44.4, 113.0))

_WIDTH = {"bf16": 2, "fp16": 2, "fp32": 4}


def zero_bytes(psi: float, dp: int, stage: int, precision: str = "bf16") -> dict[str, float]:
    """Bytes per rank of weights, gradients and Adam states for ``psi`` parameters.

    Mixed precision: 16-bit weights and gradients, fp32 master weights + two moments
    (K = 12 bytes, the ZeRO paper's figure); fp32: 4 + 4 bytes and two moments (K = 8).
    Stage 1 shards the optimizer states over ``dp``, stage 2 also the gradients, stage 3 also
    the weights.
    """
    if stage not in (0, 1, 2, 3) or dp < 1 or psi < 0:
        raise LayoutError(f"need psi {psi} >= 0, dp {dp} >= 1, ZeRO stage {stage} in 0..3")
    width = _WIDTH[precision]
    k = 8 if precision == "fp32" else 12
    weights = width * psi / (dp if stage >= 3 else 1)
    grads = width * psi / (dp if stage >= 2 else 1)
    optimizer = k * psi / (dp if stage >= 1 else 1)
    return {"weights": weights, "grads": grads, "optimizer": optimizer,
            "total": weights + grads + optimizer}


def activation_bytes_per_layer(gpt: GPTConfig, micro_batch: int, tp: int,
                               sequence_parallel: bool, recompute: str,
                               precision: str = "bf16") -> float:
    """Activation bytes one transformer layer keeps per micro-batch (Korthikanti et al.).

    16-bit: ``sbh(10 + 24/t + 5as/(ht))`` with TP, ``sbh/t (34 + 5as/h)`` with TP + SP;
    selective recomputation drops the ``5as/h`` attention term; full recomputation keeps only
    the layer input ``2sbh`` (``/t`` with SP). fp32 doubles everything.
    """
    if recompute not in RECOMPUTE:
        raise LayoutError(f"recompute {recompute!r} is not one of {RECOMPUTE}")
    s, b, h, a = gpt.seq_len, micro_batch, gpt.hidden, gpt.n_heads
    sbh = float(s * b * h)
    attention = 0.0 if recompute == "selective" else 5.0 * a * s / h
    if recompute == "full":
        per_layer = 2.0 * sbh / (tp if sequence_parallel else 1)
    elif sequence_parallel:
        per_layer = sbh / tp * (34.0 + attention)
    else:
        per_layer = sbh * (10.0 + 24.0 / tp + attention / tp)
    return per_layer * _WIDTH[precision] / 2


@dataclass(frozen=True)
class Estimate:
    """The figures of one layout (``mt plan --json`` prints :meth:`to_dict`)."""

    layout: Layout
    gpu: str
    efficiency: float
    parameters: int
    parameters_per_gpu: int
    memory_per_gpu_gb: float
    memory_weights_gb: float
    memory_grads_gb: float
    memory_optimizer_gb: float
    memory_activations_gb: float
    gpu_memory_gb: float
    fits: bool
    model_flops_per_iteration: float
    bubble_fraction: float
    pipeline_time_s: float
    tp_comm_time_s: float
    p2p_time_s: float
    dp_comm_time_s: float
    optimizer_time_s: float
    iteration_time_s: float
    tflops_per_gpu: float
    tokens_per_s: float
    simulated: bool

    def to_dict(self) -> dict[str, object]:
        """Flat JSON-ready dict: the layout's fields first, then the figures."""
        out: dict[str, object] = dict(asdict(self.layout))
        out.update({k: v for k, v in asdict(self).items() if k != "layout"})
        out["num_micro_batches"] = self.layout.num_micro_batches
        out["world_size"] = self.layout.world_size
        return out


def _stage_params(gpt: GPTConfig, layout: Layout) -> list[int]:
    """Parameters one TP rank of each pipeline stage holds (padded, tied copy on the last)."""
    h, f, t = gpt.hidden, gpt.ffn_hidden, layout.tp
    sharded = 3 * h * h + 3 * h + h * h + h * f + f + f * h  # column/row weights + col biases
    block = 4 * h + 2 * h + sharded // t  # LayerNorms and row biases are replicated
    unit = 128 * t
    vocab = -(-gpt.vocab_size // unit) * unit if t > 1 else gpt.vocab_size
    counts = []
    for i, layers in enumerate(stage_layers(gpt.n_layers, layout)):
        n = layers * block
        if i == 0 or i == layout.pp - 1:
            n += vocab // t * h
        if i == 0:
            n += gpt.seq_len * h
        if i == layout.pp - 1:
            n += 2 * h
        counts.append(n)
    return counts


def _in_flight(layout: Layout) -> list[int]:
    """Closed-form peak of chunk forwards alive per stage (no simulation)."""
    p, m, v = layout.pp, layout.num_micro_batches, layout.virtual_stages
    if layout.schedule == "gpipe":
        return [m * v] * p
    if layout.schedule == "1f1b":
        return [min(m, p - i) for i in range(p)]
    return [min(m * v, 2 * (p - i - 1) + (v - 1) * p + 1) for i in range(p)]


def _memory(gpt: GPTConfig, layout: Layout, in_flight: list[int]) -> dict[str, float]:
    """Bytes on the fullest stage, by part."""
    t, b, prec = layout.tp, layout.micro_batch, layout.precision
    per_layer = activation_bytes_per_layer(gpt, b, t, layout.sequence_parallel,
                                           layout.recompute, prec)
    # While recomputing, one layer's full activations exist again (the working set).
    working = (activation_bytes_per_layer(gpt, b, t, layout.sequence_parallel, "none", prec)
               if layout.recompute == "full" else 0.0)
    best: dict[str, float] = {}
    params = _stage_params(gpt, layout)
    for i, layers in enumerate(stage_layers(gpt.n_layers, layout)):
        parts = zero_bytes(params[i], layout.dp, layout.zero_stage, prec)
        chunk_layers = layers / layout.virtual_stages
        acts = per_layer * chunk_layers * in_flight[i] + working
        if i == layout.pp - 1:  # fp32 logits for the loss, one micro-batch
            acts += 4.0 * gpt.seq_len * b * gpt.vocab_size / t
        parts["activations"] = acts
        parts["total"] += acts
        parts["params"] = float(params[i])
        if not best or parts["total"] > best["total"]:
            best = parts
    return best


def _times(gpt: GPTConfig, layout: Layout, gpu: GPUSpec, efficiency: float) -> dict:
    """Per-stage chunk forward / backward seconds, P2P, TP and DP communication."""
    s, b, h, f, t = gpt.seq_len, layout.micro_batch, gpt.hidden, gpt.ffn_hidden, layout.tp
    width = _WIDTH[layout.precision]
    layer_fwd = b * s * (8.0 * h * h + 4.0 * h * f) + 4.0 * b * s * s * h
    recompute = {"full": layer_fwd, "selective": 4.0 * b * s * s * h, "none": 0.0}
    speed = t * gpu.peak_flops * efficiency
    message = float(b * s * h * width)
    intra = t <= gpu.gpus_per_node
    tp_bw = gpu.nvlink_bytes_per_s if intra else gpu.ib_bytes_per_s
    allreduce = 2.0 * (t - 1) / t * message / tp_bw
    n_recomp = 2 if layout.recompute == "full" else 0
    # Elementwise ops (LayerNorm, GeLU, softmax, dropout, residuals) are memory bound: the
    # forward writes about the bytes Korthikanti counts as stored, backward reads and writes
    # them again (twice the traffic), a full recompute writes them once more.
    traffic = activation_bytes_per_layer(gpt, b, t, layout.sequence_parallel, "none",
                                         layout.precision) / gpu.memory_bytes_per_s
    ew_bwd = 2.0 + (1.0 if layout.recompute == "full" else 0.0)
    fwd, bwd = [], []
    for i, layers in enumerate(stage_layers(gpt.n_layers, layout)):
        n = layers / layout.virtual_stages
        head = 2.0 * b * s * h * gpt.vocab_size if i == layout.pp - 1 else 0.0
        fwd.append((n * layer_fwd + head) / speed + n * (2 * allreduce + traffic))
        bwd.append((n * (2 * layer_fwd + recompute[layout.recompute]) + 2 * head) / speed
                   + n * ((2 + n_recomp) * allreduce + ew_bwd * traffic))
    one_node = layout.world_size <= gpu.gpus_per_node
    p2p_bw = gpu.nvlink_bytes_per_s if one_node else gpu.ib_bytes_per_s
    p2p = message / t / p2p_bw if layout.pp > 1 else 0.0  # scatter-gather: 1/t per TP rank
    d = layout.dp
    dp_bw = gpu.nvlink_bytes_per_s if t * d <= gpu.gpus_per_node else gpu.ib_bytes_per_s
    grads = max(_stage_params(gpt, layout)) * width
    volume = 3.0 if layout.zero_stage == 3 else 2.0  # ZeRO-3 gathers weights twice more
    dp_time = volume * (d - 1) / d * grads / dp_bw if d > 1 else 0.0
    m = layout.num_micro_batches
    tp_total = m * sum(stage_layers(gpt.n_layers, layout)) / layout.pp * (4 + n_recomp) * (
        allreduce)
    # Adam step, memory bound: ~32 bytes read + written per parameter of the rank's shard.
    shard = max(_stage_params(gpt, layout)) / (d if layout.zero_stage >= 1 else 1)
    optimizer = 32.0 * shard / gpu.memory_bytes_per_s
    return {"fwd": fwd, "bwd": bwd, "p2p": p2p, "dp": dp_time, "tp": tp_total,
            "optimizer": optimizer}


def estimate(gpt: GPTConfig, layout: Layout, gpu: GPUSpec, efficiency: float = EFFICIENCY,
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
        schedule = get_schedule(layout.schedule, p, m, v)
        sim = simulate(schedule, forward_time=times["fwd"], backward_time=times["bwd"],
                       p2p_time=times["p2p"])
        pipeline_time, in_flight = sim.pipeline_time, list(sim.peak_in_flight)
        bubble = max(sim.bubble_fraction)
    else:
        step = max(times["fwd"]) + max(times["bwd"])
        bubble = (p - 1) / (v * m)
        pipeline_time = m * v * step * (1 + bubble) + 2 * (p - 1) * times["p2p"] * v
        in_flight = _in_flight(layout)
    mem = _memory(gpt, layout, in_flight)
    iteration = pipeline_time + times["dp"] + times["optimizer"]
    flops = model_flops_per_iteration(gpt, layout.global_batch)
    gb = 1e9
    return Estimate(
        layout=layout, gpu=gpu.name, efficiency=efficiency,
        parameters=count_parameters(gpt), parameters_per_gpu=int(mem["params"]),
        memory_per_gpu_gb=mem["total"] / gb, memory_weights_gb=mem["weights"] / gb,
        memory_grads_gb=mem["grads"] / gb, memory_optimizer_gb=mem["optimizer"] / gb,
        memory_activations_gb=mem["activations"] / gb, gpu_memory_gb=gpu.memory_bytes / gb,
        fits=mem["total"] <= gpu.memory_bytes, model_flops_per_iteration=flops,
        bubble_fraction=bubble, pipeline_time_s=pipeline_time, tp_comm_time_s=times["tp"],
        p2p_time_s=times["p2p"] * 2 * (m * v + p - 1) if p > 1 else 0.0,
        dp_comm_time_s=times["dp"], optimizer_time_s=times["optimizer"],
        iteration_time_s=iteration,
        tflops_per_gpu=flops / (iteration * layout.world_size) / 1e12,
        tokens_per_s=layout.global_batch * gpt.seq_len / iteration,
        simulated=simulate_pipeline)


def calibrate_efficiency(gpt: GPTConfig, cases: list[tuple[Layout, float]], gpu: GPUSpec,
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
