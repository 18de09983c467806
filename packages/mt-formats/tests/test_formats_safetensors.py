"""The streaming safetensors writer/reader: format compatibility, checksums, clear errors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import crc32c
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mt_formats.errors import ConvertError
from mt_formats.safetensors_io import CHECKSUM_KEY, SafetensorsReader, SafetensorsWriter
from mt_formats.tensors import TensorSpec, tensor_checksum, tensor_sha256


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "b.small": torch.randn(3, generator=gen).to(torch.bfloat16),
        "a.matrix": torch.randn(5, 7, generator=gen),
        "ids": torch.arange(11, dtype=torch.int64),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
    }


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _write(path: Path, tensors: dict[str, torch.Tensor], order: list[str]) -> dict[str, str]:
    with SafetensorsWriter(path, {k: TensorSpec.of(v) for k, v in tensors.items()},
                           {"note": "x"}) as writer:
        for key in order:
            writer.write(key, tensors[key])
    with safe_open(str(path), "pt") as handle:
        return json.loads(handle.metadata()[CHECKSUM_KEY])


def test_convert_writer_output_is_read_by_the_safetensors_library(tmp_path: Path) -> None:
    tensors = _tensors()
    order = ["ids", "empty", "scalar", "a.matrix", "flags", "b.small"]  # any order works
    checksums = _write(tmp_path / "m.safetensors", tensors, order)
    loaded = load_file(str(tmp_path / "m.safetensors"))
    assert set(loaded) == set(tensors)
    for key, tensor in tensors.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
        assert checksums[key] == tensor_checksum(tensor)
        assert checksums[key] == f"crc32c:{crc32c.crc32c(_bytes(tensor)):08x}"
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as handle:
        assert handle.metadata()["format"] == "pt" and handle.metadata()["note"] == "x"
    # the data section starts 8-byte aligned, as the reference writer does
    header_len = struct.unpack("<Q", (tmp_path / "m.safetensors").read_bytes()[:8])[0]
    assert header_len % 8 == 0


def test_convert_reader_reads_reference_files_and_verifies(tmp_path: Path) -> None:
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    reader = SafetensorsReader(tmp_path / "ref.safetensors",
                               {k: tensor_sha256(v) for k, v in tensors.items()})
    assert sorted(reader.keys()) == sorted(tensors)
    assert reader.spec("a.matrix") == TensorSpec((5, 7), torch.float32)
    assert all(torch.equal(reader.get(k), v) for k, v in tensors.items())
    reader.close()
    wrong = SafetensorsReader(tmp_path / "ref.safetensors", {"ids": "f" * 64})
    with pytest.raises(ConvertError, match=r"ref\.safetensors: checksum mismatch for tensor "
                                           r"'ids' \(manifest says"):
        wrong.get("ids")
    wrong.close()


def test_convert_corrupted_byte_names_file_and_tensor(tmp_path: Path) -> None:
    tensors = {"first": torch.ones(64), "second": torch.full((64,), 2.0)}
    path = tmp_path / "c.safetensors"
    _write(path, tensors, ["first", "second"])
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF  # inside the last tensor ("second", laid out after "first")
    path.write_bytes(bytes(raw))
    reader = SafetensorsReader(path)
    assert torch.equal(reader.get("first"), tensors["first"])
    with pytest.raises(ConvertError, match=r"c\.safetensors: checksum mismatch for tensor "
                                           r"'second' \(file metadata says"):
        reader.get("second")
    reader.close()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_convert_malformed_file_names_the_file(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "bad.safetensors"
    _write(path, {"w": torch.ones(100)}, ["w"])
    raw = path.read_bytes()
    damaged = {"truncate": raw[:-10], "garbage": b"\x10" + b"\x00" * 7 + b"{not json",
               "empty": b""}[damage]
    path.write_bytes(damaged)
    with pytest.raises(ConvertError, match=r"bad\.safetensors: not a readable safetensors "
                                           r"file \(malformed or truncated\)"):
        SafetensorsReader(path)


def test_convert_writer_rejects_bad_use(tmp_path: Path) -> None:
    specs = {"w": TensorSpec((2, 3), torch.float32), "b": TensorSpec((3,), torch.float32)}
    writer = SafetensorsWriter(tmp_path / "w.safetensors", specs)
    with pytest.raises(ConvertError, match=r"tensor 'w' is \[3, 2\] F32, the layout expects "
                                           r"\[2, 3\] F32"):
        writer.write("w", torch.zeros(3, 2))
    with pytest.raises(ConvertError, match="'x' is not in the planned layout"):
        writer.write("x", torch.zeros(1))
    writer.write("w", torch.zeros(2, 3))
    with pytest.raises(ConvertError, match="'w' written twice"):
        writer.write("w", torch.zeros(2, 3))
    with pytest.raises(ConvertError, match=r"tensors never written: \['b'\]"):
        writer.close()
    with pytest.raises(ConvertError, match="missing.safetensors: file not found"):
        SafetensorsReader(tmp_path / "missing.safetensors")


def test_convert_write_parts_joins_views_padding_and_strided_parts(tmp_path: Path) -> None:
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    parts = [full[:, 1:3], 8, full[1]]  # strided, 8 zero bytes (2 floats), contiguous row
    want = torch.cat([full[:, 1:3].reshape(-1), torch.zeros(2), full[1]])
    path = tmp_path / "p.safetensors"
    with SafetensorsWriter(path, {"x": TensorSpec((16,), torch.float32)}) as writer:
        checksum = writer.write_parts("x", parts)
    assert checksum == tensor_checksum(want)
    assert torch.equal(load_file(str(path))["x"], want)
    writer = SafetensorsWriter(tmp_path / "q.safetensors", {"x": TensorSpec((16,),
                                                                            torch.float32)})
    with pytest.raises(ConvertError, match=r"q\.safetensors: tensor 'x' gets 60 bytes .* "
                                           r"expects \[16\] F32 \(64 bytes\)"):
        writer.write_parts("x", [full[:, 1:3], 4, full[1]])
    writer.abort()


def test_convert_sha256_files_of_format_version_1_are_still_verified(tmp_path: Path) -> None:
    tensors = {"w": torch.randn(8, 3), "b": torch.ones(3)}
    path = tmp_path / "old.safetensors"
    with SafetensorsWriter(path, {k: TensorSpec.of(v) for k, v in tensors.items()},
                           algorithm="sha256") as writer:
        for key, tensor in tensors.items():
            assert writer.write(key, tensor) == tensor_sha256(tensor)
    with safe_open(str(path), "pt") as handle:  # version 1's metadata key and digests
        assert json.loads(handle.metadata()["mt.sha256"])["w"] == tensor_sha256(tensors["w"])
    reader = SafetensorsReader(path, {"w": tensor_sha256(tensors["w"])})
    assert torch.equal(reader.get("w"), tensors["w"])
    reader.close()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # last byte: inside the last tensor of the layout
    path.write_bytes(bytes(data))
    reader = SafetensorsReader(path)
    with pytest.raises(ConvertError, match=r"old\.safetensors: checksum mismatch for tensor"):
        for key in reader.keys():
            reader.get(key)
    reader.close()
    with pytest.raises(ConvertError, match=r"unrecognised checksum 'md5:00'"):
        SafetensorsReader(path, {"w": "md5:00"}).get("w")
