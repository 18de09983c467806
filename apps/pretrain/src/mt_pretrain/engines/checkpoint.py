"""mt's engine's checkpoints: one file per rank, written atomically, resumable at any layout.

The format (names, ``meta.json``, rank order, the publish protocol, weights-only reading)
and the resharding maths are mt-checkpoint's; this module fills the rank files (weights of
DP replica 0, ZeRO optimizer shards, RNG states) and loads them into a run of any layout.
Ranks write into ``.step-XXXXXXXX.tmp``, which rank 0 publishes once every rank has finished
(:func:`mt_checkpoint.publish_step`).
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mt_checkpoint import (
    DATA_ORDER,
    BackgroundWrite,
    Built,
    CheckpointError,
    CheckpointMeta,
    HostBuffers,
    SavedLayout,
    Snapshot,
    canonical_optimizer,
    clean_stale,
    find_checkpoint,
    load_rank,
    local_optimizer,
    publish_step,
    rank_payload,
    read_meta,
    save_payload,
    save_rank,
    step_dir,
    to_host,
    unfinished_step,
    wait_for_ranks,
)
from mt_data import DataLoaderState
from mt_dist import ParallelGroups
from mt_dist.failpoints import failpoint
from mt_model import GPTConfig, parameter_stages
from mt_pretrain.config.resolve import RunPlan
from mt_pretrain.config.schema import ConfigError, PretrainConfig, TrainArgs
from mt_pretrain.data.inputs import run_tokenizer
from mt_zero import ZeroOptimizer, consolidate, load_consolidated, optimizer_shard_state

__all__ = ["CheckpointError", "Checkpointer", "find_checkpoint", "load"]

# Fields that may differ between the saved and the resuming model (regularisation only).
_MAY_DIFFER = {"dropout", "attention_dropout"}


def _barrier(groups: ParallelGroups) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_stage_names(plan: RunPlan, full_names: list[str]) -> dict[int, list[str]]:
    """Parameter names of every pipeline stage of ``plan``."""
    layers = [sp.layers for sp in plan.stages.stages]
    tied = plan.model.tied_embeddings
    return {s: [n for n in full_names if s in parameter_stages(n, layers, tied)]
            for s in range(len(layers))}


class Checkpointer:
    """Writes the checkpoints of one run (every rank calls :meth:`save` together).

    A save in the background (``--async-save``) takes the collective part (the full weights
    gathered over data parallelism) on the training thread, and a copy of the rank's state
    into host memory (:class:`mt_checkpoint.HostBuffers`, allocated at the first save and
    reused) made by a thread during the next step's forward and backward: :meth:`settle`,
    called before the optimizer changes the state, waits for it. The rank's writer process
    then writes the rank file, and rank 0's publishes the step once every rank's file is
    written (:func:`mt_checkpoint.wait_for_ranks`: no collective beside training's). A save
    waits for the one before it; a step whose write did not finish (a crash, a kill) is
    never published, and the previous one stays the newest.
    """

    def __init__(self, root: Path, keep_last: int, config: PretrainConfig, plan: RunPlan,
                 groups: ParallelGroups, built: Built, optimizer: ZeroOptimizer) -> None:
        self.root, self.keep_last = root, keep_last
        self.config, self.plan, self.groups, self.built = config, plan, groups, built
        self.optimizer = optimizer
        self.last_saved: Path | None = None
        self.last_step: int | None = None
        self.writer = BackgroundWrite()
        self.buffers = HostBuffers(rank=groups.rank)
        # A background save's snapshot being copied, and what hands it to the writer.
        self._copying: tuple[Snapshot, Callable[[dict[str, Any]], None]] | None = None

    @property
    def longest_write(self) -> float:
        """Seconds the longest background write took (what waiting for one costs)."""
        return self.writer.longest

    def settle(self) -> None:
        """Before the live state changes (the optimizer's next update): wait for the
        snapshot's copies, if any, and hand the snapshot to the writer."""
        if self._copying is None:
            return
        snapshot, hand_over = self._copying
        self._copying = None
        hand_over(snapshot.result())

    def wait(self) -> None:
        """Until the background write, if any, is published here (rank 0) or written."""
        self.settle()
        self.writer.wait()

    def close(self) -> None:
        """Wait for the background write, then end the writer process."""
        self.settle()
        self.writer.close()

    def save(self, step: int, data_state: DataLoaderState, background: bool = False) -> Path:
        """Write the checkpoint of ``step`` (collective); returns its folder. With
        ``background`` the files are written (and the step published) by the writer process,
        and training goes on."""
        self.wait()
        groups, opt = self.groups, self.optimizer
        tmp = self.root / f".{step_dir(step)}.tmp"
        if groups.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if self.last_step is None:
                clean_stale(self.root)  # what a killed save left behind (never loaded)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _barrier(groups)
        weights = opt.full_parameters()  # collective over DP; also works for ZeRO-3
        rng = {"torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state() if groups.device.type == "cuda" else None,
               "tracker": self.built.tracker.state_dict() if self.built.tracker else {}}
        state = (weights if groups.grad_rank == 0 else {}, optimizer_shard_state(opt), rng)
        coord = groups.coord if groups.cp_size > 1 else groups.coord[:3]  # (pp, dp, tp[, cp])
        meta = self._meta(step, data_state) if groups.rank == 0 else None
        final = self.root / step_dir(step)
        if background:
            # The payload as the foreground would pickle it, its tensors being copied: the
            # writer gets it at settle(), before training changes the live state.
            def hand_over(payload: dict[str, Any]) -> None:
                self.writer.start(write_in_background, tmp, groups.rank, payload, meta,
                                  self.plan.topology.world_size, self.config.parallel.timeout,
                                  self.root, self.keep_last)

            self._copying = (self.buffers.start(rank_payload(groups.rank, coord, *state)),
                             hand_over)
        else:
            save_rank(tmp, groups.rank, coord, *to_host(state))
            failpoint("checkpoint.write", groups.rank)
            _barrier(groups)
            if meta is not None:
                self._publish(tmp, meta)
            _barrier(groups)
        self.last_saved, self.last_step = final, step
        return final

    def _publish(self, tmp: Path, meta: CheckpointMeta) -> None:
        _publish(self.root, tmp, meta, self.keep_last)

    def _meta(self, step: int, data_state: DataLoaderState) -> CheckpointMeta:
        tokenizer, fingerprint = run_tokenizer(self.config.data, self.plan.gpt.vocab_size)
        return CheckpointMeta(
            step=step, layout=SavedLayout.of(self.plan.layout), model=self.plan.model.to_dict(),
            styles=self.built.styles,
            stage_params=all_stage_names(self.plan, list(self.built.full_shapes)),
            consumed_samples=data_state.consumed_samples, data_step=data_state.step,
            tokens=data_state.consumed_samples * self.plan.gpt.seq_len,
            config=self.config.to_dict(),
            tokenizer=tokenizer, tokenizer_sha256=fingerprint)


def write_in_background(tmp: Path, rank: int, payload: dict[str, Any],
                        meta: CheckpointMeta | None, world_size: int, timeout: float,
                        root: Path, keep_last: int) -> None:
    """The background part of a save, in the rank's writer process: this rank's file; on
    rank 0 (``meta``), the publication once every rank's file is written."""
    failpoint("checkpoint.background", rank)
    save_payload(tmp, rank, payload)
    failpoint("checkpoint.write", rank)
    if meta is not None:
        wait_for_ranks(tmp, world_size, timeout)
        _publish(root, tmp, meta, keep_last)


def _publish(root: Path, tmp: Path, meta: CheckpointMeta, keep_last: int) -> None:
    publish_step(root, tmp, meta, keep_last,
                 phase=lambda name: failpoint(f"checkpoint.{name}", 0))


def _check_model(meta: CheckpointMeta, plan: RunPlan) -> None:
    # Through GPTConfig: fields newer than the checkpoint take their defaults.
    saved, mine = GPTConfig.from_dict(meta.model).to_dict(), plan.model.to_dict()
    diff = {k: (saved.get(k), mine.get(k)) for k in set(saved) | set(mine)
            if k not in _MAY_DIFFER and saved.get(k) != mine.get(k)}
    if diff:
        raise ConfigError(f"checkpoint model differs from the configured one "
                          f"(field: (saved, configured)): {dict(sorted(diff.items()))}")


def _optimizer_state(folder: Path, meta: CheckpointMeta, plan: RunPlan,
                     groups: ParallelGroups, names: list[str], styles: dict[str, str]
                     ) -> dict[str, Any]:
    """This rank's ``mt-zero-full/1`` optimizer state from a checkpoint of any layout."""
    old, old_stages = meta.layout, meta.stage_params
    if old.tp == plan.topology.tp and set(old_stages.get(groups.pp_rank, ())) == set(names):
        # Same slicing and stage: only the DP shards of this (pp, tp) need consolidating.
        shards = [load_rank(folder, r)["optimizer"]
                  for r in old.replicas(groups.pp_rank, groups.tp_rank)]
        return consolidate(shards)
    wanted = set(names)
    merged: dict[str, Any] = {"master": {}, "sharded": {}, "replicated": {}, "group_of": {}}
    for stage, stage_names in sorted(old_stages.items()):
        if not wanted & set(stage_names):
            continue
        by_tp = [[load_rank(folder, r)["optimizer"] for r in old.replicas(stage, t)]
                 for t in range(old.tp)]
        # Shards are merged as they were cut (the saved styles: a grouped-query key/value
        # projection is split or replicated depending on tp) and cut as this run needs.
        part = canonical_optimizer(by_tp, wanted & set(stage_names),
                                   {**styles, **meta.styles}, plan.gpt.vocab_size)
        for key in ("master", "sharded", "replicated", "group_of"):
            merged[key].update(part[key])
        for key in ("param_groups", "scaler"):
            merged.setdefault(key, part[key])
    return local_optimizer(merged, names, styles, groups.tp_rank, plan.topology.tp)


def load(path: str | Path, train: TrainArgs, plan: RunPlan, groups: ParallelGroups,
         built: Built, optimizer: ZeroOptimizer) -> tuple[int, DataLoaderState]:
    """Resume from a checkpoint (any layout): optimizer + weights, RNG, data position.

    Returns (step, data-loader state). The run's hyperparameters (weight decay, betas, eps)
    come from ``train``, not from the checkpoint.
    """
    folder = find_checkpoint(path)
    meta = read_meta(folder)
    unfinished = unfinished_step(Path(path))
    if groups.rank == 0 and unfinished is not None and unfinished > meta.step:
        warnings.warn(f"{path}: the save of step {unfinished} did not finish (the run stopped "
                      f"during its write); resuming from step {meta.step}, the newest "
                      "complete checkpoint", stacklevel=2)
    _check_model(meta, plan)
    names = [n for n, p in built.stage.named_parameters() if p.requires_grad]
    state = _optimizer_state(folder, meta, plan, groups, names, built.styles)
    load_consolidated(optimizer, state)
    for index, group in enumerate(optimizer.optimizer.param_groups):
        group["weight_decay"] = train.weight_decay if index == 0 else 0.0
        group["betas"] = (train.adam_beta1, train.adam_beta2)
        group["eps"] = train.adam_eps
    saved, topo = meta.layout, plan.topology
    same_world = (saved.tp, saved.pp, saved.dp, saved.cp) == (topo.tp, topo.pp, topo.dp, topo.cp)
    if same_world:
        rng = load_rank(folder, groups.rank)["rng"]
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and groups.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"])
        if built.tracker is not None and rng["tracker"]:
            built.tracker.load_state_dict(rng["tracker"])
    elif groups.rank == 0 and built.stage.rng is None and plan.gpt.dropout > 0:
        # Keyed dropout (mt_tensor_parallel.KeyedRNG) needs no saved streams; a compiled
        # forward draws from generators a new layout cannot take over.
        warnings.warn("resuming a compiled run at another layout: dropout RNG streams "
                      "restart", stacklevel=2)
    consumed = meta.consumed_samples
    if groups.rank == 0 and consumed and meta.data_order != DATA_ORDER:
        warnings.warn(f"{folder} was written before mt's sample order stopped depending on "
                      f"the run's length: training continues after sample "
                      f"{consumed:,} of the new order, so the samples "
                      "it sees next are not those the old run would have seen", stacklevel=2)
    return meta.step, DataLoaderState.from_dict(meta.data)
