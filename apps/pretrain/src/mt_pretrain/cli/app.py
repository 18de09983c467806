"""The root `mt` command line.

Subcommands live with what they drive: `mt data` comes from mt-data, `mt pretrain`, `mt plan`,
`mt matrix` and `mt plot` from this app. Others plug in through the `mt.commands` entry-point
group (mt-inference registers `mt eval`, `mt generate`, `mt serve` and `mt bias` there,
apps/convert `mt convert`), so no app imports another.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import importlib.util
from pathlib import Path
from typing import Annotated, Any

import typer

from mt_data.cli import HelpFitsTerminal
from mt_data.cli import app as data_app
from mt_pretrain.cli.matrix import _HELP as _MATRIX_HELP
from mt_pretrain.cli.matrix import matrix
from mt_pretrain.cli.options import with_config_options
from mt_pretrain.cli.plan import _HELP as _PLAN_HELP
from mt_pretrain.cli.plan import plan

#: Every distribution of the mt monorepo, with its import name.
DISTRIBUTIONS: dict[str, str] = {
    "mt-dist": "mt_dist",
    "mt-tensor-parallel": "mt_tensor_parallel",
    "mt-pipeline": "mt_pipeline",
    "mt-zero": "mt_zero",
    "mt-checkpoint": "mt_checkpoint",
    "mt-plan": "mt_plan",
    "mt-eval": "mt_eval",
    "mt-data": "mt_data",
    "mt-model": "mt_model",
    "mt-formats": "mt_formats",
    "mt-inference": "mt_inference",
    "mt-pretrain": "mt_pretrain",
    "mt-convert": "mt_convert",
}

app = typer.Typer(
    name="mt",
    help="mt: train GPT models with tensor, pipeline and data parallelism (MT-NLG style).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def package_versions() -> dict[str, str]:
    """Version of each mt distribution: installed metadata first, else the source tree's."""
    versions = {}
    for dist, module in DISTRIBUTIONS.items():
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = _source_version(module)
    return versions


def _source_version(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return "not installed"
    # Read __version__ without importing the package (importing pulls torch: seconds).
    for line in open(spec.origin, encoding="utf-8"):
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip("\"'") + " (source)"
    return "unknown (source)"


def _version_callback(value: bool) -> None:
    if value:
        for dist, version in package_versions().items():
            typer.echo(f"{dist:<20} {version}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True,
        help="Print the version of every mt package and exit.",
    ),
) -> None:
    """mt: train GPT models with tensor, pipeline and data parallelism (MT-NLG style)."""


def _pretrain(config_path: Path | None, overrides: dict[str, Any]) -> None:
    """Pretrain a GPT with tensor, pipeline and data parallelism (ZeRO)."""
    from mt_pretrain.cli.pretrain import pretrain_main

    raise typer.Exit(pretrain_main(config_path, overrides))


_PRETRAIN_HELP = (
    "Pretrain a GPT with tensor, pipeline and data parallelism (ZeRO).\n\n"
    "With no model, layout, training or data flag: the 3D demo (the shipped config "
    "demo-3d.yaml: the tiny preset on the embedded corpus, TP 2 x PP 2 x DP 2 on 8 local "
    "processes, a few minutes on a laptop CPU; output flags such as --dry-run or --overwrite "
    "apply to it). Otherwise every degree defaults to 1 and data parallelism takes the "
    "processes left: `mt pretrain --nproc 2` trains DP 2. Under torchrun, mpirun or srun "
    "each process is one rank. Flags override the YAML file given with --config."
)

app.command(
    "pretrain",
    help=_PRETRAIN_HELP,
    cls=HelpFitsTerminal,
    context_settings={"max_content_width": 110},
)(with_config_options(_pretrain))


@app.command("plot")
def plot(
    metrics: Annotated[list[Path], typer.Argument(
        exists=True, dir_okay=False, help="Metrics JSONL file(s) written by mt pretrain.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="PNG to write.")] = Path(
        "loss.png"),
    key: Annotated[str, typer.Option(help="Metric to plot (loss, lr, tokens_per_s, ...).")] = (
        "loss"),
    x: Annotated[str, typer.Option(help="Horizontal axis: step or tokens.")] = "step",
    log_y: Annotated[bool, typer.Option("--log-y", help="Logarithmic vertical axis.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output file.")] = False,
) -> None:
    """Draw a metric (default: the loss curve) of one or more runs to a PNG."""
    from mt_pretrain.cli.plot import plot_metrics

    try:
        path = plot_metrics(metrics, output, key=key, x=x, log_y=log_y, overwrite=overwrite)
    except ValueError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {path}")


app.command("plan", help=_PLAN_HELP, context_settings={"max_content_width": 110})(plan)
app.command("matrix", help=_MATRIX_HELP, context_settings={"max_content_width": 110})(matrix)
app.add_typer(data_app, name="data")


def _mount_plugins() -> None:
    """Add the subcommands other distributions register under the `mt.commands` group."""
    mounted = {group.name for group in app.registered_groups}
    for entry in metadata.entry_points(group="mt.commands"):
        if entry.name not in mounted:
            app.add_typer(entry.load(), name=entry.name)


def main() -> None:
    """Console-script entry point of `mt`."""
    _mount_plugins()
    app()
