"""mt-plan: what a parallel layout costs, before anything runs.

- :class:`ParallelLayout`: one way to run a model (TP x PP x DP, batch sizes, ZeRO stage,
  schedule, sequence parallelism, recomputation, precision), validated; :func:`enumerate_layouts`
  lists the valid ones of a GPU count (``mt plan --search``).
- :func:`estimate`: memory per GPU by part (ZeRO, Korthikanti activations times the schedule's
  in-flight micro-batches, temporaries), model FLOPs (Narayanan), the pipeline bubble from
  mt-pipeline's simulator, TP / DP communication, iteration time and TFLOP/s from one
  calibrated efficiency (:data:`EFFICIENCY`, fitted to MT-NLG 530B's published times).
- :data:`GPUS`, :class:`GPUSpec`, :func:`load_gpu`: the hardware descriptions (data sheets, or
  YAML with measured costs).
- :mod:`mt_plan.calibrate`: measures this machine's matmul, attention, memory and AdamW rates
  at a model's shapes and stores them as such a YAML (``mt plan --calibrate``).
- :func:`measure_peak_flops`, :func:`model_flops_utilization`: a run's MFU against a given
  or probed peak (what ``mt pretrain`` reports beside the plan's prediction).
- :mod:`mt_plan.memory`: the peak memory a run measures on every rank (CUDA allocator or RSS),
  the counterpart of the estimate, and the end-of-run line that sets the two side by side.

Bucket sizes, vocabulary padding and the stage split come from the packages that own them
(mt-zero, mt-tensor-parallel, mt-pipeline). ``mt plan`` and ``mt pretrain --dry-run`` are thin
commands over it.
"""

from mt_plan.estimate import (
    EFFICIENCY,
    MTNLG_GPU,
    MTNLG_PUBLISHED,
    Estimate,
    activation_bytes_per_layer,
    attention_flops,
    calibrate_efficiency,
    estimate,
    stage_memory,
    zero_bytes,
)
from mt_plan.gpus import GPUS, GPUSpec, GPUSpecError, load_gpu
from mt_plan.layout import RECOMPUTE, LayoutError, ParallelLayout, enumerate_layouts, stage_layers
from mt_plan.mfu import measure_peak_flops, model_flops_utilization

__version__ = "0.1.0"

__all__ = [
    "EFFICIENCY",
    "GPUS",
    "MTNLG_GPU",
    "MTNLG_PUBLISHED",
    "RECOMPUTE",
    "Estimate",
    "GPUSpec",
    "GPUSpecError",
    "LayoutError",
    "ParallelLayout",
    "__version__",
    "activation_bytes_per_layer",
    "attention_flops",
    "calibrate_efficiency",
    "enumerate_layouts",
    "estimate",
    "load_gpu",
    "measure_peak_flops",
    "model_flops_utilization",
    "stage_layers",
    "stage_memory",
    "zero_bytes",
]
