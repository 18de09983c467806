"""Tensors streamed out of stored files in read groups, read ahead across tensors.

A reader whose tensors' bytes are byte ranges of its files (or rows of several files,
joined) hands them to a writer as :class:`~mt_formats.canonical.Streamed` chunks instead of
tensors: the bytes are read in groups of at most 8 MiB (:class:`~mt_formats.shard_pieces.
ReadGroup`), in the order of the reader's ``names()`` and across tensors, into a ring of
reused page-aligned buffers (:class:`~mt_formats.spans.ReadAhead`, ``O_DIRECT`` where the
file system allows), hashed by the read threads as they arrive, and verified after each
tensor's last group. Nothing maps the files, goes through the page cache or is allocated
per tensor, and the memory is the ring's, whatever the largest tensor.
"""

from __future__ import annotations

import collections
from abc import abstractmethod
from collections.abc import Generator, Iterator
from pathlib import Path

from mt_formats.canonical import Streamed
from mt_formats.crc import CHECKSUM_ALGORITHM, crc_combine, crc_kind
from mt_formats.errors import ConvertError
from mt_formats.shard_pieces import ReadGroup, Window
from mt_formats.spans import FileSpan, ReadAhead, ScratchBuffer, interleave_rows
from mt_formats.tensors import TensorSpec

__all__ = ["CHUNK", "Found", "Plan", "StreamingReader", "span_groups"]

#: Bytes of one read group (a whole number of 4 KiB blocks, at any offset, fits one 8 MiB
#: read request).
CHUNK = (8 << 20) - 4096

Plan = tuple[TensorSpec, list[ReadGroup]]
"""A tensor's spec and its read groups: first those whose bytes are the tensor's, in order,
then those only verified."""

Found = dict[tuple[int, int], list[tuple[int, int, int]]]
"""The CRCs of the windows read, by file key: ``(offset, length, crc)``."""


def span_groups(span: FileSpan, spec: TensorSpec, key: tuple[int, int] = (0, 0),
                chunk: int | None = None) -> list[ReadGroup]:
    """A tensor stored as-is at ``span`` in read groups of whole rows (its last dimension),
    about ``chunk`` bytes each (default :data:`CHUNK`; one row if larger): a writer slicing
    rows gets them whole."""
    chunk = CHUNK if chunk is None else chunk
    row = spec.shape[-1] * spec.dtype.itemsize if spec.shape else 0
    step = max(1, chunk // row) * row if row else chunk
    windows = [Window(key, start, span.sub(start, min(step, span.length - start)))
               for start in range(0, span.length, step)] or [Window(key, 0, span)]
    return [ReadGroup("data", (window,)) for window in windows]


class StreamingReader:
    """The streams of a checkpoint reader (a mix-in): it says how each tensor is read
    (:meth:`_stream_plan`) and verified (:meth:`_stream_verify`); :meth:`_stream` gives the
    :class:`Streamed` tensor. Streams are taken one at a time; taking them in the order of
    ``names()`` reads ahead across tensors, starting another one starts the reading over
    (the one before cannot be resumed). :meth:`_close_streams` before the files close.
    Its state (the read-ahead, the plans, a scratch buffer) lives in the instance's
    ``__dict__``, created on first use, so the readers' constructors need not call it."""

    root: Path  # the checkpoint, named in errors

    @abstractmethod
    def names(self) -> list[str]: ...

    @abstractmethod
    def _stream_plan(self, name: str) -> Plan | None:
        """How ``name`` is read (None: it cannot be streamed)."""

    @abstractmethod
    def _stream_verify(self, name: str, found: Found) -> None:
        """Check every file holding ``name`` from the CRCs of the windows read (raises
        ConvertError)."""

    def _stream(self, name: str) -> Streamed | None:
        plan = self._plan(name)
        return None if plan is None else Streamed(plan[0], self._chunks(name, plan[1]))

    def _close_streams(self) -> None:
        ahead = self.__dict__.pop("_ahead", None)
        if ahead is not None:  # its reads use the files
            ahead.close()

    def _plan(self, name: str) -> Plan | None:
        plans: dict[str, Plan | None] = self.__dict__.setdefault("_plans", {})
        if name not in plans:
            plans[name] = self._stream_plan(name)
        return plans[name]

    def _groups_from(self, name: str) -> Iterator[tuple[tuple[str, int], list[FileSpan]]]:
        """The read groups of ``name`` and of every later tensor, tagged (name, index)."""
        names = self.names()
        for later in names[names.index(name):]:
            plan = self._plan(later)
            for index, group in enumerate(plan[1] if plan else []):
                yield (later, index), [window.span for window in group.windows]

    def _chunks(self, name: str, groups: list[ReadGroup]) -> Generator[memoryview, None, int]:
        """Yields ``name``'s chunks, verifies its files, returns its CRC."""
        kind = crc_kind(CHECKSUM_ALGORITHM)
        assert kind is not None
        ahead: ReadAhead | None = self.__dict__.get("_ahead")
        if groups and (ahead is None or ahead.next_tag() != (name, 0)):
            if ahead is not None:  # another tensor's stream, or none was started
                ahead.close()
            ahead = self.__dict__["_ahead"] = ReadAhead(self._groups_from(name), kind.update)
        joined: ScratchBuffer = self.__dict__.setdefault("_joined", ScratchBuffer())
        found: Found = collections.defaultdict(list)
        crc = 0
        for index, group in enumerate(groups):
            assert ahead is not None
            if self.__dict__.get("_ahead") is not ahead:
                raise RuntimeError(f"{name}: streams are taken one at a time; another one "
                                   "started before this one ended")
            try:
                tag, views, crcs = ahead.take()
            except OSError as err:  # the source, not the destination, is at fault
                raise ConvertError(f"{self.root}: reading tensor {name!r} "
                                   f"failed: {err}") from None
            assert tag == (name, index), (tag, name, index)
            for window, view, window_crc in zip(group.windows, views, crcs):
                found[window.key].append((window.offset, len(view), window_crc))
            if group.kind == "rows":  # the same rows of every shard, joined
                out = joined.take(sum(len(view) for view in views))
                interleave_rows(views, group.rows, out)
                crc = crc_combine(crc, kind.update(out, 0), out.size)
                yield memoryview(out)
            elif group.kind == "data":
                for view, window_crc in zip(views, crcs):
                    crc = crc_combine(crc, window_crc, len(view))
                    yield view
        self._stream_verify(name, found)
        return crc
