"""Streaming safetensors files with per-tensor checksums.

The writer is our own (the format is an 8-byte little-endian header length, a JSON header,
then the raw tensor bytes) because ``safetensors.torch.save_file`` needs every tensor in
memory at once. Here the header is computed from the shapes up front and each tensor is
written at its offset as soon as it is produced, so peak memory is one tensor. The
checksums go into the header's ``__metadata__`` under ``mt.checksums``: the header is first
written with placeholder digests of the same length and rewritten when the file is
complete, so the header size never changes.

Checksums are :mod:`mt_formats.crc` strings: ``"crc32c:1a2b3c4d"`` (CRC-32C of the raw
bytes, what this version writes; a conversion hashes every byte it reads and every byte it
writes, and the CPU's CRC instructions make that cheap), ``"crc32:..."`` (zlib's CRC-32,
format version 2) or a bare 64-digit SHA-256 hex digest (format version 1, under the
metadata key ``mt.sha256``). All are still read and verified.

Reading uses ``safetensors.safe_open`` (memory-mapped, nothing unpickled); every failure is
turned into a :class:`~mt_formats.errors.ConvertError` naming the file and the tensor.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open

from mt_checkpoint import DirectFile
from mt_formats.crc import CHECKSUM_ALGORITHM, _Hasher, algorithm_of, crc_combine, crc_kind, digest
from mt_formats.errors import ConvertError
from mt_formats.spans import FileSpan, copy_span, open_direct, read_ahead
from mt_formats.tensors import TensorSpec, dtype_from_name, dtype_name, raw_bytes

__all__ = [
    "CHECKSUM_KEY",
    "LEGACY_CHECKSUM_KEY",
    "Part",
    "SafetensorsReader",
    "SafetensorsWriter",
]

CHECKSUM_KEY = "mt.checksums"
"""``__metadata__`` key holding a JSON object ``{tensor name: checksum of its bytes}``."""
LEGACY_CHECKSUM_KEY = "mt.sha256"
"""Format version 1's key (``{tensor name: sha256 hex}``); still read."""

_ZEROS = bytes(1 << 20)  # immutable source of padding bytes
_WRITEBACK_MIN = 1 << 20  # bytes of one tensor worth starting its writeback early

Part = torch.Tensor | int | FileSpan
"""A piece of a stored tensor: a tensor (any strides), a count of zero bytes, or a byte
range of another file (copied in the kernel)."""


def zero_chunks(count: int) -> Iterator[memoryview]:
    """``count`` zero bytes (padding), as views of one constant block."""
    for start in range(0, count, len(_ZEROS)):
        yield memoryview(_ZEROS)[:min(len(_ZEROS), count - start)]


def _placeholder(algorithm: str) -> str:
    # Same length as a real digest, so the header never changes size.
    return "".join(c if c == ":" or c.isalpha() and i < 5 else "0"
                   for i, c in enumerate(digest(b"", algorithm)))


def _nbytes(part: Part) -> int:
    if isinstance(part, int):
        return part
    if isinstance(part, FileSpan):
        return part.length
    return part.numel() * part.element_size()


def _layout(entries: Mapping[str, TensorSpec]) -> list[str]:
    # Larger items first so every tensor starts at an offset aligned to its item size
    # (safetensors forbids gaps between tensors, so alignment must come from the order).
    return sorted(entries, key=lambda key: -entries[key].dtype.itemsize)


class SafetensorsWriter:
    """Write one safetensors file tensor by tensor, in any order.

    ``entries`` fixes every tensor's name, shape and dtype before the first byte is written.
    :meth:`write` checks each tensor against its entry and stores it at its offset;
    :meth:`close` fails unless every entry was written, then stores the checksums and
    fsyncs. Use as a context manager; on an exception the file is left incomplete (the
    caller's atomic directory discards it).
    """

    def __init__(self, path: Path, entries: Mapping[str, TensorSpec],
                 metadata: Mapping[str, str] | None = None,
                 algorithm: str = CHECKSUM_ALGORITHM) -> None:
        self.path = Path(path)
        self.entries = dict(entries)
        self.algorithm = algorithm
        self._crc = crc_kind(algorithm)  # None for sha256
        self._key = CHECKSUM_KEY if algorithm != "sha256" else LEGACY_CHECKSUM_KEY
        self._metadata = {"format": "pt", **(metadata or {})}
        self._offsets: dict[str, tuple[int, int]] = {}
        position = 0
        for key in _layout(self.entries):
            self._offsets[key] = (position, position + self.entries[key].nbytes)
            position += self.entries[key].nbytes
        self._checksums: dict[str, str] = {}
        self._open = ("", 0)  # the tensor begin() started, and its bytes appended so far
        # Reused for parts that are not contiguous (e.g. row-parallel slices): after the
        # first such tensor no new pages are touched, which matters on a busy machine.
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._read_buffer: memoryview | None = None  # for FileSpan parts
        header = self._header({key: _placeholder(algorithm) for key in self.entries})
        self._data_start = 8 + len(header)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Past the page cache where the file system allows (mt_checkpoint.direct_io): the
        # tensors' whole blocks are written directly, the rest buffered.
        self._file = DirectFile(self.path)
        os.ftruncate(self._file.fd, self._data_start + position)
        self._file.write(struct.pack("<Q", len(header)) + header)

    def _header(self, checksums: Mapping[str, str]) -> bytes:
        metadata = {**self._metadata, self._key: json.dumps(dict(sorted(checksums.items())))}
        header: dict[str, Any] = {"__metadata__": metadata}
        for key, (begin, end) in self._offsets.items():
            spec = self.entries[key]
            header[key] = {"dtype": dtype_name(spec.dtype), "shape": list(spec.shape),
                           "data_offsets": [begin, end]}
        raw = json.dumps(header, separators=(",", ":")).encode()
        return raw + b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned

    def write(self, key: str, tensor: torch.Tensor) -> str:
        """Store ``tensor`` as ``key``; returns its checksum (:func:`digest`)."""
        self._planned(key)
        expected, actual = self.entries[key], TensorSpec.of(tensor)
        if expected != actual:
            raise ConvertError(f"{self.path}: tensor {key!r} is {actual.describe()}, "
                               f"the layout expects {expected.describe()}")
        return self.write_parts(key, [tensor.detach().to("cpu")])

    def write_parts(self, key: str, parts: Sequence[Part], checksum: str | None = None,
                    part_crcs: list[int] | None = None) -> str:
        """Store ``key`` as the concatenation of the raw bytes of ``parts`` (tensors of the
        entry's dtype, any strides, ints: that many zero bytes, or byte ranges of other
        files, copied in the kernel) without joining them in memory; hashes as it writes.
        ``checksum``, when the caller knows it already (the same bytes went to another
        file), skips hashing. With a CRC algorithm and no ``checksum``, ``part_crcs`` (if
        given) receives each part's own CRC, from which the caller can assemble the
        checksum of the tensor the parts came from. Returns the checksum."""
        expected = self._planned(key)
        size = sum(_nbytes(p) for p in parts)
        dtypes = {p.dtype for p in parts if isinstance(p, torch.Tensor)}
        if size != expected.nbytes or dtypes - {expected.dtype}:
            raise ConvertError(f"{self.path}: tensor {key!r} gets {size} bytes of "
                               f"{sorted(map(str, dtypes))}, the layout expects "
                               f"{expected.describe()} ({expected.nbytes} bytes)")
        self._file.seek(self._data_start + self._offsets[key][0])
        if checksum is None and self._crc is not None:
            checksum = self._write_crc(parts, part_crcs)
        else:
            hasher = None if checksum is not None else _Hasher(self.algorithm)
            for part in parts:
                if isinstance(part, FileSpan) and hasher is None:
                    self._copy(part, None)
                    continue
                for chunk in self._chunks(part):
                    self._file.write(chunk)
                    if hasher is not None:
                        hasher.update(chunk)
            checksum = checksum if hasher is None else hasher.hexdigest()
        self._checksums[key] = checksum
        self._start_writeback(*self._offsets[key])
        return checksum

    def write_stream(self, key: str, chunks: Iterable[memoryview], crc: Callable[[], int]
                     ) -> str:
        """Store ``key`` as the concatenation of ``chunks`` (through the direct file's
        staging buffers, no hashing), whose CRC the caller computed from these very bytes
        (``crc()`` once the chunks are taken, recorded as the checksum). With a CRC
        algorithm only; returns the checksum."""
        self.begin(key)
        limit = self.entries[key].nbytes
        for chunk in chunks:
            if self._open[1] + len(chunk) > limit:
                self._open = (key, limit + 1)  # more than planned
                break
            self.append(chunk)
        self._check_size(key)  # before crc(): an overrun leaves the chunks untaken
        return self.end(key, crc())

    def begin(self, key: str) -> None:
        """Start storing ``key``: :meth:`append` its bytes in order, then :meth:`end`."""
        self._planned(key)
        if self._crc is None:
            raise ConvertError(f"{self.path}: tensor {key!r} comes with a CRC, the file has "
                               f"{self.algorithm} checksums")
        self._file.seek(self._data_start + self._offsets[key][0])
        self._open = (key, 0)

    def append(self, data: Any) -> None:
        """The next bytes of the tensor :meth:`begin` started (any buffer)."""
        self._open = (self._open[0], self._open[1] + self._file.write(data))

    def end(self, key: str, crc: int) -> str:
        """Finish ``key``, whose bytes have the CRC ``crc`` (computed by the caller from
        these very bytes, recorded as the checksum); returns the checksum."""
        self._check_size(key)
        self._open = ("", 0)
        assert self._crc is not None
        checksum = self._crc.format(crc)
        self._checksums[key] = checksum
        # No early writeback: tensors written in file order make one run of the direct
        # file, whose whole blocks bypass the page cache (a flush would cut the run).
        return checksum

    def _check_size(self, key: str) -> None:
        expected, (started, size) = self.entries[key], self._open
        assert started == key, f"{key!r} was not begun (the tensor begun: {started!r})"
        if size != expected.nbytes:
            got = f"more than {expected.nbytes}" if size > expected.nbytes else f"only {size}"
            raise ConvertError(f"{self.path}: tensor {key!r} gets {got} bytes, the layout "
                               f"expects {expected.describe()} ({expected.nbytes} bytes)")

    def _start_writeback(self, begin: int, end: int) -> None:
        """Have the kernel start writing what of ``[begin, end)`` went through the page cache
        (kernel copies, partial blocks: the rest is written directly) to disk now, without
        waiting: the final fsync then finds most of the file on disk already, instead of
        flushing it all at the end while the CPU idles. (Linux's POSIX_FADV_DONTNEED
        starts asynchronous writeback of the dirty range, and drops the pages once clean:
        nothing reads them back.) Small tensors are left to the fsync."""
        if end - begin < _WRITEBACK_MIN:
            return
        self._file.flush()
        try:
            os.posix_fadvise(self._file.fd, self._data_start + begin, end - begin,
                             os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):  # not on this platform: fsync does it all
            pass

    def _copy(self, part: FileSpan, update: Callable[[Any, int], int] | None) -> int:
        """Copy a byte range of another file to the current position; its CRC (0 when
        ``update`` is None: nothing hashed)."""
        self._file.flush()  # the copy writes at an explicit offset
        position = self._file.tell()
        crc = copy_span(part, self._file.fd, position, self._buffer(), update)
        self._file.seek(position + part.length)
        return crc

    def _write_crc(self, parts: Sequence[Part], part_crcs: list[int] | None) -> str:
        assert self._crc is not None
        update, total = self._crc.update, 0
        for part in parts:
            crc = size = 0
            if isinstance(part, FileSpan):
                crc, size = self._copy(part, update), part.length
            else:
                for chunk in self._chunks(part):
                    self._file.write(chunk)
                    crc, size = update(chunk, crc), size + len(chunk)
            # combine(0, crc, size) == crc: skip the arithmetic for the first part
            total = crc_combine(total, crc, size, self.algorithm) if total else crc
            if part_crcs is not None:
                part_crcs.append(crc)
        return self._crc.format(total)

    def _planned(self, key: str) -> TensorSpec:
        if key not in self.entries:
            raise ConvertError(f"{self.path}: tensor {key!r} is not in the planned layout")
        if key in self._checksums:
            raise ConvertError(f"{self.path}: tensor {key!r} written twice")
        return self.entries[key]

    def _chunks(self, part: Part) -> Iterator[Any]:
        """Byte buffers of one part: views when possible, else one copy into scratch."""
        if isinstance(part, int):
            yield from zero_chunks(part)
            return
        if isinstance(part, FileSpan):
            buffer = self._buffer()
            for start in range(0, part.length, len(buffer)):
                size = os.preadv(part.fd, [buffer[: min(len(buffer), part.length - start)]],
                                 part.offset + start)
                yield buffer[:size]
            return
        part = part.detach()
        if part.numel() == 0:
            return
        if part.is_contiguous():
            yield part.reshape(-1).view(torch.uint8).numpy()
            return
        size = part.numel() * part.element_size()
        if self._scratch.numel() < size:
            self._scratch = torch.empty(size, dtype=torch.uint8)
        flat = self._scratch[:size]
        flat.view(part.dtype).view(part.shape).copy_(part)
        yield flat.numpy()

    def _buffer(self) -> memoryview:
        if self._read_buffer is None:
            self._read_buffer = memoryview(bytearray(8 << 20))
        return self._read_buffer

    def close(self) -> dict[str, str]:
        """Finish the file (checksums into the header, fsync); returns the checksums."""
        missing = sorted(set(self.entries) - set(self._checksums))
        if missing:
            self._file.abort()
            raise ConvertError(f"{self.path}: tensors never written: {missing}")
        header = self._header(self._checksums)
        if 8 + len(header) != self._data_start:  # cannot happen: digests have fixed length
            raise AssertionError("safetensors header changed size")
        self._file.seek(8)
        self._file.write(header)
        self._file.close()  # fsynced
        return dict(self._checksums)

    def abort(self) -> None:
        """Close the file without finishing it (after a failure)."""
        self._file.abort()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class SafetensorsReader:
    """Read tensors from one safetensors file, verifying checksums.

    Expected checksums (:func:`digest` strings, any algorithm) come from
    ``expected_sha256`` (e.g. a manifest; the name is historical) and from the file's own
    ``mt.checksums`` / ``mt.sha256`` metadata when present; every available one is checked.
    """

    def __init__(self, path: Path, expected_sha256: Mapping[str, str] | None = None) -> None:
        self.path = Path(path)
        self._spans: dict[str, tuple[int, int]] | None = None
        self._fd: int | None = None
        self._direct_fd = -1  # the file opened with O_DIRECT, with _fd (SpanBuffer reads it)
        if not self.path.is_file():
            raise ConvertError(f"{self.path}: file not found")
        try:
            self._handle = safe_open(str(self.path), framework="pt", device="cpu")
            self._file = self._handle.__enter__()
            self.metadata: dict[str, str] = dict(self._file.metadata() or {})
            self._keys = list(self._file.keys())
        except ConvertError:
            raise
        except Exception as err:  # safetensors raises its own untyped error
            raise ConvertError(f"{self.path}: not a readable safetensors file "
                               f"(malformed or truncated): {err}") from None
        try:
            self._embedded = self._embedded_checksums()
        except ConvertError:
            self.close()
            raise
        self._expected = dict(expected_sha256 or {})

    def _embedded_checksums(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for meta_key in (LEGACY_CHECKSUM_KEY, CHECKSUM_KEY):  # the newer one wins
            raw = self.metadata.get(meta_key)
            if raw is None:
                continue
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as err:
                raise ConvertError(f"{self.path}: malformed {meta_key} metadata: "
                                   f"{err}") from None
            if not isinstance(value, dict):
                raise ConvertError(f"{self.path}: {meta_key} metadata is not an object")
            out.update({str(k): str(v) for k, v in value.items()})
        return out

    def keys(self) -> list[str]:
        """Tensor names in the file."""
        return list(self._keys)

    def spec(self, key: str) -> TensorSpec:
        """Shape and dtype of ``key`` from the header (no data read)."""
        self._check_key(key)
        view = self._file.get_slice(key)
        return TensorSpec(tuple(view.get_shape()), dtype_from_name(view.get_dtype()))

    def get(self, key: str, verify: bool = True) -> torch.Tensor:
        """Load ``key`` (a CPU tensor) and verify its checksums (unless ``verify`` is
        false: then the caller must call :meth:`verify`)."""
        self._check_key(key)
        read_ahead([self.span(key)])  # read in large requests, not page fault by page fault
        try:
            tensor = self._file.get_tensor(key)
        except Exception as err:
            raise ConvertError(f"{self.path}: cannot read tensor {key!r}: {err}") from None
        if verify:
            self.verify(key, tensor)
        return tensor

    def verify(self, key: str, tensor: torch.Tensor | None, known: str | None = None
               ) -> None:
        """Check ``tensor``'s bytes against every known checksum of ``key``; each
        algorithm involved hashes the bytes once. ``known``: a checksum of ``tensor``
        computed already (e.g. while writing it), used instead of hashing again; with
        ``tensor`` None, ``known`` is the checksum of the stored bytes, which are read
        only if a checksum of another kind must be checked too."""
        computed = {} if known is None else {algorithm_of(known): known}
        for source, table in (("file metadata", self._embedded), ("manifest", self._expected)):
            if key not in table:
                continue
            try:
                algorithm = algorithm_of(table[key])
            except ConvertError as err:
                raise ConvertError(f"{self.path}: tensor {key!r}: {source}: {err}") from None
            if algorithm not in computed:
                if tensor is None:  # only ``known`` was given: read the bytes after all
                    tensor = self.get(key, verify=False)
                computed[algorithm] = digest(raw_bytes(tensor), algorithm)
            if table[key] != computed[algorithm]:
                raise ConvertError(
                    f"{self.path}: checksum mismatch for tensor {key!r} ({source} says "
                    f"{table[key][:16]}..., data hashes to {computed[algorithm][:16]}...): "
                    "the file is corrupted")

    def _check_key(self, key: str) -> None:
        if key not in self._keys:
            raise ConvertError(f"{self.path}: tensor {key!r} is missing")

    def span(self, key: str) -> FileSpan:
        """Where ``key``'s bytes are stored in the file (for in-kernel copies)."""
        self._check_key(key)
        if self._spans is None:
            with open(self.path, "rb") as handle:  # safe_open validated the header already
                size = struct.unpack("<Q", handle.read(8))[0]
                header = json.loads(handle.read(size))
            self._fd = os.open(self.path, os.O_RDONLY)
            self._direct_fd = open_direct(self.path)
            self._spans = {k: (8 + size + v["data_offsets"][0],
                               v["data_offsets"][1] - v["data_offsets"][0])
                           for k, v in header.items() if k != "__metadata__"}
        assert self._fd is not None
        return FileSpan(self._fd, *self._spans[key], self._direct_fd)

    def close(self) -> None:
        """Release the memory map."""
        self._handle.__exit__(None, None, None)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._direct_fd >= 0:
            os.close(self._direct_fd)
            self._direct_fd = -1


