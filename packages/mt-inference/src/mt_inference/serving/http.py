"""`mt serve`'s HTTP side: a Starlette application served by uvicorn on a thread of rank 0.

Routes: ``POST /v1/completions`` (:mod:`mt_inference.serving.api`; ``stream`` answers with
server-sent events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /health`` (503 while draining, or once the checkpoint's folder no longer holds what the
server loaded: :mod:`.watch`), ``GET /openapi.json`` (:mod:`.openapi`). With an API key
the /v1 routes need ``Authorization: Bearer KEY`` (compared in constant time; 401
otherwise). Every refusal is a JSON error object: malformed JSON, a wrong or unknown field
(400), a wrong key (401), an unknown model or route (404), another method (405, with
``Allow``), a body over the limit (413), a full queue (429, with Retry-After), draining
(503), a request past its time (504). A client that disconnects frees its rows at the
engine's next step.

Clients that hold connections without asking are cut off: a connection whose
request headers have not arrived ``client_timeout`` seconds after it opened (or after its
last response) is closed, and so is a body still arriving that long after its headers (408),
and one whose client stops reading its response: when the response's unsent bytes pass the
transport's high-water mark and do not drain within ``client_timeout`` seconds, the
connection is aborted (a client that asks and never reads would hold its connection, and
with enough of them every connection, for ever); past ``max_connections`` open connections,
the idlest one without a request in progress makes room for the new one. Parsing and
checking a body (up to ``max_body_bytes``) runs on a worker thread, so that large bodies do
not stall the event loop that answers everyone.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette  # pants: no-infer-dep
from starlette.concurrency import run_in_threadpool  # pants: no-infer-dep
from starlette.exceptions import HTTPException  # pants: no-infer-dep
from starlette.requests import ClientDisconnect, Request  # pants: no-infer-dep
from starlette.responses import JSONResponse, Response, StreamingResponse  # pants: no-infer-dep
from starlette.routing import Route  # pants: no-infer-dep

from mt_inference.serving.api import (
    FIELDS,
    ApiError,
    Choice,
    Limits,
    chunk_body,
    completion_body,
    error_body,
    now,
    parse_completion,
    usage_body,
)
from mt_inference.serving.engine import Inbox, Job
from mt_inference.serving.openapi import openapi_schema
from mt_inference.serving.watch import CheckpointWatch

__all__ = ["ServerConfig", "build_app", "start_server"]


@dataclass(frozen=True)
class ServerConfig:
    """What the HTTP side needs to check and queue requests."""

    model: str
    limits: Limits
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    stop_ids: tuple[int, ...]
    max_body_bytes: int = 1 << 20
    request_timeout: float = 600.0
    api_key: str | None = None
    """The /v1 routes need ``Authorization: Bearer API_KEY`` (None: no key)."""
    client_timeout: float = 30.0
    """Seconds a client has to send a request's headers, then its body, and to take in a
    response once the send buffer is full."""
    max_connections: int = 512
    """Open connections at most (more: the idlest without a request is closed)."""
    watch: CheckpointWatch | None = None
    """Whether the checkpoint is still what its path holds (None: not watched)."""


def _error(error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(error.message, error.kind, error.param, error.code),
                        status_code=error.status, headers=headers)


async def _body(request: Request, limit: int, seconds: float) -> bytes:
    """The body, at most ``limit`` bytes (413) and arrived within ``seconds`` (408); raises
    starlette's ClientDisconnect where the client goes away first."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body of {declared} bytes is over the limit of "
                       f"{limit}")
    body = bytearray()
    try:
        async with asyncio.timeout(seconds):
            async for piece in request.stream():
                body += piece
                if len(body) > limit:
                    raise ApiError(413, f"the request body is over the limit of {limit} "
                                   "bytes")
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {seconds:g} s (it "
                       f"had sent {len(body)} bytes)") from None
    return bytes(body)


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose names are all different (else which value was meant?)."""
    seen: dict[str, Any] = {}
    for name, value in pairs:
        if name in seen:
            raise ApiError(400, f"the request body gives {json.dumps(name[:40])} twice",
                           name if name in FIELDS else None)  # (dumps: lone surrogates too)
        seen[name] = value
    return seen


def _json(raw: bytes) -> Any:
    """The parsed body, or a 400 saying why not (malformed, not UTF-8, a name given twice in
    one object, nested past the parser's depth, a number of more digits than Python
    converts)."""
    try:
        return json.loads(raw, object_pairs_hook=_unique)
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON for mt serve (nested too "
                       "deep)") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, a 5,000-digit number
        raise ApiError(400, f"the request body is not valid JSON ({err})") from None


class _Handlers:
    """The routes of one server (``inbox``: where checked requests wait for the engine)."""

    def __init__(self, config: ServerConfig, inbox: Inbox) -> None:
        self.config, self.inbox = config, inbox
        self.model_card = {"id": config.model, "object": "model", "created": now(),
                           "owned_by": "mt", "max_model_len": config.limits.max_positions}
        if config.watch is not None:  # the folder served (vLLM's field for a model's path)
            self.model_card["root"] = config.watch.folder
        self.schema = openapi_schema(config.model, config.limits, config.api_key is not None)

    def refuse_key(self, request: Request) -> Response | None:
        """401 unless the request carries the key (constant-time compare), or no key is
        set."""
        key = self.config.api_key
        if key is None:
            return None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                              key.encode()):
            return None
        return _error(ApiError(401, "a valid API key is required: send the header "
                               "'Authorization: Bearer KEY'", code="invalid_api_key"),
                      {"WWW-Authenticate": "Bearer"})

    async def health(self, _request: Request) -> Response:
        inbox = self.inbox
        if inbox.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        change = await self.checkpoint_change()
        if change is not None:
            return JSONResponse({"status": "stale", "message": change}, status_code=503)
        return JSONResponse({"status": "ok", "waiting": len(inbox), "running": inbox.running,
                             "gone": inbox.gone})

    async def checkpoint_change(self) -> str | None:
        """:meth:`CheckpointWatch.change` on a worker thread (its ``stat`` calls may be slow
        on a network file system; the event loop answers everyone)."""
        watch = self.config.watch
        return None if watch is None else await run_in_threadpool(watch.change)

    async def openapi(self, _request: Request) -> Response:
        return JSONResponse(self.schema)

    async def models(self, request: Request) -> Response:
        refused = self.refuse_key(request)
        return refused or JSONResponse({"object": "list", "data": [self.model_card]})

    async def model(self, request: Request) -> Response:
        refused = self.refuse_key(request)
        if refused:
            return refused
        asked = request.path_params["model"]
        if asked != self.config.model:
            shown = asked if len(asked) <= 60 else asked[:57] + "..."
            return _error(ApiError(404, f"the model '{shown}' does not exist; this server "
                                   f"serves '{self.config.model}'", "model",
                                   code="model_not_found"))
        return JSONResponse(self.model_card)

    async def completions(self, request: Request) -> Response:
        refused = self.refuse_key(request)
        if refused:
            return refused
        config = self.config
        await self.checkpoint_change()  # announced once, when first seen
        try:
            raw = await _body(request, config.max_body_bytes, config.client_timeout)
            completion = await run_in_threadpool(self.parse, raw)
        except ClientDisconnect:  # gone before its request was whole: no one to answer
            return Response(status_code=499)
        except ApiError as err:
            return _error(err)
        job = Job(f"cmpl-{uuid.uuid4().hex}", completion, asyncio.get_running_loop(),
                  time.monotonic() + config.request_timeout)
        refusal = self.inbox.offer(job)
        if refusal == "full":
            return _error(ApiError(429, f"the queue is full ({self.inbox.max_waiting} "
                                   "requests wait); try again shortly",
                                   kind="rate_limit_exceeded"), {"Retry-After": "1"})
        if refusal == "draining":
            return _error(ApiError(503, "the server is shutting down", kind="unavailable"))
        created = now()
        if not completion.stream:
            return await self.whole(job, created, request)
        # The stream's status waits for its first event: a request refused before it started
        # (timed out waiting for room, failed at its prefill) gets its own status, not a 200.
        first = await self.next_event(job, request)
        if first is None:
            return Response(status_code=499)
        if first[0] == "error":
            return _error(first[1])
        return StreamingResponse(self.events(job, created, first),
                                 media_type="text/event-stream")

    def parse(self, raw: bytes) -> Any:
        """The checked completion request of body ``raw`` (ApiError: why not)."""
        config = self.config
        return parse_completion(_json(raw), config.model, config.encode, config.decode,
                                config.limits, config.stop_ids)

    @staticmethod
    async def next_event(job: Job, request: Request) -> tuple[str, Any] | None:
        """The job's next event, or None once its client has gone (the job is cancelled)."""
        while True:
            try:
                return await asyncio.wait_for(job.queue.get(), 1.0)
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancelled = True
                    return None

    async def whole(self, job: Job, created: int, request: Request) -> Response:
        try:
            while (event := await self.next_event(job, request)) is not None:
                kind, value = event
                if kind == "done":
                    return JSONResponse(completion_body(job.ident, self.config.model,
                                                        created, value))
                if kind == "error":
                    return _error(value)
            return Response(status_code=499)
        finally:
            if not job.finished:
                job.cancelled = True

    async def events(self, job: Job, created: int, first: tuple[str, Any]
                     ) -> AsyncIterator[str]:
        """The server-sent events of a stream, from the job's ``first`` event on."""
        usage = job.completion.include_usage

        def event(choice: Choice | None, counts: dict[str, int] | None = None) -> str:
            chunk = chunk_body(job.ident, self.config.model, created, choice, counts, usage)
            return f"data: {json.dumps(chunk)}\n\n"

        try:
            kind, value = first
            while kind == "delta":
                yield event(value)
                kind, value = await job.queue.get()
            if kind == "error":  # failed after its first event: the 200 is sent already
                yield f"data: {json.dumps(error_body(value.message, value.kind))}\n\n"
                return
            if usage:
                yield event(None, usage_body(value))
            yield "data: [DONE]\n\n"
        finally:
            if not job.finished:  # the client went away mid-stream
                job.cancelled = True


def build_app(config: ServerConfig, inbox: Inbox) -> Starlette:
    """The application: checks and queues requests; the engine (another thread) runs them."""
    handlers = _Handlers(config, inbox)

    async def http_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse(error_body(exc.detail, "invalid_request_error"),
                            status_code=exc.status_code, headers=exc.headers)

    async def server_error(_request: Request, exc: Exception) -> Response:
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}",
                                       "server_error"), status_code=500)

    app = Starlette(routes=[
        Route("/health", handlers.health, methods=["GET"]),
        Route("/openapi.json", handlers.openapi, methods=["GET"]),
        Route("/v1/models", handlers.models, methods=["GET"]),
        Route("/v1/models/{model:path}", handlers.model, methods=["GET"]),
        Route("/v1/completions", handlers.completions, methods=["POST"]),
    ], exception_handlers={HTTPException: http_error, Exception: server_error})
    # A trailing slash is a 404 like any unknown route: Starlette's redirect would answer a
    # POST with an empty 307 to an address built from the client's Host header.
    app.router.redirect_slashes = False
    return app


def _guarded_protocol(client_timeout: float, max_connections: int) -> type:
    """uvicorn's h11 protocol, cutting off clients that hold a connection without asking:
    each connection must deliver a request's headers within ``client_timeout`` seconds of
    opening or of its last response, and read its response (a write paused by a full buffer
    must resume within ``client_timeout`` seconds); past ``max_connections``, the connection
    idle longest (no request in progress) is closed for the new one, or the new one if all
    are busy."""
    from uvicorn.protocols.http.h11_impl import H11Protocol  # pants: no-infer-dep

    class Guarded(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _stalled: asyncio.TimerHandle | None = None
        _idle_since = 0.0

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_request()
            open_ = [c for c in self.connections
                     if isinstance(c, Guarded) and not c.transport.is_closing()]
            if len(open_) > max_connections:  # (a closed one leaves the set a little later)
                idle = [c for c in open_ if not c.busy]
                min(idle, key=lambda c: c._idle_since, default=self).cut()

        @property
        def busy(self) -> bool:
            """A request in progress (its headers arrived, its response not complete)."""
            return self.cycle is not None and not self.cycle.response_complete

        def _await_request(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._idle_since = time.monotonic()
            self._deadline = self.loop.call_later(client_timeout, self._expire)

        def _expire(self) -> None:
            if not self.busy:
                self.cut()

        def cut(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            if not self.transport.is_closing():
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_request()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stalled is None:  # unsent bytes can never go: abort, not close
                self._stalled = self.loop.call_later(client_timeout, self.transport.abort)

        def resume_writing(self) -> None:
            if self._stalled is not None:
                self._stalled.cancel()
                self._stalled = None
            super().resume_writing()

        def connection_lost(self, exc: Exception | None) -> None:
            for timer in (self._deadline, self._stalled):
                if timer is not None:
                    timer.cancel()
            super().connection_lost(exc)

    return Guarded


def start_server(app: Starlette, host: str, port: int, client_timeout: float = 30.0,
                 max_connections: int = 512) -> tuple[Any, threading.Thread]:
    """Serve ``app`` with uvicorn on a thread (signals stay with the main thread), its
    connections guarded (:func:`_guarded_protocol`); returns (the server, its thread) once it
    listens. Raises OSError if the port cannot be bound."""
    import uvicorn  # pants: no-infer-dep

    server = uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=5, http=_guarded_protocol(client_timeout, max_connections)))
    failure: list[BaseException] = []

    def run() -> None:
        try:
            server.run()
        except BaseException as err:  # noqa: BLE001 - reported to the starting thread
            failure.append(err)

    thread = threading.Thread(target=run, name="mt-serve-http", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.02)
    if not server.started:
        raise OSError(f"cannot serve on {host}:{port}"
                      + (f" ({failure[0]})" if failure else " (is the port in use?)"))
    for listening in getattr(server, "servers", []):  # --port 0: the one the system chose
        for sock in listening.sockets or ():
            server.config.port = sock.getsockname()[1]
            break
    return server, thread
