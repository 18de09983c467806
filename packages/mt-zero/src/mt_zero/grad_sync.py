"""Bucketed, overlapped gradient averaging over the data-parallel group.

Every managed parameter gets a post-accumulate-grad hook. When all parameters of a bucket
have their gradient for this backward, the bucket is *complete*; complete buckets are
launched strictly in bucket order (so every rank issues the same collectives in the same
order even if autograd finishes them in another order) as async all-reduces (stages 0-1)
or reduce-scatters (stages 2-3) that run while backward continues. A callback queued on
the autograd engine runs when backward ends: it launches whatever is left (parameters that
got no gradient count as zero), waits for all handles and finalizes the buckets, so after
``loss.backward()`` returns the gradients are averaged.

Inside :meth:`GradSync.no_sync` nothing is communicated: gradients accumulate locally and
are reduced by the next synchronized backward (or by :meth:`GradSync.finish`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from mt_zero.buckets import FlatBucket

__all__ = ["GradSync"]


class GradSync:
    """Hooks that average gradients of ``buckets`` as backward produces them.

    Args:
        buckets: the flat buckets, in launch order.
        on_complete: called with a bucket once all its gradients of the current backward
            exist, and again for every bucket when backward ends, whether or not
            synchronization is enabled. Stage 3 frees the bucket's parameters there (the
            call must be idempotent).
    """

    def __init__(
        self,
        buckets: Sequence[FlatBucket],
        on_complete: Callable[[FlatBucket], None] | None = None,
    ) -> None:
        self.buckets = tuple(buckets)
        self._on_complete = on_complete
        self._sync = True
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._complete = [False] * len(self.buckets)
        self._launched = [False] * len(self.buckets)
        self._next = 0  # first bucket not yet launched
        self._callback_queued = False
        self._unreduced = False  # local gradients exist that no reduction has seen
        self._hooks = []
        for bucket in self.buckets:
            for position, p in enumerate(bucket.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    self._make_hook(bucket.index, position)))

    @property
    def launched(self) -> int:
        """Buckets whose reduction has started in the current backward (for overlap checks)."""
        return self._next

    @property
    def sync_enabled(self) -> bool:
        """False inside :meth:`no_sync`."""
        return self._sync

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without communication."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def remove_hooks(self) -> None:
        """Detach from the parameters (the buckets keep their storage)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _make_hook(self, index: int, position: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            # Also under no_sync: the bucket takes the gradient into its flat storage.
            self.buckets[index].absorb(position)
            self._on_grad(index, position)

        return hook

    def _on_grad(self, index: int, key: int) -> None:
        if not self._callback_queued:
            # Runs once the whole backward pass (this graph task) has finished.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        self._unreduced = True
        ready = self._ready[index]
        ready.add(key)
        if len(ready) == len(self.buckets[index].params) and not self._complete[index]:
            self._mark_complete(index)

    def _mark_complete(self, index: int) -> None:
        self._complete[index] = True
        if self._sync:
            self._launch_in_order(upto=len(self.buckets), only_complete=True)
        if self._on_complete is not None:
            self._on_complete(self.buckets[index])

    def _launch_in_order(self, upto: int, only_complete: bool) -> None:
        while self._next < upto and (self._complete[self._next] or not only_complete):
            self.buckets[self._next].start_reduce()
            self._launched[self._next] = True
            self._next += 1

    def _end_of_backward(self) -> None:
        if self._on_complete is not None:
            for bucket in self.buckets:
                self._on_complete(bucket)
        if self._sync:
            self._reduce_all()
        self._ready = [set() for _ in self.buckets]
        self._complete = [False] * len(self.buckets)
        self._callback_queued = False

    def _reduce_all(self) -> None:
        self._launch_in_order(upto=len(self.buckets), only_complete=False)
        for bucket, launched in zip(self.buckets, self._launched):
            if launched:
                bucket.finish_reduce()
        self._launched = [False] * len(self.buckets)
        self._next = 0
        self._unreduced = False

    def finish(self) -> None:
        """Before the optimizer step: reduce gradients no synchronized backward reduced.

        Needed when the last backward ran under :meth:`no_sync`; a no-op otherwise. Must be
        called on every rank (it may communicate).
        """
        if self._unreduced:
            self._reduce_all()
