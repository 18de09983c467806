"""GB/s of an ``mt convert`` layout reshape against a plain file copy, and peak memory.

A random GPT of about 1.1 GB of fp32 weights is written as a consolidated checkpoint (in
a child process, so its generation does not count towards this process's peak RSS), then
timed, alternately and ``--repeats`` times each on the same disk:

- copy: ``shutil.copyfile`` of the checkpoint's ``model.safetensors`` + fsync;
- reshape: ``convert_checkpoint(src, dst, to="tp", tp=2, pp=2)``: TP 1 -> TP 2 x PP 2
  (read, slice, pad the vocabulary, checksum, write and fsync 4 files + manifest);
- merge: the TP 2 x PP 2 checkpoint back to consolidated;
- to / from each of ``--formats`` (default dcp, mcore, gguf at f32): the consolidated
  checkpoint written in that format, and read back into a consolidated one;
- crc32c: one ``crc32c.crc32c`` pass over the source file, the checksum conversions record
  (a conversion verifies the checksum of every byte it reads and records one for every
  byte it writes; for most tensors one pass serves both, see ``mt_formats.crc``).

Before each run its source files are dropped from the page cache (fsync, then
``POSIX_FADV_DONTNEED``), so that every side reads its source from disk, as a checkpoint
larger than memory is read (otherwise the copy would read a source the previous copy left
in the cache, and the merge shards the reshape wrote past it). Every side runs twice in a
row and the second run is timed: on a virtual machine a run's speed depends on the guest
finding page-cache memory at hand and on the host having cached what it just read (see
mt-formats' README), and the second run of each side finds both, as the others' do.
Speeds are source bytes / best time. Peak RSS is ``resource.getrusage`` of
this process (it includes the page-cache pages of memory-mapped source files it touched),
once after the first reshape and once at the end (the merge maps and merges the shards).
The load average is printed too: on a shared machine it explains most of the spread.
Example:

    PYTHONPATH=$(ls -d packages/*/src apps/*/src | tr '\\n' ':') python3 benchmarks/convert.py
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

import crc32c
import torch

from mt_formats import TensorSpec, canonical_shapes, convert_checkpoint, make_writer
from mt_model import GPTConfig


def _config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(n_layers=args.layers, hidden=args.hidden, n_heads=args.heads,
                     vocab_size=args.vocab, seq_len=args.seq)


def _build(config_dict: dict, directory: str) -> None:
    """Stream random tensors into a consolidated checkpoint (one tensor in memory)."""
    config = GPTConfig.from_dict(config_dict)
    shapes = canonical_shapes(config)
    writer = make_writer("consolidated", config,
                         {n: TensorSpec(s, torch.float32) for n, s in shapes.items()})
    generator = torch.Generator().manual_seed(0)
    Path(directory).mkdir(parents=True)
    writer.open(Path(directory))
    for name, shape in shapes.items():
        writer.write(name, torch.randn(shape, generator=generator) * 0.02)
    writer.finish()


def _copy(source: Path, target: Path) -> float:
    _evict(source)
    start = time.perf_counter()
    shutil.copyfile(source, target)
    with open(target, "rb+") as handle:  # the converter fsyncs what it writes: so do we
        os.fsync(handle.fileno())
    return time.perf_counter() - start


def _hash(path: Path) -> float:
    """Seconds to CRC-32C the file once: the converter's hashing, next to the copy."""
    start = time.perf_counter()
    crc, buffer = 0, memoryview(bytearray(8 << 20))  # reused, as the converter's
    with open(path, "rb", buffering=0) as handle:
        while size := handle.readinto(buffer):
            crc = crc32c.crc32c(buffer[:size], crc)
    return time.perf_counter() - start


def _evict(source: Path) -> None:
    """Drop ``source`` (a file, or every file under a folder) from the page cache."""
    for path in [source] if source.is_file() else sorted(source.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _timed(fn: object, source: Path, output: Path, **kwargs: object) -> float:
    """Seconds of the second of two runs in a row of ``fn(source, output, **kwargs)``,
    ``source`` read from disk each time; ``output`` (a file or folder) is what the second
    run left."""
    for run in range(2):
        _evict(source)
        start = time.perf_counter()
        fn(source, output, **kwargs)  # type: ignore[operator]
        seconds = time.perf_counter() - start
        if run == 0 and output.is_dir():
            shutil.rmtree(output)
        elif run == 0:
            output.unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--formats", default="dcp,mcore,gguf",
                        help="formats to write and read back (gguf at f32: the same bytes)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="parent of the scratch directory, created if missing (default: the "
                             "system temporary directory); the scratch directory is removed after")
    args = parser.parse_args()
    config = _config(args)
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="mt-convert-bench-", dir=args.dir))
    try:
        source = scratch / "full"
        context = multiprocessing.get_context("spawn")
        child = context.Process(target=_build, args=(config.to_dict(), str(source)))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise SystemExit(f"building the source checkpoint failed ({child.exitcode})")
        size = (source / "model.safetensors").stat().st_size
        print(f"checkpoint: {config.n_layers} layers, hidden {config.hidden}, vocab "
              f"{config.vocab_size}: {size / 1e9:.3f} GB fp32")
        copies, reshapes, merges, hashes = [], [], [], []
        formats = [f for f in args.formats.split(",") if f]
        writes: dict[str, list[float]] = {f: [] for f in formats}
        reads: dict[str, list[float]] = {f: [] for f in formats}
        reshape_peak = 0
        for repeat in range(args.repeats):
            copies.append(_timed(_copy, source / "model.safetensors", scratch / "copy"))
            (scratch / "copy").unlink()
            hashes.append(_hash(source / "model.safetensors"))
            reshapes.append(_timed(convert_checkpoint, source, scratch / "tp2pp2", to="tp",
                                   tp=2, pp=2))
            if repeat == 0:  # before any merge: the reshape's own peak
                reshape_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            merges.append(_timed(convert_checkpoint, scratch / "tp2pp2", scratch / "back"))
            shutil.rmtree(scratch / "tp2pp2")
            shutil.rmtree(scratch / "back")
            for fmt in formats:
                extra = {"gguf_type": "f32"} if fmt == "gguf" else {}
                writes[fmt].append(_timed(convert_checkpoint, source, scratch / fmt, to=fmt,
                                          **extra))
                reads[fmt].append(_timed(convert_checkpoint, scratch / fmt, scratch / "back"))
                shutil.rmtree(scratch / fmt)
                shutil.rmtree(scratch / "back")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        copy = size / min(copies) / 1e9
        rows = [("reshape TP1 -> TP2 x PP2", reshapes),
                ("merge TP2 x PP2 -> consolidated", merges)]
        for fmt in formats:
            rows += [(f"consolidated -> {fmt}", writes[fmt]),
                     (f"{fmt} -> consolidated", reads[fmt])]
        for label, times in rows:
            speed = size / min(times) / 1e9
            print(f"{label:32s} {min(times):6.2f} s  {speed:5.2f} GB/s  "
                  f"{speed / copy:4.2f}x copy")
        print(f"{'shutil.copyfile + fsync':32s} {min(copies):6.2f} s  {copy:5.2f} GB/s")
        print(f"{'crc32c of the file (one pass)':32s} {min(hashes):6.2f} s  "
              f"{size / min(hashes) / 1e9:5.2f} GB/s  (the reshape hashes every byte once, "
              "row-parallel ones twice, that pass alongside the shard writes)")
        print(f"peak RSS after the reshapes (copy, crc32c and reshape only): "
              f"{reshape_peak / 1e9:.2f} GB")
        print(f"peak RSS of this process: {peak / 1e9:.2f} GB ({peak / size:.2f}x the "
              f"checkpoint; largest tensor "
              f"{config.vocab_size * config.hidden * 4 / 1e9:.2f} GB)")
        print("load average (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
