"""``mt plan``: estimate memory, bubble, communication and speed of a layout, or search layouts.

The maths lives in :mod:`mt_plan.estimate`; this module parses flags, resolves the model
and GPU, and prints a report, one JSON object, or a ranked table.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from mt_pipeline import DEFAULT_SCHEDULE, chunked_schedules
from mt_plan.checkpoints import failure_costs, save_costs
from mt_plan.estimate import EFFICIENCY, Estimate, estimate
from mt_plan.gpus import GPUS, GPUSpec, GPUSpecError, load_gpu
from mt_plan.layout import (
    MAX_MICRO_BATCHES,
    MAX_WORLD_SIZE,
    RECOMPUTE,
    SCHEDULES,
    ZERO_STAGES,
    LayoutError,
    ParallelLayout,
    cp_hint,
    enumerate_layouts,
    idle_option_problems,
    nearest_gpu_count,
)
from mt_zero.precision import PRECISIONS

__all__ = ["JSON_KEYS", "plan"]

#: Keys of ``mt plan --json`` (also listed in --help).
JSON_KEYS: dict[str, str] = {
    "tp, pp, dp, cp, global_batch, micro_batch, zero_stage, schedule, virtual_stages, "
    "sequence_parallel, recompute, precision, num_micro_batches, world_size": "the layout",
    "gpu, gpu_memory_gb": "GPU type and its memory (GB = 1e9 bytes)",
    "efficiency": "calibrated fraction of peak FLOP/s reached by the matmuls",
    "parameters, parameters_per_gpu": "model parameters; on the fullest GPU",
    "memory_per_gpu_gb": "peak on the fullest GPU, = memory_weights_gb + memory_grads_gb + "
                         "memory_optimizer_gb + memory_activations_gb + memory_temporaries_gb "
                         "(what the peak phase adds: loss and tied-gradient buffers, optimizer "
                         "step temporaries or the shard all-gather)",
    "fits": "memory_per_gpu_gb <= gpu_memory_gb",
    "model_flops_per_iteration": "96 B s l h^2 (1 + s/6h + V/16lh)",
    "bubble_fraction": "pipeline bubble / ideal compute, worst stage (simulated)",
    "pipeline_time_s, tp_comm_time_s, cp_comm_time_s, p2p_time_s, dp_comm_time_s, "
    "optimizer_time_s, framework_time_s": "time components (TP, CP and P2P happen inside "
        "the pipeline time, not overlapped; framework: the calibrated per-step and "
        "per-tensor cost of the training code, 0 for the built-in GPUs)",
    "tp_hidden_s, dp_exposed_s, exposed_comm_s, hidden_comm_s": "communication on the "
        "critical path (TP but for what the column layers' backward GEMMs hide: the input "
        "gradients' collectives, with SP the inputs' second gathers; CP, P2P, the tied "
        "embedding's sum and the DP part compute does not hide: buckets still reducing "
        "after the last backward, ZeRO 1-2's weight gather, ZeRO-3's gathers beyond the "
        "previous unit's compute) and the TP and DP parts hidden under compute",
    "iteration_time_s, tflops_per_gpu, tokens_per_s": "the estimated speed; TFLOP/s by the "
        "formula above (it counts a full recompute, as MT-NLG reported)",
    "simulated": "true when the schedule ran through mt-pipeline's simulator",
    "calibrated": "true when the rates were measured (--calibrate, or a --gpu file it wrote) "
                  "rather than efficiency x peak",
    "checkpoint": "one save (mt_plan.checkpoints.SaveCosts): checkpoint_bytes, rank_bytes, "
                  "node_bytes, sync_s (training stopped by a synchronous save), async_s (by an "
                  "asynchronous one: the copy to host memory), write_s, host_bytes_per_node",
    "failures": "with --save-interval and --failures-per-day, for sync and async saves: "
                "interval_s, saving_fraction, failure_fraction, total_fraction, "
                "lost_per_failure_s, best_interval_steps",
}

_HELP = (
    "Plan a training run at any scale: memory per GPU, FLOPs, pipeline bubble, communication, "
    "iteration time and TFLOP/s per GPU, from the model and the cluster. Iteration times use "
    f"one efficiency constant ({EFFICIENCY}, fitted to MT-NLG 530B's published times) on a "
    "data sheet's peak, or the rates --calibrate measures on this machine.\n\n"
    "--json keys: " + "; ".join(f"{k} ({v})" for k, v in JSON_KEYS.items())
)


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def _model(name: str | None, config: Path | None) -> tuple[Any, ParallelLayout | None]:
    """The model of --model or --config, and, when the config is an ``mt pretrain`` one, the
    layout of its run (as ``mt pretrain --config FILE --dry-run`` resolves it)."""
    from mt_model import GPTConfig, GPTConfigError, preset

    if (name is None) == (config is None):
        raise _fail("give exactly one of --model PRESET or --config FILE")
    try:
        if name is not None:
            return preset(name), None
        if not config.is_file():
            raise _fail(f"config file {config} not found")
        from mt_checkpoint import CheckpointError
        from mt_pretrain.config.load import load_config, read_yaml
        from mt_pretrain.config.resolve import resolve
        from mt_pretrain.config.schema import SECTIONS, ConfigError

        try:
            data = read_yaml(config)
            if isinstance(data, dict) and set(data) & set(SECTIONS):  # an `mt pretrain` YAML
                run = load_config(config)
                plan = resolve(run, run.world_size_hint())
                return plan.gpt, plan.layout
        except (ConfigError, CheckpointError) as err:  # not UTF-8, not YAML, bad fields
            raise _fail(str(err)) from None
        if not isinstance(data, dict):
            raise _fail(f"{config}: expected a mapping of GPTConfig fields")
        return GPTConfig.from_dict(data), None
    except (GPTConfigError, TypeError) as err:
        raise _fail(str(err)) from None


#: mt plan's layout flags and the :class:`ParallelLayout` fields they set (--gpus: the
#: world size): what an ``mt pretrain`` config gives, unless the flag is given.
_LAYOUT_FLAGS = {"gpus": "world_size", "tp": "tp", "cp": "cp", "pp": "pp",
                 "global_batch_size": "global_batch", "micro_batch_size": "micro_batch",
                 "zero_stage": "zero_stage", "schedule": "schedule",
                 "virtual_stages": "virtual_stages", "sequence_parallel": "sequence_parallel",
                 "recompute": "recompute", "precision": "precision",
                 "chunked_loss": "chunked_loss", "main_grads": "main_grads"}


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the option ``name`` (its parameter) was given on the command line."""
    return getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"


def _run_flags(ctx: typer.Context, run: ParallelLayout) -> dict[str, Any]:
    """The layout flags' values (in :data:`_LAYOUT_FLAGS` order): the config's run's, but
    for the flags given on the command line."""
    return {flag: ctx.params[flag] if _given(ctx, flag) else getattr(run, field)
            for flag, field in _LAYOUT_FLAGS.items()}


#: Options and the option they do nothing without (unset, 0 or false).
_NEEDS = {"failures_per_day": "save_interval", "save_interval": "failures_per_day",
          "restart_minutes": "failures_per_day", "top": "search", "overwrite": "calibrate"}
#: The checkpoint options, of one planned layout only (--search prints no checkpoint lines).
_SAVE_FLAGS = ("save_interval", "failures_per_day", "restart_minutes", "write_gb_per_s",
               "host_gb_per_s")


def _idle_options(ctx: typer.Context) -> list[str]:
    """Options given on the command line that would change nothing, one message each."""
    def flag(name: str) -> str:
        return f"--{name.replace('_', '-')}"

    idle = [f"{flag(name)} does nothing without {flag(need)}: leave it out"
            for name, need in _NEEDS.items() if _given(ctx, name) and not ctx.params[need]]
    if ctx.params["search"]:
        idle += [f"{flag(name)} does nothing with --search (it prints no checkpoint figures): "
                 "leave it out" for name in _SAVE_FLAGS if _given(ctx, name)]
    return idle


def _number_problems(numbers: dict[str, int | None], zero_stage: int) -> list[str]:
    """What is wrong with the numeric flags (``numbers``: flag -> value, None: not given),
    each naming its flag and value."""
    problems = [f"--{flag} must be a positive integer, got {value}"
                for flag, value in numbers.items() if value is not None and value < 1]
    problems += [f"--{flag} must be below 2**63, got {value}"
                 for flag, value in numbers.items() if value is not None and value >= 2**63]
    if zero_stage not in ZERO_STAGES:
        problems.append(f"--zero-stage must be 0, 1, 2 or 3, got {zero_stage}")
    if not problems:
        world = numbers["gpus"] or numbers["tp"] * numbers["cp"] * numbers["pp"]  # type: ignore
        if world > MAX_WORLD_SIZE:
            what = "--gpus" if numbers["gpus"] else "--tp x --cp x --pp"
            problems.append(f"{what} must be at most {MAX_WORLD_SIZE:,} GPUs, got {world:,}")
    return problems


def _search_ignores(ctx: typer.Context, calibrate: Path | None) -> list[str]:
    """The layout flags given on the command line that --search would not use (it chooses
    them itself; --calibrate measures at --tp and --micro-batch-size)."""
    chosen = ["tp", "pp", "micro_batch_size", "virtual_stages", "sequence_parallel",
              "recompute"]
    if calibrate is not None:
        chosen = [name for name in chosen if name not in ("tp", "micro_batch_size")]
    return [f"--{name.replace('_', '-')}" for name in chosen if _given(ctx, name)]


def _search(gpt: Any, gpu: GPUSpec, gpus: int, global_batch: int, zero: int, schedule: str,
            top: int, as_json: bool, max_cp: int, options: dict[str, Any]) -> None:
    def layouts_of(n: int, cp: int) -> list[ParallelLayout]:
        # --precision, --chunked-loss and --main-grads hold for every layout.
        return [dataclasses.replace(lay, **options) for lay in enumerate_layouts(
            gpt, n, global_batch, gpu.gpus_per_node, zero, schedule, max_cp=cp)]

    layouts = layouts_of(gpus, max_cp)
    # Rank all by the closed form, then simulate the best few for exact figures.
    grid = "tp x cp x pp x dp" if max_cp > 1 else "tp x pp x dp"
    if not layouts:
        near = nearest_gpu_count(gpt, gpus, global_batch, gpu.gpus_per_node, zero, schedule,
                                 max_cp)
        raise _fail(
            f"no layout splits this run over {gpus} GPUs: {grid} = {gpus} needs tp to "
            f"divide the {gpt.n_heads} heads (at most {gpu.gpus_per_node} per node), pp the "
            f"{gpt.n_layers} layers and dp the global batch {global_batch}"
            + (f"; {near} GPUs can" if near else ""))
    fewest = min(lay.num_micro_batches for lay in layouts)
    if fewest > MAX_MICRO_BATCHES:
        raise _fail(f"--global-batch-size {global_batch:,} is at least {fewest:,} "
                    f"micro-batches per step in every layout on {gpus} GPUs; at most "
                    f"{MAX_MICRO_BATCHES:,} (a smaller --global-batch-size or more --gpus)")
    layouts = [lay for lay in layouts if lay.num_micro_batches <= MAX_MICRO_BATCHES]
    estimates = [estimate(gpt, lay, gpu, simulate_pipeline=False) for lay in layouts]
    quick = [e for e in estimates if e.fits]
    if not quick:
        least = min(estimates, key=lambda e: e.memory_per_gpu_gb)
        lay = least.layout
        with_cp = f" x cp {lay.cp}" if lay.cp > 1 else ""
        remedies = ["more GPUs"] + (["ZeRO stage 3"] if zero < 3 else [])
        if max_cp == 1 and (hint := cp_hint(gpt.seq_len, gpus)) > 1:
            split = [e for e in (estimate(gpt, other, gpu, simulate_pipeline=False)
                                 for other in layouts_of(gpus, hint)) if e.fits]
            if split:
                remedies.append(f"--cp {hint} (splitting each sequence, {len(split)} layouts "
                                "fit)")
        raise _fail(f"none of the {len(layouts)} layouts on {gpus} x {gpu.name} fits in memory: "
                    f"the leanest (tp {lay.tp} x pp {lay.pp} x dp {lay.dp}{with_cp}, micro-batch "
                    f"{lay.micro_batch}, recompute {lay.recompute}) needs "
                    f"{least.memory_per_gpu_gb:.1f} GB of the {gpu.memory_bytes / 1e9:.0f} GB "
                    f"per GPU; use {' or '.join(remedies)}")
    quick.sort(key=lambda e: -e.tokens_per_s)
    best = [estimate(gpt, e.layout, gpu) for e in quick[:2 * top]]
    best = sorted((e for e in best if e.fits), key=lambda e: -e.tokens_per_s)[:top]
    if as_json:
        typer.echo(json.dumps([e.to_dict() for e in best]))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(quick)} of {len(layouts)} layouts fit on {gpus} x {gpu.name}; "
                  f"top {len(best)} by estimated throughput")
    columns = ("tp", "cp", "pp", "dp", "micro", "recompute", "SP", "mem GB", "bubble",
               "iter s", "TFLOP/s", "tokens/s")
    for col in columns if max_cp > 1 else (c for c in columns if c != "cp"):
        table.add_column(col, justify="right")
    for e in best:
        lay = e.layout
        table.add_row(str(lay.tp), *([str(lay.cp)] if max_cp > 1 else []), str(lay.pp),
                      str(lay.dp), str(lay.micro_batch),
                      lay.recompute, "y" if lay.sequence_parallel else "n",
                      f"{e.memory_per_gpu_gb:.1f}", f"{e.bubble_fraction:.3f}",
                      f"{e.iteration_time_s:.2f}", f"{e.tflops_per_gpu:.1f}",
                      f"{e.tokens_per_s:,.0f}")
    Console(width=120).print(table)
    typer.echo(f"efficiency constant {EFFICIENCY} (matmuls at that fraction of peak)")


def _local_gpu() -> str:
    """The built-in table's entry for this machine's GPU ("a100-80gb" if unknown or none)."""
    import torch

    if not torch.cuda.is_available():
        return "a100-80gb"
    name = torch.cuda.get_device_name().lower()
    memory = torch.cuda.get_device_properties(0).total_memory
    for key in ("h200", "h100", "a100"):
        if key in name:
            if key == "a100":
                return "a100-40gb" if memory < 50e9 else "a100-80gb"
            return "h100-80gb" if key == "h100" else key
    return "a100-80gb"


def _calibrate(gpt: Any, base: GPUSpec, explicit: str | None, path: Path, micro_batch: int,
               tp: int, precision: str, model: str) -> GPUSpec:
    """Measure this device at ``gpt``'s shapes, store the calibration, return the spec
    (``base``'s capacity and links, or, on a CPU without ``--gpu``, the machine's own)."""
    import torch

    from mt_plan.calibrate import calibrated, measure, write_calibration

    if micro_batch < 1 or tp < 1 or precision not in PRECISIONS:
        raise _fail(f"--calibrate needs --micro-batch-size {micro_batch} >= 1, --tp {tp} >= 1 "
                    f"and --precision bf16, fp16 or fp32 (got {precision!r})")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = (torch.cuda.get_device_name() if device == "cuda"
             else f"cpu, {torch.get_num_threads()} threads")
    typer.echo(f"calibrating on {where}: {model} shapes, micro-batch {micro_batch} x "
               f"{gpt.seq_len}, tp {tp}, {precision} ...", err=True)
    rates = measure(gpt, micro_batch, tp, precision, device)
    if device == "cpu" and explicit is None:
        # This machine: its memory; its peak the measured forward GEMM rate; ranks talk
        # through shared memory (gloo), so links at the measured memory bandwidth.
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        link = rates["memory_bandwidth_gb_per_s"] * 1e9
        base = GPUSpec("cpu", rates["gemm_fwd_tflops"] * 1e12, float(memory), link, link, 1,
                       gather_scratch=1.0)
    spec = calibrated(base, rates, f"{base.name} (calibrated: {where})")
    about = {"device": where, "model": model, "micro_batch": micro_batch,
             "seq_len": gpt.seq_len, "tp": tp, "precision": precision,
             "torch": str(torch.__version__)}
    try:
        write_calibration(path, spec, rates, about)
    except OSError as err:
        raise _fail(f"cannot write the calibration to {path}: {err.strerror or err}") from None
    typer.echo("measured   " + ", ".join(f"{k} {v:,.4g}" for k, v in rates.items())
               + f"; written to {path}", err=True)
    return spec


def _check_calibrate(calibrate: Path, inputs: list[str | Path], overwrite: bool) -> None:
    """--calibrate writes a new file: not over the model config or GPU file it reads, nor
    over an existing file without --overwrite, and somewhere writable (checked before the
    measurement, not after)."""
    from mt_data import output_clash
    from mt_data.paths import existing_file, unwritable

    if clash := output_clash("--calibrate", calibrate, inputs):
        raise _fail(clash)
    if why := unwritable("--calibrate", calibrate):
        raise _fail(why)
    if why := existing_file("--calibrate", calibrate, overwrite):
        raise _fail(why)


def _check_micro_batches(layout: ParallelLayout) -> None:
    if layout.num_micro_batches > MAX_MICRO_BATCHES:
        raise _fail(f"--global-batch-size {layout.global_batch:,} is "
                    f"{layout.num_micro_batches:,} micro-batches of {layout.micro_batch:,} "
                    f"on each of dp {layout.dp:,} replicas per step; at most "
                    f"{MAX_MICRO_BATCHES:,} (a larger --micro-batch-size or --gpus, or a "
                    "smaller --global-batch-size)")


def plan(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option(help="Model preset (tiny .. mt-nlg-530b).")] = None,
    config: Annotated[Path | None, typer.Option(
        help="YAML: GPTConfig fields, or an mt pretrain config: its model and the layout of "
             "its run (as mt pretrain --dry-run resolves it: --gpus its world size, --tp, "
             "--micro-batch-size, --precision ... its values), the flags given overriding "
             "it.")] = None,
    gpu: Annotated[str | None, typer.Option(
        help=f"GPU type {sorted(GPUS)} or a YAML file (peak_tflops, memory_gb, "
             "nvlink_gb_per_s, ib_gb_per_s, gpus_per_node). Default a100-80gb; with "
             "--calibrate, this machine's GPU if the table knows it.")] = None,
    gpus: Annotated[int | None, typer.Option(
        help="Number of GPUs (default tp x cp x pp).")] = None,
    tp: Annotated[int, typer.Option(help="Tensor-parallel degree.")] = 1,
    cp: Annotated[int, typer.Option(
        help="Context-parallel degree: each rank holds s / cp tokens of every sequence "
             "(activations / cp, the whole sequence's keys and values kept, their exchange "
             "timed). With --search: the largest CP degree to try (1, 2, 4, ... up to it).")
    ] = 1,
    pp: Annotated[int, typer.Option(help="Pipeline stages.")] = 1,
    global_batch_size: Annotated[int, typer.Option(help="Sequences per step.")] = 32,
    micro_batch_size: Annotated[int, typer.Option(help="Sequences per micro-batch.")] = 1,
    zero_stage: Annotated[int, typer.Option(help="ZeRO stage 0-3.")] = 1,
    schedule: Annotated[str, typer.Option(
        help=f"Pipeline schedule {SCHEDULES}.")] = DEFAULT_SCHEDULE,
    virtual_stages: Annotated[int, typer.Option(
        help=f"Chunks per stage (>= 2 with {', '.join(chunked_schedules())}).")] = 1,
    sequence_parallel: Annotated[bool, typer.Option(
        "--sequence-parallel", help="Sequence parallelism (Korthikanti et al.).")] = False,
    recompute: Annotated[str, typer.Option(help=f"Activation recompute {RECOMPUTE}.")] = "full",
    precision: Annotated[str, typer.Option(help=", ".join(PRECISIONS) + ".")] = "bf16",
    chunked_loss: Annotated[bool, typer.Option(
        help="The head and the loss in one, chunk by chunk (mt pretrain's default); off: "
        "the [b, s, vocab / tp] logits, their float32 copy and gradient.")] = True,
    main_grads: Annotated[bool, typer.Option(
        help="bf16 / fp16: fp32 gradients, accumulated and reduced in fp32 (mt pretrain's "
        "default); off: 16-bit gradients (half the gradient memory).")] = True,
    search: Annotated[bool, typer.Option(
        "--search", help="Search layouts on --gpus GPUs instead of --tp/--pp.")] = False,
    top: Annotated[int, typer.Option(help="Rows of --search output (with --search).")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    calibrate: Annotated[Path | None, typer.Option(
        help="Measure this machine first (CUDA if present, else CPU) at the model's shapes "
             "and --micro-batch-size / --tp / --precision: matmul, attention, memory and "
             "AdamW rates; write them to this YAML (--gpu gives capacity and links) and plan "
             "with them. Later runs reuse it as --gpu FILE. An existing FILE is refused "
             "unless --overwrite.")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="With --calibrate: replace the FILE if it exists.")] = False,
    save_interval: Annotated[int, typer.Option(
        help="Steps between checkpoints: with --failures-per-day, the work saves and "
             "failures are expected to cost, synchronous and asynchronous.")] = 0,
    failures_per_day: Annotated[float, typer.Option(
        help="Failures of the whole job per day (MT-NLG: about one node a day); with "
             "--save-interval.")] = 0.0,
    restart_minutes: Annotated[float, typer.Option(
        help="Minutes from a failure to training again (requeue, start, load); with "
             "--failures-per-day.")] = 10.0,
    write_gb_per_s: Annotated[float, typer.Option(
        help="Checkpoint write bandwidth of one node to its storage, GB/s.")] = 5.0,
    host_gb_per_s: Annotated[float, typer.Option(
        help="Copy bandwidth of one GPU to pinned host memory, GB/s (PCIe 4 x16: ~25).")
    ] = 25.0,
) -> None:
    """Plan a run: memory, FLOPs, bubble, communication, iteration time (see --help)."""
    problems = _number_problems({
        "gpus": gpus, "tp": tp, "cp": cp, "pp": pp, "global-batch-size": global_batch_size,
        "micro-batch-size": micro_batch_size, "virtual-stages": virtual_stages, "top": top},
        zero_stage)
    saves = {"save-interval": save_interval, "failures-per-day": failures_per_day,
             "restart-minutes": restart_minutes, "write-gb-per-s": write_gb_per_s,
             "host-gb-per-s": host_gb_per_s}
    problems += _save_problems(saves) + _idle_options(ctx)
    if search and (ignored := _search_ignores(ctx, calibrate)):
        problems.append(f"--search chooses {', '.join(ignored)} itself: leave "
                        f"{'it' if len(ignored) == 1 else 'them'} out, or plan one layout "
                        "without --search")
    if problems:
        raise _fail("; ".join(problems))
    if calibrate is not None:
        _check_calibrate(calibrate, [p for p in (config, gpu) if p and Path(p).exists()],
                         overwrite)
    gpt, run = _model(model, config)
    if run is not None:  # an mt pretrain config: its run's layout, the flags given on top
        (gpus, tp, cp, pp, global_batch_size, micro_batch_size, zero_stage, schedule,
         virtual_stages, sequence_parallel, recompute, precision, chunked_loss,
         main_grads) = _run_flags(ctx, run).values()
    if not search and (idle := idle_option_problems(  # the rule of mt pretrain
            tp=tp, pp=pp, virtual_stages=virtual_stages, sequence_parallel=sequence_parallel,
            main_grads=main_grads, precision=precision)):
        raise _fail("; ".join(idle))
    try:
        # An empty --gpu is refused by load_gpu.
        spec = load_gpu(gpu if gpu is not None else
                        (_local_gpu() if calibrate is not None else "a100-80gb"))
    except GPUSpecError as err:
        raise _fail(str(err)) from None
    if calibrate is not None:
        spec = _calibrate(gpt, spec, gpu, calibrate, micro_batch_size, tp, precision,
                          model or str(config))
    n = gpus if gpus is not None else tp * cp * pp
    try:
        if search:
            _search(gpt, spec, n, global_batch_size, zero_stage, schedule, top, as_json, cp,
                    {"precision": precision, "chunked_loss": chunked_loss,
                     "main_grads": main_grads})
            return
        if n % (tp * cp * pp):
            with_cp = f" x --cp {cp}" if cp > 1 else ""
            raise _fail(f"--gpus {n} is not divisible by --tp {tp} x --pp {pp}{with_cp} = "
                        f"{tp * cp * pp}")
        layout = ParallelLayout(tp, pp, n // (tp * cp * pp), global_batch_size,
                                micro_batch_size, zero_stage, schedule, virtual_stages,
                                sequence_parallel, recompute, precision, chunked_loss,
                                main_grads, cp)
        _check_micro_batches(layout)
        est = estimate(gpt, layout, spec)
    except LayoutError as err:
        raise _fail(str(err)) from None
    figures, lines = _saving(est, spec, saves)
    typer.echo(json.dumps({**est.to_dict(), **figures}) if as_json else
               "\n".join([est.report(), *lines]))


def _save_problems(saves: dict[str, float]) -> list[str]:
    """The checkpoint options' bounds, one message each."""
    problems = [f"--{name} must be a finite number >= 0, got {value}"
                for name, value in saves.items() if not 0 <= value < float("inf")]
    problems += [f"--{name} must be > 0, got {saves[name]}"
                 for name in ("write-gb-per-s", "host-gb-per-s") if saves[name] == 0]
    return problems


def _saving(est: Estimate, spec: GPUSpec, saves: dict[str, float]
            ) -> tuple[dict[str, Any], list[str]]:
    """The checkpoint figures of ``est`` (JSON keys ``checkpoint`` and ``failures``) and the
    report's lines about them."""
    lay, gb = est.layout, 1e9
    cost = save_costs(est.parameters, est.parameters_per_gpu, lay, spec,
                      saves["write-gb-per-s"] * gb, saves["host-gb-per-s"] * gb)
    figures: dict[str, Any] = {"checkpoint": cost.to_dict()}
    lines = [
        f"checkpoint  {cost.checkpoint_bytes / gb:,.1f} GB per save; the fullest rank writes "
        f"{cost.rank_bytes / gb:,.2f} GB, its node {cost.node_bytes / gb:,.1f} GB",
        f"saving      synchronous: training stops {cost.sync_s:,.1f} s per save (a node's "
        f"bytes at {saves['write-gb-per-s']:g} GB/s); asynchronous: {cost.async_s:,.2f} s "
        f"(the copy to host at {saves['host-gb-per-s']:g} GB/s per GPU), "
        f"{cost.host_bytes_per_node / gb:,.1f} GB of pinned host memory per node, the write "
        f"{cost.write_s:,.1f} s behind"]
    interval, rate = int(saves["save-interval"]), saves["failures-per-day"]
    if interval and rate:
        restart = saves["restart-minutes"] * 60.0
        sync = failure_costs(cost.sync_s, 0.0, est.iteration_time_s, interval, rate, restart)
        background = failure_costs(cost.async_s, cost.write_s, est.iteration_time_s, interval,
                                   rate, restart)
        figures["failures"] = {"sync": sync.to_dict(), "async": background.to_dict()}
        lines.append(
            f"failures    {rate:g} a day, a save every {interval:,} steps ({sync.interval_s:,.0f}"
            f" s): synchronous saves cost {sync.saving_fraction:.2%} of the time and failures "
            f"{sync.failure_fraction:.2%} (each {sync.lost_per_failure_s:,.0f} s of work and "
            f"restart); asynchronous {background.saving_fraction:.2%} and "
            f"{background.failure_fraction:.2%}; the least costly interval: "
            f"{sync.best_interval_steps:,} steps synchronous, "
            f"{background.best_interval_steps:,} asynchronous")
    return figures, lines
