"""`mt generate`: any checkpoint mt reads (a pretrain checkpoint at any layout, a Hugging Face
GPT-2 or Llama folder with its tokenizer, a consolidated folder), its tokenizer, and
mt-model's cached decoding (:func:`mt_model.generate`): on one process the model whole
(:meth:`Generator.load`), or at a TP x PP x DP layout (:func:`generate_rank`: each DP replica
completes its share of the prompts with its stages, :class:`StageDecoder`; rank 0 collects).

Prompts are read from a JSONL file (rows ``{"prompt": TEXT}``, each checked: the file and
line at fault are named) or given one by one; completions are cut at the first stop string
(``finish_reason`` "stop"), and stop at the tokenizer's end-of-text token.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mt_dist import LaunchInfo
from mt_eval import TaskError
from mt_eval.tasks import numbered_rows
from mt_inference.model import as_pretrain_checkpoint, load_eval_model, whole_model
from mt_inference.placement import Placement
from mt_inference.text import TextStream
from mt_model import (
    DecodeBatch,
    DecodeModel,
    DecodeRequest,
    Sampling,
    Token,
    WholeModel,
    interleave,
)
from mt_zero.precision import compute_dtype

__all__ = ["GenerateSpec", "Generator", "generate_rank", "read_prompts"]


#: Fields of an OpenAI-style request that a row might carry to set its own sampling: mt
#: generate takes those from its options, for every row. (``seed``, ``n`` or ``logprobs``
#: may be a row's own data: mt generate's output rows carry ``logprobs``.)
_REQUEST_FIELDS = ("max_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "stop")


def read_prompts(path: Path) -> list[tuple[str, str]]:
    """Where each row of a JSONL file is (``PATH:LINE``) and its ``prompt``; a TaskError
    names the line at fault, and a row setting its own sampling (``max_tokens``, ``stop``,
    ...: options mt generate takes for every row) is refused rather than run without it.
    Other fields (an id, metadata) are the user's and left alone."""
    prompts = []
    for number, row in numbered_rows(path):
        if not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise TaskError(f'{path}:{number}: a row must be {{"prompt": TEXT}} with a '
                            f"non-empty TEXT, got {json.dumps(row)[:80]}")
        if fields := [key for key in _REQUEST_FIELDS if row.get(key) is not None]:
            raise TaskError(f"{path}:{number}: the row sets {', '.join(fields)}, which mt "
                            "generate takes from its options for every row (--max-new-tokens, "
                            "--temperature, --top-k, --top-p, --stop); leave it out "
                            "and give the option, or use mt serve for per-request settings")
        prompts.append((f"{path}:{number}", row["prompt"]))
    return prompts


@dataclass
class Generator:
    """A model (whole here, or this rank's part of it) and its tokenizer, ready to complete
    text."""

    model: DecodeModel
    tokenizer: Any
    in_flight: int = 1
    """Batches in flight through a pipeline's stages at once (1, or at least the stages:
    :func:`mt_model.interleave`)."""

    @classmethod
    def load(cls, placement: Placement) -> Generator:
        """The checkpoint's full model on this process, on the placement's device in its
        precision."""
        device, precision = placement.device, placement.precision
        where = torch.device("cuda" if device == "cuda" or (
            device == "auto" and torch.cuda.is_available()) else "cpu")
        with as_pretrain_checkpoint(placement.checkpoint, placement.tokenizer) as (path, tok):
            loaded = load_eval_model(path, tok)
        return cls(WholeModel(whole_model(loaded, where, compute_dtype(precision))),
                   loaded.open_tokenizer())

    def check_room(self, prompts: Sequence[str], max_new_tokens: int,
                   sources: Sequence[str]) -> None:
        """A TaskError naming the first prompt (by its source) whose tokens and
        ``max_new_tokens`` new ones exceed the model's positions."""
        positions = self.model.max_positions
        for prompt, source in zip(prompts, sources, strict=True):
            count = len(self.tokenizer.encode(prompt))
            if count + max_new_tokens > positions:
                raise TaskError(f"{source}: a prompt of {count} tokens + {max_new_tokens} new "
                                f"tokens exceed the model's {positions} positions: lower "
                                "--max-new-tokens or shorten the prompt")

    def complete(self, prompts: Sequence[str], sampling: Sampling, stop: Sequence[str] = (),
                 on_text: Callable[[int, str], None] | None = None) -> list[dict[str, Any]]:
        """One result row per prompt: ``prompt``, ``completion``, ``token_ids`` (the new
        tokens), ``logprobs`` and ``finish_reason``; ``on_text(row, text)`` streams each
        row's new text as it is decoded. Decoding stops at the tokenizer's end-of-text."""
        tok = self.tokenizer
        ids = [tok.encode(p) for p in prompts]
        empty = [i for i, row in enumerate(ids) if not row]
        if empty:
            raise TaskError(f"prompt {empty[0] + 1} encodes to no tokens")
        rule = Sampling(sampling.max_new_tokens, sampling.temperature, sampling.top_k,
                        sampling.top_p, sampling.seed,
                        tuple(sorted({*sampling.stop_ids, tok.eod_id})))
        rows = self.complete_ids(ids, [rule] * len(ids), [stop] * len(ids), on_text)
        return [{"prompt": prompt, **row} for prompt, row in zip(prompts, rows, strict=True)]

    def complete_ids(self, prompts: Sequence[Sequence[int]], rules: Sequence[Sampling],
                     stops: Sequence[Sequence[str]],
                     on_text: Callable[[int, str], None] | None = None
                     ) -> list[dict[str, Any]]:
        """:meth:`complete` for prompts given as token ids, each with its own rule and stop
        strings. A completion stops at its first stop string (its decoding too: every rank
        sees the same tokens, so all stop it together)."""
        model = self.model
        # Past the prompts (or the stages, that interleave needs) the batches would be empty
        count = min(self.in_flight, max(len(prompts), model.stages))
        batches = [DecodeBatch(model) for _ in range(count)]
        for start, batch in enumerate(batches):
            rows = list(range(start, len(prompts), count))
            if rows:
                batch.add([DecodeRequest(tuple(prompts[r]), rules[r]) for r in rows], rows)
        streams = [TextStream(self.tokenizer.decode, stop) for stop in stops]
        logprobs: list[list[float]] = [[] for _ in prompts]
        reasons = ["length"] * len(prompts)

        def show(row: int, text: str) -> None:
            if text and on_text is not None:
                on_text(row, text)

        def on_tokens(events: list[Token]) -> list[int]:
            stopped = []
            for event in events:
                row, stream = int(event.key), streams[int(event.key)]  # type: ignore[call-overload]
                if event.token is not None:
                    logprobs[row].append(event.logprob)
                    show(row, stream.push(event.token))
                if stream.stopped and event.finish is None:
                    stopped.append(row)
                if event.finish is not None or stream.stopped:
                    reasons[row] = "stop" if stream.stopped else str(event.finish)
                    show(row, stream.flush())
            return stopped

        interleave(batches, model.stage, model.stages, on_tokens)
        flush = getattr(model, "flush", None)
        if flush is not None:
            flush()
        return [{"completion": stream.text, "token_ids": stream.tokens[:stream.kept()],
                 "logprobs": lp[:stream.kept()], "finish_reason": reason}
                for stream, lp, reason in zip(streams, logprobs, reasons, strict=True)]


@dataclass(frozen=True)
class GenerateSpec:
    """One `mt generate` run over several processes (the command's options)."""

    placement: Placement
    prompts: tuple[str, ...]
    sampling: Sampling
    stop: tuple[str, ...] = ()
    batch_size: int = 8
    stream: bool = False
    """Write the (one) prompt's completion to stdout as it comes (rank 0)."""
    in_flight: int = 1
    sources: tuple[str, ...] = ()
    """Where each prompt comes from (``PATH:LINE``, ``--prompt``), for errors that name it."""

    def check_room(self, generator: Generator) -> None:
        """Every prompt fits the model with its new tokens (checked before any decoding)."""
        sources = self.sources or tuple(f"prompt {i + 1}" for i in range(len(self.prompts)))
        generator.check_room(self.prompts, self.sampling.max_new_tokens, sources)


def generate_rank(spec: GenerateSpec, info: LaunchInfo) -> list[dict[str, Any]] | None:
    """This rank's part of ``spec``: DP replica ``r`` completes prompts ``r, r + dp, ...`` in
    batches; returns every prompt's row on rank 0, None elsewhere."""
    import sys

    import torch.distributed as dist

    from mt_inference.decoder import StageDecoder
    from mt_inference.session import ScoringSession

    session = ScoringSession(spec.placement, info)
    completed = False
    try:
        generator = Generator(StageDecoder(session), session.tokenizer, spec.in_flight)
        spec.check_room(generator)
        groups = session.groups
        mine = list(range(groups.dp_rank, len(spec.prompts), groups.dp_size))

        def show(_row: int, text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        rows: list[tuple[int, dict[str, Any]]] = []
        for start in range(0, len(mine), spec.batch_size):
            chunk = mine[start:start + spec.batch_size]
            done = generator.complete([spec.prompts[i] for i in chunk], spec.sampling,
                                      spec.stop, on_text=show if spec.stream and
                                      session.is_main else None)
            rows += zip(chunk, done, strict=True)
        everyone: list[Any] = [None] * groups.topology.world_size
        dist.all_gather_object(everyone, rows if groups.is_last_stage and groups.tp_rank == 0
                               else [])
        completed = True
        if not session.is_main:
            return None
        return [row for _, row in sorted((pair for part in everyone for pair in part),
                                         key=lambda pair: pair[0])]
    finally:
        session.close(completed)
