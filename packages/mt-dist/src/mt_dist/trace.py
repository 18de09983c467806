"""Every collective of a process, traced: kind, group, bytes, when launched, how long waited.

While a :class:`CollectiveTrace` is active (a context manager) it wraps torch.distributed's
collective and point-to-point functions, so it sees every collective the process issues,
whoever issues it: mt's own (:mod:`mt_dist.collectives`, the tensor-parallel mappings, the
pipeline's sends), DeepSpeed's and Megatron-core's alike; one ruler for every engine a
benchmark compares. A collective issued inside another (``batch_isend_irecv``'s sends, an
object all-gather's tensors) is counted once, as the outer call. Inside torch's
``_coalescing_manager`` (megatron-core's gradient buckets and parameter gathers) the calls
only queue their collectives: each is recorded launched when the block ends, waited on
with the block.

Each call becomes a :class:`CollectiveRecord`:

- ``blocked_s``, the seconds the calling thread could do nothing else: a synchronous call's
  whole duration; an asynchronous one's launch plus its time in ``wait()``. This is the
  *exposed* communication.
- ``in_flight_s``, from launch to the end of its wait (asynchronous calls; equal to
  ``blocked_s`` for synchronous ones). ``in_flight_s - blocked_s`` ran under other work: the
  *hidden* communication (an upper bound: the collective may have ended before the wait).
- ``bytes``: what this rank's buffer of the collective holds: an all-reduce's tensor, an
  all-gather's output, a reduce-scatter's input, a send's or receive's tensor.

:meth:`CollectiveTrace.take` hands over the records since the last take (one training step)
and :func:`summarize` adds them up per kind and group; :attr:`CollectiveTrace.origin_s`
places the records on the host's monotonic clock, so that ranks of one host can be lined up
(benchmarks/comm.py tells the time a rank waited for a slower peer from the collective's own).
"""

from __future__ import annotations

import inspect
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["CollectiveRecord", "CollectiveTrace", "as_dict", "summarize"]


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _p2p_bytes(ops: Any) -> int:
    return sum(_nbytes(getattr(op, "tensor", None)) for op in ops or ())


#: Traced function -> (the argument whose size counts, how to size it).
_SIZED: dict[str, tuple[str | None, Callable[[Any], int]]] = {
    "all_reduce": ("tensor", _nbytes),
    "broadcast": ("tensor", _nbytes),
    "reduce": ("tensor", _nbytes),
    "all_gather": ("tensor_list", _nbytes),
    "all_reduce_coalesced": ("tensors", _nbytes),
    "all_gather_into_tensor": ("output_tensor", _nbytes),
    "all_gather_single": ("output_tensor", _nbytes),
    "all_gather_coalesced": ("output_tensor_lists", _nbytes),
    "_all_gather_base": ("output_tensor", _nbytes),
    "reduce_scatter": ("input_list", _nbytes),
    "reduce_scatter_tensor": ("input", _nbytes),
    "reduce_scatter_single": ("input", _nbytes),
    "_reduce_scatter_base": ("input", _nbytes),
    "all_to_all_single": ("input", _nbytes),
    "all_to_all": ("input_tensor_list", _nbytes),
    "send": ("tensor", _nbytes),
    "recv": ("tensor", _nbytes),
    "isend": ("tensor", _nbytes),
    "irecv": ("tensor", _nbytes),
    "batch_isend_irecv": ("p2p_op_list", _p2p_bytes),
    "gather": ("tensor", _nbytes),
    "scatter": ("tensor", _nbytes),
    "barrier": (None, lambda _: 0),
    "monitored_barrier": (None, lambda _: 0),
    # Pickled objects: sizes unknown until pickled (their inner tensors are not counted).
    "all_gather_object": (None, lambda _: 0),
    "broadcast_object_list": (None, lambda _: 0),
    "gather_object": (None, lambda _: 0),
    "scatter_object_list": (None, lambda _: 0),
    "send_object_list": (None, lambda _: 0),
    "recv_object_list": (None, lambda _: 0),
}


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective call of this process (see the module docstring)."""

    kind: str
    group: str
    bytes: int
    launched_s: float
    """Seconds since the trace started (or since the last :meth:`CollectiveTrace.take`)."""
    blocked_s: float
    in_flight_s: float
    waited: bool
    """False for an asynchronous call nobody waited on before the take (its in-flight time
    is then its launch's only)."""


class _Pending:
    __slots__ = ("kind", "group", "nbytes", "launched", "blocked", "ended", "waited")

    def __init__(self, kind: str, group: str, nbytes: int, launched: float) -> None:
        self.kind, self.group, self.nbytes, self.launched = kind, group, nbytes, launched
        self.blocked, self.ended, self.waited = 0.0, launched, False


class _TracedWork:
    """An asynchronous collective's work object (or a coalesced block's manager) whose
    ``wait()`` is timed, its seconds shared by the ``pending`` records it waits for;
    everything else is the work object's own."""

    def __init__(self, work: Any, pending: list[_Pending]) -> None:
        object.__setattr__(self, "_work", work)
        object.__setattr__(self, "_pending", pending)

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            ended = time.perf_counter()
            for p in self._pending:
                p.blocked += (ended - began) / len(self._pending)
                p.ended, p.waited = max(p.ended, ended), True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CollectiveTrace:
    """Records every torch.distributed collective of this process while active.

    Args:
        names: what to call known groups in the records (e.g. ``{groups.tp: "tp"}``); the
            default group is ``"world"``, any other ``"ranks 0,2"``.

    Use ``with trace:`` around the work to trace (the functions are unwrapped after);
    :meth:`take` may be called inside or after. One trace active per process at a time.
    """

    _active: CollectiveTrace | None = None

    def __init__(self, names: Mapping[ProcessGroup | None, str] | None = None) -> None:
        self._names = {id(g): n for g, n in (names or {}).items() if g is not None}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._pending: list[_Pending] = []
        self._origin = time.perf_counter()
        self._saved: list[tuple[Any, str, Any]] = []

    # ---------------------------------------------------------------- turning it on, off
    def __enter__(self) -> CollectiveTrace:
        if CollectiveTrace._active is not None:
            raise RuntimeError("a CollectiveTrace is already active in this process")
        CollectiveTrace._active = self
        self._origin = time.perf_counter()
        # One wrapper per function, wherever torch names it: torch compares them by identity
        # (a P2POp's op must be distributed_c10d's isend or irecv).
        wrappers: dict[int, Callable[..., Any]] = {}
        for name in _SIZED:
            for module in (dist, dist.distributed_c10d):
                original = getattr(module, name, None)
                if original is None or getattr(original, "_mt_traced", False):
                    continue
                if id(original) not in wrappers:
                    wrappers[id(original)] = self._wrap(name, original)
                self._saved.append((module, name, original))
                setattr(module, name, wrappers[id(original)])
        original_cm = dist._coalescing_manager
        self._saved.append((dist, "_coalescing_manager", original_cm))
        dist._coalescing_manager = self._wrap_coalescing(original_cm)
        return self

    def _wrap_coalescing(self, original: Callable[..., Any]) -> Callable[..., Any]:
        trace = self

        @contextmanager
        def traced_cm(*args: Any, **kwargs: Any) -> Iterator[Any]:
            """torch's ``_coalescing_manager`` (megatron-core's bucket all-reduces): the
            calls in the block only queue their ops; the block's exit launches them (and,
            synchronous, waits), so their records take the exit's times."""
            block: list[_Pending] = []
            manager = original(*args, **kwargs)
            cm = manager.__enter__()
            trace._local.coalescing = block
            try:
                yield _TracedWork(cm, block)
            except BaseException:
                trace._local.coalescing = None
                if not manager.__exit__(*sys.exc_info()):
                    raise
                return
            trace._local.coalescing = None
            began = time.perf_counter()
            trace._local.depth = 1
            try:
                manager.__exit__(None, None, None)
            finally:
                trace._local.depth = 0
            ended = time.perf_counter()
            for p in block:
                p.launched, p.ended = began, ended
                p.blocked = (ended - began) / len(block)
                p.waited = not kwargs.get("async_ops", False)

        return traced_cm

    def __exit__(self, *exc: object) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()
        CollectiveTrace._active = None

    # ------------------------------------------------------------------------- records
    @property
    def origin_s(self) -> float:
        """The ``time.perf_counter()`` at which the pending records' ``launched_s`` start.
        On Linux that is CLOCK_MONOTONIC, one clock for every process of a host: ranks on
        one host can line their records up (who launched a collective last)."""
        with self._lock:
            return self._origin

    def take(self) -> list[CollectiveRecord]:
        """The collectives launched since the last take, in launch order; the clock of the
        next records restarts now."""
        now = time.perf_counter()
        with self._lock:
            pending, self._pending = self._pending, []
            origin, self._origin = self._origin, now
        return [CollectiveRecord(p.kind, p.group, p.nbytes, p.launched - origin, p.blocked,
                                 p.ended - p.launched, p.waited) for p in pending]

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Collectives inside are not recorded (e.g. the trace's own bookkeeping)."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth

    def _group_name(self, group: Any) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        name = self._names.get(id(group))
        if name is None:
            try:
                ranks = dist.get_process_group_ranks(group)
            except (RuntimeError, ValueError):
                return "?"
            name = "ranks " + ",".join(str(r) for r in ranks)
            self._names[id(group)] = name
        return name

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)
        sized, size_of = _SIZED[name]
        trace = self

        def traced(*args: Any, **kwargs: Any) -> Any:
            if getattr(trace._local, "depth", 0):  # inside another traced call
                return original(*args, **kwargs)
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                bound = {}
            group = bound.get("group")
            if name == "batch_isend_irecv":
                ops = bound.get("p2p_op_list") or ()
                group = getattr(ops[0], "group", None) if ops else None
            nbytes = size_of(bound.get(sized)) if sized else 0
            began = time.perf_counter()
            trace._local.depth = 1
            try:
                result = original(*args, **kwargs)
            finally:
                trace._local.depth = 0
            ended = time.perf_counter()
            pending = _Pending(name, trace._group_name(group), nbytes, began)
            pending.blocked, pending.ended = ended - began, ended
            block = getattr(trace._local, "coalescing", None)
            if block is not None and (result is None or isinstance(
                    result, dist.distributed_c10d._IllegalWork)):
                block.append(pending)  # launched (and timed) when the block ends
                with trace._lock:
                    trace._pending.append(pending)
                return result
            if isinstance(result, list) and result:  # batch_isend_irecv: a work per op
                result = [_TracedWork(w, [pending]) for w in result]  # their waits add up
            elif hasattr(result, "wait"):
                result = _TracedWork(result, [pending])
            else:  # synchronous: its whole time was waiting
                pending.waited = True
            with trace._lock:
                trace._pending.append(pending)
            return result

        traced._mt_traced = True  # type: ignore[attr-defined]
        traced.__wrapped__ = original  # type: ignore[attr-defined]
        return traced


def summarize(records: Sequence[CollectiveRecord]) -> dict[str, Any]:
    """Totals of ``records`` (one step's): ``collectives``, ``comm_bytes``,
    ``comm_exposed_s`` (seconds blocked), ``comm_hidden_s`` (seconds some collective was in
    flight while none blocked: the union of their in-flight intervals less the blocked time,
    so collectives in flight together count once) and ``by_kind``: the same per
    ``"KIND GROUP"``, with its count. Blocked intervals are taken as disjoint (one thread
    issues and waits)."""
    by: dict[str, list[CollectiveRecord]] = {}
    for r in records:
        by.setdefault(f"{r.kind} {r.group}", []).append(r)

    def totals(rows: Sequence[CollectiveRecord]) -> dict[str, Any]:
        exposed = math.fsum(r.blocked_s for r in rows)
        return {"n": len(rows), "bytes": sum(r.bytes for r in rows), "exposed_s": exposed,
                "hidden_s": max(0.0, _union(rows) - exposed)}

    whole = totals(records)
    return {"collectives": whole["n"], "comm_bytes": whole["bytes"],
            "comm_exposed_s": whole["exposed_s"], "comm_hidden_s": whole["hidden_s"],
            "by_kind": {k: totals(v) for k, v in sorted(by.items())}}


def _union(records: Sequence[CollectiveRecord]) -> float:
    """Seconds covered by the records' in-flight intervals."""
    total, end = 0.0, -math.inf
    for r in sorted(records, key=lambda r: r.launched_s):
        lo, hi = r.launched_s, r.launched_s + r.in_flight_s
        if lo > end:
            total, end = total + (hi - lo), hi
        elif hi > end:
            total, end = total + (hi - end), hi
    return total


def as_dict(record: CollectiveRecord) -> dict[str, Any]:
    """``record`` as a JSON-ready dict."""
    return asdict(record)
