"""The merge of sharded checkpoints reads every tensor into reused buffers
(mt_formats.spans.SpanBuffer, O_DIRECT where the file system allows): the bytes it hands the
writer are exactly the in-memory merge's (merge_shards), row-parallel shards included, and
the reads are the file's bytes at any offset and length, direct or buffered."""

from __future__ import annotations

import os
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

from mt_formats import convert_checkpoint, save_model
from mt_formats.canonical import Buffered
from mt_formats.sharded import ShardedReader
from mt_formats.spans import FileSpan, SpanBuffer, interleave_rows, open_direct
from mt_model import GPT, preset


def test_convert_merge_buffers_are_the_in_memory_merge(tmp_path: Path) -> None:
    model = GPT(preset("tiny").replace(n_layers=2), seed=7)
    save_model(model, tmp_path / "src")
    convert_checkpoint(tmp_path / "src", tmp_path / "tp", to="tp", tp=2, pp=2)
    styles = set()
    with ShardedReader(tmp_path / "tp") as reader:
        for name in reader.names():
            buffered = reader.read_pieces(name)
            assert isinstance(buffered, Buffered)
            got = b"".join(bytes(part) for part in buffered.data)
            want = reader.read(name).contiguous().reshape(-1).view(torch.uint8).numpy()
            assert got == want.tobytes(), name
            assert buffered.crc == crc32c.crc32c(got)
            styles.add(reader._layout.styles[name])
    assert {"row", "column", "column_qkv", "vocab", "replicate"} <= styles
    convert_checkpoint(tmp_path / "tp", tmp_path / "back")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (
        tmp_path / "src" / "model.safetensors").read_bytes()


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
