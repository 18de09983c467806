"""The correctness contract, checked: train a matrix case and its reference, compare them.

For each case of :mod:`mt_pretrain.contract.matrix` the runner trains the case and (once per
distinct reference) the run it must equal, both through :func:`mt_pretrain.launch.launch` exactly as
the CLI does, and compares per step the loss, the gradient norm before clipping and the
learning rate, the validation loss at the end, and every parameter gathered to full shape.

Differences are relative: ``|a - b| / |b|`` per step for the scalars; for parameters the
largest ``||a - b|| / ||b||`` over tensors, leaving out the elements whose gradient is zero in
exact arithmetic (:func:`mt_model.gradient_free_slices`: Adam turns their round-off gradients
into drift of up to the learning rate per step in every run, one process included).
:func:`tolerance_for` gives the limits: fp32 round-off for fp32; for bf16 and fp16 a
multiple of the noise floor, measured in the same run on the same machine
(:meth:`MatrixRunner.floor`: one-process runs that differ only in how the global batch is
grouped into micro-batches: the same sums in another order, which is all a correct layout
changes). 16-bit matmuls take another kernel on each instruction set (AVX-512 BF16, AVX2
emulation, AMX), so the floor is a property of the machine, never a stored figure. As such
limits may exceed the distance between a 16-bit run and an fp32 one, a 16-bit case must also
differ from the fp32 run of its reference by more than fp32 round-off: proof that it really
computed in 16 bits.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from mt_model import gradient_free_slices
from mt_pretrain.contract.matrix import COMMON, TRAITS, Case

__all__ = ["FP32", "GROUPINGS", "ISA_FLAGS", "Diff", "MatrixRunner", "Outcome", "Tolerance",
           "Trace", "compare", "cpu_isa", "floor_of", "noise_floor", "run_case", "run_matrix",
           "tolerance_for"]


@dataclass(frozen=True)
class Tolerance:
    """Largest relative differences a case may show against its reference."""

    loss: float
    grad_norm: float
    params: float

    def scaled(self, factor: float) -> Tolerance:
        """Every limit times ``factor``."""
        return Tolerance(self.loss * factor, self.grad_norm * factor, self.params * factor)


#: fp32: round-off (the limits the contract states).
FP32 = Tolerance(loss=1e-5, grad_norm=1e-5, params=1e-5)
#: The micro-batch sizes a noise floor groups the global batch into, each against
#: micro-batches of 1 (the worst of them is the floor).
GROUPINGS = (2, 4, 8)
#: The multiple of the floor a 16-bit case may reach, by what it adds to the floor's
#: reordering (each above the worst ratio the full matrix measured: apps/pretrain/README.md,
#: "Tolerances"):
#: - nothing beyond summing in another order (data/pipeline parallel, ZeRO, checkpointing,
#:   dropout): 3;
#: - DeepSpeed's engine: it reduces 16-bit gradients its own way: 6;
#: - tensor parallelism: each row-parallel all-reduce rounds partial sums to 16 bits once
#:   more per layer, t partial sums at TP t: 8; context parallelism likewise: each layer's
#:   key/value gradients are cp partial sums rounded to 16 bits, reduce-scattered, and each
#:   run's attention output two 16-bit partial results merged.
FLOOR_FACTORS = {"plain": 3.0, "own_reduction": 6.0, "tp": 8.0}


#: fp32 weights of the Llama rows: the one-process floor of llama-test (10 steps, worst over
#: micro-batches of 2, 4 and 8 against 1; loss and grad norm stay far inside FP32), above
#: the GPT-2 tiny's: no biases and SwiGLU leave more gradient elements made of cancelling
#: sums, which Adam turns into equal-sized steps.
LLAMA_FP32_PARAMS_FLOOR = 2.2e-5


def _kind(case: Case) -> str:
    """What ``case`` adds to a reordering (the key of :data:`FLOOR_FACTORS`)."""
    if case.layout.tp > 1 or case.layout.cp > 1:
        return "tp"
    return "own_reduction" if TRAITS[case.engine].own_reduction else "plain"


def needs_floor(case: Case) -> bool:
    """Whether the limits of ``case`` derive from its precision's measured noise floor: every
    16-bit case, and the parameters of a tensor- or context-parallel fp32 GPT-2 case."""
    precision = case.layout.precision
    return precision != "fp32" or (case.model == "tiny" and _kind(case) == "tp")


def tolerance_for(case: Case, floor: Tolerance | None = None) -> Tolerance:
    """The limits ``case`` must keep against its reference; where :func:`needs_floor` says
    so, from the noise floor of its precision measured on this machine
    (:meth:`MatrixRunner.floor`).

    fp32 keeps :data:`FP32`, except the parameters of a tensor- or context-parallel case: the
    larger of 1e-5 and the tensor-parallel multiple of the fp32 floor. Their partial sums
    round the forward activations too (a regrouped batch only reorders the gradient sums),
    and Adam turns that round-off, on the few elements whose gradient is a cancelling sum,
    into a visible part of a step (measured: apps/pretrain/README.md, "Tolerances")."""
    precision = case.layout.precision
    if precision == "fp32" and case.model != "tiny":
        return Tolerance(FP32.loss, FP32.grad_norm,
                         LLAMA_FP32_PARAMS_FLOOR * FLOOR_FACTORS["plain"])
    if not needs_floor(case):
        return FP32
    if floor is None:
        raise ValueError(f"{case.name}: a {precision} case needs its measured noise floor")
    if precision == "fp32":
        return Tolerance(FP32.loss, FP32.grad_norm,
                         max(FP32.params, floor.params * FLOOR_FACTORS["tp"]))
    return floor.scaled(FLOOR_FACTORS[_kind(case)])


def floor_of(measured: dict[str, Diff]) -> Tolerance:
    """The noise floor of :meth:`MatrixRunner.noise_floor`'s differences: the worst grouping
    per quantity (the ``"fp32-gap"`` entry is not a grouping)."""
    groupings = [d for name, d in measured.items() if name != "fp32-gap"]
    return Tolerance(max(d.loss for d in groupings), max(d.grad_norm for d in groupings),
                     max(d.params for d in groupings))


#: The CPU flags that decide which 16-bit kernels run (and so the noise floors).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_isa() -> str:
    """The instruction sets behind this machine's 16-bit kernels, in one line: the CPU's
    flags of :data:`ISA_FLAGS`, torch's vector capability and oneDNN's cap if one is set
    (``ONEDNN_MAX_CPU_ISA``, which moves bf16 matmuls to another kernel)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            flags = next((set(line.split(":", 1)[1].split()) for line in info
                          if line.startswith("flags")), set())
    except OSError:
        pass
    have = [flag for flag in ISA_FLAGS if flag in flags] or ["flags unknown"]
    text = f"cpu {' '.join(have)}; torch {torch.backends.cpu.get_cpu_capability()}"
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return text + (f"; ONEDNN_MAX_CPU_ISA={cap}" if cap else "")


@dataclass
class Trace:
    """What one run produced: per-step records, final validation loss, final weights."""

    records: list[dict[str, Any]]
    val_loss: float | None
    weights: dict[str, torch.Tensor]
    seconds: float


@dataclass(frozen=True)
class Diff:
    """Worst relative differences of a run against its reference."""

    loss: float
    grad_norm: float
    lr: float
    params: float
    steps: int

    def within(self, tol: Tolerance) -> bool:
        """All differences within ``tol`` (the learning rate must be exact to 1e-12)."""
        return (self.loss <= tol.loss and self.grad_norm <= tol.grad_norm
                and self.params <= tol.params and self.lr <= 1e-12)


@dataclass
class Outcome:
    """One case's result. ``fp32_gap``: for a 16-bit case, the grad-norm difference from the
    fp32 run of its reference, which must exceed fp32 round-off. ``tolerance`` is None only
    when the case failed before its limits were known."""

    case: Case
    diff: Diff | None
    tolerance: Tolerance | None
    seconds: float
    error: str | None = None
    fp32_gap: float | None = None
    passed: bool = field(init=False)

    def __post_init__(self) -> None:
        real_precision = self.fp32_gap is None or self.fp32_gap > FP32.grad_norm
        self.passed = (self.error is None and self.diff is not None and real_precision
                       and self.tolerance is not None and self.diff.within(self.tolerance))


def _config_options(case: Case, steps: int, out: Path, cache: Path,
                    micro_batch_size: int | None = None) -> dict[str, Any]:
    options = {**COMMON, **case.options(), "train_steps": steps, "eval_interval": steps,
               "out_dir": str(out), "cache_dir": str(cache), "metrics": "none"}
    if micro_batch_size is not None:
        options["micro_batch_size"] = micro_batch_size
    return options


def run_case(case: Case, steps: int, out: Path, cache: Path,
             micro_batch_size: int | None = None) -> Trace:
    """Train ``case`` for ``steps`` steps (as `mt pretrain` would) and keep its trace."""
    from mt_pretrain.config.load import load_config
    from mt_pretrain.launch import launch

    config = load_config(None, _config_options(case, steps, out, cache, micro_batch_size))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # an in-process rank shares the cores like a spawned one
    start = time.perf_counter()
    try:
        with _quiet_stdout():  # the runs' own lines; errors still reach stderr
            summary = launch(config, environ={}, timeout=600, keep_weights=True)
    finally:
        torch.set_num_threads(threads)
    assert summary is not None and summary.weights is not None
    return Trace(summary.records, summary.val_loss, summary.weights,
                 time.perf_counter() - start)


@contextmanager
def _quiet_stdout() -> Iterator[None]:
    """File descriptor 1 to /dev/null (forked ranks inherit it), then back."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-30)


def compare(run: Trace, ref: Trace, skip: dict[str, slice] | None = None) -> Diff:
    """Worst relative differences of ``run`` against ``ref`` (same number of steps);
    ``skip`` names parameter slices (along dim 0) to leave out."""
    if len(run.records) != len(ref.records):
        raise ValueError(f"{len(run.records)} steps against the reference's "
                         f"{len(ref.records)}")
    losses = [_rel(a["loss"], b["loss"]) for a, b in zip(run.records, ref.records)]
    if ref.val_loss is not None:
        losses.append(_rel(run.val_loss if run.val_loss is not None else math.nan,
                           ref.val_loss))
    norms = [_rel(a["grad_norm"], b["grad_norm"]) for a, b in zip(run.records, ref.records)]
    lrs = [_rel(a["lr"], b["lr"]) for a, b in zip(run.records, ref.records)]
    if run.weights.keys() != ref.weights.keys():
        raise ValueError(f"parameters differ: {sorted(run.weights.keys() ^ ref.weights.keys())}")
    params = 0.0
    for name, want in ref.weights.items():
        got, want = run.weights[name].float().clone(), want.float().clone()
        if skip and name in skip:
            got[skip[name]] = 0.0
            want[skip[name]] = 0.0
        scale = float(want.norm())
        error = float((got - want).norm())
        params = max(params, error / scale if scale > 0 else error)
    return Diff(max(losses), max(norms), max(lrs), params, len(run.records))


def _skip() -> dict[str, slice]:
    from mt_pretrain.config.load import load_config

    return gradient_free_slices(load_config(None, COMMON).model.gpt_config())


class MatrixRunner:
    """Checks cases one by one, training each distinct reference once (kept in memory) and
    measuring each 16-bit precision's noise floor once, on first use.

    Args:
        steps: optimizer steps of every run.
        root: folder for the runs' outputs and the shared data cache.
    """

    def __init__(self, steps: int, root: Path) -> None:
        self.steps, self.root, self.cache = steps, Path(root), Path(root) / "cache"
        self.skip = _skip()
        self._refs: dict[Case, Trace] = {}
        self._floors: dict[str, dict[str, Diff]] = {}

    def reference(self, case: Case) -> Trace:
        """The trace of ``case`` run as a reference (trained on first use)."""
        if case not in self._refs:
            folder = self.root / f"ref-{len(self._refs)}"
            self._refs[case] = run_case(case, self.steps, folder, self.cache)
        return self._refs[case]

    def noise_floor(self, precision: str) -> dict[str, Diff]:
        """One process in ``precision`` with micro-batches of 1 (the reference run) against
        the same run with the global batch grouped into larger micro-batches
        (:data:`GROUPINGS`): mathematically the same steps, summed in another order. The
        differences per grouping (``"mb2"``...) and, for a 16-bit precision, under
        ``"fp32-gap"``, the distance of the fp32 run from it (what a tolerance must stay
        below)."""
        if precision not in self._floors:
            from mt_pretrain.contract.matrix import matrix_layout

            case = Case(matrix_layout(precision=precision))
            ref = self.reference(case)
            out = {f"mb{mb}": compare(run_case(case, self.steps,
                                               self.root / f"floor-{precision}-mb{mb}",
                                               self.cache, mb), ref, self.skip)
                   for mb in GROUPINGS}
            if precision != "fp32":
                out["fp32-gap"] = compare(self.reference(Case(matrix_layout())), ref, self.skip)
            self._floors[precision] = out
        return self._floors[precision]

    def floor(self, precision: str) -> Tolerance:
        """The noise floor of ``precision`` on this machine (:func:`floor_of`)."""
        return floor_of(self.noise_floor(precision))

    def tolerance(self, case: Case) -> Tolerance:
        """The limits of ``case`` on this machine (:func:`tolerance_for`)."""
        floor = self.floor(case.layout.precision) if needs_floor(case) else None
        return tolerance_for(case, floor)

    def check(self, case: Case, folder: Path) -> Outcome:
        """Train ``case`` in ``folder`` and compare it with its reference; for a 16-bit case
        also measure its distance to the fp32 run of the reference."""
        ref = self.reference(case.reference())
        tolerance = self.tolerance(case)
        trace = run_case(case, self.steps, folder, self.cache)
        gap = None
        if case.layout.precision != "fp32":
            fp32_ref = replace(case.reference(), layout=replace(case.reference().layout,
                                                                precision="fp32"))
            gap = compare(trace, self.reference(fp32_ref), self.skip).grad_norm
        return Outcome(case, compare(trace, ref, self.skip), tolerance, trace.seconds,
                       fp32_gap=gap)


def run_matrix(cases: Sequence[Case], steps: int, work: Path | None = None,
               on_result: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Run ``cases`` and their references; ``on_result`` sees each outcome as it comes. A
    case that fails to run is reported (``Outcome.error``), and the others still run."""
    with tempfile.TemporaryDirectory(prefix="mt-matrix-") as tmp:
        runner = MatrixRunner(steps, Path(work) if work is not None else Path(tmp))
        outcomes = []
        for index, case in enumerate(cases):
            start = time.perf_counter()
            try:
                outcome = runner.check(case, runner.root / f"case-{index}")
            except Exception as err:  # noqa: BLE001 - one failing case must not stop the rest
                outcome = Outcome(case, None, None, time.perf_counter() - start,
                                  error=f"{type(err).__name__}: {err}".splitlines()[0])
            outcomes.append(outcome)
            if on_result is not None:
                on_result(outcome)
        return outcomes


def noise_floor(precision: str, steps: int, work: Path | None = None) -> dict[str, Diff]:
    """:meth:`MatrixRunner.noise_floor` of ``precision`` in a runner of its own."""
    with tempfile.TemporaryDirectory(prefix="mt-floor-") as tmp:
        return MatrixRunner(steps, Path(work) if work is not None else Path(tmp)).noise_floor(
            precision)
