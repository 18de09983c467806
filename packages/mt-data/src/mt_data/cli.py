"""``mt data``: prepare, train-tokenizer, export-megatron, import-megatron, inspect.

Every command shows a rich progress bar while it works and ends with a summary table. Every
failure (an mt-data error, a bad value, an OS error) is one ``error: ...`` line on stderr and
exit status 2, never a traceback.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand

from mt_data.badinput import ON_ERROR
from mt_data.decontam import DecontamConfig
from mt_data.dedup import DedupConfig
from mt_data.errors import DataError
from mt_data.filters import FilterConfig
from mt_data.group_counts import group_rows, occupation_rows, read_group_counts
from mt_data.ingest import ErrorLog, IngestConfig, iter_documents
from mt_data.megatron import export_megatron, import_megatron
from mt_data.paths import blocking_file, existing_file, output_clash, unwritable
from mt_data.pipeline import PrepareConfig, prepare, read_dropped, select_dropped, summary_rows
from mt_data.quality import parse_rule_sets
from mt_data.shards import TokenDataset
from mt_data.stages import CleanConfig
from mt_data.tokenizer import TokenizerError, load_tokenizer, recorded_tokenizer, train_tokenizer

#: Below this many columns --help is click's plain layout (see :class:`HelpFitsTerminal`).
NARROW_COLUMNS = 100


class HelpFitsTerminal(TyperCommand):
    """A command whose ``--help`` fits the terminal: rich panels on a wide one; below
    :data:`NARROW_COLUMNS`, click's plain layout, which wraps each flag's help under it and
    never cuts a flag's name (rich's table squeezes the columns and cuts ``--x/--no-x``
    pairs at 80)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        if shutil.get_terminal_size().columns >= NARROW_COLUMNS:
            super().format_help(ctx, formatter)
            return
        mode, self.rich_markup_mode = self.rich_markup_mode, None  # Typer's plain path
        try:
            super().format_help(ctx, formatter)
        finally:
            self.rich_markup_mode = mode


app = typer.Typer(name="data", help="Arrow data pipeline: raw text -> deduplicated, tokenized "
                  "shards -> packed GPT samples; Megatron .bin/.idx interop.",
                  no_args_is_help=True, add_completion=False)
console = Console(stderr=True)


class RichProgress:
    """ProgressHook that draws one rich progress bar per stage.

    The bars are redrawn by the calls themselves (at most every 0.1 s), not by rich's refresh
    thread: a process with a second thread starts its workers with ``spawn`` (forking one
    could copy a lock the thread holds), and fork starts them at once with the CLI's imports.
    """

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task: TaskID | None = None
        self._drawn = 0.0

    def _draw(self, now: bool = False) -> None:
        if now or time.monotonic() - self._drawn >= 0.1:
            self.progress.refresh()
            self._drawn = time.monotonic()

    def stage(self, name: str, total: float | None, unit: str) -> None:
        """Start a bar for a new stage."""
        self.task = self.progress.add_task(name, total=total, unit=unit)
        self._draw(now=True)

    def advance(self, amount: float) -> None:
        """Advance the current bar."""
        if self.task is not None:
            self.progress.advance(self.task, amount)
            self._draw()

    def end(self) -> None:
        """Complete the current bar."""
        if self.task is not None:
            task = self.progress.tasks[-1]
            self.progress.update(self.task, total=task.total or 1,
                                 completed=task.total or 1)
            self.task = None
            self._draw(now=True)


class _AmountColumn(ProgressColumn):
    """``done/total unit``, or nothing for stages of unknown size."""

    def render(self, task: Task) -> Text:
        if task.total is None or not task.fields.get("unit"):
            return Text("")
        return Text(f"{task.completed:,.1f}/{task.total:,.1f} {task.fields['unit']}")


def _progress(refresh_thread: bool = False) -> Progress:
    """The bars of a command; without ``refresh_thread`` they are drawn by
    :class:`RichProgress`'s calls only (no thread: the workers fork)."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), _AmountColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                    auto_refresh=refresh_thread)


def _table(title: str, rows: list[tuple[str, str]]) -> None:
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)


EXIT_ERROR = 2


def _fail(message: str) -> None:
    """Print ``error: MESSAGE`` (one line, no markup) and exit with status 2."""
    console.print(Text.assemble(("error:", "red"), " ", " ".join(message.split())),
                  soft_wrap=True)
    raise typer.Exit(code=EXIT_ERROR)


@contextmanager
def _errors(writing: Path | None = None) -> Iterator[None]:
    """Turn a failure into one ``error: ...`` line and exit status 2; an operating-system
    error that names no file (Arrow's writers raise such) names ``writing``, the output."""
    try:
        yield
    except (DataError, ValueError, OSError) as exc:
        if isinstance(exc, OSError) and not isinstance(exc, DataError) and \
                exc.filename is None and writing is not None:
            _fail(f"{writing}: writing failed: {exc.strerror or exc}")
        _fail(str(exc))


@contextmanager
def _writing(flag: str, path: Path) -> Iterator[None]:
    """Turn an operating-system error while writing ``path`` (given as ``flag``) into one
    ``error: FLAG PATH: writing failed: REASON`` line and exit status 2."""
    try:
        yield
    except OSError as exc:
        _fail(f"{flag} {path}: writing failed: {exc.strerror or exc}")


def _bad_inputs(samples: list[str], total: int) -> None:
    for sample in samples[:10]:
        console.print(Text.assemble(("bad input", "yellow"), " ", sample), soft_wrap=True)
    if total > 10:
        console.print(f"... {total - 10:,} more bad inputs (counted in the summary)",
                      highlight=False)


#: The most worker processes `mt data prepare` starts.
MAX_WORKERS = 1024


def _given(ctx: typer.Context, *names: str) -> list[str]:
    """The options among ``names`` (parameter names) typed on the command line, as flags."""
    return [f"--{name.replace('_', '-')}" for name in names
            if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"]


def _idle_prepare_options(ctx: typer.Context, quality_filters: bool, fuzzy_dedup: bool,
                          decontaminate: list[Path] | None) -> list[str]:
    """Options given that would change nothing."""
    idle = []
    for off, flag, names in (
            (not quality_filters, "with --no-quality-filters",
             ("min_chars", "max_chars", "min_words", "max_symbol_ratio", "min_alpha_words",
              "max_html_ratio", "max_repeated_lines")),
            (not fuzzy_dedup, "with --no-fuzzy-dedup", ("threshold", "num_perm", "bands")),
            (not decontaminate, "without --decontaminate", ("decontam_mode", "decontam_ngram"))):
        if off and (unused := _given(ctx, *names)):
            idle.append(f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} nothing "
                        f"{flag}: leave {'it' if len(unused) == 1 else 'them'} out")
    return idle


def _basic_filters(on: bool, rule_sets: str | None, given: FilterConfig) -> FilterConfig:
    """The mt-basic filters of the flags (``given``), or with --no-quality-filters none of
    them but the normalisation (contradicted by --filters)."""
    if on:
        return given
    if rule_sets is not None:
        raise ValueError(f"--no-quality-filters and --filters {rule_sets} contradict each "
                         "other; give one")
    if given.normalize is None:
        return FilterConfig.disabled()
    return FilterConfig(given.normalize, None, None, None, None, None, None, None)


@app.command("prepare", cls=HelpFitsTerminal)
def prepare_cmd(
    ctx: typer.Context,
    inputs: Annotated[list[Path], typer.Argument(help="JSONL / Parquet / text files or folders "
                                                 "(JSONL and text .gz and .zst read "
                                                 "transparently).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output dataset folder.")],
    text_key: Annotated[str, typer.Option(help="JSON field / Parquet column with the "
                                          "text.")] = "text",
    tokenizer: Annotated[str, typer.Option(help="gpt2, tokenizer-1k, a tokenizer.json, or a "
                                           "folder with vocab.json + merges.txt.")] = "gpt2",
    on_error: Annotated[str, typer.Option(help="Bad input lines: 'skip' (count and report) or "
                                          "'stop'.")] = "skip",
    workers: Annotated[int, typer.Option(
        help="Processes working in parallel, this one included (0 = one per CPU).")] = 0,
    normalize: Annotated[bool, typer.Option(help="Unicode NFC normalisation.")] = True,
    filters: Annotated[str | None, typer.Option(
        "--filters", help="Quality rule sets applied in order, comma-separated: mt-basic, "
        "gopher-quality, gopher-repetition, c4, fineweb (default: mt-basic, the filters below; "
        "the others with datatrove's default thresholds).")] = None,
    quality_filters: Annotated[bool, typer.Option(help="Length/symbol/alpha/HTML/repeated-line "
                                                  "filters (mt-basic).")] = True,
    min_chars: Annotated[int, typer.Option(help="Minimum characters per document.")] = 100,
    max_chars: Annotated[int, typer.Option(help="Maximum characters per document.")] = 5_000_000,
    min_words: Annotated[int, typer.Option(help="Minimum words per document.")] = 20,
    max_symbol_ratio: Annotated[float, typer.Option(help="Max symbols (#, {}, |, ...) per "
                                                    "word.")] = 0.1,
    min_alpha_words: Annotated[float, typer.Option(help="Min fraction of words with a "
                                                   "letter.")] = 0.7,
    max_html_ratio: Annotated[float, typer.Option(help="Max HTML tags per word.")] = 0.02,
    max_repeated_lines: Annotated[float, typer.Option(help="Max fraction of repeated "
                                                      "lines.")] = 0.3,
    exact_dedup: Annotated[bool, typer.Option(help="Drop exact duplicates.")] = True,
    fuzzy_dedup: Annotated[bool, typer.Option(help="Drop near duplicates (MinHash + LSH).")] = True,
    threshold: Annotated[float, typer.Option(help="Jaccard threshold of fuzzy dedup.")] = 0.8,
    num_perm: Annotated[int, typer.Option(help="MinHash permutations.")] = 128,
    bands: Annotated[int, typer.Option(help="LSH bands (num_perm / bands rows each).")] = 16,
    decontaminate: Annotated[list[Path] | None, typer.Option(
        help="Evaluation files/folders: drop/cut documents sharing n-grams with them "
             "(off when not given).")] = None,
    decontam_mode: Annotated[str, typer.Option(help="'drop' or 'cut'.")] = "drop",
    decontam_ngram: Annotated[int, typer.Option(help="Words per decontamination n-gram.")] = 13,
    keep_work: Annotated[bool, typer.Option(help="Keep the intermediate work/ folder.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output folder.")] = False,
    group_counts: Annotated[bool, typer.Option(
        help="Count group words (gender, race, religion, occupations) before and after the "
             "filters: OUTPUT/groups.json, shown by 'mt data inspect DIR --groups'.")] = True,
    group_words: Annotated[Path | None, typer.Option(
        "--group-words", metavar="FILE",
        help="Group-words JSON file to count (default: mt's lists, the schema of "
             "mt_data/assets/group_words.json).")] = None,
    executor: Annotated[str, typer.Option(
        help="Where the tasks run: 'local' (this machine's --workers processes) or 'ray' "
             "(a Ray cluster: needs pip install 'mt-data[ray]' and storage every node sees "
             "for the inputs and --output; the same dataset, byte for byte).")] = "local",
    ray_address: Annotated[str | None, typer.Option(
        help="With --executor ray: 'auto' (the cluster this node is in), HOST:PORT of its "
             "head, or leave out for a Ray started on this machine for the run.")] = None,
) -> None:
    """Run the pipeline: ingest, clean/filter, dedup, decontaminate, tokenize, write shards.

    Rerunning the same command after an interruption resumes at the chunk/shard level.
    """
    if idle := _idle_prepare_options(ctx, quality_filters, fuzzy_dedup, decontaminate):
        _fail("; ".join(idle))
    if workers > MAX_WORKERS:
        _fail(f"--workers must be at most {MAX_WORKERS:,}, got {workers:,}")
    if on_error not in ON_ERROR:
        _fail(f"--on-error must be {' or '.join(ON_ERROR)}, got {on_error!r}")
    if (blocker := blocking_file(output)) is not None:
        _fail(f"--output {output}: {blocker} is a file, not a folder; name a path in a folder")
    with _errors(writing=output):
        basic = _basic_filters(quality_filters, filters, FilterConfig(
            "NFC" if normalize else None, min_chars, max_chars, min_words, max_symbol_ratio,
            min_alpha_words, max_html_ratio, max_repeated_lines))
        clean = CleanConfig(
            ingest=IngestConfig(text_key=text_key),
            filters=basic,
            rule_sets=parse_rule_sets(filters, basic) if filters is not None else None,
            dedup=DedupConfig(exact=exact_dedup, fuzzy=fuzzy_dedup, num_perm=num_perm,
                              bands=bands, threshold=threshold),
            decontam=DecontamConfig(ngram=decontam_ngram, mode=decontam_mode)
            if decontaminate else None,
            eval_paths=tuple(str(p) for p in decontaminate or ()),
            on_error=on_error,
        )
        if group_words is not None and not group_counts:
            raise ValueError("--group-words and --no-group-counts contradict each other; "
                             "give one")
        if executor == "ray" and _given(ctx, "workers"):
            raise ValueError("--workers counts local processes; with --executor ray the "
                             "cluster's CPUs run the tasks: leave out --workers")
        config = PrepareConfig(clean, tokenizer, workers, keep_work, overwrite, group_counts,
                               str(group_words) if group_words is not None else None,
                               executor, ray_address)
        load_tokenizer(tokenizer)  # fail before the long stages
        with _progress() as progress:
            summary = prepare(inputs, output, config, RichProgress(progress))
    _bad_inputs(summary["bad_input_samples"], sum(summary["bad_inputs"].values()))
    _table(f"prepared {output}", summary_rows(summary))


@app.command("train-tokenizer")
def train_tokenizer_cmd(
    inputs: Annotated[list[Path], typer.Argument(help="Text files or folders to train on.")],
    vocab_size: Annotated[int, typer.Option(help="Vocabulary size (EOD token included).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="tokenizer.json to write.")],
    text_key: Annotated[str, typer.Option(help="JSON field / Parquet column with the "
                                          "text.")] = "text",
    min_frequency: Annotated[int, typer.Option(help="Minimum pair frequency to merge.")] = 2,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output file.")] = False,
) -> None:
    """Train a GPT-2 style byte-level BPE tokenizer (EOD token <|endoftext|> = id 0)."""
    clash = output_clash("--output", output, inputs)
    if clash:
        _fail(clash)
    if output.is_dir():
        _fail(f"--output {output} is a folder; name the tokenizer.json to write")
    if (blocker := blocking_file(output)) is not None:
        _fail(f"--output {output}: {blocker} is a file, not a folder; name a path in a folder")
    if why := unwritable("--output", output) or existing_file("--output", output, overwrite):
        _fail(why)
    log = ErrorLog("skip")
    docs, nbytes = 0, 0
    start = time.perf_counter()

    def texts():
        nonlocal docs, nbytes
        for batch in iter_documents(inputs, IngestConfig(text_key=text_key), log):
            for text in batch.column("text").to_pylist():
                docs += 1
                nbytes += len(text)
                yield text

    with _errors(), _progress(refresh_thread=True) as progress:
        task = progress.add_task("train BPE", total=None, unit="")
        tok = train_tokenizer(texts(), vocab_size, min_frequency, name=str(output))
        progress.update(task, total=1, completed=1)
    _bad_inputs([str(e) for e in log.errors], log.total)
    if docs == 0:
        _fail(f"no documents in {', '.join(map(str, inputs))}: nothing to train on "
              f"({log.total:,} bad inputs)")
    with _writing("--output", output):
        output.parent.mkdir(parents=True, exist_ok=True)
        tok.save(output)
    _table(f"tokenizer {output}", [
        ("documents", f"{docs:,}"), ("MB", f"{nbytes / 1e6:,.2f}"),
        ("bad inputs", f"{log.total:,}"), ("vocab size", f"{tok.vocab_size:,}"),
        ("EOD id", str(tok.eod_id)), ("seconds", f"{time.perf_counter() - start:.2f}"),
    ])


@app.command("export-megatron")
def export_megatron_cmd(
    data: Annotated[Path, typer.Argument(help="Prepared dataset folder.")],
    prefix: Annotated[Path, typer.Argument(help="Output prefix: writes PREFIX.bin, PREFIX.idx.")],
    overwrite: Annotated[bool, typer.Option(help="Replace an existing PREFIX.bin / "
                                            "PREFIX.idx.")] = False,
) -> None:
    """Write Megatron-LM MMIDIDX PREFIX.bin / PREFIX.idx (one sequence per document, EOD in)."""
    start = time.perf_counter()
    with _errors(), _progress(refresh_thread=True) as progress:
        task = progress.add_task("export .bin/.idx", total=None, unit="")
        info = export_megatron(data, prefix, overwrite=overwrite)
        progress.update(task, total=1, completed=1)
    seconds = time.perf_counter() - start
    _table(f"exported {prefix}", [
        ("documents", f"{info['documents']:,}"), ("tokens", f"{info['tokens']:,}"),
        ("dtype", info["dtype"]), ("MB", f"{info['bytes'] / 1e6:,.2f}"),
        ("seconds", f"{seconds:.2f}"),
    ])


@app.command("import-megatron")
def import_megatron_cmd(
    prefix: Annotated[Path, typer.Argument(help="Prefix of PREFIX.bin / PREFIX.idx.")],
    output: Annotated[Path, typer.Argument(help="Dataset folder to write.")],
    tokenizer: Annotated[str, typer.Option(help="Tokenizer the ids come from (recorded in the "
                                           "index).")] = "gpt2",
) -> None:
    """Read Megatron-LM .bin/.idx into token shards (each document = its sequences joined)."""
    start = time.perf_counter()
    with _errors(), _progress(refresh_thread=True) as progress:
        task = progress.add_task("import .bin/.idx", total=None, unit="")
        index = import_megatron(prefix, output, load_tokenizer(tokenizer).describe())
        progress.update(task, total=1, completed=1)
    _table(f"imported {output}", [
        ("documents", f"{index['documents']:,}"), ("tokens", f"{index['tokens']:,}"),
        ("shards", str(len(index["shards"]))), ("dtype", index["dtype"]),
        ("max token id", f"{index['max_token_id']:,}"),
        ("seconds", f"{time.perf_counter() - start:.2f}"),
    ])


@app.command("inspect")
def inspect_cmd(
    ctx: typer.Context,
    data: Annotated[Path, typer.Argument(help="Prepared dataset folder.")],
    document: Annotated[int, typer.Option(help="Document to decode as a sample.")] = 0,
    chars: Annotated[int, typer.Option(help="Characters of the sample to print.")] = 500,
    verify: Annotated[bool, typer.Option(help="Check shard (and groups.json) SHA-256 checksums "
                                          "and the largest token id against the shards.")] = False,
    dropped: Annotated[str | None, typer.Option(
        help="Show the documents recorded as dropped by this rule (e.g. c4/curly_bracket, "
             "too_short) or by every rule of a rule set (e.g. gopher-quality), instead of a "
             "decoded document.")] = None,
    groups: Annotated[bool, typer.Option(
        "--groups", help="Show the group-word counts (mentions and documents per group, "
        "occupations with the gender words after them) before and after the filters, instead "
        "of a decoded document.")] = False,
) -> None:
    """Print documents, tokens, sources and a decoded sample of a prepared dataset (or what its
    filters dropped, --dropped, or the group words it carries, --groups)."""
    if chars < 0:
        _fail(f"--chars must be 0 or more, got {chars}")
    if (dropped is not None or groups) and _given(ctx, "document"):
        _fail(f"--document {document} is the decoded document, which "
              f"{'--groups' if groups else '--dropped'} shows instead; give one of them")
    with _errors():
        ds = TokenDataset(data)
    if not 0 <= document < max(len(ds), 1):
        _fail(f"--document {document}: {data} holds documents 0 to {len(ds) - 1}")
    with _errors():
        max_id = ds.max_token_id
        chosen = select_dropped(read_dropped(data), dropped) if dropped is not None else None
        carried = read_group_counts(data) if groups else None
    rows = [("documents", f"{len(ds):,}"), ("tokens", f"{ds.num_tokens:,}"),
            ("shards", str(len(ds.index["shards"]))), ("dtype", ds.index["dtype"]),
            ("max token id", f"{max_id:,}"),
            ("tokenizer", f"{ds.tokenizer['name']} (vocab "
                          f"{_count(ds.tokenizer.get('vocab_size'))}, EOD "
                          f"{ds.tokenizer.get('eod_id', 'unknown')})")]
    for name, counts in sorted(ds.index["sources"].items()):
        rows.append((f"source {name}", f"{counts['documents']:,} docs, "
                                       f"{counts['tokens']:,} tokens"))
    bad: list[str] = []
    if verify:
        with _errors(), _progress(refresh_thread=True) as progress:
            task = progress.add_task("verify checksums", total=None, unit="")
            bad = ds.verify()
            if not bad:
                ds.verify_max_token_id()
            if not bad and (ds.index.get("stats") or {}).get("groups"):
                read_group_counts(data)  # its SHA-256 against index.json's record
            progress.update(task, total=1, completed=1)
        rows.append(("checksums", "ok" if not bad else f"MISMATCH: {', '.join(bad)}"))
    _table(f"dataset {data}", rows)
    if bad:
        _fail(f"{data}: checksum mismatch in {', '.join(bad)}")
    if chosen is not None:
        _show_dropped(chosen, chars)
    if carried is not None:
        _show_groups(carried)
    if chosen is not None or carried is not None:
        return
    if len(ds) and 0 <= document < len(ds):
        doc_id, source = ds.metadata(document)
        try:
            text = recorded_tokenizer(ds.tokenizer, str(data)).decode(ds.document(document))
        except TokenizerError as err:  # the ids are still worth seeing: said why
            console.print(Text.assemble(("warning:", "yellow"), " ", " ".join(
                f"{err}; token ids shown".split())), soft_wrap=True)
            text = " ".join(str(t) for t in ds.document(document)[:200])
        Console().print(f"[bold]document {document}[/bold] ({doc_id}, {source}, "
                        f"{len(ds.document(document))} tokens):")
        Console().print(text[:chars], markup=False, highlight=False)


def _count(value: int | None) -> str:
    """``value`` with thousands separators, or "unknown" (an imported dataset may not record
    its tokenizer's size)."""
    return "unknown" if value is None else f"{value:,}"


def _show_dropped(rules: dict[str, dict], chars: int) -> None:
    """Each rule's drop count and its recorded examples (the text as the rule saw it)."""
    out = Console()
    for rule, info in rules.items():
        samples = info["samples"]
        out.print(f"[bold]{rule}[/bold]: {info['dropped']:,} dropped"
                  + (f", {len(samples)} shown" if samples else ""), highlight=False)
        for sample in samples:
            out.print(f"[bold]{sample['id']}[/bold] ({sample['source']}, {sample['chars']:,} "
                      f"chars):", highlight=False)
            out.print(sample["text"][:chars], markup=False, highlight=False)
            out.print()


def _show_groups(counts: dict[str, Any]) -> None:
    """The group table and the occupation table of ``groups.json``."""
    out = Console()
    source = counts["group_words"]
    out.print(f"group words: {source['path']} (sha256 {source['sha256'][:12]}); before: the "
              "documents read, after: those kept", highlight=False)
    table = Table(title="groups: mentions and documents, before and after the filters")
    for name in ("dimension", "group"):
        table.add_column(name, style="bold")
    for name in ("mentions before", "after", "change", "documents before", "after", "change"):
        table.add_column(name, justify="right")
    for row in group_rows(counts):
        table.add_row(*row)
    out.print(table)
    header, rows, unmentioned = occupation_rows(counts)
    if rows:
        table = Table(title="occupations: mentions, and the gender word after each in its "
                      "sentence")
        table.add_column(header[0], style="bold")
        for name in header[1:]:
            table.add_column(name, justify="right")
        for row in rows:
            table.add_row(*row)
        out.print(table)
    if unmentioned:
        out.print(f"never mentioned ({len(unmentioned)}): {', '.join(unmentioned)}",
                  highlight=False)


def main() -> None:
    """Entry point for ``python -m mt_data.cli``."""
    app()


if __name__ == "__main__":
    main()
