"""`mt serve`'s HTTP side: a Starlette application served by uvicorn on a thread of rank 0.

Routes: ``POST /v1/completions`` (:mod:`mt_pretrain.serving.api`; ``stream`` answers with
server-sent events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` (503
while draining). Every refusal is a JSON error object: malformed JSON, a wrong field (400),
an unknown model or route (404), a body over the limit (413), a full queue (429, with
Retry-After), draining (503), a request past its time (504). A client that disconnects
frees its rows at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette  # pants: no-infer-dep
from starlette.exceptions import HTTPException  # pants: no-infer-dep
from starlette.requests import Request  # pants: no-infer-dep
from starlette.responses import JSONResponse, Response, StreamingResponse  # pants: no-infer-dep
from starlette.routing import Route  # pants: no-infer-dep

from mt_pretrain.serving.api import (
    ApiError,
    Limits,
    chunk_body,
    completion_body,
    error_body,
    now,
    parse_completion,
)
from mt_pretrain.serving.engine import Inbox, Job

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


def _error(error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    code = "model_not_found" if error.status == 404 and error.param == "model" else None
    return JSONResponse(error_body(error.message, error.kind, error.param, code),
                        status_code=error.status, headers=headers)


async def _body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body of {declared} bytes is over the limit of "
                       f"{limit}")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise ApiError(413, f"the request body is over the limit of {limit} bytes")
    return bytes(body)


def build_app(config: ServerConfig, inbox: Inbox) -> Starlette:
    """The application: checks and queues requests; the engine (another thread) runs them."""

    async def health(_request: Request) -> Response:
        if inbox.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok", "waiting": len(inbox), "running": inbox.running,
                             "gone": inbox.gone})

    async def models(_request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": config.model, "object": "model", "created": now(), "owned_by": "mt",
             "max_model_len": config.limits.max_positions}]})

    async def completions(request: Request) -> Response:
        try:
            raw = await _body(request, config.max_body_bytes)
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ApiError(400, f"the request body is not valid JSON ({err})") from None
            completion = parse_completion(body, config.model, config.encode, config.decode,
                                          config.limits, config.stop_ids)
        except ApiError as err:
            return _error(err)
        job = Job(f"cmpl-{uuid.uuid4().hex}", completion, asyncio.get_running_loop(),
                  time.monotonic() + config.request_timeout)
        refused = inbox.offer(job)
        if refused == "full":
            return _error(ApiError(429, f"the queue is full ({inbox.max_waiting} requests "
                                   "wait); try again shortly", kind="rate_limit_exceeded"),
                          {"Retry-After": "1"})
        if refused == "draining":
            return _error(ApiError(503, "the server is shutting down", kind="unavailable"))
        created = now()
        if completion.stream:
            return StreamingResponse(_events(job, created), media_type="text/event-stream")
        return await _whole(job, created, request)

    async def _whole(job: Job, created: int, request: Request) -> Response:
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(job.queue.get(), 1.0)
                except TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                if kind == "done":
                    return JSONResponse(completion_body(job.ident, config.model, created,
                                                        value))
                if kind == "error":
                    return _error(value)
        finally:
            if not job.finished:
                job.cancelled = True

    async def _events(job: Job, created: int) -> AsyncIterator[str]:
        try:
            while True:
                kind, value = await job.queue.get()
                if kind == "delta":
                    chunk = chunk_body(job.ident, config.model, created, value)
                    yield f"data: {json.dumps(chunk)}\n\n"
                elif kind == "error":
                    yield f"data: {json.dumps(error_body(value.message, value.kind))}\n\n"
                    return
                else:
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not job.finished:  # the client went away mid-stream
                job.cancelled = True

    async def http_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse(error_body(exc.detail, "invalid_request_error"),
                            status_code=exc.status_code)

    async def server_error(_request: Request, exc: Exception) -> Response:
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}",
                                       "server_error"), status_code=500)

    return Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ], exception_handlers={HTTPException: http_error, Exception: server_error})


def start_server(app: Starlette, host: str, port: int) -> tuple[Any, threading.Thread]:
    """Serve ``app`` with uvicorn on a thread (signals stay with the main thread); returns
    (the server, its thread) once it listens. Raises OSError if the port cannot be bound."""
    import uvicorn  # pants: no-infer-dep

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=5))
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
    return server, thread
