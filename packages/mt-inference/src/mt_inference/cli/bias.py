"""`mt bias`: the social biases a checkpoint picked up, as MT-NLG's and GPT-3's authors
measured them (likelihood and generation probes), into a report folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from mt_inference.cli.options import command_app, errors, fail, sampling_flags
from mt_inference.placement import Placement

__all__ = ["app", "bias_command"]

_HELP = (
    "Measure the social biases a checkpoint picked up, the way the MT-NLG and GPT-3 papers "
    "did, into an --output folder: report.json (every figure, every item and every sample "
    "with its seed), table.md, occupation.png and sentiment.png (with matplotlib) and "
    "SHA256SUMS.\n\n"
    "Likelihood probes (--data-dir; needs pip install 'mt-inference\\[harness]'): "
    "lm-evaluation-harness's own crows_pairs_english (likelihood_diff, pct_stereotype) and "
    "winogender_all tasks, from local copies of their data in `mt eval --data-dir`'s layout: "
    "DATA_DIR/jannalu/crows_pairs_multilingual/english/test.jsonl and "
    "DATA_DIR/oskarvanderwal/winogender/all/test.jsonl, rows in the datasets' own schema.\n\n"
    "Generation probes (mt's, no data needed): --samples continuations of every prompt, each "
    "sampled with a seed of its own (the same report at any layout): \"The {occupation} was "
    "a\" over 60 occupations, counting the gender of each continuation's first gendered "
    "word; and prompts about gender, race and religion groups, whose continuations give "
    "each group's descriptive words and sentiment (VADER's lexicon, shipped). The prompts, "
    "word lists and counting rules are data files (--probes, --group-words replace them); "
    "mt-eval's README names their sources.\n\n"
    "CHECKPOINT is anything mt eval reads. --nproc N runs at --tp x --pp on N local "
    "processes; under torchrun, mpirun or srun each process is one rank."
)

#: The most continuations --samples draws per prompt (every sample is listed up front).
MAX_SAMPLES = 10_000
#: The most continuations of a run (each listed before the model is read, and logged in
#: report.json): mt's probes at the most --samples (2.1 million) fit.
MAX_CONTINUATIONS = 2_500_000
#: What `mt bias` writes in its folder (anything else there is the user's: never replaced).
_WRITES = ("report.json", "table.md", "occupation.png", "sentiment.png", "SHA256SUMS")


def bias_command(
    placement: Placement,
    output: Annotated[Path, typer.Option(
        "--output", "-o",
        help="Report folder (created; an earlier report of mt bias there is replaced whole).")],
    data_dir: Annotated[Path | None, typer.Option(
        help="Local copies of CrowS-Pairs' and Winogender's data (see above).")] = None,
    likelihood: Annotated[bool, typer.Option(
        help="Run the likelihood probes (CrowS-Pairs, Winogender; needs --data-dir).")
    ] = True,
    generation: Annotated[bool, typer.Option(help="Run the generation probes.")] = True,
    samples: Annotated[int, typer.Option(help="Continuations sampled per prompt.")] = 10,
    seed: Annotated[int, typer.Option(help="Seed of every sample's own seed.")] = 0,
    max_new_tokens: Annotated[int, typer.Option(help="New tokens per continuation.")] = 16,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (GPT-3's: 1).")
    ] = 1.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling (GPT-3's: 0.9).")] = 0.9,
    probes: Annotated[Path | None, typer.Option(
        help="A probes YAML instead of mt's (mt_eval/bias/probes.yaml's schema).")] = None,
    group_words: Annotated[Path | None, typer.Option(
        help="Group-word lists instead of mt's (mt_data/assets/group_words.json's schema)."
    )] = None,
    limit: Annotated[int | None, typer.Option(
        help="Score the first N items of each likelihood task.")] = None,
    batch_size: Annotated[int, typer.Option(
        help="Likelihood requests per forward pass; continuations decoded together.")] = 32,
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
) -> None:
    from mt_inference.bias import BiasSpec

    console = Console(stderr=True)
    spec = BiasSpec(placement, str(data_dir) if data_dir else None, likelihood, generation,
                    str(probes) if probes else None,
                    str(group_words) if group_words else None, samples, seed,
                    max_new_tokens, temperature, top_p, 0, limit, batch_size, progress)
    problems = _problems(spec, output)
    if problems:
        fail(console, problems)
    from mt_inference.bias import bias_rank
    from mt_inference.launch import launch

    with errors(console):
        report = launch(spec, bias_rank)
    if report is None:  # a rank other than 0 under a launcher
        return
    report["checkpoint"] = placement.checkpoint
    _write(report, output, console)


def _problems(spec: object, output: Path) -> list[str]:
    """Every problem with the options, found before a model is read."""
    import importlib.util

    from mt_eval import TaskError
    from mt_inference.bias import BiasSpec, bias_probes
    from mt_model import Sampling

    assert isinstance(spec, BiasSpec)
    problems = [f"--{name} must be positive, got {value}" for name, value in
                (("samples", spec.samples), ("batch-size", spec.batch_size),
                 ("limit", spec.limit if spec.limit is not None else 1)) if value < 1]
    if spec.samples > MAX_SAMPLES:
        problems.append(f"--samples must be at most {MAX_SAMPLES:,} per prompt (GPT-3's "
                        f"study drew 800), got {spec.samples:,}")
    problems += spec.placement.problems()
    try:
        Sampling(spec.max_new_tokens, spec.temperature, 0, spec.top_p)
    except ValueError as err:
        problems.append(sampling_flags(str(err)))
    if spec.temperature == 0 and spec.samples > 1:
        problems.append(f"--temperature 0 is greedy: the {spec.samples} samples of a prompt "
                        "would be one continuation repeated; give --temperature > 0 or "
                        "--samples 1")
    if not (spec.likelihood or spec.generation):
        problems.append("--no-likelihood with --no-generation leaves nothing to measure")
    if spec.likelihood:
        if spec.data_dir is None:
            problems.append("the likelihood probes read local copies of CrowS-Pairs and "
                            "Winogender: give --data-dir (or --no-likelihood)")
        elif not Path(spec.data_dir).is_dir():
            problems.append(f"--data-dir {spec.data_dir}: no such folder")
        elif importlib.util.find_spec("lm_eval") is None:
            problems.append("the likelihood probes run lm-evaluation-harness's tasks: pip "
                            "install 'mt-inference[harness]' (or --no-likelihood)")
    elif spec.limit is not None or spec.data_dir is not None:
        problems.append("--limit and --data-dir are for the likelihood probes, which "
                        "--no-likelihood turns off")
    if spec.generation and spec.samples <= MAX_SAMPLES:
        try:
            prompts = len(bias_probes(spec).prompts)
        except (TaskError, ValueError) as err:
            problems.append(str(err))
        else:
            if prompts * spec.samples > MAX_CONTINUATIONS:
                problems.append(f"--samples {spec.samples:,} x {prompts:,} prompts = "
                                f"{prompts * spec.samples:,} continuations: at most "
                                f"{MAX_CONTINUATIONS:,} a run (report.json logs every one); "
                                "give fewer --samples or probes")
    elif spec.probes is not None or spec.group_words is not None:
        problems.append("--probes and --group-words are for the generation probes, which "
                        "--no-generation turns off")
    problems += _output_problems(spec, output)
    if spec.likelihood and not problems:  # lm-eval's index takes seconds to build: last
        problems += _local_data(str(spec.data_dir))
    return problems


def _output_problems(spec: object, output: Path) -> list[str]:
    """What is wrong with --output: an input, a file, a folder of the user's, unwritable."""
    from mt_data.paths import output_clash, unwritable
    from mt_inference.bias import BiasSpec

    assert isinstance(spec, BiasSpec)
    problems = []
    inputs = [spec.placement.checkpoint, *(p for p in (spec.data_dir, spec.probes,
                                                       spec.group_words) if p is not None)]
    if (clash := output_clash("--output", output, inputs)) is not None:
        problems.append(clash)
    elif output.exists() and not output.is_dir():
        problems.append(f"--output {output} is a file; name a folder for the report")
    elif output.is_dir() and (theirs := sorted(p.name for p in output.iterdir()
                                               if p.name not in _WRITES)):
        problems.append(f"--output {output} holds files mt bias did not write "
                        f"({', '.join(theirs[:3])}); name an empty or new folder")
    elif (why := unwritable("--output", output, folder=True)) is not None:
        problems.append(why)
    return problems


def _local_data(data_dir: str) -> list[str]:
    """The likelihood tasks' local files, checked before the model is read."""
    from mt_eval import TaskError
    from mt_inference.bias import LIKELIHOOD_TASKS
    from mt_inference.harness import local_task, task_manager

    manager = task_manager()  # the ranks forked later share it
    problems = []
    for task in LIKELIHOOD_TASKS:
        try:
            local_task(task, data_dir, manager)
        except TaskError as err:
            problems.append(str(err))
    return problems


def _write(report: dict, output: Path, console: Console) -> None:
    """report.json, table.md, the plots (with matplotlib) and SHA256SUMS, each atomically;
    the table on stdout."""
    import importlib.util
    import json

    from mt_data.shards import atomic_write_bytes, write_sha256sums
    from mt_eval import write_json
    from mt_inference.bias_report import bias_plots, bias_table

    output.mkdir(parents=True, exist_ok=True)
    table = bias_table(report)
    print(table)
    written = [write_json(output / "report.json", json.loads(json.dumps(report, default=str)))]
    atomic_write_bytes(output / "table.md", table.encode("utf-8"))
    written.append(output / "table.md")
    if importlib.util.find_spec("matplotlib") is None:
        console.print("warning: no plots: they need matplotlib (pip install "
                      "'mt-inference[plot]')", highlight=False, soft_wrap=True)
    else:
        written += bias_plots(report, output)
    for name in _WRITES:  # a plot of an earlier report this one has no data for: stale
        if output / name not in written and name != "SHA256SUMS":
            (output / name).unlink(missing_ok=True)
    write_sha256sums(output / "SHA256SUMS", written)
    console.print(f"wrote {output}/: {', '.join(p.name for p in written)}, SHA256SUMS "
                  "(sha256sum -c checks them)", highlight=False, soft_wrap=True)


app = command_app(bias_command, _HELP)
