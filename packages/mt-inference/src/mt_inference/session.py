"""A model ready to score on this rank: the checkpoint's model at a TP x PP layout (DP takes
the processes left), its tokenizer and mt's stage scorer, for mt's own evaluation engine and
for lm-evaluation-harness (:mod:`mt_inference.harness`) alike.

Every rank reads the checkpoint's full weights and keeps its own TP slice of its stage's
parameters (so any saved layout scores at any other); every rank is handed the same batches,
and the scores reach every rank.
"""

from __future__ import annotations

import os
from dataclasses import replace

from mt_checkpoint import materialize_stage
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
from mt_inference.model import EvalModel, as_pretrain_checkpoint, load_eval_model
from mt_inference.placement import Placement, PlacementError
from mt_inference.scorer import StageScorer
from mt_pipeline import plan_pipeline
from mt_plan.layout import LayoutError, ParallelLayout
from mt_zero.precision import compute_dtype

__all__ = ["ScoringSession", "check_layout"]


def check_layout(placement: Placement, model: EvalModel, world_size: int) -> ParallelLayout:
    """The layout of ``placement`` over ``world_size`` ranks (each replica scores its share
    of the requests one at a time), or a PlacementError naming the numbers at fault."""
    try:
        topology = Topology.from_world(world_size, tp=placement.tp, pp=placement.pp)
        layout = ParallelLayout(topology.tp, topology.pp, topology.dp, topology.dp, 1,
                                zero_stage=0, recompute="none", precision=placement.precision)
        layout.check(model.config)
    except (TopologyError, LayoutError) as err:
        raise PlacementError(f"invalid layout: {err}") from None
    return layout


class ScoringSession:
    """This rank's stage of the model, joined to the other ranks, with its scorer.

    Opening it initialises torch.distributed; :meth:`close` (every rank, at the end) tears it
    down.
    """

    def __init__(self, placement: Placement, info: LaunchInfo) -> None:
        use_cuda = {"auto": None, "cpu": False, "cuda": True}[placement.device]
        device = local_device(info, use_cuda=use_cuda)
        model = load_eval_model(placement.checkpoint, placement.tokenizer)
        layout = check_layout(placement, model, info.world_size)
        tokenizer = model.open_tokenizer()
        if tokenizer.vocab_size > model.config.vocab_size:
            raise PlacementError(f"tokenizer {model.tokenizer} has {tokenizer.vocab_size} ids, "
                                 f"more than the model's vocabulary of "
                                 f"{model.config.vocab_size}")
        init_distributed(info, device, timeout=placement.timeout)
        try:
            groups = build_groups(layout.topology, device, timeout=placement.timeout)
            gpt = model.config
            stages = plan_pipeline(layout.pipeline_config(), gpt.n_layers, layout.pp)
            dtype = compute_dtype(placement.precision)
            built = materialize_stage(gpt, stages.stages[groups.pp_rank], groups, layout.tp,
                                      lambda name, _shape: model.weights[name], seed=0,
                                      sequence_parallel=False, device=device)
        except BaseException:
            finalize_distributed(completed=False)
            raise
        built.stage.to(dtype)
        self.placement, self.layout, self.groups, self.model = placement, layout, groups, model
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
    def open_here(cls, placement: Placement) -> ScoringSession:
        """Open on this process as its launcher (torchrun, mpirun, srun) placed it, or as the
        only rank; another format than an mt checkpoint is converted once, in a temporary
        folder, while the weights are read."""
        info = discover(os.environ)
        if info.launcher == "single":
            info = replace(info, master_port=free_port(info.master_addr))
        with as_pretrain_checkpoint(placement.checkpoint, placement.tokenizer) as (path, tok):
            return cls(replace(placement, checkpoint=path, tokenizer=tok,
                               nproc=info.world_size), info)
