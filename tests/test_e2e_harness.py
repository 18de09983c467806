"""Cross-app: mt as a model of lm-evaluation-harness, on lm-eval's own task files.

A tiny GPT trained briefly by `mt pretrain` with the GPT-2 vocabulary, exported by `mt convert
--to hf`. MT-NLG's tasks as lm-eval 0.4.13 ships them (lambada_openai, boolq, race, piqa,
hellaswag, winogrande, anli_r1, wic: their YAMLs unchanged, Python hooks and multiple-input
scoring included) read local rows in each dataset's own schema through `mt eval --data-dir`.
`mt eval` (the harness engine) scores the mt checkpoint, lm-eval's HF backend the export: every
per-item log-likelihood within 1e-4 (fp32), greedy flags and metrics identical, at 0 and 2
shots; the same at TP 2 x PP 2 (4 processes); `python -m mt_inference.lm_eval --model mt`
(lm-eval's own command line) writes lm-eval's numbers; a missing file is named; without
--data-dir and with the hub out of reach, a dataset not cached fails at once.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from e2e_models import single_threaded, trained_gpt2_vocab
from harness_data import LAYOUT, rows, write_data
from mt_cli import app
from typer.testing import CliRunner

from mt_inference.launch import evaluate
from mt_inference.placement import Placement
from mt_inference.rank import EvalSpec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

TOL = 1e-4
TASKS = ("lambada_openai", "boolq", "race", "piqa", "hellaswag", "winogrande", "anli_r1", "wic")
DOCS = 6  # evaluated documents per task (and as many few-shot candidates)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("harness")
    ckpt, hf = trained_gpt2_vocab(root)
    data = root / "data"
    write_data(data, LAYOUT, lambda _split: DOCS)
    assert ast.literal_eval(rows("race", 1, 0)[0]["problems"])[0]["options"]  # real schema
    # Results of the evaluations several tests compare against (one process at 2 shots, mt
    # and lm-eval's HF backend), computed once: the tests only read them.
    return {"root": root, "ckpt": ckpt, "hf": hf, "data": data, "results": {}}


def _once(setup: dict[str, Any], key: tuple[Any, ...], run: Callable[[], dict]) -> dict:
    """``run()``'s results, computed on first use by this module's tests."""
    if key not in setup["results"]:
        setup["results"][key] = run()
    return setup["results"][key]


def _mt(setup: dict[str, Any], shots: int, **layout: Any) -> dict:
    def run() -> dict:
        spec = EvalSpec(Placement(str(setup["ckpt"]), **layout), TASKS, shots=shots,
                        batch_size=8, progress=False, engine="harness",
                        data_dir=str(setup["data"]), log_samples=True)
        return single_threaded(evaluate, spec, {}, 900)

    return _once(setup, ("mt", shots, *sorted(layout.items())), run)


def _hf(setup: dict[str, Any], shots: int) -> dict:
    return _once(setup, ("hf", shots), lambda: _hf_run(setup, shots))


def _hf_run(setup: dict[str, Any], shots: int) -> dict:
    import lm_eval

    from mt_inference.harness import local_task, task_manager

    manager = task_manager()
    tasks = [local_task(t, setup["data"], manager, shots) for t in TASKS]
    return single_threaded(
        lm_eval.simple_evaluate, model="hf",
        model_args=f"pretrained={setup['hf']},dtype=float32", tasks=tasks, num_fewshot=shots,
        batch_size=8, device="cpu", log_samples=True, task_manager=manager,
        fewshot_random_seed=1234)


def _per_item(results: dict, task: str) -> dict[int, list[tuple[float, bool | None]]]:
    out = {}
    for sample in results["samples"][task]:
        out[sample["doc_id"]] = [(r[0][0], bool(r[0][1])) if isinstance(r[0], (list, tuple))
                                 else (r[0], None) for r in sample["resps"]]
    return out


def _assert_same(ours: dict, theirs: dict, what: str) -> None:
    for task in TASKS:
        mine, ref = _per_item(ours, task), _per_item(theirs, task)
        assert sorted(mine) == sorted(ref) and len(ref) == DOCS, (what, task)
        for doc_id, items in ref.items():
            got = mine[doc_id]
            assert [g for _, g in got] == [g for _, g in items], (what, task, doc_id)
            assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in items], abs=TOL,
                                                          rel=0), (what, task, doc_id)
        for key, value in theirs["results"][task].items():
            if key.startswith(("acc", "f1", "mcc")) and "stderr" not in key:
                assert ours["results"][task][key] == value, (what, task, key)
            elif key.startswith(("perplexity", "word_perplexity")):
                # exp(-mean ll): per-item log-likelihoods within TOL move it by at most
                # a factor exp(TOL), so relative TOL (measured: 2e-6)
                assert ours["results"][task][key] == pytest.approx(value, rel=TOL), (task, key)


@pytest.mark.parametrize("shots", [0, 2])
def test_mt_through_the_harness_equals_lm_eval_hf(setup: dict[str, Any], shots: int) -> None:
    ours, theirs = _mt(setup, shots), _hf(setup, shots)
    _assert_same(ours, theirs, f"{shots}-shot")
    assert ours["n-shot"] == theirs["n-shot"] and set(ours["configs"]) == set(TASKS)
    # The prompts themselves are lm-eval's (its few-shot draw, its hooks): string for string.
    for task in TASKS:
        a = [s["arguments"] for s in ours["samples"][task]]
        b = [s["arguments"] for s in theirs["samples"][task]]
        assert a == b, task


def test_tp2_pp2_scores_like_one_process(setup: dict[str, Any]) -> None:
    _assert_same(_mt(setup, 2, tp=2, pp=2, nproc=4), _mt(setup, 2), "tp2 x pp2")


def test_lm_eval_command_line_with_model_mt(setup: dict[str, Any], tmp_path: Path) -> None:
    """`python -m mt_inference.lm_eval --model mt` is lm-eval's command line with mt
    registered: its results file holds lm-eval --model hf's numbers."""
    import yaml

    from mt_inference.harness import local_task, task_manager

    config = local_task("boolq", setup["data"], task_manager(), 2)
    config = {**{k: v for k, v in config.items() if not callable(v)}, "task": "boolq_local"}
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "boolq_local.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(os.path.abspath(p) for p in sys.path if p)}
    run = subprocess.run(
        [sys.executable, "-m", "mt_inference.lm_eval", "--model", "mt", "--model_args",
         f"checkpoint={setup['ckpt']}", "--tasks", "boolq_local", "--include_path",
         str(tmp_path / "tasks"), "--num_fewshot", "2", "--device", "cpu",
         "--output_path", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    written = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    theirs = _hf(setup, 2)
    assert written["results"]["boolq_local"]["acc,none"] == theirs["results"]["boolq"]["acc,none"]
    assert "boolq_local" in run.stdout  # lm-eval's table


def test_a_missing_local_file_is_named(setup: dict[str, Any], tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["eval", str(setup["ckpt"]), "--task", "piqa",
                                      "--data-dir", str(tmp_path), "--no-progress"])
    assert result.exit_code == 2, result.output
    expected = tmp_path / "baber" / "piqa" / "validation.jsonl"
    assert f"task piqa: no local copy of {expected}" in " ".join(result.output.split())


def test_a_task_from_a_hub_out_of_reach_fails_at_once(setup: dict[str, Any]) -> None:
    """No --data-dir and no hub (an endpoint that cannot resolve): one warning says the
    datasets come from the local cache only, and a dataset not cached fails in one line,
    without `datasets`' download retries."""
    env = {k: v for k, v in os.environ.items() if k not in (
        "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="https://hub.invalid", HF_HOME=str(setup["root"] / "hf-home"),
               OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(os.path.abspath(p) for p in sys.path if p))
    run = subprocess.run(
        [sys.executable, "-c", "import sys; sys.argv[0] = 'mt'; from mt_cli import app; app()",
         "eval", str(setup["ckpt"]), "--task", "boolq", "--no-progress"],
        env=env, capture_output=True, text=True, timeout=300)
    said = " ".join(run.stderr.split())
    assert run.returncode == 2, run.stderr[-3000:]
    assert "warning: the Hugging Face hub cannot be reached (hub.invalid does not resolve" in said
    assert "error: --task boolq: lm-evaluation-harness cannot load it:" in said, said
    assert "Retrying" not in said, said
