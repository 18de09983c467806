"""``mt data prepare --executor ray``: the pipeline's tasks as Ray tasks on a Ray cluster.

:class:`RayExecutor` is a :class:`concurrent.futures.Executor` whose ``submit`` starts a Ray
task, so the pipeline's stages run on it unchanged (:func:`mt_data.sharing.run_shared`):
cleaning (with the MinHash signatures) and tokenizing one work item per task, fuzzy dedup as
tasks of a few LSH bands (:mod:`mt_data.dedup_tasks`). Tasks read their inputs and write
their outputs (chunk and shard files, atomically, named by the task) on storage every node
sees, the same files the local executor writes: the dataset is the same, byte for byte.
A worker that dies mid-task has its task retried by Ray (a task's outputs are replaced whole,
so a retry writes the same bytes); a task that raises (bad input) is not retried, and its
error is the task's own, not Ray's wrapper. A driver killed and run again resumes from the
chunks and shards already recorded, as the local executor does.

Ray is an extra (``pip install 'mt-data[ray]'``), imported only here.
"""

from __future__ import annotations

import importlib.util
import socket
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

__all__ = ["RAY_RETRIES", "RayExecutor", "check_ray", "connect"]

#: How many times Ray starts a task again after the worker running it died.
RAY_RETRIES = 3


def check_ray(address: str | None) -> None:
    """Before anything is written: Ray is installed and ``address`` answers (one line,
    ValueError, else)."""
    if importlib.util.find_spec("ray") is None:
        raise ValueError("--executor ray needs Ray, which is not installed: pip install "
                         "'mt-data[ray]'")
    _reachable(address)


def connect(address: str | None) -> tuple[Any, bool]:
    """Join the Ray cluster at ``address`` (``auto``: the one this node belongs to;
    ``HOST:PORT``), or start a local one (None); returns the ``ray`` module and whether this
    call joined (False: the program had joined one itself, and keeps it)."""
    try:
        import ray  # pants: no-infer-dep (optional: mt-data[ray])
    except ImportError:
        raise ValueError("--executor ray needs Ray, which is not installed: pip install "
                         "'mt-data[ray]'") from None
    if ray.is_initialized():
        return ray, False
    _reachable(address)  # Ray itself retries an unreachable head for minutes
    try:
        ray.init(address=address, log_to_driver=False, include_dashboard=False,
                 configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as err:
        where = f"--ray-address {address}" if address else "a local Ray"
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"{where}: cannot join a Ray cluster ({first})") from None
    return ray, True


def _reachable(address: str | None) -> None:
    """A ``HOST:PORT`` address is a port that answers, else one line (ValueError)."""
    if address is None or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--ray-address {address}: expected auto or HOST:PORT of the "
                         "cluster's head (ray start --head prints it)")
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as err:
        raise ValueError(f"--ray-address {address}: cannot join a Ray cluster (nothing "
                         f"answers there: {err.strerror or err}); start one with ray start "
                         "--head, or leave out --ray-address for a local one") from None


class RayExecutor(Executor):
    """Tasks on a Ray cluster, as futures. ``_max_workers`` is the cluster's CPU count (how
    many tasks :func:`~mt_data.sharing.run_shared` keeps in flight); the driver runs none
    itself (``shares_work``: its node's CPUs are the cluster's)."""

    shares_work = False

    def __init__(self, address: str | None = None) -> None:
        self._ray, self._joined = connect(address)
        self._max_workers = max(1, int(self._ray.cluster_resources().get("CPU", 1)))
        self._remote: dict[Callable[..., Any], Any] = {}

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        remote = self._remote.get(fn)
        if remote is None:
            remote = self._remote[fn] = self._ray.remote(max_retries=RAY_RETRIES)(fn)
        ref = remote.remote(*args, **kwargs)
        ray_future = ref.future()
        future: Future[Any] = Future()
        ray = self._ray

        def cancelled(mine: Future[Any]) -> None:
            if mine.cancelled():  # the run stopped: its queued task need not run
                ray.cancel(ref)

        def settle(done: Future[Any]) -> None:  # on Ray's thread, as the driver goes on
            if done.cancelled():
                future.cancel()
                return
            # Pending -> running in one step, under the future's lock: a cancel by the driver
            # after it is refused (the result comes), one before it stands.
            if not future.set_running_or_notify_cancel():
                return
            error = done.exception()
            if error is None:
                future.set_result(done.result())
            else:  # the task's own exception, not RayTaskError's traceback text
                cause = getattr(error, "cause", None)
                future.set_exception(cause if isinstance(cause, BaseException) else error)

        future.add_done_callback(cancelled)
        ray_future.add_done_callback(settle)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Leaves the cluster if it joined it (a local one started for this run stops)."""
        if self._joined:
            self._ray.shutdown()
