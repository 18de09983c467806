"""Issue 42, "a fresh count of your own": every `mt` command as a hostile new user runs it.

Each case runs in process (typer's CliRunner on the root `mt` app, `mt convert` mounted as
`mt` mounts it) in a folder of its own, under an alarm, and must meet the bar of DESIGN.md's
"Trust": exit 2 for bad input, no traceback and no exception escaping, exactly one error line
(``error: ...``, or click's one usage-error panel) naming what is at fault, nothing the user
gave modified or deleted (every file of the case folder, and the shared checkpoint, export
and dataset, hashed before and after), nothing unpickled or written outside the output, and
no hang (an alarm fails the case). The cases needing a model or a dataset share one tiny
GPT trained once and one dataset prepared once (module fixtures).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import random
import shlex
import shutil
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from e2e_models import single_threaded, trained_gpt2_vocab
from mt_cli import app
from typer.testing import CliRunner

HUGE = str(2**70)  # beyond every integer type: int64, C int, size_t
BIN = bytes(range(256)) * 4  # not UTF-8 (0x80 at offset 128), not JSON, not YAML, not Arrow
ALARM_S = 60
WORDS = ("the whale swam far across the grey sea while the men on the ship watched it go and "
         "spoke of home").split()
MC = '{"context": "The sea is", "choices": [" wet", " dry"], "label": 0}\n'
PROMPT = '{"prompt": "The whale"}\n'
GPU = "peak_tflops: 100\nmemory_gb: 80\nnvlink_gb_per_s: 300\nib_gb_per_s: 25\n"
GPT = "n_layers: 2\nhidden: 64\nn_heads: 4\nvocab_size: 100\nseq_len: 32\n"
PRETRAIN = "--nproc 1 --train-steps 1 --save none --sample-tokens 0 --eval-interval 0"


class Hang(Exception):
    """The case's alarm went off."""


Setup = Callable[[Path, dict[str, Path]], None]


@dataclass(frozen=True)
class Case:
    """One command line (``{t}`` the case folder, ``{ck}`` the checkpoint, ``{hf}`` its
    Hugging Face export, ``{ds}`` the prepared dataset, ``{corpus}`` its text, ``{metrics}``
    the run's metrics file), the user's files it finds (bytes, text or a setup function of
    the path and the shared fixtures), and what its one error line must say."""

    id: str
    args: str
    says: str | tuple[str, ...]
    files: dict[str, bytes | str | Setup] = field(default_factory=dict)
    code: int = 2
    never: tuple[str, ...] = ()
    """Paths that must not exist afterwards (what an unpickled payload would create)."""


def copy_of(name: str, *edits: Callable[[Path], Any]) -> Setup:
    """A copy of the shared ``name`` folder (ck, hf, ds) with ``edits`` applied."""
    def setup(path: Path, world: dict[str, Path]) -> None:
        shutil.copytree(world[name], path, ignore=shutil.ignore_patterns("cache", ".*.lock"))
        for edit in edits:
            edit(path)
    return setup


def cut(name: str, keep: int) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_bytes((folder / name).read_bytes()[:keep])


def put(name: str, data: bytes | str) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        if isinstance(data, bytes):
            (folder / name).write_bytes(data)
        else:
            (folder / name).write_text(data)
    return edit


def json_edit(name: str, **changes: Any) -> Callable[[Path], None]:
    import json

    def edit(folder: Path) -> None:
        record = json.loads((folder / name).read_text())
        for key, value in changes.items():
            if key == "shard0":
                record["shards"][0].update(value)
            else:
                record[key] = value
        (folder / name).write_text(json.dumps(record))
    return edit


def link(target: str) -> Setup:
    return lambda path, world: path.symlink_to(path.parent / target)


class Payload:
    """Unpickled, it would create the folder ``marker`` (a stand-in for any code)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.mkdir, (self.marker,)


def payload(name: str, marker: str) -> Setup:
    """A file ``name`` in a copy of the HF export (its weights removed): a torch pickle that
    would run code when unpickled."""
    def setup(path: Path, world: dict[str, Path]) -> None:
        shutil.copytree(world["hf"], path)
        (path / "model.safetensors").unlink()
        torch.save({"transformer.wte.weight": Payload(str(path.parent / marker))}, path / name)
    return setup


def corpus_text(docs: int = 40, words: int = 60) -> str:
    """Plain text of varied lines (the quality filters keep it)."""
    draw = random.Random(docs)
    return "\n".join(" ".join(draw.choice(WORDS) for _ in range(words)) + "."
                     for _ in range(docs))


C = Case
CASES = [
    # --- mt pretrain: link loops, metrics that are no file or where checkpoints go -------------
    C("link-pretrain-out-dir-loop", f"pretrain --out-dir {{t}}/a {PRETRAIN}",
      "--out-dir {t}/a: a symbolic link on the way loops back on itself",
      {"a": link("b"), "b": link("a")}),
    C("link-pretrain-load-loop", "pretrain --load {t}/a --dry-run",
      "--load {t}/a: a symbolic link on the way loops back on itself",
      {"a": link("b"), "b": link("a")}),
    C("path-pretrain-metrics-device", f"pretrain --metrics /dev/full {PRETRAIN}",
      "--metrics /dev/full is not a regular file"),
    C("clash-pretrain-metrics-is-latest", "pretrain --out-dir {t}/run --metrics "
      "{t}/run/checkpoints/latest --train-steps 1 --sample-tokens 0 --eval-interval 0",
      "lies where the checkpoints of {t}/run/checkpoints go (latest)"),
    # --- `mt --help`-level: unknown commands and options, missing and malformed values -------
    C("root-unknown-command", "nosuch", "No such command 'nosuch'"),
    C("root-data-unknown-command", "data nosuch", "No such command 'nosuch'"),
    C("root-flag-missing-value", "pretrain --tp", "Option '--tp' requires an argument"),
    C("root-hex-int", "pretrain --tp 0x10 --dry-run", "Invalid value for '--tp'"),
    C("root-float-for-int", "plan --model tiny --tp 1e999", "Invalid value for '--tp'"),
    C("root-text-for-float", "pretrain --lr 1e-3x", "Invalid value for '--lr'"),
    C("root-empty-int", "pretrain --tp= --dry-run", "Invalid value for '--tp'"),
    C("root-extra-argument", "pretrain -- --tp", "unexpected extra argument"),
    C("root-convert-extra-argument", "convert a b c", "No such command 'c'"),
    C("root-convert-format-choice", "convert {hf} {t}/out --from onnx",
      "Invalid value for '--from'"),

    # --- wrong types and shapes in YAML / JSON the user gives ----------------------------------
    C("yaml-pretrain-list-key", "pretrain --config {t}/c.yaml", "line 1: a key must be a name",
      {"c.yaml": "? [a, b]\n: 2\n"}),
    C("yaml-pretrain-date-for-str", "pretrain --config {t}/c.yaml",
      "prompt must be a string, got datetime.date", {"c.yaml": "prompt: 2024-01-01\n"}),
    C("yaml-pretrain-list-for-str", "pretrain --config {t}/c.yaml",
      "split must be a string, got [969, 30, 1]", {"c.yaml": "split: [969, 30, 1]\n"}),
    C("yaml-pretrain-bool-for-int", "pretrain --config {t}/c.yaml",
      "tp must be an integer, got True", {"c.yaml": "tp: true\n"}),
    C("yaml-pretrain-list-for-float", "pretrain --config {t}/c.yaml", "lr must be a number",
      {"c.yaml": "lr: [1]\n"}),
    C("yaml-pretrain-tab", "pretrain --config {t}/c.yaml", "line 2, column 1: YAML syntax",
      {"c.yaml": "parallel:\n\ttp: 2\n"}),
    C("yaml-pretrain-section-list", "pretrain --config {t}/c.yaml",
      "train is a section of fields", {"c.yaml": "train: [1, 2]\n"}),
    C("yaml-plan-float-layers", "plan --config {t}/c.yaml", "n_layers must be a positive int, "
      "got 2.5", {"c.yaml": GPT.replace("n_layers: 2", "n_layers: 2.5")}),
    C("yaml-plan-bool-layers", "plan --config {t}/c.yaml", "n_layers must be a positive int, "
      "got True", {"c.yaml": GPT.replace("n_layers: 2", "n_layers: true")}),
    C("yaml-plan-list", "plan --config {t}/c.yaml", "expected a mapping of GPTConfig fields",
      {"c.yaml": "- 1\n- 2\n"}),
    C("yaml-plan-scalar", "plan --config {t}/c.yaml", "expected a mapping of GPTConfig fields",
      {"c.yaml": "hello\n"}),
    C("yaml-plan-pretrain-model-list", "plan --config {t}/c.yaml", "model must be a string",
      {"c.yaml": "model: [1, 2]\n"}),
    C("yaml-gpu-list", "plan --model tiny --gpu {t}/g.yaml", "expected a mapping of",
      {"g.yaml": "- 1\n"}),
    C("yaml-gpu-empty", "plan --model tiny --gpu {t}/g.yaml", "expected a mapping of",
      {"g.yaml": ""}),
    C("yaml-gpu-text-number", "plan --model tiny --gpu {t}/g.yaml",
      "peak_tflops must be a number, got 'fast'",
      {"g.yaml": GPU.replace("100", "fast") + "gpus_per_node: 8\n"}),
    C("yaml-gpu-syntax", "plan --model tiny --gpu {t}/g.yaml", "g.yaml line 2: not YAML",
      {"g.yaml": "peak_tflops: [1\nmemory_gb: 80\n"}),
    C("yaml-probes-list", "bias {ck} -o {t}/r --no-likelihood --probes {t}/p.yaml",
      "needs an 'occupation' probe, a 'groups' probe", {"p.yaml": "- a\n- b\n"}),
    C("yaml-probes-key-twice", "bias {ck} -o {t}/r --no-likelihood --probes {t}/p.yaml",
      "p.yaml: not a readable probes YAML file: line 3, column 1: occupation is given twice; "
      "keep one", {"p.yaml": "occupation:\n  templates: ['The {occupation} was a']\n"
                   "occupation:\n  templates: ['A {occupation} is']\n"}),
    C("yaml-probes-group-twice", "bias {ck} -o {t}/r --no-likelihood --probes {t}/p.yaml",
      "line 5, column 5: female is given twice; keep one",
      {"p.yaml": "groups:\n  gender:\n    female: [She was]\n    male: [He was]\n"
                 "    female: [She is]\n"}),
    C("yaml-probes-lone-surrogate", "bias {ck} -o {t}/r --no-likelihood --probes {t}/p.yaml",
      "p.yaml: prompt 'She \\ud800 was' holds a lone surrogate \\ud800 at character 4",
      {"p.yaml": 'groups:\n  gender:\n    female: ["She \\ud800 was"]\n    male: [He was]\n'}),
    C("yaml-task-key-twice", "eval {ck} --task {t}/t.yaml --engine mt",
      "t.yaml: not YAML (line 2, column 1: task is given twice; keep one)",
      {"t.yaml": "task: a\ntask: b\n"}),
    C("yaml-task-list", "eval {ck} --task {t}/t.yaml --engine mt",
      "a task file must be a YAML mapping", {"t.yaml": "- 1\n"}),
    C("json-hf-config-list", "convert {t}/h {t}/out", "config.json: expected a JSON object",
      {"h": copy_of("hf", put("config.json", "[1]"))}),
    C("json-hf-config-text-layers", "convert {t}/h {t}/out",
      "n_layers must be a positive int, got 'four'",
      {"h": copy_of("hf", json_edit("config.json", n_layer="four"))}),
    C("json-group-words-list", "data prepare {t}/a.txt -o {t}/out --group-words {t}/g.json",
      'needs "dimensions"', {"a.txt": corpus_text(), "g.json": "[1, 2]"}),
    C("json-bias-group-words-empty", "bias {ck} -o {t}/r --no-likelihood --group-words "
      "{t}/g.json", 'needs "dimensions"', {"g.json": '{"dimensions": {}, "occupations": []}'}),
    C("json-prompts-list-row", "generate {ck} --input {t}/p.jsonl", "p.jsonl:1: a row must be "
      "a JSON object, got list", {"p.jsonl": "[1, 2]\n"}),
    C("json-prompts-int-prompt", "generate {ck} --input {t}/p.jsonl",
      'p.jsonl:1: a row must be {{"prompt": TEXT}}', {"p.jsonl": '{"prompt": 5}\n'}),
    C("json-prompts-not-json", "generate {ck} --input {t}/p.jsonl", "p.jsonl:1: not JSON",
      {"p.jsonl": "The whale\n"}),
    C("json-prompts-row-sampling", "generate {ck} --input {t}/p.jsonl",
      "p.jsonl:2: the row sets max_tokens, stop, which mt generate takes from its options",
      {"p.jsonl": '{"prompt": "a", "id": 1}\n{"prompt": "a", "max_tokens": 3, "stop": "x"}\n'}),
    C("json-task-label-text", "eval {ck} --task {t}/t.jsonl",
      "t.jsonl:1: 'label' must be an index into the 2 choices, got '0'",
      {"t.jsonl": MC.replace('"label": 0', '"label": "0"')}),
    C("json-task-no-choices", "eval {ck} --task {t}/t.jsonl", "into the 0 choices",
      {"t.jsonl": '{"context": "a", "choices": [], "label": 0}\n'}),
    C("json-task-mixed-rows", "eval {ck} --task {t}/t.jsonl", "t.jsonl:2: field 'context' is "
      "missing", {"t.jsonl": MC + '{"text": "the whale"}\n'}),
    C("json-prepare-text-not-string", "data prepare {t}/a.jsonl -o {t}/out --on-error stop "
      "--tokenizer tokenizer-1k --workers 1", "a.jsonl:1: not_text: 'text' is int",
      {"a.jsonl": '{"text": 5}\n'}),
    C("json-index-tokenizer-empty", "data inspect {t}/d", "field 'tokenizer' lacks name",
      {"d": copy_of("ds", json_edit("index.json", tokenizer={}))}),
    C("json-index-sources-shape", "data inspect {t}/d", "source 'x' must record its documents",
      {"d": copy_of("ds", json_edit("index.json", sources={"x": 5}))}),
    C("json-index-documents-text", "data inspect {t}/d", "field 'documents' missing or not",
      {"d": copy_of("ds", json_edit("index.json", documents="many"))}),

    # --- negative and zero numbers --------------------------------------------------------------
    C("neg-plan-top", "plan --model tiny --search --gpus 8 --top -1",
      "--top must be a positive integer, got -1"),
    C("neg-matrix-steps", "matrix --steps -3 --list", "--steps must be a positive integer"),
    C("neg-pretrain-save-interval", "pretrain --save-interval -1 --dry-run --train-steps 2",
      "--save-interval must be >= 0, got -1"),
    C("zero-pretrain-keep-last", "pretrain --keep-last 0 --dry-run --train-steps 2",
      "--keep-last must be a positive integer, got 0"),
    C("zero-pretrain-exit-interval", "pretrain --exit-interval 0 --dry-run --train-steps 2",
      "--exit-interval must be a positive integer, got 0"),
    C("zero-pretrain-eval-task-limit", "pretrain --eval-task-limit 0 --dry-run",
      "--eval-task-limit must be a positive integer, got 0"),
    C("neg-prepare-min-chars", "data prepare {t}/a.txt -o {t}/out --min-chars -5",
      "min_chars (-5)", {"a.txt": corpus_text()}),
    C("neg-prepare-html-ratio", "data prepare {t}/a.txt -o {t}/out --max-html-ratio -1",
      "max_html_tag_ratio must be >= 0, got -1.0", {"a.txt": corpus_text()}),
    C("zero-prepare-bands", "data prepare {t}/a.txt -o {t}/out --bands 0",
      "num_perm (128) must be a positive multiple of bands (0)", {"a.txt": corpus_text()}),
    C("zero-prepare-decontam-ngram", "data prepare {t}/a.txt -o {t}/out --decontaminate "
      "{t}/e.jsonl --decontam-ngram 0", "need ngram (0) >= 1",
      {"a.txt": corpus_text(), "e.jsonl": '{"text": "a b c"}\n'}),
    C("neg-train-tokenizer-min-frequency", "data train-tokenizer {corpus} --vocab-size 300 "
      "--min-frequency -1 -o {t}/tok.json", "min_frequency must be between 0 and 2**32 - 1, "
      "got -1"),
    C("zero-train-tokenizer-vocab", "data train-tokenizer {corpus} --vocab-size 0 "
      "-o {t}/tok.json", "vocab_size 0 is too small"),
    C("zero-convert-tp", "convert {hf} {t}/out --tp 0", "Invalid value for '--tp'"),
    C("zero-generate-max-new", "generate {ck} --prompt The --max-new-tokens 0",
      "--max-new-tokens must be >= 1, got 0"),
    C("neg-generate-top-k", "generate {ck} --prompt The --top-k -1 --temperature 1",
      "--top-k must be >= 0, got -1"),
    C("zero-generate-top-p", "generate {ck} --prompt The --top-p 0 --temperature 1",
      "--top-p must be in (0, 1], got 0.0"),
    C("neg-generate-temperature", "generate {ck} --prompt The --temperature -1",
      "--temperature must be a finite number >= 0, got -1.0"),
    C("zero-eval-limit", "eval {ck} --task mt-cloze --limit 0", "--limit must be positive, "
      "got 0"),
    C("neg-serve-port", "serve {ck} --port -1", "--port must be 0..65535, got -1"),
    C("zero-serve-request-timeout", "serve {ck} --request-timeout 0",
      "--request-timeout must be positive, got 0.0"),
    C("huge-serve-max-tokens", "serve {ck} --port 0 --max-tokens 64", "--max-tokens 64 "
      "would never apply: the model's 64 positions leave 63 new tokens at most"),
    C("neg-serve-max-waiting", "serve {ck} --max-waiting -1", "--max-waiting must be positive"),
    C("zero-serve-max-body", "serve {ck} --max-body-bytes 0", "--max-body-bytes must be "
      "positive"),
    C("zero-serve-tp", "serve {ck} --tp 0", "--tp must be positive, got 0"),
    C("zero-bias-batch-size", "bias {ck} -o {t}/r --no-likelihood --batch-size 0",
      "--batch-size must be positive, got 0"),
    C("zero-bias-max-new", "bias {ck} -o {t}/r --no-likelihood --max-new-tokens 0",
      "--max-new-tokens must be >= 1, got 0"),

    # --- huge numbers (2**70 and its kin) -------------------------------------------------------
    C("huge-plot-integer", "plot {t}/m.jsonl -o {t}/o.png", "m.jsonl:1: loss is 1000",
      {"m.jsonl": '{"step": 1, "loss": 1' + "0" * 400 + '}\n'}),
    C("huge-plan-top", "plan --model tiny --search --gpus 8 --top {huge}",
      "--top must be below 2**63"),
    C("huge-plan-gpt-layers", "plan --config {t}/c.yaml", "n_layers must be at most 65,536",
      {"c.yaml": GPT.replace("n_layers: 2", "n_layers: " + HUGE)}),
    C("huge-matrix-steps", "matrix --steps {huge} --noise-floor",
      "--steps must be below 2**63"),
    C("huge-pretrain-nproc", "pretrain --nproc 4611686018427387904 --dry-run", "at most 1,048,576"),
    C("huge-pretrain-yaml-steps", "pretrain --config {t}/c.yaml",
      "--train-steps must be below 2**63", {"c.yaml": "train_steps: " + HUGE}),
    C("huge-prepare-workers", "data prepare {t}/a.txt -o {t}/out --workers {huge}",
      "--workers must be at most 1,024", {"a.txt": corpus_text()}),
    C("huge-prepare-num-perm", "data prepare {t}/a.txt -o {t}/out --num-perm {huge}",
      "num_perm must be at most 65,536", {"a.txt": corpus_text()}),
    C("huge-train-tokenizer-vocab", "data train-tokenizer {corpus} --vocab-size {huge} "
      "-o {t}/tok.json", "is too large: token ids are stored as uint32"),
    C("huge-train-tokenizer-min-frequency", "data train-tokenizer {corpus} --vocab-size 300 "
      "--min-frequency {huge} -o {t}/tok.json", "min_frequency must be between 0"),
    C("huge-inspect-document", "data inspect {ds} --document {huge}",
      "holds documents 0 to 0"),
    C("huge-index-max-id", "data inspect {t}/d", "max_token_id 1180591620717411303424",
      {"d": copy_of("ds", json_edit("index.json", max_token_id=2**70))}),
    C("huge-convert-tp", "convert {hf} {t}/out --tp {huge}", "n_heads 4 is not divisible"),
    C("huge-convert-pad-multiple", "convert {hf} {t}/out --tp 1 --pad-multiple {huge}",
      "--pad-multiple must be between 1 and 65,536"),
    C("huge-hf-config-layers", "convert {t}/h {t}/out", "n_layers must be at most 65,536",
      {"h": copy_of("hf", json_edit("config.json", n_layer=2**70))}),
    C("huge-generate-nproc", "generate {ck} --prompt The --nproc {huge}",
      "--nproc must be at most 1,048,576 processes"),
    C("huge-generate-tp", "generate {ck} --prompt The --tp {huge} --nproc {huge}",
      "--tp x --pp must be at most 1,048,576"),
    C("huge-generate-max-new", "generate {ck} --prompt The --max-new-tokens {huge}",
      "exceed the model's 64 positions"),
    C("huge-generate-in-flight", "generate {ck} --prompt The --pp 2 --nproc 2 --in-flight "
      "{huge}", f"--in-flight {HUGE} splits each batch of --batch-size 8 prompts into {HUGE}: "
      "give at most 8"),
    C("huge-eval-shots", "eval {ck} --task {t}/t.jsonl --shots {huge} --limit 1",
      "examples asked, but the pool holds 2 documents",
      {"t.jsonl": "".join(MC.replace("sea", w) for w in ("sea", "sky", "cat"))}),
    C("huge-eval-nproc", "eval {ck} --task mt-cloze --nproc {huge}", "--nproc must be at "
      "most"),
    C("huge-serve-port", "serve {ck} --port {huge}", "--port must be 0..65535"),
    C("huge-serve-max-batch", "serve {ck} --max-batch {huge}",
      "--max-batch must be below 2**63"),
    C("huge-serve-max-body", "serve {ck} --max-body-bytes {huge}",
      "--max-body-bytes must be below 2**63"),
    C("huge-bias-max-new", "bias {ck} -o {t}/r --no-likelihood --max-new-tokens {huge}",
      "exceed the model's 64 positions"),
    C("huge-bias-probes", "bias {ck} -o {t}/r --no-likelihood --samples 10000 --probes "
      "{t}/p.yaml", "--samples 10,000 x 300 prompts = 3,000,000 continuations: at most "
      "2,500,000 a run", {"p.yaml": "occupation:\n  templates: ['The {occupation} was a']\n"
                          f"  occupations: [{', '.join(f'o{k}' for k in range(300))}]\n"}),
    C("huge-bias-nproc", "bias {ck} -o {t}/r --no-likelihood --nproc {huge}",
      "--nproc must be at most"),

    # --- nan, inf and 1e999 ---------------------------------------------------------------------
    C("nan-plot-value", "plot {t}/m.jsonl -o {t}/o.png", "m.jsonl:1: loss is nan",
      {"m.jsonl": '{"step": 1, "loss": NaN}\n'}),
    C("inf-plot-1e999", "plot {t}/m.jsonl -o {t}/o.png", "m.jsonl:1: loss is inf",
      {"m.jsonl": '{"step": 1, "loss": 1e999}\n'}),
    C("nan-gpu-yaml", "plan --model tiny --gpu {t}/g.yaml", "these must be positive: "
      "peak_flops nan", {"g.yaml": GPU.replace("100", ".nan") + "gpus_per_node: 8\n"}),
    C("nan-gpt-yaml-eps", "plan --config {t}/c.yaml", "layernorm_eps must be a finite number",
      {"c.yaml": GPT + "layernorm_eps: .nan\n"}),
    C("nan-pretrain-yaml-steps", "pretrain --config {t}/c.yaml",
      "train_steps must be an integer, got nan", {"c.yaml": "train_steps: .nan\n"}),
    C("inf-pretrain-yaml-1e999", "pretrain --config {t}/c.yaml",
      "train_steps must be an integer, got inf", {"c.yaml": "train_steps: 1e999\n"}),
    C("nan-pretrain-min-lr", "pretrain --min-lr nan --dry-run --train-steps 2",
      "--min-lr nan must be in [0, lr"),
    C("inf-pretrain-weight-decay", "pretrain --weight-decay inf --dry-run --train-steps 2",
      "--weight-decay must be >= 0, got inf"),
    C("nan-pretrain-beta2", "pretrain --adam-beta2 nan --dry-run --train-steps 2",
      "--adam-beta2 must be in [0, 1)"),
    C("nan-pretrain-eps", "pretrain --adam-eps nan --dry-run --train-steps 2",
      "--adam-eps must be > 0"),
    C("nan-pretrain-clip", "pretrain --clip-grad nan --dry-run --train-steps 2",
      "--clip-grad must be >= 0, got nan"),
    C("inf-pretrain-lr-1e999", "pretrain --lr 1e999 --dry-run --train-steps 2",
      "--lr must be a finite number > 0, got inf"),
    C("nan-pretrain-exit-duration", "pretrain --exit-duration nan --dry-run --train-steps 2",
      "--exit-duration must be > 0 minutes, got nan"),
    C("nan-pretrain-peak-tflops", "pretrain --peak-tflops nan --dry-run --train-steps 2",
      "--peak-tflops must be > 0, got nan"),
    C("nan-pretrain-blend-weight", "pretrain --data 'nan {ds}' --dry-run",
      "blend weights must be finite numbers >= 0"),
    C("inf-pretrain-blend-weight", "pretrain --data 'inf {ds} 1 {ds}' --dry-run",
      "blend weights must be finite numbers >= 0"),
    C("nan-prepare-symbol-ratio", "data prepare {t}/a.txt -o {t}/out --max-symbol-ratio nan",
      "max_symbol_ratio must be >= 0, got nan", {"a.txt": corpus_text()}),
    C("inf-prepare-alpha-words", "data prepare {t}/a.txt -o {t}/out --min-alpha-words inf",
      "min_alpha_word_fraction is a fraction", {"a.txt": corpus_text()}),
    C("nan-prepare-repeated-lines", "data prepare {t}/a.txt -o {t}/out "
      "--max-repeated-lines nan", "max_repeated_line_fraction is a fraction",
      {"a.txt": corpus_text()}),
    C("nan-prepare-threshold", "data prepare {t}/a.txt -o {t}/out --threshold nan",
      "threshold must be in (0, 1], got nan", {"a.txt": corpus_text()}),
    C("nan-hf-config-eps", "convert {t}/h {t}/out", "layernorm_eps must be a finite number",
      {"h": copy_of("hf", json_edit("config.json", layer_norm_epsilon=float("nan")))}),
    C("nan-generate-temperature", "generate {ck} --prompt The --temperature nan",
      "--temperature must be a finite number >= 0, got nan"),
    C("inf-generate-temperature", "generate {ck} --prompt The --temperature inf",
      "--temperature must be a finite number >= 0, got inf"),
    C("nan-generate-top-p", "generate {ck} --prompt The --top-p nan --temperature 1",
      "--top-p must be in (0, 1], got nan"),
    C("nan-serve-request-timeout", "serve {ck} --request-timeout nan",
      "--request-timeout must be positive, got nan"),
    C("inf-serve-request-timeout", "serve {ck} --request-timeout inf",
      "--request-timeout must be positive, got inf"),
    C("nan-bias-temperature", "bias {ck} -o {t}/r --no-likelihood --temperature nan",
      "--temperature must be a finite number >= 0, got nan"),
    C("nan-bias-top-p", "bias {ck} -o {t}/r --no-likelihood --top-p nan",
      "--top-p must be in (0, 1], got nan"),

    # --- empty strings --------------------------------------------------------------------------
    C("empty-pretrain-model", "pretrain --model '' --dry-run --train-steps 2",
      "--model is empty"),
    C("empty-pretrain-yaml-model", "pretrain --config {t}/c.yaml --dry-run",
      "--model is empty", {"c.yaml": "model: ''\n"}),
    C("empty-pretrain-eval-task", "pretrain --eval-task , --dry-run --train-steps 2",
      "--eval-task ',' names no task"),
    C("empty-pretrain-data", "pretrain --data '' --dry-run", "--data '': blend weights"),
    C("empty-pretrain-tokenizer", "pretrain --tokenizer '' --dry-run --train-steps 2",
      "--tokenizer: . holds neither tokenizer.json"),
    C("empty-plan-model", "plan --model ''", "unknown GPT preset ''"),
    C("empty-plan-gpu", "plan --model tiny --gpu ''", "unknown GPU type ''"),
    C("empty-matrix-only", "matrix --only '' --list", "--only is empty"),
    C("empty-matrix-set", "matrix --set '' --list", "--set must be one of"),
    C("empty-plot-key", "plot {metrics} -o {t}/o.png --key ''", "no '' values against 'step'"),
    C("empty-prepare-text-key", "data prepare {t}/a.jsonl -o {t}/out --text-key '' "
      "--tokenizer tokenizer-1k --workers 1", "no line has the '' field",
      {"a.jsonl": '{"text": "hello"}\n'}),
    C("empty-prepare-filters", "data prepare {t}/a.txt -o {t}/out --filters ''",
      "no rule set named in ''", {"a.txt": corpus_text()}),
    C("empty-inspect-dropped", "data inspect {ds} --dropped ''", "no rule ''"),
    C("empty-export-prefix", "data export-megatron {ds} ''", "PREFIX . is a folder"),
    C("empty-generate-prompt-row", "generate {ck} --input {t}/p.jsonl",
      'p.jsonl:1: a row must be {{"prompt": TEXT}} with a non-empty TEXT',
      {"p.jsonl": '{"prompt": ""}\n'}),
    C("empty-eval-task", "eval {ck} --task ''", "--task is empty"),
    C("empty-serve-host", "serve {ck} --host ''", "--host is empty"),
    C("empty-serve-model-name", "serve {ck} --model-name ''", "--model-name is empty"),
    C("empty-serve-api-key", "serve {ck} --api-key ''", "--api-key (or MT_API_KEY) must be "
      "printable ASCII"),

    # --- missing paths, files for folders and folders for files, paths under a file ------------
    C("path-pretrain-config-folder", "pretrain --config {t}", "is a directory"),
    C("path-pretrain-metrics-under-file", f"pretrain --metrics {{t}}/f/m.jsonl {PRETRAIN} "
      "--out-dir {t}/run", "--metrics {t}/f/m.jsonl: {t}/f is a file, not a folder",
      {"f": "precious"}),
    C("path-pretrain-cache-under-file", f"pretrain --cache-dir {{t}}/f/c {PRETRAIN} "
      "--out-dir {t}/run", "--cache-dir {t}/f/c: {t}/f is a file, not a folder",
      {"f": "precious"}),
    C("path-pretrain-out-dir-under-file", f"pretrain --out-dir {{t}}/f/run {PRETRAIN}",
      "--out-dir {t}/f/run: {t}/f is a file", {"f": "precious"}),
    C("path-pretrain-load-hf", "pretrain --load {hf} --dry-run", "neither meta.json nor latest"),
    C("path-plan-config-folder", "plan --config {t}", "config file {t} not found"),
    C("path-plan-gpu-missing", "plan --model tiny --gpu {t}/nope.yaml",
      "GPU description file {t}/nope.yaml not found"),
    C("path-plan-calibrate-under-file", "plan --model tiny --calibrate {t}/f/cal.yaml",
      "--calibrate {t}/f/cal.yaml: {t}/f is a file, not a folder", {"f": "precious"}),
    C("path-plan-calibrate-folder", "plan --model tiny --calibrate {t}/d",
      "--calibrate {t}/d is a folder", {"d/keep": "mine"}),
    C("path-matrix-markdown-folder", "matrix --markdown {t} --only NOPE",
      "--markdown {t} is a folder"),
    C("path-plot-missing", "plot {t}/nope.jsonl -o {t}/o.png", "does not exist"),
    C("path-plot-output-folder", "plot {metrics} -o {t}/d.png", "--output {t}/d.png is a folder",
      {"d.png/keep": "mine"}),
    C("path-prepare-output-under-file", "data prepare {t}/a.txt -o {t}/f/out",
      "--output {t}/f/out: {t}/f is a file, not a folder",
      {"a.txt": corpus_text(), "f": "precious"}),
    C("path-prepare-input-empty-folder", "data prepare {t}/d -o {t}/out --tokenizer "
      "tokenizer-1k --workers 1", "no readable input files among the 0 found",
      {"d/.hidden": "x"}),
    C("path-prepare-group-words-folder", "data prepare {t}/a.txt -o {t}/out --group-words "
      "{t}/d", "not a readable group-words JSON file", {"a.txt": corpus_text(), "d/x": "x"}),
    C("path-train-tokenizer-output-under-file", "data train-tokenizer {corpus} --vocab-size 300 "
      "-o {t}/f/tok.json", "--output {t}/f/tok.json: {t}/f is a file", {"f": "precious"}),
    C("path-inspect-file", "data inspect {t}/f", "has no index.json", {"f": "x"}),
    C("path-export-prefix-folder", "data export-megatron {ds} {t}/d", "PREFIX {t}/d is a folder",
      {"d/keep": "mine"}),
    C("path-export-bin-is-folder", "data export-megatron {ds} {t}/x", "{t}/x.bin is a folder",
      {"x.bin/keep": "mine"}),
    C("path-export-prefix-under-file", "data export-megatron {ds} {t}/f/out",
      "PREFIX {t}/f/out: {t}/f is a file", {"f": "precious"}),
    C("path-import-output-file", "data import-megatron {t}/p {t}/f", "{t}/f is a file",
      {"p.bin": BIN, "p.idx": BIN, "f": "precious"}),
    C("path-convert-destination-under-file", "convert {hf} {t}/f/out",
      "{t}/f is a file, not a folder; choose a destination in a folder", {"f": "precious"}),
    C("path-convert-source-empty-folder", "convert {t}/src {t}/out", "config.json: file not "
      "found", {"src/.keep": ""}),
    C("path-generate-checkpoint-empty-folder", "generate {t}/e --prompt The",
      "neither an mt pretrain checkpoint nor a folder mt convert reads", {"e/.keep": ""}),
    C("path-generate-input-folder", "generate {ck} --input {t}/d", "cannot read (Is a "
      "directory)", {"d/x": "x"}),
    C("path-eval-task-folder", "eval {ck} --task {t}/d", "--task {t}/d is a folder",
      {"d/x.yaml": "task: x\n"}),
    C("path-eval-data-dir-missing", "eval {ck} --task boolq --data-dir {t}/nope",
      "--data-dir {t}/nope: no such folder"),
    C("path-eval-output-under-file", "eval {ck} --task mt-cloze --output {t}/f/r.json",
      "{t}/f is a file, not a folder", {"f": "precious"}),
    C("path-serve-checkpoint-file", "serve {t}/f", "a file, not a checkpoint folder",
      {"f": "x"}),
    C("path-bias-data-dir-file", "bias {ck} -o {t}/r --data-dir {t}/f", "--data-dir {t}/f: no "
      "such folder", {"f": "x"}),
    C("path-bias-probes-missing", "bias {ck} -o {t}/r --no-likelihood --probes {t}/nope.yaml",
      "not a readable probes YAML file"),

    # --- an output that is an input, lies inside one or holds one ------------------------------
    C("clash-pretrain-out-dir-is-data", f"pretrain --data {{t}}/d --out-dir {{t}}/d {PRETRAIN}",
      "--out-dir {t}/d is the input {t}/d", {"d": copy_of("ds")}),
    C("clash-pretrain-out-dir-in-data", f"pretrain --data {{t}}/d --out-dir {{t}}/d/run "
      f"{PRETRAIN}", "--out-dir {t}/d/run lies inside the input {t}/d", {"d": copy_of("ds")}),
    C("clash-pretrain-save-is-data", "pretrain --data {t}/d --save {t}/d --nproc 1 "
      "--train-steps 1 --out-dir {t}/run", "--save {t}/d is the input {t}/d",
      {"d": copy_of("ds")}),
    C("clash-pretrain-metrics-is-config", f"pretrain --config {{t}}/c.yaml --metrics "
      f"{{t}}/c.yaml --out-dir {{t}}/run {PRETRAIN}", "--metrics {t}/c.yaml is the input",
      {"c.yaml": "seed: 1\n"}),
    C("clash-pretrain-metrics-is-eval-task", f"pretrain --eval-task {{t}}/t.jsonl --metrics "
      f"{{t}}/t.jsonl --out-dir {{t}}/run {PRETRAIN}", "--metrics {t}/t.jsonl is the input",
      {"t.jsonl": '{"text": "the whale is big"}\n'}),
    C("clash-pretrain-metrics-is-index", f"pretrain --data {{t}}/d --metrics "
      f"{{t}}/d/index.json --out-dir {{t}}/run {PRETRAIN}", "--metrics {t}/d/index.json lies "
      "inside the input {t}/d", {"d": copy_of("ds")}),
    C("clash-plot-output-symlink-to-input", "plot {t}/m.jsonl -o {t}/l.png", "is the input",
      {"m.jsonl": '{"step": 1, "loss": 1}\n', "l.png": link("m.jsonl")}),
    C("clash-prepare-output-is-decontam", "data prepare {t}/a.txt -o {t}/e --decontaminate "
      "{t}/e", "--output {t}/e is the input {t}/e",
      {"a.txt": corpus_text(), "e/x.jsonl": '{"text": "a b c"}\n'}),
    C("clash-prepare-input-is-cwd", "data prepare '' -o {t}/out --tokenizer tokenizer-1k",
      "lies inside the input"),
    C("clash-export-into-dataset", "data export-megatron {t}/d {t}/d/out",
      "PREFIX {t}/d/out lies inside the input {t}/d", {"d": copy_of("ds")}),
    C("clash-import-output-holds-prefix", "data import-megatron {t}/p {t}",
      "OUTPUT {t} holds the input", {"p.bin": BIN, "p.idx": BIN}),
    C("clash-convert-destination-empty", "convert {hf} ''", ".: destination already exists"),
    C("clash-convert-dry-run-onto-source", "convert {hf} {hf} --dry-run",
      "the destination is the source checkpoint"),
    C("clash-generate-output-folder-of-input", "generate {ck} --input {t}/p.jsonl --output {t}",
      "--output {t} holds the input", {"p.jsonl": PROMPT}),
    C("clash-generate-output-in-checkpoint", "generate {ck} --input {t}/p.jsonl --output "
      "{ck}/o.jsonl", "lies inside the input {ck}", {"p.jsonl": PROMPT}),
    C("clash-eval-output-existing", "eval {ck} --task mt-cloze --limit 1 -o {t}/notes.json",
      "--output {t}/notes.json already exists; pass --overwrite to replace it",
      {"notes.json": "precious"}),
    C("clash-eval-output-digest-existing", "eval {ck} --task mt-cloze --limit 1 -o {t}/r.json",
      "--output {t}/r.json.sha256 already exists; pass --overwrite to replace it",
      {"r.json.sha256": "precious"}),
    C("clash-generate-output-existing", "generate {ck} --input {t}/p.jsonl -o {t}/out.jsonl",
      "--output {t}/out.jsonl already exists; pass --overwrite to replace it",
      {"p.jsonl": PROMPT, "out.jsonl": "precious"}),
    C("clash-eval-output-in-checkpoint", "eval {ck} --task mt-cloze --output {ck}/r.json",
      "lies inside the input {ck}"),
    C("clash-bias-output-is-checkpoint", "bias {ck} -o {ck} --no-likelihood",
      "--output {ck} is the input {ck}"),

    # --- an output folder holding the user's own files, with and without --overwrite/--force --
    C("own-prepare-index-overwrite", "data prepare {t}/a.txt -o {t}/mine --overwrite",
      "holds index.json, which mt data prepare did not write",
      {"a.txt": corpus_text(), "mine/index.json": '{"mine": 1}'}),
    C("own-pretrain-resume-user-metrics", "pretrain --save {t}/ck --load {t}/ck --metrics "
      "{t}/notes.jsonl --nproc 1 --train-steps 3 --sample-tokens 0 --eval-interval 0 "
      "--out-dir {t}/run", "--metrics {t}/notes.jsonl holds lines mt pretrain did not write",
      {"ck/step-00000002": copy_of("ck"), "ck/latest": "step-00000002\n",
       "notes.jsonl": "my notes\nline 2\n"}),
    C("own-pretrain-new-run-user-metrics", f"pretrain --metrics {{t}}/notes.jsonl --out-dir "
      f"{{t}}/run {PRETRAIN}", "--metrics {t}/notes.jsonl holds lines mt pretrain did not",
      {"notes.jsonl": "my notes\n"}),
    C("own-convert-symlink-to-user-folder", "convert {hf} {t}/l --force",
      "holds notes.txt, which mt convert did not write",
      {"mine/notes.txt": "mine", "l": link("mine")}),
    C("own-convert-destination-dangling-link", "convert {hf} {t}/l",
      "{t}/l is a link to {t}/gone, which does not exist", {"l": link("gone")}),
    C("own-convert-destination-under-dangling-link", "convert {hf} {t}/l/out --dry-run",
      "{t}/l is a link to {t}/gone, which does not exist", {"l": link("gone")}),
    C("own-convert-dry-run-force-user-folder", "convert {hf} {t}/mine --dry-run --force",
      "holds notes.txt, which mt convert did not write", {"mine/notes.txt": "mine"}),
    C("own-eval-suite-user-folder", "eval {ck} --suite mt-nlg -o {t}/mine",
      "--output {t}/mine holds files mt eval --suite did not write (notes.txt)",
      {"mine/notes.txt": "mine"}),
    C("own-bias-output-file", "bias {ck} -o {t}/f --no-likelihood", "--output {t}/f is a file",
      {"f": "precious"}),

    # --- symbolic links ---------------------------------------------------------------------------
    C("link-pretrain-config-loop", "pretrain --config {t}/c.yaml", "config file {t}/c.yaml not "
      "found", {"c.yaml": link("c.yaml")}),
    C("link-plot-dangling-input", "plot {t}/l.jsonl -o {t}/o.png", "does not exist",
      {"l.jsonl": link("gone")}),
    C("link-prepare-input-loop", "data prepare {t}/loop -o {t}/out --tokenizer tokenizer-1k",
      "input {t}/loop does not exist", {"loop": link("loop")}),
    C("link-generate-input-dangling", "generate {ck} --input {t}/l.jsonl",
      "cannot read (No such file or directory)", {"l.jsonl": link("gone")}),

    # --- non-UTF-8, binary and empty files given as text, JSON or YAML -------------------------
    C("binary-gpu-yaml", "plan --model tiny --gpu {t}/g.yaml", "g.yaml is not UTF-8 text",
      {"g.yaml": BIN}),
    C("binary-pretrain-utf16-config", "pretrain --config {t}/c.yaml", "is not UTF-8 text "
      "(byte 0xff at offset 0)", {"c.yaml": "tp: 1\n".encode("utf-16")}),
    C("binary-pretrain-eval-task", "pretrain --eval-task {t}/t.jsonl --dry-run",
      "--eval-task: {t}/t.jsonl: not UTF-8 text", {"t.jsonl": BIN}),
    C("binary-pretrain-tokenizer", "pretrain --tokenizer {t}/tok.json --dry-run",
      "not a readable tokenizer.json", {"tok.json": BIN}),
    C("binary-pretrain-data-file", "pretrain --data {t}/raw.bin --dry-run",
      "is a file but not a blend file", {"raw.bin": BIN}),
    C("binary-plot-utf16", "plot {t}/m.jsonl -o {t}/o.png", "not UTF-8 text: byte 0xff",
      {"m.jsonl": '{"step": 1, "loss": 1}\n'.encode("utf-16")}),
    C("binary-plot-bom", "plot {t}/m.jsonl -o {t}/o.png", "m.jsonl:1: not a JSON line",
      {"m.jsonl": '\ufeff{"step": 1, "loss": 1}\n'.encode()}),
    C("binary-prepare-jsonl-stop", "data prepare {t}/b.jsonl -o {t}/out --tokenizer "
      "tokenizer-1k --workers 1 --on-error stop", "b.jsonl:1: json: malformed JSON",
      {"b.jsonl": BIN}),
    C("binary-prepare-decontam", "data prepare {t}/a.txt -o {t}/out --tokenizer tokenizer-1k "
      "--decontaminate {t}/e.jsonl --workers 1", "e.jsonl:1: json: malformed JSON",
      {"a.txt": corpus_text(), "e.jsonl": BIN}),
    C("binary-prepare-parquet", "data prepare {t}/a.parquet -o {t}/out --tokenizer "
      "tokenizer-1k --workers 1", "unreadable Parquet file", {"a.parquet": b"PAR1garbage"}),
    C("binary-prepare-tokenizer", "data prepare {t}/a.txt -o {t}/out --tokenizer {t}/tok.json",
      "tok.json: not a readable tokenizer.json", {"a.txt": corpus_text(), "tok.json": BIN}),
    C("binary-train-tokenizer-input", "data train-tokenizer {t}/b.txt --vocab-size 300 "
      "-o {t}/tok.json", "no documents in {t}/b.txt: nothing to train on", {"b.txt": BIN}),
    C("empty-train-tokenizer-input", "data train-tokenizer {t}/e.txt --vocab-size 300 "
      "-o {t}/tok.json", "no documents in {t}/e.txt", {"e.txt": ""}),
    C("binary-import-idx", "data import-megatron {t}/p {t}/out", "p.idx: bad magic",
      {"p.bin": BIN, "p.idx": BIN}),
    C("binary-index-json", "data inspect {t}/d", "d/index.json: not valid JSON",
      {"d/index.json": BIN}),
    C("binary-hf-config", "convert {t}/h {t}/out", "config.json: not valid JSON",
      {"h": copy_of("hf", put("config.json", BIN))}),
    C("empty-hf-config", "convert {t}/h {t}/out", "config.json: not valid JSON",
      {"h": copy_of("hf", put("config.json", ""))}),
    C("binary-convert-tokenizer", "convert {ck} {t}/out --to hf --tokenizer {t}/tok.json",
      "not a readable tokenizer.json", {"tok.json": BIN}),
    C("binary-generate-tokenizer", "generate {ck} --prompt The --tokenizer {t}/tok.json",
      "not a readable tokenizer.json", {"tok.json": BIN}),
    C("binary-eval-yaml-task", "eval {ck} --task {t}/t.yaml --engine mt",
      "t.yaml: not UTF-8 text", {"t.yaml": BIN}),
    C("binary-bias-probes", "bias {ck} -o {t}/r --no-likelihood --probes {t}/p.yaml",
      "not a readable probes YAML file", {"p.yaml": BIN}),
    C("binary-bias-group-words", "bias {ck} -o {t}/r --no-likelihood --group-words {t}/g.json",
      "not a readable group-words JSON file", {"g.json": BIN}),
    C("empty-bias-probes", "bias {ck} -o {t}/r --no-likelihood --probes {t}/p.yaml",
      "needs an 'occupation' probe", {"p.yaml": ""}),

    # --- nested too deeply to read ---------------------------------------------------------------
    C("deep-pretrain-config", "pretrain --config {t}/c.yaml", "YAML nested too deeply",
      {"c.yaml": "a: " + "[" * 5000 + "\n"}),
    C("deep-generate-prompts", "generate {ck} --input {t}/p.jsonl",
      "p.jsonl:1: not a row (JSON nested too deeply", {"p.jsonl": "[" * 100000 + "\n"}),
    C("deep-eval-task", "eval {ck} --task {t}/t.jsonl", "t.jsonl:1: not a row (JSON nested",
      {"t.jsonl": "[" * 100000 + "\n"}),
    C("deep-bias-probes", "bias {ck} -o {t}/r --no-likelihood --probes {t}/p.yaml",
      "nested too deeply", {"p.yaml": "a: " + "[" * 5000 + "\n"}),
    C("deep-gpu-yaml", "plan --model tiny --gpu {t}/g.yaml", "not YAML (nested too deeply",
      {"g.yaml": "a: " + "[" * 5000 + "\n"}),

    # --- truncated and corrupt checkpoints and datasets ------------------------------------------
    C("corrupt-shard-flipped", "data inspect {t}/d --verify", "shard-00000-00000.arrow",
      {"d": copy_of("ds", lambda d: put("shard-00000-00000.arrow", (
          d / "shard-00000-00000.arrow").read_bytes()[:-20] + b"\0" * 20)(d))}),
    C("corrupt-shard-empty", "data inspect {t}/d", "unreadable shard (File is too small: 0)",
      {"d": copy_of("ds", put("shard-00000-00000.arrow", b""))}),
    C("corrupt-groups-missing", "data inspect {t}/d --groups", "groups.json: missing",
      {"d": copy_of("ds", lambda d: (d / "groups.json").unlink())}),
    C("corrupt-groups-edited", "data inspect {t}/d --verify", "groups.json: damaged",
      {"d": copy_of("ds", lambda d: put("groups.json", (d / "groups.json").read_text()
                                          .replace("1", "2", 1))(d))}),
    C("corrupt-dropped-missing", "data inspect {t}/d --dropped too_short",
      "has no dropped.json", {"d": copy_of("ds", lambda d: (d / "dropped.json").unlink())}),
    C("corrupt-dropped-empty-object", "data inspect {t}/d --dropped too_short",
      "dropped.json: damaged", {"d": copy_of("ds", put("dropped.json", "{}"))}),
    C("corrupt-dropped-list", "data inspect {t}/d --dropped too_short",
      "dropped.json: damaged", {"d": copy_of("ds", put("dropped.json", "[1]"))}),
    C("corrupt-dropped-rules-shape", "data inspect {t}/d --dropped too_short",
      "dropped.json: damaged", {"d": copy_of("ds", put("dropped.json", '{"rules": [1]}'))}),
    C("corrupt-pretrain-shard-cut", f"pretrain --data {{t}}/d --out-dir {{t}}/run {PRETRAIN}",
      "unreadable shard", {"d": copy_of("ds", cut("shard-00000-00000.arrow", 3000))}),
    C("corrupt-pretrain-shard-sum", f"pretrain --data {{t}}/d --out-dir {{t}}/run {PRETRAIN}",
      "its SHA-256 differs from the one index.json records",
      {"d": copy_of("ds", json_edit("index.json", shard0={"sha256": "0" * 64}))}),
    C("corrupt-pretrain-no-shards", f"pretrain --data {{t}}/d --out-dir {{t}}/run {PRETRAIN}",
      "disagrees with its shards' largest id -1",
      {"d": copy_of("ds", json_edit("index.json", shards=[]))}),
    C("corrupt-pretrain-shard-dtype", f"pretrain --data {{t}}/d --out-dir {{t}}/run "
      f"{PRETRAIN}", "dtype 'float64' is not a token dtype",
      {"d": copy_of("ds", json_edit("index.json", dtype="float64"))}),
    C("corrupt-export-shard", "data export-megatron {t}/d {t}/out", "unreadable shard",
      {"d": copy_of("ds", cut("shard-00000-00000.arrow", 5000))}),
    C("corrupt-checkpoint-cut", "pretrain --load {t}/ck --out-dir {t}/run --global-batch-size "
      f"8 {PRETRAIN}", "damaged or truncated", {"ck": copy_of("ck", cut("rank-00000.pt", 100000))}),
    C("corrupt-checkpoint-meta-binary", "convert {t}/c {t}/out", "meta.json: damaged",
      {"c/meta.json": BIN, "c/rank-00000.pt": b"x"}),
    C("corrupt-checkpoint-latest-escape", f"pretrain --load {{t}}/ck --out-dir {{t}}/run "
      f"{PRETRAIN}", "latest is damaged (it names '../../../etc'", {"ck/latest": "../../../etc"}),
    C("corrupt-checkpoint-latest-empty", f"pretrain --load {{t}}/ck --out-dir {{t}}/run "
      f"{PRETRAIN}", "latest is empty", {"ck/latest": ""}),
    C("corrupt-checkpoint-meta-format", "convert {t}/c {t}/out", "format 'mt-pretrain/99'",
      {"c": copy_of("ck", json_edit("meta.json", format="mt-pretrain/99"))}),
    C("corrupt-checkpoint-meta-edited", "generate {t}/c --prompt The", "does not match its "
      "checksum", {"c": copy_of("ck", json_edit("meta.json", step=7))}),
    C("corrupt-safetensors-cut", "convert {t}/h {t}/out", "not a readable safetensors file",
      {"h": copy_of("hf", cut("model.safetensors", 1000))}),
    C("corrupt-safetensors-header", "eval {t}/h --task {t}/t.jsonl", "header too large",
      {"t.jsonl": MC, "h": copy_of("hf", lambda h: put("model.safetensors", (
          10**15).to_bytes(8, "little") + (h / "model.safetensors").read_bytes()[8:])(h))}),
    C("corrupt-safetensors-flipped", "convert {t}/h {t}/out", "checksum mismatch for tensor",
      {"h": copy_of("hf", lambda h: put("model.safetensors", (
          h / "model.safetensors").read_bytes()[:-100] + b"\xff" * 100)(h))}),
    C("corrupt-hf-layers-more", "convert {t}/h {t}/out", "missing tensors ['h.4.ln_1.weight'",
      {"h": copy_of("hf", json_edit("config.json", n_layer=5))}),
    C("corrupt-hf-vocab-edited", "convert {t}/h {t}/out", "has shape [50257, 64], config.json "
      "needs [100, 64]", {"h": copy_of("hf", json_edit("config.json", vocab_size=100))}),
    C("corrupt-hf-type-bert", "generate {t}/h --prompt The", "model_type='bert' is not "
      "supported", {"h": copy_of("hf", json_edit("config.json", model_type="bert"))}),
    C("corrupt-eval-duplicate-pool", "eval {ck} --task {t}/t.jsonl --shots 1 --limit 1",
      "the others are copies of it", {"t.jsonl": MC * 3}),

    # --- insecure: pickles that would run code, shard names escaping the dataset -----------------
    C("insecure-hf-pickle", "convert {t}/h {t}/out", "cannot load as plain tensors",
      {"h": payload("pytorch_model.bin", "pwned")}, never=("{t}/pwned",)),
    C("insecure-hf-pickle-generate", "generate {t}/h --prompt The", "cannot load as plain",
      {"h": payload("pytorch_model.bin", "pwned")}, never=("{t}/pwned",)),
    C("insecure-checkpoint-pickle", "convert {t}/c {t}/out", "damaged or truncated",
      {"c": copy_of("ck", lambda c: (c / "rank-00000.pt").write_bytes(
          pickle.dumps(Payload(str(c.parent / "pwned")))))}, never=("{t}/pwned",)),
    C("insecure-shard-absolute", "data inspect {t}/d", "is named '/",
      {"d": copy_of("ds", json_edit("index.json", shard0={"file": "/etc/hostname"}))}),
    C("insecure-shard-parent", f"pretrain --data {{t}}/d --out-dir {{t}}/run {PRETRAIN}",
      "shard 0 is named '../../d2/shard.arrow', not a file of the dataset folder",
      {"d": copy_of("ds", json_edit("index.json", shard0={"file": "../../d2/shard.arrow"}))}),
    C("insecure-shard-folder", "data export-megatron {t}/d {t}/out", "shard 0 is named '.'",
      {"d": copy_of("ds", json_edit("index.json", shard0={"file": "."}))}),
    C("insecure-pretrain-yaml-python-tag", "pretrain --config {t}/c.yaml",
      "could not determine a constructor", {"c.yaml": "tp: !!python/name:os.system\n"}),
    C("insecure-probes-python-tag", "bias {ck} -o {t}/r --no-likelihood --probes {t}/p.yaml",
      "could not determine a constructor", {"p.yaml": "x: !!python/name:os.system\n"}),

    # --- contradictory flags, and flags that would silently do nothing ----------------------------
    C("idle-pretrain-wandb-name", "pretrain --wandb-name foo --dry-run --train-steps 2",
      "--wandb-name 'foo' names a Weights & Biases run, and no --wandb-project"),
    C("idle-pretrain-rampup-partial", "pretrain --rampup-start 8 --dry-run --train-steps 2",
      "needs --rampup-start, --rampup-increment and --rampup-tokens together"),
    C("idle-matrix-floor-list", "matrix --noise-floor --list",
      "--noise-floor measures the noise floors only: --list would do nothing"),
    C("idle-matrix-floor-markdown", "matrix --noise-floor --markdown {t}/m.md",
      "--noise-floor measures the noise floors only: --markdown would do nothing"),
    C("idle-matrix-list-markdown", "matrix --list --markdown {t}/mine.md",
      "--list names the cases only: --markdown would do nothing", {"mine.md": "precious"}),
    C("idle-matrix-list-work-dir", "matrix --list --work-dir {t}/w",
      "--list names the cases only: --work-dir would do nothing"),
    C("idle-prepare-no-fuzzy-threshold", "data prepare {t}/a.txt -o {t}/out --no-fuzzy-dedup "
      "--threshold 0.5", "--threshold does nothing with --no-fuzzy-dedup",
      {"a.txt": corpus_text()}),
    C("idle-prepare-decontam-mode", "data prepare {t}/a.txt -o {t}/out --decontam-mode cut",
      "--decontam-mode does nothing without --decontaminate", {"a.txt": corpus_text()}),
    C("idle-prepare-no-quality-min-chars", "data prepare {t}/a.txt -o {t}/out "
      "--no-quality-filters --min-chars 5 --min-words 2", "--min-chars, --min-words do nothing "
      "with --no-quality-filters", {"a.txt": corpus_text()}),
    C("idle-inspect-document-groups", "data inspect {ds} --groups --document 0",
      "--document 0 is the decoded document, which --groups shows instead"),
    C("idle-convert-tokenizer-consolidated", "convert {hf} {t}/out --tokenizer gpt2",
      "--tokenizer only applies to the hf and gguf targets, not 'consolidated'"),
    C("idle-convert-drop-optimizer", "convert {hf} {t}/out --drop-optimizer",
      "--drop-optimizer only applies to the formats that hold optimizer state (pretrain, "
      "dcp, mcore), not to 'consolidated'"),
    C("idle-convert-pad-consolidated", "convert {hf} {t}/out --to consolidated "
      "--pad-multiple 8", "--pad-multiple 8 only applies to the tp and megatron formats"),
    C("idle-generate-logprobs-prompt", "generate {ck} --prompt The --logprobs",
      "--logprobs writes log-probabilities into the JSONL rows of --input"),
    C("idle-generate-top-k-greedy", "generate {ck} --prompt The --top-k 5",
      "--top-k choose among tokens to sample, and --temperature 0 is greedy"),
    C("idle-generate-top-p-greedy", "generate {ck} --prompt The --top-p 0.5",
      "--top-p choose among tokens to sample"),
    C("idle-generate-seed-greedy", "generate {ck} --prompt The --seed 5",
      "--seed 5 seeds the sampling, and --temperature 0 is greedy (nothing is drawn)"),
    C("idle-generate-nproc-tp", "generate {ck} --prompt The --tp 2 --nproc 3",
      "--nproc 3 is not divisible by --tp 2 x --pp 1 = 2"),
    C("idle-eval-log-samples", "eval {ck} --task mt-cloze --log-samples",
      "--log-samples adds every document's log-likelihoods to --output's JSON"),
    C("idle-eval-overwrite", "eval {ck} --task mt-cloze --overwrite",
      "--overwrite replaces an existing --output file: give --output too"),
    C("idle-generate-overwrite", "generate {ck} --prompt The --overwrite",
      "--overwrite replaces an existing --output file: give --output too"),
    C("idle-eval-task-twice", "eval {ck} --task mt-cloze --task mt-cloze",
      "--task mt-cloze is given twice: it would run twice; give it once"),
    C("idle-eval-include-path-mt", "eval {ck} --task mt-cloze --include-path {t}",
      "--include-path is for lm-eval's tasks"),
    C("idle-serve-key-and-no-key", "serve {ck} --api-key abc --allow-no-key",
      "--allow-no-key serves without a key, and --api-key"),
    C("idle-bias-limit-no-likelihood", "bias {ck} -o {t}/r --no-likelihood --limit 5",
      "--limit and --data-dir are for the likelihood probes"),
    C("idle-bias-probes-no-generation", "bias {ck} -o {t}/r --no-generation --data-dir {t}/dd "
      "--probes {t}/p.yaml", "--probes and --group-words are for the generation probes",
      {"dd/.keep": "", "p.yaml": "occupation: {templates: ['The {occupation} was a']}\n"}),

    # --- unknown keys -----------------------------------------------------------------------------
    C("unknown-pretrain-nested-key", "pretrain --config {t}/c.yaml", "unknown config keys "
      "['bogus']", {"c.yaml": "parallel:\n  tp: 1\n  bogus: 2\n"}),
    C("unknown-pretrain-section-typo", "pretrain --config {t}/c.yaml", "unknown config keys "
      "['paralel']", {"c.yaml": "paralel:\n  tp: 1\n"}),
    C("unknown-pretrain-null-key", "pretrain --config {t}/c.yaml", "unknown config keys "
      "['None']", {"c.yaml": "~: 2\n"}),
    C("unknown-plan-gpt-key", "plan --config {t}/c.yaml", "unknown GPTConfig keys ['bogus']",
      {"c.yaml": GPT + "bogus: 3\n"}),
    C("unknown-plan-pretrain-key", "plan --config {t}/c.yaml", "unknown config keys ['bogus']",
      {"c.yaml": "model: {model: tiny, bogus: 1}\n"}),
    C("unknown-gpu-key", "plan --model tiny --gpu {t}/g.yaml", "unknown keys ['bogus']",
      {"g.yaml": GPU + "gpus_per_node: 8\nbogus: 1\n"}),
    C("unknown-probes-key", "bias {ck} -o {t}/r --no-likelihood --probes {t}/p.yaml",
      "unknown key 'bogus' (occupation, groups)", {"p.yaml": "bogus: 1\n"}),
    C("unknown-probes-occupation-key", "bias {ck} -o {t}/r --no-likelihood --probes "
      "{t}/p.yaml", "p.yaml: occupation: unknown key 'occupation' (templates, occupations)",
      {"p.yaml": "occupation:\n  templates: ['The {occupation} was a']\n  occupation: [x]\n"}),

    # --- eval and plan: results that could be wrong --------------------------------------------
    C("eval-rolling-empty-document", "eval {ck} --task {t}/t.yaml --engine mt --no-progress",
      "t.yaml: document 1: the text encodes to no tokens",
      {"t.yaml": "task: roll\ndataset_path: json\ndataset_kwargs: {data_files: {test: r.jsonl}}"
                 "\ntest_split: test\noutput_type: loglikelihood_rolling\ndoc_to_target: text\n",
       "r.jsonl": '{"text": "the whale"}\n{"text": ""}\n'}),
    C("eval-two-tasks-one-name", "eval {ck} --task {t}/a/t.jsonl --task {t}/b/t.jsonl "
      "--no-progress -o {t}/r.json", "{t}/b/t.jsonl: its task name 't' is also {t}/a/t.jsonl's",
      {"a/t.jsonl": MC, "b/t.jsonl": MC}),
    C("inf-gpu-yaml", "plan --model tiny --gpu {t}/g.yaml", "memory_gb must be a finite number",
      {"g.yaml": GPU.replace("80", ".inf")}),
    C("clash-eval-output-task-data", "eval {ck} --task {t}/t.yaml --engine mt -o {t}/r.jsonl "
      "--overwrite", "--output {t}/r.jsonl is the input {t}/r.jsonl",
      {"t.yaml": "task: t\ndataset_path: json\ndataset_kwargs: {data_files: {test: r.jsonl}}\n"
                 "test_split: test\noutput_type: multiple_choice\ndoc_to_text: context\n"
                 "doc_to_choice: choices\ndoc_to_target: label\n", "r.jsonl": MC}),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """The shared inputs: a tiny GPT-2-vocabulary checkpoint of 2 steps and its HF export,
    a dataset prepared from a small text with tokenizer-1k, that text and the run's metrics;
    checked unchanged at the end (a case that wrote into them fails there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("hostile")
    ckpt, hf = single_threaded(trained_gpt2_vocab, root, seq_len=64, steps=2)
    corpus = root / "corpus.txt"
    corpus.write_text(corpus_text(50))
    result = CliRunner().invoke(app, ["data", "prepare", str(corpus), "-o", str(root / "ds"),
                                      "--tokenizer", "tokenizer-1k", "--workers", "1"])
    assert result.exit_code == 0, result.output
    shared = {"ck": ckpt, "hf": hf, "ds": root / "ds", "corpus": corpus,
              "metrics": root / "run" / "metrics.jsonl"}
    before = {name: _snapshot(path) for name, path in shared.items()}
    yield shared
    torch.set_num_threads(threads)
    after = {name: _snapshot(path) for name, path in shared.items()}
    assert after == before, "a case changed a shared input"


def _snapshot(root: Path) -> dict[str, str]:
    """SHA-256 of every regular file under ``root`` (a dataset's cache/ of checksum stamps
    aside: reading a dataset writes it by design)."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()
                                                 and not p.is_symlink()
                                                 and "cache" not in p.relative_to(root).parts)
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _alarm(_signum: int, _frame: Any) -> None:
    raise Hang(f"no end within {ALARM_S} s")


def _error_text(output: str) -> tuple[int, str]:
    """(the number of error lines, the error's text on one line): mt's ``error:`` lines, or
    click's usage-error panel (one message in a box)."""
    lines = output.splitlines()
    ours = [k for k, line in enumerate(lines) if line.startswith("error:")]
    panels = [k for k, line in enumerate(lines) if line.startswith("╭─ Error")]
    if panels:
        boxed = []
        for line in lines[panels[0] + 1:]:
            if line.startswith("╰"):
                break
            boxed.append(line.strip("│ "))
        return len(ours) + len(panels), " ".join(" ".join(boxed).split())
    text = " ".join(" ".join(lines[ours[0]:]).split()) if ours else ""
    return len(ours), text


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(case: Case, world: dict[str, Path], tmp_path: Path,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    names = {k: str(v) for k, v in world.items()} | {"t": str(tmp_path), "huge": HUGE}
    for rel, data in case.files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if callable(data):
            data(path, world)
        elif isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data)
    mine = _snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)  # an empty path names this folder, never the repository
    args = [word.format(**names) for word in shlex.split(case.args)]
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(ALARM_S)
    try:
        result = CliRunner().invoke(app, args, env={"COLUMNS": "1000"})
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    output = result.output
    assert not isinstance(result.exception, Hang), f"hang: mt {shlex.join(args)}"
    assert "Traceback" not in output, output
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        repr(result.exception), output)
    assert result.exit_code == case.code, output
    count, text = _error_text(output)
    assert count == 1, output
    for fragment in (case.says,) if isinstance(case.says, str) else case.says:
        assert fragment.format(**names) in text, (fragment.format(**names), text)
    after = _snapshot(tmp_path)
    lost = [p for p, digest in mine.items() if after.get(p) != digest]
    assert not lost, f"the user's files changed or vanished: {lost}"
    for path in case.never:
        assert not Path(path.format(**names)).exists(), f"{path} exists: code was run"


def test_bias_rerun_leaves_no_plot_of_the_earlier_report(world: dict[str, Path],
                                                         tmp_path: Path) -> None:
    """An --output folder of an earlier `mt bias` report is replaced whole: a plot the new
    report has no data for (no occupation probe here) is not left beside it, unchecksummed."""
    out = tmp_path / "r"
    out.mkdir()
    (out / "occupation.png").write_bytes(b"the earlier report's plot")
    (tmp_path / "p.yaml").write_text("groups:\n  gender:\n    female: [She was]\n"
                                     "    male: [He was]\n")
    result = single_threaded(CliRunner().invoke, app, [
        "bias", str(world["ck"]), "-o", str(out), "--no-likelihood", "--probes",
        str(tmp_path / "p.yaml"), "--samples", "1", "--max-new-tokens", "1", "--no-progress"])
    assert result.exit_code == 0, result.output
    sums = [line.split()[1] for line in (out / "SHA256SUMS").read_text().splitlines()]
    assert not (out / "occupation.png").exists(), sorted(p.name for p in out.iterdir())
    assert sorted(p.name for p in out.iterdir()) == sorted([*sums, "SHA256SUMS"])


def test_generate_allocates_no_batch_past_its_prompts(world: dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """--in-flight beyond the prompts (--batch-size as large): one decode batch per prompt
    at most (each is allocated), not one per --in-flight."""
    import mt_inference.generation as generation
    from mt_inference.placement import Placement
    from mt_model import Sampling

    made = []
    real = generation.DecodeBatch

    def counted(model: Any) -> Any:
        made.append(1)
        return real(model)

    gen = single_threaded(generation.Generator.load, Placement(str(world["ck"])))
    gen.in_flight = 4096
    monkeypatch.setattr(generation, "DecodeBatch", counted)
    rows = single_threaded(gen.complete, ["The whale", "The sea"], Sampling(2))
    assert [len(r["token_ids"]) for r in rows] == [2, 2] and len(made) == 2, len(made)


def test_the_table_is_large_and_its_ids_unique() -> None:
    assert len(CASES) >= 150
    assert len({c.id for c in CASES}) == len(CASES)
