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
rest (``mt pretrain --load`` sets the run's own before its first step). The step and the
data position are 0: ``mt pretrain``'s learning-rate schedule follows the samples its data
loader has consumed, and the source's were another loader's, so the run starts its
schedule and its data from the beginning (a note says how far the source had trained, where
it records it: :meth:`~mt_formats.canonical.CheckpointReader.progress`).

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
from mt_formats.canonical import CheckpointWriter, TensorRef
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
        states = {name: self.source_state(name) for name in self.specs}
        self.check_states()
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
        self._note_progress(states)
        meta = CheckpointMeta(step=0, layout=SavedLayout(1, 1, 1), model=self.config.to_dict(),
                              styles=param_styles(shapes, decoder_plan(self.config, 1)),
                              stage_params={0: list(self.specs)}, source="mt convert")
        write_meta(self._directory, meta)
        self._tensors.clear()

    def _note_progress(self, states: dict[str, Any]) -> None:
        """Where the source's Adam state is carried and the source records how far its
        training went, a note: the new run's schedule starts over (see the module)."""
        carried = any(state is not None for state in states.values())
        progress = self.state_source.progress() if carried and self.state_source else None
        if progress is not None and progress.step:
            tokens = "" if progress.tokens is None else f", {progress.tokens:,} tokens"
            self.notes.append(
                f"the source had trained {progress.step} steps{tokens}: mt pretrain --load "
                "starts its learning-rate schedule and its data at step 0 (both follow the "
                "samples its own data loader consumes); Adam's moments and step counts "
                "are carried")

    def abort(self) -> None:
        self._tensors.clear()
