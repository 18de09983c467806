"""Possibly compressed input files (``.gz``, ``.zst``) read to their end or reported.

A stream that stops inside a gzip member or a zstd frame raises
:class:`~mt_data.errors.StreamError` with ``kind="truncated"``; data that does not decode raises
it with ``kind="corrupt"``. Concatenated gzip members and zstd frames are read as one stream.
(``zstandard``'s own stream reader returns end-of-file at a cut frame without a word, so zstd
is decoded here frame by frame.)
"""

from __future__ import annotations

import gzip
import io
import zlib
from pathlib import Path
from typing import IO, Any

from mt_data.errors import DataError, StreamError

GZIP_EXTS = (".gz",)
ZSTD_EXTS = (".zst", ".zstd")
COMPRESSED = GZIP_EXTS + ZSTD_EXTS
READ_SIZE = 1 << 18
"""Compressed bytes decoded per step (bounds the memory one step may expand to)."""


def is_compressed(path: Path) -> bool:
    """True for ``.gz`` / ``.zst`` / ``.zstd`` files."""
    return path.name.lower().endswith(COMPRESSED)


class _GzipRaw(io.RawIOBase):
    """A gzip file whose truncation / corruption errors name the file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = gzip.open(path, "rb")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        try:
            return self._file.readinto1(buffer)  # what is decoded so far, up to the cut
        except EOFError:
            raise StreamError(str(self.path), "truncated", "the gzip stream ends before its "
                              "end-of-stream marker (the file is incomplete)") from None
        except (gzip.BadGzipFile, zlib.error) as exc:
            raise StreamError(str(self.path), "corrupt", f"invalid gzip data ({exc})") from None

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


class _ZstdRaw(io.RawIOBase):
    """Zstandard frames decoded one after another; input ending inside a frame is an error."""

    def __init__(self, path: Path, zstandard: Any) -> None:
        self.path = path
        self._zstd = zstandard
        self._dctx = zstandard.ZstdDecompressor(max_window_size=1 << 31)  # zstd --long=31
        self._file = open(path, "rb")  # noqa: SIM115 - closed in close()
        self._frame: Any = None  # decompressobj of the frame being decoded
        self._leftover = b""     # input after the end of the last frame
        self._consumed = 0       # compressed bytes read
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def _decode_more(self) -> bool:
        """Decode the next piece of input into ``_out``; False at the clean end."""
        data, self._leftover = self._leftover or self._file.read(READ_SIZE), b""
        if not data:
            if self._frame is not None:
                raise StreamError(str(self.path), "truncated", f"the zstd stream ends inside a "
                                  f"frame after {self._consumed:,} bytes (the file is incomplete)")
            return False
        self._consumed += len(data)
        if self._frame is None:
            self._frame = self._dctx.decompressobj()
        try:
            self._out = memoryview(self._frame.decompress(data))
        except self._zstd.ZstdError as exc:
            raise StreamError(str(self.path), "corrupt", f"invalid zstd data ({exc})") from None
        if self._frame.eof:
            self._leftover, self._frame = self._frame.unused_data, None
            self._consumed -= len(self._leftover)
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._out:
            if not self._decode_more():
                return 0
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


def open_binary(path: Path) -> IO[bytes]:
    """Open a possibly compressed file for binary reading (gzip built in, zstd via zstandard).

    Reads raise :class:`StreamError` when a compressed stream is truncated or corrupt.
    """
    name = path.name.lower()
    if name.endswith(GZIP_EXTS):
        return io.BufferedReader(_GzipRaw(path), READ_SIZE)
    if name.endswith(ZSTD_EXTS):
        try:
            import zstandard
        except ImportError as exc:  # optional dependency
            raise DataError(f"{path}: reading .zst files needs the 'zstandard' package") from exc
        return io.BufferedReader(_ZstdRaw(path, zstandard), READ_SIZE)
    return open(path, "rb")


def check_stream(path: Path) -> int:
    """Decode a compressed file to its end without keeping it; returns its decoded size.

    Raises :class:`StreamError` when the file is truncated or corrupt.
    """
    size = 0
    with open_binary(path) as f:
        while block := f.read(1 << 20):
            size += len(block)
    return size
