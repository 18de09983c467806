"""``mt pretrain`` checkpoint -> ``mt pretrain`` checkpoint at another (TP, PP, DP, ZeRO)
layout, optimizer state included.

The source's AdamW state is rebuilt per parameter: each pipeline stage's ZeRO shards (one
per DP rank, each piece with its parameter name, offset and length, see
``mt_zero.optimizer_shard_state``) go through ``mt_checkpoint.canonical_optimizer``
(``mt_zero.consolidate``, then the TP slices merged, padding rows dropped). The canonical
fp32 master weights, ``exp_avg`` / ``exp_avg_sq`` and the replicated ``step`` are then cut
again for every target TP rank (``mt_checkpoint.local_optimizer``) and split over the target
DP ranks (``mt_zero.split_consolidated``: ZeRO stage >= 1 partitions a flat buffer, stage 0
keeps everything on every DP rank). Each target rank file is ``mt pretrain``'s: ``format``,
``rank``, ``coord``, ``model`` (DP rank 0 only: the weights, in the source's dtype),
``optimizer`` (``mt-zero-shard/1``) and ``rng`` (``mt_checkpoint.save_rank``). ``meta.json``
is the source's moved to the new layout (``CheckpointMeta.relaid``), with the ``stage_params``
of a uniform partition (as ``mt pretrain`` makes).

``drop_optimizer`` writes the master weights with empty optimizer state: the run resumes
with fresh Adam moments and step counts. RNG: an unchanged layout copies every rank's
states; any other layout gets freshly seeded default generators (``mt_checkpoint.fresh_rng``:
the rank seed ``mt pretrain`` uses) and no tensor-parallel tracker state, so dropout streams
restart, as when ``mt pretrain`` itself resumes at another layout.

Memory: a rank file is one ``torch.save`` (it needs its whole content), so this path holds
one source stage's consolidated optimizer state plus one target rank's payload, not one
layer. Files are read with ``torch.load(weights_only=True, mmap=True)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mt_checkpoint import (
    SavedLayout,
    cut,
    fresh_rng,
    local_optimizer,
    rank_file,
    save_rank,
    write_meta,
)
from mt_formats.atomic import atomic_directory
from mt_formats.canonical import ProgressFn, canonical_shapes
from mt_formats.errors import ConvertError, WriteFailed
from mt_formats.pretrain import PretrainReader, StageOptimizer, load_rank_file
from mt_formats.sharded import _check_tp, stage_layers, stages_of
from mt_tensor_parallel import decoder_plan, param_styles
from mt_zero import split_consolidated

__all__ = ["PretrainTarget", "convert_pretrain", "describe_pretrain"]



@dataclass(frozen=True)
class PretrainTarget:
    """Target layout of a pretrain -> pretrain conversion (None: keep the source's)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    zero_stage: int | None = None
    drop_optimizer: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConvertError(f"--{name} must be >= 1, got {value}")
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            raise ConvertError(f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage}")


def _rng(source: StageOptimizer, same: bool, rank: int, pp: int, dp: int) -> dict[str, Any]:
    """The rank's saved RNG states when the layout is unchanged, else fresh ones."""
    if same:
        return load_rank_file(source.root, source.meta, rank)["rng"]
    return fresh_rng(source.meta.seed, pp, dp)


def _stage_state(source: StageOptimizer, names: Sequence[str], drop: bool) -> dict[str, Any]:
    """The canonical (unsharded) optimizer state of one target stage's parameters, gathered
    from the source stages holding them (``mt_checkpoint.canonical_optimizer``'s form);
    ``drop``: the master weights only (fresh Adam moments and step counts)."""
    out: dict[str, Any] = {"master": {}, "sharded": {}, "replicated": {}, "group_of": {}}
    for name in names:
        state, _ = source.state_of(name)
        if name not in state["master"]:
            raise ConvertError(f"{source.root}: the optimizer shards lack parameter {name!r}")
        out.setdefault("param_groups", state["param_groups"])
        out.setdefault("scaler", state["scaler"])
        out["master"][name] = state["master"][name]
        out["group_of"][name] = state["group_of"][name]
        out["sharded"][name] = {} if drop else state["sharded"][name]
        out["replicated"][name] = {} if drop else state["replicated"][name]
    return out


def _write_stage(source: StageOptimizer, staging: Path, stage: int, names: list[str],
                 target: SavedLayout, drop: bool, same: bool) -> int:
    """Write every rank file of target pipeline ``stage``; returns the bytes written."""
    canonical = _stage_state(source, names, drop)
    fulls = {n: source.reader.read(n) for n in names}  # model weights, the source's dtype
    # Cut as the target's TP degree slices each tensor (grouped-query key/value heads are
    # split or replicated depending on it); the source was merged by its saved styles.
    styles = {**source.styles, **param_styles(names, decoder_plan(source.reader.config,
                                                                   target.tp))}
    written = 0
    for tp_rank in range(target.tp):
        local = local_optimizer(canonical, names, styles, tp_rank, target.tp)
        weights = {n: cut(styles[n], fulls[n], tp_rank, target.tp) for n in names}
        shards = split_consolidated(local, target.dp, target.zero_stage)
        for dp_rank, shard in enumerate(shards):
            rank = target.rank(stage, dp_rank, tp_rank)
            written += save_rank(staging, rank, (stage, dp_rank, tp_rank),
                                 weights if dp_rank == 0 else {}, shard,
                                 _rng(source, same, rank, stage, dp_rank))
    return written


def _target(src: StageOptimizer, target: PretrainTarget) -> SavedLayout:
    zero = src.layout.zero_stage if target.zero_stage is None else target.zero_stage
    return SavedLayout(target.tp or src.tp, target.pp or src.pp, target.dp or src.dp,
                       zero_stage=zero, precision=src.layout.precision)


def convert_pretrain(source: Path, destination: Path, target: PretrainTarget,
                     overwrite: bool = False, progress: ProgressFn | None = None
                     ) -> tuple[str, int, int]:
    """Write the ``mt pretrain`` checkpoint ``source`` (a step folder or a folder with
    ``latest``) as a step folder ``destination`` at the ``target`` layout, atomically.
    Returns (source format, parameters, bytes written)."""
    with PretrainReader(Path(source)) as reader:
        src = StageOptimizer(reader)
        new = _target(src, target)
        ranges = stage_layers(reader.config.n_layers, new.pp)
        names = [n for n in canonical_shapes(reader.config) if n in src.styles]
        tied = reader.config.tied_embeddings
        stage_names = {s: [n for n in names if s in stages_of(n, ranges, tied)]
                       for s in range(new.pp)}
        _check_tp(reader.config, new.tp)
        same = (new.tp, new.pp, new.dp, new.cp) == (src.tp, src.pp, src.dp, src.layout.cp)
        written = 0
        try:
            with atomic_directory(Path(destination), overwrite) as staging:
                for stage, stage_list in stage_names.items():
                    written += _write_stage(src, staging, stage, stage_list, new,
                                            target.drop_optimizer, same)
                    if progress is not None:
                        progress(f"pipeline stage {stage}", stage + 1, new.pp)
                write_meta(staging, src.meta.relaid(new, stage_names))
        except OSError as err:
            raise WriteFailed(f"{destination}: writing failed, nothing was written: "
                               f"{err}") from err
        return reader.format, len(names), written


def describe_pretrain(source: Path, target: PretrainTarget) -> list[str]:
    """What :func:`convert_pretrain` would write (for ``--dry-run``): one line per target
    rank file with the source rank files its pipeline stage reads."""
    with PretrainReader(Path(source)) as reader:
        src = StageOptimizer(reader)
        new = _target(src, target)
        tp, pp, dp, zero = new.tp, new.pp, new.dp, new.zero_stage
        ranges = stage_layers(reader.config.n_layers, pp)
        names = list(canonical_shapes(reader.config))
        state = "dropped (fresh AdamW)" if target.drop_optimizer else "carried"
        lines = [f"{reader.root} (pretrain {src.tp}x{src.pp}x{src.dp}, ZeRO "
                 f"{src.layout.zero_stage}) -> pretrain {tp}x{pp}x{dp}, ZeRO "
                 f"{zero}, optimizer state {state} (dry run: nothing written)"]
        for stage in range(pp):
            mine = {n for n in names if stage in stages_of(n, ranges,
                                                         reader.config.tied_embeddings)}
            old = sorted(s for s, ns in src.stage_names.items() if mine & set(ns))
            files = [rank_file(r) for s in old for t in range(src.tp)
                     for r in src.layout.replicas(s, t)]
            for d in range(dp):
                for t in range(tp):
                    lines.append(f"{new.file(stage, d, t)} (pp {stage}, dp "
                                 f"{d}, tp {t}): layers {ranges[stage][0]}-"
                                 f"{ranges[stage][1] - 1} <- {', '.join(files)}")
        return lines
