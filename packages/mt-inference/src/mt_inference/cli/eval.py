"""`mt eval`: zero- and few-shot evaluation of an mt checkpoint at any TP x PP layout, with
lm-evaluation-harness's tasks, prompts and metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from mt_inference.cli.options import command_app, errors, fail
from mt_inference.placement import Placement

__all__ = ["app", "eval_command"]

_HELP = (
    "Evaluate a checkpoint zero- or few-shot, the way lm-evaluation-harness scores models.\n\n"
    "CHECKPOINT is an mt pretrain checkpoint folder (its latest step, or one step folder), "
    "or any folder mt convert reads (a Hugging Face GPT-2 or Llama folder, an mt "
    "consolidated or sharded folder, a Megatron-LM checkpoint; converted once, in process); "
    "the tokenizer is the one it trained with or the one the folder carries (or "
    "--tokenizer).\n\n"
    "With lm-evaluation-harness installed (pip install 'mt-inference\\[harness]'), TASK is any "
    "lm-eval task, group or tag name, or a task YAML: lm-eval runs its own task code (Python "
    "hooks, multiple-input tasks, filters, its metrics and results JSON) and mt scores its "
    "log-likelihood requests; --data-dir points named tasks at local copies of their data "
    "(no hub). mt's own engine (--engine mt; by default for the task files it reads, as "
    "before the harness engine, and whenever the harness is not installed) runs "
    "the built-in tasks (mt-cloze, mt-choice, mt-perplexity: from the embedded corpus' "
    "held-out documents), .jsonl files (rows {context, choices, label}: multiple choice; "
    "rows {text}: last-word cloze) and lm-eval YAMLs of the log-likelihood kinds "
    "(dataset_path: json). Both draw few-shot examples as lm-eval does (same seed, same "
    "examples).\n\n"
    "--nproc N evaluates on N local processes at --tp x --pp (data parallelism takes the "
    "rest); under torchrun, mpirun or srun each process is one rank."
)


def eval_command(
    placement: Placement,
    task: Annotated[list[str] | None, typer.Option(
        "--task", "-t", help="Task to evaluate (repeatable).")] = None,
    suite: Annotated[str | None, typer.Option(
        help="A suite instead of tasks: mt-nlg (MT-NLG's evaluation: LAMBADA, BoolQ, RACE-h, "
        "PiQA, HellaSwag, WinoGrande, ANLI R1-R3, HANS, WiC at zero, one and few shots, "
        "through lm-evaluation-harness). --output is then a folder: lm-eval's results JSON of "
        "each setting, table.md laid out like the paper's and table.png.")] = None,
    shots: Annotated[int | None, typer.Option(
        "--shots", help="Few-shot examples per prompt (default: the task's num_fewshot, "
        "else 0).")] = None,
    fewshot_seed: Annotated[int, typer.Option(
        help="Seed of the few-shot draw (lm-eval's default: 1234).")] = 1234,
    batch_size: Annotated[int, typer.Option(help="Requests per forward pass.")] = 16,
    limit: Annotated[int | None, typer.Option(
        help="Evaluate the first N documents of each task.")] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Write the results as JSON here.")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace an existing --output file.")] = False,
    log_samples: Annotated[bool, typer.Option(
        "--log-samples", help="Add every document's log-likelihoods to the JSON.")] = False,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    engine: Annotated[str, typer.Option(
        help="Task engine: harness (lm-evaluation-harness's own task code; needs "
        "`pip install 'mt-inference\\[harness]'`), mt (mt-eval's, for its built-in tasks, "
        "JSONL files and the log-likelihood YAMLs), or auto: mt's engine for the task files it "
        "reads (the same numbers), the harness for the rest (lm-eval task names, hooks, "
        "generation, --data-dir, --include-path) when it is installed.")] = "auto",
    include_path: Annotated[Path | None, typer.Option(
        help="A folder of lm-eval task YAMLs to add (the harness engine).")] = None,
    data_dir: Annotated[Path | None, typer.Option(
        help="Local copies of the tasks' datasets, no hub needed (the harness engine): "
        "DATA_DIR/<dataset_path>/<dataset_name>/<split>.jsonl (or .json, .parquet), rows in "
        "the dataset's own schema, e.g. DATA_DIR/aps/super_glue/boolq/validation.jsonl.")
    ] = None,
) -> None:
    from mt_inference.rank import EvalSpec

    console = Console(stderr=True)
    tasks = tuple(task or [])
    problems = [f"--{name} must be positive, got {value}" for name, value in
                (("batch-size", batch_size), ("limit", limit if limit is not None else 1))
                if value < 1]
    if shots is not None and shots < 0:
        problems.append(f"--shots must be 0 or more, got {shots}")
    problems += placement.problems() + _task_problems(tasks, suite, shots, engine)
    problems += _output_problems(placement, tasks, suite, output, log_samples,
                                 include_path, data_dir, overwrite)
    chosen, problem = _engine("harness" if suite else engine, list(tasks), include_path,
                              data_dir)
    problems += [problem] if problem else []
    if problems:
        fail(console, problems)
    spec = EvalSpec(placement, tasks, shots, fewshot_seed, batch_size, limit, progress,
                    engine=chosen, include_path=str(include_path) if include_path else None,
                    data_dir=str(data_dir) if data_dir else None, log_samples=log_samples,
                    suite=suite)
    if chosen == "harness" and data_dir is None:  # the datasets come from the hub
        from mt_inference.hub import offline_unless_reachable

        if (why := offline_unless_reachable()) is not None:
            console.print(f"warning: the Hugging Face hub cannot be reached ({why}): the "
                          "tasks' datasets are read from its local cache only (--data-dir "
                          "reads local copies)", highlight=False, soft_wrap=True)
    from mt_inference.launch import evaluate

    with errors(console):
        results = evaluate(spec)
    if results is None:  # a rank other than 0 under a launcher
        return
    if suite is not None:
        _report_suite(results, output, console)
    elif chosen == "harness":
        _report_harness(results, output, console)
    else:
        _report_own(spec, results, output, console)


def _task_problems(tasks: tuple[str, ...], suite: str | None, shots: int | None,
                   engine: str) -> list[str]:
    from mt_inference.suites import SUITES

    problems = []
    keys = [str(Path(n).resolve()) if Path(n).is_file() else n for n in tasks]
    twice = [name for k, name in enumerate(tasks) if name.strip() and keys[k] in keys[:k]]
    if twice:
        problems.append(f"--task {twice[0]} is given twice: it would run twice; give it once")
    for name in tasks:
        if not name.strip():
            problems.append("--task is empty: give a task name or a task file")
        elif Path(name).is_dir():
            problems.append(f"--task {name} is a folder; give a task file (a folder of task "
                            "YAMLs is --include-path)")
    if (suite is None) == (not tasks):
        problems.append("give --task (one or more) or --suite, not both")
    elif suite is not None:
        if suite not in SUITES:
            problems.append(f"--suite must be one of {', '.join(SUITES)}, got {suite!r}")
        if shots is not None:
            problems.append("--shots with --suite: a suite runs each task at its own shot "
                            "counts (zero, one and few)")
        if engine == "mt":
            problems.append("--suite runs through lm-evaluation-harness, not --engine mt")
    return problems


def _output_problems(placement: Placement, tasks: tuple[str, ...], suite: str | None,
                     output: Path | None, log_samples: bool, include_path: Path | None,
                     data_dir: Path | None, overwrite: bool = False) -> list[str]:
    from mt_data.paths import existing_file, foreign_entries, output_clash, unwritable
    from mt_eval.tasks import task_data_files

    if output is None:
        return (["--log-samples adds every document's log-likelihoods to --output's JSON: "
                 "give --output too"] if log_samples else []) + (
            ["--overwrite replaces an existing --output file: give --output too"]
            if overwrite else [])
    if overwrite and suite is not None:
        return ["--overwrite replaces an --output file; --suite writes a folder and replaces "
                "only the files it wrote there"]
    inputs = [placement.checkpoint, *(t for t in tasks if Path(t).exists()),
              *(f for t in tasks for f in task_data_files(t)),
              *(p for p in (data_dir, include_path) if p is not None)]
    if output.is_dir() and suite is None:
        return [f"--output {output} is a folder; name the JSON file to write"]
    if clash := output_clash("--output", output, inputs):
        return [clash]
    if why := unwritable("--output", output, folder=suite is not None):
        return [why]
    if suite is None and (why := existing_file("--output", output, overwrite)
                          or existing_file("--output", _sums(output), overwrite)):
        return [why]
    if suite is not None and output.is_file():
        return [f"--output {output} is a file; with --suite name a folder"]
    if suite is not None and (theirs := foreign_entries(output, _SUITE_WRITES)):
        return [f"--output {output} holds files mt eval --suite did not write "
                f"({', '.join(theirs[:3])}); name an empty or new folder"]
    return []


def _sums(output: Path) -> Path:
    """The digest file written beside the results file ``output``."""
    return output.with_name(output.name + ".sha256")


def _report_own(spec: object, results: object, output: Path | None, console: Console
                ) -> None:
    """mt-eval's table on stdout and, with --output, its results JSON."""
    from mt_eval import results_json, results_table, write_json
    from mt_inference.rank import EvalSpec

    assert isinstance(spec, EvalSpec)
    Console().print(results_table(results))
    if output is not None:
        place = spec.placement
        config = {"checkpoint": place.checkpoint, "tasks": list(spec.tasks),
                  "shots": spec.shots, "fewshot_seed": spec.fewshot_seed,
                  "batch_size": spec.batch_size, "limit": spec.limit, "tp": place.tp,
                  "pp": place.pp, "nproc": place.nproc, "precision": place.precision,
                  "tokenizer": place.tokenizer}
        write_json(output, results_json(results, config, samples=spec.log_samples))
        _wrote(output, console)


#: What `mt eval --suite` writes in its --output folder (with the digests of the results).
_SUITE_WRITES = ("results_*.json", "results_*.json.sha256", "table.md", "table.png",
                 "SHA256SUMS", ".*.tmp")


def _harness_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("lm_eval") is not None


def _runs_own(task: str) -> bool:
    """Whether mt's own engine takes ``task`` (as before the harness engine existed): a task
    file it reads, or one whose error is its own to report (a missing data file...); not one
    that needs lm-evaluation-harness (a name it does not know, hooks, generation)."""
    from mt_eval import TaskError, load_task

    if not Path(task).is_file():
        return False
    try:
        load_task(task)
    except TaskError as err:
        return "--engine harness" not in str(err)
    return True


def _engine(asked: str, tasks: list[str], include_path: Path | None,
            data_dir: Path | None) -> tuple[str, str | None]:
    """(the task engine to run, or a problem naming the option at fault)."""
    from mt_eval import BUILTIN

    if asked not in ("auto", "mt", "harness"):
        return "mt", f"--engine must be auto, mt or harness, got {asked!r}"
    own = [t for t in tasks if t in BUILTIN or t.endswith(".jsonl")]
    harness = asked == "harness" or (asked == "auto" and not own and _harness_installed() and (
        include_path is not None or data_dir is not None or not all(map(_runs_own, tasks))))
    if harness and not _harness_installed():
        return "mt", ("--engine harness needs lm-evaluation-harness: pip install "
                      "'mt-inference[harness]'")
    if harness and own:
        return "mt", (f"--task {', '.join(own)}: mt's own tasks run with --engine mt, not "
                      "through lm-evaluation-harness")
    if not harness and (include_path or data_dir):
        option = "--include-path" if include_path else "--data-dir"
        why = ("lm-evaluation-harness is not installed (pip install 'mt-inference[harness]')"
               if not _harness_installed() else "--engine mt runs mt's own tasks")
        return "mt", f"{option} is for lm-eval's tasks (the harness engine), but {why}"
    for folder, option in ((include_path, "--include-path"), (data_dir, "--data-dir")):
        if folder is not None and not folder.is_dir():
            return "mt", f"{option} {folder}: no such folder"
    return ("harness" if harness else "mt"), None


def _report_harness(results: dict, output: Path | None, console: Console) -> None:
    """lm-eval's table on stdout and, with --output, its results JSON."""
    import json

    from lm_eval.utils import handle_non_serializable, make_table  # pants: no-infer-dep

    print(make_table(results))
    if output is not None:
        from mt_eval import write_json

        write_json(output, json.loads(json.dumps(results, default=handle_non_serializable)))
        _wrote(output, console)


def _wrote(output: Path, console: Console) -> None:
    """The digest of the results file just written, beside it; the line saying so."""
    from mt_data.shards import sha256_beside

    sums = sha256_beside(output)
    console.print(f"wrote {output} ({sums.name}: sha256sum -c checks it)", highlight=False,
                  soft_wrap=True)


def _report_suite(report: dict, output: Path | None, console: Console) -> None:
    """The paper-like table on stdout; with --output, a folder of lm-eval's results JSON per
    setting, table.md and table.png (with matplotlib)."""
    import importlib.util
    import json

    from lm_eval.utils import handle_non_serializable  # pants: no-infer-dep

    from mt_data.shards import atomic_write_bytes, write_sha256sums
    from mt_eval import write_json
    from mt_inference.suites import suite_plot, suite_table

    table = suite_table(report)
    print(table)
    if output is None:
        return
    output.mkdir(parents=True, exist_ok=True)
    written = []
    for setting, results in report["settings"].items():
        written.append(write_json(output / f"results_{setting}.json", json.loads(
            json.dumps(results, default=handle_non_serializable))))
    atomic_write_bytes(output / "table.md", table.encode("utf-8"))
    written.append(output / "table.md")
    if importlib.util.find_spec("matplotlib") is None:
        console.print("warning: no table.png: the plot needs matplotlib (pip install "
                      "'mt-inference[plot]')", highlight=False, soft_wrap=True)
    else:
        written.append(suite_plot(report, output / "table.png"))
    write_sha256sums(output / "SHA256SUMS", written)
    console.print(f"wrote {output}/: {', '.join(p.name for p in written)}, SHA256SUMS "
                  "(sha256sum -c checks them)", highlight=False, soft_wrap=True)


app = command_app(eval_command, _HELP)
