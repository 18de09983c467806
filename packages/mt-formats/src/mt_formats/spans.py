"""Byte ranges of stored files, copied in the kernel and hashed from a reused buffer.

When a conversion reads a tensor straight from a safetensors file (no transform), each
contiguous piece of a target shard is a byte range of the source file. Copying it with
``os.copy_file_range`` keeps the data in the kernel (what ``cp`` does); its CRC, which
both verifies the source and becomes the shard's checksum, is computed from ``pread`` into
one reused buffer, which touches no new memory pages (hashing a memory map of the source
faults every page in, and on a busy machine those faults cost more than the hashing).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["FileSpan", "copy_span", "crc_span", "read_ahead"]


@dataclass(frozen=True)
class FileSpan:
    """``length`` bytes at ``offset`` of the open file descriptor ``fd``."""

    fd: int
    offset: int
    length: int


def copy_span(span: FileSpan, out_fd: int, out_offset: int, buffer: memoryview,
              update: Callable[[Any, int], int] | None) -> int:
    """Copy ``span`` to ``out_fd`` at ``out_offset``; returns the CRC of its bytes
    (``update(data, crc) -> crc``, e.g. ``CrcKind.update``; None: no hashing, 0 returned).
    Falls back to writing the bytes read where the kernel cannot copy between the files."""
    if update is None:  # nothing to hash: the kernel copies it all
        done = _kernel_copy(span.fd, out_fd, span.offset, out_offset, span.length)
        span = FileSpan(span.fd, span.offset + done, span.length - done)
        out_offset += done
    crc = 0
    for done, chunk in _chunks(span, buffer):
        if update is not None:
            crc = update(chunk, crc)
        _copy(span.fd, out_fd, span.offset + done, out_offset + done, chunk)
    return crc


def crc_span(span: FileSpan, buffer: memoryview, update: Callable[[Any, int], int]) -> int:
    """The CRC of ``span``'s bytes, read with ``pread`` into ``buffer``."""
    crc = 0
    for _, chunk in _chunks(span, buffer):
        crc = update(chunk, crc)
    return crc


def _chunks(span: FileSpan, buffer: memoryview) -> Iterator[tuple[int, memoryview]]:
    """``(offset within span, bytes)`` pieces of ``span``, each read with ``pread`` into
    ``buffer`` (valid until the next piece)."""
    done = 0
    while done < span.length:
        size = os.preadv(span.fd, [buffer[: min(len(buffer), span.length - done)]],
                         span.offset + done)
        if size <= 0:
            raise OSError(f"unexpected end of file at byte {span.offset + done}")
        yield done, buffer[:size]
        done += size


def _kernel_copy(src: int, dst: int, src_offset: int, dst_offset: int, length: int) -> int:
    """Bytes ``os.copy_file_range`` copied (fewer than ``length`` where it cannot)."""
    copied = 0
    try:
        while copied < length:
            step = os.copy_file_range(src, dst, length - copied, src_offset + copied,
                                      dst_offset + copied)
            if step == 0:
                break
            copied += step
    except OSError:  # e.g. EXDEV on old kernels: the caller writes the rest
        pass
    return copied


def _copy(src: int, dst: int, src_offset: int, dst_offset: int, chunk: memoryview) -> None:
    copied = _kernel_copy(src, dst, src_offset, dst_offset, len(chunk))
    while copied < len(chunk):
        copied += os.pwrite(dst, chunk[copied:], dst_offset + copied)


def read_ahead(spans: Iterable[FileSpan]) -> None:
    """Start reading the byte ranges ``spans`` cover (file by file, first to last byte)
    into the page cache (``POSIX_FADV_WILLNEED``: asynchronous, in large requests), so that
    a read or kernel copy of them made next finds them there instead of waiting for the disk
    request by request. Advice only: where the platform has none, nothing happens."""
    ranges: dict[int, tuple[int, int]] = {}
    for span in spans:
        lo, hi = ranges.get(span.fd, (span.offset, span.offset + span.length))
        ranges[span.fd] = min(lo, span.offset), max(hi, span.offset + span.length)
    for fd, (lo, hi) in ranges.items():
        with contextlib.suppress(AttributeError, OSError):
            os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_WILLNEED)
