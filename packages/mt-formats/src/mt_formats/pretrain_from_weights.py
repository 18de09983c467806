"""``--to pretrain`` from weights only (hf, consolidated, tp, megatron, deepspeed sources): a
fresh ``mt pretrain`` checkpoint that ``mt pretrain --load`` starts from. (From an ``mt
pretrain`` source, :mod:`mt_formats.pretrain_relayout` reshards it, optimizer state
included.)

The destination is one step folder of the simplest layout (tp = pp = dp = 1, ZeRO 0): the
meta file and one rank file (mt-checkpoint's names). ``mt pretrain --load`` reshards
it to the run's own (TP, PP, DP, ZeRO) layout, so one file serves every layout. The rank
file holds the fp32 weights under ``"model"`` (what
:class:`~mt_formats.pretrain.PretrainReader` reads) and, under ``"optimizer"``, the same
weights as a one-rank mt-zero optimizer shard of an AdamW that has not stepped
(``mt_zero.initial_state``: fp32 masters, no Adam moments yet, as for a new run), or,
when the source holds Adam's state (a DeepSpeed universal checkpoint, a torchtitan DCP
folder), its ``exp_avg``, ``exp_avg_sq`` and ``step`` per parameter, and the source's
settings (:data:`mt_formats.adam.SETTINGS`) in the param groups of the matrices and of the
rest (``mt pretrain --load`` sets the run's own before its first step). With Adam's state
comes the step the source's training had reached, and the tokens it had seen, where it
records them (:meth:`~mt_formats.canonical.CheckpointReader.progress`): the run continues
its learning-rate schedule from there. Otherwise the step is 0. The data position is 0
either way: training starts at the beginning of the run's own data.

``torch.save`` needs the whole file, so the writer buffers the tensors until
:meth:`~PretrainWriter.finish`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mt_checkpoint import (
    CheckpointMeta,
    SavedLayout,
    fresh_rng,
    rank_file,
    save_rank,
    write_meta,
)
from mt_formats.adam import by_role
from mt_formats.canonical import CheckpointWriter, TensorRef, TrainingProgress
from mt_formats.errors import ConvertError
from mt_formats.tensors import TensorSpec
from mt_model import GPTConfig
from mt_tensor_parallel import decoder_plan, param_styles
from mt_zero import initial_state, split_consolidated

__all__ = ["PretrainWriter"]

RANK_FILE = rank_file(0)  # the one rank of the tp = pp = dp = 1 step folder


class PretrainWriter(CheckpointWriter):
    """An ``mt pretrain`` step folder (tp = pp = dp = 1) from canonical tensors."""

    format = "pretrain"

    def __init__(self, config: GPTConfig, specs: dict[str, TensorSpec]) -> None:
        super().__init__(config, specs)
        self._directory: Path | None = None
        self._tensors: dict[str, torch.Tensor] = {}

    holds_optimizer_state = True  # in the rank file's mt-zero shard

    def targets(self, name: str) -> list[TensorRef]:
        spec = TensorSpec(self.specs[name].shape, torch.float32)
        return [TensorRef(RANK_FILE, f"model/{name}", spec),
                TensorRef(RANK_FILE, f"optimizer/master/{name}", spec, "flattened")]

    def open(self, directory: Path) -> None:
        self._directory = Path(directory)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.specs:
            raise ConvertError(f"{RANK_FILE}: unexpected tensor {name!r}")
        self._tensors[name] = tensor.detach().to(torch.float32).contiguous().clone()

    def finish(self) -> None:
        if self._directory is None:
            raise ConvertError("PretrainWriter.finish() before open()")
        missing = [name for name in self.specs if name not in self._tensors]
        if missing:
            raise ConvertError(f"{self._directory / RANK_FILE}: tensors never written: "
                               f"{missing}")
        shapes = {name: tuple(spec.shape) for name, spec in self.specs.items()}
        weights = {name: self._tensors[name] for name in self.specs}
        states = {name: self.state_source.optimizer_state(name) if self.state_source else None
                  for name in self.specs}
        for name, state in states.items():  # a source's fp32 master: weight and master
            if state is not None and "master" in state:
                weights[name] = state["master"].detach().to(torch.float32).contiguous()
        full = initial_state(weights)
        if self.state_source is not None:
            for name in self.specs:
                state = states[name]
                if state is not None:
                    full["state"][name] = {
                        "sharded": {key: state[key].detach().to(torch.float32).contiguous()
                                    for key in ("exp_avg", "exp_avg_sq")},
                        "replicated": {"step": torch.as_tensor(state["step"],
                                                               dtype=torch.float32)}}
            carried = {name: self.state_source.optimizer_settings(name)
                       for name, state in states.items() if state is not None}
            roles = by_role(carried, shapes, str(self.state_source.root))
            for index, role in ((0, True), (1, False)):  # initial_state's groups
                full["param_groups"][index].update(roles.get(role, {}))
        optimizer = split_consolidated(full, 1, 0)[0]
        save_rank(self._directory, 0, (0, 0, 0), weights, optimizer, fresh_rng(0, 0, 0))
        progress = self._progress(states)
        meta = CheckpointMeta(step=progress.step, tokens=progress.tokens or 0,
                              layout=SavedLayout(1, 1, 1), model=self.config.to_dict(),
                              styles=param_styles(shapes, decoder_plan(self.config, 1)),
                              stage_params={0: list(self.specs)}, source="mt convert")
        write_meta(self._directory, meta)
        self._tensors.clear()

    def _progress(self, states: dict[str, Any]) -> TrainingProgress:
        """The source's training progress where its Adam state is carried (the run then
        continues its schedule from that step); step 0 otherwise."""
        carried = any(state is not None for state in states.values())
        progress = self.state_source.progress() if carried and self.state_source else None
        if progress is None:
            return TrainingProgress(0)
        if progress.step:
            self.notes.append(f"mt pretrain --load continues the source's schedule at step "
                              f"{progress.step}, its data from the start of the run's data")
        return progress

    def abort(self) -> None:
        self._tensors.clear()
