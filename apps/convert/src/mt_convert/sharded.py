"""The tensor-parallel layout: ``tp_rank_XX/model.safetensors`` per TP rank + ``config.json``.

Each rank's file holds exactly the state dict of ``mt_model.GPT`` after
``mt_tensor_parallel.apply_tensor_parallel(model, group, GPT_PLAN)`` on that rank: canonical
names, tensors sliced by ``mt_tensor_parallel.shard_tensor`` (qkv per [q; k; v] block,
column / row splits, the token embedding padded to a multiple of ``pad_multiple * tp``
rows and split by vocabulary range, everything else replicated). Merging uses
``merge_shards`` and drops the padding rows, so consolidated -> TP -> consolidated is
bit-identical. Replicated tensors are checked to be equal on every rank when read.

The manifest's ``layout`` is ``{"tp": N, "pp": 1, "pad_multiple": 128}``; pipeline stages
(``pp > 1``) are reserved for a later version and rejected with a clear error.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mt_convert.errors import ConvertError
from mt_convert.layout import CheckpointReader, CheckpointWriter, TensorRef, canonical_shapes
from mt_convert.manifest import FileEntries, open_checked, read_manifest, write_manifest
from mt_convert.safetensors_io import SafetensorsReader, SafetensorsWriter, TensorSpec
from mt_model import GPTConfig
from mt_tensor_parallel import (
    DEFAULT_PAD_MULTIPLE,
    GPT_PLAN,
    check_divisibility,
    merge_shards,
    param_styles,
    shard_tensor,
)

__all__ = ["SHARDED_FORMAT", "ShardedReader", "ShardedWriter", "shard_file", "shard_specs"]

SHARDED_FORMAT = "mt-sharded"


def shard_file(tp_rank: int) -> str:
    """Relative path of TP rank ``tp_rank``'s file."""
    return f"tp_rank_{tp_rank:02d}/model.safetensors"


def _check_tp(config: GPTConfig, tp: int) -> None:
    try:
        check_divisibility(tp=tp, n_heads=config.n_heads, hidden=config.hidden,
                           ffn_hidden=config.ffn_hidden)
    except ValueError as err:
        raise ConvertError(str(err)) from None


def shard_specs(specs: dict[str, TensorSpec], tp: int, pad_multiple: int
                ) -> tuple[dict[str, str], list[dict[str, TensorSpec]]]:
    """(style of each tensor, per-rank shard specs) of canonical ``specs`` split ``tp`` ways.
    Shapes come from running ``shard_tensor`` on meta tensors, so they cannot disagree with
    the real slicing."""
    styles = param_styles(specs, GPT_PLAN)
    ranks: list[dict[str, TensorSpec]] = [{} for _ in range(tp)]
    # Layers repeat the same few (style, shape) pairs; slicing each pair once keeps this
    # fast for 100+ layer models.
    cache: dict[tuple[str, tuple[int, ...]], list[tuple[int, ...]]] = {}
    for name, spec in specs.items():
        key = (styles[name], spec.shape)
        if key not in cache:
            full = torch.empty(spec.shape, device="meta")
            cache[key] = [tuple(shard_tensor(key[0], full, rank, tp,
                                             pad_multiple=pad_multiple).shape)
                          for rank in range(tp)]
        for rank in range(tp):
            ranks[rank][name] = TensorSpec(cache[key][rank], spec.dtype)
    return styles, ranks


class ShardedWriter(CheckpointWriter):
    """Splits each canonical tensor into ``tp`` shards, one file per rank."""

    format = "tp"

    def __init__(self, config: GPTConfig, specs: dict[str, TensorSpec], tp: int,
                 pad_multiple: int = DEFAULT_PAD_MULTIPLE) -> None:
        super().__init__(config, specs)
        _check_tp(config, tp)
        self.tp, self.pad_multiple = tp, pad_multiple
        self._styles, self._ranks = shard_specs(self.specs, tp, pad_multiple)
        self._writers: list[SafetensorsWriter] = []
        self._directory: Path | None = None

    def targets(self, name: str) -> list[TensorRef]:
        return [TensorRef(shard_file(rank), name, self._ranks[rank][name],
                          f"tp {rank}/{self.tp} {self._styles[name]}")
                for rank in range(self.tp)]

    def open(self, directory: Path) -> None:
        self._directory = Path(directory)
        meta = {"mt.format": SHARDED_FORMAT, "mt.tp": str(self.tp)}
        for rank in range(self.tp):
            self._writers.append(SafetensorsWriter(self._directory / shard_file(rank),
                                                   self._ranks[rank],
                                                   {**meta, "mt.tp_rank": str(rank)}))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        for rank, writer in enumerate(self._writers):
            writer.write(name, shard_tensor(self._styles[name], tensor, rank, self.tp,
                                            pad_multiple=self.pad_multiple))

    def finish(self) -> None:
        assert self._directory is not None, "open() first"
        files: dict[str, FileEntries] = {}
        for rank, writer in enumerate(self._writers):
            checksums = writer.close()
            files[shard_file(rank)] = {name: (spec, checksums[name])
                                       for name, spec in self._ranks[rank].items()}
        layout = {"tp": self.tp, "pp": 1, "pad_multiple": self.pad_multiple}
        write_manifest(self._directory, SHARDED_FORMAT, self.config, layout, files)

    def abort(self) -> None:
        for writer in self._writers:
            writer.abort()


def _layout_int(manifest_path: Path, layout: dict, key: str, default: int | None) -> int:
    value = layout.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConvertError(f"{manifest_path}: layout.{key} must be a positive int, got "
                           f"{value!r}")
    return value


class ShardedReader(CheckpointReader):
    """Reads a TP-sharded checkpoint and merges each tensor back to its full shape."""

    format = "tp"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        manifest = read_manifest(self.root, SHARDED_FORMAT)
        self.config = manifest.config
        self.tp = _layout_int(manifest.path, manifest.layout, "tp", None)
        pp = _layout_int(manifest.path, manifest.layout, "pp", 1)
        if pp != 1:
            raise ConvertError(f"{manifest.path}: pipeline-parallel layouts (pp={pp}) are not "
                               "supported yet")
        self.pad_multiple = _layout_int(manifest.path, manifest.layout, "pad_multiple",
                                        DEFAULT_PAD_MULTIPLE)
        _check_tp(self.config, self.tp)
        self._shapes = canonical_shapes(self.config)
        wanted = {shard_file(rank) for rank in range(self.tp)}
        if set(manifest.files) != wanted:
            raise ConvertError(f"{manifest.path}: files {sorted(manifest.files)} do not match "
                               f"tp={self.tp} (expected {sorted(wanted)})")
        # dtypes only matter for the comparison against headers, which open_checked does
        specs = {name: TensorSpec(shape, torch.float32) for name, shape in self._shapes.items()}
        self._styles, ranks = shard_specs(specs, self.tp, self.pad_multiple)
        self._files: list[SafetensorsReader] = []
        try:
            for rank in range(self.tp):
                shapes = {name: spec.shape for name, spec in ranks[rank].items()}
                self._files.append(open_checked(self.root, manifest, shard_file(rank), shapes))
        except BaseException:
            self.close()
            raise

    def names(self) -> list[str]:
        return list(self._shapes)

    def spec(self, name: str) -> TensorSpec:
        return TensorSpec(self._shapes[name], self._files[0].spec(name).dtype)

    def sources(self, name: str) -> list[TensorRef]:
        return [TensorRef(shard_file(rank), name, file.spec(name),
                          f"tp {rank}/{self.tp} {self._styles[name]}")
                for rank, file in enumerate(self._files)]

    def read(self, name: str) -> torch.Tensor:
        shards = [file.get(name) for file in self._files]
        style = self._styles[name]
        if len({shard.dtype for shard in shards}) > 1:
            raise ConvertError(f"{self.root}: tensor {name!r} has different dtypes on "
                               f"different tp ranks: {[str(s.dtype) for s in shards]}")
        if style == "replicate":
            for rank, shard in enumerate(shards[1:], start=1):
                if not torch.equal(shard, shards[0]):
                    raise ConvertError(f"{self.root / shard_file(rank)}: replicated tensor "
                                       f"{name!r} differs from tp rank 0's copy")
        vocab = self.config.vocab_size if style == "vocab" else None
        return merge_shards(style, shards, vocab_size=vocab)

    def close(self) -> None:
        for file in getattr(self, "_files", []):
            file.close()
