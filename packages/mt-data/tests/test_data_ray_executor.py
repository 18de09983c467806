""":class:`mt_data.ray_executor.RayExecutor`'s futures against a stand-in for Ray (no
cluster): a task that finishes on Ray's callback thread while the driver cancels it (a run
stopping after another task's failure, or interrupted) ends cancelled or with its result,
and nothing fails on Ray's thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from mt_data.ray_executor import RayExecutor


class _Ref:
    """An object ref whose future Ray completes on a thread of its own."""

    def __init__(self, reached: threading.Event, go_on: threading.Event) -> None:
        self.reached, self.go_on = reached, go_on
        self.done: Future[Any] = _Paused(self)

    def future(self) -> Future[Any]:
        return self.done


class _Paused(Future):
    """Ray's future, whose callback pauses when it reads the task's outcome until the
    driver has acted: the thread switch a busy callback thread may take at that point."""

    def __init__(self, ref: _Ref) -> None:
        super().__init__()
        self.ref = ref

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.ref.reached.set()
        self.ref.go_on.wait(5)
        return super().exception(timeout)


class _Ray:
    """What RayExecutor uses of the ``ray`` module."""

    def __init__(self) -> None:
        self.refs: list[_Ref] = []
        self.reached, self.go_on = threading.Event(), threading.Event()

    def remote(self, **_options: Any) -> Any:
        ray = self

        class Remote:
            def remote(self, *_args: Any, **_kwargs: Any) -> _Ref:
                ray.refs.append(_Ref(ray.reached, ray.go_on))
                return ray.refs[-1]

        return lambda _fn: Remote()

    def cancel(self, _ref: _Ref) -> None:
        pass


@pytest.fixture
def callback_errors() -> Iterator[list[logging.LogRecord]]:
    """What concurrent.futures logs of callbacks that raised (on the thread that ran them)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger, handler = logging.getLogger("concurrent.futures"), Keep(logging.ERROR)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_a_task_cancelled_as_it_finishes_ends_once(callback_errors: list[logging.LogRecord]
                                                   ) -> None:
    ray = _Ray()
    executor = RayExecutor.__new__(RayExecutor)  # connect() skipped: no cluster
    executor._ray, executor._joined, executor._max_workers, executor._remote = ray, False, 1, {}
    with ThreadPoolExecutor(1, thread_name_prefix="ray-callbacks") as ray_thread:
        for task in range(5):
            ray.reached.clear()
            ray.go_on.clear()
            future = executor.submit(len, "task")
            finished = ray_thread.submit(ray.refs[-1].done.set_result, task)
            assert ray.reached.wait(5)  # Ray's thread is settling the task ...
            future.cancel()  # ... when the driver cancels it
            ray.go_on.set()
            finished.result()
            assert future.result(5) == task  # running when cancelled: not cancelled
        ray.go_on.set()
        future = executor.submit(len, "task")
        future.cancel()  # before Ray's thread settles it
        ray_thread.submit(ray.refs[-1].done.set_result, 0).result()
        assert future.cancelled()
    assert not callback_errors, callback_errors[0].getMessage()
