"""Large files written past the page cache: the whole 4096-byte blocks with ``O_DIRECT``.

A buffered write copies every byte into the kernel's page cache and the final ``fsync``
writes it out from there. For a checkpoint that copy is pure cost: nothing reads the file
back soon, and on a virtual machine it is the dominant one (mt-checkpoint's README has the
figures).

:class:`DirectFile` stages what it is given in two page-aligned buffers and writes each full
one with ``O_DIRECT`` from a thread while the other fills, so the caller's hashing and copying
overlap the disk. The bytes of a run that fall outside whole aligned blocks (its first and last
partial block) are written buffered; a run never shares a block with a direct write, so the
two kinds never meet in one page. Where the file system refuses ``O_DIRECT`` (some network
and FUSE file systems, older tmpfs: at the open or at the first write) everything is written
buffered, the same bytes. :meth:`DirectFile.close` ends with ``fsync``: the file is durable
either way.

The staging buffers (and mt-formats' direct read buffers) come from :func:`direct_buffer`:
memory backed by 2 MiB pages where the kernel gives them. A direct request is one segment
per physically contiguous piece of its buffer, and a device takes a bounded number of
segments per request (a virtio disk: 254): from 4 KiB pages an 8 MiB write leaves as
requests of about 512 KiB, from 2 MiB pages as requests of the device's largest size
(mt-formats' README has the measurements).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["BLOCK", "DirectFile", "direct_buffer"]

#: Alignment of direct writes: file offsets, lengths and buffer addresses are multiples of it.
BLOCK = 4096
#: Bytes of one staging buffer (a direct write), two of them per file.
_STAGE = 8 << 20
#: A transparent huge page.
_HUGE = 2 << 20


def direct_buffer(size: int) -> memoryview:
    """A writable buffer of ``size`` bytes for ``O_DIRECT`` requests: private anonymous
    memory at a page-aligned address; from 2 MiB on, starting at a 2 MiB boundary and
    advised to be backed by transparent huge pages (``MADV_HUGEPAGE``; where the kernel
    has none or refuses, 4 KiB pages, the same bytes), so that one request covers few
    physically contiguous segments (see the module docstring)."""
    if size < 0:
        raise ValueError(f"a buffer of {size} bytes")
    length = max(size, 1)
    if length < _HUGE:
        return memoryview(mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE))[:size]
    region = mmap.mmap(-1, length + _HUGE, flags=mmap.MAP_PRIVATE)
    skip = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % _HUGE
    with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE here
        region.madvise(mmap.MADV_HUGEPAGE, skip, length)
    return memoryview(region)[skip:skip + size]


class DirectFile:
    """A file written in runs of consecutive bytes (:meth:`seek` starts a new run, at any
    offset; :meth:`write` appends to it), the whole blocks with ``O_DIRECT`` where allowed.

    ``path`` is created or truncated. Use as a context manager, or :meth:`close` (which
    flushes and fsyncs); a failed write (disk full...) is raised by the :meth:`write`,
    :meth:`seek`, :meth:`flush` or :meth:`close` that meets it, as an ``OSError`` naming
    the file.
    """

    def __init__(self, path: str | os.PathLike[str], stage: int = _STAGE) -> None:
        self.path = Path(path)
        self.fd = self._direct = -1
        stage = max(BLOCK, stage - stage % BLOCK)
        with self._named():  # before the file exists: a refused allocation leaves nothing
            self._stages = [direct_buffer(stage) for _ in range(2)]
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._direct = _open_direct(self.path)
        self._busy: list[Future[None] | None] = [None, None]
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mt-direct")
        self._which = 0
        self._base = 0  # file offset of the current stage's first byte (a block boundary)
        self._fill = 0  # bytes of the current stage that hold data
        self._lead = 0  # bytes at the stage's start that precede the run (not data)
        self._high = 0  # end of the furthest byte handed to the disk

    @property
    def direct(self) -> bool:
        """Whether whole blocks are written with ``O_DIRECT``."""
        return self._direct >= 0

    def tell(self) -> int:
        """Where the next :meth:`write` goes."""
        return self._base + self._fill

    def seek(self, position: int) -> None:
        """Start a new run at ``position`` (the current run's bytes are handed to the disk).
        A run may rewrite bytes written before (a header completed last): it then starts
        once every earlier write is done."""
        if position == self.tell():
            return
        with self._named():
            self._flush(final=True)
            if position < self._high:
                self._wait_all()
        self._start(position)

    def write(self, data: Any) -> int:
        """Append ``data`` (any buffer) to the current run; returns its length."""
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            stage = self._stages[self._which]
            take = min(len(stage) - self._fill, len(view) - done)
            stage[self._fill:self._fill + take] = view[done:done + take]
            self._fill += take
            done += take
            if self._fill == len(stage):
                with self._named():
                    self._flush(final=False)
        return len(view)

    def flush(self) -> None:
        """Hand the run's bytes to the disk (its partial last block buffered): after it, the
        file's bytes up to :meth:`tell` may be written through other descriptors (a kernel
        copy into the next range), since no later direct write shares a block with them."""
        with self._named():
            self._flush(final=True)

    def close(self) -> None:
        """Write what is staged, wait for every write, fsync and close."""
        if self.fd < 0:
            return
        try:
            with self._named():
                self._flush(final=True)
                self._wait_all()
                os.fsync(self.fd)
        finally:
            self._release()

    def abort(self) -> None:
        """Close without flushing (after a failure; the caller discards the file)."""
        with contextlib.suppress(OSError):
            self._wait_all()
        self._release()

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    @contextlib.contextmanager
    def _named(self) -> Iterator[None]:
        """An operating-system error in the block, raised naming this file."""
        try:
            yield
        except OSError as err:
            if err.filename is not None:
                raise
            raise OSError(err.errno, err.strerror, str(self.path)) from None

    def _start(self, position: int) -> None:
        self._lead = position % BLOCK
        self._base = position - self._lead
        self._fill = self._lead

    def _flush(self, final: bool) -> None:
        """Hand the current stage to the disk: its whole blocks of data directly (from the
        writer thread), a partial first block and, when ``final``, a partial last block
        buffered. Then switch to the other stage, once its previous write is done."""
        stage, lead, fill = self._stages[self._which], self._lead, self._fill
        if fill == lead:  # nothing staged
            return
        head = min(fill, -(-lead // BLOCK) * BLOCK) if lead else lead
        tail = fill if final else fill - fill % BLOCK
        whole = max(head, fill - fill % BLOCK)
        if head > lead:  # the first block, shared with bytes before the run
            _pwrite(self.fd, stage[lead:head], self._base + lead)
        if whole > head:
            self._busy[self._which] = self._pool.submit(
                self._write_blocks, stage[head:whole], self._base + head)
        if tail > whole:  # the last block, partly data (end of the run)
            _pwrite(self.fd, stage[whole:tail], self._base + whole)
        self._high = max(self._high, self._base + fill)
        self._which ^= 1
        self._wait(self._which)
        self._start(self._base + fill)

    def _write_blocks(self, blocks: memoryview, offset: int) -> None:
        if self._direct >= 0:
            try:
                _pwrite(self._direct, blocks, offset)
                return
            except OSError as err:  # refused as misaligned: the file system cannot
                if err.errno != errno.EINVAL:
                    raise
                os.close(self._direct)
                self._direct = -1
        _pwrite(self.fd, blocks, offset)

    def _wait(self, which: int) -> None:
        job, self._busy[which] = self._busy[which], None
        if job is not None:
            job.result()

    def _wait_all(self) -> None:
        for which in (0, 1):
            self._wait(which)

    def _release(self) -> None:
        self._pool.shutdown(wait=True)
        for fd in (self.fd, self._direct):
            if fd >= 0:
                os.close(fd)
        self.fd = self._direct = -1


def _open_direct(path: Path) -> int:
    """``path`` (just created) opened for writing with ``O_DIRECT``, or -1 where the
    platform or the file system has none."""
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT)
    except (AttributeError, OSError):
        return -1


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
