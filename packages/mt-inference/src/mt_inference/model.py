"""What the inference commands run: the model config, its full weights and its tokenizer,
read from an `mt pretrain` checkpoint (the folder, its ``latest``, or one step), or from any
folder `mt convert` reads (a Hugging Face GPT-2 folder, an mt consolidated or sharded folder, a
Megatron-LM checkpoint), converted once into a temporary `mt pretrain` checkpoint by
mt-formats, the library under `mt convert`, in process."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mt_checkpoint import CheckpointError, find_checkpoint, read_meta
from mt_formats import ConvertError, convert_checkpoint, load_state_dict
from mt_model import GPTConfig

if TYPE_CHECKING:
    from mt_data import Tokenizer

__all__ = ["EvalModel", "as_pretrain_checkpoint", "load_eval_model", "whole_model"]


@dataclass
class EvalModel:
    """A model to evaluate: ``weights`` are full (unsharded) fp32 tensors by mt name."""

    config: GPTConfig
    weights: dict[str, torch.Tensor]
    tokenizer: str
    source: str
    step: int | None = None
    loaded: Tokenizer | None = field(default=None, repr=False, compare=False)
    """The tokenizer, where checking its fingerprint has loaded it already."""

    def open_tokenizer(self) -> Tokenizer:
        """The tokenizer, loaded once."""
        from mt_data import load_tokenizer

        return self.loaded if self.loaded is not None else load_tokenizer(self.tokenizer)


def _folder_tokenizer(folder: Path) -> str | None:
    """The tokenizer a model folder carries (``tokenizer.json``, or GPT-2's vocab and merges
    files), as ``mt_data.load_tokenizer`` takes it."""
    if (folder / "tokenizer.json").is_file() or (
            (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()):
        return str(folder)
    return None


@contextmanager
def as_pretrain_checkpoint(path: str, tokenizer: str | None
                           ) -> Iterator[tuple[str, str | None]]:
    """(an `mt pretrain` checkpoint, tokenizer) for ``path``: itself, or a temporary
    conversion of another format by mt-formats, in this process (deleted on exit), with the
    tokenizer the folder carries unless ``tokenizer`` is given."""
    try:
        find_checkpoint(path)
    except CheckpointError:
        if not Path(path).is_dir():
            raise
    else:  # the work's own errors pass through: not taken for another format's folder
        yield path, tokenizer
        return
    with tempfile.TemporaryDirectory(prefix="mt-eval-") as tmp:
        target = Path(tmp) / "checkpoint"
        try:
            convert_checkpoint(path, target, to="pretrain")
        except ConvertError as err:
            raise CheckpointError(f"{path}: neither an mt pretrain checkpoint nor a folder mt "
                                  f"convert reads ({err})") from None
        yield str(target), tokenizer or _folder_tokenizer(Path(path))


def load_eval_model(path: str | Path, tokenizer: str | None = None) -> EvalModel:
    """Config, full weights and tokenizer of the checkpoint at ``path``."""
    folder = find_checkpoint(path)
    meta = read_meta(folder)
    try:  # mt-formats: the one reader of pretrain checkpoints (checksums checked)
        config, weights = load_state_dict(folder, "pretrain")
    except ConvertError as err:
        raise CheckpointError(str(err)) from None
    name = tokenizer or meta.tokenizer
    if name is None:
        raise CheckpointError(f"{folder}: the tokenizer the run trained with is not recorded "
                              "and its dataset is not here; pass --tokenizer (gpt2, "
                              "tokenizer-1k, a tokenizer.json or a folder)")
    loaded = None if meta.tokenizer_sha256 is None else _check_tokenizer(
        name, meta.tokenizer, meta.tokenizer_sha256, folder, tokenizer)
    return EvalModel(config, weights, name, str(folder), meta.step, loaded)


def _check_tokenizer(name: str, trained: str | None, fingerprint: str, folder: Path,
                     given: str | None) -> Tokenizer:
    """The tokenizer ``name``, checked to be the one the run trained with (``fingerprint``),
    not a file edited or replaced since: ids of another tokenizer read as other text."""
    from mt_data import load_tokenizer
    from mt_data.tokenizer import TokenizerError

    try:
        loaded = load_tokenizer(name)
        have = loaded.fingerprint
    except TokenizerError as err:
        raise CheckpointError(f"{folder}: the tokenizer the run trained with does not load "
                              f"({err}); pass --tokenizer with that one") from None
    if have != fingerprint:
        where = f"--tokenizer {given}" if given else f"the tokenizer at {trained}"
        raise CheckpointError(f"{folder}: {where} is not the one the run trained with (sha256 "
                              f"{have[:12]}..., the run's {fingerprint[:12]}...): "
                              + ("pass the run's tokenizer" if given else
                                 "restore it, or pass --tokenizer with the run's"))
    return loaded


def whole_model(loaded: EvalModel, device: torch.device, dtype: torch.dtype) -> Any:
    """The whole model (mt-model's ``GPT``, eval mode) of ``loaded``'s weights, for decoding
    on one process (its weights laid out for decoding's thin products on CPU)."""
    from mt_model import GPT, decoding_layout_

    model = GPT(loaded.config, seed=None)
    model.load_state_dict(loaded.weights, strict=True)
    model = model.to(device=device, dtype=dtype).eval()
    return decoding_layout_(model) if device.type == "cpu" else model
