"""Tasks: documents and how to turn them into requests, in lm-evaluation-harness's format.

A task is named on the command line (:func:`mt_eval.load_task`) as a built-in name
(:mod:`mt_eval.builtin`), a YAML task file, or a JSONL file:

- YAML: the subset of lm-eval's task format that scores log-likelihoods: ``dataset_path:
  json`` with ``dataset_kwargs: {data_files: ...}`` (a path or ``{split: path}``; relative
  paths are relative to the YAML file), ``test_split`` / ``validation_split`` /
  ``training_split`` / ``fewshot_split``, ``output_type`` (``multiple_choice``,
  ``loglikelihood``, ``loglikelihood_rolling``), ``doc_to_text``, ``doc_to_choice``,
  ``doc_to_target``, ``target_delimiter``, ``fewshot_delimiter``, ``description``,
  ``num_fewshot``, ``metric_list``, ``dataset_name: null``. Other keys (Python hooks,
  ``include:``, filters, ``generate_until``...) are refused by name, with the way to run them:
  lm-evaluation-harness itself (``mt eval --engine harness``).
- JSONL: rows ``{"context", "choices", "label"}`` are multiple choice; rows ``{"text"}`` are
  last-word cloze (LAMBADA style: the context is the text but its last word, the target that
  word with its space; accuracy is whether the target is the greedy continuation). Few-shot
  examples come from the same file, never the document itself.

Which documents are evaluated and which serve as examples follows lm-eval: the test split,
else the validation split; examples from ``fewshot_split``, else the training split, else
the validation split, else the test split. lm-eval's draw: when ``fewshot_split`` equals
``test_split`` (both unset included: a task with training and validation splits only),
n + 1 examples are drawn and the evaluated document dropped from them, otherwise n.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mt_data.text import not_utf8
from mt_eval.errors import TaskError, unique_keys_loader, yaml_problem

__all__ = ["DEFAULT_METRICS", "OUTPUT_TYPES", "Task", "jsonl_task", "load_jsonl",
           "task_data_files", "yaml_task"]

OUTPUT_TYPES = ("multiple_choice", "loglikelihood", "loglikelihood_rolling")
#: Metrics of each output type when the task names none (lm-eval's defaults).
DEFAULT_METRICS = {
    "multiple_choice": ("acc", "acc_norm"),
    "loglikelihood": ("perplexity", "acc"),
    "loglikelihood_rolling": ("word_perplexity", "byte_perplexity", "bits_per_byte"),
}
_KEYS = {"task", "task_alias", "tag", "dataset_path", "dataset_kwargs", "test_split",
         "validation_split", "training_split", "fewshot_split", "output_type", "doc_to_text",
         "doc_to_choice", "doc_to_target", "target_delimiter", "fewshot_delimiter",
         "description", "num_fewshot", "metric_list", "metadata", "should_decontaminate",
         "doc_to_decontamination_query"}
_CLOZE = {"doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}",
          "doc_to_target": "{{' '+text.split(' ')[-1]}}"}


@dataclass(frozen=True)
class Task:
    """One evaluation task, ready to build requests.

    Attributes:
        name: the name results are reported under.
        output_type: ``multiple_choice``, ``loglikelihood`` or ``loglikelihood_rolling``.
        docs: the evaluated documents, in order (their index is the ``doc_id``).
        fewshot_docs: the pool few-shot examples are drawn from.
        exclude_self: leave the evaluated document out of its own examples.
        doc_to_text, doc_to_choice, doc_to_target: field names or templates (lm-eval's).
        metrics: the metrics reported.
        source: where the task came from (for messages).
    """

    name: str
    output_type: str
    docs: tuple[dict[str, Any], ...]
    fewshot_docs: tuple[dict[str, Any], ...]
    doc_to_text: Any = None
    doc_to_choice: Any = None
    doc_to_target: Any = None
    target_delimiter: str = " "
    fewshot_delimiter: str = "\n\n"
    description: str = ""
    num_fewshot: int | None = None
    exclude_self: bool = False
    metrics: tuple[str, ...] = ()
    source: str = ""
    config: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        where = self.source or self.name
        if self.output_type not in OUTPUT_TYPES:
            raise TaskError(f"{where}: output_type {self.output_type!r} is not supported by "
                            f"mt's own engine (it scores {', '.join(OUTPUT_TYPES)}); "
                            "lm-evaluation-harness runs it: mt eval --engine harness")
        if not self.docs:
            raise TaskError(f"{where}: no documents to evaluate")
        if self.output_type == "multiple_choice" and self.doc_to_choice is None:
            raise TaskError(f"{where}: a multiple_choice task needs doc_to_choice")
        if self.doc_to_target is None:
            raise TaskError(f"{where}: doc_to_target is missing")
        if self.output_type != "loglikelihood_rolling" and self.doc_to_text is None:
            raise TaskError(f"{where}: doc_to_text is missing")
        allowed = {"acc", "acc_norm"} if self.output_type == "multiple_choice" else \
            set(DEFAULT_METRICS[self.output_type])
        unknown = [m for m in self.metrics if m not in allowed]
        if unknown:
            raise TaskError(f"{where}: metric {unknown[0]!r} is not computed for "
                            f"{self.output_type} tasks (mt eval has {sorted(allowed)})")


#: A JSON escape of a UTF-16 surrogate: only a line holding one can decode to a string that
#: is not Unicode text (an escaped half of a pair, alone), which no tokenizer takes.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _lone_surrogate(row: dict[str, Any]) -> str | None:
    """Where in ``row`` a string (or a key) holds a lone surrogate, described; else None."""
    todo: list[tuple[Any, str]] = [(row, "")]
    while todo:
        value, where = todo.pop()
        texts: list[tuple[str, str]] = []
        if isinstance(value, str):
            texts.append((value, where))
        elif isinstance(value, dict):
            for key, item in value.items():
                texts.append((key, f"a field name in {where or 'the row'}"))
                todo.append((item, f"{where}.{key}" if where else str(key)))
        elif isinstance(value, list):
            todo += [(item, f"{where}[{i}]") for i, item in enumerate(value)]
        for text, place in texts:
            if why := not_utf8(text):
                return f"{place} holds {why}"
    return None


def numbered_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) of every non-blank line of a JSONL file; a bad line (not JSON, not
    an object, a string that is not Unicode text) is an error naming the file and line."""
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise TaskError(f"{path}: cannot read ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise TaskError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise TaskError(f"{path}:{number}: not JSON ({err.msg})") from None
        except RecursionError:
            raise TaskError(f"{path}:{number}: not a row (JSON nested too deeply to "
                            "read)") from None
        if not isinstance(row, dict):
            raise TaskError(f"{path}:{number}: a row must be a JSON object, got "
                            f"{type(row).__name__}")
        if _SURROGATE_ESCAPE.search(line) and (where := _lone_surrogate(row)):
            raise TaskError(f"{path}:{number}: {where}: not UTF-8 text")
        rows.append((number, row))
    if not rows:
        raise TaskError(f"{path}: no rows")
    return rows


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file (:func:`numbered_rows` without the numbers)."""
    return [row for _, row in numbered_rows(path)]


def jsonl_task(path: Path) -> Task:
    rows = load_jsonl(path)
    first = rows[0]
    if {"context", "choices", "label"} <= first.keys():
        kind, need = "multiple_choice", ("context", "choices", "label")
        spec = {"doc_to_text": "context", "doc_to_choice": "choices", "doc_to_target": "label"}
    elif "text" in first:
        kind, need, spec = "loglikelihood", ("text",), dict(_CLOZE, target_delimiter="")
    else:
        raise TaskError(f"{path}:1: rows need the fields context, choices and label (multiple "
                        f"choice) or text (last-word cloze); found {sorted(first)}")
    for number, row in enumerate(rows, 1):
        for key in need:
            if key not in row:
                raise TaskError(f"{path}:{number}: field {key!r} is missing")
        if kind == "multiple_choice":
            choices, label = row["choices"], row["label"]
            if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
                raise TaskError(f"{path}:{number}: 'choices' must be a list of strings")
            if isinstance(label, bool) or not isinstance(label, int) or not (
                    0 <= label < len(choices)):  # JSON true is no index (Python's 1)
                raise TaskError(f"{path}:{number}: 'label' must be an index into the "
                                f"{len(choices)} choices, got {label!r}")
        elif not isinstance(row["text"], str) or len(row["text"].split(" ")) < 2:
            raise TaskError(f"{path}:{number}: 'text' must hold at least two words")
    docs = tuple(rows)
    return Task(path.stem, kind, docs, docs, exclude_self=True,
                metrics=DEFAULT_METRICS[kind], source=str(path), **spec)


#: The typed keys of a task file: what each must be (None is always allowed: the default).
_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "task": ((str, int), "a name"),
    "output_type": ((str,), f"one of {', '.join(OUTPUT_TYPES)}"),
    "test_split": ((str,), "the name of a data_files split"),
    "validation_split": ((str,), "the name of a data_files split"),
    "training_split": ((str,), "the name of a data_files split"),
    "fewshot_split": ((str,), "the name of a data_files split"),
    "dataset_kwargs": ((dict,), "a mapping (data_files: ...)"),
    "doc_to_text": ((str, int), "a field name, a template or an int"),
    "doc_to_choice": ((str, list), "a field name, a template or a list"),
    "doc_to_target": ((str, int, list), "a field name, a template, an int or a list"),
    "target_delimiter": ((str,), "a string"),
    "fewshot_delimiter": ((str,), "a string"),
    "description": ((str,), "a string"),
    "num_fewshot": ((int,), "a whole number >= 0"),
    "metric_list": ((list,), "a list of {metric: NAME} entries"),
}


def _check_types(path: Path, config: dict[str, Any]) -> None:
    """Each typed key of ``config`` is of its type: a TaskError naming the file, the key and
    the value, when the file is read (not when the examples are drawn, deep in the run)."""
    for key, (kinds, what) in _TYPES.items():
        value = config.get(key)
        if value is None:
            continue
        if key == "doc_to_choice" and isinstance(value, dict):
            raise TaskError(f"{path}: doc_to_choice as a mapping is not read by mt's own "
                            "engine (a list, a field name or a template); "
                            "lm-evaluation-harness reads it: mt eval --engine harness")
        if isinstance(value, bool) or not isinstance(value, kinds) or (
                key == "num_fewshot" and value < 0):
            raise TaskError(f"{path}: {key} must be {what}, got {value!r}")
    for entry in config.get("metric_list") or ():
        name = entry.get("metric") if isinstance(entry, dict) else entry
        if not isinstance(name, str):
            raise TaskError(f"{path}: metric_list entries must be {{metric: NAME}} (or a "
                            f"name), got {entry!r}")
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    for split, names in (files.items() if isinstance(files, dict) else [("", files)]):
        if files is None:
            break
        if not isinstance(split, str) or not (isinstance(names, str) or (
                isinstance(names, list) and names and all(isinstance(n, str) for n in names))):
            raise TaskError(f"{path}: dataset_kwargs.data_files must name the JSONL file(s): "
                            f"a path, a list of paths or {{split: path(s)}}, got {files!r}")


def _read_config(path: Path) -> Any:
    """The YAML document of the task file ``path``; a TaskError names what is wrong."""
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=unique_keys_loader())
    except OSError as err:
        raise TaskError(f"{path}: cannot read ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise TaskError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except yaml.YAMLError as err:
        if "!function" in str(err):
            raise TaskError(f"{path}: lm-eval's Python hooks (!function) are not run by mt's "
                            "own engine; lm-evaluation-harness runs them: mt eval --engine "
                            "harness (pip install 'mt-inference[harness]')") from None
        raise TaskError(f"{path}: not YAML ({yaml_problem(err)})") from None
    except RecursionError:
        raise TaskError(f"{path}: not YAML (nested too deeply to read)") from None


def task_data_files(spec: str) -> list[Path]:
    """The data files the task YAML ``spec`` names (relative to it), inputs that a results
    file must not replace; none for any other task, or a YAML that cannot be read (its
    error is reported when the task is loaded)."""
    path = Path(spec)
    if path.suffix not in (".yaml", ".yml") or not path.is_file():
        return []
    try:
        config = _read_config(path)
    except TaskError:
        return []
    kwargs = config.get("dataset_kwargs") if isinstance(config, dict) else None
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    named = files.values() if isinstance(files, dict) else [files]
    names = [n for names in named for n in (names if isinstance(names, list) else [names])]
    return [path.parent / n for n in names if isinstance(n, str)]


def yaml_task(path: Path) -> Task:
    config = _read_config(path)
    if not isinstance(config, dict):
        raise TaskError(f"{path}: a task file must be a YAML mapping")
    unknown = sorted(set(config) - _KEYS - {"dataset_name"}, key=str)  # keys of any type
    if config.get("dataset_name") is not None:
        unknown.insert(0, "dataset_name")
    if unknown:
        raise TaskError(f"{path}: {unknown[0]!r} is not supported by mt's own engine (it "
                        f"reads {', '.join(sorted(_KEYS))}; dataset_name only as null); "
                        "lm-evaluation-harness runs every feature of its task files: mt eval "
                        "--engine harness (pip install 'mt-inference[harness]')")
    _check_types(path, config)
    if config.get("dataset_path") != "json":
        raise TaskError(f"{path}: dataset_path must be 'json' (local JSON/JSONL files), got "
                        f"{config.get('dataset_path')!r}")
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, (str, list)):
        files = {"train": files}
    if not isinstance(files, dict) or not files:
        raise TaskError(f"{path}: dataset_kwargs.data_files must name the JSONL file(s)")
    splits = {}
    for split, names in files.items():
        rows: list[dict[str, Any]] = []
        for name in [names] if isinstance(names, str) else names:
            rows += load_jsonl(path.parent / name)
        splits[split] = tuple(rows)

    def split_of(key: str) -> tuple[dict[str, Any], ...] | None:
        name = config.get(key)
        if name is None:
            return None
        if name not in splits:
            raise TaskError(f"{path}: {key} {name!r} is not among data_files "
                            f"{sorted(splits)}")
        return splits[name]

    test, valid, train = split_of("test_split"), split_of("validation_split"), \
        split_of("training_split")
    docs = test if test is not None else valid
    if docs is None:
        raise TaskError(f"{path}: name the evaluated split with test_split or "
                        "validation_split")
    fewshot = split_of("fewshot_split")
    # lm-eval's rule: whenever the few-shot split "is" the test split (both unnamed too, as
    # in a task with validation and training splits only), n + 1 examples are drawn and the
    # evaluated document dropped from them.
    exclude_self = config.get("fewshot_split") == config.get("test_split")
    if fewshot is None:
        fewshot = next(s for s in (train, valid, test) if s is not None)
    kind = config.get("output_type", "generate_until")
    metrics = tuple(m["metric"] if isinstance(m, dict) else m
                    for m in config.get("metric_list") or ()) or DEFAULT_METRICS.get(kind, ())
    return Task(
        name=str(config.get("task", path.stem)), output_type=kind, docs=docs,
        fewshot_docs=fewshot, doc_to_text=config.get("doc_to_text"),
        doc_to_choice=config.get("doc_to_choice"), doc_to_target=config.get("doc_to_target"),
        target_delimiter=config.get("target_delimiter", " "),
        fewshot_delimiter=config.get("fewshot_delimiter", "\n\n"),
        description=config.get("description", "") or "", num_fewshot=config.get("num_fewshot"),
        exclude_self=exclude_self, metrics=metrics, source=str(path), config=config)
