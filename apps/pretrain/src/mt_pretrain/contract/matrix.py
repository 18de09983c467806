"""The layout matrix (pure): every way `mt pretrain` can split a run over at most 8 processes,
what each must equal, and a small subset that still holds every pair of features.

A :class:`Case` is a parallel :class:`~mt_plan.layout.Layout` (TP x CP x PP x DP, ZeRO stage,
schedule, sequence parallelism, activation checkpointing, precision) plus dropout and the
engine. Its :meth:`Case.reference` is the run it must train exactly like:

- dropout 0: one process in the same precision (same seed, same global batches);
- dropout > 0: the masks are keyed by (micro-batch, layer), so data parallelism, pipeline
  stages, schedules, ZeRO and checkpointing do not change them, but tensor-parallel regions
  draw per-rank masks by design (their activations are shards), and so do context-parallel
  ranks (their slices of a sequence): the reference is the run at the same TP and CP degrees
  and sequence-parallel setting on one pipeline stage and one replica, which is one process
  when tp = cp = 1.

:func:`candidates` enumerates the whole space (every valid combination, a few thousand);
:func:`full_matrix` is what ``mt matrix --set full`` runs: every parallel layout, every
feature on every grid it applies to, and :func:`pairwise_cover`, the CI subset: a greedy
choice of cases in which every pair of feature values that can occur together occurs at
least once (TP x ZeRO stage, schedule x DP, SP x ZeRO, checkpointing x dropout, bf16 x
pipelines...). Context parallelism has its own rows (:func:`cp_rows`, CI: :data:`CP_CI`),
outside the pairwise cover, which stays the cover of the three other dimensions.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from mt_pipeline import DEFAULT_SCHEDULE, SCHEDULES
from mt_plan.layout import ParallelLayout
from mt_pretrain.config.engines import ENGINES, REFERENCE
from mt_pretrain.config.schema import PRECISIONS, layout_flags

__all__ = ["COMMON", "CP_CI", "ENGINE_CI", "LLAMA", "LLAMA_CI", "TRAITS", "Case",
           "EngineTraits", "candidates",
           "ci_matrix", "cp_rows", "full_matrix", "llama_rows", "matrix_layout",
           "pairwise_cover", "valid"]

#: The run every case trains: the tiny GPT on the embedded corpus, global batch 8 of
#: micro-batches of 1 (so every DP degree up to 8 divides it), validation at the end.
GLOBAL_BATCH, MICRO_BATCH, MAX_PROCS = 8, 1, 8
COMMON: dict[str, Any] = {
    "model": "tiny", "seq_len": 32, "micro_batch_size": MICRO_BATCH,
    "global_batch_size": GLOBAL_BATCH, "eval_iters": 1, "sample_tokens": 0, "progress": False,
    "log_interval": 1000, "save": "none", "timeout": 120.0,
}
DROPOUT = 0.1


@dataclass(frozen=True)
class EngineTraits:
    """What the matrix needs to know of a training engine."""

    keyed_dropout: bool
    """It draws dropout masks from mt's keyed streams, equal at every layout (else its
    dropout cases are left out: they cannot match one process)."""
    own_reduction: bool
    """It reduces 16-bit gradients its own way (the contract allows a wider 16-bit floor)."""
    start_seconds: float
    """Extra seconds it takes to start a run on a 2-core CPU (the matrix's costs)."""
    zero3_seconds: float
    """Extra seconds its ZeRO-3 takes per micro-batch and tensor-parallel rank (the matrix's
    costs: DeepSpeed gathers and releases each module's parameters in Python hooks)."""
    tag: str
    """Its mark in case names ("" for the reference engine)."""


#: Every engine of mt_pretrain.config.engines, as the matrix sees it.
TRAITS = {"mt": EngineTraits(keyed_dropout=True, own_reduction=False, start_seconds=0.0,
                             zero3_seconds=0.0, tag=""),
          "deepspeed": EngineTraits(keyed_dropout=False, own_reduction=True,
                                    start_seconds=2.7, zero3_seconds=1.25, tag="ds")}


@dataclass(frozen=True)
class Case:
    """One row of the matrix: a layout, the dropout rate and the engine."""

    layout: ParallelLayout
    dropout: float = 0.0
    engine: str = REFERENCE
    model: str = "tiny"
    """The preset trained: the GPT-2 ``tiny``, or ``llama-test`` (the Llama row set)."""

    @property
    def nproc(self) -> int:
        """Processes the case runs on."""
        return self.layout.world_size

    @property
    def checkpointing(self) -> bool:
        """Activation checkpointing (full recomputation of each layer)."""
        return self.layout.recompute == "full"

    @property
    def recompute(self) -> str:
        """What each layer recomputes: none, selective or full."""
        return self.layout.recompute

    @property
    def name(self) -> str:
        """Short, unique label: ``tp2.pp2.dp2 z1 1f1b sp ac bf16 drop ds`` (``sel``:
        selective recomputation; ``.cp2`` after the degrees with context parallelism)."""
        lay = self.layout
        cp = f".cp{lay.cp}" if lay.cp > 1 else ""
        parts = [f"tp{lay.tp}.pp{lay.pp}.dp{lay.dp}{cp}", f"z{lay.zero_stage}"]
        if lay.pp > 1:
            parts.append(lay.schedule if lay.virtual_stages == 1 else
                         f"{lay.schedule}{lay.virtual_stages}")
        parts += [flag for flag, on in (("sp", lay.sequence_parallel),
                                        ("ac", self.checkpointing),
                                        ("sel", self.recompute == "selective")) if on]
        if lay.precision != "fp32":
            parts.append(lay.precision)
        if self.dropout:
            parts.append("drop")
        if TRAITS[self.engine].tag:
            parts.append(TRAITS[self.engine].tag)
        if self.model != "tiny":
            parts.append(self.model.split("-")[0])
        return " ".join(parts)

    def options(self) -> dict[str, Any]:
        """The `mt pretrain` flags of this case (on top of :data:`COMMON`): the layout's
        through the config's own inverse (:func:`~mt_pretrain.config.schema.layout_flags`)."""
        return {**layout_flags(self.layout), "dropout": self.dropout, "engine": self.engine,
                "model": self.model}

    def reference(self) -> Case:
        """The run this case must equal (see the module docstring)."""
        lay = self.layout
        keep = self.dropout > 0  # the masks of shards and slices are drawn per rank
        return Case(matrix_layout(tp=lay.tp if keep else 1, precision=lay.precision,
                                  sequence_parallel=lay.sequence_parallel and keep,
                                  chunked_loss=lay.chunked_loss, cp=lay.cp if keep else 1),
                    self.dropout, model=self.model)

    def factors(self) -> dict[str, object]:
        """The feature values pairwise coverage counts; a factor that means nothing here
        (the schedule with one stage, SP with tp 1) is left out."""
        lay = self.layout
        out: dict[str, object] = {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp,
                                  "zero": lay.zero_stage, "recompute": self.recompute,
                                  "precision": lay.precision, "dropout": self.dropout > 0,
                                  "engine": self.engine}
        if lay.pp > 1:
            out["schedule"] = lay.schedule
        if lay.tp > 1:
            out["sp"] = lay.sequence_parallel
        if lay.cp > 1:
            out["cp"] = lay.cp
        return out

    def pairs(self) -> frozenset[tuple[tuple[str, object], tuple[str, object]]]:
        """Every pair of (factor, value) of this case."""
        items = sorted(self.factors().items(), key=lambda kv: kv[0])
        return frozenset(itertools.combinations(items, 2))


def matrix_layout(tp: int = 1, pp: int = 1, dp: int = 1, zero_stage: int = 0,
                  schedule: str = DEFAULT_SCHEDULE, sequence_parallel: bool = False,
                  checkpointing: bool | str = False, precision: str = "fp32",
                  chunked_loss: bool = True, cp: int = 1) -> ParallelLayout:
    """A layout at the matrix's batch sizes (a chunked schedule with 2 chunks per stage).
    ``checkpointing``: the recomputation, a mode or True (full); ``chunked_loss``: the
    engine's (a case and its reference compute the loss alike)."""
    recompute = (("full" if checkpointing else "none") if isinstance(checkpointing, bool)
                 else checkpointing)
    return ParallelLayout(tp, pp, dp, GLOBAL_BATCH, MICRO_BATCH, zero_stage, schedule,
                  2 if SCHEDULES[schedule].chunked else 1, sequence_parallel,
                  recompute, precision, chunked_loss, cp=cp)


def _grids(cp: int = 1) -> Iterator[tuple[int, int, int]]:
    for tp, pp, dp in itertools.product((1, 2, 4), (1, 2, 4), (1, 2, 4, 8)):
        if tp * pp * dp * cp <= MAX_PROCS:
            yield tp, pp, dp


@cache
def valid(case: Case) -> bool:
    """Whether `mt pretrain` accepts the case (its own config checks decide) and the case
    differs from its reference."""
    from mt_pretrain.config.load import load_config
    from mt_pretrain.config.schema import ConfigError

    if case == case.reference():
        return False
    try:
        load_config(None, {**COMMON, **case.options(), "train_steps": 1})
    except ConfigError:
        return False
    return True


def candidates(cp: int = 1) -> list[Case]:
    """Every valid case at context-parallel degree ``cp``: grids x ZeRO stages x schedules x
    SP x recompute x precision x dropout x engine. ZeRO > 0 only with data (or context)
    parallelism, SP only with TP, and DeepSpeed only with dropout 0 (its pipeline engine draws
    masks its own way)."""
    out = []
    for tp, pp, dp in _grids(cp):
        for zero, schedule, sp, ac, precision, dropout, engine in itertools.product(
                (0, 1, 2, 3) if dp * cp > 1 else (0,),
                tuple(SCHEDULES) if pp > 1 else (DEFAULT_SCHEDULE,),
                (False, True) if tp > 1 else (False,), ("none", "selective", "full"),
                PRECISIONS, (0.0, DROPOUT), ENGINES):
            if dropout and not TRAITS[engine].keyed_dropout:
                continue
            layout = matrix_layout(tp, pp, dp, zero, schedule, sp, ac, precision,
                                   ENGINES[engine].chunked_loss, cp)
            case = Case(layout, dropout, engine)
            if valid(case):
                out.append(case)
    return out


def _run_cost(case: Case) -> float:
    """Seconds one run of ``case`` takes, 10 steps on a 2-core CPU (fitted to the CI matrix's
    runs on an AVX2-only EPYC, bf16 emulated): a start per process; tensor parallelism's
    collectives in every layer of every micro-batch a rank runs, twice as many with sequence
    parallelism (gloo's small collectives cost 1-2 ms each there), context
    parallelism's likewise; 16-bit matmuls; DeepSpeed's start and its ZeRO-3 hooks."""
    lay = case.layout
    micro = GLOBAL_BATCH / (MICRO_BATCH * lay.dp * lay.cp)  # micro-batches a rank runs
    traits = TRAITS[case.engine]
    return (0.8 + 0.4 * case.nproc
            + (0.4 + 0.65 * lay.sequence_parallel) * (lay.tp - 1) * micro
            + 1.6 * (lay.cp - 1) * micro
            + 0.6 * (lay.precision == "fp16") + 1.3 * (lay.precision == "bf16")
            + traits.start_seconds
            + traits.zero3_seconds * (lay.zero_stage == 3) * lay.tp * micro)


def _cost(case: Case) -> float:
    """Seconds checking ``case`` takes: its run, and the runs of its reference where that is
    not the one process every shard trains anyway (dropout under TP or CP compares with a
    run at the same degree; a 16-bit case with the fp32 run of its reference too)."""
    cost = _run_cost(case)
    ref = case.reference()
    if ref.nproc > 1:
        cost += _run_cost(ref)
        if ref.layout.precision != "fp32":
            cost += _run_cost(_with(ref, precision="fp32"))
    return cost


def pairwise_cover(cases: Iterable[Case] | None = None) -> list[Case]:
    """A small subset of ``cases`` (default: every candidate) holding every pair of feature
    values that occurs in ``cases``: greedy, the case with the most uncovered pairs per
    unit of cost first (ties: the earlier case), so the result is deterministic."""
    pool = list(cases if cases is not None else candidates())
    pairs = [c.pairs() for c in pool]
    uncovered = set().union(*pairs)
    chosen: list[Case] = []
    while uncovered:
        best = max(range(len(pool)),
                   key=lambda i: (len(pairs[i] & uncovered) / _cost(pool[i]), -i))
        chosen.append(pool[best])
        uncovered -= pairs[best]
    return chosen


def full_matrix() -> list[Case]:
    """What ``mt matrix --set full`` runs: every parallel layout (grid x ZeRO stage x
    schedule, fp32, dropout 0), every feature (SP, checkpointing, selective recomputation,
    bf16, fp16, dropout,
    dropout with checkpointing, DeepSpeed) on every grid it applies to, the pairwise
    cover, the Llama row set, the context-parallel rows and the engine rows of CI; in that
    order, without repeats."""
    pool = candidates()
    plain, variants = _base_and_features(pool)
    return list(dict.fromkeys(plain + variants + pairwise_cover(pool) + llama_rows(pool)
                              + cp_rows() + list(ENGINE_CI)))


def _base_and_features(pool: list[Case]) -> tuple[list[Case], list[Case]]:
    """Every plain case of ``pool`` (fp32, dropout 0, mt's engine, no recomputation, no SP),
    and each grid's base layout with every feature."""
    plain = [c for c in pool if c.dropout == 0 and c.engine == REFERENCE and
             c.layout.precision == "fp32" and c.recompute == "none" and
             not c.layout.sequence_parallel]
    base = {}
    for c in plain:  # one base layout per grid: ZeRO-1 with DP (or CP), the 1F1B schedule
        lay = c.layout
        key = (lay.tp, lay.pp, lay.dp)
        if lay.zero_stage == (1 if lay.dp * lay.cp > 1 else 0) and \
                lay.schedule == DEFAULT_SCHEDULE:
            base[key] = c
    features: list[dict[str, Any]] = [
        {"sequence_parallel": True}, {"checkpointing": True}, {"recompute": "selective"},
        {"precision": "bf16"},
        {"precision": "fp16"}, {"dropout": DROPOUT},
        {"dropout": DROPOUT, "checkpointing": True},
        *({"engine": name} for name in ENGINES if name != REFERENCE)]
    variants = []
    for case in base.values():
        for feature in features:
            variant = _with(case, **feature)
            if variant in pool:
                variants.append(variant)
    return plain, variants


def cp_rows() -> list[Case]:
    """The context-parallel rows of the full matrix: at CP 2 and 4, every grid it fits in 8
    processes (plain), each grid's base layout with every feature, the Llama row set, and
    the CI rows (:data:`CP_CI`)."""
    out: list[Case] = []
    for cp in (2, 4):
        pool = candidates(cp)
        plain, variants = _base_and_features(pool)
        out += plain + variants + llama_rows(pool)
    return list(dict.fromkeys(out + list(CP_CI)))


#: The Llama row set: llama-test (RoPE, RMSNorm, SwiGLU, 4 query / 2 key-value heads, untied
#: head) on every grid's base layout, with sequence parallelism where there is TP (key/value
#: heads split at TP 2, replicated at TP 4).
LLAMA = "llama-test"


def llama_rows(pool: Iterable[Case] | None = None) -> list[Case]:
    """The Llama row set of the full matrix (fp32, dropout 0, mt's engine)."""
    out = []
    for case in (pool if pool is not None else candidates()):
        lay = case.layout
        if (case.dropout == 0 and case.engine == REFERENCE and lay.precision == "fp32"
                and case.recompute == "none" and lay.schedule == DEFAULT_SCHEDULE
                and lay.zero_stage == (1 if lay.dp * lay.cp > 1 else 0)
                and lay.sequence_parallel == (lay.tp > 1)):
            out.append(replace(case, model=LLAMA))
    return out


#: The Llama rows CI runs: every Llama-specific mechanism at once (TP 2 x PP 2 x DP 2 with
#: SP: split key/value heads, SP RMSNorm, the untied head on the last stage; TP 4 x DP 2 with
#: SP: replicated key/value heads).
LLAMA_CI = (
    Case(matrix_layout(tp=2, pp=2, dp=2, zero_stage=1, sequence_parallel=True), model=LLAMA),
    Case(matrix_layout(tp=4, dp=2, zero_stage=1, sequence_parallel=True), model=LLAMA),
)


#: The context-parallel rows CI runs (GPT-2 tiny unless said): CP 4 alone (2 chunks of 4
#: tokens per rank); CP 2 with TP 2, sequence parallelism, full recomputation and ZeRO-1 over
#: the two CP ranks; CP 2 x DP 2 with ZeRO-2 in bf16; CP 2 x DP 2 with ZeRO-3 on Llama
#: (rotary positions of each slice, grouped-query keys gathered); CP 2 with 2 pipeline
#: stages, selective recomputation and keyed dropout (each CP rank its own masks).
CP_CI = (
    Case(matrix_layout(cp=4)),
    Case(matrix_layout(tp=2, cp=2, zero_stage=1, sequence_parallel=True, checkpointing=True)),
    Case(matrix_layout(dp=2, cp=2, zero_stage=2, precision="bf16")),
    Case(matrix_layout(dp=2, cp=2, zero_stage=3), model=LLAMA),
    Case(matrix_layout(pp=2, cp=2, zero_stage=1, checkpointing="selective"), DROPOUT),
)


#: The engine rows CI adds to the cover, DeepSpeed in bf16 through each of its engines:
#: ``DeepSpeedEngine`` (pp 1) with ZeRO-3, its stage-3 bf16 optimizer; ``PipelineEngine`` (PP 2
#: x DP 2, 1F1B, ZeRO-1), its bf16 pipeline path (a pairwise cover holds DeepSpeed x bf16 and
#: DeepSpeed x PP, not the three together). The first measured against its floor multiple:
#: parameters 0.021 of 0.096 (ZeRO 1: 0.024, ZeRO 2: 0.017, TP 2 x DP 2: 0.060 of 0.128).
ENGINE_CI = (
    Case(matrix_layout(dp=2, zero_stage=3, precision="bf16",
                       chunked_loss=ENGINES["deepspeed"].chunked_loss), engine="deepspeed"),
    Case(matrix_layout(pp=2, dp=2, zero_stage=1, precision="bf16",
                       chunked_loss=ENGINES["deepspeed"].chunked_loss), engine="deepspeed"),
)


def ci_matrix() -> list[Case]:
    """What CI and ``mt matrix --set ci`` run: the pairwise cover, the Llama CI rows, the
    context-parallel CI rows and the engine rows."""
    return pairwise_cover() + list(LLAMA_CI) + list(CP_CI) + list(ENGINE_CI)


def _with(case: Case, **changes: Any) -> Case:
    layout_changes = {k: v for k, v in changes.items()
                      if k in ("sequence_parallel", "precision")}
    if changes.get("checkpointing"):
        layout_changes["recompute"] = "full"
    if "recompute" in changes:
        layout_changes["recompute"] = changes["recompute"]
    if "engine" in changes:
        layout_changes["chunked_loss"] = ENGINES[changes["engine"]].chunked_loss
    return replace(case, layout=replace(case.layout, **layout_changes),
                   dropout=changes.get("dropout", case.dropout),
                   engine=changes.get("engine", case.engine))
