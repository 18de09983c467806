"""mt serve's engine without HTTP: rank 0's dispatcher driving two data-parallel replicas
(two engine loops in this process, one tiny model), as the ranks of a DP 2 server do: jobs go
to the least loaded replica, each job gets the text it gets alone, a cancelled job and a job
past its deadline free their rows, and a full batch leaves jobs waiting."""

from __future__ import annotations

import asyncio
import socket
import time

import torch

from mt_inference.serving.api import ApiError, Completion
from mt_inference.serving.engine import Command, Dispatcher, Inbox, Job, ServeLoop
from mt_model import GPT, GPTConfig, Sampling, WholeModel


def _decode(tokens: list[int]) -> str:
    return "".join(f"<{t}>" for t in tokens)


class Replicas:
    """Two replicas' loops driven one iteration at a time (broadcast: the same command to
    both; gather: both results joined)."""

    def __init__(self, model: GPT) -> None:
        self.model = model
        self.loops = [ServeLoop(WholeModel(model), r, True, lambda c: c, lambda x: x)
                      for r in range(2)]

    def iterate(self, dispatcher: Dispatcher) -> Command:
        command = dispatcher.command()
        dispatcher.deliver([item for loop in self.loops for item in loop.iterate(command)])
        return command


def _job(loop: asyncio.AbstractEventLoop, name: str, prompt: tuple[int, ...], tokens: int,
         deadline: float = 1e9, rule: Sampling | None = None) -> Job:
    completion = Completion("m", (prompt,), (_decode(list(prompt)),),
                            (rule or Sampling(max_new_tokens=tokens),), (), None, False, False)
    return Job(name, completion, loop, time.monotonic() + deadline)


def _engine(max_batch: int) -> tuple[Replicas, Inbox, Dispatcher, asyncio.AbstractEventLoop]:
    """Two replicas of a tiny model, rank 0's inbox and dispatcher (``max_batch`` rows per
    replica), and the loop the jobs answer on."""
    replicas = Replicas(GPT(GPTConfig(2, 32, 4, 97, 48), seed=3).eval())
    inbox = Inbox(max_waiting=8)
    dispatcher = Dispatcher(inbox, _decode, replicas=2, max_batch=max_batch,
                            check=replicas.loops[0].batch.check)
    return replicas, inbox, dispatcher, asyncio.new_event_loop()


def test_one_failing_request_fails_alone() -> None:
    """A request the engine cannot run (here one whose seed got past the checks, so that its
    generator raises in the prefill, as an unchecked seed of 2**70 did) ends in an error of
    its own; the requests beside it finish, and the loop serves the next ones."""
    replicas, inbox, dispatcher, loop = _engine(max_batch=4)
    bad_rule = Sampling(max_new_tokens=4, temperature=1.0)
    object.__setattr__(bad_rule, "seed", 2**70)  # what the checks now refuse at the door
    bad = _job(loop, "bad", (5, 9), 4, rule=bad_rule)
    good = _job(loop, "good", (1, 2, 3), 5)
    too_long = _job(loop, "long", (1,) * 40, 20)  # 40 + 20 > 48 positions
    for job in (bad, good, too_long):
        assert inbox.offer(job) is None
    for _ in range(10):
        replicas.iterate(dispatcher)
    kind, error = _outcome(loop, bad)
    assert kind == "error" and error.status == 500 and "decoding failed" in error.message
    kind, error = _outcome(loop, too_long)
    assert kind == "error" and error.status == 400 and "48 positions" in error.message
    kind, choices = _outcome(loop, good)
    assert kind == "done" and choices[0].completion_tokens == 5
    assert dispatcher.load == [0, 0] and not dispatcher.rows
    after = _job(loop, "after", (4, 4), 3)
    assert inbox.offer(after) is None
    for _ in range(5):
        replicas.iterate(dispatcher)
    assert _outcome(loop, after)[0] == "done"
    loop.close()


def _outcome(loop: asyncio.AbstractEventLoop, job: Job) -> tuple[str, object]:
    loop.run_until_complete(asyncio.sleep(0))
    kind, value = job.queue.get_nowait()
    return kind, value


def test_two_replicas_share_jobs_cancel_and_time_out() -> None:
    replicas, inbox, dispatcher, loop = _engine(max_batch=2)
    prompts = [(5, 9, 14), (1, 2, 3, 4), (42, 17), (7, 7, 7, 7, 7)]
    jobs = [_job(loop, f"j{i}", p, 6 + i) for i, p in enumerate(prompts)]
    late = _job(loop, "late", (3, 3), 4, deadline=-1.0)  # its time is up while it waits
    gone = _job(loop, "gone", (8, 9), 30)
    for job in [*jobs, late, gone]:
        assert inbox.offer(job) is None
    command = replicas.iterate(dispatcher)
    placed = {key[0]: replica for replica, key, _ in command.admit}
    assert placed == {"j0": 0, "j1": 1, "j2": 0, "j3": 1}  # least loaded, two rows each
    assert len(inbox) == 2 and inbox.running == 4
    gone.cancelled = True
    for _ in range(40):
        if all(job.finished for job in [*jobs, late, gone]):
            break
        replicas.iterate(dispatcher)
    loop.run_until_complete(asyncio.sleep(0))
    with torch.no_grad():
        for i, (job, prompt) in enumerate(zip(jobs, prompts, strict=True)):
            kind, choices = job.queue.get_nowait()
            ids = list(prompt)
            for _ in range(6 + i):  # greedy, alone, the full forward each token
                ids.append(int(replicas.model(torch.tensor([ids]))[0, -1].argmax()))
            assert kind == "done" and choices[0].text == _decode(ids[len(prompt):]), i
            assert choices[0].finish_reason == "length"
    kind, error = late.queue.get_nowait()
    assert kind == "error" and error.status == 504
    kind, error = gone.queue.get_nowait()
    assert kind == "error" and error.status == 499 and inbox.gone == 1
    assert inbox.running == 0 and dispatcher.load == [0, 0]
    inbox.drain()
    assert inbox.offer(_job(loop, "after", (1,), 1)) == "draining"
    assert replicas.iterate(dispatcher).stop
    loop.close()


def test_port_zero_is_the_port_the_system_chose() -> None:
    """`mt serve --port 0` (any free port): the server's port, which the line announcing it
    names, is the one it listens on, not 0."""
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from mt_inference.serving.http import start_server

    app = Starlette(routes=[Route("/", lambda _request: PlainTextResponse("here"))])
    server, thread = start_server(app, "127.0.0.1", 0)
    try:
        assert server.config.port != 0
        assert httpx.get(f"http://127.0.0.1:{server.config.port}/").text == "here"
    finally:
        server.should_exit = True
        thread.join(10)


def test_stopping_at_once_ends_the_waiting_requests_too() -> None:
    """A second interrupt stops the server at once (``fail_all``): every accepted request,
    running or still waiting for room in the batch, gets the error at once, and no new one
    is accepted. A waiting request left unanswered would hang until the HTTP server gives up
    on it and answer with its plain-text 500."""
    replicas, inbox, dispatcher, loop = _engine(max_batch=1)
    jobs = [_job(loop, f"job{i}", (1, 2), 10) for i in range(4)]
    for job in jobs:
        assert inbox.offer(job) is None
    replicas.iterate(dispatcher)
    assert len(dispatcher.rows) == 2 and len(inbox) == 2  # one running per replica
    dispatcher.fail_all(ApiError(500, "the server stopped", kind="server_error"))
    for job in jobs:
        kind, error = _outcome(loop, job)
        assert kind == "error" and error.message == "the server stopped", job.ident
    assert inbox.offer(_job(loop, "late", (1,), 1)) == "draining"
    loop.close()


def test_a_client_that_never_reads_its_response_is_cut_off() -> None:
    """A client that sends requests back to back (HTTP/1.1 pipelining) for large responses
    and reads none of them holds a connection with a request in progress for ever (the
    second response waits for the first to drain). With every connection taken
    (``max_connections`` 1) nobody else is answered, so the connection is aborted once its
    unsent bytes have not drained for ``client_timeout`` seconds, and the next client is
    answered."""
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from mt_inference.serving.http import start_server

    size = 64 * 2**20
    app = Starlette(routes=[Route("/big", lambda _request: PlainTextResponse("x" * size)),
                            Route("/", lambda _request: PlainTextResponse("here"))])
    server, thread = start_server(app, "127.0.0.1", 0, client_timeout=1.0, max_connections=1)
    hog = socket.socket()
    try:
        port = server.config.port
        hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        hog.connect(("127.0.0.1", port))
        hog.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
        time.sleep(0.3)
        started, answer = time.monotonic(), None
        while answer is None and time.monotonic() < started + 10:
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/", timeout=2).text
            except httpx.HTTPError:  # closed for want of a free connection
                time.sleep(0.2)
        assert answer == "here"
        received = 0
        try:
            while chunk := hog.recv(2**20):
                received += len(chunk)
        except ConnectionResetError:
            pass
        assert received < 2 * size  # aborted, not sent whole
    finally:
        hog.close()
        server.should_exit = True
        thread.join(10)
