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

    PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':') python3 benchmarks/prepare_ray.py
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--scales", default="1,4")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
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
