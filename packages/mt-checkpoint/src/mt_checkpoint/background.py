"""Asynchronous saves: a snapshot of a rank's state in host memory, written by a process of its
own while training goes on.

:class:`HostBuffers` copies every tensor of a nested state into host memory kept from one save
to the next (shared memory, so the writer process reads it without another copy; registered
with CUDA, i.e. pinned, for CUDA tensors), storage by storage: tensors that shared a storage
share the copy, at the same offsets, so ``torch.save`` writes the same bytes as it would have
written from the live state. The buffers are allocated (their pages touched) at the first
save only: every later save is one memory copy per storage. :meth:`HostBuffers.start` makes
the copies of host tensors in a thread, so that a training loop can run the next forward and
backward meanwhile (they leave the state alone) and wait for them before its optimizer step.
:func:`snapshot` is the same copy into fresh memory.

:class:`BackgroundWrite` runs one write at a time in a writer process (spawned at the first
write, kept for the next): the write's pickling, checksums and system calls never take the
training process's interpreter lock nor its core. The writer dies with the process that
started it (a killed rank leaves no writer behind to publish a step), ignores the signals
meant for training (Ctrl-C, SIGTERM: the rank decides), runs at a lower priority than
training (nice 10); a failed write is raised in the training process at the next
:meth:`BackgroundWrite.wait` (the next save, or the end of the run); a writer that died is
one line with its exit code.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import errno
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.multiprocessing as mp

from mt_dist.failpoints import failpoint

__all__ = ["BackgroundWrite", "HostBuffers", "Snapshot", "snapshot", "to_host"]


class HostBuffers:
    """Host memory for the snapshots of one rank's state, reused from save to save.

    A buffer belongs to a live storage (its device, address and size): the next snapshot of
    the same storage copies into the same memory. Buffers of storages that a snapshot no
    longer meets are released by it. ``shared``: in shared memory, so that another process
    (:class:`BackgroundWrite`'s writer) maps it instead of receiving a copy. ``rank``: whose
    state it holds (a failpoint may name it).
    """

    def __init__(self, shared: bool = True, rank: int = 0) -> None:
        self.shared, self.rank = shared, rank
        self._buffers: dict[tuple[str, int, int], torch.UntypedStorage] = {}
        self._thread: ThreadPoolExecutor | None = None

    @property
    def nbytes(self) -> int:
        """Host bytes held."""
        return sum(b.nbytes() for b in self._buffers.values())

    def _buffer(self, storage: torch.UntypedStorage, key: tuple[str, int, int]
                ) -> torch.UntypedStorage:
        found = self._buffers.get(key)
        if found is not None:
            return found
        host = torch.empty(storage.nbytes(), dtype=torch.uint8)
        if self.shared:
            host.share_memory_()
        if storage.device.type == "cuda" and host.numel():
            _pin(host)
        return host.untyped_storage()

    def snapshot(self, value: Any) -> Any:
        """``value`` (dicts, lists, tuples of tensors and plain values) with every tensor
        copied into these buffers, views of one storage kept views of one copy."""
        return self.start(value).result()

    def start(self, value: Any) -> Snapshot:
        """:meth:`snapshot`, its copies of host tensors made by a thread while the caller
        goes on: training's forward and backward leave the state alone, so they can run
        meanwhile, and :meth:`Snapshot.result` waits for the copies before the optimizer
        changes it. (Device tensors are copied at once: a DMA into pinned memory.)"""
        if self.shared:
            self._check_room(value)
        used: dict[tuple[str, int, int], torch.UntypedStorage] = {}
        later: list[tuple[torch.Tensor, torch.Tensor]] = []

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            key = (str(storage.device), storage.data_ptr(), storage.nbytes())
            if key not in used:
                used[key] = self._buffer(storage, key)
                if storage.device.type == "cpu":
                    later.append((_bytes(used[key]), _bytes(storage)))
                else:
                    used[key].copy_(storage)
            out = torch.empty(0, dtype=tensor.dtype)
            out.set_(used[key], tensor.storage_offset(), tensor.size(), tensor.stride())
            return out

        copied = _walk(value, copy)
        self._buffers = used
        return Snapshot(copied, self._copier().submit(_copy_all, later, self.rank)
                        if later else None)

    def _copier(self) -> ThreadPoolExecutor:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mt-snapshot")
        return self._thread

    def _check_room(self, value: Any) -> None:
        """One line, before anything is copied, where shared memory cannot hold the new
        buffers (a container's 64 MB ``/dev/shm`` would otherwise end the rank with a bus
        error at the first page past it)."""
        new: dict[tuple[str, int, int], int] = {}

        def need(tensor: torch.Tensor) -> None:
            storage = tensor.untyped_storage()
            key = (str(storage.device), storage.data_ptr(), storage.nbytes())
            if key not in self._buffers:
                new[key] = storage.nbytes()

        _walk(value, need)
        wanted = sum(new.values())
        if not wanted or not os.path.isdir(SHM):
            return
        stat = os.statvfs(SHM)
        free = stat.f_bavail * stat.f_frsize
        if wanted > free:
            raise OSError(errno.ENOSPC, f"an asynchronous save needs {wanted / 2**30:.2f} GiB "
                          f"of shared memory for this rank's snapshot, and {SHM} has "
                          f"{free / 2**30:.2f} GiB free (a container: raise its --shm-size; "
                          "or save in the foreground, without --async-save)", SHM)


#: Where shared memory lives (its free space checked before a snapshot's first copy).
SHM = "/dev/shm"


class Snapshot:
    """A snapshot whose copies may still be running (:meth:`HostBuffers.start`). The live
    tensors must not change before :meth:`result` returns (the copying thread holds them
    until then)."""

    def __init__(self, value: Any, copying: Future[None] | None) -> None:
        self._value, self._copying = value, copying

    @property
    def done(self) -> bool:
        """Whether the copies are made (never blocks)."""
        return self._copying is None or self._copying.done()

    def result(self) -> Any:
        """The copied value, once every copy is made."""
        if self._copying is not None:
            self._copying.result()
            self._copying = None
        return self._value


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage's bytes as a uint8 tensor (whose copy releases the interpreter lock)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]], rank: int) -> None:
    failpoint("checkpoint.snapshot", rank)
    for host, live in pairs:
        host.copy_(live)


def snapshot(value: Any) -> Any:
    """``value`` with every tensor copied into fresh host memory (pinned for CUDA tensors),
    views of one storage kept views of one copy."""
    return HostBuffers(shared=False).snapshot(value)


def _walk(item: Any, leaf: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(item, torch.Tensor):
        return leaf(item.detach())
    if isinstance(item, dict):
        # The same kind of mapping with its attributes (a module's state dict is an OrderedDict
        # whose ``_metadata`` load_state_dict reads): the copy pickles as the original does.
        out = copy.copy(item)
        for k, v in item.items():
            out[k] = _walk(v, leaf)
        return out
    if isinstance(item, (list, tuple)):
        return type(item)(_walk(v, leaf) for v in item)
    return item


def _pin(host: torch.Tensor) -> None:
    """Page-lock ``host`` for CUDA (a copy from the GPU is then a DMA); best effort: an
    unpinned buffer is only slower."""
    with contextlib.suppress(Exception):
        torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)


def to_host(value: Any) -> Any:
    """``value`` with every tensor on the CPU (those already there as they are, not copied:
    for a write in the foreground, files must load anywhere)."""
    return _walk(value, lambda t: t.cpu())


class BackgroundWrite:
    """One write at a time, in a writer process of its own (started at the first write).

    ``start(fn, *args)`` runs ``fn(*args)`` there: ``fn`` a module-level function, ``args``
    picklable (tensors in shared memory, as :class:`HostBuffers` makes them, are passed as
    handles, not copied). A failpoint reached in the writer kills the training process
    (``MT_FAILPOINT_PID``): a crash during a write is the rank's crash.
    """

    def __init__(self) -> None:
        self._context = mp.get_context("spawn")
        self._process: Any = None
        self._jobs: Any = None
        self._results: Any = None
        self._pending = False
        self._outcome: tuple[str, Any] | None = None
        #: Seconds the longest write took, start to end (what a save costs when waited for).
        self.longest = 0.0

    def start(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` in the writer, after the previous write ended (its error
        raised)."""
        self.wait()
        if self._process is None:
            self._jobs, self._results = self._context.Queue(), self._context.Queue()
            self._process = self._context.Process(
                target=_serve, args=(self._jobs, self._results, os.getpid()),
                name="mt-checkpoint-writer", daemon=True)
            self._process.start()
        self._jobs.put((fn, args))
        self._pending = True

    @property
    def busy(self) -> bool:
        """Whether a write was started and not yet waited for (done or not)."""
        return self._pending

    @property
    def running(self) -> bool:
        """Whether the writer is still at the last write (never blocks)."""
        if self._pending and self._outcome is None:
            with contextlib.suppress(queue.Empty):
                self._outcome = self._results.get_nowait()
        return self._pending and self._outcome is None

    def wait(self) -> None:
        """Block until the running write ends; raise its error, if it failed."""
        if not self._pending:
            return
        while self._outcome is None:
            try:
                self._outcome = self._results.get(timeout=0.2)
            except queue.Empty:
                if not self._process.is_alive():
                    code = self._process.exitcode
                    self._pending = False
                    self._end()
                    raise RuntimeError(f"the checkpoint writer process died with exit code "
                                       f"{code} during a write; that step is not published"
                                       ) from None
        (outcome, value), self._outcome, self._pending = self._outcome, None, False
        if outcome == "error":
            raise value
        self.longest = max(self.longest, value)

    def close(self) -> None:
        """Wait for the running write (its error raised), then end the writer."""
        try:
            self.wait()
        finally:
            self._end()

    def _end(self) -> None:
        if self._process is not None:
            if self._process.is_alive():
                self._jobs.put(None)
                self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.kill()
            self._process.join()
        for q in (self._jobs, self._results):
            if q is not None:
                q.close()
                q.join_thread()
        self._process = self._jobs = self._results = None


def _serve(jobs: Any, results: Any, parent: int) -> None:
    """The writer process: run each job, report its seconds or its error; end when the
    parent does (or sends None)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _die_with(parent)
    with contextlib.suppress(OSError):
        os.nice(10)  # where the writer and training want the same core, training goes first
    os.environ["MT_FAILPOINT_PID"] = str(parent)  # a failpoint here is the rank's crash
    while (job := jobs.get()) is not None:
        fn, args = job
        began = time.perf_counter()
        try:
            fn(*args)
        except BaseException as err:  # noqa: BLE001 - raised in the training process
            results.put(("error", _portable(err)))
        else:
            results.put(("done", time.perf_counter() - began))
        del fn, args, job  # the shared buffers unmapped before the next job


def _die_with(parent: int) -> None:
    """End this process when ``parent`` ends: at once where Linux's parent-death signal
    exists, else within a second (a thread watching the parent)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="mt-writer-watch", daemon=True).start()


def _portable(err: BaseException) -> BaseException:
    """``err`` if it survives pickling, else a RuntimeError carrying its text and trace."""
    import pickle

    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - any pickling failure
        text = "".join(traceback.format_exception(err)).rstrip()
        return RuntimeError(f"checkpoint write failed in the writer process:\n{text}")
