"""Sharded tensors as views and byte ranges, both ways, so that shards are neither sliced
into copies nor joined in memory.

Splitting (:func:`shard_parts`): each rank's shard as views of the canonical tensor (and a
count of zero padding bytes), which the writer writes without a copy, or copies in the
kernel from the source file where they are byte ranges of it (:func:`in_file`). When the
views tile the tensor (every style but row-parallel), the source tensor's CRC follows from
the pieces' (:func:`source_crc`), so verifying what was read needs no pass of its own. From
bytes streaming by instead (:mod:`mt_formats.streams`), each shard as segments of the
canonical tensor's bytes (:func:`shard_segments`: byte ranges, strided rows, padding), cut
out of each chunk as it comes (:class:`ShardCutter`).

Merging (:func:`merge_pieces`): for every style but row-parallel (tp > 1), merging TP shards
(``merge_shards``) only concatenates byte ranges of the shards: whole shards (column), each
shard's q, k and v blocks (fused qkv), each shard without its trailing padding rows
(vocabulary), rank 0's copy (replicated); row-parallel shards are joined along their last
dimension (:func:`row_count`: each merged row is a slice of every shard). The sharded
reader reads every byte of every file holding a tensor in read groups (:func:`merge_groups`:
those ranges, or the same rows of every row shard, whose rows it then interleaves, then the
bytes only checked) ahead of their use, into reused buffers (:mod:`mt_formats.streams`,
``O_DIRECT`` where the file system allows), hashing them as they arrive; a writer that
stores the canonical tensor as-is (consolidated) writes the chunks, and nothing maps the
files or allocates per tensor. The windows' CRCs give back each shard's CRC
(:func:`mt_formats.crc.join_crcs`), which is checked against the shard file's checksums.
Copies must agree: replicated TP shards with rank 0's, the last stage's tied embedding with
the first stage's, compared by their verified CRCs (a difference goes unnoticed with
probability 2^-32, the strength of the checksums).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mt_formats.crc import CHECKSUM_ALGORITHM, join_crcs
from mt_formats.safetensors_io import Part, zero_chunks
from mt_formats.spans import FileSpan, ScratchBuffer
from mt_formats.tensors import TensorSpec
from mt_tensor_parallel import padded_vocab_size, shard_tensor, vocab_range

__all__ = ["Piece", "ReadGroup", "Segment", "ShardCutter", "Window", "in_file", "merge_groups",
           "merge_pieces", "row_count", "shard_parts", "shard_segments", "source_crc", "tiles"]


@dataclass(frozen=True)
class Piece:
    """Bytes ``[offset, offset + span.length)`` of TP rank ``rank``'s shard, at ``span``."""

    rank: int
    offset: int
    span: FileSpan


#: Fused styles and their number of blocks (mt_tensor_parallel.sharding).
_FUSED = {"column_qkv": 3, "column_pair": 2}


def merge_pieces(style: str, spans: Sequence[FileSpan], specs: Sequence[TensorSpec],
                 vocab_size: int) -> list[Piece] | None:
    """The byte ranges, in order, whose concatenation is ``merge_shards(style, shards,
    vocab_size=...)`` of the shards stored at ``spans`` (one per TP rank), or None where
    merging is not a concatenation (row-parallel slices of more than one rank)."""
    tp = len(spans)
    if style == "replicate" or tp == 1 and style != "vocab":
        return [Piece(0, 0, spans[0])]
    if style == "column":
        return [Piece(rank, 0, span) for rank, span in enumerate(spans)]
    if style in _FUSED:  # [q; k; v] or a pair: every rank's slice of each block in turn
        n = _FUSED[style]
        if any(span.length % n for span in spans):
            return None
        return [Piece(rank, c * span.length // n,
                      span.sub(c * span.length // n, span.length // n))
                for c in range(n) for rank, span in enumerate(spans)]
    if style == "vocab":
        pieces, start = [], 0
        for rank, (span, spec) in enumerate(zip(spans, specs)):
            rows = spec.shape[0] if spec.shape else 0
            real = max(0, min(rows, vocab_size - start))
            if real and rows:
                pieces.append(Piece(rank, 0, span.sub(0, span.length // rows * real)))
            start += rows
        return pieces
    return None


def row_count(style: str, specs: Sequence[TensorSpec]) -> int | None:
    """For row-parallel shards (``style`` "row", more than one), the number of rows each
    holds (the product of every dimension but the last, the same for all), whose join
    along the last dimension is ``merge_shards``; None otherwise."""
    if style != "row" or len(specs) < 2 or not specs[0].shape:
        return None
    if any(spec.shape[:-1] != specs[0].shape[:-1] for spec in specs):
        return None
    rows = 1
    for size in specs[0].shape[:-1]:
        rows *= size
    return rows if rows > 0 else None


@dataclass(frozen=True)
class Window:
    """Bytes ``[offset, offset + span.length)`` of the tensor as stored in the file of
    (pipeline stage, TP rank) ``key``, at ``span``."""

    key: tuple[int, int]
    offset: int
    span: FileSpan


@dataclass(frozen=True)
class ReadGroup:
    """Windows read together (:class:`mt_formats.spans.ReadAhead`). ``kind`` "data": each
    window is the next bytes of the merged tensor; "rows": ``rows`` rows of every TP rank's
    row-parallel shard, which joined along the rows (:func:`mt_formats.spans.interleave_rows`)
    are the next bytes of the merged tensor; "check": bytes only verified (vocabulary padding,
    the copies of replicated and tied tensors)."""

    kind: str
    windows: tuple[Window, ...]
    rows: int = 0


def merge_groups(style: str, spans: Sequence[FileSpan], specs: Sequence[TensorSpec],
                 vocab_size: int, stage: int, copies: dict[tuple[int, int], FileSpan],
                 chunk: int) -> list[ReadGroup] | None:
    """Every byte of a tensor's shards (``spans``: one per TP rank of pipeline stage
    ``stage``; ``copies``: its copies on other stages, by (stage, rank)) in read groups of
    at most ``chunk`` bytes (or one row of every shard, if larger): first those whose bytes
    are the merged tensor's, in order, then those only verified. None where merging is not
    a concatenation of byte ranges or of rows (:func:`merge_pieces`, :func:`row_count`).
    The windows of each file tile its tensor, so the file's CRC follows from theirs."""
    rows = row_count(style, specs)
    groups: list[ReadGroup] = []
    if rows:
        widths = [span.length // rows for span in spans]
        step = max(1, chunk // max(1, sum(widths)))
        for first in range(0, rows, step):
            count = min(step, rows - first)
            groups.append(ReadGroup("rows", tuple(
                Window((stage, rank), first * width, span.sub(first * width, count * width))
                for rank, (span, width) in enumerate(zip(spans, widths))), count))
        covered = [span.length for span in spans]
    else:
        pieces = merge_pieces(style, spans, specs, vocab_size)
        if pieces is None:
            return None
        groups += _packed("data", [
            Window((stage, piece.rank), piece.offset + start, piece.span.sub(start, length))
            for piece in pieces for start, length in _windows(piece.span.length, chunk)],
            chunk)
        covered = [0] * len(spans)
        for piece in pieces:
            covered[piece.rank] += piece.span.length
    rest = [Window((stage, rank), done + start, span.sub(done + start, length))
            for rank, (span, done) in enumerate(zip(spans, covered)) if done < span.length
            for start, length in _windows(span.length - done, chunk)]
    rest += [Window(key, start, span.sub(start, length)) for key, span in copies.items()
             for start, length in _windows(span.length, chunk)]
    return groups + _packed("check", rest, chunk)


def _windows(length: int, chunk: int) -> list[tuple[int, int]]:
    """(start, length) of consecutive windows of at most ``chunk`` bytes covering
    ``length`` bytes (one empty window for none)."""
    return [(start, min(chunk, length - start)) for start in range(0, length, chunk)] or [
        (0, 0)]


def _packed(kind: str, windows: list[Window], chunk: int) -> list[ReadGroup]:
    """``windows`` in order, consecutive ones together while they fit in ``chunk`` bytes."""
    groups: list[ReadGroup] = []
    batch: list[Window] = []
    size = 0
    for window in windows:
        if batch and size + window.span.length > chunk:
            groups.append(ReadGroup(kind, tuple(batch)))
            batch, size = [], 0
        batch.append(window)
        size += window.span.length
    if batch:
        groups.append(ReadGroup(kind, tuple(batch)))
    return groups


@dataclass(frozen=True)
class Segment:
    """Bytes of a shard taken from its canonical tensor's bytes: ``rows`` rows of ``width``
    bytes, the first at ``start``, each ``stride`` bytes after the one before (one row: a
    byte range); ``rows`` 0: ``width`` zero bytes (padding)."""

    start: int
    width: int
    rows: int = 1
    stride: int = 0

    @property
    def end(self) -> int:
        """One past the last source byte it takes."""
        return self.start + (self.rows - 1) * self.stride + self.width if self.rows else 0


def shard_segments(style: str, spec: TensorSpec, rank: int, tp: int, pad_multiple: int
                   ) -> list[Segment] | None:
    """Rank ``rank``'s shard (``mt_tensor_parallel.shard_tensor``) as segments of the
    canonical tensor's bytes, in the shard's order and taking the source bytes in
    increasing order (so a writer can cut the shard out of the bytes as they stream by:
    :class:`ShardCutter`); None where it is not so (e.g. a divisibility error, which
    ``shard_tensor`` then reports)."""
    tensor = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
    size = spec.dtype.itemsize
    segments: list[Segment] = []
    try:
        parts = shard_parts(style, tensor, rank, tp, pad_multiple)
    except ValueError:  # e.g. not divisible: shard_tensor says so when the tensor is sliced
        return None
    for part in parts:
        if isinstance(part, int):
            segments.append(Segment(0, part, 0))
            continue
        if part is not tensor and part._base is not tensor:
            return None  # not a view of the tensor: shard_tensor's own result
        if part.numel() == 0:
            continue
        start = part.storage_offset() * size
        if part.is_contiguous():
            segments.append(Segment(start, part.numel() * size))
            continue
        width, strides, shape = part.shape[-1], part.stride(), part.shape
        if part.dim() < 2 or strides[-1] != 1 or any(
                strides[i] != strides[i + 1] * shape[i + 1] for i in range(part.dim() - 2)):
            return None
        segments.append(Segment(start, width * size, part.numel() // width, strides[-2] * size))
    ends = [segment.end for segment in segments if segment.rows]
    starts = [segment.start for segment in segments if segment.rows]
    if any(begin < end for begin, end in zip(starts[1:], ends)):
        return None
    return segments


class ShardCutter:
    """Cuts one shard's bytes (its :func:`shard_segments`) out of the canonical tensor's
    bytes as they stream by, chunk after chunk (:meth:`cut`), then :meth:`finish`."""

    def __init__(self, segments: Sequence[Segment], scratch: ScratchBuffer) -> None:
        self._segments = list(segments)
        self._next = 0  # the first segment not yet cut whole
        self._scratch = scratch

    def cut(self, begin: int, data: memoryview) -> Iterator[memoryview]:
        """The shard's next bytes found in ``data``, the source's bytes from ``begin`` on
        (each piece valid until the next is taken)."""
        end = begin + len(data)
        array = np.frombuffer(data, dtype=np.uint8)
        while self._next < len(self._segments):
            segment = self._segments[self._next]
            if segment.rows and segment.start >= end:
                return
            if not segment.rows:  # padding, once the segments before it are whole
                yield from zero_chunks(segment.width)
            elif segment.end > begin:
                yield from self._rows(segment, begin, array)
            if segment.rows and segment.end > end:
                return
            self._next += 1

    def finish(self) -> Iterator[memoryview]:
        """The padding after the last source bytes (the shard is then whole, if every
        chunk was cut)."""
        for segment in self._segments[self._next:]:
            if not segment.rows:
                yield from zero_chunks(segment.width)
        self._next = len(self._segments)

    def _rows(self, segment: Segment, begin: int, array: np.ndarray) -> Iterator[memoryview]:
        end = begin + len(array)
        if segment.rows == 1:
            low, high = max(segment.start, begin), min(segment.end, end)
            yield memoryview(array[low - begin:high - begin])
            return
        stride, width = segment.stride, segment.width
        row = segment.start - begin  # where row 0 starts, relative to the chunk
        first = max(0, -(-(-row - width + 1) // stride))  # rows that reach into the chunk
        last = min(segment.rows, (len(array) - 1 - row) // stride + 1)  # exclusive
        if first < last and row + first * stride < 0:  # a row begun in an earlier chunk
            low = row + first * stride
            yield memoryview(array[0:min(low + width, len(array))])
            first += 1
        tail = None
        if first < last and row + (last - 1) * stride + width > len(array):  # ends later
            last -= 1
            tail = row + last * stride
        if first < last:  # whole rows, gathered
            count, at = last - first, row + first * stride
            rows = np.lib.stride_tricks.as_strided(array[at:], shape=(count, width),
                                                   strides=(stride, 1), writeable=False)
            out = self._scratch.take(count * width)
            np.copyto(out.reshape(count, width), rows)
            yield memoryview(out)
        if tail is not None:
            yield memoryview(array[tail:])


def shard_parts(style: str, tensor: torch.Tensor, rank: int, tp: int, pad_multiple: int
                ) -> list[Part]:
    """Rank ``rank``'s shard of ``tensor`` as views (and a count of zero padding bytes)
    whose bytes, joined, are exactly those of ``mt_tensor_parallel.shard_tensor`` (the
    tests check it): writing them needs no copy of the shard."""
    if tp == 1 and style != "vocab" or style == "replicate":
        return [tensor]
    if style == "vocab":
        padded = padded_vocab_size(tensor.shape[0], tp, pad_multiple)
        start, end = vocab_range(padded, rank, tp)
        real = min(end, tensor.shape[0])
        row = tensor[0].numel() * tensor.element_size() if tensor.dim() else 0
        return [tensor[start:max(real, start)], (end - max(real, start)) * row]
    if style in _FUSED and tensor.shape[0] % (_FUSED[style] * tp) == 0:
        n = _FUSED[style]  # [q; k; v] or a pair: this rank's slice of each block
        blocks = tensor.reshape(n, tensor.shape[0] // n, *tensor.shape[1:])
        return [blocks[c].narrow(0, rank * blocks.shape[1] // tp, blocks.shape[1] // tp)
                for c in range(n)]
    dim = 0 if style == "column" else tensor.dim() - 1
    if style not in ("column", "row") or tensor.shape[dim] % tp:
        # Unknown styles and divisibility errors: let the reference raise its message.
        return [shard_tensor(style, tensor, rank, tp, pad_multiple=pad_multiple)]
    piece = tensor.shape[dim] // tp
    return [tensor.narrow(dim, rank * piece, piece)]


def in_file(part: Part, tensor: torch.Tensor, span: FileSpan) -> Part:
    """A contiguous view of ``tensor`` (stored as-is at ``span``) as a byte range of the
    file; anything else unchanged."""
    if not isinstance(part, torch.Tensor) or not part.is_contiguous() or not (
            tensor.is_contiguous()):
        return part
    start = (part.storage_offset() - tensor.storage_offset()) * part.element_size()
    return span.sub(start, part.numel() * part.element_size())


def tiles(tensor: torch.Tensor, parts: list[list[Part]]) -> bool:
    """Whether the parts are contiguous views of a contiguous ``tensor`` (or padding), so
    :func:`source_crc` can assemble its CRC from theirs."""
    return tensor.is_contiguous() and all(
        isinstance(part, int) or part.is_contiguous() for rank_parts in parts
        for part in rank_parts)


def source_crc(tensor: torch.Tensor, parts: list[list[Part]], crcs: list[list[int]]
                ) -> str | None:
    """The CRC (:data:`CHECKSUM_ALGORITHM`) of ``tensor`` from those of its shards' parts,
    when they are contiguous views tiling it (None otherwise, e.g. row slices)."""
    if not tensor.is_contiguous() or any(len(p) != len(c) for p, c in zip(parts, crcs)):
        return None
    pieces, base = [], tensor.storage_offset()
    for rank_parts, rank_crcs in zip(parts, crcs):
        for part, crc in zip(rank_parts, rank_crcs):
            if isinstance(part, int):
                continue  # padding: not in the source
            if not part.is_contiguous():
                return None
            pieces.append(((part.storage_offset() - base) * part.element_size(),
                           part.numel() * part.element_size(), crc))
    crc = join_crcs(pieces, tensor.numel() * tensor.element_size())
    return None if crc is None else f"{CHECKSUM_ALGORITHM}:{crc:08x}"
