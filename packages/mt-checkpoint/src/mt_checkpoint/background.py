"""Asynchronous saves: a snapshot of a rank's state in host memory, written by a thread while
training goes on.

:func:`snapshot` copies every tensor of a nested state to the CPU (pinned memory for CUDA
tensors, so the copy is a DMA the GPU does not wait on twice), storage by storage: tensors
that shared a storage share the copy, at the same offsets, so ``torch.save`` writes the same
bytes as it would have written from the live state. :class:`BackgroundWrite` runs one write at
a time on a thread; a failed write is raised on the training thread at the next
:meth:`BackgroundWrite.wait` (the next save, or the end of the run).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BackgroundWrite", "snapshot", "to_host"]


def snapshot(value: Any) -> Any:
    """``value`` (dicts, lists, tuples of tensors and plain values) with every tensor copied
    to host memory, views of one storage kept views of one copy."""
    copies: dict[tuple[str, int], torch.UntypedStorage] = {}

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = (str(storage.device), storage.data_ptr())
        if key not in copies:
            host = torch.empty(storage.nbytes(), dtype=torch.uint8,
                               pin_memory=storage.device.type == "cuda")
            host.untyped_storage().copy_(storage)
            copies[key] = host.untyped_storage()
        out = torch.empty(0, dtype=tensor.dtype)
        out.set_(copies[key], tensor.storage_offset(), tensor.size(), tensor.stride())
        return out

    def walk(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            return copy(item.detach())
        if isinstance(item, dict):
            return {k: walk(v) for k, v in item.items()}
        if isinstance(item, (list, tuple)):
            return type(item)(walk(v) for v in item)
        return item

    return walk(value)


def to_host(value: Any) -> Any:
    """``value`` with every tensor on the CPU (those already there as they are, not copied:
    for a write in the foreground, files must load anywhere)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(v) for v in value)
    return value


class BackgroundWrite:
    """One write at a time on a thread of its own."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        #: Seconds the longest write took, start to end (what a save costs when waited for).
        self.longest = 0.0

    def start(self, write: Callable[[], None]) -> None:
        """Run ``write()`` on a thread, after the previous write ended (its error raised)."""
        self.wait()

        def run() -> None:
            began = time.perf_counter()
            try:
                write()
            except BaseException as err:  # noqa: BLE001 - raised on the training thread
                self._error = err
            self.longest = max(self.longest, time.perf_counter() - began)

        # A daemon: a rank that fails does not wait for its write (the step stays unpublished).
        self._thread = threading.Thread(target=run, name="mt-checkpoint-writer", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the running write ends; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
