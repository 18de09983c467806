"""Cross-app: `mt eval` gives lm-evaluation-harness's numbers, at any layout.

A tiny GPT trained briefly by `mt pretrain` with the GPT-2 vocabulary is exported by `mt
convert --to hf` (weights, config and, unasked, the tokenizer it trained with). lm-eval's HF
backend (a pinned test dependency) scores the export; `mt eval` scores the mt checkpoint.
Multiple-choice, cloze and rolling-perplexity tasks, zero-shot and with 2 examples (the same
examples: lm-eval's seed): every per-item log-likelihood within 1e-4 (fp32), every greedy
flag and acc / acc_norm identical. Then TP 2 x PP 2 (4 processes) against one process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from e2e_models import single_threaded, trained_gpt2_vocab

from mt_eval import builtin_task
from mt_inference.launch import evaluate
from mt_inference.placement import Placement
from mt_inference.rank import EvalSpec
from mt_pretrain.config.load import load_config
from mt_pretrain.launch import launch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

TOL = 1e-4
#: lm-eval's Hugging Face model sums each window's token log-probabilities in float32: a
#: rolling log-likelihood of -1,472 carries its rounding (one float32 unit of it is 1.2e-4),
#: which mt's float64 sums do not. Log-likelihoods agree within TOL or 4 float32 rounding
#: units of the value, whichever is larger.
REF_REL = 4 * 2.0**-24
TASKS = {
    "mc": "output_type: multiple_choice\nfewshot_split: test\ndoc_to_text: context\n"
          "doc_to_choice: choices\ndoc_to_target: label\n",
    "cloze": "output_type: loglikelihood\nfewshot_split: test\n"
             "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
             "doc_to_target: \"{{' '+text.split(' ')[-1]}}\"\ntarget_delimiter: \"\"\n",
    "ppl": "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: text\n",
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval")
    ckpt, _hf = trained_gpt2_vocab(root, steps=12)  # enough for some greedy continuations
    assert (root / "hf" / "tokenizer.json").exists(), "the export must carry its tokenizer"
    # ... that transformers loads unaided: GPT-2's ids, and a text-generation pipeline.
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "hf")
    assert tokenizer("Hello world")["input_ids"] == [15496, 995]
    assert tokenizer.eos_token_id == 50256
    generate = transformers.pipeline("text-generation", model=str(root / "hf"), device="cpu")
    assert generate("The whale", max_new_tokens=3, do_sample=False)[0][
        "generated_text"].startswith("The whale")
    tasks = root / "tasks"
    tasks.mkdir()
    rows = {"mc": builtin_task("mt-choice").docs[:10],
            # plus an item a barely trained model gets right: "the" is its greedy word
            "cloze": (*builtin_task("mt-cloze").docs[:9],
                      {"text": "He went down to the sea, and then up into the"}),
            # document beginnings: a few windows each (long documents: see the note below)
            "ppl": tuple({"text": d["text"][:600]} for d in builtin_task("mt-perplexity").docs[:3])}
    for name, body in TASKS.items():
        data = tasks / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows[name]), encoding="utf-8")
        (tasks / f"{name}.yaml").write_text(
            f"task: t_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\n{body}", encoding="utf-8")
    return {"root": root, "ckpt": ckpt, "hf": root / "hf", "tasks": tasks}


def _mt(setup: dict[str, Path], names: list[str], shots: int, source: str = "ckpt",
        **layout: int) -> dict:
    spec = EvalSpec(Placement(str(setup[source]), **layout),
                    tuple(str(setup["tasks"] / f"{n}.yaml") for n in names), shots=shots,
                    batch_size=8, progress=False)
    results = single_threaded(evaluate, spec, {}, 600)
    return {r.name: r for r in results}


@pytest.fixture(scope="module")
def one_process(setup: dict[str, Path]) -> dict:
    """`mt eval` of every task at 2 shots on one process, the mt checkpoint: what the other
    layouts, sources and engines must score like (computed once; the tests only read it)."""
    return _mt(setup, list(TASKS), 2)


def _lm_eval(setup: dict[str, Path], names: list[str], shots: int) -> dict:
    import lm_eval

    from mt_inference.harness import task_manager

    out = single_threaded(lambda: lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={setup['hf']},dtype=float32",
        tasks=[f"t_{n}" for n in names], num_fewshot=shots, batch_size=8, device="cpu",
        log_samples=True, task_manager=task_manager((str(setup["tasks"]),)),
        fewshot_random_seed=1234, bootstrap_iters=0))
    return out


@pytest.mark.parametrize("shots", [0, 2])
def test_mt_eval_equals_lm_eval(setup: dict[str, Path], shots: int) -> None:
    names = list(TASKS) if shots == 0 else ["mc", "cloze"]
    ours, theirs = _mt(setup, names, shots), _lm_eval(setup, names, shots)
    greedy_seen = False
    for task, samples in theirs["samples"].items():
        mine = {s["doc_id"]: s for s in ours[task].samples}
        assert sorted(mine) == sorted(s["doc_id"] for s in samples)
        for sample in samples:
            if task == "t_ppl":
                lls, greedy = [r[0] for r in sample["resps"]], None
            else:
                lls = [r[0][0] for r in sample["resps"]]
                greedy = [bool(r[0][1]) for r in sample["resps"]]
            got = mine[sample["doc_id"]]
            assert got["loglikelihoods"] == pytest.approx(lls, abs=TOL, rel=REF_REL), (
                task, sample)
            if greedy is not None:
                assert got["is_greedy"] == greedy, (task, sample["doc_id"])
                greedy_seen |= any(greedy)
        for key, value in theirs["results"][task].items():
            metric = key.split(",")[0]
            if metric in ("acc", "acc_norm"):
                assert ours[task].metrics[metric] == value, (task, metric)
            elif metric in ours[task].metrics:
                assert ours[task].metrics[metric] == pytest.approx(value, rel=1e-6), (task, key)
    assert greedy_seen, "no greedy continuation at all: the is_greedy check proved nothing"


@pytest.mark.parametrize("other", ["tp2-pp2", "hf-folder"])
def test_layouts_and_sources_agree(setup: dict[str, Path], one_process: dict,
                                   other: str) -> None:
    """TP 2 x PP 2 on 4 processes, and the Hugging Face export given to `mt eval` as it is
    (converted by `mt convert` on the fly, its own tokenizer), score like one process on the
    mt checkpoint."""
    one = one_process
    four = _mt(setup, list(TASKS), 2, tp=2, pp=2, nproc=4) if other == "tp2-pp2" else \
        _mt(setup, list(TASKS), 2, source="hf")
    for task, result in one.items():
        other = four[task]
        assert other.metrics.keys() == result.metrics.keys()
        for metric in ("acc", "acc_norm"):
            if metric in result.metrics:
                assert other.metrics[metric] == result.metrics[metric], (task, metric)
        for a, b in zip(result.samples, other.samples, strict=True):
            assert b["loglikelihoods"] == pytest.approx(a["loglikelihoods"], abs=TOL, rel=0)
            assert b["is_greedy"] == a["is_greedy"], (task, a["doc_id"])


def test_pretrain_eval_task_equals_mt_eval(tmp_path: Path) -> None:
    """`mt pretrain --eval-task` at TP 2 x PP 2 with sequence parallelism (odd request
    lengths padded to a multiple of tp; the head on every position) writes, after its last
    step, the metrics `mt eval` computes on the checkpoint it saved (one process)."""
    tasks = ("mt-choice", "mt-cloze", "mt-perplexity")
    config = load_config(None, {
        "model": "tiny", "nproc": 4, "tp": 2, "pp": 2, "sequence_parallel": True,
        "micro_batch_size": 2,
        "global_batch_size": 4, "train_steps": 4, "eval_interval": 0, "sample_tokens": 0,
        "progress": False, "log_interval": 100, "timeout": 300.0,
        "eval_task": ",".join(tasks), "eval_task_interval": 2, "eval_task_limit": 6,
        "out_dir": str(tmp_path / "run"), "cache_dir": str(tmp_path / "cache")})
    summary = single_threaded(launch, config, {}, 600)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    scored = {line["step"]: {k[5:]: v for k, v in line.items() if k.startswith("eval/")}
              for line in lines}
    assert [step for step, m in scored.items() if m] == [2, 4]
    spec = EvalSpec(Placement(summary.checkpoint), tasks, limit=6, progress=False)
    for result in single_threaded(evaluate, spec, {}, 600):
        for metric, value in result.metrics.items():
            assert scored[4][f"{result.name}/{metric}"] == pytest.approx(value, rel=1e-6), (
                result.name, metric)


def test_both_engines_score_alike(setup: dict[str, Path], one_process: dict) -> None:
    """The same task files through mt's own engine and through lm-evaluation-harness (mt as
    its model): the same prompts, so the same per-item log-likelihoods and metrics."""
    names = list(TASKS)
    ours = one_process
    spec = EvalSpec(Placement(str(setup["ckpt"])),
                    tuple(str(setup["tasks"] / f"{n}.yaml") for n in names), shots=2,
                    batch_size=8, progress=False, engine="harness", log_samples=True)
    harness = single_threaded(evaluate, spec, {}, 600)
    for name in names:
        task = f"t_{name}"
        mine = {s["doc_id"]: s for s in ours[task].samples}
        for sample in harness["samples"][task]:
            lls = [r[0] if name == "ppl" else r[0][0] for r in sample["resps"]]
            got = mine[sample["doc_id"]]["loglikelihoods"]
            assert got == pytest.approx(lls, abs=TOL, rel=0), (task, sample["doc_id"])
        for metric, value in ours[task].metrics.items():
            theirs = harness["results"][task][f"{metric},none"]
            if metric in ("acc", "acc_norm"):
                assert value == theirs, (task, metric)
            else:
                assert value == pytest.approx(theirs, rel=1e-6), (task, metric)
