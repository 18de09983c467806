"""What the inference commands share on the command line: CHECKPOINT and the options that
place it on processes (declared once, here: :func:`with_placement`), and how they end on an
error (mt-dist's rule: one line, exit 2 for bad input, 1 for a failed rank, 130 when
interrupted). No torch at import: `mt --help` starts without it."""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from mt_inference.placement import Placement

__all__ = ["command_app", "errors", "fail", "sampling_flags", "with_placement"]

_PLACEMENT = "Placement"
_OPTIONS: dict[str, tuple[Any, Any]] = {
    "tokenizer": (Annotated[str | None, typer.Option(
        help="Tokenizer (gpt2, tokenizer-1k, a tokenizer.json or a folder) instead of the "
        "checkpoint's.", rich_help_panel=_PLACEMENT)], None),
    "tp": (Annotated[int, typer.Option(help="Tensor-parallel degree.",
                                       rich_help_panel=_PLACEMENT)], 1),
    "pp": (Annotated[int, typer.Option(help="Pipeline-parallel degree.",
                                       rich_help_panel=_PLACEMENT)], 1),
    "nproc": (Annotated[int, typer.Option(
        help="Local processes (without a launcher); dp = nproc / (tp x pp).",
        rich_help_panel=_PLACEMENT)], 1),
    "device": (Annotated[str, typer.Option(help="auto, cpu or cuda.",
                                           rich_help_panel=_PLACEMENT)], "auto"),
    "precision": (Annotated[str, typer.Option(help="fp32, bf16 or fp16 weights.",
                                              rich_help_panel=_PLACEMENT)], "fp32"),
    "timeout": (Annotated[float, typer.Option(
        help="Seconds a collective waits for the other ranks.",
        rich_help_panel=_PLACEMENT)], 600.0),
}
_CHECKPOINT = Annotated[str, typer.Argument(
    metavar="CHECKPOINT", help="mt pretrain checkpoint (any layout), or a folder mt convert "
    "reads (e.g. Hugging Face).")]


def with_placement(command: Callable[..., None]) -> Callable[..., None]:
    """The Typer command of ``command(placement, **options)``: CHECKPOINT first, then
    ``command``'s own options, then the placement options; it is called with the
    :class:`~mt_inference.placement.Placement` they make."""
    hints = typing.get_type_hints(command, include_extras=True)
    own = [p.replace(annotation=hints[p.name], kind=inspect.Parameter.KEYWORD_ONLY)
           for p in inspect.signature(command).parameters.values() if p.name != "placement"]
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("checkpoint", keyword, annotation=_CHECKPOINT), *own,
              *(inspect.Parameter(name, keyword, annotation=kind, default=default)
                for name, (kind, default) in _OPTIONS.items())]

    def run(**kwargs: Any) -> None:
        placement = Placement(kwargs.pop("checkpoint"),
                              **{name: kwargs.pop(name) for name in _OPTIONS})
        command(placement, **kwargs)

    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params}
    run.__doc__, run.__name__ = command.__doc__, command.__name__
    return run


#: mt-model's ``Sampling`` fields, as the options of `mt generate` and `mt bias` spell them.
_SAMPLING_FIELDS = re.compile(r"\b(max_new_tokens|temperature|top_k|top_p|seed)\b")


def sampling_flags(message: str) -> str:
    """A ``Sampling`` error with its field names as the command line's flags (``top_k`` ->
    ``--top-k``)."""
    return _SAMPLING_FIELDS.sub(lambda m: "--" + m.group(1).replace("_", "-"), message)


def _say(console: Console) -> Callable[[str], None]:
    def say(line: str) -> None:
        head, _, rest = line.partition(" ")
        console.print(f"[bold red]{head}[/] {escape(rest)}", highlight=False, soft_wrap=True)
    return say


def fail(console: Console, problems: list[str] | str) -> NoReturn:
    """``error: PROBLEMS`` (joined by "; ") on ``console``, exit 2 (bad input)."""
    from mt_dist.exits import BAD_INPUT

    text = problems if isinstance(problems, str) else "; ".join(problems)
    _say(console)(f"error: {text}")
    raise typer.Exit(BAD_INPUT)


@contextmanager
def errors(console: Console) -> Iterator[None]:
    """What the work inside raises ends the command by mt-dist's rule, one line on
    ``console``; a bug keeps its traceback."""
    from mt_checkpoint import CheckpointError
    from mt_data import DataError
    from mt_dist.exits import one_line_errors
    from mt_eval import TaskError

    with one_line_errors(expected=(CheckpointError, DataError, TaskError), say=_say(console)):
        yield


def command_app(command: Callable[..., None], help_text: str) -> typer.Typer:
    """A Typer app whose callback is ``command`` with the placement options (see
    :func:`with_placement`): `mt` mounts it by its ``mt.commands`` entry point, and
    ``python -m mt_inference`` by name."""
    app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False)
    app.callback(invoke_without_command=True, subcommand_metavar="", help=help_text,
                 context_settings={"max_content_width": 110, "allow_interspersed_args": True}
                 )(with_placement(command))
    return app
