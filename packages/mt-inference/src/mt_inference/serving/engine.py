"""The decoding side of `mt serve`: continuous batching on every rank, driven by rank 0.

The HTTP thread puts each checked request (a :class:`Job`) into the :class:`Inbox`, a bounded
queue. Every rank runs :meth:`ServeLoop.run`: at each iteration rank 0's :class:`Dispatcher`
decides a :class:`Command` (the jobs to admit, each to the least loaded data-parallel replica
with room; the rows to cancel: finished by a stop string, timed out, or their client gone;
whether to stop), every rank receives it, each replica runs one step of its
:class:`~mt_model.DecodeBatch`, and the replicas' new tokens come back to rank 0, which turns
them into text for the jobs (:class:`~mt_inference.text.TextStream`: cut at stop
strings) and hands each job its pieces through the job's own asyncio queue. While nothing
runs, rank 0 waits up to a second for work, then sends an empty command (the other ranks'
collectives never wait long). Draining (SIGTERM) refuses new work, finishes what was
accepted, then stops every rank.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from mt_inference.serving.api import (
    ApiError,
    Choice,
    Completion,
    TokenEntries,
    move_logprobs,
    new_logprobs,
    scores_logprobs,
)
from mt_inference.text import TextStream
from mt_model import DecodeBatch, DecodeModel, DecodeRequest, PromptScores, Token

__all__ = ["Command", "Dispatcher", "Inbox", "Job", "ServeLoop"]

_IDLE_WAIT_S = 1.0


@dataclass
class Job:
    """One request's work: filled by the engine, read by the HTTP handler on ``loop``."""

    ident: str
    completion: Completion
    loop: asyncio.AbstractEventLoop
    deadline: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    """Set by the HTTP side: the client went away."""
    finished: bool = False

    @property
    def rows(self) -> int:
        return self.completion.rows

    def put(self, kind: str, value: Any) -> None:
        """Hand ``(kind, value)`` to the handler: ``delta`` (a streamed :class:`Choice`),
        ``done`` (the list of choices) or ``error`` (an :class:`ApiError`)."""
        if kind != "delta":
            self.finished = True
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the server's loop has closed
            pass


class Inbox:
    """Jobs waiting for room in the batch: at most ``max_waiting``; none once draining."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self._waiting: deque[Job] = deque()
        self._ready = threading.Condition()
        self.draining = False
        self.running = 0
        """Rows the engine decodes now (set by the dispatcher)."""
        self.gone = 0
        """Requests whose client went away before their end."""

    def offer(self, job: Job) -> str | None:
        """Queue ``job``; or why not: ``draining`` or ``full``."""
        with self._ready:
            if self.draining:
                return "draining"
            if len(self._waiting) >= self.max_waiting:
                return "full"
            self._waiting.append(job)
            self._ready.notify()
            return None

    def drain(self) -> None:
        """Refuse new jobs; the engine stops once the accepted ones are done."""
        with self._ready:
            self.draining = True
            self._ready.notify()

    def wait(self, timeout: float) -> None:
        """Return when a job waits, draining began, or after ``timeout`` seconds."""
        with self._ready:
            if not self._waiting and not self.draining:
                self._ready.wait(timeout)

    def take(self, fits: Callable[[Job], bool]) -> list[Job]:
        """The waiting jobs, first come first, while ``fits(job)`` (which reserves room)."""
        taken = []
        with self._ready:
            while self._waiting and fits(self._waiting[0]):
                taken.append(self._waiting.popleft())
        return taken

    def __len__(self) -> int:
        with self._ready:
            return len(self._waiting)


@dataclass(frozen=True)
class Command:
    """What every rank does in one iteration."""

    admit: tuple[tuple[int, Hashable, DecodeRequest], ...] = ()
    """(replica, row key, request) to prefill and add."""
    cancel: tuple[Hashable, ...] = ()
    stop: bool = False


@dataclass
class _Row:
    job: Job
    index: int
    replica: int
    stream: TextStream
    choice: Choice
    entries: TokenEntries
    """Its tokens' ``logprobs`` texts and the characters each completes."""
    held: Choice = field(default_factory=lambda: Choice(0))
    """Log-probability entries of tokens whose text is held back (a stop string may still
    cut them): sent with the text they make, dropped where a stop string cuts it."""
    sent: int = 0
    """Characters of the token entries sent so far (the next chunk's text offset)."""


class Dispatcher:
    """Rank 0's side of the engine: commands out, tokens in, text to the jobs."""

    def __init__(self, inbox: Inbox, decode: Callable[[list[int]], str], replicas: int,
                 max_batch: int, check: Callable[[DecodeRequest], None],
                 token_bytes: Callable[[int], bytes] | None = None) -> None:
        self.inbox, self.decode, self.check = inbox, decode, check
        self.token_bytes = token_bytes or (lambda token: decode([token]).encode())
        """A token's bytes (the tokenizer's; by default its text's)."""
        self.max_batch = max_batch
        self.load = [0] * replicas
        self.rows: dict[Hashable, _Row] = {}
        self.left: dict[str, int] = {}  # rows of each job still running
        self.done: dict[str, dict[int, Choice]] = {}  # finished rows of each job
        self._cancel: list[Hashable] = []

    def _end(self, job: Job, kind: str, value: Any) -> None:
        for key in [k for k, row in self.rows.items() if row.job is job]:
            self._drop(key)
            self._cancel.append(key)
        self.left.pop(job.ident, None)
        self.done.pop(job.ident, None)
        job.put(kind, value)

    def _drop(self, key: Hashable) -> None:
        row = self.rows.pop(key)
        self.load[row.replica] -= 1

    def command(self) -> Command:
        """The next command (waits up to a second when there is nothing to do)."""
        clock = time.monotonic()
        for job in {id(r.job): r.job for r in self.rows.values()}.values():
            if job.cancelled:
                self.inbox.gone += 1
                self._end(job, "error", ApiError(499, "the client went away"))
            elif clock > job.deadline:
                self._end(job, "error", ApiError(504, "the request timed out", kind="timeout"))
        if not self.rows and not self._cancel:
            self.inbox.wait(_IDLE_WAIT_S)
            clock = time.monotonic()  # the jobs that came meanwhile are judged now
        admit = []
        job_replica: dict[str, int] = {}

        def fits(job: Job) -> bool:
            replica = min(range(len(self.load)), key=self.load.__getitem__)
            if self.load[replica] + job.rows > self.max_batch and self.load[replica]:
                return False
            self.load[replica] += job.rows
            job_replica[job.ident] = replica
            return True

        for job in self.inbox.take(fits):
            replica = job_replica[job.ident]
            refusal = None
            if job.cancelled:
                self.inbox.gone += 1
                refusal = ApiError(499, "the client went away")
            elif clock > job.deadline:
                refusal = ApiError(504, "the request timed out waiting for room",
                                   kind="timeout")
            try:
                requests = [] if refusal else self._requests(job.completion)
            except ValueError as err:  # this request cannot run here: it fails, not the server
                refusal = ApiError(400, str(err), "prompt")
            except Exception as err:  # noqa: BLE001 - a fault with one request is its own
                refusal = ApiError(500, f"internal error: {_reason(err)}", kind="server_error")
            if refusal is not None:
                self.load[replica] -= job.rows
                job.put("error", refusal)
                continue
            for index, request in enumerate(requests):
                key = (job.ident, index)
                self.rows[key] = _Row(job, index, replica, TextStream(
                    self.decode, job.completion.stop), Choice(index, prompt_tokens=len(
                        request.prompt) if index % job.completion.n == 0 else 0),
                    TokenEntries(self.token_bytes))
                admit.append((replica, key, request))
            self.left[job.ident] = job.rows
        cancel, self._cancel = tuple(self._cancel), []
        stop = self.inbox.draining and not self.rows and not admit and not len(self.inbox)
        self.inbox.running = len(self.rows)
        return Command(tuple(admit), cancel, stop)

    def _requests(self, completion: Completion) -> list[DecodeRequest]:
        """One decoding request per row of ``completion``, each checked against the model
        (a ValueError naming the numbers when one cannot run)."""
        requests = []
        for index, rule in enumerate(completion.sampling):
            request = DecodeRequest(completion.prompts[index // completion.n], rule,
                                    echo=completion.echo and completion.logprobs is not None,
                                    top_logprobs=completion.logprobs or 0)
            self.check(request)
            requests.append(request)
        return requests

    def deliver(self, results: list[tuple[str, Hashable, Any]]) -> None:
        """Turn the replicas' prompt scores, new tokens and failures into the jobs' text."""
        for kind, key, value in results:
            row = self.rows.get(key)
            if row is None:  # cancelled meanwhile
                continue
            try:
                if kind == "error":  # decoding this row failed: its request fails alone
                    self._end(row.job, "error", ApiError(500, f"decoding failed: {value}",
                                                         kind="server_error"))
                elif kind == "scores":
                    self._echo(row, value)
                else:
                    self._token(key, row, value)
            except Exception as err:  # noqa: BLE001 - a fault with one request is its own
                self._end(row.job, "error", ApiError(500, f"internal error: {_reason(err)}",
                                                     kind="server_error"))
        self.inbox.running = len(self.rows)

    def _echo(self, row: _Row, scores: PromptScores | None) -> None:
        completion = row.job.completion
        if not completion.echo:
            return
        text = completion.texts[row.index // completion.n]
        delta = Choice(row.index, text)
        if completion.logprobs is not None:
            prompt = completion.prompts[row.index // completion.n]
            scores_logprobs((delta, row.choice), prompt, scores, row.entries)
        row.choice.text += text
        row.sent = sum(delta.widths or ())
        if completion.stream:
            row.job.put("delta", delta)

    def _token(self, key: Hashable, row: _Row, event: Token) -> None:
        completion = row.job.completion
        delta = Choice(row.index)
        if event.token is not None:
            delta.text = row.stream.push(event.token)
            row.choice.completion_tokens += 1
            if completion.logprobs is not None:
                new_logprobs(row.held, event, row.entries)
        finish = "stop" if row.stream.stopped else event.finish
        keep = None  # of the held entries
        if finish is not None:
            delta.text += row.stream.flush()
            delta.finish_reason = row.choice.finish_reason = finish
            if row.stream.stopped:
                kept = row.choice.completion_tokens = row.stream.kept()
                keep = kept - (len(row.stream.tokens) - len(row.held.tokens or ()))
                if event.finish is None:
                    self._cancel.append(key)
        if delta.text or finish is not None:  # the entries go out with the text they make
            delta.offset = row.sent
            move_logprobs(row.held, [delta, row.choice], keep)
            row.sent += sum(delta.widths or ())
        row.choice.text += delta.text
        if completion.stream and (delta.text or delta.tokens or delta.finish_reason):
            row.job.put("delta", delta)
        if finish is None:
            return
        self._drop(key)
        ident = row.job.ident
        self.done.setdefault(ident, {})[row.index] = row.choice
        self.left[ident] -= 1
        if self.left[ident] == 0:
            del self.left[ident]
            done = self.done.pop(ident)
            row.job.put("done", [done[i] for i in sorted(done)])

    def fail_all(self, error: ApiError) -> None:
        """End every accepted job with ``error`` (the engine failed or was stopped at once):
        the running ones and those still waiting, and refuse new ones."""
        self.inbox.drain()
        for job in {id(r.job): r.job for r in self.rows.values()}.values():
            self._end(job, "error", error)
        for job in self.inbox.take(lambda _job: True):
            job.put("error", error)


class ServeLoop:
    """The loop every rank runs (see the module docstring).

    Args:
        model: this rank's :class:`~mt_model.DecodeModel`.
        replica: this rank's data-parallel replica.
        reports: this rank hands its replica's results to rank 0.
        broadcast: rank 0's command to every rank (identity with one process).
        gather: every reporting rank's results, joined on rank 0 (identity with one).
    """

    def __init__(self, model: DecodeModel, replica: int, reports: bool,
                 broadcast: Callable[[Command | None], Command],
                 gather: Callable[[list], list]) -> None:
        self.batch = DecodeBatch(model)
        self.replica, self.reports = replica, reports
        self.broadcast, self.gather = broadcast, gather

    def run(self, dispatcher: Dispatcher | None) -> None:
        """Serve until rank 0's dispatcher says stop."""
        while True:
            command = self.broadcast(dispatcher.command() if dispatcher else None)
            results = self.iterate(command)
            if command.stop:
                return
            gathered = self.gather(results if self.reports else [])
            if dispatcher is not None:
                dispatcher.deliver(gathered)

    def iterate(self, command: Command) -> list[tuple[str, Hashable, Any]]:
        """Run one command on this rank: cancel, admit this replica's rows, one step (none
        once told to stop); returns this replica's results. A row whose prefill or step
        raises is reported as ``("error", key, message)`` and leaves the batch: one request
        never stops the server (every rank of a replica fails alike, before or after the
        same collectives, as the checks that raise are the same on every rank)."""
        batch = self.batch
        if command.cancel:
            batch.cancel(command.cancel)
        mine = [(key, request) for replica, key, request in command.admit
                if replica == self.replica]
        results: list[tuple[str, Hashable, Any]] = []
        if mine:
            try:
                scores = batch.add([r for _, r in mine], [k for k, _ in mine])
            except Exception as err:  # noqa: BLE001 - reported to its requests' clients
                results += [("error", key, _reason(err)) for key, _ in mine]
            else:
                results += [("scores", key, s) for (key, _), s in zip(mine, scores,
                                                                       strict=True)]
        if command.stop:
            return results
        try:
            results += [("token", event.key, event) for event in batch.step()]
        except Exception as err:  # noqa: BLE001 - the rows of the failed step fail
            keys = [row.key for row in batch.rows]
            batch.cancel(keys)
            results += [("error", key, _reason(err)) for key in keys]
        return results


def _reason(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"
