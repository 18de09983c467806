"""``meta.json``, typed: what a step folder holds besides the rank files.

One frozen dataclass, :class:`CheckpointMeta`, is read (:func:`read_meta`) and written
(:func:`mt_checkpoint.publish_step`); nobody indexes the JSON by hand. The model and the run
config stay plain dicts (their owners, mt-model's ``GPTConfig`` and mt pretrain's config,
parse them), so this package depends on neither.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mt_checkpoint.checksums import json_crc
from mt_checkpoint.layout import SavedLayout
from mt_checkpoint.names import DATA_ORDER, FORMAT, META, CheckpointError

__all__ = ["CheckpointMeta", "read_meta"]


@dataclass(frozen=True)
class CheckpointMeta:
    """The content of a step folder's ``meta.json``.

    Attributes:
        step: the optimizer steps taken when the checkpoint was written.
        layout: the (TP, PP, DP, ZeRO, precision) layout of its rank files.
        model: the model's config (``GPTConfig.to_dict()``).
        styles: the tensor-parallel slicing style of every parameter.
        stage_params: the parameter names of every pipeline stage.
        consumed_samples, data_step: the data loader's position.
        data_order: the sample order the position counts in (absent in old files: 1).
        tokens: training tokens seen.
        config: the run's config (``mt pretrain``'s), for readers; may be empty.
        source: who wrote it when not a training run (``"mt convert"``).
        tokenizer: the tokenizer the run trained with (a built-in name such as ``gpt2``,
            or a path); absent in old files.
        tokenizer_sha256: that tokenizer's fingerprint (``mt_data``'s
            ``Tokenizer.fingerprint``), so that a reader can tell it from a file edited or
            replaced since; absent in old files.
        files: each rank file's ``bytes`` and ``crc32c`` (:mod:`mt_checkpoint.checksums`),
            filled in when the step is published; absent in files written before checksums.
    """

    step: int
    layout: SavedLayout
    model: Mapping[str, Any]
    styles: Mapping[str, str]
    stage_params: Mapping[int, Sequence[str]]
    consumed_samples: int = 0
    data_step: int = 0
    data_order: int = DATA_ORDER
    tokens: int = 0
    config: Mapping[str, Any] = field(default_factory=dict)
    source: str | None = None
    tokenizer: str | None = None
    tokenizer_sha256: str | None = None
    files: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def data(self) -> dict[str, int]:
        """The data loader's state (mt-data's ``DataLoaderState.to_dict()``)."""
        return {"consumed_samples": self.consumed_samples, "step": self.data_step}

    @property
    def seed(self) -> int:
        """The run's seed (0 when the config does not say)."""
        return int((self.config.get("train") or {}).get("seed", 0) or 0)

    def relaid(self, layout: SavedLayout, stage_params: Mapping[int, Sequence[str]]
               ) -> CheckpointMeta:
        """This checkpoint at another layout; the run config's ``parallel`` section (when
        there is one) follows, so that a run resumed from it agrees with its files."""
        config = json.loads(json.dumps(self.config))  # a deep copy of plain data
        parallel = config.get("parallel")
        if isinstance(parallel, dict):
            parallel.update({"tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
                             "zero_stage": layout.zero_stage,
                             "virtual_stages": layout.virtual_stages})
            if "cp" in parallel or layout.cp > 1:
                parallel["cp"] = layout.cp
            if parallel.get("nproc") is not None:
                parallel["nproc"] = layout.world_size
        return replace(self, layout=layout, config=config,
                       stage_params={int(s): list(n) for s, n in stage_params.items()})

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``meta.json``."""
        out: dict[str, Any] = {
            "format": FORMAT, "step": self.step, "data": self.data,
            "data_order": self.data_order, "tokens": self.tokens,
            "layout": self.layout.to_dict(), "model": dict(self.model),
            "styles": dict(self.styles),
            "stage_params": {str(s): list(n) for s, n in sorted(self.stage_params.items())},
            "config": dict(self.config),
        }
        if self.source is not None:
            out["source"] = self.source
        if self.tokenizer is not None:
            out["tokenizer"] = self.tokenizer
        if self.tokenizer_sha256 is not None:
            out["tokenizer_sha256"] = self.tokenizer_sha256
        if self.files:
            out["files"] = {name: dict(entry) for name, entry in sorted(self.files.items())}
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str) -> CheckpointMeta:
        """Parse ``meta.json``'s object; ``where`` (the file) starts every error."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise CheckpointError(f"{where}: format {found!r}, expected {FORMAT!r}")
        if "crc32c" in data:  # absent in files written before meta.json carried one
            stored = data["crc32c"]
            body = {k: v for k, v in data.items() if k != "crc32c"}
            if json_crc(body) != stored:
                raise CheckpointError(f"{where}: damaged (its content does not match its "
                                      f"checksum {stored})")
        missing = [k for k in ("step", "data", "layout", "model", "styles", "stage_params")
                   if k not in data]
        if missing:
            raise CheckpointError(f"{where}: damaged (no {', '.join(missing)})")
        layout = SavedLayout.from_dict(data["layout"], where)
        position = data["data"]
        if not isinstance(position, dict) or "consumed_samples" not in position:
            raise CheckpointError(f"{where}: damaged (data is {position!r}, expected "
                                  "{\"consumed_samples\": N, \"step\": N})")
        for key, value in (("step", data["step"]),
                           ("data.consumed_samples", position["consumed_samples"]),
                           ("data.step", position.get("step", 0)),
                           ("data_order", data.get("data_order", 1)),
                           ("tokens", data.get("tokens", 0))):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CheckpointError(f"{where}: damaged ({key} is {json.dumps(value)}, "
                                      "expected a whole number >= 0)")
        try:
            meta = cls(
                step=int(data["step"]), layout=layout, model=dict(data["model"]),
                styles={str(k): str(v) for k, v in data["styles"].items()},
                stage_params={int(s): [str(n) for n in names]
                              for s, names in data["stage_params"].items()},
                consumed_samples=int(position["consumed_samples"]),
                data_step=int(position.get("step", 0)),
                data_order=int(data.get("data_order", 1)), tokens=int(data.get("tokens", 0)),
                config=dict(data.get("config") or {}), source=data.get("source"),
                tokenizer=data.get("tokenizer"), tokenizer_sha256=data.get("tokenizer_sha256"),
                files={str(k): dict(v) for k, v in (data.get("files") or {}).items()})
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CheckpointError(f"{where}: damaged ({type(err).__name__}: {err})") from None
        from mt_tensor_parallel import PARAM_STYLES  # torch: not at the CLI's start

        unknown = next(((k, v) for k, v in meta.styles.items() if v not in PARAM_STYLES), None)
        if unknown is not None:
            raise CheckpointError(f"{where}: damaged (styles[{unknown[0]!r}] is {unknown[1]!r}, "
                                  f"not one of {', '.join(PARAM_STYLES)})")
        if not isinstance(meta.tokenizer, (str, type(None))):
            raise CheckpointError(f"{where}: damaged (tokenizer {meta.tokenizer!r} is not a "
                                  "name or a path)")
        if not isinstance(meta.tokenizer_sha256, (str, type(None))):
            raise CheckpointError(f"{where}: damaged (tokenizer_sha256 "
                                  f"{meta.tokenizer_sha256!r} is not a hex digest)")
        if sorted(meta.stage_params) != list(range(layout.pp)):
            raise CheckpointError(f"{where}: stage_params names stages "
                                  f"{sorted(meta.stage_params)}, the layout has pp {layout.pp}")
        return meta

    def as_json(self) -> str:
        """``meta.json``'s text: :meth:`to_dict` with the checksum of its content."""
        body = self.to_dict()
        return json.dumps({**body, "crc32c": json_crc(body)}, indent=1)

    def __post_init__(self) -> None:
        if self.step < 0 or self.consumed_samples < 0:
            raise CheckpointError(f"meta: negative step {self.step} or consumed samples "
                                  f"{self.consumed_samples}")


def read_meta(folder: Path) -> CheckpointMeta:
    """The parsed ``meta.json`` of a step folder (one-line errors for a damaged one)."""
    path = folder / META
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: damaged ({err})") from None
    return CheckpointMeta.from_dict(data, str(path))
