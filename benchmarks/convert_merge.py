"""Where the merge TP 2 x PP 2 -> consolidated (and the reshape back) spends its time, next to
plain file copies.

Builds (once, under ``--dir``) the same 1.117 GB fp32 checkpoint as ``convert.py`` and its
TP 2 x PP 2 reshape, then ``--repeats`` times, alternately: ``shutil.copyfile`` + fsync of
``model.safetensors`` (the bytes the merge writes), the merge back to consolidated, the
reshape of the consolidated checkpoint to TP 2 x PP 2, and a copy + fsync of the four shard
files (the bytes the merge reads: every shard is verified,
the last stage's tied embedding and the replicated copies included), each source dropped
from the page cache first (as ``convert.py`` does). For each it prints the wall time, the
process's user and system CPU time, and the bytes the disk read and wrote with its busy
time (``/proc/diskstats`` of the disk holding ``--dir``); for the merge also the wall time
per tensor style (from one progress call to the next: the writer's time plus any wait for
the read-ahead) and the time outside the tensor loop (opening, final fsyncs, manifest). At
the end, the best and the median of each, and the merge's and the reshape's speed against
each copy. On a virtual machine a copy's time depends on the page cache finding memory (its
system CPU time shows it, several-fold for the same file), the merge's much less (it reads
and writes past the page cache); and a file read again soon reads faster even past this
machine's page cache (the host caches it: 1.3-1.6 GB/s the first time, 3.3-5.6 GB/s
again). So every side runs twice in a row and the second run is the one timed: each finds
the memory the first one's files freed and reads a source the first one just read, the
same conditions for all, at their best. Example:

    PYTHONPATH=$(ls -d packages/*/src apps/*/src | tr '\\n' ':') \\
        python3 benchmarks/convert_merge.py --repeats 3 --dir /tmp/cvb-merge
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from convert import _build, _copy, _evict  # type: ignore[import-not-found]

from mt_formats import convert_checkpoint
from mt_formats.sharded import ShardedReader
from mt_model import GPTConfig


def _disk_of(path: Path) -> str:
    """The /proc/diskstats name of the block device holding ``path``."""
    device = os.stat(path).st_dev
    link = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}").resolve()
    return link.parent.name if (link / "partition").exists() else link.name


def _disk(name: str) -> tuple[int, int, int]:
    """(bytes read, bytes written, busy ms) of disk ``name`` so far."""
    for line in Path("/proc/diskstats").read_text().splitlines():
        fields = line.split()
        if fields[2] == name:
            return int(fields[5]) * 512, int(fields[9]) * 512, int(fields[12])
    raise SystemExit(f"disk {name} not in /proc/diskstats")


class _Meter:
    """Wall, CPU and disk counters between :meth:`start` and :meth:`line`."""

    def __init__(self, disk: str) -> None:
        self.disk = disk

    def start(self) -> None:
        self._cpu, self._io, self._wall = os.times(), _disk(self.disk), time.perf_counter()

    def line(self) -> tuple[float, str]:
        wall, cpu, io = time.perf_counter() - self._wall, os.times(), _disk(self.disk)
        return wall, (f"{wall:5.2f} s, cpu user {cpu.user - self._cpu.user:4.2f} s sys "
                      f"{cpu.system - self._cpu.system:4.2f} s, disk read "
                      f"{(io[0] - self._io[0]) / 1e9:4.2f} GB written "
                      f"{(io[1] - self._io[1]) / 1e9:4.2f} GB busy "
                      f"{(io[2] - self._io[2]) / 1e3:4.2f} s")


class _StyleClock:
    """Wall time per tensor style, from one progress call to the next."""

    def __init__(self, styles: dict[str, str]) -> None:
        self.styles = styles
        self.per: dict[str, float] = collections.defaultdict(float)
        self._last = 0.0

    def start(self) -> None:
        self._last = time.perf_counter()

    def progress(self, name: str, done: int, total: int) -> None:
        now = time.perf_counter()
        self.per[self.styles[name]] += now - self._last
        self._last = now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/cvb-merge"),
                        help="where the checkpoints are built (kept for later runs)")
    args = parser.parse_args()
    root = args.dir / "merge-profile"
    full, sharded, back = root / "full", root / "tp2pp2", root / "back"
    if not full.exists():
        root.mkdir(parents=True, exist_ok=True)
        config = GPTConfig(n_layers=18, hidden=1024, n_heads=16, vocab_size=50257,
                           seq_len=1024)
        _build(config.to_dict(), str(full))
    if not sharded.exists():
        convert_checkpoint(full, sharded, to="tp", tp=2, pp=2)
    with ShardedReader(sharded) as reader:
        styles = {name: reader._layout.styles[name] for name in reader.names()}
        sizes = {name: reader.spec(name).nbytes for name in reader.names()}
    meter = _Meter(_disk_of(root))
    times: dict[str, list[float]] = {"copy": [], "merge": [], "reshape": [], "copy-shards": []}

    def twice(repeat: int, side: str, source: Path, run: Callable[[], object],
              output: Path) -> None:
        """``run`` twice in a row, ``source`` dropped from the page cache before each and
        ``output`` removed after; the second is timed (see above)."""
        for warm in (False, True):
            _evict(source)
            meter.start()
            run()
            seconds, line = meter.line()
            if output.is_dir():
                shutil.rmtree(output)
            else:
                output.unlink()
            print(f"[{repeat}] {side}{' again' if warm else ''}  {line}", flush=True)
        times[side].append(seconds)

    clock = _StyleClock(styles)

    def merge() -> None:
        clock.per.clear()
        clock.start()
        convert_checkpoint(sharded, back, progress=clock.progress)

    for repeat in range(args.repeats):
        twice(repeat, "copy", full, lambda: _copy(full / "model.safetensors", root / "copy"),
              root / "copy")
        copy = times["copy"][-1]
        twice(repeat, "merge", sharded, merge, back)
        merged = times["merge"][-1]
        print(f"    {copy / merged:4.2f}x the copy; per style (the second run): " + ", ".join(
            f"{style} {seconds:4.2f} s / "
            f"{sum(sizes[n] for n in sizes if styles[n] == style) / 1e6:.0f} MB"
            for style, seconds in sorted(clock.per.items()))
            + f"; outside the loop {merged - sum(clock.per.values()):4.2f} s", flush=True)
        twice(repeat, "reshape", full,
              lambda: convert_checkpoint(full, root / "reshaped", to="tp", tp=2, pp=2),
              root / "reshaped")
        print(f"    {copy / times['reshape'][-1]:4.2f}x the copy", flush=True)
        twice(repeat, "copy-shards", sharded,
              lambda: _copy_tree(sharded, root / "copy-shards"), root / "copy-shards")
    best = {side: min(values) for side, values in times.items()}
    median = {side: statistics.median(values) for side, values in times.items()}
    for side in times:
        print(f"{side:12s} best {best[side]:5.2f} s, median {median[side]:5.2f} s")
    for side, what in (("copy", "model.safetensors"), ("copy-shards", "the shard files")):
        for job in ("merge", "reshape"):
            print(f"{job} against the copy of {what}: {best[side] / best[job]:4.2f}x (best), "
                  f"{median[side] / median[job]:4.2f}x (median)")
    print("load average (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))


def _copy_tree(source: Path, target: Path) -> None:
    """Copy every file under ``source`` (``shutil.copyfile``), fsync each."""
    for path in sorted(source.rglob("*")):
        if path.is_file():
            out = target / path.relative_to(source)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, out)
            with open(out, "rb+") as handle:
                os.fsync(handle.fileno())


if __name__ == "__main__":
    main()
