"""``mt convert SRC DST``: the command line of mt_formats.

``app`` is a Typer app whose callback is the command itself, so it works both standalone
(``python -m mt_convert SRC DST``) and mounted by the root ``mt`` CLI through the
``mt.commands`` entry point (``app.add_typer(app, name="convert")``) without an extra
sub-command name. Expected failures print one ``error:`` line and exit with status 1.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from mt_formats.errors import ConvertError, WriteFailed

__all__ = ["app", "main"]


class Format(StrEnum):
    """Checkpoint formats on the command line."""

    consolidated = "consolidated"
    hf = "hf"
    tp = "tp"
    megatron = "megatron"
    pretrain = "pretrain"
    dcp = "dcp"
    mcore = "mcore"
    gguf = "gguf"
    deepspeed = "deepspeed"


app = typer.Typer(
    name="convert",
    help="Convert GPT checkpoints between formats and layouts.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


Layout = tuple[int | None, int | None, int | None]
"""(tp, pp, pad_multiple) options."""


def _dry_run(src: Path, dst: Path, to: str, from_format: str | None, layout: Layout,
             console: Console, model: str | None = None, gguf_type: str | None = None,
             drop_optimizer: bool = False) -> None:
    from mt_formats.convert import make_writer, open_checkpoint, plan_conversion

    with open_checkpoint(src, from_format, model) as reader:
        specs = {name: reader.spec(name) for name in reader.names()}
        writer = make_writer(to, reader.config, specs, *layout, gguf_type)
        if writer.holds_optimizer_state and not drop_optimizer:
            reader.check_optimizer_files()
        entries = plan_conversion(reader, writer)
        size = sum(spec.nbytes for spec in specs.values())
        # Plain lines, not a table: greppable and never folded by the terminal width.
        lines = [f"{src} ({reader.format}) -> {dst} ({writer.format}): {len(entries)} "
                 f"tensors, {size / 2**20:.1f} MiB (dry run: nothing written)"]
        progress = reader.progress()
        if progress is not None:  # what travels with Adam's state (mt_formats' READMEs)
            tokens = "" if progress.tokens is None else f", {progress.tokens:,} tokens"
            lines.append(f"the source's training: step {progress.step}{tokens}")
        for entry in entries:
            lines.append(entry.name)
            lines.extend(f"  <- {ref.describe()}" for ref in entry.sources)
            lines.extend(f"  -> {ref.describe()}" for ref in entry.targets)
        console.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so that the staging folder is
    removed rather than left beside the destination (in the main thread; elsewhere a signal
    handler cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _convert(src: Path, dst: Path, to: str, from_format: str | None, layout: Layout,
             force: bool, console: Console, model: str | None = None,
             optimizer: dict[str, Any] | None = None, tokenizer: str | None = None,
             gguf_type: str | None = None) -> None:
    from mt_formats.convert import convert_checkpoint

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.fields[tensor]}"))
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("converting", total=None, tensor="")

        def progress(name: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, tensor=name)

        tp, pp, pad_multiple = layout
        result = convert_checkpoint(src, dst, to=to, from_format=from_format, tp=tp, pp=pp,
                                    pad_multiple=pad_multiple, overwrite=force,
                                    progress=progress, model=model, tokenizer=tokenizer,
                                    gguf_type=gguf_type, **(optimizer or {}))
    console.print(f"wrote {result.destination} ({result.target_format}): {result.tensors} "
                  f"tensors, {result.bytes / 2**20:.1f} MiB in {result.seconds:.1f} s",
                  markup=False, highlight=False, soft_wrap=True)
    for note in result.notes:
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    if to == "hf" and not (dst / "tokenizer.json").exists():
        console.print("note: no tokenizer written; pass --tokenizer "
                      "so that transformers and lm-eval load the folder unaided",
                      markup=False, highlight=False, soft_wrap=True)
    if to == "gguf" and result.tokenizer is None:
        console.print("note: no tokenizer written; llama.cpp needs "
                      "one: pass --tokenizer", markup=False, highlight=False, soft_wrap=True)


@app.callback(invoke_without_command=True, subcommand_metavar="",
              context_settings={"allow_interspersed_args": True})
def convert(
    src: Annotated[Path, typer.Argument(help="Source checkpoint directory.")],
    dst: Annotated[Path, typer.Argument(help="Destination directory (must not exist unless "
                                             "--force).")],
    to: Annotated[Format | None, typer.Option(
        "--to", help="Target format (default: pretrain for an mt pretrain source with "
        "--tp/--pp/--dp/--zero-stage, tp when --tp or --pp is given, else consolidated); "
        "deepspeed is read-only.")] = None,
    from_format: Annotated[Format | None, typer.Option(
        "--from", help="Source format (default: detected from config.json).")] = None,
    tp: Annotated[int | None, typer.Option(
        "--tp", min=1, help="Tensor-parallel degree of the tp / megatron target.")] = None,
    pp: Annotated[int | None, typer.Option(
        "--pp", min=1, help="Pipeline stages of the tp / megatron target (uniform layer "
        "split).")] = None,
    pad_multiple: Annotated[int | None, typer.Option(
        "--pad-multiple", min=1, help="Pad the vocabulary to a multiple of this x tp "
        "(tp / megatron target; default 128).")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the mapping of source tensors to target tensors and write "
        "nothing.")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace an existing destination (only once the new one is "
        "complete).")] = False,
    model: Annotated[str | None, typer.Option(
        "--model", help="deepspeed, dcp or mcore source (they may record no model config): "
        "model preset or JSON file of GPTConfig fields (sizes are read from the tensors).")
    ] = None,
    dp: Annotated[int | None, typer.Option(
        "--dp", min=1, help="Data-parallel degree of the pretrain target (pretrain source; "
        "default: the source's).")] = None,
    zero_stage: Annotated[int | None, typer.Option(
        "--zero-stage", min=0, max=3, help="ZeRO stage of the pretrain target (pretrain "
        "source; default: the source's).")] = None,
    drop_optimizer: Annotated[bool, typer.Option(
        "--drop-optimizer", help="pretrain, dcp or mcore target: write the weights alone (a "
        "fresh optimizer, no Adam moments) instead of carrying the source's (an mt pretrain "
        "checkpoint, a DeepSpeed universal one, a DCP folder with torch's optimizer "
        "state, a Megatron-core one with its distributed optimizer's state, Megatron-LM's "
        "per-rank files with their distrib_optim.pt).")] = False,
    tokenizer: Annotated[str | None, typer.Option(
        "--tokenizer", help="hf or gguf target: the tokenizer to write beside the weights (gpt2, "
        "tokenizer-1k, a tokenizer.json or a folder; default: the one an mt pretrain source "
        "trained with).")] = None,
    gguf_type: Annotated[str | None, typer.Option(
        "--gguf-type", help="gguf target: how matrices are stored: f32, f16 (default), bf16 "
        "or q8_0 (norms and biases stay f32).")] = None,
) -> None:
    """Convert a GPT checkpoint: mt consolidated, mt sharded (TP x PP), Hugging Face
    GPT-2 or Llama, Megatron-LM, Megatron-core torch_dist, an mt pretrain checkpoint, torch
    DCP (torchtitan's Llama, transformers' GPT-2) or (read only) a DeepSpeed universal
    checkpoint, tensor by tensor,
    verified, written atomically."""
    sharded = tp is not None or pp is not None
    target = to.value if to is not None else ("tp" if sharded else "consolidated")
    optimizer = {"dp": dp, "zero_stage": zero_stage, "drop_optimizer": drop_optimizer}
    layout = (tp, pp, pad_multiple)
    source = from_format.value if from_format is not None else None
    console = Console(stderr=True)
    # Imported here: the format library needs torch (seconds), `mt --help` does not.
    from mt_formats.convert import check_options, check_paths, detect_format
    from mt_formats.pretrain_relayout import PretrainTarget, describe_pretrain

    try:
        if to is None and (sharded or dp is not None or zero_stage is not None) and (
                source or detect_format(src)) == "pretrain":
            target = "pretrain"  # between mt pretrain layouts: keep the optimizer state
        if dry_run:  # what the conversion would refuse, the dry run says
            check_paths(src, dst, force)
            check_options(src, target, source, pad_multiple=pad_multiple, dp=dp,
                          zero_stage=zero_stage, drop_optimizer=drop_optimizer, model=model,
                          tokenizer=tokenizer, gguf_type=gguf_type)
        if dry_run and target == "pretrain" and (source or detect_format(src)) == "pretrain":
            lines = describe_pretrain(src, PretrainTarget(tp, pp, dp, zero_stage,
                                                          drop_optimizer))
            Console().print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)
        elif dry_run:
            _dry_run(src, dst, target, source, layout, Console(), model, gguf_type,
                     drop_optimizer)
        else:
            with _sigterm_interrupts():
                _convert(src, dst, target, source, layout, force, console, model, optimizer,
                         tokenizer, gguf_type)
    except ConvertError as err:  # bad input exits 2, a failed write 1 (as mt pretrain)
        console.print(f"[bold red]error:[/] {escape(str(err))}", highlight=False,
                      soft_wrap=True)
        raise typer.Exit(1 if isinstance(err, WriteFailed) else 2) from None
    except KeyboardInterrupt:
        console.print("interrupted: nothing was written")
        raise typer.Exit(130) from None
    except (MemoryError, RuntimeError) as err:  # the machine's limits, not the input
        if isinstance(err, RuntimeError) and "can't start new thread" not in str(err):
            raise
        console.print(f"[bold red]error:[/] {escape(str(src))}: converting it needs more memory "
                      "or threads than this process may have (memory, `ulimit -v` or `ulimit "
                      f"-u`): {type(err).__name__}: {escape(str(err) or 'allocation refused')}; "
                      "nothing was written", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def main() -> None:
    """Console entry point (``python -m mt_convert``)."""
    app()
