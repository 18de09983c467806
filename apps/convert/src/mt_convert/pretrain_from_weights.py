"""``--to pretrain`` from weights only (hf, consolidated, tp, megatron, deepspeed sources): a
fresh ``mt pretrain`` checkpoint that ``mt pretrain --load`` starts from. (From an ``mt
pretrain`` source, :mod:`mt_convert.pretrain_relayout` reshards it, optimizer state
included.)

The destination is one step folder of the simplest layout (tp = pp = dp = 1, ZeRO 0, step
0): the meta file and one rank file (mt-checkpoint's names). ``mt pretrain --load`` reshards
it to the run's own (TP, PP, DP, ZeRO) layout, so one file serves every layout. The rank
file holds the fp32 weights under ``"model"`` (what
:class:`~mt_convert.pretrain.PretrainReader` reads) and, under ``"optimizer"``, the same
weights as a one-rank mt-zero optimizer shard (fp32 masters, one piece per parameter, no
Adam moments yet: the optimizer starts fresh, as for a new run). Matrices go to parameter
group 0 (weight decay), vectors to group 1, like ``mt_zero.decay_param_groups``; the run
sets its own learning rate, weight decay, betas and eps. The data position is 0: training
starts at step 1 of the run's data.

``torch.save`` needs the whole file, so the writer buffers the tensors until
:meth:`~PretrainWriter.finish`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mt_checkpoint import FORMAT, META, rank_file
from mt_convert.errors import ConvertError
from mt_convert.layout import CheckpointWriter, TensorRef
from mt_convert.tensors import TensorSpec
from mt_model import GPTConfig
from mt_tensor_parallel import GPT_PLAN, param_styles

__all__ = ["PretrainWriter"]

RANK_FORMAT = "mt-pretrain-rank/1"
SHARD_FORMAT = "mt-zero-shard/1"
RANK_FILE = rank_file(0)  # the one rank of the tp = pp = dp = 1 step folder


def _param_groups() -> list[dict[str, Any]]:
    """torch AdamW's group hyperparameters (every key this torch version expects on load);
    the resuming run overrides lr, weight decay, betas and eps."""
    dummy = [torch.zeros(1), torch.zeros(1)]
    optimizer = torch.optim.AdamW([{"params": [dummy[0]], "weight_decay": 0.1},
                                   {"params": [dummy[1]], "weight_decay": 0.0}], lr=0.0)
    return [{k: v for k, v in group.items() if k != "params"}
            for group in optimizer.state_dict()["param_groups"]]


class PretrainWriter(CheckpointWriter):
    """An ``mt pretrain`` step folder (tp = pp = dp = 1, step 0) from canonical tensors."""

    format = "pretrain"

    def __init__(self, config: GPTConfig, specs: dict[str, TensorSpec]) -> None:
        super().__init__(config, specs)
        self._directory: Path | None = None
        self._tensors: dict[str, torch.Tensor] = {}

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

    def _optimizer(self) -> dict[str, Any]:
        pieces, master = [], []
        for name in self.specs:
            tensor = self._tensors[name]
            pieces.append({"name": name, "offset": 0, "length": tensor.numel(),
                           "group": 0 if tensor.dim() >= 2 else 1})
            master.append(tensor.reshape(-1).clone())
        return {"format": SHARD_FORMAT, "stage": 0, "dp_size": 1, "dp_rank": 0,
                "shapes": {name: tuple(self.specs[name].shape) for name in self.specs},
                "param_groups": _param_groups(), "pieces": pieces, "master": master,
                "state": [{} for _ in pieces], "scaler": None}

    def _meta(self) -> dict[str, Any]:
        shapes = {name: tuple(spec.shape) for name, spec in self.specs.items()}
        return {
            "format": FORMAT, "step": 0,
            "data": {"consumed_samples": 0, "step": 0}, "tokens": 0,
            "layout": {"tp": 1, "pp": 1, "dp": 1, "world_size": 1, "virtual_stages": 1,
                       "zero_stage": 0, "precision": "fp32"},
            "model": self.config.to_dict(),
            "styles": param_styles(shapes, GPT_PLAN),
            "stage_params": {"0": list(self.specs)},
            "config": {}, "source": "mt convert",
        }

    def finish(self) -> None:
        if self._directory is None:
            raise ConvertError("PretrainWriter.finish() before open()")
        missing = [name for name in self.specs if name not in self._tensors]
        if missing:
            raise ConvertError(f"{self._directory / RANK_FILE}: tensors never written: "
                               f"{missing}")
        payload = {"format": RANK_FORMAT, "rank": 0, "coord": [0, 0, 0],
                   "model": dict(self._tensors), "optimizer": self._optimizer(),
                   "rng": {"torch": torch.Generator().manual_seed(0).get_state(),
                           "cuda": None, "tracker": {}}}
        with open(self._directory / RANK_FILE, "wb") as f:
            torch.save(payload, f)
        (self._directory / META).write_text(json.dumps(self._meta(), indent=1),
                                            encoding="utf-8")
        self._tensors.clear()

    def abort(self) -> None:
        self._tensors.clear()
