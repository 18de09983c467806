"""Cross-app: mt as a model of lm-evaluation-harness, on lm-eval's own task files.

A tiny GPT trained briefly by `mt pretrain` with the GPT-2 vocabulary, exported by `mt convert
--to hf`. MT-NLG's tasks as lm-eval 0.4.13 ships them (lambada_openai, boolq, race, piqa,
hellaswag, winogrande, anli_r1, wic: their YAMLs unchanged, Python hooks and multiple-input
scoring included) read local rows in each dataset's own schema through `mt eval --data-dir`.
`mt eval` (the harness engine) scores the mt checkpoint, lm-eval's HF backend the export: every
per-item log-likelihood within 1e-4 (fp32), greedy flags and metrics identical, at 0 and 2
shots; the same at TP 2 x PP 2 (4 processes); `python -m mt_pretrain.lm_eval --model mt`
(lm-eval's own command line) writes lm-eval's numbers; a missing file is named.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from e2e_models import single_threaded, trained_gpt2_vocab
from typer.testing import CliRunner

from mt_eval import builtin_task
from mt_pretrain.cli.app import app
from mt_pretrain.evaluation.rank import EvalSpec
from mt_pretrain.launch import launch_eval

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

TOL = 1e-4
TASKS = ("lambada_openai", "boolq", "race", "piqa", "hellaswag", "winogrande", "anli_r1", "wic")
DOCS = 6  # evaluated documents per task (and as many few-shot candidates)


def _sentences() -> list[list[str]]:
    """Word lists of held-out sentences of the embedded corpus (real text)."""
    out = []
    for doc in builtin_task("mt-perplexity").docs:
        for sentence in doc["text"].replace("\n", " ").split(". "):
            words = sentence.split()
            if 8 <= len(words) <= 30:
                out.append(words)
    return out


def _rows(task: str, n: int, offset: int) -> list[dict[str, Any]]:
    """``n`` rows of ``task`` in its dataset's own schema (fields and types as on the hub)."""
    s = _sentences()
    pick = lambda i: s[(offset * 7 + i * 3) % len(s)]  # noqa: E731
    text = lambda i: " ".join(pick(i))  # noqa: E731
    rows: list[dict[str, Any]] = []
    for i in range(n):
        w = pick(i)
        if task == "lambada_openai":
            rows.append({"text": text(i)})
        elif task == "boolq":
            rows.append({"question": " ".join(w[:6]).lower(), "passage": text(i + 1) + ". " +
                         text(i + 2), "idx": i, "label": (i + offset) % 2})
        elif task == "race":
            problems = [{"question": " ".join(pick(i + k)[:5]) + "?", "answer": "ABCD"[k % 4],
                         "options": [" ".join(pick(i + k + j)[-3:]) for j in range(4)]}
                        for k in range(2)]
            rows.append({"example_id": f"high{i}.txt", "article": text(i + 1) + ". " +
                         text(i + 3), "problems": str(problems)})
        elif task == "piqa":
            rows.append({"goal": " ".join(w[:7]), "sol1": " ".join(pick(i + 1)[:6]),
                         "sol2": " ".join(pick(i + 2)[:6]), "label": (i + offset) % 2})
        elif task == "hellaswag":
            rows.append({"ind": i, "activity_label": w[0].capitalize(),
                         "ctx_a": " ".join(w[1:8]), "ctx_b": " ".join(w[8:11]),
                         "ctx": " ".join(w[1:11]), "endings": [" ".join(pick(i + j)[-5:])
                                                              for j in range(4)],
                         "source_id": f"corpus~{i}", "split": "val", "split_type": "indomain",
                         "label": str((i + offset) % 4)})
        elif task == "winogrande":
            rows.append({"sentence": " ".join(w[:4]) + " _ " + " ".join(w[4:10]),
                         "option1": pick(i + 1)[0], "option2": pick(i + 2)[0],
                         "answer": str(1 + (i + offset) % 2)})
        elif task == "hans":
            rows.append({"premise": text(i), "hypothesis": " ".join(pick(i + 1)[:7]),
                         "label": (i + offset) % 2, "parse_premise": "", "parse_hypothesis": "",
                         "binary_parse_premise": "", "binary_parse_hypothesis": "",
                         "heuristic": "lexical_overlap", "subcase": "ln_subject/object_swap",
                         "template": f"temp{i % 3}"})
        elif task.startswith("anli_r"):
            rows.append({"uid": f"u{offset}-{i}", "premise": text(i), "hypothesis":
                         " ".join(pick(i + 1)[:8]), "label": (i + offset) % 3, "reason": ""})
        elif task == "wic":
            a, b = text(i), text(i + 1)
            word = w[2]
            start = a.index(word)
            rows.append({"word": word, "sentence1": a, "sentence2": b, "start1": start,
                         "end1": start + len(word), "start2": 0, "end2": len(b.split()[0]),
                         "idx": i, "label": (i + offset) % 2})
    return rows


#: (dataset folder under DATA_DIR, splits) of each task: lm-eval's dataset_path/dataset_name.
LAYOUT = {
    "lambada_openai": ("EleutherAI/lambada_openai/default", ("test",)),
    "boolq": ("aps/super_glue/boolq", ("train", "validation")),
    "race": ("EleutherAI/race/high", ("test",)),
    "piqa": ("baber/piqa", ("train", "validation")),
    "hellaswag": ("Rowan/hellaswag", ("train", "validation")),
    "winogrande": ("allenai/winogrande/winogrande_xl", ("train", "validation")),
    "anli_r1": ("facebook/anli", ("train_r1", "test_r1")),
    "wic": ("aps/super_glue/wic", ("train", "validation")),
}
#: The rest of MT-NLG's tasks (`mt eval --suite mt-nlg`).
SUITE_LAYOUT = {
    **LAYOUT,
    "anli_r2": ("facebook/anli", ("train_r2", "test_r2")),
    "anli_r3": ("facebook/anli", ("train_r3", "test_r3")),
    "hans": ("jhu-cogsci/hans", ("train", "validation")),
}


def _write_data(data: Path, layout: dict[str, tuple[str, tuple[str, ...]]],
                rows: Any) -> None:
    """Every task's splits under ``data`` (``rows(split)``: how many rows a split gets)."""
    for task, (folder, splits) in layout.items():
        (data / folder).mkdir(parents=True, exist_ok=True)
        for k, split in enumerate(splits):
            part = _rows(task, rows(split), offset=10 * k + 1 if "train" in split else 0)
            (data / folder / f"{split}.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("harness")
    ckpt, hf = trained_gpt2_vocab(root)
    data = root / "data"
    _write_data(data, LAYOUT, lambda _split: DOCS)
    assert ast.literal_eval(_rows("race", 1, 0)[0]["problems"])[0]["options"]  # real schema
    return {"root": root, "ckpt": ckpt, "hf": hf, "data": data}


def _mt(setup: dict[str, Path], shots: int, **layout: Any) -> dict:
    spec = EvalSpec(str(setup["ckpt"]), TASKS, shots=shots, batch_size=8, progress=False,
                    engine="harness", data_dir=str(setup["data"]), log_samples=True, **layout)
    return single_threaded(launch_eval, spec, {}, 900)


def _hf(setup: dict[str, Path], shots: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from mt_pretrain.evaluation.harness import local_task

    manager = TaskManager()
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
                assert ours["results"][task][key] == pytest.approx(value, rel=1e-3), (task, key)


@pytest.mark.parametrize("shots", [0, 2])
def test_mt_through_the_harness_equals_lm_eval_hf(setup: dict[str, Path], shots: int) -> None:
    ours, theirs = _mt(setup, shots), _hf(setup, shots)
    _assert_same(ours, theirs, f"{shots}-shot")
    assert ours["n-shot"] == theirs["n-shot"] and set(ours["configs"]) == set(TASKS)
    # The prompts themselves are lm-eval's (its few-shot draw, its hooks): string for string.
    for task in TASKS:
        a = [s["arguments"] for s in ours["samples"][task]]
        b = [s["arguments"] for s in theirs["samples"][task]]
        assert a == b, task


def test_tp2_pp2_scores_like_one_process(setup: dict[str, Path]) -> None:
    _assert_same(_mt(setup, 2, tp=2, pp=2, nproc=4), _mt(setup, 2), "tp2 x pp2")


def test_lm_eval_command_line_with_model_mt(setup: dict[str, Path], tmp_path: Path) -> None:
    """`python -m mt_pretrain.lm_eval --model mt` is lm-eval's command line with mt
    registered: its results file holds lm-eval --model hf's numbers."""
    import yaml
    from lm_eval.tasks import TaskManager

    from mt_pretrain.evaluation.harness import local_task

    config = local_task("boolq", setup["data"], TaskManager(), 2)
    config = {**{k: v for k, v in config.items() if not callable(v)}, "task": "boolq_local"}
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "boolq_local.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(os.path.abspath(p) for p in sys.path if p)}
    run = subprocess.run(
        [sys.executable, "-m", "mt_pretrain.lm_eval", "--model", "mt", "--model_args",
         f"checkpoint={setup['ckpt']}", "--tasks", "boolq_local", "--include_path",
         str(tmp_path / "tasks"), "--num_fewshot", "2", "--device", "cpu",
         "--output_path", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    written = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    theirs = _hf(setup, 2)
    assert written["results"]["boolq_local"]["acc,none"] == theirs["results"]["boolq"]["acc,none"]
    assert "boolq_local" in run.stdout  # lm-eval's table


def test_a_missing_local_file_is_named(setup: dict[str, Path], tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["eval", str(setup["ckpt"]), "--task", "piqa",
                                      "--data-dir", str(tmp_path), "--no-progress"])
    assert result.exit_code == 2, result.output
    expected = tmp_path / "baber" / "piqa" / "validation.jsonl"
    assert f"task piqa: no local copy of {expected}" in " ".join(result.output.split())


def test_the_mt_nlg_suite(setup: dict[str, Path], tmp_path: Path) -> None:
    """`mt eval --suite mt-nlg`: MT-NLG's eleven tasks (HANS from mt's own task file) at zero,
    one and few shots (the suite's counts), one command: lm-eval's results JSON per setting,
    the paper-like table and its plot."""
    from mt_pretrain.evaluation.suites import SUITES

    suite = SUITES["mt-nlg"]
    assert set(suite.tasks) == set(SUITE_LAYOUT)
    data = tmp_path / "data"  # enough documents for 50 examples (+ the one left out)
    _write_data(data, SUITE_LAYOUT, lambda split: 52 if "train" in split else 17)
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["eval", str(setup["ckpt"]), "--suite", "mt-nlg",
                                      "--data-dir", str(data), "--limit", "2", "--no-progress",
                                      "--output", str(out)])
    assert result.exit_code == 0, result.output
    for setting, shots in suite.settings().items():
        written = json.loads((out / f"results_{setting}.json").read_text())
        assert written["n-shot"] == shots, setting
        assert set(written["results"]) == set(suite.tasks)
        assert all(0 <= r["acc,none"] <= 1 for r in written["results"].values())
    table = (out / "table.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == "| task | 0-shot | 1-shot | few-shot |" and len(rows) == 12
    assert "| winogrande |" in table and "(50) |" in table and "| hans |" in table
    assert (out / "table.png").read_bytes()[:4] == b"\x89PNG"
    bad = CliRunner().invoke(app, ["eval", str(setup["ckpt"]), "--suite", "mt-nlg",
                                   "--shots", "3"])
    assert bad.exit_code == 2 and "--shots with --suite" in bad.output


def test_generate_until_equals_lm_eval_hf(setup: dict[str, Path], tmp_path: Path) -> None:
    """A generate_until task (greedy, stop strings, a budget of new tokens): mt's text equals
    lm-eval's HF backend's, string for string, and so does exact_match."""
    rows = _rows("lambada_openai", 8, 3)
    data = tmp_path / "gen.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (tmp_path / "t_gen.yaml").write_text(
        f"task: t_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: generate_until\n"
        "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
        "doc_to_target: \"{{' '+text.split(' ')[-1]}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: 6\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n", encoding="utf-8")
    spec = EvalSpec(str(setup["ckpt"]), (str(tmp_path / "t_gen.yaml"),), progress=False,
                    engine="harness", log_samples=True)
    ours = single_threaded(launch_eval, spec, {}, 600)

    import lm_eval
    from lm_eval.tasks import TaskManager

    theirs = single_threaded(
        lm_eval.simple_evaluate, model="hf",
        model_args=f"pretrained={setup['hf']},dtype=float32", tasks=["t_gen"], batch_size=1,
        device="cpu", log_samples=True, task_manager=TaskManager(include_path=str(tmp_path)))
    texts = [s["resps"][0][0] for s in ours["samples"]["t_gen"]]
    assert texts == [s["resps"][0][0] for s in theirs["samples"]["t_gen"]]
    assert all(texts), texts  # real continuations (this barely trained model: " the the...")
    assert ours["results"]["t_gen"]["exact_match,none"] == \
        theirs["results"]["t_gen"]["exact_match,none"]
    refused = EvalSpec(str(setup["ckpt"]), (str(tmp_path / "t_gen.yaml"),), progress=False,
                       engine="harness", tp=2, nproc=2)
    with pytest.raises(Exception, match="mt decodes on one process for now"):
        single_threaded(launch_eval, refused, {}, 600)
