"""Cross-app: `mt serve` as OpenAI-style tools use it, and as a hostile client finds it.

A tiny GPT (GPT-2 vocabulary, 320 positions) trained briefly by `mt pretrain` and exported by
`mt convert --to hf`, served by `mt serve` (a real process, real HTTP):
- lm-evaluation-harness's ``local-completions`` model against the server scores
  log-likelihood tasks (lambada_openai, piqa: lm-eval's own YAMLs on local rows) as lm-eval
  ``--model hf`` does on the export: every per-item log-likelihood within 1e-4, greedy flags
  and accuracy identical;
- the ``openai`` client streams a completion whose pieces make the whole greedy text, which
  equals transformers' greedy continuation;
- faults: malformed JSON, wrong types, unknown fields and fields' values, NaN, numbers past
  any range (a seed of 2**70 once stopped the server), JSON nested 5,000 deep, lone
  surrogates, an oversized body, a prompt past the context, an unknown model or route: each a
  JSON error with its status naming the field, the server up;
- the openai client's models.retrieve, 405 with Allow, n completions per prompt, and a
  stream's usage (stream_options.include_usage);
  64 concurrent clients on a queue of 16: each answered 200 (the same text as alone) or 429;
  a client that disconnects mid-stream frees its rows;
- at PP 2 (two processes; TP 2 x PP 2 decoding is test_e2e_generate_layouts.py's): the same
  greedy text, and SIGTERM with requests in flight lets them finish, refuses new ones, and
  stops every rank (exit 0).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_models import single_threaded, trained_gpt2_vocab
from harness_data import LAYOUT, write_data
from serve_harness import NAME, Server

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

TOL = 1e-4
PROMPT = "Call me Ishmael. Some years ago"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve")
    ckpt, hf = trained_gpt2_vocab(root, seq_len=320)
    return {"root": root, "ckpt": ckpt, "hf": hf}


@pytest.fixture(scope="module")
def server(model: dict[str, Path]) -> Iterator[Server]:
    running = Server(model["ckpt"], model["root"] / "serve.log", "--max-waiting", "16",
                     "--max-batch", "8")
    yield running
    assert running.stop() == 0, running.log.read_text()


@functools.cache  # the same continuation is compared at one process and at PP 2: load once
def _greedy_hf(hf_dir: Path, prompt: str, new: int) -> str:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=new, do_sample=False,
                          pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
    if tokenizer.eos_token_id in out:
        out = out[:out.index(tokenizer.eos_token_id)]
    return tokenizer.decode(out)


def test_lm_eval_local_completions_scores_as_hf(model: dict[str, Path], server: Server
                                                ) -> None:
    import lm_eval

    from mt_inference.harness import local_task, task_manager

    data = model["root"] / "data"
    layout = {t: LAYOUT[t] for t in ("lambada_openai", "piqa")}
    write_data(data, layout, lambda _split: 6)
    results = {}
    for backend, args in (
            ("hf", f"pretrained={model['hf']},dtype=float32"),
            ("local-completions", f"model={NAME},base_url={server.url}/v1/completions,"
             f"tokenizer_backend=huggingface,tokenizer={model['hf']},max_length=320,"
             "num_concurrent=1,max_retries=1,tokenized_requests=True")):
        manager = task_manager()
        tasks = [local_task(t, data, manager, 0) for t in layout]
        results[backend] = single_threaded(
            lm_eval.simple_evaluate, model=backend, model_args=args, tasks=tasks,
            num_fewshot=0, batch_size=4, device="cpu", log_samples=True,
            task_manager=manager)
    ours, theirs = results["local-completions"], results["hf"]
    for task in layout:
        mine = {s["doc_id"]: s["resps"] for s in ours["samples"][task]}
        ref = {s["doc_id"]: s["resps"] for s in theirs["samples"][task]}
        assert sorted(mine) == sorted(ref) and len(ref) == 6
        for doc, items in ref.items():
            got = [r[0] for r in mine[doc]]
            want = [r[0] for r in items]
            assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=TOL, rel=0)
            assert [bool(g[1]) for g in got] == [bool(w[1]) for w in want], (task, doc)
        assert ours["results"][task]["acc,none"] == theirs["results"][task]["acc,none"]


def test_openai_client_streams_the_greedy_text(model: dict[str, Path], server: Server
                                               ) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [NAME]
    pieces = [chunk.choices[0].text for chunk in client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)]
    whole = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    assert len(pieces) > 5 and "".join(pieces) == whole.choices[0].text
    assert whole.choices[0].text == _greedy_hf(model["hf"], PROMPT, 24)
    assert whole.usage.completion_tokens <= 24
    seeded = [client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12,
                                        temperature=1.0, seed=5).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_bad_requests_get_json_errors(server: Server) -> None:
    cases = [
        (b"{not json", 400, None),
        ({"prompt": 3}, 400, "prompt"),
        ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "stream": "yes"}, 400, "stream"),
        ({"prompt": "x", "presence_penalty": 1.0}, 400, "presence_penalty"),
        ({"prompt": [[1, 2, 99999999]]}, 400, "prompt"),
        ({"prompt": "word " * 400}, 400, "prompt"),
        ({"prompt": "x", "max_tokens": 400}, 400, "max_tokens"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
        (b"[" * 10 + b'"x' * (1 << 20), 413, None),
        ({"prompt": "x", "seed": 2**70}, 400, "seed"),  # reached torch and stopped the server
        (b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
        (b'{"prompt": "x", "top_p": NaN}', 400, "top_p"),
        (b'{"prompt": "x", "max_tokens": 1e999}', 400, "max_tokens"),
        (b'{"prompt": "x", "top_k": ' + b"9" * 5000 + b"}", 400, None),  # past int parsing
        ({"prompt": "x", "top_k": 10**300}, 400, "top_k"),
        ({"prompt": "x", "seed": 5.0}, 400, "seed"),  # an integer field: as the schema says
        (b"[" * 5000 + b"]" * 5000, 400, None),
        ({"prompt": [[[[[[[[[1]]]]]]]]]}, 400, "prompt"),
        (b'{"prompt": "\\ud800 lone"}', 400, "prompt"),
        (b'{"prompt": "x", "stop": ["\\udfff"]}', 400, "stop"),
        ({"prompt": "x", "max_token": 3}, 400, "max_token"),  # misspelt: was ignored
        ({"prompt": "x", "temprature": 0.5}, 400, "temprature"),
        ({"prompt": "x", "n": 0}, 400, "n"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        (b'{"prompt": "x", "prompt": "y"}', 400, "prompt"),  # which one was meant?
        (b'{"prompt": "x", "\\ud800": 1, "\\ud800": 2}', 400, None),  # named, escaped
    ]
    for body, status, param in cases:
        response = server.post(body)
        assert response.status_code == status, (body[:40], response.text)
        error = response.json()["error"]
        assert error["message"] and error["param"] == param, (body[:40], error)
    missing = httpx.get(f"{server.url}/v1/nothing", timeout=10)
    assert missing.status_code == 404 and "error" in missing.json()
    unknown = server.post({"prompt": "x", "max_token": 3, "temprature": 1}).json()["error"]
    assert "'max_token', 'temprature'" in unknown["message"]
    assert "did you mean 'max_tokens'" in unknown["message"]
    assert server.post({"prompt": "x", "max_tokens": 2}).status_code == 200  # still up


def test_bad_flags_and_a_busy_port(model: dict[str, Path], server: Server) -> None:
    from mt_cli import app
    from typer.testing import CliRunner

    busy = CliRunner().invoke(app, ["serve", str(model["ckpt"]), "--port", str(server.port)])
    assert busy.exit_code == 2 and f"cannot serve on 127.0.0.1:{server.port}" in busy.output
    bad = CliRunner().invoke(app, ["serve", str(model["ckpt"]), "--port", "70000",
                                   "--max-batch", "0", "--max-tokens", "0"])
    assert bad.exit_code == 2, bad.output
    assert "--max-batch must be positive, got 0" in bad.output
    assert "--port must be 0..65535, got 70000" in bad.output
    assert "--max-tokens must be positive, got 0" in bad.output  # started, then refused all


def test_models_retrieve_405_n_and_stream_usage(server: Server) -> None:
    """The openai client's models.retrieve; 405 names the allowed method; n completions per
    prompt (seeded: each its own draw, the same at every call; the prompt's tokens counted
    once); a stream's last chunk carries the usage with stream_options.include_usage."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    wrong = httpx.delete(f"{server.url}/v1/completions", timeout=10)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    allow = httpx.post(f"{server.url}/health", timeout=10).headers["allow"]
    assert set(allow.split(", ")) == {"GET", "HEAD"}
    body = {"prompt": [PROMPT, "The whale"], "max_tokens": 6, "temperature": 1.0, "seed": 11,
            "n": 3}
    first, again = server.post(body).json(), server.post(body).json()
    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == list(range(6))
    assert texts == [c["text"] for c in again["choices"]] and len(set(texts[:3])) == 3
    single = server.post({**body, "prompt": "The whale", "n": 1}).json()
    assert single["choices"][0]["text"] == texts[3]  # sample 0 keeps the request's seed
    prompt_tokens = sum(client.completions.create(
        model=NAME, prompt=p, max_tokens=1, temperature=0).usage.prompt_tokens
        for p in body["prompt"])
    assert first["usage"]["prompt_tokens"] == prompt_tokens
    assert first["usage"]["completion_tokens"] == 6 * 6
    chunks = list(client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chunks[:-1]) and not chunks[-1].choices
    whole = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def _events(server: Server, body: dict) -> list[dict]:
    response = server.post({**body, "stream": True})
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line)["choices"][0] for line in lines[:-1]]


def test_logprobs_follow_the_text_a_stop_string_cuts(server: Server) -> None:
    """With a stop string the log-probabilities are those of the tokens the text keeps (the
    fewest that hold it), whole or streamed, and a stream's text offsets run on from chunk to
    chunk, as in the whole response."""
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2}
    full = server.post(body).json()["choices"][0]
    pieces, scores = full["logprobs"]["tokens"], full["logprobs"]["token_logprobs"]
    assert "".join(pieces) == full["text"]
    starts = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
    assert full["logprobs"]["text_offset"] == starts
    streamed = _events(server, body)
    assert [t for c in streamed for t in c["logprobs"]["tokens"]] == pieces
    assert [o for c in streamed for o in c["logprobs"]["text_offset"]] == starts
    k = next(i for i in range(2, len(pieces)) if len(pieces[i]) > 1 and len(pieces[i - 1]) > 1)
    for stop in (pieces[k], pieces[k - 1][-1] + pieces[k][:1]):  # a token; across two
        cut = full["text"].index(stop)
        kept = next(n for n in range(len(pieces) + 1) if sum(map(len, pieces[:n])) >= cut)
        whole = server.post({**body, "stop": stop}).json()
        choice, usage = whole["choices"][0], whole["usage"]
        assert choice["text"] == full["text"][:cut] and choice["finish_reason"] == "stop"
        assert choice["logprobs"]["tokens"] == pieces[:kept], (stop, choice)
        assert choice["logprobs"]["token_logprobs"] == scores[:kept]
        assert choice["logprobs"]["text_offset"] == starts[:kept]
        assert usage["completion_tokens"] == kept
        chunks = _events(server, {**body, "stop": stop})
        assert "".join(c["text"] for c in chunks) == full["text"][:cut]
        assert [t for c in chunks for t in c["logprobs"]["tokens"]] == pieces[:kept]
        assert [o for c in chunks for o in c["logprobs"]["text_offset"]] == starts[:kept]


def test_logprobs_of_tokens_inside_a_character_index_the_text(server: Server) -> None:
    """A byte-level token that holds part of a character (GPT-2's tokens of "日本語", "€")
    is written ``bytes:\\xNN...`` in ``tokens`` and ``top_logprobs``, as OpenAI writes such
    tokens, and the character counts for the token that completes it: every ``text_offset``
    indexes the text, echoed and generated, whole and streamed. Decoded on their own, those
    tokens would each be "\ufffd" (one character too many each) and share one top entry."""
    prompt = "café 日本語 €"
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 5, "echo": True}
    full = server.post(body).json()["choices"][0]
    text, entries = full["text"], full["logprobs"]
    assert text.startswith(prompt)
    assert any(t.startswith("bytes:\\x") for t in entries["tokens"]), entries["tokens"]
    assert "\ufffd" not in "".join(entries["tokens"])
    raw = b"".join(bytes.fromhex(t[6:].replace("\\x", "")) if t.startswith("bytes:") else
                   t.encode() for t in entries["tokens"])
    assert raw.decode() == text  # the tokens' bytes are the text's
    offsets = entries["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] <= len(text)
    for offset, token in zip(offsets, entries["tokens"], strict=True):
        if not token.startswith("bytes:"):  # a whole token's text stands where it says
            assert text[offset:offset + len(token)] == token, (offset, token)
    assert all("\ufffd" not in key for top in entries["top_logprobs"][1:] for key in top)
    streamed = _events(server, body)
    assert [o for c in streamed for o in c["logprobs"]["text_offset"]] == offsets


def test_a_stream_refused_before_its_first_token_gets_its_status(
        model: dict[str, Path]) -> None:
    """A request past its time before it started gets 504, streamed or not (a stream's
    status waits for its first event)."""
    hurried = Server(model["ckpt"], model["root"] / "hurried.log", "--request-timeout", "1e-6")
    try:
        for stream in (False, True):
            refused = hurried.post({"prompt": PROMPT, "max_tokens": 4, "stream": stream})
            assert refused.status_code == 504, (stream, refused.text)
            assert refused.json()["error"]["type"] == "timeout"
    finally:
        assert hurried.stop() == 0, hurried.log.read_text()


def test_64_concurrent_clients_and_a_full_queue(server: Server) -> None:
    prompts = [f"{PROMPT} {i}" for i in range(8)]
    alone = {p: server.post({"prompt": p, "max_tokens": 16, "temperature": 0})
             .json()["choices"][0]["text"] for p in prompts}

    def ask(i: int) -> tuple[int, str, str | None]:
        response = server.post({"prompt": prompts[i % 8], "max_tokens": 16, "temperature": 0})
        text = response.json()["choices"][0]["text"] if response.status_code == 200 else None
        return response.status_code, prompts[i % 8], text

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(ask, range(64)))
    codes = [code for code, _, _ in answers]
    assert set(codes) <= {200, 429} and codes.count(200) >= 16, codes
    for code, prompt, text in answers:
        if code == 200:
            assert text == alone[prompt]  # batched with others, the same tokens
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["waiting"] == 0


def test_a_client_gone_mid_stream_frees_its_rows(server: Server) -> None:
    gone = httpx.get(f"{server.url}/health", timeout=10).json()["gone"]
    body = {"prompt": "x", "max_tokens": 310, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = httpx.get(f"{server.url}/health", timeout=10).json()
        if health["gone"] == gone + 1 and health["running"] == 0:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the stream's rows were not freed: {health}")


def test_pp2_serves_and_drains_on_sigterm(model: dict[str, Path]) -> None:
    server = Server(model["ckpt"], model["root"] / "serve-pp2.log", "--nproc", "2", "--pp", "2")
    try:
        whole = server.post({"prompt": PROMPT, "max_tokens": 24, "temperature": 0})
        assert whole.json()["choices"][0]["text"] == _greedy_hf(model["hf"], PROMPT, 24)
        body = {"prompt": "x", "max_tokens": 300, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            flying = [pool.submit(server.post, body) for _ in range(4)]
            deadline = time.monotonic() + 60
            while httpx.get(f"{server.url}/health", timeout=10).json()["running"] < 4:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            try:
                late = server.post({"prompt": "x", "max_tokens": 2})
                assert late.status_code == 503, late.text
            except httpx.ConnectError:
                pass  # already stopped: refused as well
            for future in flying:
                response = future.result()
                assert response.status_code == 200, response.text
                assert response.json()["usage"]["completion_tokens"] == 300
        assert server.proc.wait(60) == 0, server.log.read_text()
        assert "stopped" in server.log.read_text()
        left = subprocess.run(["pgrep", "-f", f"--port {server.port}"], capture_output=True,
                              text=True).stdout.split()
        assert not left, f"ranks left behind: {left}"
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
