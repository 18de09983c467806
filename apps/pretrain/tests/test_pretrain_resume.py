"""Checkpoints: exact resume (12 steps == 6 + resume + 6, bit for bit) and resume at another
(TP, PP, DP) layout, where the sharded checkpoint is resharded on load and the loss curve
continues within fp32 round-off."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
from conftest import run_pretrain

from mt_formats import load_state_dict
from mt_pretrain.run.metrics import read_metrics

STEPS, HALF = 12, 6
COMMON: dict[str, Any] = {
    "model": "tiny", "seq_len": 32, "dropout": 0.0, "micro_batch_size": 2,
    "global_batch_size": 8, "train_steps": STEPS, "eval_interval": 0, "sample_tokens": 0,
    "progress": False, "log_interval": 100, "timeout": 120.0,
}


_run = partial(run_pretrain, COMMON)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """12 steps at TP 1 x PP 2 x DP 2 (ZeRO-1), checkpoints after steps 6 and 12."""
    cache = tmp_path_factory.mktemp("mt-cache")
    out = tmp_path_factory.mktemp("full")
    summary = _run(out, cache, nproc=4, tp=1, pp=2, dp=2, zero_stage=1, save_interval=HALF,
                   keep_last=5)
    return out, cache, summary


def test_pretrain_exact_resume(full_run: tuple[Path, Path, Any], tmp_path: Path) -> None:
    out, cache, full = full_run
    assert len(full.losses) == STEPS
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == [
        "step-00000006", "step-00000012"]
    resumed = _run(tmp_path, cache, nproc=4, tp=1, pp=2, dp=2, zero_stage=1, save="none",
                   load=str(out / "checkpoints" / "step-00000006"))
    assert resumed.start_step == HALF and resumed.final_step == STEPS
    assert resumed.losses == full.losses[HALF:]  # identical, not just close
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert steps == list(range(HALF + 1, STEPS + 1))


@pytest.mark.parametrize("layout", [
    {"nproc": 2, "tp": 2, "pp": 1, "zero_stage": 1},   # TP 1 -> 2, PP 2 -> 1, DP 2 -> 1
    {"nproc": 1, "tp": 1, "pp": 1, "zero_stage": 0},   # one process, plain optimizer
])
def test_pretrain_resume_at_another_layout(full_run: tuple[Path, Path, Any], tmp_path: Path,
                                           layout: dict[str, Any]) -> None:
    out, cache, full = full_run
    resumed = _run(tmp_path, cache, save="none", load=str(out / "checkpoints" / "step-00000006"),
                   **layout)
    assert resumed.start_step == HALF
    assert resumed.losses == pytest.approx(full.losses[HALF:], rel=1e-4)


def test_a_checkpoint_continues_only_on_data_of_its_tokenizer(
        full_run: tuple[Path, Path, Any], tmp_path: Path) -> None:
    """--load of a run trained with tokenizer-1k on data prepared with another tokenizer
    (whose ids fit the model's vocabulary, so nothing else stops it) is refused before any
    step: the checkpoint and the dataset each record their tokenizer's fingerprint."""
    from mt_data import PrepareConfig, load_tokenizer, prepare, train_tokenizer
    from mt_data.corpus import CORPORA, corpus_path, corpus_texts
    from mt_pretrain.config.schema import ConfigError

    out, cache, _ = full_run
    tok = tmp_path / "tok.json"
    train_tokenizer(corpus_texts()[:60], 500).save(tok)
    data = tmp_path / "data"
    prepare([corpus_path(name) for name in CORPORA], data,
            PrepareConfig(tokenizer=str(tok), workers=1))
    step = out / "checkpoints" / "step-00000006"
    with pytest.raises(ConfigError) as err:
        _run(tmp_path / "run", cache, nproc=1, save="none", load=str(step), data=str(data))
    assert str(err.value) == (
        f"--load {step}: its run trained with tokenizer tokenizer-1k (sha256 "
        f"{load_tokenizer('tokenizer-1k').fingerprint[:12]}...), this run's data is of "
        f"tokenizer {tok} ({load_tokenizer(tok).fingerprint[:12]}...): the same ids would "
        "mean other text; train on data prepared with tokenizer-1k")


def test_pretrain_checkpoint_consolidates(full_run: tuple[Path, Path, Any]) -> None:
    out, _, _ = full_run
    model, weights = load_state_dict(out / "checkpoints")  # follows `latest`
    assert model.vocab_size == 1000 and model.seq_len == 32
    assert weights["embed.tokens.weight"].shape == (1000, 64)
    assert len([n for n in weights if n.startswith("blocks.3.")]) == 12


def test_pretrain_exact_resume_with_dropout(tmp_path: Path, full_run: tuple[Path, Path, Any]
                                            ) -> None:
    """RNG states (default generator and the TP stream of the attention dropout) resume."""
    _, cache, _ = full_run
    layout = {"nproc": 2, "tp": 2, "pp": 1, "dropout": 0.1, "train_steps": 6}
    full = _run(tmp_path / "full", cache, save_interval=3, **layout)
    resumed = _run(tmp_path / "resumed", cache, save="none",
                   load=str(tmp_path / "full" / "checkpoints" / "step-00000003"), **layout)
    assert resumed.losses == full.losses[3:]


# Extending and chaining runs: dropout on, 2 ranks, an LR schedule that does not depend on the
# run's length (explicit warmup and decay), so one 10-step run is the reference.
CHAIN: dict[str, Any] = {"nproc": 2, "tp": 1, "pp": 1, "dp": 2, "zero_stage": 1,
                         "dropout": 0.1, "warmup_tokens": 2 * 8 * 32,
                         "decay_tokens": 10 * 8 * 32}


@pytest.fixture(scope="module")
def ten_steps(tmp_path_factory: pytest.TempPathFactory, full_run: tuple[Path, Path, Any]
              ) -> Any:
    _, cache, _ = full_run
    return _run(tmp_path_factory.mktemp("ten"), cache, train_steps=10, save="none", **CHAIN)


def test_extending_a_finished_run_is_exact(ten_steps: Any, full_run: tuple[Path, Path, Any],
                                           tmp_path: Path) -> None:
    """5 steps, then --load with --train-steps 10: bit for bit the 10-step run (the sample
    order does not depend on the run's length, dropout masks on the layout or the past)."""
    _, cache, _ = full_run
    five = _run(tmp_path / "five", cache, train_steps=5, **CHAIN)
    assert five.losses == ten_steps.losses[:5]
    more = _run(tmp_path / "more", cache, train_steps=10, save="none",
                load=str(tmp_path / "five" / "checkpoints"), **CHAIN)
    assert more.start_step == 5 and more.losses == ten_steps.losses[5:]


def test_exit_interval_chains_jobs_exactly(ten_steps: Any, full_run: tuple[Path, Path, Any],
                                           tmp_path: Path) -> None:
    """The same command three times, --exit-interval 4, --load after the first: steps 1-4,
    5-8, 9-10 with a checkpoint at each exit; together bit for bit the 10-step run."""
    _, cache, _ = full_run
    job = {"train_steps": 10, "exit_interval": 4, **CHAIN}
    first = _run(tmp_path, cache, **job)
    assert (first.stopped, first.final_step) == ("exit-interval", 4)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    second = _run(tmp_path, cache, load=str(tmp_path / "checkpoints"), **job)
    assert (second.start_step, second.stopped, second.final_step) == (4, "exit-interval", 8)
    third = _run(tmp_path, cache, load=str(tmp_path / "checkpoints"), **job)
    assert (third.start_step, third.stopped, third.final_step) == (8, None, 10)
    assert first.losses + second.losses + third.losses == ten_steps.losses
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert steps == list(range(1, 11))  # one metrics line per step across the jobs


def test_exit_duration_saves_before_the_time_is_up(full_run: tuple[Path, Path, Any],
                                                   tmp_path: Path) -> None:
    """With less time than one more step needs, the run saves and exits after step 1."""
    _, cache, _ = full_run
    run = _run(tmp_path, cache, train_steps=10, exit_duration=1e-4, **CHAIN)
    assert (run.stopped, run.final_step) == ("exit-duration", 1)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000001"


def test_a_checkpoint_of_the_old_sample_order_resumes_with_a_warning(
        full_run: tuple[Path, Path, Any], tmp_path: Path) -> None:
    """Written before the sample order stopped depending on the run's length (no
    "data_order" in meta.json): it resumes at the same consumed-sample count, and says that
    the samples it sees next differ from the old run's."""
    import json
    import shutil

    out, cache, _ = full_run
    folder = tmp_path / "old" / "step-00000006"
    shutil.copytree(out / "checkpoints" / "step-00000006", folder)
    meta = json.loads((folder / "meta.json").read_text())
    assert meta.pop("data_order") == 2
    del meta["crc32c"], meta["files"]  # nor did such files carry checksums
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="written before mt's sample order stopped depending "
                      "on the run's length: training continues after sample 48 of the new "
                      "order"):
        resumed = _run(tmp_path / "run", cache, nproc=1, tp=1, pp=1, zero_stage=0,
                       save="none", load=str(folder))
    assert resumed.start_step == HALF


def test_a_resume_at_another_global_batch_size_counts_on_from_its_checkpoint(
        cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """4 steps at global batch 8, then --load at --global-batch-size 16 for 2 more: bit for
    bit the run whose ramp-up gives those batch sizes (8 until 32 samples, then 16) in one go.
    The data goes on after the 32 samples the checkpoint consumed, and the LR (a function of
    the tokens consumed) and the dataset's size count from there; the start line says so."""
    one = {"nproc": 1, "tp": 1, "pp": 1, "warmup_tokens": 8 * 32, "decay_tokens": 64 * 32}
    whole = _run(tmp_path / "ramp", cache, **one, train_steps=6, global_batch_size=16,
                 rampup_start=8, rampup_increment=8, rampup_tokens=32 * 32, save="none")
    first = _run(tmp_path / "first", cache, **one, train_steps=4, global_batch_size=8)
    capsys.readouterr()
    ck = tmp_path / "first" / "checkpoints"
    then = _run(tmp_path / "then", cache, **one, train_steps=6, global_batch_size=16,
                load=str(ck), save="none")
    assert (then.start_step, then.final_step) == (4, 6)
    assert (first.tokens, then.tokens) == (4 * 8 * 32, 2 * 16 * 32)  # each run's own tokens
    assert first.losses + then.losses == whole.losses  # identical, not just close
    sizes = [r["global_batch_size"] for r in read_metrics(tmp_path / "ramp" / "metrics.jsonl")]
    assert sizes == [8, 8, 8, 8, 16, 16]
    assert [r["global_batch_size"] for r in read_metrics(tmp_path / "then" / "metrics.jsonl")
            ] == sizes[4:]
    assert f"resumed from {ck} at step 4 (its run consumed 32 samples in 4 steps at global " \
           "batch size 8; the run goes on from there at global batch size 16)" \
        in capsys.readouterr().out
