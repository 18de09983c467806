"""Byte ranges of stored files, copied in the kernel and hashed from a reused buffer.

When a conversion reads a tensor straight from a safetensors file (no transform), each
contiguous piece of a target shard is a byte range of the source file. Copying it with
``os.copy_file_range`` keeps the data in the kernel (what ``cp`` does); its CRC, which
both verifies the source and becomes the shard's checksum, is computed from ``pread`` into
one reused buffer, which touches no new memory pages (hashing a memory map of the source
faults every page in, and on a busy machine those faults cost more than the hashing).

:class:`SpanBuffer` reads byte ranges into reused memory instead, bypassing the page cache
where the file system allows (``O_DIRECT``): a reader that hands the bytes it verified to
a writer (the merge of sharded checkpoints) neither maps the files nor copies freshly read
page-cache pages to user memory, which on a virtual machine costs several times what the
kernel's own file copy does. :class:`ReadAhead` keeps a ring of them reading groups of
ranges ahead of their use, so that the disk always has requests queued.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mt_checkpoint import direct_buffer

__all__ = ["FileSpan", "ReadAhead", "ScratchBuffer", "SpanBuffer", "copy_span",
           "crc_span", "interleave_rows", "open_direct", "read_ahead"]


@dataclass(frozen=True)
class FileSpan:
    """``length`` bytes at ``offset`` of the open file descriptor ``fd``; ``direct_fd``
    (-1: none) is the same file opened with ``O_DIRECT`` (:class:`SpanBuffer` reads it)."""

    fd: int
    offset: int
    length: int
    direct_fd: int = -1

    def sub(self, start: int, length: int) -> FileSpan:
        """``length`` bytes from ``start`` (relative to this span) of the same file."""
        return replace(self, offset=self.offset + start, length=length)


def copy_span(span: FileSpan, out_fd: int, out_offset: int, buffer: memoryview,
              update: Callable[[Any, int], int] | None) -> int:
    """Copy ``span`` to ``out_fd`` at ``out_offset``; returns the CRC of its bytes
    (``update(data, crc) -> crc``, e.g. ``CrcKind.update``; None: no hashing, 0 returned).
    Falls back to writing the bytes read where the kernel cannot copy between the files."""
    if update is None:  # nothing to hash: the kernel copies it all
        done = _kernel_copy(span.fd, out_fd, span.offset, out_offset, span.length)
        span = span.sub(done, span.length - done)
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


#: O_DIRECT reads: offsets, lengths and buffer addresses are multiples of this.
_ALIGN = 4096


def open_direct(path: str | os.PathLike[str]) -> int:
    """``path`` opened read-only with ``O_DIRECT``, or -1 where the platform or file
    system has none."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (AttributeError, OSError):
        return -1


class ScratchBuffer:
    """A byte buffer reused from call to call, grown when too small: after the first use
    no new memory pages are touched (fresh pages cost more than the copies into them)."""

    def __init__(self) -> None:
        self._array = np.empty(0, dtype=np.uint8)

    def take(self, size: int) -> np.ndarray:
        """The first ``size`` bytes of the buffer (uint8; its old contents)."""
        if self._array.size < size:
            self._array = np.empty(size, dtype=np.uint8)
        return self._array[:size]


#: Bytes of one read request of :class:`SpanBuffer`: larger spans are read in pieces of
#: this size by several threads at once, so that the disk always has requests queued (a
#: direct read has no kernel read-ahead).
_REQUEST = 8 << 20
_READ_THREADS = 4
#: Buffers of :class:`ReadAhead`: one in use, the others read ahead.
_SLOTS = 8
_pool: ThreadPoolExecutor | None = None


def _read_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="mt-read")
    return _pool


class SpanBuffer:
    """Byte ranges read into one reused page-aligned buffer, with ``O_DIRECT`` where the
    span has a ``direct_fd`` (each as the 4096-aligned blocks covering it, at the next
    aligned position), else with ``pread``; requests of at most 8 MiB, several in flight.
    :meth:`reset` starts over."""

    def __init__(self) -> None:
        self._buffer = direct_buffer(0)
        self._used = 0

    @staticmethod
    def room(spans: Iterable[FileSpan]) -> int:
        """Bytes of buffer :meth:`start` needs for ``spans``."""
        return sum(-(-(span.length + 2 * _ALIGN) // _ALIGN) * _ALIGN for span in spans)

    def reset(self, room: int) -> None:
        """Forget what was read (views of it must not be used any more) and make room for
        ``room`` bytes (:meth:`room`)."""
        if len(self._buffer) < room:
            self._buffer = direct_buffer(room)
        self._used = 0

    def start(self, spans: Sequence[FileSpan],
              update: Callable[[Any, int], int] | None = None) -> _Reads:
        """Start reading ``spans`` on the read threads (views of their bytes, valid until
        :meth:`reset`, from the result's ``result()``), each hashed with ``update(data, crc)
        -> crc`` once read, where given."""
        plans = [self._claim(span) for span in spans]
        jobs: list[list[Future[int | None]]] = []
        for span, (fd, region, offset, least, low) in zip(spans, plans):
            if fd < 0:
                jobs.append([])
            elif least <= _REQUEST:  # read and hashed by one thread
                jobs.append([_read_pool().submit(_read_span, fd, region, offset, least,
                                                 region[low:low + span.length], update)])
            else:
                jobs.append([_read_pool().submit(_read_span, fd, region[done:done + _REQUEST],
                                                 offset + done, min(_REQUEST, least - done))
                             for done in range(0, least, _REQUEST)])
        return _Reads(spans, plans, jobs, update)

    def _claim(self, span: FileSpan) -> tuple[int, memoryview, int, int, int]:
        """(fd to read, its region of the buffer, file offset, bytes to read at least,
        where the span starts in the region); fd -1 for an empty span."""
        direct = span.direct_fd >= 0
        start = span.offset - span.offset % _ALIGN if direct else span.offset
        size = -(-(span.offset + span.length - start) // _ALIGN) * _ALIGN
        region = self._buffer[self._used:self._used + size]
        if len(region) < size:
            raise ValueError(f"no room for {size} bytes: reset() with room() first")
        self._used += size
        low = span.offset - start
        fd = -1 if not span.length else span.direct_fd if direct else span.fd
        return fd, region, start, low + span.length, low


class _Reads:
    """Reads started by :meth:`SpanBuffer.start`: for each span, its jobs (a single one
    returns the span's CRC where hashing was asked)."""

    def __init__(self, spans: Sequence[FileSpan], plans: list[tuple[int, memoryview, int, int,
                 int]], jobs: list[list[Future[int | None]]],
                 update: Callable[[Any, int], int] | None) -> None:
        self._spans, self._plans, self._jobs, self._update = spans, plans, jobs, update

    def wait(self) -> None:
        """Wait until no read writes into the buffer any more (errors ignored)."""
        wait([job for span_jobs in self._jobs for job in span_jobs])

    def result(self) -> tuple[list[memoryview], list[int]]:
        """Each span's bytes (views of the buffer) and, with ``update``, its CRC (else 0);
        where a direct read was refused, every span is read again buffered."""
        refused, hashed = False, []
        for span_jobs in self._jobs:
            crc = None
            for job in span_jobs:
                try:
                    crc = job.result()
                except _NotDirect:
                    refused = True
            hashed.append(crc)
        views, crcs = [], []
        for span, (fd, region, _, _, low), crc in zip(self._spans, self._plans, hashed):
            if refused or fd < 0:  # a direct read was refused: read them all buffered
                _read_into(span.fd, region[:span.length], span.offset, span.length)
                low, crc = 0, None
            view = region[low:low + span.length]
            if crc is None and self._update is not None:
                crc = self._update(view, 0)
            views.append(view)
            crcs.append(crc or 0)
        return views, crcs


class ReadAhead:
    """Groups of byte ranges read in order ahead of their use, each group into one of
    ``slots`` reused page-aligned buffers (:class:`SpanBuffer`), each range hashed as it
    arrives (``update(data, crc) -> crc``) by the read threads: while the caller uses one
    group, the next ones are read, so the disk always has requests queued and no buffer is
    ever larger than a group.

    ``groups`` yields ``(tag, spans)`` and is drawn lazily, as slots free up.
    :meth:`take` returns the next group; :meth:`close` waits for the reads in flight.
    """

    def __init__(self, groups: Iterator[tuple[Any, Sequence[FileSpan]]],
                 update: Callable[[Any, int], int], slots: int = _SLOTS) -> None:
        self._groups, self._update = groups, update
        self._free = [SpanBuffer() for _ in range(slots)]
        self._queue: collections.deque[tuple[Any, SpanBuffer, _Reads]] = collections.deque()
        self._held: SpanBuffer | None = None
        self._fill()

    def next_tag(self) -> Any:
        """The tag of the group :meth:`take` returns next (None: no group is left)."""
        return self._queue[0][0] if self._queue else None

    def take(self) -> tuple[Any, list[memoryview], list[int]]:
        """The next group's tag, the bytes of each of its spans (views valid until the next
        :meth:`take`) and their CRCs; IndexError when no group is left."""
        if self._held is not None:  # the caller is done with the previous group
            self._free.append(self._held)
            self._held = None
            self._fill()
        tag, buffer, reads = self._queue.popleft()
        self._held = buffer
        views, crcs = reads.result()
        return tag, views, crcs

    def close(self) -> None:
        """Wait for the reads in flight (they write into the buffers); take no more."""
        for _, _, reads in self._queue:
            reads.wait()
        self._queue.clear()
        self._free.clear()
        self._held = None

    def _fill(self) -> None:
        while self._free:
            group = next(self._groups, None)
            if group is None:
                return
            tag, spans = group
            buffer = self._free.pop()
            buffer.reset(SpanBuffer.room(spans))
            self._queue.append((tag, buffer, buffer.start(spans, self._update)))


def _read_span(fd: int, region: memoryview, offset: int, least: int,
               data: memoryview | None = None,
               update: Callable[[Any, int], int] | None = None) -> int | None:
    """:func:`_read_into`, then the CRC of ``data`` (a view of ``region``) with ``update``
    where given."""
    _read_into(fd, region, offset, least)
    return None if update is None or data is None else update(data, 0)


def _read_into(fd: int, region: memoryview, offset: int, least: int) -> None:
    """Read ``fd`` from ``offset`` into ``region`` until at least ``least`` bytes are in;
    raises :class:`_NotDirect` where the first read is refused as misaligned (EINVAL)."""
    done = 0
    while done < least:
        try:
            size = os.preadv(fd, [region[done:]], offset + done)
        except OSError as err:
            if done == 0 and err.errno == errno.EINVAL:
                raise _NotDirect from None
            raise
        if size <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += size


def interleave_rows(sources: Sequence[memoryview], rows: int, out: np.ndarray) -> None:
    """Write into ``out`` (uint8) the rows of the byte strings ``sources``, each ``rows``
    rows of equal length, joined along the rows: row 0 of every source in order, then
    row 1, ... (the bytes of ``torch.cat(tensors, dim=-1)`` of tensors with those bytes).
    """
    if rows < 1 or any(len(source) % rows for source in sources) or out.size != sum(
            len(source) for source in sources):
        raise ValueError(f"sources of {[len(s) for s in sources]} bytes are not {rows} rows "
                         f"each, or do not fill {out.size} bytes")
    table, column = out.reshape(rows, -1), 0
    for source in sources:
        width = len(source) // rows
        table[:, column:column + width] = np.frombuffer(source, np.uint8).reshape(rows, width)
        column += width


class _NotDirect(Exception):
    """A direct read was refused (alignment, file system): read buffered."""


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
