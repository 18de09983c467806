"""Conversions between consolidated and sharded checkpoints stream every tensor in chunks
read ahead into reused buffers (mt_formats.streams, mt_formats.spans.ReadAhead over
SpanBuffer, O_DIRECT where the file system allows): the bytes the merge hands the writer
are exactly the in-memory merge's (merge_shards), row-parallel shards included, however the
chunks fall; the shards the sharded writer cuts out of chunks are exactly shard_tensor's,
wherever the chunks end; and the reads are the file's bytes at any offset and length,
direct or buffered."""

from __future__ import annotations

import os
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

from mt_formats import ConvertError, convert_checkpoint, save_model, sharded, spans, streams
from mt_formats.canonical import Streamed
from mt_formats.shard_pieces import ShardCutter, shard_segments
from mt_formats.sharded import ShardedReader
from mt_formats.spans import (
    FileSpan,
    ReadAhead,
    ScratchBuffer,
    SpanBuffer,
    interleave_rows,
    open_direct,
)
from mt_formats.tensors import TensorSpec
from mt_model import GPT, preset
from mt_tensor_parallel import shard_tensor


@pytest.mark.parametrize("chunk", [streams.CHUNK, 4096, 1000])
def test_convert_merge_streams_are_the_in_memory_merge(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        chunk: int) -> None:
    # small chunks: tensors in many read groups, rows in windows, groups of several tensors
    # ahead of the one taken
    monkeypatch.setattr(streams, "CHUNK", chunk)
    model = GPT(preset("tiny").replace(n_layers=2), seed=7)
    save_model(model, tmp_path / "src")
    convert_checkpoint(tmp_path / "src", tmp_path / "tp", to="tp", tp=2, pp=2)
    styles = set()
    with ShardedReader(tmp_path / "tp") as reader:
        for name in reader.names():
            streamed = reader.read_pieces(name)
            assert isinstance(streamed, Streamed)
            got = b"".join(bytes(chunk) for chunk in streamed)
            want = reader.read(name).contiguous().reshape(-1).view(torch.uint8).numpy()
            assert got == want.tobytes(), name
            assert streamed.crc == crc32c.crc32c(got)
            styles.add(reader._layout.styles[name])
        # the memory the reader holds is its ring of groups of at most `chunk` bytes (or
        # one row of each shard), not the largest tensor
        rooms = []
        for name in reader.names():
            for group in reader._plan(name)[1]:
                size = sum(window.span.length for window in group.windows)
                assert size <= chunk or group.rows == 1, (name, group)
                rooms.append(SpanBuffer.room(window.span for window in group.windows))
        held = sum(len(buffer._buffer) for buffer in reader._ahead._free)
        assert held <= spans._SLOTS * max(rooms)
        if chunk == 4096:  # a group's buffer is a fraction of the largest tensor
            assert max(rooms) < reader.spec("embed.tokens.weight").nbytes
    assert {"row", "column", "column_qkv", "vocab", "replicate"} <= styles
    convert_checkpoint(tmp_path / "tp", tmp_path / "back")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (
        tmp_path / "src" / "model.safetensors").read_bytes()


def test_convert_merge_streams_in_any_order(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Streams taken out of the order of names(), or one abandoned for another, give the
    same bytes (the read-ahead starts over); resuming an abandoned one is refused."""
    monkeypatch.setattr(streams, "CHUNK", 4096)
    model = GPT(preset("tiny").replace(n_layers=2), seed=3)
    save_model(model, tmp_path / "src")
    convert_checkpoint(tmp_path / "src", tmp_path / "tp", to="tp", tp=2, pp=2)
    with ShardedReader(tmp_path / "tp") as reader:
        want = {name: reader.read(name).contiguous().reshape(-1).view(torch.uint8).numpy()
                .tobytes() for name in reader.names()}
        for name in reversed(reader.names()):
            streamed = reader.read_pieces(name)
            assert streamed is not None
            assert b"".join(bytes(chunk) for chunk in streamed) == want[name], name
        first, second = "embed.tokens.weight", "blocks.1.mlp.proj.weight"
        abandoned = iter(reader.read_pieces(first))
        next(abandoned)
        assert b"".join(bytes(c) for c in reader.read_pieces(second)) == want[second]
        with pytest.raises(RuntimeError, match="one at a time"):
            next(abandoned)


def test_convert_a_shard_cut_short_under_the_reader_is_named(tmp_path: Path) -> None:
    """A shard file truncated after it was opened (checked) fails the stream in one line
    naming the checkpoint and the tensor, as a fault of the source."""
    model = GPT(preset("tiny").replace(n_layers=2), seed=4)
    save_model(model, tmp_path / "src")
    convert_checkpoint(tmp_path / "src", tmp_path / "tp", to="tp", tp=2)
    with ShardedReader(tmp_path / "tp") as reader:
        reader.read_pieces(reader.names()[0])  # plans made: the header was read
        shard = tmp_path / "tp" / "tp_rank_01" / "model.safetensors"
        os.truncate(shard, shard.stat().st_size // 2)
        with pytest.raises(ConvertError) as caught:
            for first in reader.names():
                for _ in reader.read_pieces(first):
                    pass
        assert type(caught.value) is ConvertError  # not WriteFailed: the source is at fault
        assert str(caught.value).startswith(f"{tmp_path / 'tp'}: reading tensor ")
        assert "unexpected end of file" in str(caught.value)


def test_convert_read_ahead_reads_groups_in_order_ahead_of_use(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    data = os.urandom(3 << 20)
    path.write_bytes(data)
    fd, direct_fd = os.open(path, os.O_RDONLY), open_direct(path)
    drawn = []

    def groups():
        for index in range(40):
            start = index * 70001
            drawn.append(index)
            yield index, [FileSpan(fd, start, 70001 - index, direct_fd),
                          FileSpan(fd, start + 5, index, direct_fd)]

    try:
        ahead = ReadAhead(groups(), crc32c.crc32c, slots=3)
        assert drawn == [0, 1, 2]  # as many groups as slots are read before any is taken
        for index in range(40):
            tag, views, crcs = ahead.take()
            assert tag == index and len(drawn) == min(40, index + 3)
            start = index * 70001
            want = [data[start:start + 70001 - index], data[start + 5:start + 5 + index]]
            assert [bytes(view) for view in views] == want
            assert crcs == [crc32c.crc32c(part) for part in want]
        assert ahead.next_tag() is None
        ahead.close()
    finally:
        os.close(fd)
        if direct_fd >= 0:
            os.close(direct_fd)


@pytest.mark.parametrize(("style", "shape"), [
    ("column", (12, 5)), ("column_qkv", (12, 5)), ("column_pair", (8, 3)), ("row", (6, 8)),
    ("row", (2, 3, 12)), ("vocab", (13, 4)), ("replicate", (7,)), ("row", (4, 0))])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_convert_shard_cutter_is_shard_tensor_for_any_chunks(style: str, shape: tuple[int, ...],
                                                             tp: int) -> None:
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(tp))
    data = tensor.numpy().tobytes()
    spec = TensorSpec(tuple(shape), torch.float32)
    for rank in range(tp):
        want = shard_tensor(style, tensor, rank, tp, pad_multiple=2).contiguous()
        segments = shard_segments(style, spec, rank, tp, 2)
        assert segments is not None
        for size in (1, 3, 7, 20, 33, 4096):  # rows split anywhere, several in one chunk
            cutter, got = ShardCutter(segments, ScratchBuffer()), bytearray()
            for begin in range(0, len(data), size):
                for piece in cutter.cut(begin, memoryview(data[begin:begin + size])):
                    got += bytes(piece)
            for piece in cutter.finish():
                got += bytes(piece)
            assert bytes(got) == want.numpy().tobytes(), (style, rank, size)
    # not divisible: left to shard_tensor to explain, when the tensor is sliced in memory
    assert shard_segments("column", TensorSpec((5, 2), torch.float32), 0, 2, 2) is None
    with pytest.raises(ValueError, match="divisible"):
        shard_tensor("column", torch.zeros(5, 2), 0, 2)


def test_convert_tp_to_tp_streams_the_same_files(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """TP 2 x PP 2 -> TP 4 streams the merged chunks (not row-aligned) into the new shards:
    the files are those of the consolidated -> TP 4 reshape."""
    model = GPT(preset("tiny").replace(n_layers=2), seed=9)
    save_model(model, tmp_path / "src")
    convert_checkpoint(tmp_path / "src", tmp_path / "tp4", to="tp", tp=4)
    convert_checkpoint(tmp_path / "src", tmp_path / "tp2pp2", to="tp", tp=2, pp=2)
    monkeypatch.setattr(streams, "CHUNK", 1000)
    convert_checkpoint(tmp_path / "tp2pp2", tmp_path / "again", to="tp", tp=4)
    # where a shard is not a run of segments, the writer joins the chunks and slices them
    monkeypatch.setattr(sharded, "shard_segments", lambda *args: None)
    convert_checkpoint(tmp_path / "tp2pp2", tmp_path / "joined", to="tp", tp=4)
    for rank in range(4):
        file = f"tp_rank_{rank:02d}/model.safetensors"
        want = (tmp_path / "tp4" / file).read_bytes()
        assert (tmp_path / "again" / file).read_bytes() == want
        assert (tmp_path / "joined" / file).read_bytes() == want


@pytest.mark.parametrize("direct", [True, False])
def test_convert_span_buffer_reads_any_range(tmp_path: Path, direct: bool) -> None:
    path = tmp_path / "data.bin"
    data = os.urandom((17 << 20) + 12345)  # more than two 8 MiB requests
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    direct_fd = open_direct(path) if direct else -1
    if direct and direct_fd < 0:
        pytest.skip("no O_DIRECT on this file system")
    try:
        spans = [FileSpan(fd, offset, length, direct_fd) for offset, length in [
            (0, 4096), (1, 4095), (4095, 2), (12345, 9 << 20), (len(data) - 7, 7),
            (100, 0), (3, len(data) - 3)]]
        buffer = SpanBuffer()
        for count in (1, len(spans)):  # one at a time, and all at once after a reset
            for start in range(0, len(spans), count):
                chunk = spans[start:start + count]
                buffer.reset(SpanBuffer.room(chunk))
                views, _ = buffer.start(chunk).result()
                assert [bytes(v) for v in views] == [
                    data[s.offset:s.offset + s.length] for s in chunk]
    finally:
        os.close(fd)
        if direct_fd >= 0:
            os.close(direct_fd)


def test_convert_interleave_rows_is_cat_along_the_last_dimension() -> None:
    generator = torch.Generator().manual_seed(0)
    shards = [torch.randn(5, width, generator=generator) for width in (3, 3, 2)]
    sources = [memoryview(s.numpy().tobytes()) for s in shards]
    out = np.empty(sum(len(s) for s in sources), dtype=np.uint8)
    interleave_rows(sources, 5, out)
    assert out.tobytes() == torch.cat(shards, dim=-1).numpy().tobytes()
    with pytest.raises(ValueError, match="not 7 rows"):
        interleave_rows(sources, 7, out)
