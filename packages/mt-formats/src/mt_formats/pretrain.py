"""Reading ``mt pretrain`` checkpoints (model weights only) as a conversion source.

A step folder (or a checkpoints folder whose pointer names one) holds the meta file (model
config, layout {tp, pp, dp}, each parameter's TP styles) and one file per rank; the ranks of
DP replica 0 carry their pipeline stage's fp32 weights, TP-sliced, under ``"model"`` with
full-model names. Each file is checked against the size and CRC-32C ``meta.json`` records,
then opened with ``torch.load(weights_only=True, mmap=True)``, so the optimizer state beside
the weights is never read into memory. The names, the meta file
and which rank file holds what are mt-checkpoint's (:class:`mt_checkpoint.SavedLayout`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mt_checkpoint import (
    LATEST,
    META,
    CheckpointError,
    CheckpointMeta,
    canonical_optimizer,
    rank_file,
    read_meta,
    verify_rank_file,
)
from mt_formats.adam import settings_of
from mt_formats.canonical import (
    CheckpointReader,
    TensorRef,
    TrainingProgress,
    canonical_shapes,
    follow_pointer,
)
from mt_formats.errors import ConvertError
from mt_formats.tensors import TensorSpec
from mt_formats.torch_io import load_weights_only
from mt_model import GPTConfig
from mt_tensor_parallel import decoder_plan, merge_shards, param_styles

__all__ = ["PretrainReader", "StageOptimizer", "is_pretrain_checkpoint", "load_rank_file",
           "step_folder"]

def is_pretrain_checkpoint(path: Path) -> bool:
    """Whether ``path`` is an mt pretrain step folder or a folder with a ``latest`` file."""
    return (path / META).is_file() or (path / LATEST).is_file()


def step_folder(path: Path) -> Path:
    """The step folder ``path`` designates: itself, or the one its ``latest`` names."""
    folder = follow_pointer(path, META, LATEST, "checkpoint")
    if folder is not None:
        return folder
    raise ConvertError(f"{path}: not an mt pretrain checkpoint (neither {META} nor {LATEST})")


def load_rank_file(folder: Path, meta: CheckpointMeta, rank: int) -> Any:
    """Rank ``rank``'s file of the step folder ``folder``, checked against the checksum its
    ``meta.json`` records, then read weights-only and memory-mapped."""
    if not (folder / rank_file(rank)).is_file():
        raise ConvertError(f"{folder / rank_file(rank)}: file not found (incomplete checkpoint)")
    try:
        path = verify_rank_file(folder, rank, meta)
    except CheckpointError as err:
        raise ConvertError(str(err)) from None
    return load_weights_only(path)


def _weights(folder: Path, meta: CheckpointMeta, rank: int) -> dict[str, torch.Tensor]:
    path = folder / rank_file(rank)
    data = load_rank_file(folder, meta, rank)
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or not model:
        raise ConvertError(f"{path}: no model weights (expected a non-empty 'model' dict on "
                           "the ranks of DP replica 0)")
    return model


class PretrainReader(CheckpointReader):
    """Model weights of an ``mt pretrain`` checkpoint of any (TP, PP, DP) layout."""

    format = "pretrain"

    def __init__(self, root: Path) -> None:
        self.root = step_folder(Path(root))
        try:
            self.meta = read_meta(self.root)
        except CheckpointError as err:
            raise ConvertError(str(err)) from None
        try:
            self.config = GPTConfig.from_dict(dict(self.meta.model))
        except (KeyError, TypeError, ValueError) as err:
            raise ConvertError(f"{self.root / META}: bad model: {err!r}") from None
        self.layout = self.meta.layout
        self.tp, self.pp = self.layout.tp, self.layout.pp
        data = self.meta.config.get("data") or {}
        self.tokenizer = self.meta.tokenizer or data.get("tokenizer")
        self._shapes = canonical_shapes(self.config)
        self._styles = {**param_styles(self._shapes, decoder_plan(self.config, self.tp)),
                        **self.meta.styles}
        self.styles = dict(self._styles)
        """TP slicing style of every tensor."""
        self._files = {(s, t): self.layout.file(s, 0, t)  # DP replica 0 holds the weights
                       for s in range(self.pp) for t in range(self.tp)}
        self._parts = {(s, t): _weights(self.root, self.meta, self.layout.rank(s, 0, t))
                       for s, t in self._files}
        self._stages: dict[str, list[int]] = {name: [] for name in self._shapes}
        for (stage, rank), part in self._parts.items():
            extra = sorted(set(part) - set(self._shapes))
            if extra:
                raise ConvertError(f"{self.root / self._files[(stage, rank)]}: unexpected "
                                   f"tensors {extra}")
            if rank == 0:
                for name in part:
                    self._stages[name].append(stage)
        missing = sorted(name for name, stages in self._stages.items() if not stages)
        if missing:
            raise ConvertError(f"{self.root}: no rank holds {missing}")
        self._optimizer: StageOptimizer | None = None  # on first use

    def names(self) -> list[str]:
        return list(self._shapes)

    def spec(self, name: str) -> TensorSpec:
        stage = self._stages[name][0]
        return TensorSpec(self._shapes[name], self._parts[(stage, 0)][name].dtype)

    def sources(self, name: str) -> list[TensorRef]:
        return [TensorRef(self._files[(s, t)], f"model/{name}",
                          TensorSpec.of(self._parts[(s, t)][name]),
                          f"pp {s}/{self.pp} tp {t}/{self.tp} {self._styles[name]}")
                for s in self._stages[name] for t in range(self.tp)]

    def _shards(self, name: str, stage: int) -> list[torch.Tensor]:
        shards = []
        for rank in range(self.tp):
            part = self._parts[(stage, rank)]
            if name not in part:
                raise ConvertError(f"{self.root / self._files[(stage, rank)]}: lacks {name!r}, "
                                   "which tp rank 0 of the same stage holds")
            shards.append(part[name])
        return shards

    def read(self, name: str) -> torch.Tensor:
        first, *others = self._stages[name]
        shards = self._shards(name, first)
        for stage in others:  # the tied embedding's copy on the last stage
            for rank, shard in enumerate(self._shards(name, stage)):
                if not torch.equal(shard, shards[rank]):
                    raise ConvertError(f"{self.root / self._files[(stage, rank)]}: copy of "
                                       f"{name!r} differs from pipeline stage {first}'s")
        style = self._styles[name]
        full = merge_shards(style, shards, vocab_size=self.config.vocab_size
                            if style == "vocab" else None)
        if tuple(full.shape) != self._shapes[name]:
            raise ConvertError(f"{self.root}: tensor {name!r} merges to {list(full.shape)}, "
                               f"the model config needs {list(self._shapes[name])}")
        return full

    def optimizer_state(self, name: str) -> dict[str, torch.Tensor] | None:
        """Adam's state of ``name`` from the ranks' mt-zero shards, consolidated over DP and
        merged over TP one pipeline stage at a time (the stage last asked for is kept, as
        the names come in stage order); None for a checkpoint whose optimizer has not
        stepped (written with --drop-optimizer, or from weights only)."""
        if self._optimizer is None:
            self._optimizer = StageOptimizer(self)
        state, _ = self._optimizer.state_of(name)
        moments = state["sharded"].get(name) or {}
        if "exp_avg" not in moments:
            return None
        return {"exp_avg": moments["exp_avg"], "exp_avg_sq": moments["exp_avg_sq"],
                "step": torch.as_tensor(state["replicated"][name]["step"])}

    def optimizer_settings(self, name: str) -> dict[str, Any] | None:
        """The hyperparameters of ``name``'s param group in the ranks' mt-zero shards (the
        learning rate of the last step, betas, eps, weight decay, and ``initial_lr`` where
        a conversion put it there) and otherwise, as ``initial_lr``, the run's peak learning
        rate (``train.lr`` of the run's config, which its schedule scales); None for a
        checkpoint whose optimizer has not stepped."""
        if self.optimizer_state(name) is None:
            return None
        assert self._optimizer is not None  # made by optimizer_state
        state, _ = self._optimizer.state_of(name)
        where = f"{self.root}: optimizer param groups"
        try:
            group = state["param_groups"][state["group_of"][name]]
        except (KeyError, IndexError, TypeError):
            raise ConvertError(f"{where}: none holds parameter {name!r}") from None
        settings = settings_of(group, where)
        peak = (self.meta.config.get("train") or {}).get("lr")
        if isinstance(peak, (int, float)) and not isinstance(peak, bool) and \
                "initial_lr" not in settings:
            settings["initial_lr"] = float(peak)
        return settings

    def progress(self) -> TrainingProgress:
        """The step and the tokens seen that ``meta.json`` records."""
        return TrainingProgress(self.meta.step, self.meta.tokens)

    def close(self) -> None:
        self._parts.clear()
        self._optimizer = None


SHARD_FORMAT = "mt-zero-shard/1"  # what a rank file's optimizer entry must be


class StageOptimizer:
    """The source checkpoint's optimizer state, consolidated one pipeline stage at a time
    (the last stage is cached: target stages walk the layers in order)."""

    def __init__(self, reader: PretrainReader) -> None:
        self.reader, self.root, self.meta = reader, reader.root, reader.meta
        self.layout = reader.meta.layout
        self.tp, self.pp, self.dp = self.layout.tp, self.layout.pp, self.layout.dp
        self.styles: dict[str, str] = dict(reader.styles)
        self.vocab = reader.config.vocab_size
        self.stage_names = {s: list(v) for s, v in reader.meta.stage_params.items()}
        self._cached: tuple[int, dict[str, Any]] | None = None

    def _shards(self, stage: int, tp_rank: int) -> list[dict[str, Any]]:
        shards = []
        for rank in self.layout.replicas(stage, tp_rank):  # ZeRO shard order (dp x cp)
            path = self.root / rank_file(rank)
            data = load_rank_file(self.root, self.meta, rank)
            state = data.get("optimizer") if isinstance(data, dict) else None
            if not isinstance(state, dict) or state.get("format") != SHARD_FORMAT:
                raise ConvertError(f"{path}: no {SHARD_FORMAT!r} optimizer shard")
            shards.append(state)
        return shards

    def stage(self, stage: int) -> dict[str, Any]:
        """Canonical (unsharded) optimizer state of every parameter of source ``stage``."""
        if self._cached is not None and self._cached[0] == stage:
            return self._cached[1]
        self._cached = None  # free the previous stage first
        try:
            out = canonical_optimizer([self._shards(stage, t) for t in range(self.tp)],
                                      self.stage_names[stage], self.styles, self.vocab)
        except ValueError as err:
            raise ConvertError(f"{self.root}: optimizer shards of pipeline stage {stage}: "
                               f"{err}") from None
        self._cached = (stage, out)
        return out

    def state_of(self, name: str) -> tuple[dict[str, Any], int]:
        """(canonical state of the stage holding ``name``, that stage)."""
        for stage, names in sorted(self.stage_names.items()):
            if name in names:
                return self.stage(stage), stage
        raise ConvertError(f"{self.root / META}: no pipeline stage lists parameter {name!r}")
