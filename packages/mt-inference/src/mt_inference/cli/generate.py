"""`mt generate`: text from any checkpoint mt reads, greedy or sampled."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from mt_inference.cli.options import command_app, errors, fail, sampling_flags
from mt_inference.placement import Placement

__all__ = ["app", "generate_command"]

_HELP = (
    "Complete prompts with a checkpoint: greedy by default, or sampled (--temperature, "
    "--top-k, --top-p) with a --seed that gives the same text alone or batched.\n\n"
    "CHECKPOINT is an mt pretrain checkpoint (any layout), or any folder mt convert reads "
    "(a Hugging Face GPT-2 or Llama folder with its tokenizer, an mt consolidated folder). "
    "One --prompt streams its completion to the terminal; --input prompts.jsonl (rows "
    '{"prompt": TEXT}) writes one JSONL row per prompt to --output (prompt, completion, '
    "token_ids, logprobs with --logprobs, finish_reason) with a progress bar. Generation "
    "stops at the tokenizer's end-of-text token, at a --stop string, or after "
    "--max-new-tokens.\n\n"
    "--nproc N decodes on N local processes at --tp x --pp (each stage caches its own layers "
    "and heads; data parallelism takes the rest and shares out the prompts); under "
    "torchrun, mpirun or srun each process is one rank. The same --seed gives the same "
    "tokens at every layout."
)


def generate_command(
    placement: Placement,
    prompt: Annotated[str | None, typer.Option(help="One prompt (streamed).")] = None,
    input: Annotated[Path | None, typer.Option(  # noqa: A002 - the flag users expect
        "--input", "-i", help='JSONL prompts: rows {"prompt": TEXT}.')] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="JSONL results (with --input; default: stdout).")] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace an existing --output file.")] = False,
    max_new_tokens: Annotated[int, typer.Option(help="New tokens at most.")] = 64,
    temperature: Annotated[float, typer.Option(
        help="0: greedy (the default); > 0: sample from softmax(logits / T).")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Sample among the k likeliest (0: all).")] = 0,
    top_p: Annotated[float, typer.Option(
        help="Sample among the likeliest tokens holding probability p (1: all).")] = 1.0,
    stop: Annotated[list[str] | None, typer.Option(
        help="Stop before this text (repeatable).")] = None,
    seed: Annotated[int, typer.Option(
        help="Seed of the sampling: each prompt draws from a generator of its own seeded with "
        "it, so a prompt and seed give the same text alone or batched (and two rows of the "
        "same prompt the same text).")] = 0,
    logprobs: Annotated[bool, typer.Option(
        "--logprobs", help="Write each new token's log-probability.")] = False,
    batch_size: Annotated[int, typer.Option(help="Prompts decoded together.")] = 8,
    in_flight: Annotated[int, typer.Option(
        help="Batches in flight through the pipeline's stages: 1 (the batch steps through "
        "them whole), or >= --pp (every stage busy: pays when a step is bound by compute, "
        "large batches; not when bound by reading the weights).")] = 1,
) -> None:
    console = Console(stderr=True)
    problems = _input_problems(placement, prompt, input, output, stop or [], logprobs,
                               overwrite)
    problems += [f"--{name} must be positive, got {value}" for name, value in
                 (("batch-size", batch_size), ("in-flight", in_flight)) if value < 1]
    pp = placement.pp
    if in_flight > 1 and pp == 1:
        problems.append(f"--in-flight {in_flight} keeps the stages of a pipeline busy, and "
                        "--pp 1 has one stage: leave it out")
    elif 1 < in_flight < pp:
        problems.append(f"--in-flight {in_flight} cannot keep --pp {pp} stages busy: give 1 "
                        f"or at least {pp}")
    elif in_flight > max(batch_size, 1):  # the rest would be empty batches, each allocated
        problems.append(f"--in-flight {in_flight} splits each batch of --batch-size "
                        f"{batch_size} prompts into {in_flight}: give at most {batch_size}")
    problems += placement.problems()
    if temperature == 0 and (top_k or top_p != 1):
        given = " and ".join(f for f, on in (("--top-k", top_k), ("--top-p", top_p != 1)) if on)
        problems.append(f"{given} choose among tokens to sample, and --temperature 0 is "
                        "greedy: give --temperature > 0 too, or leave them out")
    if temperature == 0 and 0 < seed < 2**63:  # out of range: Sampling's check names it
        problems.append(f"--seed {seed} seeds the sampling, and --temperature 0 is greedy "
                        "(nothing is drawn): give --temperature > 0 too, or leave --seed out")
    try:
        from mt_model import Sampling

        sampling = Sampling(max_new_tokens, temperature, top_k, top_p, seed)
    except ValueError as err:
        problems.append(sampling_flags(str(err)))
    if problems:
        fail(console, problems)
    with errors(console):
        from mt_inference.generation import GenerateSpec, read_prompts

        given = [("--prompt", prompt)] if prompt is not None else \
            read_prompts(input)  # type: ignore[arg-type]
        spec = GenerateSpec(placement, tuple(text for _, text in given), sampling,
                            tuple(stop or []), batch_size, stream=prompt is not None,
                            in_flight=in_flight, sources=tuple(where for where, _ in given))
        rows = _generate(spec, console)
        if rows is not None:  # None: a rank other than 0 under a launcher
            _report(rows, prompt, output, logprobs, console)


def _input_problems(placement: Placement, prompt: str | None, input: Path | None,  # noqa: A002
                    output: Path | None, stop: list[str], logprobs: bool,
                    overwrite: bool = False) -> list[str]:
    """What is wrong with the prompts, the output and the stop strings."""
    from mt_data.paths import existing_file, output_clash, unwritable
    from mt_data.text import not_utf8

    problems = []
    if (prompt is None) == (input is None):
        problems.append("give --prompt TEXT or --input prompts.jsonl (one of them)")
    if prompt == "":
        problems.append("--prompt is empty")
    elif prompt is not None and (why := not_utf8(prompt)):
        problems.append(f"--prompt holds {why}: give UTF-8 text")
    if output is not None and input is None:
        problems.append("--output is for --input's results (one --prompt streams to the "
                        "terminal)")
    if logprobs and prompt is not None:
        problems.append("--logprobs writes log-probabilities into the JSONL rows of --input; "
                        "one --prompt streams text only: leave it out")
    if output is not None and input is not None and (
            clash := output_clash("--output", output, [placement.checkpoint, input])):
        problems.append(clash)
    elif output is not None and input is not None and (
            why := unwritable("--output", output) or existing_file("--output", output, overwrite)
            or existing_file("--output", output.with_name(output.name + ".sha256"),
                             overwrite)):
        problems.append(why)
    if overwrite and output is None:
        problems.append("--overwrite replaces an existing --output file: give --output too")
    if "" in stop:
        problems.append("--stop is empty: give the text to stop before")
    problems += [f"--stop holds {why}: give UTF-8 text" for why in map(not_utf8, stop) if why]
    return problems


def _generate(spec: object, console: Console) -> list[dict] | None:
    """Every prompt's row: on this process with the model whole (streamed, or with a progress
    bar), else at the placement's layout (None on ranks other than 0 under a launcher)."""
    import contextlib

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from mt_inference.generation import GenerateSpec, Generator, generate_rank
    from mt_inference.launch import launch

    assert isinstance(spec, GenerateSpec)
    place, prompt = spec.placement, spec.prompts[0] if spec.stream else None
    if not place.whole_here():
        with _streamed(prompt), contextlib.nullcontext() if spec.stream else console.status(
                f"generating at tp {place.tp} x pp {place.pp} on {place.nproc} processes"):
            return launch(spec, generate_rank)
    generator = Generator.load(place)
    spec.check_room(generator)
    if prompt is not None:
        def show(_row: int, text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        with _streamed(prompt):
            return generator.complete([prompt], spec.sampling, spec.stop, on_text=show)
    rows: list[dict] = []
    with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("prompts", total=len(spec.prompts))
        for start in range(0, len(spec.prompts), spec.batch_size):
            chunk = list(spec.prompts[start:start + spec.batch_size])
            rows += generator.complete(chunk, spec.sampling, spec.stop)
            bar.update(task, advance=len(chunk))
    return rows


@contextmanager
def _streamed(prompt: str | None) -> Iterator[None]:
    """The prompt on stdout, the completion to follow it inside; a failure first ends the
    line, so that its error line starts a line of its own."""
    if prompt is None:
        yield
        return
    sys.stdout.write(prompt)
    sys.stdout.flush()
    try:
        yield
    except BaseException:
        sys.stdout.write("\n")
        sys.stdout.flush()
        raise


def _report(rows: list[dict], prompt: str | None, output: Path | None, logprobs: bool,
            console: Console) -> None:
    """After the streamed prompt, its finish line; else the JSONL rows (--output or stdout)."""
    import json

    from mt_data.shards import atomic_write_bytes, sha256_beside

    if prompt is not None:
        row = rows[0]
        sys.stdout.write("\n")
        console.print(escape(f"[{row['finish_reason']}: {len(row['token_ids'])} tokens]"),
                      highlight=False)
        return
    text = "".join(json.dumps({k: v for k, v in r.items() if logprobs or k != "logprobs"})
                   + "\n" for r in rows)
    if output is None:
        sys.stdout.write(text)
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(output, text.encode("utf-8"))
    sums = sha256_beside(output)
    console.print(f"wrote {output}: {len(rows)} completions ({sums.name}: sha256sum -c "
                  "checks it)", highlight=False, soft_wrap=True)


app = command_app(generate_command, _HELP)
