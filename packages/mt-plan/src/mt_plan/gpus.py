"""Accelerator descriptions for ``mt plan``: a small built-in table or a custom YAML file.

Figures are vendor data sheet numbers for dense bf16 matmuls (no sparsity), HBM capacity,
NVLink bandwidth per GPU and direction, and the InfiniBand bandwidth one GPU gets across nodes
(one HDR 200 Gb/s NIC per A100 in a DGX A100 / Selene node, one NDR 400 Gb/s per H100/H200).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["GPUS", "GPUSpec", "GPUSpecError", "load_gpu"]


class GPUSpecError(ValueError):
    """A GPU name or description that cannot be used; the message names the values."""


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator type and the node it sits in.

    Attributes:
        name: label printed in reports.
        peak_flops: peak dense bf16 FLOP/s of one GPU.
        memory_bytes: usable device memory of one GPU, in bytes.
        nvlink_bytes_per_s: intra-node bandwidth per GPU and direction, bytes/s.
        ib_bytes_per_s: inter-node bandwidth per GPU and direction, bytes/s.
        gpus_per_node: GPUs sharing one NVLink domain.
        memory_bytes_per_s: device memory bandwidth (elementwise ops, optimizer step).

    The remaining fields describe fixed costs that data sheets do not give; they default to
    0 (negligible at the scale of the built-in GPUs, and MT-NLG's calibration assumes so) and
    are measured on a machine by a calibration, e.g. ``benchmarks/plan.py`` on a CPU:

        layer_overhead_s: fixed seconds of one transformer layer's forward + backward per
            micro-batch beyond its FLOPs and bytes (operator dispatch, kernel launches);
            the forward takes a third of it.
        head_overhead_s: the same for the embedding, final LayerNorm, output head and loss.
        link_latency_s: fixed seconds of one collective or point-to-point message.
        bulk_latency_s: fixed seconds of a collective carrying a gradient bucket, a
            parameter shard or the tied embedding's gradient, where it differs from a small
            message's (gloo on CPU: an all-reduce of 1 MB costs ~2 ms beyond its bytes, one
            of 4 bytes 0.2-0.6 ms, most of it the ranks' skew after compute); 0 means
            ``link_latency_s``.
        stepped_latency_s: fixed seconds of a collective the ranks reach in step, with no
            compute of theirs between it and the one before (ZeRO-3's gathers and
            reductions of its units, which the prefetch and the backward launch back to
            back: gloo on CPU, a one-element all-reduce repeated, 0.1 ms over two ranks that
            have a core each, more where ranks share one); 0 means ``link_latency_s``.
        tp_latency_s: fixed seconds of a tensor-parallel collective of a layer's
            activation (all-reduce, or all-gather / reduce-scatter with sequence
            parallelism) between the layer's matmuls, where it differs from a small
            message's (gloo on CPU: several times a one-element message's, and a
            reduce-scatter as much as an all-reduce; figures in apps/pretrain/README.md);
            0 means ``link_latency_s``.
        comm_rate_under_compute: how fast a collective progresses while its rank computes,
            as a share of its speed alone (what overlap can hide); 0 means 1 (a GPU's copy
            engines and NICs run beside the kernels; gloo on CPU cores that all compute
            gets a share of them, smaller with more ranks per core).
        gather_bytes_per_s: bus bandwidth of ZeRO-3's per-unit gathers (one layer's or
            the stage's rest's weights, a few MB each), where it differs from the gradient
            buckets' (gloo on CPU: all-reduces of a few MB run at about half the rate of
            tens of MB, figures in apps/pretrain/README.md); 0 means the link's.
        tensor_overhead_s: fixed seconds per parameter tensor of the optimizer step (a
            per-tensor Adam loop and gradient norm).
        optimizer_params_per_s: Adam step throughput in parameters per second; 0 means
            memory bound at ``memory_bytes_per_s`` (32 bytes per parameter).
        alloc_bytes_per_s: rate at which a freshly allocated large buffer is first touched
            (page faults on a CPU, where such buffers come straight from the kernel); 0
            means free, as with a GPU's caching allocator.
        step_overhead_s: fixed seconds of the training framework per optimizer step beyond
            the modelled compute and messages (loss bookkeeping, metrics, the ZeRO
            wrapper's per-step work).
        micro_batch_overhead_s: the same per micro-batch on each stage (data loading,
            batch assembly, the pipeline executor's per-micro-batch work); a third in
            forward.
        param_overhead_s: the same per parameter tensor of a stage per step (gradient
            hooks and bucket bookkeeping of the data-parallel wrapper).
        gather_scratch: scratch bytes an all-gather allocates per byte of its output (gloo
            on CPU stages the output in a buffer of its own: 1; NCCL: 0).
        gemm_fwd_flops, gemm_bwd_flops: measured FLOP/s of the block's and the head's
            matmuls at the model's shapes, forward and backward (data + weight gradient);
            0 means ``efficiency`` x ``peak_flops`` (data-sheet planning).
        attention_fwd_flops, attention_bwd_flops: the same for the attention kernel, in the
            FLOPs the estimator counts for it (see :func:`mt_plan.estimate.attention_flops`);
            0 means ``efficiency`` x ``peak_flops``.
        fused_attention: the attention kernel never stores the s x s scores (flash /
            memory-efficient scaled-dot-product attention, what torch picks for mt on CPU and
            on these GPUs): the ``5as/h`` activation term is dropped as with selective
            recomputation, a causal kernel skips the masked half of the scores, and its
            backward recomputes them. The built-in GPUs describe mt's runs (True); MT-NLG's
            calibration describes Megatron's 2021 kernels, which stored the scores.
        gather_via_all_reduce: ZeRO's all-gather and reduce-scatter run as all-reduces
            (mt-zero on gloo, where those are slower), moving 2 (d-1)/d of the data each
            instead of (d-1)/d.
    """

    name: str
    peak_flops: float
    memory_bytes: float
    nvlink_bytes_per_s: float
    ib_bytes_per_s: float
    gpus_per_node: int = 8
    memory_bytes_per_s: float = 2.0e12
    layer_overhead_s: float = 0.0
    head_overhead_s: float = 0.0
    link_latency_s: float = 0.0
    bulk_latency_s: float = 0.0
    stepped_latency_s: float = 0.0
    tp_latency_s: float = 0.0
    comm_rate_under_compute: float = 0.0
    gather_bytes_per_s: float = 0.0
    tensor_overhead_s: float = 0.0
    optimizer_params_per_s: float = 0.0
    alloc_bytes_per_s: float = 0.0
    step_overhead_s: float = 0.0
    micro_batch_overhead_s: float = 0.0
    param_overhead_s: float = 0.0
    gather_scratch: float = 0.0
    gemm_fwd_flops: float = 0.0
    gemm_bwd_flops: float = 0.0
    attention_fwd_flops: float = 0.0
    attention_bwd_flops: float = 0.0
    fused_attention: bool = True
    gather_via_all_reduce: bool = False

    def __post_init__(self) -> None:
        names = [f.name for f in fields(self)]
        positive = names[1:names.index("layer_overhead_s")]
        costs = names[names.index("layer_overhead_s"):names.index("fused_attention")]
        bad = [f"{n} {getattr(self, n)!r}" for n in positive if not getattr(self, n) > 0]
        bad += [f"{n} {getattr(self, n)!r} (>= 0)" for n in costs if not getattr(self, n) >= 0]
        if bad:
            raise GPUSpecError(f"GPU {self.name!r}: these must be positive: {', '.join(bad)}")

    @property
    def adam_params_per_s(self) -> float:
        """Parameters per second of the Adam step (measured, or memory bound)."""
        return self.optimizer_params_per_s or self.memory_bytes_per_s / 32.0

    def rates(self, efficiency: float) -> tuple[float, float, float, float]:
        """FLOP/s of one GPU for (block matmuls forward, backward, attention forward,
        backward): measured where calibrated, otherwise ``efficiency`` x peak."""
        planned = self.peak_flops * efficiency
        return (self.gemm_fwd_flops or planned, self.gemm_bwd_flops or planned,
                self.attention_fwd_flops or planned, self.attention_bwd_flops or planned)

    @property
    def calibrated(self) -> bool:
        """True when the matmul rates were measured (``mt plan --calibrate``)."""
        return self.gemm_fwd_flops > 0

    def first_touch_s(self, nbytes: float) -> float:
        """Seconds to fault in ``nbytes`` of freshly allocated memory (0 if free)."""
        return nbytes / self.alloc_bytes_per_s if self.alloc_bytes_per_s else 0.0


_GiB = 2.0**30

#: The built-in GPU table (8 GPUs a node).
GPUS: dict[str, GPUSpec] = {
    "a100-40gb": GPUSpec("a100-40gb", 312e12, 40 * _GiB, 300e9, 25e9, 8, 1.555e12),
    "a100-80gb": GPUSpec("a100-80gb", 312e12, 80 * _GiB, 300e9, 25e9, 8, 2.039e12),
    "h100-80gb": GPUSpec("h100-80gb", 989e12, 80 * _GiB, 450e9, 50e9, 8, 3.35e12),
    "h200": GPUSpec("h200", 989e12, 141e9, 450e9, 50e9, 8, 4.8e12),
}

# YAML keys (human units) -> GPUSpec field and scale.
_YAML_KEYS: dict[str, tuple[str, float]] = {
    "peak_tflops": ("peak_flops", 1e12),
    "memory_gb": ("memory_bytes", 1e9),
    "nvlink_gb_per_s": ("nvlink_bytes_per_s", 1e9),
    "ib_gb_per_s": ("ib_bytes_per_s", 1e9),
    "gpus_per_node": ("gpus_per_node", 1.0),
    "memory_bandwidth_gb_per_s": ("memory_bytes_per_s", 1e9),
    # Measured by `mt plan --calibrate` (mt_plan.calibrate), optional.
    "gemm_fwd_tflops": ("gemm_fwd_flops", 1e12),
    "gemm_bwd_tflops": ("gemm_bwd_flops", 1e12),
    "attention_fwd_tflops": ("attention_fwd_flops", 1e12),
    "attention_bwd_tflops": ("attention_bwd_flops", 1e12),
    "optimizer_gparams_per_s": ("optimizer_params_per_s", 1e9),
}
_REQUIRED = ("peak_tflops", "memory_gb", "nvlink_gb_per_s", "ib_gb_per_s")


def _from_mapping(data: Any, source: str) -> GPUSpec:
    if not isinstance(data, dict):
        raise GPUSpecError(f"{source}: expected a mapping of {sorted(_YAML_KEYS)}, "
                           f"got {type(data).__name__}")
    unknown = sorted(set(data) - set(_YAML_KEYS) - {"name", "fused_attention", "calibration"})
    missing = sorted(set(_REQUIRED) - set(data))
    if unknown or missing:
        raise GPUSpecError(f"{source}: unknown keys {unknown}, missing keys {missing}")
    kwargs: dict[str, Any] = {"name": str(data.get("name", Path(source).stem))}
    if "fused_attention" in data:
        if not isinstance(data["fused_attention"], bool):
            raise GPUSpecError(f"{source}: fused_attention must be true or false, got "
                               f"{data['fused_attention']!r}")
        kwargs["fused_attention"] = data["fused_attention"]
    for key, (field, scale) in _YAML_KEYS.items():
        if key in data:
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise GPUSpecError(f"{source}: {key} must be a number, got {value!r}")
            if field == "gpus_per_node" and not isinstance(value, int):
                raise GPUSpecError(f"{source}: {key} must be an integer, got {value!r}")
            scaled = _scaled(value, scale)
            if scaled is None:
                shown = repr(value) if len(repr(value)) <= 24 else f"{len(str(value))} digits"
                raise GPUSpecError(f"{source}: {key} must be a finite number, got {shown}")
            kwargs[field] = int(value) if field == "gpus_per_node" else scaled
    return GPUSpec(**kwargs)


def _scaled(value: float, scale: float) -> float | None:
    """``value`` x ``scale`` as a float; None when it is infinite (``.inf``, or a number past
    the largest float once in bytes or FLOP/s). NaN passes, for GPUSpec's check."""
    try:
        scaled = float(value) * scale
    except OverflowError:  # an integer of hundreds of digits
        return None
    return None if math.isinf(scaled) else scaled


def load_gpu(name_or_path: str) -> GPUSpec:
    """A built-in GPU by name, or a YAML file with keys ``peak_tflops``, ``memory_gb``,
    ``nvlink_gb_per_s``, ``ib_gb_per_s`` and optionally ``gpus_per_node``,
    ``memory_bandwidth_gb_per_s``, ``name``, ``fused_attention`` and the measured rates
    ``mt plan --calibrate`` writes (``gemm_fwd_tflops``, ``gemm_bwd_tflops``,
    ``attention_fwd_tflops``, ``attention_bwd_tflops``, ``optimizer_gparams_per_s``; a
    ``calibration`` mapping says where and when they were measured)."""
    key = name_or_path.lower()
    if key in GPUS:
        return GPUS[key]
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise GPUSpecError(f"GPU description file {path} not found")
        import yaml

        try:
            data = yaml.load(path.read_text(encoding="utf-8"), Loader=_strict_loader())
        except GPUSpecError as err:  # a key given twice, an ambiguous number
            raise GPUSpecError(f"{path} {err}") from None
        except UnicodeDecodeError as err:
            raise GPUSpecError(f"{path} is not UTF-8 text (byte {err.object[err.start]:#04x} "
                               f"at offset {err.start})") from None
        except (yaml.YAMLError, RecursionError) as err:
            problem = getattr(err, "problem", None) or "nested too deeply to read"
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise GPUSpecError(f"{path}{where}: not YAML ({problem})") from None
        return _from_mapping(data, str(path))
    raise GPUSpecError(f"unknown GPU type {name_or_path!r}; use one of {sorted(GPUS)} "
                       "or a .yaml file")


@cache
def _strict_loader() -> type:
    """YAML's safe loader, refusing what PyYAML reads silently otherwise: a key given twice
    in one mapping (the last one won), and the numbers YAML 1.1 and YAML 1.2 read apart: an
    integer with a leading zero (``010``: octal 8 in 1.1, 10 in 1.2) and a sexagesimal number
    (``1:30``: 90 in 1.1, text in 1.2). Errors are :class:`GPUSpecError` naming the line."""
    import yaml

    class Strict(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, (str, int, float, bool, type(None))):
                    if key in seen:
                        raise GPUSpecError(f"line {key_node.start_mark.line + 1}: {key} is "
                                           "given twice; keep one")
                    seen.add(key)
            return super().construct_mapping(node, deep)

        def construct_yaml_int(self, node: Any) -> int:
            value = super().construct_yaml_int(node)
            text, line = str(node.value), node.start_mark.line + 1
            if _LEADING_ZERO.match(text):
                raise GPUSpecError(
                    f"line {line}: {text} is ambiguous: YAML 1.1 reads it as octal {value}, "
                    f"YAML 1.2 as {int(text.replace('_', ''))}; write the number without the "
                    "leading zero")
            return _decimal(text, value, line)

        def construct_yaml_float(self, node: Any) -> float:
            value = super().construct_yaml_float(node)
            return _decimal(str(node.value), value, node.start_mark.line + 1)

    Strict.add_constructor("tag:yaml.org,2002:int", Strict.construct_yaml_int)
    Strict.add_constructor("tag:yaml.org,2002:float", Strict.construct_yaml_float)
    # 1e3 is a number (YAML 1.2, mt pretrain's configs); YAML 1.1 wants 1.0e+3.
    Strict.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT, list("-+0123456789."))
    return Strict


#: A number in exponent form without YAML 1.1's dot and sign (1e3, 2.5E-4).
_EXPONENT = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")
#: An integer YAML 1.1 reads as octal: a zero, then more digits.
_LEADING_ZERO = re.compile(r"^[-+]?0[0-9_]+$")


def _decimal(text: str, value: float, line: int) -> Any:
    """``value``, read from ``text`` on ``line``, unless ``text`` is sexagesimal (a
    :class:`GPUSpecError`)."""
    if ":" in text:
        raise GPUSpecError(f"line {line}: {text} is ambiguous: YAML 1.1 reads it as {value} "
                           "(base 60), YAML 1.2 as text; write the number in decimal")
    return value
