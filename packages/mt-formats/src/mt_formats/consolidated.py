"""The consolidated format: one ``model.safetensors`` with the full canonical tensors and a
``config.json`` manifest (model config, format version, per-tensor CRC-32 checksums).

Tensor names are ``mt_model.GPT``'s state-dict names; the tied embedding is stored once as
``embed.tokens.weight``. This is the hub every other conversion can go through, and the
easiest file to inspect by hand.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mt_formats.canonical import (
    CheckpointReader,
    CheckpointWriter,
    Deferred,
    Pieces,
    Streamed,
    TensorRef,
    canonical_shapes,
)
from mt_formats.crc import CHECKSUM_ALGORITHM, crc_kind, join_crcs
from mt_formats.errors import ConvertError
from mt_formats.manifest import (
    FileEntries,
    model_metadata,
    open_checked,
    read_manifest,
    write_manifest,
)
from mt_formats.safetensors_io import SafetensorsWriter
from mt_formats.streams import Found, Plan, StreamingReader, span_groups
from mt_formats.tensors import TensorSpec
from mt_model import GPTConfig

__all__ = ["CONSOLIDATED_FORMAT", "ConsolidatedReader", "ConsolidatedWriter", "MODEL_FILE"]

CONSOLIDATED_FORMAT = "mt-consolidated"
MODEL_FILE = "model.safetensors"


class ConsolidatedReader(StreamingReader, CheckpointReader):
    """Reads a consolidated checkpoint directory; structure is checked on open."""

    format = "consolidated"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        manifest = read_manifest(self.root, CONSOLIDATED_FORMAT)
        self.config = manifest.config
        self._shapes = canonical_shapes(self.config)
        extra = sorted(set(manifest.files) - {MODEL_FILE})
        if extra:
            raise ConvertError(f"{manifest.path}: unexpected files {extra} in a consolidated "
                               f"checkpoint (only {MODEL_FILE})")
        self._file = open_checked(self.root, manifest, MODEL_FILE, self._shapes)

    def names(self) -> list[str]:
        return list(self._shapes)

    def spec(self, name: str) -> TensorSpec:
        return self._file.spec(name)

    def sources(self, name: str) -> list[TensorRef]:
        return [TensorRef(MODEL_FILE, name, self.spec(name))]

    def read(self, name: str) -> torch.Tensor:
        return self._file.get(name)

    def read_stream(self, name: str) -> Streamed | None:
        """``name``'s bytes in chunks of whole rows (:mod:`mt_formats.streams`), verified
        against the file's checksum after the last one."""
        return self._stream(name)

    def _stream_plan(self, name: str) -> Plan | None:
        return self.spec(name), span_groups(self._file.span(name), self.spec(name))

    def _stream_verify(self, name: str, found: Found) -> None:
        crc = join_crcs(found[(0, 0)], self._file.span(name).length)
        assert crc is not None, f"{name}: the windows read do not tile it"
        kind = crc_kind(CHECKSUM_ALGORITHM)
        assert kind is not None
        self._file.verify(name, None, kind.format(crc))

    def read_deferred(self, name: str) -> tuple[torch.Tensor, Deferred | None]:
        tensor = self._file.get(name, verify=False)
        return tensor, Deferred(lambda checksum: self._file.verify(name, tensor, checksum),
                                self._file.span(name))

    def close(self) -> None:
        self._close_streams()
        self._file.close()


class ConsolidatedWriter(CheckpointWriter):
    """Writes ``model.safetensors`` tensor by tensor, then ``config.json``."""

    format = "consolidated"

    def __init__(self, config: GPTConfig, specs: dict[str, TensorSpec]) -> None:
        super().__init__(config, specs)
        self._writer: SafetensorsWriter | None = None
        self._directory: Path | None = None

    def targets(self, name: str) -> list[TensorRef]:
        return [TensorRef(MODEL_FILE, name, self.specs[name])]

    def open(self, directory: Path) -> None:
        self._directory = Path(directory)
        self._writer = SafetensorsWriter(self._directory / MODEL_FILE, self.specs,
                                         {"mt.format": CONSOLIDATED_FORMAT,
                                          **model_metadata(self.config)})

    def write(self, name: str, tensor: torch.Tensor) -> str:
        assert self._writer is not None, "open() first"
        return self._writer.write(name, tensor)  # the checksum of exactly these bytes

    accepts_pieces = True

    def write_pieces(self, name: str, pieces: Pieces) -> list[int]:
        assert self._writer is not None, "open() first"
        crcs: list[int] = []  # copied in the kernel, hashed from a reused buffer
        self._writer.write_parts(name, list(pieces.spans), None, crcs)
        return crcs

    def write_streamed(self, name: str, streamed: Streamed) -> None:
        assert self._writer is not None, "open() first"
        self._writer.write_stream(name, streamed, lambda: streamed.crc)

    def finish(self) -> None:
        assert self._writer is not None and self._directory is not None, "open() first"
        checksums = self._writer.close()
        entries: FileEntries = {name: (self.specs[name], checksums[name]) for name in self.specs}
        write_manifest(self._directory, CONSOLIDATED_FORMAT, self.config, {},
                       {MODEL_FILE: entries})

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
