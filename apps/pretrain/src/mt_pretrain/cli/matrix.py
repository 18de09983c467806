"""`mt matrix`: train parallel layouts against one process and print how close they came."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mt_data.paths import existing_file, unwritable
from mt_zero.precision import PRECISIONS

__all__ = ["matrix", "markdown_table"]

_HELP = (
    "Check the correctness contract on this machine: train parallel layouts of the tiny GPT "
    "(up to 8 local processes, gloo) and the run each must equal (one process in the same "
    "precision; with dropout, the same TP degree), then compare every step's loss, gradient "
    "norm and learning rate, the validation loss and every final parameter.\n\n"
    "--set ci is the pairwise cover CI runs (every pair of feature values at least once); "
    "--set full adds every (TP, PP, DP, ZeRO, schedule) layout and every feature on every "
    "grid; --set all is every valid combination. Exit status 1 if any case fails."
)


def _fail(console: Console, message: str) -> typer.Exit:
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(2)


def _cases(which: str, only: list[str], console: Console) -> list:
    from mt_pretrain.contract.matrix import candidates, ci_matrix, full_matrix

    sets = {"ci": ci_matrix, "full": full_matrix, "all": candidates}
    if which not in sets:
        raise typer.BadParameter(f"--set must be one of {sorted(sets)}, got {which!r}")
    cases = sets[which]()
    kept = [c for c in cases if all(word in c.name for word in only)]
    if not kept:
        given = " ".join(f"--only {word!r}" for word in only)
        raise _fail(console, f"{given} matches none of the {len(cases)} cases of --set "
                    f"{which}; `mt matrix --set {which} --list` names them")
    return kept


def _row(outcome) -> list[str]:  # noqa: ANN001 - an Outcome
    d, tol = outcome.diff, outcome.tolerance
    if d is None:
        return [outcome.case.name, str(outcome.case.nproc), "-", "-", "-", "-",
                f"{outcome.seconds:.1f}", f"FAIL: {outcome.error}"]
    verdict = "pass" if outcome.passed else "FAIL"
    if outcome.fp32_gap is not None and outcome.fp32_gap <= 1e-5:
        verdict += " (equals fp32)"
    return [outcome.case.name, str(outcome.case.nproc), str(d.steps),
            f"{d.loss:.1e} / {tol.loss:.0e}", f"{d.grad_norm:.1e} / {tol.grad_norm:.0e}",
            f"{d.params:.1e} / {tol.params:.0e}", f"{outcome.seconds:.1f}", verdict]


_COLUMNS = ["layout", "procs", "steps", "loss", "grad norm", "params", "s", "result"]


def markdown_table(outcomes: list) -> str:
    """The outcomes as a Markdown table (worst difference / tolerance per column)."""
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(_row(o)) + " |" for o in outcomes]
    return "\n".join(lines) + "\n"


def _floor(steps: int, console: Console) -> None:
    from mt_pretrain.contract.runner import cpu_isa, noise_floor

    console.print(f"measured on: {cpu_isa()}", highlight=False)
    for precision in (p.name for p in PRECISIONS.values() if p.bytes == 2):  # 16-bit
        for name, d in noise_floor(precision, steps).items():
            console.print(f"{precision} {name:>8}: loss {d.loss:.2e}  grad norm "
                          f"{d.grad_norm:.2e}  params {d.params:.2e}", highlight=False)


#: The flags of `mt matrix` by parameter name, and those --noise-floor and --list leave unused.
_FLAGS = {"which": "--set", "only": "--only", "markdown": "--markdown", "work_dir": "--work-dir",
          "list_only": "--list", "steps": "--steps", "overwrite": "--overwrite"}
_UNUSED = {"--noise-floor measures the noise floors only": ("which", "only", "markdown",
                                                            "overwrite", "work_dir", "list_only"),
           "--list names the cases only": ("markdown", "overwrite", "work_dir", "steps")}


def _check_markdown(markdown: Path | None, overwrite: bool) -> str | None:
    """Why the --markdown file cannot be written (before any case runs), or None."""
    if markdown is None:
        return ("--overwrite replaces the --markdown file: give --markdown too, or leave "
                "--overwrite out") if overwrite else None
    return unwritable("--markdown", markdown) or existing_file("--markdown", markdown, overwrite)


def _check_work_dir(work_dir: Path | None) -> str | None:
    """Why the runs cannot go in --work-dir (before any case runs), or None."""
    if work_dir is None:
        return None
    if work_dir.exists() and not work_dir.is_dir():
        return f"--work-dir {work_dir} is not a folder; name a folder for the runs"
    return unwritable("--work-dir", work_dir, folder=True)


def _write_markdown(markdown: Path, outcomes: list, errors: Console) -> None:
    """Write the Markdown table atomically (a temporary file beside it, then a rename),
    creating the folders missing on the way."""
    from mt_data.shards import removed_on_failure

    try:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        with removed_on_failure(markdown.with_name(f".{markdown.name}.tmp")) as tmp:
            tmp.write_text(markdown_table(outcomes), encoding="utf-8")
            os.replace(tmp, markdown)
    except OSError as err:  # e.g. a full disk, or the folder changed since it was checked
        raise _fail(errors, f"--markdown {markdown}: writing failed: {err.strerror or err}"
                    ) from None


def _idle_flags(ctx: typer.Context, floor: bool, list_only: bool) -> str | None:
    """Flags given with --noise-floor or --list that they would not use."""
    if not (floor or list_only):
        return None
    mode = list(_UNUSED)[0 if floor else 1]
    idle = [_FLAGS[name] for name in _UNUSED[mode]
            if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"]
    if not idle:
        return None
    return (f"{mode}: {', '.join(idle)} would do nothing; leave "
            f"{'it' if len(idle) == 1 else 'them'} out")


def matrix(
    ctx: typer.Context,
    which: Annotated[str, typer.Option("--set", help="ci, full or all.")] = "ci",
    only: Annotated[list[str], typer.Option(
        "--only", help="Keep cases whose name holds this text (repeatable: all must match), "
        "e.g. --only tp2 --only bf16.")] = [],  # noqa: B006 - Typer reads the default
    steps: Annotated[int, typer.Option(help="Optimizer steps per run.")] = 10,
    list_only: Annotated[bool, typer.Option("--list", help="Print the cases and exit.")] = False,
    markdown: Annotated[Path | None, typer.Option(
        help="Also write the table as Markdown to this file.")] = None,
    overwrite: Annotated[bool, typer.Option(
        help="Replace an existing --markdown file.")] = False,
    floor: Annotated[bool, typer.Option(
        "--noise-floor", help="Measure the bf16 and fp16 noise floors the tolerances are "
        "derived from (every run measures them again: they depend on the CPU's instruction "
        "set), and exit.")] = False,
    work_dir: Annotated[Path | None, typer.Option(
        help="Keep the runs' folders here (default: a temporary folder).")] = None,
) -> None:
    """Train layouts against the run they must equal; print the differences."""
    from mt_pretrain.contract.runner import cpu_isa, run_matrix

    console = Console(soft_wrap=True)
    if not console.is_terminal:
        console.width = max(console.width, 150)  # the table's columns, whole, in a log
    errors = Console(stderr=True, soft_wrap=True)
    if steps < 1:
        raise _fail(errors, f"--steps must be a positive integer, got {steps}")
    if steps >= 2**63:
        raise _fail(errors, f"--steps must be below 2**63, got {steps}")
    if "" in only:
        raise _fail(errors, "--only is empty: give text of the case names to keep")
    if (idle := _idle_flags(ctx, floor, list_only)) is not None:
        raise _fail(errors, idle)
    if floor:
        _floor(steps, console)
        return
    if not list_only and (why := _check_markdown(markdown, overwrite) or
                          _check_work_dir(work_dir)):
        raise _fail(errors, why)
    cases = _cases(which, only, errors)
    if list_only:
        for case in cases:
            console.print(f"{case.name:<44} {case.nproc} procs, reference: "
                          f"{case.reference().name}", highlight=False)
        console.print(f"{len(cases)} cases", highlight=False)
        return
    console.print(f"{len(cases)} cases, {steps} steps each; 16-bit noise floors measured "
                  f"on {cpu_isa()}", highlight=False)
    outcomes = run_matrix(cases, steps, work_dir,
                          lambda o: console.print("  ".join(_row(o)), highlight=False))
    table = Table(*_COLUMNS, title=f"mt matrix --set {which}: worst difference / tolerance")
    for outcome in outcomes:
        table.add_row(*_row(outcome))
    console.print(table)
    failed = [o for o in outcomes if not o.passed]
    console.print(f"{len(outcomes) - len(failed)} of {len(outcomes)} cases pass; "
                  f"{sum(o.seconds for o in outcomes):.0f} s of runs", highlight=False)
    if markdown is not None:
        _write_markdown(markdown, outcomes, errors)
    if failed:
        raise typer.Exit(1)



