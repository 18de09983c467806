"""Tokens/s of mt's cached decoding (``mt_model.generate``) against Hugging Face
transformers' ``generate``, like for like, on CPU.

One random GPT-2-shaped model (``mt_model.GPT``, mt's deterministic init, the tanh GeLU of
GPT-2) is copied into ``transformers.GPT2LMHeadModel`` with the ``mt convert`` name mapping
(``mt_formats.hf_config``; sdpa attention, tied head), so both sides hold the same fp32
weights. For each batch size both sides complete the same prompts (``--prompt-tokens``
random ids each, all rows the same length, so neither side pads) with exactly
``--new-tokens`` greedy tokens, key/value cache on:

- **mt**: ``mt_model.generate(model, prompts, Sampling(max_new_tokens=N), logprobs=False)``
  (no stop ids, so it never stops early; no log-probabilities, as transformers without
  ``output_scores``; it runs under ``torch.no_grad`` itself), the model laid out by
  ``decoding_layout_`` as `mt generate` holds it: on x86 builds of torch every projection
  and the output head also held in oneDNN's packed layout (``mt_model.gpt.PackedWeight``;
  the same float32 products, one more copy of those weights in memory);
- **hf**: ``GPT2LMHeadModel.generate(ids, attention_mask, max_new_tokens=N,
  min_new_tokens=N, do_sample=False)`` with ``eos_token_id`` removed from the model's
  generation config (no early stop), its default ``DynamicCache``, under
  ``torch.inference_mode``.

Before timing, one untimed call of each side checks that both give the same greedy tokens
(the first prompt must agree; other rows that differ, e.g. a near tie moved by a batched
matmul's round-off, are counted and printed). Then the sides alternate (mt, hf, mt, hf, ...)
``--repeats`` times, each call timed alone with Python's cyclic garbage collector paused
(after a collection), and the median of each side is reported. tokens/s = batch x new
tokens / wall seconds of the whole ``generate`` call (the prefill included on both sides).

Targets (printed, never an exit status): mt/hf >= 1.0 at batch 1 and >= 1.5 at batch 16.
Each side is a zero-argument callable made by a ``*_side`` factory (:func:`build_sides`).

Then `mt serve` (:func:`server_comparison`, ``--clients 0`` skips it): the same weights saved
as a Hugging Face folder and served by a process of its own; ``--clients`` requests (greedy,
the same lengths) sent by as many concurrent clients, against the same requests one by one
(continuous batching is what the first gains), alternating.

    PYTHONPATH=$(ls -d packages/*/src apps/*/src | tr '\\n' ':') \\
        python3 benchmarks/generate.py                      # GPT-2 small, batches 1 and 16
    ... python3 benchmarks/generate.py --model tiny --repeats 2   # a quick check
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from mt_model import (  # noqa: E402
    GPT,
    PRESETS,
    GPTConfig,
    Sampling,
    count_parameters,
    decoding_layout_,
    generate,
)

#: mt/hf targets by batch size (issue: cached decoding on CPU).
TARGETS = {1: 1.0, 16: 1.5}
#: (prompt tokens, new tokens) when not given; the tiny preset holds 64 positions only.
DEFAULT_LENGTHS = {"tiny": (16, 32)}
GPT2_LENGTHS = (32, 64)

Side = Callable[[], list[list[int]]]
"""One side of the comparison: generates for the whole batch, returns each row's new
tokens."""


def gpt2_presets() -> list[str]:
    return sorted(name for name, config in PRESETS.items() if config.architecture == "gpt2")


def model_config(name: str) -> GPTConfig:
    """The preset with GPT-2's activation (tanh GeLU, HF ``gelu_new``)."""
    return PRESETS[name].replace(gelu_approximate="tanh")


def hf_twin(model: GPT):  # noqa: ANN201 (transformers is imported late)
    """``GPT2LMHeadModel`` holding ``model``'s weights (benchmarks/train.py's ``hf_model``:
    ``mt convert``'s names, sdpa attention, the tied head checked), eval mode, no end-of-text
    token (it never stops early)."""
    from train import hf_model  # benchmarks/train.py, beside this script

    hf = hf_model(model.config, model.state_dict(), torch.device("cpu"))
    hf.config.use_cache = True  # train.py's twin trains; this one decodes with its cache
    for field in ("eos_token_id", "bos_token_id"):  # else it would be merged back in
        setattr(hf.generation_config, field, None)
        setattr(hf.config, field, None)
    return hf.eval()


def make_prompts(config: GPTConfig, batch: int, length: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` random token ids (the last id, GPT-2's end of text,
    left out)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size - 1, (batch, length), generator=gen).tolist()


# ------------------------------------------------------------------------------- sides
def mt_side(model: GPT, prompts: list[list[int]], new_tokens: int) -> Side:
    sampling = Sampling(max_new_tokens=new_tokens)  # greedy, no stop ids

    def run() -> list[list[int]]:
        return [c.tokens for c in generate(model, prompts, sampling, logprobs=False)]

    return run


def hf_side(hf, prompts: list[list[int]], new_tokens: int) -> Side:  # noqa: ANN001
    from transformers import GenerationConfig

    ids = torch.tensor(prompts, dtype=torch.int64)
    mask = torch.ones_like(ids)
    rule = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            do_sample=False, num_beams=1, use_cache=True, pad_token_id=0,
                            eos_token_id=None, bos_token_id=None)

    def run() -> list[list[int]]:
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, generation_config=rule)
        return out[:, ids.shape[1]:].tolist()

    return run


def build_sides(model: GPT, hf, prompts: list[list[int]],  # noqa: ANN001
                new_tokens: int) -> dict[str, Side]:
    """The sides to compare, in the order they alternate ("mt" first, "hf" second)."""
    return {"mt": mt_side(model, prompts, new_tokens), "hf": hf_side(hf, prompts, new_tokens)}


# ------------------------------------------------------------------------------ timing
def check_same_tokens(outputs: dict[str, list[list[int]]], new_tokens: int) -> int:
    """Both sides' greedy tokens: every row has ``new_tokens``, the first row agrees
    (AssertionError otherwise); returns how many other rows differ."""
    mt, hf = outputs["mt"], outputs["hf"]
    for side, rows in outputs.items():
        lengths = sorted({len(r) for r in rows})
        assert lengths == [new_tokens], f"{side} generated {lengths} tokens, not {new_tokens}"
    assert mt[0] == hf[0], f"greedy tokens differ on the first prompt:\n mt {mt[0]}\n hf {hf[0]}"
    return sum(a != b for a, b in zip(mt, hf, strict=True))


def timed(run: Side) -> float:
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        run()
        return time.perf_counter() - start
    finally:
        gc.enable()


def bench_batch(model: GPT, hf, batch: int, args: argparse.Namespace  # noqa: ANN001
                ) -> dict[str, float | int]:
    prompts = make_prompts(model.config, batch, args.prompt_tokens, seed=batch)
    sides = build_sides(model, hf, prompts, args.new_tokens)
    outputs = {name: run() for name, run in sides.items()}  # warm-up and check, untimed
    differ = check_same_tokens(outputs, args.new_tokens)
    if differ:
        print(f"WARNING batch {batch}: {differ} of {batch} rows have different greedy tokens "
              "(the first agrees)")
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, run in sides.items():  # mt, hf, mt, hf, ...
            times[name].append(timed(run))
    tokens = batch * args.new_tokens
    result: dict[str, float | int] = {"batch": batch, "differ": differ}
    for name, t in times.items():
        result[name] = tokens / statistics.median(t)
        result[name + "_best"] = tokens / min(t)
    result["ratio"] = result["mt"] / result["hf"]
    return result


# ---------------------------------------------------------------------------- mt serve
def server_comparison(hf, config: GPTConfig, args: argparse.Namespace) -> None:  # noqa: ANN001
    """`mt serve` (a process of its own, the same weights) answering ``--clients`` requests
    sent by as many concurrent clients, against the same requests one by one; alternating,
    the median of ``--repeats`` each; the texts must agree."""
    import concurrent.futures
    import signal
    import subprocess
    import tempfile

    import httpx

    from mt_dist import free_port

    n = args.clients
    prompts = make_prompts(config, n, args.prompt_tokens, seed=99)
    with tempfile.TemporaryDirectory(prefix="mt-bench-serve-") as tmp:
        hf.save_pretrained(tmp)  # mt serve reads Hugging Face folders (converted in process)
        port = free_port("127.0.0.1")
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            os.path.abspath(p) for p in sys.path if p)}
        log = open(os.path.join(tmp, "serve.log"), "w")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "mt_inference", "serve", tmp, "--port", str(port),
             "--tokenizer", "gpt2", "--max-batch", str(n), "--model-name", "bench"],
            env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("mt serve did not start: "
                                     + open(log.name).read())  # noqa: SIM115
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.3)

            def ask(prompt: list[int]) -> str:
                response = httpx.post(f"{url}/v1/completions", timeout=600, json={
                    "prompt": prompt, "max_tokens": args.new_tokens, "temperature": 0})
                response.raise_for_status()
                return response.json()["choices"][0]["text"]

            def one_by_one() -> list[str]:
                return [ask(p) for p in prompts]

            def concurrent_clients() -> list[str]:
                with concurrent.futures.ThreadPoolExecutor(n) as pool:
                    return list(pool.map(ask, prompts))

            sides = {"one by one": one_by_one, f"{n} concurrent": concurrent_clients}
            texts = {name: run() for name, run in sides.items()}  # warm-up, untimed
            differ = sum(a != b for a, b in zip(*texts.values(), strict=True))
            times: dict[str, list[float]] = {name: [] for name in sides}
            for _ in range(args.repeats):
                for name, run in sides.items():
                    times[name].append(timed(run))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            log.close()
    tokens = n * args.new_tokens
    rates = {name: tokens / statistics.median(t) for name, t in times.items()}
    first, second = rates.values()
    print(f"mt serve, {n} requests of {args.prompt_tokens} + {args.new_tokens} tokens (greedy, "
          f"HTTP, median of {args.repeats}): " + ", ".join(
              f"{name} {rate:.1f} tok/s" for name, rate in rates.items())
          + f"; concurrent / one by one {second / first:.2f}x"
          + (f"; WARNING {differ} texts differ" if differ else "; the same texts"))


# -------------------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=gpt2_presets(), default="gpt2-small",
                        help="mt_model preset of the GPT-2 block (random weights)")
    parser.add_argument("--prompt-tokens", type=int, help="default 32 (tiny: 16)")
    parser.add_argument("--new-tokens", type=int, help="default 64 (tiny: 32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per side")
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch.set_num_threads (default: all cores)")
    parser.add_argument("--clients", type=int, default=16,
                        help="mt serve: concurrent clients against the same requests one by "
                        "one (0: skip the server)")
    args = parser.parse_args()
    prompt, new = DEFAULT_LENGTHS.get(args.model, GPT2_LENGTHS)
    args.prompt_tokens = args.prompt_tokens or prompt
    args.new_tokens = args.new_tokens or new
    args.batch_sizes = [int(b) for b in args.batches.split(",") if b.strip()]
    seq_len = PRESETS[args.model].seq_len
    if args.prompt_tokens < 1 or args.new_tokens < 1 or args.repeats < 1 or args.threads < 1:
        parser.error("--prompt-tokens, --new-tokens, --repeats and --threads must be >= 1")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        parser.error(f"--batches must list positive batch sizes, got {args.batches!r}")
    if args.prompt_tokens + args.new_tokens > seq_len:
        parser.error(f"{args.prompt_tokens} prompt + {args.new_tokens} new tokens exceed "
                     f"{args.model}'s {seq_len} positions")
    return args


def print_header(args: argparse.Namespace, config: GPTConfig) -> None:
    import transformers

    one, five, fifteen = os.getloadavg()
    print(f"mt generate vs transformers generate, greedy, KV cache, fp32, CPU, "
          f"{datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC")
    print(f"load average {one:.2f} {five:.2f} {fifteen:.2f}; torch {torch.__version__}, "
          f"transformers {transformers.__version__}; {torch.get_num_threads()} torch threads "
          f"of {os.cpu_count()} CPUs")
    print("command: " + shlex.join([os.path.basename(sys.executable), *sys.argv]))
    print(f"model {args.model}: {config.n_layers} layers, hidden {config.hidden}, "
          f"{config.n_heads} heads, vocab {config.vocab_size}, "
          f"{count_parameters(config) / 1e6:.1f}M parameters; prompt {args.prompt_tokens} "
          f"tokens, {args.new_tokens} new tokens, median of {args.repeats} alternating calls "
          "per side")


def print_table(results: list[dict[str, float | int]]) -> None:
    print(f"{'batch':>5} {'mt tok/s':>10} {'hf tok/s':>10} {'mt/hf':>6} {'target':>7}  result"
          f"   (best of each: mt, hf tok/s)")
    for r in results:
        target = TARGETS.get(int(r["batch"]))
        verdict = "-" if target is None else ("PASS" if r["ratio"] >= target else "BELOW")
        shown = "-" if target is None else f">={target:.1f}x"
        print(f"{r['batch']:>5} {r['mt']:>10.1f} {r['hf']:>10.1f} {r['ratio']:>5.2f}x "
              f"{shown:>7}  {verdict:<6}   ({r['mt_best']:.1f}, {r['hf_best']:.1f})")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    import transformers  # a pinned peer (benchmarks/requirements.txt): fail, never skip

    transformers.logging.set_verbosity_error()
    config = model_config(args.model)
    print_header(args, config)
    model = GPT(config, seed=0).eval()
    hf = hf_twin(model)  # copies the weights
    decoding_layout_(model)  # as `mt generate` and `mt serve` hold a model that only decodes
    results = []
    for batch in args.batch_sizes:
        results.append(bench_batch(model, hf, batch, args))
    print_table(results)
    if args.clients:
        server_comparison(hf, config, args)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
