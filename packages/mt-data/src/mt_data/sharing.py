"""Tasks shared between a process pool and the process that owns it, results in task order
and the first failure in task order, as a serial run would give them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from typing import Any

__all__ = ["run_shared"]


def run_shared(fn: Callable[..., Any], tasks: list[tuple[Any, ...]], pool: Executor | None,
               done: Callable[[int], None] = lambda i: None,
               on_result: Callable[[Any], None] = lambda result: None) -> list[Any]:
    """``fn(*task)`` for every task: in this process and in the pool's, when there is a pool
    and more than one task.

    Tasks are started in input order, by the pool's processes and by this process, which runs
    the next task itself whenever it has no result to collect (with ``workers`` = N, N - 1 pool
    processes and this one share the work), unless the pool says ``shares_work = False`` (a
    cluster's executor: its tasks run on the cluster only). Each pool process is kept with one
    task: a task finishing in the pool hands the next one to the pool at once (from the pool's
    thread), so the pool never waits for this process to finish its own task. ``on_result``
    sees each result (in this process) as soon as it is collected (so finished work is
    recorded even if a later task fails or the run is interrupted), then ``done`` the task's
    index; results are returned in task order. When tasks fail, the error raised is that of
    the first failing task in input order, as in a serial run, whatever order they finished
    in.
    """
    if pool is None or (len(tasks) <= 1 and getattr(pool, "shares_work", True)):
        results = []
        for i, task in enumerate(tasks):
            results.append(fn(*task))
            on_result(results[i])
            done(i)
        return results
    return _Shared(fn, tasks, pool, done, on_result).run()


class _Shared:
    """The state of one :func:`run_shared` with a pool: what was handed out, collected and
    failed, guarded by one lock (the pool's callbacks run on its thread)."""

    def __init__(self, fn: Callable[..., Any], tasks: list[tuple[Any, ...]], pool: Executor,
                 done: Callable[[int], None], on_result: Callable[[Any], None]) -> None:
        self.fn, self.tasks, self.pool, self.done, self.on_result = (fn, tasks, pool, done,
                                                                     on_result)
        self.depth = max(1, getattr(pool, "_max_workers", 1))
        self.here = getattr(pool, "shares_work", True)  # this process runs tasks too
        self.lock = threading.Lock()
        self.futures: dict[Future[Any], int] = {}
        self.errors: dict[int, BaseException] = {}
        self.collected: set[int] = set()
        self.results: list[Any] = [None] * len(tasks)
        self.next = self.running = 0
        self.stop = False

    def run(self) -> list[Any]:
        try:
            self.feed()
            while not self.errors and self.step():
                pass
        except BaseException:
            with self.lock:
                self.stop = True
            for future in list(self.futures):  # interrupted: do not start queued tasks
                future.cancel()
            raise
        with self.lock:
            self.stop = True
        if self.errors:
            self.raise_first()
        return self.results

    def step(self) -> bool:
        """Collect what finished, else run the next task here, else wait for the pool;
        False when nothing is left."""
        self.collect()
        if self.errors:
            return False
        i = self.take() if self.here else None
        if i is not None:
            try:
                result = self.fn(*self.tasks[i])
            except Exception as exc:  # reported in input order
                self.errors[i] = exc
                return False
            self.record(i, result)
            return True
        with self.lock:
            pending = [f for f, j in self.futures.items() if j not in self.collected]
        if pending:
            wait(pending, return_when=FIRST_COMPLETED)
        return bool(pending)

    def take(self) -> int | None:
        with self.lock:
            if self.stop or self.next >= len(self.tasks):
                return None
            self.next += 1
            return self.next - 1

    def feed(self, finished: Future[Any] | None = None) -> None:
        """Hand tasks to the pool until it holds ``depth`` (also a finished task's callback)."""
        while True:
            with self.lock:
                if finished is not None:
                    self.running -= 1
                    finished = None
                if self.stop or self.next >= len(self.tasks) or self.running >= self.depth:
                    return
                i = self.next
                try:
                    future = self.pool.submit(self.fn, *self.tasks[i])
                except BaseException as exc:  # a broken pool: this task fails with it
                    self.errors[i] = exc
                    self.stop = True
                    return
                self.next += 1
                self.running += 1
                self.futures[future] = i
            future.add_done_callback(self.feed)

    def collect(self) -> None:
        with self.lock:
            ready = [(f, i) for f, i in self.futures.items()
                     if f.done() and i not in self.collected]
        for future, i in sorted(ready, key=lambda item: item[1]):
            self.collected.add(i)
            if future.exception() is not None:
                self.errors[i] = future.exception()
            else:
                self.record(i, future.result())

    def record(self, i: int, result: Any) -> None:
        self.results[i] = result
        self.on_result(result)
        self.done(i)

    def raise_first(self) -> None:
        """Every task before the earliest failure so far was started (in order): run those
        to the end, drop the later ones, and raise the earliest failure."""
        with self.lock:
            started = dict(self.futures)
        first = min(self.errors)
        for future, i in started.items():
            if i > first:
                future.cancel()
        wait([f for f in started if not f.cancelled()])
        for future, i in started.items():
            if not future.cancelled() and future.exception() is not None:
                self.errors[i] = future.exception()
        raise self.errors[min(self.errors)]
