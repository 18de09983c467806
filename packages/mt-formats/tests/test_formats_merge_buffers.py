"""The merge of sharded checkpoints streams every tensor in chunks read ahead into reused
buffers (mt_formats.spans.ReadAhead over SpanBuffer, O_DIRECT where the file system allows):
the bytes it hands the writer are exactly the in-memory merge's (merge_shards), row-parallel
shards included, however the chunks fall, and the reads are the file's bytes at any offset
and length, direct or buffered."""

from __future__ import annotations

import os
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

from mt_formats import convert_checkpoint, save_model, sharded, spans
from mt_formats.canonical import Streamed
from mt_formats.sharded import ShardedReader
from mt_formats.spans import FileSpan, ReadAhead, SpanBuffer, interleave_rows, open_direct
from mt_model import GPT, preset


@pytest.mark.parametrize("chunk", [sharded._CHUNK, 4096, 1000])
def test_convert_merge_streams_are_the_in_memory_merge(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        chunk: int) -> None:
    # small chunks: tensors in many read groups, rows in windows, groups of several tensors
    # ahead of the one taken
    monkeypatch.setattr(sharded, "_CHUNK", chunk)
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
    monkeypatch.setattr(sharded, "_CHUNK", 4096)
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
                views = buffer.read(chunk)
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
