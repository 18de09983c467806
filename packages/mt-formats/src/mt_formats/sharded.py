"""mt's sharded layout: one safetensors file per (pipeline stage, tensor-parallel rank).

Files: ``tp_rank_XX/model.safetensors`` when ``pp == 1``, else
``pp_rank_XX_tp_rank_YY/model.safetensors``, plus ``config.json``. Each file holds exactly
the state dict of that rank's part of ``mt_model.GPT`` after
``mt_tensor_parallel.apply_tensor_parallel(model, group, GPT_PLAN)``: canonical (full
model) names, tensors sliced by ``mt_tensor_parallel.shard_tensor`` (qkv per [q; k; v]
block, column / row splits, the token embedding padded to a multiple of
``pad_multiple * tp`` rows and split by vocabulary range, everything else replicated).

Pipeline stages hold contiguous layer ranges (``layout.stage_layers``, uniform as
``mt_pipeline.uniform_partition`` makes them): ``embed.*`` on the first stage, ``ln_f.*``
on the last, and the last stage also keeps a copy of ``embed.tokens.weight`` for the tied
head, exactly as ``mt_pipeline`` names a stage's parameters. Merging uses
``merge_shards`` and drops padding rows, so A -> B -> A is bit-identical for any layouts
and padding multiples (to consolidated, the same bytes are joined in reused buffers:
:meth:`ShardedReader.read_pieces`, :mod:`mt_formats.shard_pieces`). Copies (replicated TP
tensors, the tied embedding of the last stage) are checked to agree when read.

Manifest ``layout``: ``{"tp", "pp", "pad_multiple"}`` (+ ``"stage_layers"`` when pp > 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from mt_formats import streams
from mt_formats.canonical import (
    CheckpointReader,
    CheckpointWriter,
    Streamed,
    TensorRef,
    canonical_shapes,
)
from mt_formats.crc import CHECKSUM_ALGORITHM, crc_kind, digest, join_crcs
from mt_formats.errors import ConvertError
from mt_formats.manifest import (
    FileEntries,
    model_metadata,
    open_checked,
    read_manifest,
    write_manifest,
)
from mt_formats.safetensors_io import SafetensorsReader, SafetensorsWriter
from mt_formats.shard_pieces import (
    ShardCutter,
    in_file,
    merge_groups,
    shard_parts,
    shard_segments,
    source_crc,
    tiles,
)
from mt_formats.spans import FileSpan, ScratchBuffer
from mt_formats.streams import Found, Plan, StreamingReader
from mt_formats.tensors import TensorSpec, raw_bytes
from mt_model import GPTConfig, parameter_stages
from mt_pipeline import PartitionError, uniform_partition
from mt_tensor_parallel import (
    DEFAULT_PAD_MULTIPLE,
    GPT_PLAN,
    check_divisibility,
    decoder_plan,
    merge_shards,
    param_styles,
    shard_tensor,
)

__all__ = [
    "SHARDED_FORMAT",
    "ShardedReader",
    "ShardedWriter",
    "shard_file",
    "shard_specs",
    "stage_layers",
    "stages_of",
]

SHARDED_FORMAT = "mt-sharded"


def shard_file(tp_rank: int, pp_rank: int = 0, pp: int = 1) -> str:
    """Relative path of the file of TP rank ``tp_rank`` on pipeline stage ``pp_rank``."""
    if pp == 1:
        return f"tp_rank_{tp_rank:02d}/model.safetensors"
    return f"pp_rank_{pp_rank:02d}_tp_rank_{tp_rank:02d}/model.safetensors"


def _check_tp(config: GPTConfig, tp: int) -> None:
    try:
        check_divisibility(tp=tp, n_heads=config.n_heads, hidden=config.hidden,
                           ffn_hidden=config.ffn_hidden, n_kv_heads=config.n_kv_heads)
    except ValueError as err:
        raise ConvertError(str(err)) from None


def stage_layers(n_layers: int, pp: int) -> list[tuple[int, int]]:
    """Half-open layer range of every stage of a uniform ``pp``-stage pipeline."""
    try:
        plan = uniform_partition(n_layers, pp)
    except PartitionError as err:
        raise ConvertError(f"cannot split the model into pp={pp} stages: {err}") from None
    return [stage.chunks[0] for stage in plan.stages]


def stages_of(name: str, ranges: list[tuple[int, int]], tied: bool = True) -> list[int]:
    """The pipeline stages holding canonical tensor ``name``, stage ``s`` holding the blocks
    ``ranges[s]`` (``mt_model.parameter_stages``: a tied embedding is on the first and the
    last stage)."""
    return parameter_stages(name, [range(start, stop) for start, stop in ranges], tied)


def shard_specs(specs: dict[str, TensorSpec], tp: int, pad_multiple: int,
                config: GPTConfig | None = None
                ) -> tuple[dict[str, str], list[dict[str, TensorSpec]]]:
    """(style of each tensor, per-rank shard specs) of canonical ``specs`` split ``tp`` ways.
    Shapes come from running ``shard_tensor`` on meta tensors, so they cannot disagree with
    the real slicing."""
    styles = param_styles(specs, decoder_plan(config, tp) if config is not None else GPT_PLAN)
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


class _Layout:
    """Where every canonical tensor lives in a (tp, pp, pad_multiple) layout."""

    def __init__(self, config: GPTConfig, specs: dict[str, TensorSpec], tp: int, pp: int,
                 pad_multiple: int, ranges: list[tuple[int, int]] | None = None) -> None:
        _check_tp(config, tp)
        if pad_multiple < 1:
            raise ConvertError(f"pad_multiple must be >= 1, got {pad_multiple}")
        self.tp, self.pp, self.pad_multiple = tp, pp, pad_multiple
        self.ranges = stage_layers(config.n_layers, pp) if ranges is None else ranges
        self.styles, self.ranks = shard_specs(specs, tp, pad_multiple, config)
        self.stages = {name: stages_of(name, self.ranges, config.tied_embeddings)
                       for name in specs}

    def file(self, stage: int, rank: int) -> str:
        return shard_file(rank, stage, self.pp)

    def files(self) -> list[tuple[int, int, str]]:
        """(stage, tp rank, file) of every file, stage-major."""
        return [(s, r, self.file(s, r)) for s in range(self.pp) for r in range(self.tp)]

    def file_specs(self, stage: int, rank: int) -> dict[str, TensorSpec]:
        return {name: spec for name, spec in self.ranks[rank].items()
                if stage in self.stages[name]}

    def refs(self, name: str, specs: dict[tuple[int, int], TensorSpec] | None = None
             ) -> list[TensorRef]:
        refs = []
        for stage in self.stages[name]:
            where = f"pp {stage}/{self.pp} " if self.pp > 1 else ""
            for rank in range(self.tp):
                spec = self.ranks[rank][name] if specs is None else specs[(stage, rank)]
                refs.append(TensorRef(self.file(stage, rank), name, spec,
                                      f"{where}tp {rank}/{self.tp} {self.styles[name]}"))
        return refs

    def manifest_layout(self) -> dict[str, Any]:
        layout: dict[str, Any] = {"tp": self.tp, "pp": self.pp,
                                  "pad_multiple": self.pad_multiple}
        if self.pp > 1:
            layout["stage_layers"] = [list(r) for r in self.ranges]
        return layout


class ShardedWriter(CheckpointWriter):
    """Splits each canonical tensor into ``tp`` shards and stores them on the pipeline
    stage(s) that hold it, one file per (stage, TP rank)."""

    format = "tp"

    def __init__(self, config: GPTConfig, specs: dict[str, TensorSpec], tp: int, pp: int = 1,
                 pad_multiple: int = DEFAULT_PAD_MULTIPLE) -> None:
        super().__init__(config, specs)
        self._scratch = ScratchBuffer()  # row-parallel slices of a streamed chunk, gathered
        self._layout = _Layout(config, self.specs, tp, pp, pad_multiple)
        self.tp, self.pp, self.pad_multiple = tp, pp, pad_multiple
        self._writers: dict[tuple[int, int], SafetensorsWriter] = {}
        self._directory: Path | None = None
        # Hashing and file writes release the GIL: the shards of a tensor go to their
        # files in parallel.
        self._pool = ThreadPoolExecutor(max_workers=min(4, tp * pp),
                                        thread_name_prefix="mt-convert-write")

    def targets(self, name: str) -> list[TensorRef]:
        return self._layout.refs(name)

    def open(self, directory: Path) -> None:
        self._directory = Path(directory)
        meta = {"mt.format": SHARDED_FORMAT, "mt.tp": str(self.tp), "mt.pp": str(self.pp),
                **model_metadata(self.config)}
        for stage, rank, file in self._layout.files():
            self._writers[(stage, rank)] = SafetensorsWriter(
                self._directory / file, self._layout.file_specs(stage, rank),
                {**meta, "mt.tp_rank": str(rank), "mt.pp_rank": str(stage)})

    def write(self, name: str, tensor: torch.Tensor) -> str | None:
        return self.write_from(name, tensor, None)

    def write_from(self, name: str, tensor: torch.Tensor, span: FileSpan | None
                   ) -> str | None:
        style, (first, *others) = self._layout.styles[name], self._layout.stages[name]
        tensor = tensor.detach().to("cpu")
        parts = [shard_parts(style, tensor, rank, self.tp, self.pad_multiple)
                 for rank in range(self.tp)]
        # Shards are written as views of the tensor (no copies), or copied in the kernel
        # from the source file where they are byte ranges of it, and hashed as they are
        # written, each file by one job at a time; waiting for all before the next tensor
        # keeps memory at one tensor.
        sources = parts if span is None else [[in_file(p, tensor, span) for p in rank_parts]
                                              for rank_parts in parts]
        crcs: list[list[int]] = [[] for _ in range(self.tp)]
        jobs = [self._pool.submit(self._writers[(first, rank)].write_parts, name,
                                  sources[rank], None, crcs[rank]) for rank in range(self.tp)]
        # Shards that do not tile the source (row slices): hash the source at the same
        # time as the shards are written rather than in a pass after them.
        whole = None if tiles(tensor, parts) else self._pool.submit(
            digest, raw_bytes(tensor), CHECKSUM_ALGORITHM)
        checksums = [job.result() for job in jobs]
        # The tied embedding's copy on the last stage: same bytes, so the same checksum.
        jobs = [self._pool.submit(self._writers[(stage, rank)].write_parts, name,
                                  sources[rank], checksums[rank])
                for stage in others for rank in range(self.tp)]
        for job in jobs:
            job.result()
        return source_crc(tensor, parts, crcs) if whole is None else whole.result()

    accepts_streams = True

    def write_streamed(self, name: str, streamed: Streamed) -> None:
        """Cut every shard out of ``streamed``'s chunks as they come
        (:class:`mt_formats.shard_pieces.ShardCutter`), each piece appended to its files
        (the tied embedding's to both stages' files) and hashed once."""
        style, stages = self._layout.styles[name], self._layout.stages[name]
        if streamed.spec != self.specs[name]:
            raise ConvertError(f"tensor {name!r} is {streamed.spec.describe()}, the layout "
                               f"expects {self.specs[name].describe()}")
        segments = [shard_segments(style, streamed.spec, rank, self.tp, self.pad_multiple)
                    for rank in range(self.tp)]
        if any(rank_segments is None for rank_segments in segments):  # joined, then sliced
            data = bytearray()
            for chunk in streamed:  # each chunk is valid until the next is taken
                data += chunk
            tensor = torch.empty(streamed.spec.shape, dtype=streamed.spec.dtype)
            if data:
                tensor.reshape(-1).view(torch.uint8).copy_(
                    torch.frombuffer(data, dtype=torch.uint8))
            self.write(name, tensor)
            return
        kind = crc_kind(CHECKSUM_ALGORITHM)
        assert kind is not None
        cutters = [ShardCutter(rank_segments or [], self._scratch) for rank_segments in segments]
        files = [[self._writers[(stage, rank)] for stage in stages] for rank in range(self.tp)]
        for writer in (writer for rank_files in files for writer in rank_files):
            writer.begin(name)
        crcs, position = [0] * self.tp, 0

        def append(rank: int, pieces: Iterator[memoryview]) -> None:
            for piece in pieces:
                crcs[rank] = kind.update(piece, crcs[rank])
                for writer in files[rank]:
                    writer.append(piece)

        for chunk in streamed:
            for rank, cutter in enumerate(cutters):
                append(rank, cutter.cut(position, chunk))
            position += len(chunk)
        for rank, cutter in enumerate(cutters):
            append(rank, cutter.finish())
            for writer in files[rank]:
                writer.end(name, crcs[rank])

    def finish(self) -> None:
        assert self._directory is not None, "open() first"
        files: dict[str, FileEntries] = {}
        # fsync the files in parallel: the disk flushes them concurrently.
        closing = {key: self._pool.submit(writer.close) for key, writer in self._writers.items()}
        for stage, rank, file in self._layout.files():
            checksums = closing[(stage, rank)].result()
            files[file] = {name: (spec, checksums[name]) for name, spec
                           in self._layout.file_specs(stage, rank).items()}
        write_manifest(self._directory, SHARDED_FORMAT, self.config,
                       self._layout.manifest_layout(), files)
        self._pool.shutdown()

    def abort(self) -> None:
        self._pool.shutdown(cancel_futures=True)
        for writer in self._writers.values():
            writer.abort()


def _layout_int(manifest_path: Path, layout: dict, key: str, default: int | None) -> int:
    value = layout.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConvertError(f"{manifest_path}: layout.{key} must be a positive int, got "
                           f"{value!r}")
    return value


def _read_ranges(path: Path, layout: dict, n_layers: int, pp: int
                 ) -> list[tuple[int, int]] | None:
    """The stored stage ranges (contiguous, covering every layer), or None for uniform."""
    raw = layout.get("stage_layers")
    if raw is None:
        return None
    try:
        ranges = [(int(start), int(stop)) for start, stop in raw]
    except (TypeError, ValueError):
        raise ConvertError(f"{path}: layout.stage_layers must be [[start, stop], ...], got "
                           f"{raw!r}") from None
    bounds = [0] + [stop for _, stop in ranges]
    if (len(ranges) != pp or any(start != bounds[i] or stop < start
                                 for i, (start, stop) in enumerate(ranges))
            or bounds[-1] != n_layers):
        raise ConvertError(f"{path}: layout.stage_layers {raw} must be {pp} contiguous "
                           f"ranges covering layers 0..{n_layers - 1}")
    return ranges


class ShardedReader(StreamingReader, CheckpointReader):
    """Reads a sharded checkpoint and merges each tensor back to its full shape."""

    format = "tp"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        manifest = read_manifest(self.root, SHARDED_FORMAT)
        self.config = manifest.config
        path, raw = manifest.path, manifest.layout
        tp = _layout_int(path, raw, "tp", None)
        pp = _layout_int(path, raw, "pp", 1)
        pad = _layout_int(path, raw, "pad_multiple", DEFAULT_PAD_MULTIPLE)
        ranges = _read_ranges(path, raw, self.config.n_layers, pp)
        self._shapes = canonical_shapes(self.config)
        # dtypes only matter for the comparison against headers, which open_checked does
        specs = {name: TensorSpec(shape, torch.float32) for name, shape in self._shapes.items()}
        self._layout = _Layout(self.config, specs, tp, pp, pad, ranges)
        self.tp, self.pp, self.pad_multiple = tp, pp, pad
        wanted = {file for _, _, file in self._layout.files()}
        if set(manifest.files) != wanted:
            raise ConvertError(f"{path}: files {sorted(manifest.files)} do not match tp={tp} "
                               f"pp={pp} (expected {sorted(wanted)})")
        self._files: dict[tuple[int, int], SafetensorsReader] = {}
        try:
            for stage, rank, file in self._layout.files():
                shapes = {name: spec.shape
                          for name, spec in self._layout.file_specs(stage, rank).items()}
                self._files[(stage, rank)] = open_checked(self.root, manifest, file, shapes)
        except BaseException:
            self.close()
            raise

    def names(self) -> list[str]:
        return list(self._shapes)

    def spec(self, name: str) -> TensorSpec:
        stage = self._layout.stages[name][0]
        return TensorSpec(self._shapes[name], self._files[(stage, 0)].spec(name).dtype)

    def sources(self, name: str) -> list[TensorRef]:
        specs = {key: file.spec(name) for key, file in self._files.items()
                 if key[0] in self._layout.stages[name]}
        return self._layout.refs(name, specs)

    def _stage_shards(self, name: str, stage: int) -> list[torch.Tensor]:
        shards = [self._files[(stage, rank)].get(name) for rank in range(self.tp)]
        if len({shard.dtype for shard in shards}) > 1:
            raise ConvertError(f"{self.root}: tensor {name!r} has different dtypes on "
                               f"different tp ranks: {[str(s.dtype) for s in shards]}")
        if self._layout.styles[name] == "replicate":
            for rank, shard in enumerate(shards[1:], start=1):
                if not torch.equal(shard, shards[0]):
                    raise ConvertError(f"{self.root / self._layout.file(stage, rank)}: "
                                       f"replicated tensor {name!r} differs from tp rank 0's "
                                       "copy")
        return shards

    def read(self, name: str) -> torch.Tensor:
        first, *others = self._layout.stages[name]
        shards = self._stage_shards(name, first)
        for stage in others:  # the tied embedding's copy on the last stage
            for rank, shard in enumerate(self._stage_shards(name, stage)):
                if not torch.equal(shard, shards[rank]):
                    raise ConvertError(f"{self.root / self._layout.file(stage, rank)}: tied "
                                       f"tensor {name!r} differs from pipeline stage "
                                       f"{first}'s copy")
        style = self._layout.styles[name]
        vocab = self.config.vocab_size if style == "vocab" else None
        return merge_shards(style, shards, vocab_size=vocab)

    def read_pieces(self, name: str) -> Streamed | None:
        """``name``'s merged bytes in chunks (:mod:`mt_formats.streams`): every byte of
        every file holding it is read once and verified
        (:func:`mt_formats.shard_pieces.merge_groups`). None where merging is not a
        concatenation of byte ranges or rows (:meth:`read` then does it)."""
        return self._stream(name)

    read_stream = read_pieces

    def _stream_plan(self, name: str) -> Plan | None:
        first, *others = self._layout.stages[name]
        files = [self._files[(first, rank)] for rank in range(self.tp)]
        specs = [file.spec(name) for file in files]
        copies = {(stage, rank): self._files[(stage, rank)].span(name)
                  for stage in others for rank in range(self.tp)}
        groups = None if len({spec.dtype for spec in specs}) > 1 else merge_groups(
            self._layout.styles[name], [file.span(name) for file in files], specs,
            self.config.vocab_size, first, copies, streams.CHUNK)
        return None if groups is None else (TensorSpec(self._shapes[name], specs[0].dtype),
                                            groups)

    def _stream_verify(self, name: str, found: Found) -> None:
        """Check every file holding ``name`` against the CRCs of its windows (``found``,
        by (stage, rank): (offset, length, crc)): its recorded checksum, and that copies
        agree (replicated TP shards with rank 0's, the tied embedding's copy on the last
        stage with the first stage's)."""
        kind = crc_kind(CHECKSUM_ALGORITHM)
        assert kind is not None
        first, *others = self._layout.stages[name]
        crcs = {}
        for key in [(stage, rank) for stage in (first, *others) for rank in range(self.tp)]:
            file = self._files[key]
            crc = join_crcs(found[key], file.span(name).length)
            assert crc is not None, f"{name}: the windows of {key} do not tile it"
            file.verify(name, None, kind.format(crc))
            crcs[key] = crc
        for (stage, rank), crc in crcs.items():
            if stage == first and self._layout.styles[name] == "replicate" and (
                    crc != crcs[(first, 0)]):
                raise ConvertError(f"{self.root / self._layout.file(first, rank)}: replicated "
                                   f"tensor {name!r} differs from tp rank 0's copy")
            if stage != first and crc != crcs[(first, rank)]:
                raise ConvertError(f"{self.root / self._layout.file(stage, rank)}: tied "
                                   f"tensor {name!r} differs from pipeline stage "
                                   f"{first}'s copy")

    def close(self) -> None:
        self._close_streams()
        for file in getattr(self, "_files", {}).values():
            file.close()
