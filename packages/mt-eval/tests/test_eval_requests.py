"""mt-eval builds exactly lm-evaluation-harness's requests: the same prompt strings (few-shot
examples drawn by the same seed, delimiters, descriptions, templates), the same token pairs
and rolling windows, and the same metric arithmetic. lm-eval itself is the oracle (no model
is needed: its tasks build their requests from text)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lm_eval.api.metrics as lm_metrics
import lm_eval.tasks as lm_eval_tasks
import lm_eval.utils as lm_utils
import pytest
from eval_tasks import TASKS, write_tasks
from lm_eval.api.model import TemplateLM

from mt_data import load_tokenizer
from mt_eval import (
    TaskError,
    aggregate,
    build_requests,
    builtin_task,
    encode_pair,
    load_task,
    load_tasks,
    rolling_windows,
)
from mt_eval.requests import context, continuations, fewshot_sample
from mt_eval.tasks import load_jsonl


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def lm_tasks(task_dir: Path) -> dict:
    # only these tasks: indexing the ones lm-eval ships takes seconds
    manager = lm_eval_tasks.TaskManager(include_path=str(task_dir), include_defaults=False)
    return manager.load(list(TASKS))["tasks"]


@pytest.mark.parametrize("shots", [0, 2, 5])
def test_prompts_equal_lm_eval(lm_tasks: dict, task_dir: Path, shots: int) -> None:
    for name in TASKS:
        k = 0 if name == "t_ppl" else shots
        theirs = lm_tasks[name]
        theirs.set_config(key="num_fewshot", value=k)
        theirs.set_fewshot_seed(1234)
        theirs.build_all_requests(limit=None, rank=0, world_size=1)
        ours = load_task(str(task_dir / f"{name}.yaml"))
        examples = fewshot_sample(ours, k, 1234)
        assert len(theirs.instances) == sum(
            len(continuations(ours, d)) for d in range(len(ours.docs)))
        for inst in theirs.instances:
            if name == "t_ppl":
                expected = (continuations(ours, inst.doc_id)[0],)
            else:
                expected = (context(ours, inst.doc_id, examples[inst.doc_id]),
                            continuations(ours, inst.doc_id)[inst.idx])
            assert inst.arguments == expected, (name, inst.doc_id, inst.idx)


@pytest.mark.parametrize("shots", [1, 2, 5])
def test_a_task_without_test_split_draws_as_lm_eval(tmp_path: Path, shots: int) -> None:
    """BoolQ's shape: training and validation splits, no test split, no fewshot_split. lm-eval
    then draws n + 1 training examples per document and drops the evaluated one if drawn (it
    was: mt drew n, so every prompt after the first differed). The training split holds the
    validation documents too, so that the drop happens; ``dataset_name: null`` is read."""
    rows = builtin_task("mt-choice").docs[:14]
    for split, part in (("train", rows), ("validation", rows[:8])):
        (tmp_path / f"{split}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
    (tmp_path / "t_boolq_like.yaml").write_text(
        f"task: t_boolq_like\ndataset_path: json\ndataset_name: null\ndataset_kwargs:\n"
        f"  data_files:\n    train: {tmp_path / 'train.jsonl'}\n"
        f"    validation: {tmp_path / 'validation.jsonl'}\ntraining_split: train\n"
        "validation_split: validation\noutput_type: multiple_choice\ndoc_to_text: context\n"
        "doc_to_choice: choices\ndoc_to_target: label\n", encoding="utf-8")
    manager = lm_eval_tasks.TaskManager(include_path=str(tmp_path), include_defaults=False)
    theirs = manager.load(["t_boolq_like"])["tasks"]["t_boolq_like"]
    theirs.set_config(key="num_fewshot", value=shots)
    theirs.set_fewshot_seed(1234)
    theirs.build_all_requests(limit=None, rank=0, world_size=1)
    ours = load_task(str(tmp_path / "t_boolq_like.yaml"))
    examples = fewshot_sample(ours, shots, 1234)
    assert ours.exclude_self and len(ours.docs) == 8
    prompts = {(i.doc_id, i.idx): i.arguments[0] for i in theirs.instances}
    assert len(prompts) == sum(len(continuations(ours, d)) for d in range(8))
    for (doc_id, _), prompt in prompts.items():
        assert prompt == context(ours, doc_id, examples[doc_id]), (shots, doc_id)
        # the evaluated document is never its own example
        assert ours.docs[doc_id] not in examples[doc_id]


class _LM(TemplateLM):
    """lm-eval's own context/continuation split over a given tokenizer."""

    backend = "causal"

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.tok = tokenizer

    def tok_encode(self, string: str, **kwargs) -> list[int]:
        return self.tok.encode(string)

    @property
    def eot_token_id(self) -> int:
        return self.tok.eod_id

    def _loglikelihood_tokens(self, requests, **kwargs):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests, **kwargs):
        raise NotImplementedError

    def generate_until(self, requests, **kwargs):
        raise NotImplementedError


def test_token_pairs_and_windows_equal_lm_eval() -> None:
    tok = load_tokenizer("gpt2")
    lm = _LM(tok)
    for ctx, cont in [("The whale", " swam"), ("Call me  ", "Ishmael."), ("a\n\n", "b"),
                      ("Passage: x y\nAnswer:", " yes"), ("", "Hello there")]:
        if ctx:
            assert encode_pair(tok.encode, tok.eod_id, ctx, cont) == lm._encode_pair(ctx, cont)
        else:
            assert encode_pair(tok.encode, tok.eod_id, ctx, cont) == (
                [tok.eod_id], tok.encode(cont))
    tokens = tok.encode(builtin_task("mt-perplexity").docs[0]["text"])[:300]
    for length in (1, 7, 64, 299, 300, 512):
        theirs = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
            tokens, prefix_token=tok.eod_id, max_seq_len=length, context_len=1)]
        ours = rolling_windows(tokens, tok.eod_id, length)
        assert ours == [(list(a), list(b)) for a, b in theirs], length
        assert sum(len(pred) for _, pred in ours) == len(tokens)


def test_metrics_equal_lm_eval() -> None:
    lls = [-3.0, -0.5, -7.25, -1.0]
    values, errors = aggregate("loglikelihood", [{"ll": x, "greedy": x > -2} for x in lls],
                               ("perplexity", "acc"))
    assert values["perplexity"] == pytest.approx(lm_metrics.perplexity(lls), rel=1e-12)
    assert values["acc"] == 0.5
    assert errors["acc"] == pytest.approx(lm_metrics.mean_stderr([0, 1, 0, 1]), rel=1e-12)
    items = [{"ll": x, "words": w, "bytes": b} for x, w, b in zip(lls, [2, 1, 5, 3],
                                                                  [9, 4, 30, 12], strict=True)]
    values, _ = aggregate("loglikelihood_rolling", items,
                          ("word_perplexity", "byte_perplexity", "bits_per_byte"))
    pairs = [(i["ll"], i["words"]) for i in items]
    assert values["word_perplexity"] == pytest.approx(lm_metrics.weighted_perplexity(pairs))
    byte_pairs = [(i["ll"], i["bytes"]) for i in items]
    assert values["byte_perplexity"] == pytest.approx(
        lm_metrics.weighted_perplexity(byte_pairs))
    assert values["bits_per_byte"] == pytest.approx(lm_metrics.bits_per_byte(byte_pairs))
    assert values["bits_per_byte"] == pytest.approx(
        -sum(lls) / sum(i["bytes"] for i in items) / math.log(2))


def test_builtin_tasks_are_held_out() -> None:
    """Every built-in item comes from a document mt pretrain's default split keeps out of
    training, and none from a training document."""
    from mt_data import SplitSpec, iter_corpus, split_documents

    docs = list(iter_corpus())
    split = split_documents(len(docs), SplitSpec.parse("969,30,1", seed=1234))
    held = {int(i) for i in [*split["valid"], *split["test"]]}
    normal = [" ".join(d["text"].split()) for d in docs]
    for name in ("mt-cloze", "mt-choice"):
        task = builtin_task(name)
        assert len(task.docs) >= 90
        for doc in task.docs:
            text = doc.get("text") or doc["context"]
            homes = {i for i, body in enumerate(normal) if text in body}
            assert homes and homes <= held, (name, text[:60])
    assert len(builtin_task("mt-perplexity").docs) == len(held) == 6


def test_bad_tasks_name_the_file_line_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": ["x", "y"], "label": 0}\n{not json}\n')
    with pytest.raises(TaskError, match=r"bad.jsonl:2: not JSON"):
        load_jsonl(bad)
    # JSON may escape half of a UTF-16 pair alone: no tokenizer takes that string
    bad.write_text('{"context": "smile \\ud83d\\ude00", "choices": ["x"], "label": 0}\n'
                   '{"context": "b", "choices": ["x", "y\\ud800"], "label": 0}\n')
    with pytest.raises(TaskError) as err:
        load_task(str(bad))
    assert str(err.value) == (f"{bad}:2: choices[1] holds a lone surrogate \\ud800 at "
                              "character 1: not UTF-8 text")
    bad.write_text('{"context": "a", "choices": ["x", "y"], "label": 0}\n'
                   '{"context": "b", "choices": ["x", "y"], "label": 2}\n')
    with pytest.raises(TaskError, match=r"bad.jsonl:2: 'label' must be an index into the 2"):
        load_task(str(bad))
    bad.write_text('{"context": "a", "choices": ["x", "y"], "label": 0}\n'
                   '{"context": "b", "choices": ["x", "y"], "label": true}\n')
    with pytest.raises(TaskError, match=r"bad.jsonl:2: 'label' must be an index into the 2 "
                       r"choices, got True"):
        load_task(str(bad))
    bad.write_text('{"context": "a", "choices": ["x"], "label": 0}\n{"context": "b"}\n')
    with pytest.raises(TaskError, match=r"bad.jsonl:2: field 'choices' is missing"):
        load_task(str(bad))
    bad.write_text('{"question": "a"}\n')
    with pytest.raises(TaskError, match=r"bad.jsonl:1: rows need the fields"):
        load_task(str(bad))
    yaml_file = tmp_path / "t.yaml"
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "one two three"}) + "\n")
    yaml_file.write_text(f"task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                         f"    test: {good}\ntest_split: test\noutput_type: generate_until\n"
                         "doc_to_text: text\ndoc_to_target: text\n")
    with pytest.raises(TaskError, match=r"t.yaml: output_type 'generate_until' is not"):
        load_task(str(yaml_file))
    yaml_file.write_text(yaml_file.read_text() + "process_docs: !function utils.p\n")
    with pytest.raises(TaskError, match=r"t.yaml: lm-eval's Python hooks \(!function\) are "
                                        r"not run by mt's own engine.*--engine harness"):
        load_task(str(yaml_file))
    yaml_file.write_text(f"task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                         f"    test: {good}\ntest_split: test\noutput_type: loglikelihood\n"
                         "doc_to_text: \"{{ txt }}\"\ndoc_to_target: text\n")
    task = load_task(str(yaml_file))
    with pytest.raises(TaskError, match=r"t.yaml: document 0: template .*'txt' is undefined"):
        context(task, 0, [])
    with pytest.raises(TaskError, match="unknown task 'nope'"):
        load_task("nope")
    with pytest.raises(TaskError, match="3 examples asked, but the pool holds 0"):
        fewshot_sample(load_task(str(good)), 3, 1234)


_GOOD_TASK = ("task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: rows.jsonl\n"
              "test_split: test\noutput_type: loglikelihood\ndoc_to_text: text\n"
              "doc_to_target: text\n")


@pytest.mark.parametrize("change, message", [
    # Unchecked: read as given, a TypeError when the examples are drawn.
    ("num_fewshot: three", "num_fewshot must be a whole number >= 0, got 'three'"),
    ("num_fewshot: -1", "num_fewshot must be a whole number >= 0, got -1"),
    ("num_fewshot: 1.5", "num_fewshot must be a whole number >= 0, got 1.5"),
    ("num_fewshot: true", "num_fewshot must be a whole number >= 0, got True"),
    ("target_delimiter: 3", "target_delimiter must be a string, got 3"),
    ("fewshot_delimiter: [a]", "fewshot_delimiter must be a string, got ['a']"),
    ("description: 5", "description must be a string, got 5"),
    ("task: {a: 1}", "task must be a name, got {'a': 1}"),
    ("doc_to_text: 1.5", "doc_to_text must be a field name, a template or an int, got 1.5"),
    ("doc_to_choice: {a: b}", "doc_to_choice as a mapping is not read by mt's own engine"),
    # Unchecked: "TypeError: unhashable type: 'list'".
    ("test_split: [test]", "test_split must be the name of a data_files split, got ['test']"),
    ("output_type: [a]", "output_type must be one of multiple_choice, loglikelihood, "
                         "loglikelihood_rolling, got ['a']"),
    # Unchecked: KeyError 'metric' / TypeError: 'int' object is not iterable.
    ("metric_list:\n  - aggregation: mean", "metric_list entries must be {metric: NAME} (or a "
                                            "name), got {'aggregation': 'mean'}"),
    ("metric_list: 3", "metric_list must be a list of {metric: NAME} entries, got 3"),
    # Unchecked: AttributeError: 'str' object has no attribute 'get'; TypeErrors on the files.
    ("dataset_kwargs: rows.jsonl", "dataset_kwargs must be a mapping (data_files: ...), got "
                                   "'rows.jsonl'"),
    ("dataset_kwargs: {data_files: {test: 5}}", "dataset_kwargs.data_files must name the JSONL "
                                                "file(s)"),
    ("dataset_kwargs: {data_files: {test: [5]}}", "dataset_kwargs.data_files must name the "
                                                  "JSONL file(s)"),
    ("1: x\nb: y", "1 is not supported by mt's own engine"),
])
def test_task_file_fields_of_the_wrong_type_name_the_file_and_field(
        tmp_path: Path, change: str, message: str) -> None:
    (tmp_path / "rows.jsonl").write_text('{"text": "one two three"}\n')
    key = change.split(":")[0]
    lines = [line for line in _GOOD_TASK.splitlines() if not line.startswith(f"{key}:")]
    if key == "dataset_kwargs":
        lines = [line for line in lines if not line.startswith(("  data_files", "    test:"))]
    path = tmp_path / "t.yaml"
    path.write_text("\n".join(lines) + "\n" + change + "\n")
    with pytest.raises(TaskError) as err:
        load_task(str(path))
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value), str(err.value)


def test_a_task_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_bytes(_GOOD_TASK.encode() + b"description: \xff\n")
    with pytest.raises(TaskError, match=r"t.yaml: not UTF-8 text \(invalid start byte at "
                                        r"byte \d+\)"):
        load_task(str(path))
    path.write_text(_GOOD_TASK + "description: [a, b\n")
    with pytest.raises(TaskError) as err:
        load_task(str(path))
    assert str(err.value).startswith(f"{path}: not YAML (line ")
    assert "expected ',' or ']'" in str(err.value) and "\n" not in str(err.value)
    path.write_text(_GOOD_TASK + "num_fewshot: 2\n")
    (tmp_path / "rows.jsonl").write_text('{"text": "one two three"}\n')
    assert load_task(str(path)).num_fewshot == 2


def _rolling_task(tmp_path: Path, rows: str) -> Path:
    (tmp_path / "rows.jsonl").write_text(rows)
    path = tmp_path / "roll.yaml"
    path.write_text("task: roll\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                    "    test: rows.jsonl\ntest_split: test\n"
                    "output_type: loglikelihood_rolling\ndoc_to_target: text\n")
    return path


def test_a_rolling_document_of_no_tokens_is_named(tmp_path: Path) -> None:
    """A rolling document whose text encodes to no tokens is refused, naming it (its
    metrics would leave it out); --limit past it scores the rest."""
    tok = load_tokenizer("gpt2")
    task = load_task(str(_rolling_task(tmp_path, '{"text": "the whale"}\n{"text": ""}\n')))
    with pytest.raises(TaskError, match=r"roll.yaml: document 1: the text encodes to no "
                                        r"tokens"):
        build_requests(task, tok.encode, tok.eod_id, 64, 0, 1234)
    assert len(build_requests(task, tok.encode, tok.eod_id, 64, 0, 1234, limit=1)) == 1


def test_a_perplexity_beyond_floats_is_inf_not_a_traceback() -> None:
    """A perplexity past the largest float (a mean log-likelihood below -709) is inf, as
    lm-eval writes it; a smaller one is computed as before."""
    values, errors = aggregate("loglikelihood", [{"ll": -800.0, "greedy": False},
                                                 {"ll": -900.0, "greedy": False}],
                               ("perplexity", "acc"))
    assert values["perplexity"] == math.inf and errors["perplexity"] == math.inf
    values, _ = aggregate("loglikelihood_rolling", [{"ll": -2000.0, "words": 1, "bytes": 400}],
                          ("word_perplexity", "byte_perplexity", "bits_per_byte"))
    assert values["word_perplexity"] == math.inf
    assert values["byte_perplexity"] == pytest.approx(math.exp(5.0))


def test_two_tasks_of_one_name_are_refused(tmp_path: Path) -> None:
    """Two tasks of one name are refused (the results JSON is keyed by task name, where the
    second would replace the first); the same task given twice says so."""
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "t.jsonl").write_text('{"text": "one two three"}\n')
    first, second = str(tmp_path / "a" / "t.jsonl"), str(tmp_path / "b" / "t.jsonl")
    with pytest.raises(TaskError) as err:
        load_tasks([first, second])
    assert str(err.value) == (f"{second}: its task name 't' is also {first}'s; the results "
                              "are keyed by task name: rename one")
    assert [t.name for t in load_tasks([first, "mt-cloze"])] == ["t", "mt-cloze"]
    with pytest.raises(TaskError, match=r"^mt-cloze is given twice: give each task once$"):
        load_tasks(["mt-cloze", first, "mt-cloze"])
