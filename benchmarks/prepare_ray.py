"""`mt data prepare` on Ray against the local executor, at equal workers, on this machine.

The input: the shipped corpus (2.5 MB of real English) copied until it reaches --mb MB, each
copy's words shuffled within every document by its own seed (so copies are neither exact nor
near duplicates: dedup has its real work, and removes only what the corpus itself repeats),
as 8 JSONL files; and the same at 4x. Every stage on (mt-basic filters, exact and fuzzy
dedup, group counts, the 1k tokenizer). Rows: the local executor with 1 and 2 workers (this
process plus a pool), and Ray with 1 and 2 CPUs (a one-node cluster started with `ray start
--head --num-cpus N` for the row, its start-up not counted); each prepare's own stage times
(clean with fingerprints, dedup, tokenize) and total, the sides alternated, --repeats runs,
medians. Each Ray dataset is checked equal to the local one (index.json's timings aside).

``--dedup-docs N`` measures the dedup stage alone at scale instead, at N and 4N documents:
stage-1 chunk files of 10,000 documents each (random 128-permutation signatures, 1% of the
documents near copies of an earlier one: 0-24 of their 128 values changed, and 0.5% exact
copies), deduplicated by ``stages.global_dedup`` as `prepare` runs it: in memory, bounded
(spilled, band by band) and as band tasks on Ray at 1 and 2 CPUs, each side in a fresh
process (peak = its ``ru_maxrss``), every keep mask checked equal. For Ray, each band task's
own peak resident memory (its worker's ``VmHWM``, reset at the task's start) is measured in
a second pass of the same tasks.

    PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':') python3 benchmarks/prepare_ray.py
    PYTHONPATH=... python3 benchmarks/prepare_ray.py --dedup-docs 500000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mt_data.corpus import iter_corpus
from mt_data.pipeline import PrepareConfig, prepare

STAGES = ("clean", "dedup", "tokenize", "total")
RAY = [sys.executable, "-m", "ray.scripts.scripts"]


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f} / {five:.1f}"


def make_input(folder: Path, mb: float) -> list[Path]:
    """``mb`` MB of shuffled copies of the corpus as 8 JSONL files."""
    folder.mkdir(parents=True)
    docs = [d["text"] for d in iter_corpus()]
    files = [open(folder / f"part-{k}.jsonl", "w", encoding="utf-8") for k in range(8)]
    written, copy = 0, 0
    while written < mb * 1e6:
        rng = random.Random(copy)
        for i, text in enumerate(docs):
            words = text.split(" ")
            if copy:
                rng.shuffle(words)
            line = json.dumps({"id": f"{copy}/{i}", "text": " ".join(words)}) + "\n"
            files[(copy * len(docs) + i) % 8].write(line)
            written += len(line)
        copy += 1
    for f in files:
        f.close()
    return sorted(folder.glob("*.jsonl"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A one-node Ray cluster with ``cpus`` CPUs, for one row."""

    def __init__(self, cpus: int) -> None:
        self.port, self.env = _free_port(), {
            **os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
        subprocess.run([*RAY, "start", "--head", f"--port={self.port}", f"--num-cpus={cpus}",
                        "--include-dashboard=false", "--disable-usage-stats"],
                       env=self.env, check=True, capture_output=True, timeout=300)

    def __enter__(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __exit__(self, *_: object) -> None:
        subprocess.run([*RAY, "stop", "--force"], env=self.env, capture_output=True,
                       timeout=120)


def _dataset(folder: Path) -> dict[str, bytes]:
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.name.startswith(".lock"):
            data = path.read_bytes()
            if path.name == "index.json":
                index = json.loads(data)
                for key in ("seconds", "mb_per_s", "tokens_per_s"):
                    index["stats"].pop(key)
                data = json.dumps(index, sort_keys=True).encode()
            out[str(path.relative_to(folder))] = data
    return out


def run(inputs: list[Path], out: Path, executor: str, workers: int) -> dict[str, float]:
    shutil.rmtree(out, ignore_errors=True)
    config = PrepareConfig(tokenizer="tokenizer-1k", workers=workers if executor == "local"
                           else 0)
    if executor == "local":
        summary = prepare(inputs, out, config)
    else:
        with Cluster(workers) as address:
            from dataclasses import replace

            summary = prepare(inputs, out, replace(config, executor="ray",
                                                   ray_address=address))
    return summary["seconds"]


CHUNK_DOCS = 10_000
NUM_PERM = 128


def make_chunks(folder: Path, n: int, seed: int = 0) -> list[Path]:
    """Stage-1 chunk files of ``n`` documents (the columns `global_dedup` reads; empty texts):
    random signatures, 1% near copies and 0.5% exact copies of the previous chunk's documents
    (of earlier ones of the same chunk in the first)."""
    import pyarrow as pa

    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    paths, prev = [], None
    for c, lo in enumerate(range(0, n, CHUNK_DOCS)):
        m = min(CHUNK_DOCS, n - lo)
        sig = rng.integers(0, 2**32, size=(m, NUM_PERM), dtype=np.uint32)
        digest = rng.integers(0, 256, size=(m, 16), dtype=np.uint8)
        near = np.flatnonzero(rng.random(m) < 0.01)
        exact = np.flatnonzero(rng.random(m) < 0.005)
        for rows, whole in ((near, False), (exact, True)):
            for pos in rows:
                src_sig, src_digest = prev if prev else (sig[:max(1, pos)], digest[:max(1, pos)])
                src = int(rng.integers(0, len(src_sig)))
                sig[pos] = src_sig[src]
                if whole:
                    digest[pos] = src_digest[src]
                else:
                    k = int(rng.integers(0, 25))
                    sig[pos, rng.choice(NUM_PERM, k, replace=False)] = rng.integers(
                        0, 2**32, size=k, dtype=np.uint32)
        batch = pa.RecordBatch.from_arrays([
            pa.array([str(lo + i) for i in range(m)]), pa.array(["bench"] * m),
            pa.array([""] * m),
            pa.FixedSizeBinaryArray.from_buffers(pa.binary(16), m,
                                                 [None, pa.py_buffer(digest.tobytes())]),
            pa.FixedSizeListArray.from_arrays(pa.array(sig.ravel()), NUM_PERM),
            pa.array(np.ones(m, dtype=bool))],
            names=["id", "source", "text", "hash", "minhash", "has_shingles"])
        paths.append(folder / f"chunk-{c:05d}.arrow")
        with pa.ipc.new_file(str(paths[-1]), batch.schema) as writer:
            writer.write_batch(batch)
        prev = (sig, digest)
    return paths


def _proc_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def measured_band_pairs(*job: object) -> tuple[object, ...]:
    """One band task, with the peak resident memory of its own run (the worker's high-water
    mark reset at its start, then read at its end) and the worker's memory before it, MB."""
    from mt_data.dedup_tasks import band_pairs

    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current resident size (Linux >= 4.0)
    before = _proc_kb("VmRSS")
    codes, same = band_pairs(*job)
    return codes, same, _proc_kb("VmHWM") / 1024, before / 1024


def dedup_side(paths: list[Path], side: str, spill: str, address: str | None,
               queue) -> None:  # noqa: ANN001
    """One side of the dedup comparison, in a fresh process; reports through ``queue``."""
    import resource

    from mt_data.dedup import DedupConfig, first_occurrences
    from mt_data.dedup_tasks import fuzzy_dedup_tasks
    from mt_data.sharing import run_shared
    from mt_data.stages import global_dedup

    config, kwargs, pool = DedupConfig(), {}, None
    if side == "bounded":
        kwargs = {"spill_dir": Path(spill), "bounded_min_docs": 0}
    elif side == "ray":
        import ray.cloudpickle  # pants: no-infer-dep

        from mt_data.ray_executor import RayExecutor

        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        pool = RayExecutor(address)
        kwargs = {"pool": pool}
    start = time.perf_counter()
    keep, stats = global_dedup(paths, config, **kwargs)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tasks: list[tuple[float, float]] = []
    if pool is not None:  # the same band tasks again, each measuring its own memory
        import pyarrow as pa

        digests = np.concatenate([
            np.frombuffer(pa.ipc.open_file(pa.memory_map(str(p))).get_batch(0)
                          .column("hash").buffers()[1], dtype=np.uint8).reshape(-1, 16)
            for p in paths])
        alive = np.flatnonzero(first_occurrences(digests))

        def run(fn: object, jobs: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
            out = run_shared(measured_band_pairs, jobs, pool)
            tasks.extend((hwm, before) for *_, hwm, before in out)
            return [(codes, same) for codes, same, *_ in out]

        again = fuzzy_dedup_tasks([str(p) for p in paths], config.num_perm, alive,
                                  config.bands, config.threshold, pool, pool._max_workers,
                                  run=run)
        assert (again.keep == keep[alive]).all(), "the measured pass differs"
        pool.shutdown()
    queue.put({"seconds": seconds, "peak_mb": peak, "tasks": tasks,
               "keep": np.packbits(keep).tobytes(), **stats})


def dedup_in_process(paths: list[Path], side: str, spill: Path,
                     address: str | None = None) -> dict:
    from multiprocessing import get_context

    ctx = get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=dedup_side, args=(paths, side, str(spill), address, queue))
    proc.start()
    out = queue.get()
    proc.join()
    return out


def bench_dedup(n: int, scales: list[int]) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {_load()}, "
          f"{os.cpu_count()} cores; dedup stage alone, {NUM_PERM} permutations, 16 bands")
    print("   documents  side       CPUs  dedup s  peak MB  task peak MB  tasks  exact  "
          "fuzzy  cand. pairs")
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        root = Path(tmp)
        for scale in scales:
            paths = make_chunks(root / f"chunks-{scale}", n * scale)
            rows = [("in-memory", 1), ("bounded", 1), ("ray", 1), ("ray", 2)]
            results = {}
            for side, cpus in rows:
                if side == "ray":
                    with Cluster(cpus) as address:
                        r = dedup_in_process(paths, side, root, address)
                else:
                    r = dedup_in_process(paths, side, root)
                results[side, cpus] = r
                task = (f"{max(h for h, _ in r['tasks']):6.0f} "
                        f"({max(b for _, b in r['tasks']):.0f})" if r["tasks"] else "-")
                print(f"  {n * scale:>10,}  {side:<9}  {cpus:>4}  {r['seconds']:7.1f}  "
                      f"{r['peak_mb']:7.0f}  {task:>12}  {len(r['tasks']) or '-':>5}  "
                      f"{r['exact_duplicates']:>5,}  {r['fuzzy_duplicates']:>5,}  "
                      f"{r['candidate_pairs']:>11,}", flush=True)
            first = results[rows[0]]
            for key, r in results.items():
                assert r["keep"] == first["keep"], f"{key} keeps other documents"
            shutil.rmtree(root / f"chunks-{scale}")
    print("peak MB: the side's own process (for Ray: the driver); task peak MB: the largest "
          "band task's resident high-water mark (its worker's resident memory before it); "
          "every side's keep mask equal")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--scales", default="1,4")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dedup-docs", type=int, default=0,
                        help="measure the dedup stage alone at this many documents x --scales")
    args = parser.parse_args()
    if args.dedup_docs:
        return bench_dedup(args.dedup_docs, [int(s) for s in args.scales.split(",")])
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {_load()}, "
          f"{os.cpu_count()} cores; {args.mb:g} MB x {args.scales}, every stage on")
    sides = [("local", 1), ("ray", 1), ("local", 2), ("ray", 2)]
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        root = Path(tmp)
        for scale in (int(s) for s in args.scales.split(",")):
            inputs = make_input(root / f"in-{scale}", args.mb * scale)
            size = sum(p.stat().st_size for p in inputs) / 1e6
            times: dict[tuple[str, int], list[dict[str, float]]] = {s: [] for s in sides}
            for repeat in range(args.repeats):
                for side in (sides if repeat % 2 == 0 else sides[::-1]):
                    times[side].append(run(inputs, root / f"{side[0]}-{side[1]}", *side))
                for workers in (1, 2):
                    same = _dataset(root / f"local-{workers}") == _dataset(
                        root / f"ray-{workers}")
                    assert same, f"ray at {workers} differs from local"
            print(f"{size:.0f} MB input (x{scale}), medians of {args.repeats}, {_load()}:")
            print("  executor  workers  " + "  ".join(f"{s:>8}" for s in STAGES) + "   MB/s")
            for side in sides:
                med = {k: statistics.median(t[k] for t in times[side]) for k in STAGES}
                print(f"  {side[0]:<8}  {side[1]:>7}  " + "  ".join(
                    f"{med[k]:7.1f}s" for k in STAGES) + f"  {size / med['total']:5.1f}")
            for workers in (1, 2):
                ray_t = statistics.median(t["total"] for t in times[("ray", workers)])
                local_t = statistics.median(t["total"] for t in times[("local", workers)])
                print(f"  Ray over local at {workers} worker(s): {ray_t / local_t - 1:+.0%}")
            for side in sides:
                shutil.rmtree(root / f"{side[0]}-{side[1]}", ignore_errors=True)
            shutil.rmtree(root / f"in-{scale}")


if __name__ == "__main__":
    sys.exit(main())
