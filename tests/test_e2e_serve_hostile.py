"""Cross-app: `mt serve` with an API key, as a hostile client finds it.

One server (a tiny GPT with the GPT-2 vocabulary, 64 positions, at most 8 new tokens a
request, the key in MT_API_KEY) takes:
- requests without the key, with a wrong one, another scheme: 401 with WWW-Authenticate; the
  key opens /v1; /health and /openapi.json stay open; the start-up line says a key is needed;
  a non-loopback --host without a key is refused before the model is read;
- schemathesis against the server's own /openapi.json (``MT_SERVE_FUZZ_CASES`` examples per
  operation, schema-valid and schema-invalid, default 100): no 5xx, every response (status,
  content type, body, headers, server-sent events) as the schema says, every schema-invalid
  request refused, the key enforced; and at least a fifth of the valid completions decoded;
- ``MT_SERVE_MALFORMED`` (default 1,000) random malformed bodies (random bytes, valid bodies
  cut or with a byte changed, hostile values in each field: NaN, 1e999, 5,000 digits, deep
  nesting, lone surrogates, wrong types, unknown names): each a 4xx JSON error or a 200,
  never a 5xx;
- 150 connections that ask nothing, send half a request's headers, or half a body, and
  one that goes away mid-body: the idlest are closed past ``--max-connections`` at once,
  the rest after ``--client-timeout`` (a late body: 408), while other clients are answered;
- 32 concurrent clients for ``MT_SERVE_SOAK_S`` seconds (default 20; the issue's run: 60),
  whole and streamed, an eighth of the streams dropped by their client mid-way: every answer
  200, every greedy text the one it gets alone;
and stays up (/health 200) through all of it, then stops on SIGTERM with exit 0.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from e2e_models import trained_gpt2_vocab
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance
from serve_harness import NAME, Server

KEY = "mt-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
CASES = int(os.environ.get("MT_SERVE_FUZZ_CASES", "100"))
MALFORMED = int(os.environ.get("MT_SERVE_MALFORMED", "1000"))
SOAK_S = float(os.environ.get("MT_SERVE_SOAK_S", "20"))
TALLY: collections.Counter = collections.Counter()
CLIENT_TIMEOUT_S, MAX_CONNECTIONS = 3, 48  # the soak's 32 clients keep their connections


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    return trained_gpt2_vocab(root, seq_len=64, steps=2)[0]


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[Server]:
    running = Server(model, model.parent / "serve.log", "--max-tokens", "8", "--max-waiting",
                     "64", "--max-batch", "16", "--client-timeout", str(CLIENT_TIMEOUT_S),
                     "--max-connections", str(MAX_CONNECTIONS), env={"MT_API_KEY": KEY},
                     headers=AUTH)
    yield running
    assert running.stop() == 0, running.log.read_text()
    assert "Traceback" not in running.log.read_text(), running.log.read_text()


def test_the_key_is_required(model: Path, server: Server) -> None:
    from mt_cli import app
    from typer.testing import CliRunner

    deadline = time.monotonic() + 30  # the line follows the server's start by a moment
    while "an API key is required" not in server.log.read_text():
        assert time.monotonic() < deadline, server.log.read_text()
        time.sleep(0.1)
    body = {"prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}x"},
                    {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}):
        response = server.post(body, headers={"Authorization": ""} | headers)
        assert response.status_code == 401, (headers, response.text)
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/v1/models", headers=headers,
                         timeout=10).status_code == 401
    assert server.post(body).status_code == 200
    assert httpx.get(f"{server.url}/v1/models/{NAME}", headers=AUTH, timeout=10).json()["id"] \
        == NAME
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    schema = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    limits = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert limits["max_tokens"]["maximum"] == 8 and limits["top_k"]["maximum"] == 50257
    for args in (["--host", "0.0.0.0"], ["--host", "example.org"], ["--host", "::"]):
        open_ = CliRunner().invoke(app, ["serve", str(model), *args], env={"MT_API_KEY": ""})
        assert open_.exit_code == 2 and "--allow-no-key" in open_.output, open_.output
    blank = CliRunner().invoke(app, ["serve", str(model), "--api-key", "a key"])
    assert blank.exit_code == 2 and "printable ASCII" in blank.output


@pytest.fixture
def api_schema(server: Server) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    schema.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE,
                                           schemathesis.GenerationMode.NEGATIVE])
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck))
def test_schemathesis(case: schemathesis.Case) -> None:
    """Every check but positive-data acceptance: a schema-valid prompt may still tokenize past
    the model's positions (400, as the schema says)."""
    response = case.call(headers=AUTH, timeout=60)
    mode = case.meta.generation.mode.value if case.meta else "explicit"
    TALLY[case.operation.label, mode, response.status_code] += 1
    case.validate_response(response, headers=AUTH, excluded_checks=[positive_data_acceptance])


def test_the_fuzzing_reached_the_engine(server: Server) -> None:
    """The schemathesis cases above ran (schema-valid ones among them), a fifth of the valid
    completions or more decoded, no 5xx anywhere."""
    valid = sum(n for (op, mode, _), n in TALLY.items()
                if op == "POST /v1/completions" and mode == "positive")
    decoded = TALLY["POST /v1/completions", "positive", 200]
    assert valid >= CASES // 5 and decoded >= valid // 5, dict(TALLY)
    assert not [key for key in TALLY if key[2] >= 500], dict(TALLY)
    assert server.alive()
    print(f"schemathesis: {sum(TALLY.values())} cases:", dict(sorted(TALLY.items())))


_HOSTILE = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1", b"9" * 5000, b"0.5", b"3.0",
            b"18446744073709551616", b"9223372036854775808", b'""', b'"x"', b"[]", b"{}",
            b"[[[]]]", b"true", b"null", b'"\\ud800"', b'"\\udc00x"', b'["\\u0000"]',
            b"[" * 3000 + b"]" * 3000, b"[1, 2, -5]", b'{"include_usage": "yes"}',
            b"[" + b"1," * 400 + b"1]"]
_FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "logprobs",
           "echo", "stream", "stream_options", "n", "user", "model", "best_of", "logit_bias",
           "suffix", "presence_penalty", "max_token", "\\ud800", ""]


def _malformed(rng: random.Random) -> bytes:
    valid = json.dumps({"prompt": "The whale", "max_tokens": rng.randint(1, 8),
                        "temperature": rng.choice([0, 0.7]), "stream": rng.random() < 0.3})
    kind = rng.randrange(4)
    if kind == 0:  # noise
        return bytes(rng.randrange(256) for _ in range(rng.randrange(200)))
    if kind == 1:  # a valid body cut short, or with one byte changed
        raw = bytearray(valid.encode())
        if rng.random() < 0.5:
            return bytes(raw[:rng.randrange(len(raw))])
        raw[rng.randrange(len(raw))] = rng.randrange(256)
        return bytes(raw)
    fields = [f'"{rng.choice(_FIELDS)}": '.encode() + rng.choice(_HOSTILE)
              for _ in range(rng.randint(1, 4))]
    if kind == 2:
        fields.append(b'"prompt": "x"')
    return b"{" + b", ".join(fields) + b"}"


def test_malformed_bodies_never_5xx(server: Server) -> None:
    rng = random.Random(42)
    statuses: collections.Counter = collections.Counter()
    # One client for all of them (a client per request spends most of its time building
    # its TLS context).
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        for _ in range(MALFORMED):
            body = _malformed(rng)
            response = http.post("/v1/completions", content=body)
            statuses[response.status_code] += 1
            assert response.status_code < 500, (body[:120], response.text[:300])
            if response.status_code != 200:
                assert response.json()["error"]["message"], body[:120]
    assert sum(statuses.values()) == MALFORMED and statuses[400] > MALFORMED // 2, statuses
    assert server.alive()
    print(f"malformed: {MALFORMED} bodies:", dict(sorted(statuses.items())))


def test_32_clients_for_a_while(server: Server) -> None:
    prompts = ["Call me Ishmael.", "The whale", "It was the best of times", "Some years ago"]
    alone = {p: server.post({"prompt": p, "max_tokens": 8, "temperature": 0}).json()
             ["choices"][0]["text"] for p in prompts}
    end = time.monotonic() + SOAK_S

    def client(i: int) -> collections.Counter:
        rng, seen = random.Random(i), collections.Counter()
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
            while time.monotonic() < end:
                prompt = rng.choice(prompts)
                body = {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                        "logprobs": rng.choice([None, 2])}
                if rng.random() < 0.5:
                    with http.stream("POST", "/v1/completions",
                                     json={**body, "stream": True}) as stream:
                        assert stream.status_code == 200, stream.read()
                        events = []
                        for line in stream.iter_lines():
                            if line.startswith("data: "):
                                events.append(line[6:])
                            if rng.random() < 1 / 16:  # this client gives up mid-stream
                                seen["dropped"] += 1
                                break
                        else:
                            assert events[-1] == "[DONE]", events
                            text = "".join(json.loads(e)["choices"][0]["text"]
                                           for e in events[:-1])
                            assert text == alone[prompt]
                            seen["streamed"] += 1
                else:
                    response = http.post("/v1/completions", json=body)
                    assert response.status_code == 200, response.text
                    assert response.json()["choices"][0]["text"] == alone[prompt]
                    seen["whole"] += 1
        return seen

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        totals = sum(pool.map(client, range(32)), collections.Counter())
    assert totals["whole"] >= 32 and totals["streamed"] >= 32, totals
    print(f"32 clients for {SOAK_S:g} s:", dict(totals))
    deadline = time.monotonic() + 30
    while (health := httpx.get(f"{server.url}/health", timeout=10).json())["running"]:
        assert time.monotonic() < deadline, health
        time.sleep(0.1)
    assert health["status"] == "ok" and health["waiting"] == 0


def _open(sock: socket.socket) -> bool:
    """Whether the server still holds ``sock`` open, silent (not closed, no answer)."""
    sock.settimeout(0.05)
    try:
        sock.recv(4096, socket.MSG_PEEK)  # an answer, or b"": closed
    except TimeoutError:
        return True
    except OSError:  # reset
        pass
    return False


def test_connections_that_ask_nothing_are_cut_off(server: Server) -> None:
    """One client holding connections without asking (slowloris) cannot take every file
    descriptor of the server: the idlest make room, the rest are closed in time."""
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    sends = [b"", head.encode(), b"P"]

    def connect(data: bytes) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(data)
        return sock

    busy = [connect((head + "Content-Length: 40\r\n\r\n{").encode()) for _ in range(30)]
    time.sleep(0.5)  # their headers read: requests in progress, never cut to make room
    socks = busy + [connect(sends[i % 3]) for i in range(120)]
    gone = socket.create_connection(("127.0.0.1", server.port))  # leaves mid-body
    gone.sendall((head + "Content-Length: 90\r\n\r\n{\"prompt\": ").encode())
    gone.close()
    started = time.monotonic()
    assert server.post({"prompt": "x", "max_tokens": 2}).status_code == 200
    assert time.monotonic() - started < CLIENT_TIMEOUT_S  # answered during the flood
    time.sleep(0.5)
    held = [sock for sock in socks if _open(sock)]
    assert len(held) <= MAX_CONNECTIONS, len(held)  # the idlest made room at once
    assert all(sock in held for sock in busy)
    time.sleep(CLIENT_TIMEOUT_S + 1)
    assert not any(_open(sock) for sock in socks)
    for sock in busy:
        sock.settimeout(5)
        answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert b"did not arrive within 3 s" in answer
    for sock in socks:
        sock.close()
    assert server.alive()
    slash = httpx.post(f"{server.url}/v1/completions/", json={"prompt": "x"}, headers=AUTH,
                       timeout=10)  # no redirect to the client's Host
    assert slash.status_code == 404 and slash.json()["error"]["message"]
    rows = server.post({"prompt": ["a", "b"], "n": 9, "max_tokens": 2})  # over --max-batch
    assert rows.status_code == 400 and rows.json()["error"]["param"] == "n", rows.text
