"""A model ready to score on this rank: the checkpoint's model at a TP x PP layout (DP takes
the processes left), its tokenizer and mt's stage scorer, for mt's own evaluation engine and
for lm-evaluation-harness (:mod:`mt_pretrain.evaluation.harness`) alike.

Every rank reads the checkpoint's full weights and keeps its own TP slice of its stage's
parameters (so any saved layout scores at any other); every rank is handed the same batches,
and the scores reach every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from mt_checkpoint import materialize_stage
from mt_data import load_tokenizer
from mt_dist import (
    LaunchInfo,
    Topology,
    TopologyError,
    build_groups,
    discover,
    finalize_distributed,
    free_port,
    init_distributed,
    local_device,
)
from mt_pipeline import plan_pipeline
from mt_plan.layout import LayoutError, ParallelLayout
from mt_pretrain.config.schema import ConfigError
from mt_pretrain.evaluation.model import EvalModel, as_pretrain_checkpoint, load_eval_model
from mt_pretrain.evaluation.scorer import StageScorer
from mt_zero.precision import compute_dtype

__all__ = ["EvalSpec", "ScoringSession", "check_layout"]


@dataclass(frozen=True)
class EvalSpec:
    """One `mt eval` run (the command's options)."""

    checkpoint: str
    tasks: tuple[str, ...]
    shots: int | None = None
    fewshot_seed: int = 1234
    batch_size: int = 16
    limit: int | None = None
    tp: int = 1
    pp: int = 1
    nproc: int = 1
    device: str = "auto"
    precision: str = "fp32"
    tokenizer: str | None = None
    progress: bool = True
    timeout: float = 600.0
    engine: str = "auto"
    """Task engine: mt (mt-eval's), harness (lm-evaluation-harness) or auto."""
    include_path: str | None = None
    """Extra folder of lm-eval task YAMLs (the harness engine)."""
    data_dir: str | None = None
    """Local copies of the tasks' datasets (the harness engine)."""
    log_samples: bool = False
    suite: str | None = None
    """A suite of lm-eval tasks at its shot counts (:mod:`mt_pretrain.evaluation.suites`)."""


def check_layout(spec: EvalSpec, model: EvalModel, world_size: int) -> ParallelLayout:
    """The evaluation's layout (each replica scores its share of the requests one at a time),
    or a ConfigError naming the numbers at fault."""
    try:
        topology = Topology.from_world(world_size, tp=spec.tp, pp=spec.pp)
        layout = ParallelLayout(topology.tp, topology.pp, topology.dp, topology.dp, 1,
                                zero_stage=0, recompute="none", precision=spec.precision)
        layout.check(model.config)
    except (TopologyError, LayoutError) as err:
        raise ConfigError(f"invalid layout: {err}") from None
    return layout


class ScoringSession:
    """This rank's stage of the model, joined to the other ranks, with its scorer.

    Opening it initialises torch.distributed; :meth:`close` (every rank, at the end) tears it
    down.
    """

    def __init__(self, spec: EvalSpec, info: LaunchInfo) -> None:
        use_cuda = {"auto": None, "cpu": False, "cuda": True}[spec.device]
        device = local_device(info, use_cuda=use_cuda)
        model = load_eval_model(spec.checkpoint, spec.tokenizer)
        layout = check_layout(spec, model, info.world_size)
        tokenizer = load_tokenizer(model.tokenizer)
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ConfigError(f"tokenizer {model.tokenizer} has {tokenizer.vocab_size} ids, "
                              f"more than the model's vocabulary of {model.config.vocab_size}")
        init_distributed(info, device, timeout=spec.timeout)
        try:
            groups = build_groups(layout.topology, device, timeout=spec.timeout)
            gpt = model.config
            stages = plan_pipeline(layout.pipeline_config(), gpt.n_layers, layout.pp)
            dtype = compute_dtype(spec.precision)
            built = materialize_stage(gpt, stages.stages[groups.pp_rank], groups, layout.tp,
                                      lambda name, _shape: model.weights[name], seed=0,
                                      sequence_parallel=False, device=device)
        except BaseException:
            finalize_distributed(completed=False)
            raise
        built.stage.to(dtype)
        self.spec, self.layout, self.groups, self.model = spec, layout, groups, model
        self.scorer = StageScorer(built.stage, groups, gpt.vocab_size, gpt.seq_len, dtype,
                                  gpt.hidden)
        self.tokenizer = tokenizer
        self.encode, self.decode, self.prefix = tokenizer.encode, tokenizer.decode, \
            tokenizer.eod_id
        self.dtype = dtype
        self.max_length, self.tokenizer_name = gpt.seq_len, model.tokenizer

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that reports."""
        return self.groups.rank == 0

    def close(self, completed: bool = True) -> None:
        """Leave the process group (every rank)."""
        finalize_distributed(completed=completed)

    @classmethod
    def open_here(cls, checkpoint: str, tp: int = 1, pp: int = 1, precision: str = "fp32",
                  tokenizer: str | None = None, device: str = "auto",
                  timeout: float = 600.0) -> ScoringSession:
        """Open on this process as its launcher (torchrun, mpirun, srun) placed it, or as the
        only rank; another format than an mt checkpoint is converted once, in a temporary
        folder, while the weights are read."""
        info = discover(os.environ)
        if info.launcher == "single":
            info = replace(info, master_port=free_port(info.master_addr))
        with as_pretrain_checkpoint(checkpoint, tokenizer) as (path, tok):
            spec = EvalSpec(path, (), tp=tp, pp=pp, nproc=info.world_size, device=device,
                            precision=precision, tokenizer=tok, progress=False,
                            timeout=timeout)
            return cls(spec, info)
