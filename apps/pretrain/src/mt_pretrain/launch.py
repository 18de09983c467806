"""Start the ranks of a run: under a launcher, or N local processes (``--nproc``).

Under torchrun, mpirun/mpiexec (mpi4py) or SLURM srun, this process is one rank: its place
comes from ``mt_dist.discover(os.environ)``. Otherwise ``--nproc N`` forks N local ranks
joined by gloo over a free TCP port on 127.0.0.1 (mt-dist's ``supervise``);
the parent prepares the data once, waits, forwards SIGTERM / SIGINT (the ranks save a
checkpoint and stop), and if a rank fails it stops the others and reports the root cause, or
with ``--max-restarts N`` starts the ranks again from the newest complete checkpoint (at most
N times). A job its launcher restarted (torchrun's ``--max-restarts``, a requeued SLURM job)
resumes from its ``--save`` folder by itself. This module and the CLI are the only places
that read ``os.environ``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from mt_checkpoint import sharding_styles
from mt_data.tokenizer import TokenizerError
from mt_dist import LaunchInfo, discover, free_port
from mt_dist.restarts import Restart, launcher_restart, supervise_restarting
from mt_eval import TaskError
from mt_pretrain.config.refusals import engine_of
from mt_pretrain.config.resolve import check_memory, elastic_world, resolve
from mt_pretrain.config.schema import ConfigError, PretrainConfig
from mt_pretrain.data.inputs import check_vocab, default_cache_dir, ensure_data
from mt_pretrain.engines.checkpoint import CheckpointError
from mt_pretrain.run.folder import claim_run_folder, run_folder_lock
from mt_pretrain.run.rank import RankOutOfMemory, RunSummary, run_rank
from mt_pretrain.run.train import NonFiniteLossError
from mt_pretrain.run.warnings_line import one_line_warnings

__all__ = ["EXPECTED", "launch", "spawn"]

#: Failures every rank meets alike (bad config, damaged checkpoint, bad data or tokenizer),
#: and a rank's failed allocation: re-raised in the parent as they are, one line, no
#: traceback (mt-dist's supervise).
EXPECTED = (ConfigError, CheckpointError, NonFiniteLossError, TaskError, TokenizerError,
            RankOutOfMemory)


def launch(config: PretrainConfig, environ: Mapping[str, str] | None = None,
           timeout: float | None = None, keep_weights: bool = False) -> RunSummary | None:
    """Run ``config``: as one rank under a launcher, else on ``--nproc`` local processes.

    Returns rank 0's summary (None on other ranks under a launcher); ``keep_weights`` puts
    the final full fp32 weights into it (for comparisons such as ``mt matrix``).
    """
    environ = os.environ if environ is None else environ
    cache = Path(config.data.cache_dir) if config.data.cache_dir else default_cache_dir(environ)
    info = discover(environ)
    if info.launcher != "single":
        config, restart = _after_launcher_restart(config, info.launcher, environ)
        return run_rank(config, info, cache, keep_weights, restart)
    nproc = config.world_size_hint()
    plan = resolve(config, nproc)  # fail before starting anything
    device = config.parallel.device
    if device == "cpu" or (device == "auto" and not torch.backends.cuda.is_built()):
        # A GPU's (or "auto" with a CUDA build) is checked by its rank: no CUDA call here,
        # which would keep forked ranks from using CUDA.
        check_memory(plan, "cpu", nproc)
    ckpt = config.checkpoint
    with run_folder_lock(ckpt.save_dir or ckpt.out_dir):  # no --overwrite of a running run
        claim_run_folder(ckpt, config.metrics_path)
    # Once, here, not racing per rank.
    check_vocab(plan, ensure_data(config.data, plan.gpt.vocab_size, cache))
    # Building a meta GPT imports torch's Python reference ops (seconds); do it once before
    # forking so that every rank inherits them.
    sharding_styles(plan.model, plan.topology.tp)
    if nproc == 1 and not ckpt.max_restarts:
        single = LaunchInfo(0, 1, 0, 1, "127.0.0.1", free_port("127.0.0.1"), "single")
        return run_rank(config, single, cache, keep_weights)
    engine_of(config).load().preload(config)  # likewise, the engine's own imports
    return spawn(config, nproc, cache, timeout, keep_weights)


def _rank(rank: int, config: PretrainConfig, nproc: int, port: int, cache: Path,
          threads: int, keep_weights: bool, restart: Restart | None) -> RunSummary | None:
    torch.set_num_threads(threads)
    one_line_warnings()  # a spawned rank speaks as the command does
    if restart is not None and restart.slots:  # elastic: the GPUs of the ranks left
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(restart.started)]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[s] for s in restart.slots
                                                      if s < len(gpus))
    info = LaunchInfo(rank, nproc, rank, nproc, "127.0.0.1", port, "single")
    return run_rank(config, info, cache, keep_weights, restart)


def spawn(config: PretrainConfig, nproc: int, cache: Path, timeout: float | None = None,
          keep_weights: bool = False) -> RunSummary | None:
    """Run ``nproc`` local ranks (forked when possible: no second torch import); a failed
    run starts again from its newest checkpoint, ``--max-restarts`` times at most (with
    ``--min-nproc``, without the ranks that failed)."""

    def args(restart: Restart | None) -> tuple[Any, ...]:
        size = len(restart.slots) if restart is not None and restart.slots else nproc
        run = config
        if restart is not None:
            run = replace(config, checkpoint=config.checkpoint.resuming_own(),
                          parallel=replace(config.parallel, nproc=size))
        threads = max(1, (os.cpu_count() or 1) // size)
        return run, size, free_port("127.0.0.1"), cache, threads, keep_weights, restart

    ckpt = config.checkpoint
    elastic = None
    if config.parallel.min_nproc is not None:
        def elastic(left: int) -> int | None:
            return elastic_world(config, left)
    return supervise_restarting(_rank, nproc, args, ckpt.max_restarts, Path(ckpt.out_dir),
                                timeout, expected=EXPECTED, elastic=elastic)


def _after_launcher_restart(config: PretrainConfig, launcher: str, environ: Mapping[str, str]
                            ) -> tuple[PretrainConfig, Restart | None]:
    """Under a launcher: --max-restarts is the launcher's to do; a process it restarted
    continues the run from its --save folder (unless --load says where)."""
    ckpt = config.checkpoint
    if ckpt.max_restarts:
        elastic = " and --min-nproc" if config.parallel.min_nproc is not None else ""
        raise ConfigError(f"--max-restarts{elastic} restart the ranks of --nproc runs; under "
                          f"{launcher} the launcher restarts them (torchrun --max-restarts N, "
                          "elastic with --nnodes MIN:MAX; a requeued SLURM job): leave them "
                          "out, a restarted job resumes from --save by itself, at the world "
                          "size it is given")
    restart = launcher_restart(environ)
    if restart is None or ckpt.load is not None or ckpt.save_dir is None:
        return config, None
    return replace(config, checkpoint=ckpt.resuming_own()), restart
