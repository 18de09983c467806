"""`mt pretrain`: config -> (dry run | launch) -> summary. Returns a process exit code."""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from mt_pretrain.config.load import SHIPPED, load_config
from mt_pretrain.config.schema import SECTIONS, PretrainConfig

__all__ = ["DEMO_CONFIG", "dry_run", "pretrain_main"]

#: What `mt pretrain` runs when given no model, layout, training or data flag (also
#: `--config demo-3d`).
DEMO_CONFIG = SHIPPED / "demo-3d.yaml"
_RUN_FIELDS = {f.name for section in ("model", "parallel", "train", "data")
               for f in dataclasses.fields(SECTIONS[section])}
_LAYOUT_FIELDS = {"nproc", "tp", "pp", "dp"}


def _error(console: Console, text: str) -> None:
    # escape: messages quote paths and library text with brackets, e.g. gloo's "[/...]".
    # soft_wrap: one line however narrow the terminal (a log file reads as 80 columns).
    console.print(f"[bold red]error:[/] {escape(text)}", highlight=False, soft_wrap=True)


def dry_run(config: PretrainConfig, environ: Mapping[str, str]) -> str:
    """The plan of ``config`` at the world size of the launcher (or --nproc) as text, and a
    warning line when its memory per rank exceeds this machine's (a run would be refused)."""
    from mt_dist import discover, local_device
    from mt_pretrain.config.resolve import describe, memory_shortfall, resolve

    info = discover(environ, use_mpi4py=False)
    single = info.launcher == "single"
    world = config.world_size_hint() if single else info.world_size
    plan = resolve(config, world)
    text = describe(config, plan)
    device = local_device(info, use_cuda={"auto": None, "cpu": False, "cuda": True}[
        config.parallel.device])
    short = memory_shortfall(plan, device, world if single else info.local_world_size)
    if short and config.log.says("warning"):
        text += f"\nwarning    {short}: a run here would be refused"
    return text


def pretrain_main(config_path: Path | None, overrides: dict[str, Any],
                  environ: Mapping[str, str] | None = None) -> int:
    """Run the `mt pretrain` command; 0 on success, 1 on a failed run (a rank's error, a
    diverged loss, the operating system's: disk full...), 2 on bad input (config, checkpoint,
    data), 130 when interrupted twice."""
    environ = os.environ if environ is None else environ
    console = Console(stderr=True)
    from mt_pretrain.run.warnings_line import one_line_warnings

    one_line_warnings()
    lead = _lead_process(environ)
    if not lead:  # under a launcher: rank 0 says what every rank would say alike
        console.quiet = True
    say = Console(quiet=not lead or not _says_info(overrides))
    if config_path is None and not set(overrides) & _RUN_FIELDS:
        # No model, layout, training or data given: the demo (output flags such as --dry-run,
        # --overwrite, --out-dir still apply to it).
        config_path = DEMO_CONFIG
        say.print(f"no run given: the 3D demo, {DEMO_CONFIG} (tiny GPT, TP 2 x PP 2 x "
                  "DP 2 on 8 processes); `mt pretrain --help` for the flags",
                  highlight=False, markup=False)
    elif config_path is None and not set(overrides) & _LAYOUT_FIELDS:
        # Said, so that adding --train-steps to the demo's command is no silent change.
        given = " ".join(f"--{k.replace('_', '-')}" for k in sorted(set(overrides) & _RUN_FIELDS))
        say.print(f"{given} given, so not the 3D demo: every degree is 1, on one "
                  "process unless --nproc (add --config demo-3d to start from the demo)",
                  highlight=False, markup=False)
    from mt_checkpoint import CheckpointError
    from mt_data import DataError
    from mt_dist.exits import FAILED, exit_code
    from mt_eval import TaskError

    try:
        config = load_config(config_path, overrides)
        if config.log.dry_run:
            Console(soft_wrap=True).print(dry_run(config, environ), highlight=False)
            return 0
        from mt_pretrain.launch import launch

        with warnings.catch_warnings():
            if config.log.level == "error":  # asked for: errors only (ranks: run_rank)
                warnings.simplefilter("ignore")
            summary = launch(config, environ)
    except BaseException as err:  # noqa: BLE001 - mt-dist's one rule; a bug re-raised
        from mt_pretrain.run.train import NonFiniteLossError

        code = exit_code(err, expected=(CheckpointError, DataError, TaskError),
                         failed=(NonFiniteLossError,))
        if code is None:
            raise
        console.quiet = console.quiet and code != FAILED  # a rank's own failure: always said
        _error(console, str(err) or "interrupted")
        return code
    if summary is not None and config.log.says("warning"):
        _print_summary(Console(soft_wrap=True), summary)
    return 0


def _says_info(overrides: Mapping[str, Any]) -> bool:
    """Whether the flags leave info lines on (read before the config: the demo's line)."""
    level = str(overrides.get("log_level", "info")).lower()
    quiet = str(overrides.get("quiet", "")).lower() in ("true", "1")
    return level in ("info", "debug") and not quiet


def _lead_process(environ: Mapping[str, str]) -> bool:
    """Whether this process speaks for the run: not under a launcher, or its rank 0."""
    from mt_dist import LaunchError, discover

    try:
        return discover(environ).rank == 0
    except LaunchError:
        return True  # reported by the launch itself, once it reads the same variables


def _print_summary(console: Console, summary: Any) -> None:
    losses = summary.losses
    if losses:
        console.print(
            f"trained steps {summary.start_step + 1}-{summary.final_step}: loss "
            f"{losses[0]:.4f} -> {losses[-1]:.4f}, {summary.tokens:,} tokens, "
            f"{summary.tokens_per_s:,.0f} tokens/s, {summary.wall_time:.1f} s"
            + (f" (since restart {summary.restarts})" if summary.restarts else ""),
            highlight=False)
    if summary.memory is not None:
        from mt_plan.memory import summary_line

        console.print(summary_line(summary.memory, summary.planned_memory,
                                   summary.planned_stage), highlight=False, markup=False)
    if summary.val_loss is not None:
        console.print(f"validation loss {summary.val_loss:.4f}", highlight=False)
    if summary.checkpoint:
        console.print(f"checkpoint {summary.checkpoint}", highlight=False, markup=False)
    if summary.sample:
        console.print(f"sample: {summary.sample}", highlight=False, markup=False)
    sys.stdout.flush()
