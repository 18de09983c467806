"""Cross-app: the rest of mt through lm-evaluation-harness (the model of test_e2e_harness.py):
`mt eval --suite mt-nlg` (MT-NLG's eleven tasks at zero, one and few shots in one command:
lm-eval's results JSON per setting, the paper-like table and its plot), and lm-eval's
``generate_until`` requests decoded by mt (one process and DP 2), string for string
as lm-eval's HF backend."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from e2e_models import single_threaded, trained_gpt2_vocab
from harness_data import SUITE_LAYOUT, rows, write_data
from mt_cli import app
from typer.testing import CliRunner

from mt_inference.launch import evaluate
from mt_inference.placement import Placement
from mt_inference.rank import EvalSpec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    ckpt, hf = trained_gpt2_vocab(tmp_path_factory.mktemp("harness_suite"))
    return {"ckpt": ckpt, "hf": hf}


def test_the_mt_nlg_suite(setup: dict[str, Path], tmp_path: Path) -> None:
    """`mt eval --suite mt-nlg`: MT-NLG's eleven tasks (HANS from mt's own task file) at zero,
    one and few shots (the suite's counts), one command: lm-eval's results JSON per setting,
    the paper-like table and its plot."""
    from mt_inference.suites import SUITES

    suite = SUITES["mt-nlg"]
    assert set(suite.tasks) == set(SUITE_LAYOUT)
    data = tmp_path / "data"  # enough documents for 50 examples (+ the one left out)
    write_data(data, SUITE_LAYOUT, lambda split: 52 if "train" in split else 17)
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
    check = subprocess.run(["sha256sum", "-c", "--strict", "SHA256SUMS"], cwd=out,
                           capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.count(": OK") == 5, check.stdout
    bad = CliRunner().invoke(app, ["eval", str(setup["ckpt"]), "--suite", "mt-nlg",
                                   "--shots", "3"])
    assert bad.exit_code == 2 and "--shots with --suite" in bad.output


def test_generate_until_equals_lm_eval_hf(setup: dict[str, Path], tmp_path: Path) -> None:
    """A generate_until task (greedy, stop strings, a budget of new tokens): mt's text equals
    lm-eval's HF backend's, string for string, and so does exact_match, at one process and
    at DP 2."""
    documents = rows("lambada_openai", 8, 3)
    data = tmp_path / "gen.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in documents), encoding="utf-8")
    (tmp_path / "t_gen.yaml").write_text(
        f"task: t_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: generate_until\n"
        "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
        "doc_to_target: \"{{' '+text.split(' ')[-1]}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: 6\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n", encoding="utf-8")
    spec = EvalSpec(Placement(str(setup["ckpt"])), (str(tmp_path / "t_gen.yaml"),),
                    progress=False, engine="harness", log_samples=True)
    ours = single_threaded(evaluate, spec, {}, 600)

    import lm_eval

    from mt_inference.harness import task_manager

    theirs = single_threaded(
        lm_eval.simple_evaluate, model="hf",
        model_args=f"pretrained={setup['hf']},dtype=float32", tasks=["t_gen"], batch_size=1,
        device="cpu", log_samples=True, task_manager=task_manager((str(tmp_path),)))
    texts = [s["resps"][0][0] for s in ours["samples"]["t_gen"]]
    assert texts == [s["resps"][0][0] for s in theirs["samples"]["t_gen"]]
    assert all(texts), texts  # real continuations (this barely trained model: " the the...")
    assert ours["results"]["t_gen"]["exact_match,none"] == \
        theirs["results"]["t_gen"]["exact_match,none"]
    # A task file added to the folder since: the process's next index has it.
    yaml = (tmp_path / "t_gen.yaml").read_text(encoding="utf-8")
    (tmp_path / "t_gen2.yaml").write_text(yaml.replace("task: t_gen", "task: t_gen2"))
    assert "t_gen2" in task_manager((str(tmp_path),)).task_index
    # Decoded by two replicas (DP 2: each completes half the requests; TP and PP decoding are
    # test_e2e_generate_layouts.py's): the same texts.
    parallel = EvalSpec(Placement(str(setup["ckpt"]), nproc=2),
                        (str(tmp_path / "t_gen.yaml"),), progress=False, engine="harness",
                        log_samples=True)
    shared = single_threaded(evaluate, parallel, {}, 600)
    assert [s["resps"][0][0] for s in shared["samples"]["t_gen"]] == texts
