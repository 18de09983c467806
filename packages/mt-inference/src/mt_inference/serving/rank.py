"""`mt serve` on its ranks: the model (whole on one process, or this rank's stage of a TP x PP
layout), the engine loop, and on rank 0 the HTTP server and the signals (SIGTERM or Ctrl-C:
drain, then stop every rank; a second one: stop at once)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mt_dist import LaunchInfo
from mt_inference.placement import Placement
from mt_inference.serving.api import ApiError, Limits
from mt_inference.serving.engine import Command, Dispatcher, Inbox, ServeLoop

__all__ = ["ServeSpec", "serve", "serve_rank"]


@dataclass(frozen=True)
class ServeSpec:
    """One `mt serve` (the command's options)."""

    placement: Placement
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    max_batch: int = 16
    """Rows decoded together on each replica."""
    max_waiting: int = 64
    """Requests waiting for room before 429."""
    max_prompts: int = 64
    max_tokens: int | None = None
    max_body_bytes: int = 1 << 20
    request_timeout: float = 600.0
    api_key: str | None = field(default=None, repr=False)
    """The /v1 routes need ``Authorization: Bearer API_KEY`` (None: open)."""
    client_timeout: float = 30.0
    """Seconds a client has to send a request's headers, then its body, and to take in a
    response once the send buffer is full."""
    max_connections: int = 512
    """Open connections at most (the idlest without a request makes room)."""

    @property
    def name(self) -> str:
        """The model name clients use (the checkpoint folder's, unless given)."""
        return self.model_name or Path(self.placement.checkpoint).resolve().name


@dataclass
class _Served:
    """The model as this rank serves it."""

    tokenizer: Any
    loop: ServeLoop
    vocab_size: int
    replicas: int
    close: Callable[[bool], None]


def _single(spec: ServeSpec) -> _Served:
    from mt_inference.generation import Generator

    generator = Generator.load(spec.placement)
    loop = ServeLoop(generator.model, 0, True, lambda c: c,  # type: ignore[arg-type, return-value]
                     lambda r: r)
    return _Served(generator.tokenizer, loop, generator.model.model.config.vocab_size, 1,
                   lambda _completed: None)


def _parallel(spec: ServeSpec, info: LaunchInfo) -> _Served:
    import torch.distributed as dist

    from mt_inference.decoder import StageDecoder
    from mt_inference.session import ScoringSession

    session = ScoringSession(spec.placement, info)
    groups = session.groups
    world = groups.topology.world_size

    def broadcast(command: Command | None) -> Command:
        box = [command]
        dist.broadcast_object_list(box, src=0, device=groups.device)
        assert box[0] is not None
        return box[0]

    def gather(results: list) -> list:
        parts: list[Any] = [None] * world
        dist.gather_object(results, parts if groups.rank == 0 else None, dst=0)
        return [item for part in parts for item in part] if groups.rank == 0 else []

    loop = ServeLoop(StageDecoder(session), groups.dp_rank,
                     groups.pp_rank == 0 and groups.tp_rank == 0, broadcast, gather)
    return _Served(session.tokenizer, loop, session.model.config.vocab_size, groups.dp_size,
                   session.close)


def serve_rank(spec: ServeSpec, info: LaunchInfo | None,
               announce: Callable[[str], None] = lambda line: print(line, file=sys.stderr,
                                                                   flush=True)) -> None:
    """Serve ``spec`` as rank ``info.rank`` (``info`` None: one process, the model whole)."""
    from mt_inference.serving.watch import CheckpointWatch

    # What the checkpoint's path holds before the model is read: a change while it loads
    # counts too.
    watch = CheckpointWatch(spec.placement.checkpoint, announce) if info is None or \
        info.rank == 0 else None
    served = _single(spec) if info is None else _parallel(spec, info)
    positions = served.loop.batch.model.max_positions
    if spec.max_tokens is not None and spec.max_tokens >= positions:  # every rank alike
        from mt_eval import TaskError

        served.close(True)
        raise TaskError(f"--max-tokens {spec.max_tokens} would never apply: the model's "
                        f"{positions} positions leave {positions - 1} new tokens at most; "
                        f"give at most {positions - 1}, or leave it out")
    loop, tokenizer = served.loop, served.tokenizer
    if info is not None and info.rank != 0:  # rank 0 decides when to stop; the others follow
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        completed = False
        try:
            loop.run(None)
            completed = True
        finally:
            served.close(completed)
        return
    from mt_inference.serving.http import ServerConfig, build_app, start_server

    inbox = Inbox(spec.max_waiting)
    # A request's rows (prompts x n) run together on one replica: at most --max-batch.
    limits = Limits(loop.batch.model.max_positions, served.vocab_size,
                    min(spec.max_prompts, spec.max_batch), spec.max_tokens)
    config = ServerConfig(spec.name, limits,
                          tokenizer.encode, tokenizer.decode, (tokenizer.eod_id,),
                          spec.max_body_bytes, spec.request_timeout, spec.api_key,
                          spec.client_timeout, spec.max_connections, watch)
    server, thread = start_server(build_app(config, inbox), spec.host, spec.port,
                                  spec.client_timeout, spec.max_connections)
    signals: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        signals.append(signum)
        if len(signals) > 1:
            raise KeyboardInterrupt(f"signal {signum} received twice")
        inbox.drain()
        announce("draining: finishing the accepted requests, refusing new ones (interrupt "
                 "again to stop at once)")

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    key = ("an API key is required (Authorization: Bearer)" if spec.api_key else
           "no API key: anyone who reaches this address may use it")
    announce(f"serving '{spec.name}' at http://{spec.host}:{server.config.port}/v1 "
             f"(completions, models; health at /health, schema at /openapi.json); {key}")
    dispatcher = Dispatcher(inbox, tokenizer.decode, served.replicas, spec.max_batch,
                            loop.batch.check, tokenizer.token_bytes)
    completed = False
    try:
        loop.run(dispatcher)
        completed = True
    except KeyboardInterrupt:  # a second signal: stopped at once
        dispatcher.fail_all(ApiError(503, "the server was stopped", kind="unavailable"))
        raise
    except BaseException:
        dispatcher.fail_all(ApiError(500, "the server stopped", kind="server_error"))
        raise
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        server.should_exit = True
        thread.join(10)
        served.close(completed)
    announce("stopped")


def serve(spec: ServeSpec) -> None:
    """Serve ``spec``: the model whole on this process, as one rank under a launcher, or on
    ``--nproc`` local processes (rank 0 listens; its port is checked before the model is
    read)."""
    from mt_dist import discover
    from mt_inference.launch import launch

    if discover(os.environ).rank == 0:
        _check_port(spec.host, spec.port)
    if spec.placement.whole_here():
        serve_rank(spec, None)
        return
    launch(replace(spec, model_name=spec.name), serve_rank)  # named before any conversion


def _check_port(host: str, port: int) -> None:
    """OSError naming the address when ``host:port`` cannot be listened on."""
    import socket

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as err:
        raise OSError(f"cannot serve on {host}:{port}: {err.strerror or err}") from None
