"""`mt serve`: OpenAI's completions API over any checkpoint mt reads, at any layout."""

from __future__ import annotations

import contextlib
import importlib.util
import math
from typing import Annotated

import typer
from rich.console import Console

from mt_inference.cli.options import command_app, errors, fail
from mt_inference.placement import Placement

__all__ = ["app", "serve_command"]

_HELP = (
    "Serve a checkpoint over HTTP with OpenAI's completions API, so that the openai client, "
    "lm-evaluation-harness's local-completions model and other OpenAI-style tools talk to "
    "it.\n\n"
    "Routes: POST /v1/completions (prompt as text, token ids or a list of them; max_tokens, "
    "temperature, top_p, top_k, stop, seed, logprobs, echo, stream as server-sent events), "
    "GET /v1/models, GET /v1/models/ID, GET /health, GET /openapi.json (the schema of what "
    "this server accepts, with its limits). Unknown fields are refused (400 naming them), "
    "as OpenAI does. Requests are batched continuously (they join the running "
    "batch and leave it as they finish); --max-waiting requests may wait for room, then the "
    "server answers 429; bad requests get a JSON error naming the field (400), the server "
    "stays up. Listens on 127.0.0.1 unless --host says otherwise; with --api-key (or the "
    "MT_API_KEY variable, which keeps the key out of the process list) the /v1 routes need "
    "'Authorization: Bearer KEY' (401 otherwise). Any other address than loopback needs a "
    "key, or --allow-no-key to serve it open on purpose. SIGTERM or Ctrl-C drains "
    "(new requests get 503, accepted ones finish), then every rank stops.\n\n"
    "CHECKPOINT is an mt pretrain checkpoint (any layout) or any folder mt convert reads. "
    "--nproc N serves on N local processes at --tp x --pp (data parallelism takes the rest: "
    "each replica decodes its own requests); under torchrun, mpirun or srun each process is "
    "one rank and rank 0 listens. Needs pip install 'mt-inference\\[serve]'."
)


def serve_command(
    placement: Placement,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free one).")] = 8000,
    model_name: Annotated[str | None, typer.Option(
        help="The model's name in the API (default: the checkpoint folder's name).")] = None,
    max_batch: Annotated[int, typer.Option(
        help="Prompts decoded together on each replica.")] = 16,
    max_waiting: Annotated[int, typer.Option(
        help="Requests that may wait for room (more get 429).")] = 64,
    max_tokens: Annotated[int | None, typer.Option(
        help="New tokens a request may ask at most (default: what the positions allow).")
    ] = None,
    max_body_bytes: Annotated[int, typer.Option(
        help="Largest request body (larger: 413).")] = 1 << 20,
    request_timeout: Annotated[float, typer.Option(
        help="Seconds a request may take, waiting included (then 504).")] = 600.0,
    client_timeout: Annotated[float, typer.Option(
        help="Seconds a client has to send a request's headers, and then its body, and to "
        "take in its response once the server's send buffer is full (else its connection "
        "is closed; a late body: 408).")] = 30.0,
    max_connections: Annotated[int, typer.Option(
        help="Open connections at most: past it, the one idle longest (no request in "
        "progress) is closed for the new one.")] = 512,
    api_key: Annotated[str | None, typer.Option(
        envvar="MT_API_KEY", show_envvar=True,
        help="Key the /v1 routes require as 'Authorization: Bearer KEY'.")] = None,
    allow_no_key: Annotated[bool, typer.Option(
        "--allow-no-key", help="Serve a non-loopback --host without a key (anyone who "
        "reaches it may use it).")] = False,
) -> None:
    console = Console(stderr=True)
    sizes = {"max-batch": max_batch, "max-waiting": max_waiting,
             "max-body-bytes": max_body_bytes,
             "max-tokens": max_tokens if max_tokens is not None else 1,
             "request-timeout": request_timeout, "client-timeout": client_timeout,
             "max-connections": max_connections}
    problems = [f"--{name} must be positive, got {value}" for name, value in sizes.items()
                if not 0 < value < math.inf]
    problems += [f"--{name} must be below 2**63, got {value}" for name, value in sizes.items()
                 if isinstance(value, int) and value >= 2**63]
    if not 0 <= port < 65536:
        problems.append(f"--port must be 0..65535, got {port}")
    if not host.strip():
        problems.append("--host is empty: give an address to listen on, e.g. 127.0.0.1")
    elif (why := _host_problem(host)) is not None:
        problems.append(why)
    if model_name is not None and not model_name.strip():
        problems.append("--model-name is empty: give the model's name in the API, or leave "
                        "it out for the checkpoint folder's name")
    problems += _key_problems(host, api_key, allow_no_key) if host.strip() and \
        _host_problem(host) is None else []
    problems += placement.problems()
    missing = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        problems.append(f"mt serve needs {' and '.join(missing)}: pip install "
                        "'mt-inference[serve]'")
    if problems:
        fail(console, problems)
    from mt_inference.serving.rank import ServeSpec, serve

    with errors(console):
        serve(ServeSpec(placement, host, port, model_name, max_batch, max_waiting,
                        max_tokens=max_tokens, max_body_bytes=max_body_bytes,
                        request_timeout=request_timeout, api_key=api_key or None,
                        client_timeout=client_timeout, max_connections=max_connections))


def _key_problems(host: str, api_key: str | None, allow_no_key: bool) -> list[str]:
    """Why the key settings cannot serve ``host``: a blank key, or none on an address other
    machines can reach (unless ``allow_no_key``)."""
    if api_key and allow_no_key:  # contradictory: which did the user mean?
        return ["--allow-no-key serves without a key, and --api-key (or MT_API_KEY) gives one: "
                "give one of them"]
    if api_key is not None:
        bad = sum(not 33 <= ord(c) <= 126 for c in api_key)
        why = f"{bad} of its {len(api_key)} characters are not" if api_key else "it is empty"
        if bad or not api_key:
            return [f"--api-key (or MT_API_KEY) must be printable ASCII without spaces (it "
                    f"travels in an HTTP header): {why}"]
    if api_key is None and not allow_no_key and not _loopback(host):
        return [f"--host {host} is reachable from other machines: give --api-key (or set "
                "MT_API_KEY), or --allow-no-key to serve it open on purpose"]
    return []


def _host_problem(host: str) -> str | None:
    """Why ``host`` is no address or host name to listen on (a port given with it, a URL,
    spaces), or None."""
    import ipaddress
    import re

    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
        return None
    name, colon, port = host.rpartition(":")
    if colon and port.isdigit() and "://" not in host:
        return f"--host {host} holds a port: give --host {name} --port {port}"
    if "://" in host or not re.fullmatch(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?", host):
        return (f"--host {host} is not an address or host name to listen on (e.g. 127.0.0.1, "
                "0.0.0.0, ::1 or localhost)")
    return None


def _loopback(host: str) -> bool:
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


app = command_app(serve_command, _HELP)
