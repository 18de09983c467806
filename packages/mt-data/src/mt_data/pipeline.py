"""``prepare``: raw text files -> cleaned, deduplicated, decontaminated, tokenized shards.

Stages (outputs under ``OUTPUT/work`` until the end, every file written atomically):
  1. clean: ingest + filters + decontamination + hashes/MinHash, one chunk file per batch,
     work items processed in parallel worker processes;
  2. dedup: exact + fuzzy dedup over all chunks -> ``work/keep.npy`` (from
     ``stages.BOUNDED_DEDUP_MIN_DOCS`` documents in bounded memory: signatures spilled to
     ``work/``, LSH band by band; the same result);
  3. tokenize: kept documents of each chunk -> one token shard (EOD appended);
  4. ``groups.json`` (group-word counts before and after the filters, see
     :mod:`mt_data.group_counts`), ``dropped.json``, ``index.json``.
Each finished chunk / shard is recorded, so rerunning the same command after an interruption
resumes where it stopped (at the chunk/shard level), as long as nothing it read changed: the
run's fingerprint records each file read (size, modified time, a sampled content hash, see
:func:`sample_sha256`), and a finished dataset or an unfinished run whose inputs changed since
is refused, naming the file and what changed (never served stale, never resumed with chunks of
the old input). ``OUTPUT`` is a new or empty folder or one ``prepare`` wrote
(:data:`PREPARE_OUTPUT`): one holding anything else is refused, with or without --overwrite.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import ExitStack, suppress
from dataclasses import asdict, dataclass
from functools import lru_cache
from multiprocessing import get_all_start_methods, get_context
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from mt_data.compressed import COMPRESSED
from mt_data.errors import DatasetError, NoDocumentsError, PrepareError
from mt_data.filters import FILTERS
from mt_data.fingerprint import check_recorded, check_unchanged, file_record, same_run
from mt_data.group_counts import write_group_counts
from mt_data.groups import GroupCounter, GroupWords, load_group_words, merge_counts
from mt_data.ingest import (
    JSON_EXTS,
    PARQUET_EXTS,
    TEXT_EXTS,
    TextKeyError,
    WorkItem,
    check_text_key,
    expand_inputs,
    parallel_split_bytes,
    plan_work,
)
from mt_data.paths import output_clash
from mt_data.prepare_output import check_output, output_lock, refuse_foreign
from mt_data.shards import (
    INDEX_FILE,
    ShardInfo,
    ShardSetWriter,
    TokenDataset,
    atomic_replace,
    atomic_write_json,
    file_sha256,
    write_shard,
)
from mt_data.sharing import run_shared
from mt_data.stages import (
    ChunkStats,
    CleanConfig,
    clean_item,
    count_groups,
    global_dedup,
    load_eval_index,
    read_chunk_stats,
)
from mt_data.tokenizer import Tokenizer, load_tokenizer, tokenizer_version


class ProgressHook(Protocol):
    """Receives progress; the CLI shows it with rich, libraries pass :class:`NoProgress`."""

    def stage(self, name: str, total: float | None, unit: str) -> None:
        """A stage starts; ``total`` in ``unit`` (None when unknown)."""

    def advance(self, amount: float) -> None:
        """Some work of the current stage is done."""

    def end(self) -> None:
        """The current stage is finished."""


class NoProgress:
    """A progress hook that shows nothing."""

    def stage(self, name: str, total: float | None, unit: str) -> None:
        """Ignored."""

    def advance(self, amount: float) -> None:
        """Ignored."""

    def end(self) -> None:
        """Ignored."""


#: Where ``prepare`` runs its tasks.
EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class PrepareConfig:
    """Settings of one ``prepare`` run."""

    clean: CleanConfig = CleanConfig()
    tokenizer: str = "gpt2"
    """``gpt2``, ``tokenizer-1k``, a tokenizer.json or a vocab.json + merges.txt folder."""
    workers: int = 0
    """Processes cleaning and tokenizing in parallel, this one included (0: one per CPU)."""
    keep_work: bool = False
    """Keep ``OUTPUT/work`` (cleaned text chunks, signatures) after success."""
    overwrite: bool = False
    """Delete an existing output folder first instead of resuming / refusing."""
    group_counts: bool = True
    """Count group words (:mod:`mt_data.groups`) before and after the filters:
    ``OUTPUT/groups.json``, ``mt data inspect DIR --groups``."""
    group_words: str | None = None
    """The group-words JSON file counted (None: mt's lists, ``groups.GROUP_WORDS``)."""
    executor: str = "local"
    """``local`` (this machine's processes, ``workers``) or ``ray`` (the tasks on a Ray
    cluster: :mod:`mt_data.ray_executor`; the same dataset)."""
    ray_address: str | None = None
    """With ``executor="ray"``: ``auto`` (the cluster this node is in), ``HOST:PORT``, or None
    (a local Ray started for the run)."""

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got "
                             f"{self.executor!r}")
        if self.ray_address is not None and self.executor != "ray":
            raise ValueError(f"a Ray address ({self.ray_address}) is for --executor ray")


_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "encoder.json", "vocab.bpe")


def _read_files(inputs: list[Path], config: PrepareConfig) -> list[Path]:
    """Every file the run reads: the inputs, the decontamination sets (when used) and a
    tokenizer given as a path."""
    files = list(inputs)
    if config.clean.decontam is not None and config.clean.eval_paths:
        files += expand_inputs(config.clean.eval_paths)
    tokenizer = Path(config.tokenizer)
    if tokenizer.is_file():
        files.append(tokenizer)
    elif tokenizer.is_dir():
        files += [tokenizer / name for name in _TOKENIZER_FILES if (tokenizer / name).is_file()]
    return files


def _refuse_to_delete_inputs(output: Path, inputs: Sequence[str | Path],
                             config: PrepareConfig) -> None:
    """``output`` is never, holds or lies inside something the run reads (the inputs, the
    decontamination sets, a tokenizer given as a path): ``--overwrite`` would delete it, and
    a plain run would write into it."""
    read = [*inputs, *config.clean.eval_paths]
    if Path(config.tokenizer).exists():
        read.append(config.tokenizer)
    if config.group_words is not None:
        read.append(config.group_words)
    clash = output_clash("--output", output, read)
    if clash:
        raise PrepareError(clash)


def _fingerprint(inputs: list[Path], config: PrepareConfig) -> dict[str, Any]:
    """The run's identity: its inputs and settings, plus a record of every file it reads
    (``files``: size, modified time and :func:`sample_sha256`), which tells whether a finished
    dataset or an unfinished run still matches the files on disk."""
    settings = asdict(config)
    for key in ("workers", "keep_work", "overwrite", "executor", "ray_address"):
        settings.pop(key)  # where and how fast it runs, not what it makes
    if config.group_counts:  # the default: fingerprints of earlier releases stay valid
        settings.pop("group_counts")
    if config.group_words is None:
        settings.pop("group_words")
    else:  # a list edited between an interrupted run and its resumption is another run
        settings["group_words"] = {"path": str(config.group_words),
                                   "sha256": file_sha256(Path(config.group_words))}
    rule_sets = config.clean.rule_sets
    if rule_sets is None:  # the default: fingerprints of earlier releases stay valid
        settings["clean"].pop("rule_sets")
    else:
        settings["clean"]["rule_sets"] = [{"name": rs.name, **asdict(rs)} for rs in rule_sets]
    return {"inputs": [str(p) for p in inputs], "settings": settings,
            "files": [file_record(p) for p in _read_files(inputs, config)]}


def _run_tasks(fn: Callable[..., Any], tasks: list[tuple[Any, ...]], sizes: list[float],
               pool: Executor | None, progress: ProgressHook,
               on_result: Callable[[Any], None] = lambda result: None) -> list[Any]:
    """``fn(*task)`` for every task, shared with ``pool`` (:func:`mt_data.sharing.run_shared`),
    advancing ``progress`` by each task's size."""
    return run_shared(fn, tasks, pool, lambda i: progress.advance(sizes[i]), on_result)


def _run_clean(items: list[WorkItem], config: PrepareConfig, work: Path,
               pool: Executor | None, progress: ProgressHook,
               lists: GroupWords | None) -> list[dict[str, Any]]:
    sizes = [item.nbytes / 1e6 for item in items]
    progress.stage("clean + fingerprint", sum(sizes), "MB")
    tasks = [(i, item, config.clean, str(work), lists) for i, item in enumerate(items)]
    results = _run_tasks(clean_item, tasks, sizes, pool, progress)
    progress.end()
    return results


def _run_dedup(chunks: list[Path], config: PrepareConfig, work: Path, pool: Executor | None,
               progress: ProgressHook) -> tuple[np.ndarray, dict[str, int]]:
    keep_path, stats_path = work / "keep.npy", work / "dedup.json"
    names = [p.name for p in chunks]
    if keep_path.exists() and stats_path.exists():
        recorded = json.loads(stats_path.read_text())
        if recorded.get("chunks") == names:
            return np.load(keep_path), recorded["stats"]
    progress.stage("dedup (exact + MinHash/LSH)", None, "")
    # Spills signatures to work/ from stages.BOUNDED_DEDUP_MIN_DOCS documents (same result);
    # on a cluster, LSH bands are tasks that read the signatures where they lie.
    keep, stats = global_dedup(chunks, config.clean.dedup, spill_dir=work,
                               pool=pool if config.executor == "ray" else None)
    tmp = work / f".keep.{os.getpid()}.tmp.npy"
    np.save(tmp, keep)
    atomic_replace(tmp, keep_path)
    atomic_write_json(stats_path, {"chunks": names, "stats": stats})
    progress.end()
    return keep, stats


def _worker_tokenizer(spec: str) -> Tokenizer:
    """One tokenizer per (worker) process, spec and version of its files (loading GPT-2
    takes ~0.4 s, a chunk less): a tokenizer file edited between two runs of one process,
    or of the workers it forks, is loaded again."""
    return _loaded_tokenizer(spec, tokenizer_version(spec))


@lru_cache(maxsize=2)
def _loaded_tokenizer(spec: str, version: tuple[Any, ...]) -> Tokenizer:
    return load_tokenizer(spec)


def warm_tokenizer(spec: str) -> None:
    """Load a (worker) process's tokenizer and its encoder tables ahead of stage 3."""
    _worker_tokenizer(spec).encode_batch(["warm up"])


def _kept(chunk: str, keep: np.ndarray) -> pa.RecordBatch:
    return pa.ipc.open_file(pa.memory_map(chunk, "r")).get_batch(0).filter(pa.array(keep))


def tokenize_chunk(chunk: str, keep: np.ndarray, shard: str, tokenizer: str,
                   groups: GroupWords | None = None) -> tuple[ShardInfo, dict[str, Any] | None]:
    """Stage 3 for one chunk: tokenize its kept documents (EOD appended) into a shard; with
    ``groups``, also count their group words."""
    tok = _worker_tokenizer(tokenizer)
    batch = _kept(chunk, keep)
    encoded = tok.encode_batch(batch.column("text").to_pylist())
    info = write_shard(Path(shard), encoded.tokens, encoded.lengths, batch.column("id"),
                       batch.column("source"))
    return info, count_groups(batch.column("text"), groups) if groups is not None else None


def _run_tokenize(chunks: list[Path], keep: np.ndarray, writer: ShardSetWriter,
                  config: PrepareConfig, pool: Executor | None,
                  progress: ProgressHook, lists: GroupWords | None) -> list[dict[str, Any]]:
    """Tokenize the kept documents; returns the group counts of each chunk's kept documents
    (of the shards an earlier run finished too: counted here, from their chunks)."""
    sizes = [p.stat().st_size for p in chunks]
    progress.stage(f"tokenize ({config.tokenizer})", sum(sizes) / 1e6, "MB")
    tasks, counts, start = [], [], 0
    for path, size in zip(chunks, sizes, strict=True):
        n = pa.ipc.open_file(pa.memory_map(str(path), "r")).get_batch(0).num_rows
        mask = keep[start : start + n]
        start += n
        name = path.name.replace("clean-", "shard-")
        if mask.any() and not writer.done(name):
            tasks.append((str(path), mask, str(writer.out_dir / name), config.tokenizer, lists,
                          size))
        else:
            if lists is not None and mask.any():
                counts.append(count_groups(_kept(str(path), mask).column("text"), lists))
            progress.advance(size / 1e6)
    results = _run_tasks(tokenize_chunk, [t[:-1] for t in tasks], [t[-1] / 1e6 for t in tasks],
                         pool, progress, on_result=lambda result: writer.record(result[0]))
    progress.end()
    return counts + [c for _, c in results if c is not None]


def prepare(inputs: Sequence[str | Path], output: str | Path,
            config: PrepareConfig = PrepareConfig(),
            progress: ProgressHook | None = None) -> dict[str, Any]:
    """Run the whole pipeline; returns the summary also stored in ``index.json['stats']``."""
    progress = progress or NoProgress()
    output = Path(output)
    files = expand_inputs(inputs)
    lists = load_group_words(config.group_words) if config.group_counts else None
    fingerprint = _fingerprint(files, config)
    _refuse_to_delete_inputs(output, [*inputs, *files], config)  # with or without --overwrite
    if output.exists() and not output.is_dir():
        raise PrepareError(f"--output {output} is a file; name a folder for the dataset")
    refuse_foreign(output)  # with or without --overwrite
    items, unknown = plan_work(files, split_bytes=parallel_split_bytes(
        files, config.clean.ingest.split_bytes))
    if not items:
        named = ", ".join(str(p) for p in unknown[:3]) + (" ..." if len(unknown) > 3 else "")
        known = ", ".join(JSON_EXTS + PARQUET_EXTS + TEXT_EXTS)
        why = (f": {named} end in no known extension ({known}; compressed: "
               f"{', '.join(COMPRESSED)})") if unknown else ""
        raise PrepareError(f"no readable input files among the {len(files)} found in "
                           f"{', '.join(map(str, inputs))}{why}")
    if config.executor == "ray":  # before the output folder is made
        from mt_data.ray_executor import check_ray

        check_ray(config.ray_address)
    output.mkdir(parents=True, exist_ok=True)
    with output_lock(output):
        return _prepare_locked(inputs, files, items, unknown, output, fingerprint, config,
                               progress, lists)


def _prepare_locked(inputs: Sequence[str | Path], files: list[Path], items: list[WorkItem],
                    unknown: list[Path], output: Path, fingerprint: dict[str, Any],
                    config: PrepareConfig, progress: ProgressHook,
                    lists: GroupWords | None) -> dict[str, Any]:
    if (output / INDEX_FILE).exists() and not config.overwrite:
        index = json.loads((output / INDEX_FILE).read_text())
        stats = index.get("stats")
        recorded = stats.get("fingerprint") if isinstance(stats, dict) else None
        if not isinstance(recorded, dict) or not same_run(recorded, fingerprint):
            raise PrepareError(f"{output} already holds a prepared dataset; pass --overwrite")
        check_recorded(recorded, fingerprint, output, finished=True)
        _check_readable(output)
        return dict(index["stats"], resumed="already complete")
    check_output(output, fingerprint, config.overwrite)
    work = output / "work"
    load_eval_index(config.clean, work)  # once, before the workers need it
    workers = config.workers or (os.cpu_count() or 1)
    try:
        with ExitStack() as stack:
            pool = _pool(config, workers, stack)
            summary = _stages(items, unknown, files, fingerprint, output, config, pool, progress,
                              _label(inputs), lists)
    except BrokenProcessPool as exc:
        raise PrepareError(f"{output}: a worker process died ({exc}; killed, or out of "
                           f"memory?); rerun the same command to resume") from None
    except (NoDocumentsError, TextKeyError):
        if not config.keep_work:  # nothing to resume: other settings need no --overwrite
            shutil.rmtree(work)
            with suppress(OSError):
                output.rmdir()  # only when the run created it and left nothing else
        raise
    if not config.keep_work:
        shutil.rmtree(work)
    return summary


def _check_readable(output: Path) -> None:
    """Raise :class:`PrepareError` unless the finished dataset in ``output`` opens: its index
    whole and every shard it records there, of the recorded size (a shard deleted or cut
    since is named)."""
    try:
        dataset = TokenDataset(output)
        for shard in dataset.index["shards"]:
            size = (output / shard["file"]).stat().st_size
            if shard.get("bytes", size) != size:
                raise DatasetError(f"{output / shard['file']}: {size:,} bytes, {INDEX_FILE} "
                                   f"records {shard['bytes']!r}")
    except DatasetError as err:
        raise PrepareError(f"{output} holds a finished dataset that cannot be read ({err}); "
                           "pass --overwrite to prepare it again") from None


def _pool(config: PrepareConfig, workers: int, stack: ExitStack) -> Executor | None:
    """The run's one executor for every parallel stage (worker start-up paid once): a Ray
    cluster's, or local processes, one fewer than ``workers`` since this process runs tasks
    too (see _run_tasks)."""
    if config.executor == "ray":
        from mt_data.ray_executor import RayExecutor

        return stack.enter_context(RayExecutor(config.ray_address))
    if workers > 1:
        return stack.enter_context(ProcessPoolExecutor(workers - 1,
                                                       mp_context=_pool_context()))
    return None


_FORK_UNSAFE = ("torch", "jax", "tensorflow")
"""Modules whose runtimes (OpenMP / CUDA thread pools and state) a forked child may find
broken: with one of them imported, workers are spawned."""


def _pool_context() -> BaseContext:
    """``fork`` when this process runs no other Python thread (a progress display, a user's
    thread: none can be copied holding a lock) and no runtime of ``_FORK_UNSAFE`` is loaded,
    so that workers start at once with this process's imports; else ``spawn``. (The thread
    pools of numpy's BLAS, Arrow and jemalloc are reset in a forked child by their fork
    handlers; Python 3.12+ warns about forking with them anyway: spawn there.)"""
    if ("fork" in get_all_start_methods() and threading.active_count() == 1
            and not any(name in sys.modules for name in _FORK_UNSAFE)
            and sys.version_info < (3, 12)):  # 3.12+ warns about any native thread
        return get_context("fork")
    return get_context("spawn")


def _label(inputs: Sequence[str | Path]) -> str:
    names = [str(p) for p in inputs]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{kind} {n:,}" for kind, n in sorted(counts.items()) if n)


def _check_keys(results: list[dict[str, Any]], key: str) -> None:
    """A file read in byte ranges none of which had the text field: a wrong text key."""
    keyless: dict[str, set[str]] = {}
    for result in results:
        for name, fields in result.get("keyless", {}).items():
            keyless.setdefault(name, set()).update(fields)
    check_text_key({k: sorted(v) for k, v in keyless.items()},
                   {name for result in results for name in result.get("keyed", [])}, key)


def check_documents(totals: ChunkStats, label: str) -> None:
    """Raise :class:`NoDocumentsError` (naming the inputs and why) when no document is left
    after cleaning: a 0-document dataset is never written."""
    if totals.documents_out:
        return
    if totals.documents_in == 0:
        first = f"; first: {totals.error_samples[0]}" if totals.error_samples else ""
        raise NoDocumentsError(f"no documents in {label}: no input line or file holds one "
                               f"(bad inputs: {_counts(totals.errors) or 'none'}{first})")
    raise NoDocumentsError(f"no documents left from {label}: all {totals.documents_in:,} "
                           f"documents read were dropped ({_counts(totals.dropped)})")


def _stages(items: list[WorkItem], unknown: list[Path], files: list[Path],
            fingerprint: dict[str, Any], output: Path, config: PrepareConfig,
            pool: Executor | None, progress: ProgressHook,
            label: str, lists: GroupWords | None) -> dict[str, Any]:
    work = output / "work"
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    results = _run_clean(items, config, work, pool, progress, lists)
    times["clean"] = time.perf_counter() - t0
    _check_keys(results, config.clean.ingest.text_key)
    totals = ChunkStats()
    no_groups = GroupCounter(lists).counts if lists is not None else None
    chunks: list[Path] = []
    for result in results:
        for name in result["chunks"]:
            chunks.append(work / name)
            stats = read_chunk_stats(work / name, totals)
            if lists is not None and not _same_keys(stats.groups, no_groups):
                raise PrepareError(f"{work / name}: holds no group counts of {lists.source} "
                                   "(written by an earlier mt-data?); rerun with --overwrite")
            totals.add(stats)
        totals.add(ChunkStats.from_json(result["tail"]))
    for path in unknown:
        totals.errors["unsupported"] += 1
        totals.error_samples.append(f"{path}:0: unsupported: unknown file type")
    check_documents(totals, label)
    t1 = time.perf_counter()
    if pool is not None:  # the pool's processes load the tokenizer while this one dedups
        for _ in range(max(1, getattr(pool, "_max_workers", 1))):
            pool.submit(warm_tokenizer, config.tokenizer)
    keep, dedup_stats = _run_dedup(chunks, config, work, pool, progress)
    times["dedup"] = time.perf_counter() - t1
    tokenizer = _worker_tokenizer(config.tokenizer)
    writer = ShardSetWriter(output, tokenizer.describe(), tokenizer.dtype.name, resume=True)
    t2 = time.perf_counter()
    kept_groups = _run_tokenize(chunks, keep, writer, config, pool, progress, lists)
    times["tokenize"] = time.perf_counter() - t2
    elapsed = time.perf_counter() - t0
    tokens = sum(s.tokens for s in writer.shards.values())
    summary = {
        "fingerprint": fingerprint,
        "files": len(files),
        "documents_in": totals.documents_in,
        "bytes_in": totals.bytes_in,
        "bad_inputs": dict(totals.errors),
        "bad_input_samples": totals.error_samples,
        "dropped": dict(totals.dropped),
        "after_filters": totals.documents_out,
        **dedup_stats,
        "documents_out": int(keep.sum()),
        "tokens_out": tokens,
        "seconds": {k: round(v, 3) for k, v in times.items()} | {"total": round(elapsed, 3)},
        "mb_per_s": round(totals.bytes_in / 1e6 / max(elapsed, 1e-9), 3),
        "tokens_per_s": round(tokens / max(times["tokenize"], 1e-9)),
    }
    if lists is not None and no_groups is not None:  # the counts of the documents read, kept
        summary["groups"] = write_group_counts(output, lists, totals.groups or no_groups,
                                               merge_counts([no_groups, *kept_groups]))
    check_unchanged(fingerprint)  # what was read is what the fingerprint records
    write_dropped(output, totals)
    writer.finish(summary)
    return summary


def _same_keys(a: Any, b: Any) -> bool:
    """Whether two group counts have the same dimensions, groups and occupations."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_keys(a[k], b[k]) for k in a)
    return isinstance(a, int) and isinstance(b, int)


DROPPED_FILE = "dropped.json"
"""Per rule: its drop count and up to ``SAMPLES_PER_RULE`` dropped documents (``inspect
--dropped``)."""


def write_dropped(output: Path, totals: ChunkStats) -> None:
    """Write ``OUTPUT/dropped.json`` atomically: ``{"rules": {rule: {"dropped": n,
    "samples": [{"id", "source", "chars", "text"}, ...]}}}`` for every counted rule."""
    rules = {rule: {"dropped": count, "samples": totals.dropped_samples.get(rule, [])}
             for rule, count in totals.dropped.items()}
    atomic_write_json(output / DROPPED_FILE, {"rules": rules})


def read_dropped(data: str | Path) -> dict[str, dict[str, Any]]:
    """The rules recorded in ``DATA/dropped.json`` (see :func:`write_dropped`)."""
    path = Path(data) / DROPPED_FILE
    if not path.exists():
        raise PrepareError(f"{data} has no {DROPPED_FILE}: it was prepared before dropped "
                           f"documents were recorded; prepare it again to see them")
    try:
        rules = json.loads(path.read_text(encoding="utf-8"))["rules"]
    except (ValueError, KeyError, TypeError, IndexError, RecursionError) as err:
        raise DatasetError(f"{path}: damaged ({type(err).__name__}: {err}); prepare the "
                           "dataset again") from None
    if not isinstance(rules, dict) or not all(
            isinstance(r, dict) and isinstance(r.get("dropped"), int) for r in rules.values()):
        raise DatasetError(f"{path}: damaged (its rules are not a mapping of rule -> count "
                           "and samples); prepare the dataset again")
    return rules


def select_dropped(rules: dict[str, dict[str, Any]], rule: str) -> dict[str, dict[str, Any]]:
    """The recorded rules matching ``rule``: a rule name (``c4/curly_bracket``, ``too_short``)
    or a rule set (``c4``, ``mt-basic``); ``PrepareError`` lists the recorded ones."""
    chosen = {name: info for name, info in rules.items()
              if name == rule or name.startswith(rule + "/")
              or (rule == "mt-basic" and name in FILTERS)}
    if not chosen:
        raise PrepareError(f"no rule {rule!r} in this dataset's {DROPPED_FILE}; recorded: "
                           f"{', '.join(rules) or 'none'}")
    return chosen


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows describing a prepare summary, for tables and logs."""
    rows = [("files", str(summary["files"])), ("documents in", f"{summary['documents_in']:,}"),
            ("MB in", f"{summary['bytes_in'] / 1e6:,.2f}")]
    for kind, count in sorted(summary["bad_inputs"].items()):
        rows.append((f"bad input: {kind}", f"{count:,}"))
    for name, count in summary["dropped"].items():  # every rule of the rule sets, in order
        rows.append((f"dropped: {name}", f"{count:,}"))
    rows += [
        ("exact duplicates", f"{summary['exact_duplicates']:,}"),
        ("fuzzy duplicates", f"{summary['fuzzy_duplicates']:,}"),
        ("duplicate clusters", f"{summary['fuzzy_clusters']:,}"),
        ("documents out", f"{summary['documents_out']:,}"),
        ("tokens out", f"{summary['tokens_out']:,}"),
        ("seconds", ", ".join(f"{k} {v}" for k, v in summary["seconds"].items())),
        ("throughput", f"{summary['mb_per_s']} MB/s in, {summary['tokens_per_s']:,} tokens/s"),
    ]
    if "groups" in summary:
        rows.append(("group counts", f"{summary['groups']['file']} (inspect --groups)"))
    return rows



def prepare_demo(output: str | Path, tokenizer: str = "tokenizer-1k") -> Path:
    """Prepare the embedded corpus (Moby-Dick + State of the Union) once; returns its folder.

    This is the offline demo dataset of the ``tiny`` preset (vocab 1000 = ``tokenizer-1k``).
    """
    from mt_data.corpus import CORPORA, corpus_path

    output = Path(output)
    if not (output / INDEX_FILE).exists():
        prepare([corpus_path(name) for name in CORPORA], output,
                PrepareConfig(tokenizer=tokenizer, workers=1))
    return output
