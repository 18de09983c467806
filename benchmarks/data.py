"""Benchmark mt-data: JSONL -> token shards throughput and random GPT-sample reads.

Compared in the same run, on the same input, with the same GPT-2 fast tokenizer:
  (a) HF ``datasets``: ``load_dataset("json")`` + batched ``map`` (skipped if not installed);
  (b) a Megatron-style path: a multiprocessing pool encoding one document per task (as
      Megatron's ``preprocess_data.py``) feeding megatron-core's ``IndexedDatasetBuilder``
      (skipped if megatron-core / torch are not importable);
and random-access GPT sample reads per second against megatron-core's ``IndexedDataset``,
plus the time to build a sample index over 1M documents.

Input: ``--input FILE.jsonl ...`` or, by default, about 20 MB of real text made by repeating
the embedded public-domain corpus (Moby-Dick + State of the Union). Nothing is downloaded.

    python benchmarks/data.py [--mb 20] [--workers N] [--input FILE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from mt_data import (
    CleanConfig,
    DedupConfig,
    FilterConfig,
    GPTDataset,
    PrepareConfig,
    TokenDataset,
    build_sample_index,
    corpus_texts,
    export_megatron,
    load_tokenizer,
    prepare,
)

SEQ_LEN = 2048


def make_input(path: Path, megabytes: float) -> Path:
    """JSONL of the embedded corpus repeated to about ``megabytes`` MB."""
    texts = corpus_texts()
    size, copy = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * 1e6:
            for i, text in enumerate(texts):
                f.write(json.dumps({"id": f"{copy}-{i}", "text": text}) + "\n")
                size += len(text.encode())
            copy += 1
    return path


def input_bytes(paths: list[Path]) -> int:
    """UTF-8 bytes of the text fields (what every path tokenizes)."""
    total = 0
    for path in paths:
        with open(path, encoding="utf-8") as f:
            total += sum(len(json.loads(line)["text"].encode()) for line in f if line.strip())
    return total


def cpu_seconds() -> float:
    """CPU time of this process (all threads) and of its finished child processes."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn: Callable[[], int]) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds and the tokens produced. CPU seconds matter on a shared
    machine: other jobs inflate wall time but not (much) the CPU time a path needs."""
    start, cpu = time.perf_counter(), cpu_seconds()
    tokens = fn()
    return time.perf_counter() - start, cpu_seconds() - cpu, tokens


def run_mt(paths: list[Path], out: Path, workers: int, full: bool) -> int:
    """mt-data prepare; ``full`` runs every filter and both dedups, otherwise tokenize only."""
    if full:
        clean = CleanConfig()
    else:
        clean = CleanConfig(filters=FilterConfig.disabled(),
                            dedup=DedupConfig(exact=False, fuzzy=False))
    summary = prepare(paths, out, PrepareConfig(clean=clean, tokenizer="gpt2", workers=workers,
                                                overwrite=True))
    return int(summary["tokens_out"])


def run_hf_datasets(paths: list[Path], cache: Path) -> int:
    import datasets

    tok = load_tokenizer("gpt2")
    eod = tok.eod_id
    ds = datasets.load_dataset("json", data_files=[str(p) for p in paths], split="train",
                               cache_dir=str(cache))

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        encs = tok.backend.encode_batch_fast(batch["text"], add_special_tokens=False)
        return {"input_ids": [e.ids + [eod] for e in encs]}

    mapped = ds.map(encode, batched=True, batch_size=1000, remove_columns=ds.column_names)
    return int(sum(len(x) for x in mapped.data.column("input_ids").to_pylist()))


_WORKER_TOK = None


def _init_worker() -> None:
    global _WORKER_TOK  # per-process tokenizer, as Megatron's Encoder.initializer does
    _WORKER_TOK = load_tokenizer("gpt2")


def _encode_line(line: str) -> tuple[list[int], int]:
    text = json.loads(line)["text"]
    return _WORKER_TOK.encode(text, append_eod=True), len(text.encode())


def run_megatron_style(paths: list[Path], prefix: Path, workers: int) -> int:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    tokens = 0
    with get_context("fork").Pool(workers, initializer=_init_worker) as pool:
        for path in paths:
            with open(path, encoding="utf-8") as f:
                for ids, _ in pool.imap(_encode_line, f, chunksize=32):
                    builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
                    tokens += len(ids)
    builder.finalize(f"{prefix}.idx")
    return tokens


def random_reads(read: Callable[[int], np.ndarray], n: int, count: int, seed: int = 0) -> float:
    order = np.random.default_rng(seed).integers(0, n, size=count)
    start = time.perf_counter()
    checksum = 0
    for i in order:
        checksum += int(read(int(i))[0])
    return count / (time.perf_counter() - start)


def bench_random_access(data: Path, tmp: Path) -> dict[str, float]:
    ds = GPTDataset(data, SEQ_LEN, seed=1, split="train", cache=False)
    results = {"mt-data GPTDataset": random_reads(ds.__getitem__, len(ds), 20_000)}
    try:
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    except ImportError as exc:
        print(f"  megatron-core not importable ({exc}): random-access baseline skipped")
        return results
    export_megatron(TokenDataset(data), tmp / "ra")
    theirs = IndexedDataset(str(tmp / "ra"))
    idx = ds.index
    lengths = TokenDataset(data).doc_lengths

    def megatron_sample(i: int) -> np.ndarray:
        # Megatron's GPTDataset sample read: same sample index, reads via IndexedDataset.get.
        k = int(idx.shuffle[i])
        first, last = int(idx.sample_doc[k]), int(idx.sample_doc[k + 1])
        start, stop = int(idx.sample_offset[k]), int(idx.sample_offset[k + 1]) + 1
        if first == last:
            return theirs.get(int(idx.doc_idx[first]), offset=start, length=stop - start)
        parts = [theirs.get(int(idx.doc_idx[first]), offset=start)]
        parts += [theirs.get(int(d)) for d in idx.doc_idx[first + 1 : last]]
        parts.append(theirs.get(int(idx.doc_idx[last]), length=stop))
        return np.concatenate(parts)

    for i in range(0, len(ds), max(1, len(ds) // 50)):  # same samples both ways
        np.testing.assert_array_equal(megatron_sample(i), ds[i])
    del lengths
    results["megatron-core IndexedDataset"] = random_reads(megatron_sample, len(ds), 20_000)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="*", type=Path, default=None)
    parser.add_argument("--mb", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mt-data-bench-"))
    try:
        paths = args.input or [make_input(tmp / "input.jsonl", args.mb)]
        nbytes = input_bytes(paths)
        print(f"input: {nbytes / 1e6:.1f} MB of text in {len(paths)} file(s), "
              f"{args.workers} workers, {os.cpu_count()} CPUs, "
              f"load average {os.getloadavg()[0]:.1f}")
        rows: dict[str, tuple[float, float, int]] = {}
        rows["mt-data prepare (tokenize only)"] = timed(
            lambda: run_mt(paths, tmp / "mt", args.workers, full=False))
        rows["mt-data prepare (filters + dedup)"] = timed(
            lambda: run_mt(paths, tmp / "mt-full", args.workers, full=True))
        for name, fn in (("HF datasets map", lambda: run_hf_datasets(paths, tmp / "hf")),
                         ("Megatron-style pool + IndexedDatasetBuilder",
                          lambda: run_megatron_style(paths, tmp / "mg", args.workers))):
            try:
                rows[name] = timed(fn)
            except ImportError as exc:
                print(f"  {name}: skipped ({exc})")
        print(f"\n{'JSONL -> token shards':<46}{'MB/s':>8}{'tokens/s':>12}{'wall s':>8}"
              f"{'CPU s':>8}{'MB/CPU-s':>10}")
        for name, (seconds, cpu, tokens) in rows.items():
            print(f"{name:<46}{nbytes / 1e6 / seconds:>8.2f}{tokens / seconds:>12,.0f}"
                  f"{seconds:>8.2f}{cpu:>8.2f}{nbytes / 1e6 / cpu:>10.2f}")
        ours = rows["mt-data prepare (tokenize only)"]
        for name in ("HF datasets map", "Megatron-style pool + IndexedDatasetBuilder"):
            if name in rows:
                print(f"speed-up vs {name}: wall {rows[name][0] / ours[0]:.2f}x, "
                      f"CPU {rows[name][1] / ours[1]:.2f}x")
        print("\nrandom GPT sample reads (seq_len 2048)")
        reads = bench_random_access(tmp / "mt", tmp)
        for name, per_s in reads.items():
            print(f"{name:<46}{per_s:>12,.0f} samples/s")
        if len(reads) == 2:
            values = list(reads.values())
            print(f"ratio: {values[0] / values[1]:.2f}x")
        lengths = np.random.default_rng(0).integers(20, 4000, size=1_000_000)
        start = time.perf_counter()
        build_sample_index(lengths, np.arange(1_000_000), SEQ_LEN, 1_000_000, seed=1)
        print(f"\nsample index, 1M documents, 1M samples: {time.perf_counter() - start:.2f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
