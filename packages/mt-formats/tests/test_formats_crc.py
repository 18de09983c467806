"""Hash-once verification: CRC combination (CRC-32C and zlib's CRC-32), shards written as
views of the source tensor (bytes equal to mt_tensor_parallel's slices), and a corrupted
source byte caught whether its checksum comes from the written shards (column, vocab, qkv)
or a pass over the source run alongside them (row)."""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import crc32c
import pytest
import torch

from mt_formats import ConvertError, convert_checkpoint, load_state_dict, save_model, streams
from mt_formats.crc import algorithm_of, crc32_combine, crc_combine, digest, join_crcs
from mt_formats.shard_pieces import shard_parts
from mt_model import GPT, preset
from mt_tensor_parallel import shard_tensor


@pytest.mark.parametrize(("algorithm", "crc"), [
    ("crc32c", lambda data: crc32c.crc32c(data)), ("crc32", zlib.crc32)])
def test_convert_crc_combine_matches_the_crc_of_the_concatenation(
        algorithm: str, crc: Callable[[bytes], int]) -> None:
    data = os.urandom(5000)
    for cut in (0, 1, 7, 2500, 4999, 5000):
        a, b = data[:cut], data[cut:]
        assert crc_combine(crc(a), crc(b), len(b), algorithm) == crc(data), cut
    pieces = [(0, 1000, crc(data[:1000])), (1000, 3000, crc(data[1000:4000])),
              (4000, 1000, crc(data[4000:]))]
    assert join_crcs(pieces + pieces[:1], 5000, algorithm) == crc(data)  # a copy: once
    assert join_crcs(pieces[1:], 5000, algorithm) is None  # a hole: no checksum
    assert join_crcs(pieces[:2], 5000, algorithm) is None  # short: no checksum
    assert crc32_combine(zlib.crc32(data[:9]), zlib.crc32(data[9:]), 4991) == zlib.crc32(data)
    big = os.urandom(1 << 20)  # lengths with many bits set exercise every power table entry
    assert crc_combine(crc(big[:12345]), crc(big[12345:]), len(big) - 12345,
                       algorithm) == crc(big)


def test_convert_checksum_strings_name_their_kind() -> None:
    data = os.urandom(100)
    assert digest(data) == f"crc32c:{crc32c.crc32c(data):08x}"  # what writers record
    assert digest(data, "crc32") == f"crc32:{zlib.crc32(data):08x}"
    assert algorithm_of(digest(data)) == "crc32c"
    assert algorithm_of(digest(data, "crc32")) == "crc32"
    assert algorithm_of(digest(data, "sha256")) == "sha256"
    with pytest.raises(ConvertError, match=r"unrecognised checksum 'adler32:00000001' "
                                           r"\(supported: 'crc32c:' or 'crc32:'"):
        algorithm_of("adler32:00000001")
    with pytest.raises(ConvertError, match=r"unknown checksum algorithm 'md5'; supported: "
                                           r"crc32c, crc32, sha256"):
        digest(data, "md5")


def _joined(parts: list[torch.Tensor | int]) -> torch.Tensor:
    return torch.cat([torch.zeros(p, dtype=torch.uint8) if isinstance(p, int)
                      else p.contiguous().reshape(-1).view(torch.uint8) for p in parts])


@pytest.mark.parametrize(("style", "shape"), [
    ("replicate", (6,)), ("column", (8, 4)), ("column", (8,)), ("column_qkv", (12, 4)),
    ("column_qkv", (12,)), ("row", (4, 8)), ("vocab", (50, 4)), ("vocab", (300, 2))])
def test_convert_shard_parts_are_the_bytes_of_shard_tensor(style: str,
                                                           shape: tuple[int, ...]) -> None:
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    for tp in (1, 2, 4):
        for pad in (1, 8, 128):
            for rank in range(tp):
                want = shard_tensor(style, tensor, rank, tp, pad_multiple=pad)
                got = _joined(shard_parts(style, tensor, rank, tp, pad))
                assert torch.equal(got, want.contiguous().reshape(-1).view(torch.uint8))


def _flip_byte(directory: Path, name: str) -> None:
    """Flip one data byte of tensor ``name`` in ``directory/model.safetensors``."""
    path = directory / "model.safetensors"
    raw = bytearray(path.read_bytes())
    header_len = struct.unpack("<Q", raw[:8])[0]
    start = json.loads(raw[8:8 + header_len])[name]["data_offsets"][0]
    raw[8 + header_len + start + 5] ^= 0x10
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("name", ["blocks.0.mlp.fc.weight", "blocks.0.attn.qkv.weight",
                                  "embed.tokens.weight", "blocks.1.mlp.proj.weight"])
def test_convert_corrupted_source_is_caught_while_resharding(tmp_path: Path,
                                                             name: str) -> None:
    model = GPT(preset("tiny").replace(n_layers=2), seed=4)
    save_model(model, tmp_path / "src")
    convert_checkpoint(tmp_path / "src", tmp_path / "good", to="tp", tp=2, pp=2)
    _, state = load_state_dict(tmp_path / "good")
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    _flip_byte(tmp_path / "src", name)
    with pytest.raises(ConvertError, match=rf"model\.safetensors: checksum mismatch for "
                                           rf"tensor '{name}' \(file metadata says crc32c:"):
        convert_checkpoint(tmp_path / "src", tmp_path / "bad", to="tp", tp=2, pp=2)
    assert not (tmp_path / "bad").exists()


def _flip_shard_byte(path: Path, name: str, from_end: bool) -> None:
    """Flip a data byte of ``name`` in the safetensors file ``path``: near its start, or its
    last byte (vocabulary padding rows, for the last TP rank of the token embedding)."""
    raw = bytearray(path.read_bytes())
    header_len = struct.unpack("<Q", raw[:8])[0]
    start, end = json.loads(raw[8:8 + header_len])[name]["data_offsets"]
    raw[8 + header_len + (end - 1 if from_end else start + 5)] ^= 0x10
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(("file", "name", "from_end"), [
    ("pp_rank_00_tp_rank_01", "blocks.0.mlp.fc.weight", False),  # column
    ("pp_rank_00_tp_rank_01", "blocks.0.attn.qkv.weight", True),  # fused qkv, v block
    ("pp_rank_00_tp_rank_01", "embed.tokens.weight", True),  # vocabulary padding
    ("pp_rank_01_tp_rank_00", "embed.tokens.weight", False),  # the tied copy
    ("pp_rank_01_tp_rank_01", "ln_f.weight", False),  # a replicated copy
    ("pp_rank_01_tp_rank_01", "blocks.1.mlp.proj.weight", False),  # row (rows interleaved)
])
@pytest.mark.parametrize("chunk", [streams.CHUNK, 4096])
def test_convert_merge_file_to_file_verifies_every_shard(tmp_path: Path, file: str, name: str,
                                                         from_end: bool, chunk: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """TP 2 x PP 2 -> consolidated streams byte ranges of the shards; every shard's bytes
    (padding and copies included) are still checked, in whichever read group they fall, and
    a failure leaves nothing."""
    monkeypatch.setattr(streams, "CHUNK", chunk)
    model = GPT(preset("tiny").replace(n_layers=2), seed=5)
    assert preset("tiny").vocab_size % 256  # the last TP rank holds padding rows
    save_model(model, tmp_path / "src")
    convert_checkpoint(tmp_path / "src", tmp_path / "tp", to="tp", tp=2, pp=2)
    convert_checkpoint(tmp_path / "tp", tmp_path / "good")
    assert (tmp_path / "good" / "model.safetensors").read_bytes() == (
        tmp_path / "src" / "model.safetensors").read_bytes()
    _flip_shard_byte(tmp_path / "tp" / file / "model.safetensors", name, from_end)
    with pytest.raises(ConvertError, match=rf"{file}/model\.safetensors: checksum mismatch "
                                           rf"for tensor '{name}' \(file metadata says "
                                           "crc32c:"):
        convert_checkpoint(tmp_path / "tp", tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
