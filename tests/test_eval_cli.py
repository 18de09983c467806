"""`mt eval` from the command line: results as a table and JSON, and bad input reported in
one line that names the file, line or number at fault (no traceback)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from mt_cli import app
from typer.testing import CliRunner

from mt_pretrain.config.load import load_config
from mt_pretrain.launch import launch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("evalcli")
    config = load_config(None, {
        "model": "tiny", "nproc": 1, "micro_batch_size": 2, "global_batch_size": 2,
        "train_steps": 2, "eval_interval": 0, "sample_tokens": 0, "progress": False,
        "out_dir": str(root / "run"), "cache_dir": str(root / "cache")})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        launch(config, environ={}, timeout=300)
    finally:
        torch.set_num_threads(threads)
    return root / "run" / "checkpoints"


def _eval(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["eval", *args])
    return result.exit_code, result.output


def test_results_table_and_json(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "res" / "results.json"
    code, text = _eval(str(checkpoint), "--task", "mt-choice", "--task", "mt-cloze",
                       "--limit", "5", "--shots", "1", "--no-progress", "--output", str(out),
                       "--log-samples")
    assert code == 0, text
    assert "mt-choice" in text and "acc_norm" in text and f"wrote {out}" in text
    # its digest beside it, in sha256sum's format: `sha256sum -c` passes, and fails once the
    # file changes
    check = ["sha256sum", "-c", "--strict", "results.json.sha256"]
    assert subprocess.run(check, cwd=out.parent, capture_output=True).returncode == 0
    data = json.loads(out.read_text())
    # lm-evaluation-harness's schema: what reads lm-eval's results reads mt's.
    choice = data["results"]["mt-choice"]
    assert choice["sample_len"] == 5 and data["n-shot"]["mt-choice"] == 1
    assert 0 <= choice["acc,none"] <= 1 and isinstance(choice["acc_stderr,none"], float)
    assert data["n-samples"]["mt-choice"]["effective"] == 5
    assert data["higher_is_better"]["mt-cloze"]["perplexity"] is False
    assert data["config"]["tasks"] == ["mt-choice", "mt-cloze"]
    samples = data["samples"]["mt-choice"]
    assert [s["doc_id"] for s in samples] == list(range(5))
    assert all(len(s["loglikelihoods"]) == 4 and all(x < 0 for x in s["loglikelihoods"])
               for s in samples)
    assert samples[0]["resps"][0][0][0] == samples[0]["loglikelihoods"][0]
    out.write_text(out.read_text() + " ")
    assert subprocess.run(check, cwd=out.parent, capture_output=True).returncode == 1
    from lm_eval.utils import make_table

    table = make_table(data)  # lm-eval's own reader of its results
    assert "mt-choice" in table and "acc_norm" in table and f"{choice['acc,none']:.4f}" in table
    assert not list(out.parent.glob(".*.tmp")), "the JSON is written atomically"


def test_bad_input_is_one_line(checkpoint: Path, tmp_path: Path) -> None:
    """Bad input exits 2, as in mt pretrain, data, plan, plot and convert."""
    missing = tmp_path / "nowhere"
    code, text = _eval(str(missing), "--task", "mt-cloze")
    assert code == 2 and str(missing) in text and "Traceback" not in text, text
    task = tmp_path / "broken.jsonl"
    task.write_text('{"text": "one two three"}\n{"text": \n')
    code, text = _eval(str(checkpoint), "--task", str(task))
    assert code == 2 and f"{task}:2: not JSON" in text and "Traceback" not in text, text
    code, text = _eval(str(checkpoint), "--task", "mt-cloze", "--tp", "3", "--nproc", "3")
    assert code == 2 and "invalid layout" in text and "3" in text, text
    code, text = _eval(str(checkpoint), "--task", "mt-cloze", "--batch-size", "0")
    assert code == 2 and "--batch-size must be positive, got 0" in text, text
    code, text = _eval(str(checkpoint), "--task", "no-such-task", "--engine", "mt")
    assert code == 2 and "unknown task 'no-such-task'" in text, text
    code, text = _eval(str(checkpoint), "--task", "no-such-task")  # lm-eval is installed
    assert code == 2 and "--task no-such-task: not an lm-eval task" in text, text
    code, text = _eval(str(checkpoint), "--task", "mt-cloze", "--engine", "harness")
    assert code == 2 and "--task mt-cloze: mt's own tasks run with --engine mt" in text, text
    code, text = _eval(str(checkpoint), "--task", "boolq", "--data-dir", str(missing))
    assert code == 2 and f"--data-dir {missing}: no such folder" in text, text
    folder = tmp_path / "results"
    folder.mkdir()
    code, text = _eval(str(checkpoint), "--task", "mt-cloze", "--output", str(folder))
    assert code == 2 and f"--output {folder} is a folder" in text, text
    assert not list(tmp_path.glob(".*.tmp")) and not list(folder.iterdir())
    # The results written over the task file; --shots
    # -1.
    task.write_text('{"text": "one two three four"}\n')
    code, text = _eval(str(checkpoint), "--task", str(task), "--output", str(task))
    assert code == 2 and f"--output {task} is the input {task}" in " ".join(text.split())
    assert task.read_text() == '{"text": "one two three four"}\n'
    code, text = _eval(str(checkpoint), "--task", "mt-cloze", "--shots", "-1")
    assert code == 2 and "--shots must be 0 or more, got -1" in text, text
    # --device cuda where torch has no GPU; the same check serves mt generate, serve and bias.
    if not torch.cuda.is_available():
        code, text = _eval(str(checkpoint), "--task", "mt-cloze", "--device", "cuda")
        assert code == 2 and "--device cuda: torch" in text and "Traceback" not in text, text
    code, text = _eval(str(checkpoint), "--task", "mt-cloze", "--device", "tpu",
                       "--precision", "fp8")
    assert code == 2 and "--device must be auto, cpu or cuda, got 'tpu'; --precision must " \
        "be one of fp32, bf16, fp16, got 'fp8'" in " ".join(text.split()), text


def test_auto_keeps_task_files_on_mts_engine(checkpoint: Path, tmp_path: Path) -> None:
    """A task file mt's own engine reads still runs there by default (a command that ran
    before the harness engine runs the same way); one with lm-eval's hooks goes to lm-eval."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "one two three four"}\n{"text": "five six seven eight"}\n')
    own = tmp_path / "own.yaml"
    own.write_text(f"task: own\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                   f"    test: {rows}\ntest_split: test\noutput_type: loglikelihood_rolling\n"
                   "doc_to_text: \"\"\ndoc_to_target: text\n")
    code, text = _eval(str(checkpoint), "--task", str(own), "--no-progress")
    assert code == 0 and "mt eval" in text and "|Tasks|" not in text, text  # mt's table
    hooked = tmp_path / "hooked.yaml"
    hooked.write_text(own.read_text().replace("task: own", "task: hooked")
                      + "process_docs: !function nowhere.process\n")
    code, text = _eval(str(checkpoint), "--task", str(hooked), "--no-progress")
    # lm-eval's loader met the hook (no module "nowhere"): one line, exit 2
    assert code == 2 and "lm-evaluation-harness cannot load it" in text and "nowhere" in text
    assert "Traceback" not in text, text


def test_an_output_that_cannot_be_written_is_refused_before_the_work(tmp_path: Path) -> None:
    """--output under a regular file (root writes anywhere, so not a read-only folder): one
    line naming it, exit 2, before the checkpoint is even read."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    missing = tmp_path / "no-checkpoint"
    code, text = _eval(str(missing), "--task", "mt-cloze", "--output",
                       str(blocker / "sub" / "results.json"))
    assert code == 2 and "Traceback" not in text, text
    assert f"--output {blocker}/sub/results.json: {blocker} is a file, not a folder" in \
        " ".join(text.split()), text
    assert "no-checkpoint" not in text, text  # found first


def test_a_task_file_field_of_the_wrong_type_is_one_line(tmp_path: Path) -> None:
    """`num_fewshot: three`:
    named with the file and the field, before the checkpoint is read."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "one two three four"}\n')
    task = tmp_path / "task.yaml"
    task.write_text(f"task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                    f"    test: {rows}\ntest_split: test\noutput_type: loglikelihood_rolling\n"
                    "doc_to_text: \"\"\ndoc_to_target: text\nnum_fewshot: three\n")
    code, text = _eval(str(tmp_path / "no-checkpoint"), "--task", str(task))
    assert code == 2 and "Traceback" not in text, text
    assert f"{task}: num_fewshot must be a whole number >= 0, got 'three'" in \
        " ".join(text.split()), text


def test_a_tokenizer_other_than_the_runs_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    """The checkpoint records the fingerprint of the tokenizer the run trained with: another
    one given with --tokenizer, or the recorded file edited since, is refused in one line
    (ids of another tokenizer read as other text)."""
    import dataclasses
    import shutil

    from mt_checkpoint import find_checkpoint, read_meta
    from mt_data import load_tokenizer, train_tokenizer
    from mt_data.corpus import corpus_texts

    step = find_checkpoint(checkpoint)
    meta = read_meta(step)
    assert (meta.tokenizer, meta.tokenizer_sha256) == (
        "tokenizer-1k", load_tokenizer("tokenizer-1k").fingerprint)
    code, text = _eval(str(checkpoint), "--task", "mt-cloze", "--tokenizer", "gpt2")
    assert code == 2 and f"{step}: --tokenizer gpt2 is not the one the run trained with " \
        "(sha256 " in " ".join(text.split()) and "Traceback" not in text, text
    # The run's tokenizer as a file: the same fingerprint runs; the file edited is refused.
    tok = tmp_path / "tok.json"
    load_tokenizer("tokenizer-1k").save(tok)
    copy = tmp_path / "ckpt" / step.name
    shutil.copytree(step, copy)
    (copy / "meta.json").write_text(dataclasses.replace(meta, tokenizer=str(tok)).as_json())
    code, text = _eval(str(copy), "--task", "mt-cloze", "--limit", "2", "--no-progress")
    assert code == 0, text
    train_tokenizer(corpus_texts()[:30], 1000).save(tok)
    code, text = _eval(str(copy), "--task", "mt-cloze", "--limit", "2", "--no-progress")
    assert code == 2 and f"{copy}: the tokenizer at {tok} is not the one the run trained " \
        "with" in " ".join(text.split()) and "restore it, or pass --tokenizer with the " \
        "run's" in " ".join(text.split()), text
