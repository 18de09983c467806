"""Fault injection: kills at every phase of a checkpoint save (the rollback case included), a
hung peer, damaged checkpoint files, a run folder that holds a previous run, two interrupts.
Each test asserts the exact outcome: resumable from the last complete step (and then the
same losses as a run that was never interrupted), or one clear error line and its exit
status, with nothing left half-written where a later run would read it.

Kills use the failpoints of mt_dist.failpoints (MT_FAILPOINT=<point>@<rank>): the rank
SIGKILLs itself there, exactly like a crash; the --nproc parent reports it and stops.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from conftest import run_pretrain

from mt_checkpoint import CheckpointError
from mt_dist.exits import LaunchFailed
from mt_dist.failpoints import POINTS
from mt_pretrain.config.schema import ConfigError
from mt_pretrain.run.folder import LOCK_FILE, run_folder_lock
from mt_pretrain.run.metrics import read_metrics

COMMON: dict[str, Any] = {
    "model": "tiny", "seq_len": 32, "dropout": 0.1, "micro_batch_size": 2,
    "global_batch_size": 8, "eval_interval": 0, "sample_tokens": 0, "progress": False,
    "log_interval": 100, "timeout": 60.0, "nproc": 2, "tp": 1, "pp": 2, "zero_stage": 1,
    "warmup_tokens": 2 * 8 * 32, "decay_tokens": 6 * 8 * 32, "save_interval": 2,
}
_run = partial(run_pretrain, COMMON)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Any:
    """Six steps in one go: what every interrupted-and-resumed run must reproduce."""
    return _run(tmp_path_factory.mktemp("whole"), cache, train_steps=6)


def _resume_to_six(out: Path, cache: Path) -> Any:
    return _run(out, cache, train_steps=6, load=str(out / "checkpoints"))


def _trained(steps: int, root: Path, cache: Path) -> Path:
    """A run folder of ``steps`` steps, saved every 2 (the runs are deterministic: a copy of
    it is what training the same command again in a new folder would leave)."""
    _run(root, cache, train_steps=steps)
    return root


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Path:
    """A run folder of 2 steps (step 2 saved), trained once for the tests that start there."""
    return _trained(2, tmp_path_factory.mktemp("two"), cache)


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Path:
    """A run folder of 4 steps (steps 2 and 4 saved), trained once."""
    return _trained(4, tmp_path_factory.mktemp("four"), cache)


def _copy_run(run: Path, to: Path) -> None:
    shutil.copytree(run, to, dirs_exist_ok=True)


@pytest.fixture(scope="module")
def prepared(cache: Path, two_steps: Path) -> Path:
    """The data ``cache`` with the embedded corpus prepared (by the first run)."""
    return cache


@pytest.mark.parametrize("point", [p for p in POINTS if p != "checkpoint.replace"])
def test_kill_during_a_save_leaves_a_resumable_run(point: str, uninterrupted: Any, cache: Path,
                                                   two_steps: Path, tmp_path: Path,
                                                   monkeypatch: Any) -> None:
    """Steps 1-2 saved; the save of step 4 is killed at ``point`` (``checkpoint.replace`` is
    only passed when a step is saved again: next test); the same command with --load then
    resumes from the step `latest` names and ends exactly like a whole run."""
    _copy_run(two_steps, tmp_path)
    monkeypatch.setenv("MT_FAILPOINT", f"{point}@0")
    with pytest.raises(LaunchFailed, match="died with exit code -9"):
        _run(tmp_path, cache, train_steps=4, load=str(tmp_path / "checkpoints"))
    monkeypatch.delenv("MT_FAILPOINT")
    # Until `latest` names step 4 (pointer), it names step 2, which is complete.
    expected = 4 if point in ("checkpoint.pointer", "checkpoint.prune") else 2
    resumed = _resume_to_six(tmp_path, cache)
    assert resumed.start_step == expected
    assert resumed.losses == uninterrupted.losses[expected:]
    root = tmp_path / "checkpoints"
    assert not list(root.glob(".step-*"))  # the killed save's leftovers are gone
    assert (root / "latest").read_text().strip() == "step-00000006"


@pytest.mark.parametrize("point, expected", [
    ("checkpoint.meta", 4),      # the old step 4 is untouched, `latest` names it
    ("checkpoint.replace", 2),   # old step 4 moved aside, new one not in place: fall back
    ("checkpoint.rename", 4),    # the new step 4 is in place under the name `latest` holds
])
def test_kill_while_saving_a_step_again_after_a_rollback(point: str, expected: int,
                                                         uninterrupted: Any, cache: Path,
                                                         four_steps: Path, tmp_path: Path,
                                                         monkeypatch: Any) -> None:
    """Steps 1-4 saved (2 and 4); --load step 2 and train to 4 again, killed while saving
    step 4 over the old one: nothing that `latest` names is ever deleted first."""
    _copy_run(four_steps, tmp_path)
    monkeypatch.setenv("MT_FAILPOINT", f"{point}@0")
    with pytest.raises(LaunchFailed, match="died with exit code -9"):
        _run(tmp_path, cache, train_steps=4,
             load=str(tmp_path / "checkpoints" / "step-00000002"))
    monkeypatch.delenv("MT_FAILPOINT")
    if point == "checkpoint.replace":
        with pytest.warns(UserWarning, match="names step-00000004, which is missing: loading "
                          "step-00000002, the newest complete checkpoint"):
            resumed = _resume_to_six(tmp_path, cache)
    else:
        resumed = _resume_to_six(tmp_path, cache)
    assert resumed.start_step == expected
    assert resumed.losses == uninterrupted.losses[expected:]


def _flip(path: Path, count: int) -> None:
    """Invert ``count`` bytes in the second half of ``path`` (tensor data: the file still
    unpickles, with other numbers)."""
    data = bytearray(path.read_bytes())
    at = len(data) * 3 // 4
    data[at:at + count] = bytes(b ^ 0xFF for b in data[at:at + count])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, words", [
    (lambda f: f.write_bytes(b""), "rank-00001.pt: empty; load an earlier step folder"),
    (lambda f: f.write_bytes(f.read_bytes()[:1000]), "rank-00001.pt: damaged or truncated"),
    (lambda f: _flip(f, 64), "rank-00001.pt: damaged (its checksum is crc32c:"),
])
def test_a_damaged_rank_file_is_one_clear_error(damage: Any, words: str, cache: Path,
                                                two_steps: Path, tmp_path: Path) -> None:
    _copy_run(two_steps, tmp_path)
    damage(tmp_path / "checkpoints" / "step-00000002" / "rank-00001.pt")
    with pytest.raises(CheckpointError) as err:
        _run(tmp_path / "again", cache, train_steps=4, save="none",
             load=str(tmp_path / "checkpoints" / "step-00000002"))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_damaged_meta_falls_back_or_is_one_clear_error(cache: Path, four_steps: Path,
                                                         tmp_path: Path) -> None:
    _copy_run(four_steps, tmp_path)
    root = tmp_path / "checkpoints"
    (root / "step-00000004" / "meta.json").write_text('{"format": "mt-pretrain/1", "st')
    with pytest.raises(CheckpointError, match=r"step-00000004/meta.json: damaged \("):
        _run(tmp_path / "a", cache, train_steps=6, save="none",
             load=str(root / "step-00000004"))
    with pytest.warns(UserWarning, match="loading step-00000002"):  # `latest` is broken
        resumed = _run(tmp_path / "b", cache, train_steps=6, save="none", load=str(root))
    assert resumed.start_step == 2


def test_meta_json_fields_of_the_wrong_type_are_one_clear_error(cache: Path, two_steps: Path,
                                                               tmp_path: Path) -> None:
    """A hand-edited meta.json (its checksum removed, as an old file has none) with a field
    of the wrong type: one line naming the file."""
    import json

    _copy_run(two_steps, tmp_path / "a")
    for name, edit, words in [
            ("model", lambda m: m["model"].update(n_layers="x"),
             "meta.json: damaged model (invalid GPTConfig: n_layers must be a positive int"),
            ("styles", lambda m: m.update(styles=5), "meta.json: damaged (AttributeError"),
            ("style", lambda m: m["styles"].update({"blocks.0.attn.qkv.weight": "bogus"}),
             "meta.json: damaged (styles['blocks.0.attn.qkv.weight'] is 'bogus', not one of "
             "replicate, column"),
            ("tokenizer", lambda m: m.update(tokenizer=5),
             "meta.json: damaged (tokenizer 5 is not a name or a path)"),
            ("consumed", lambda m: m["data"].update(consumed_samples="16"),
             'meta.json: damaged (data.consumed_samples is "16", expected a whole number >= 0)'),
            ("bool", lambda m: m["data"].update(consumed_samples=True),
             "meta.json: damaged (data.consumed_samples is true, expected a whole number >= 0)"),
            ("negative", lambda m: m.update(step=-2),
             "meta.json: damaged (step is -2, expected a whole number >= 0)"),
            ("data", lambda m: m.update(data="x"),
             'meta.json: damaged (data is \'x\', expected {"consumed_samples": N, "step": N})'),
            ("null", lambda m: m.update(crc32c=None),
             "meta.json: damaged (its content does not match its checksum None)")]:
        folder = tmp_path / name / "step-00000002"
        shutil.copytree(tmp_path / "a" / "checkpoints" / "step-00000002", folder)
        meta = json.loads((folder / "meta.json").read_text())
        del meta["crc32c"]
        edit(meta)  # (a crc32c of null is no file's: refused as damaged)
        (folder / "meta.json").write_text(json.dumps(meta))
        with pytest.raises(CheckpointError) as err:
            _run(tmp_path / name / "run", cache, train_steps=4, save="none", load=str(folder))
        assert words in str(err.value) and "\n" not in str(err.value), (name, str(err.value))


def test_a_run_folder_is_never_overwritten_silently(cache: Path, tmp_path: Path) -> None:
    first = _run(tmp_path, cache, train_steps=2)
    with pytest.raises(ConfigError, match=r"holds a previous run \(checkpoints in .*; metrics "
                       r"in .*\): continue it with --load .*checkpoints, start over with "
                       r"--overwrite"):
        _run(tmp_path, cache, train_steps=2)
    assert (tmp_path / "checkpoints" / "step-00000002").is_dir()  # nothing was touched
    again = _run(tmp_path, cache, train_steps=2, overwrite=True)
    assert again.losses == first.losses and again.start_step == 0
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_a_run_folder_in_use_is_refused_and_a_killed_holder_blocks_nothing(
        cache: Path, tmp_path: Path) -> None:
    """The same job twice on one folder (a requeue while the first still runs): the second
    is refused in one line naming the holder, and touches nothing. A holder killed with -9
    leaves its lock file behind, which blocks nobody (the kernel drops the lock)."""
    checkpoints = tmp_path / "checkpoints"
    with run_folder_lock(checkpoints):
        with pytest.raises(ConfigError, match=rf"{checkpoints} is in use by another run \(pid "
                           rf"{os.getpid()} on .*\): wait for it to end, or choose another "
                           r"--out-dir or --save"):
            _run(tmp_path, cache, train_steps=2, load=str(checkpoints))
    assert sorted(p.name for p in tmp_path.rglob("*")) == [LOCK_FILE, "checkpoints"]
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from mt_pretrain.run.folder import run_folder_lock\n"
        "with run_folder_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(600)"),
        str(checkpoints)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    with pytest.raises(ConfigError, match=rf"pid {holder.pid} on "):
        _run(tmp_path, cache, train_steps=2)
    (checkpoints / "step-00000001").mkdir()  # as if the running job had saved
    with pytest.raises(ConfigError, match=rf"pid {holder.pid} on "):  # --overwrite too
        _run(tmp_path, cache, train_steps=2, overwrite=True)
    assert (checkpoints / "step-00000001").is_dir()  # the running job's, untouched
    (checkpoints / "step-00000001").rmdir()
    holder.kill()
    holder.wait()
    assert _run(tmp_path, cache, train_steps=2).final_step == 2


def test_load_of_the_runs_own_empty_folder_starts_fresh(uninterrupted: Any, cache: Path,
                                                        tmp_path: Path) -> None:
    """The first job of a chain may already pass --load: its own folder has nothing yet."""
    run = _resume_to_six(tmp_path, cache)
    assert run.start_step == 0 and run.losses == uninterrupted.losses
    with pytest.raises(CheckpointError, match="no checkpoint at .*elsewhere: no such folder"):
        _run(tmp_path / "other", cache, train_steps=2, load=str(tmp_path / "elsewhere"))


# ------------------------------------------------------------------ the command, as a user


def _mt(*args: str) -> list[str]:
    return [sys.executable, "-m", "mt_pretrain", "pretrain", "--seq-len", "32",
            "--global-batch-size", "8", "--micro-batch-size", "2", "--no-progress",
            "--nproc", "2", "--tp", "1", "--pp", "2", "--eval-interval", "0", *args]


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.is_file() else []


def _start(args: list[str], out: Path, session: bool = False) -> subprocess.Popen:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=session)
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 180
    while not (metrics.is_file() and len(read_metrics(metrics)) >= 2):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.1)
    return proc


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_a_hung_peer_ends_the_run_within_the_timeout(cache: Path, tmp_path: Path) -> None:
    """SIGSTOP of rank 1: rank 0's collective times out after --timeout 10 s, the parent names
    rank 1 as hung and kills it; no process is left behind."""
    out = tmp_path / "run"
    proc = _start(_mt("--train-steps", "100000", "--timeout", "10", "--save", "none",
                      "--out-dir", str(out), "--cache-dir", str(cache)), out)
    try:
        ranks = _children(proc.pid)
        assert len(ranks) == 2, ranks
        stopped_at = time.monotonic()
        os.kill(ranks[1], signal.SIGSTOP)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    elapsed = time.monotonic() - stopped_at
    assert proc.returncode == 1, stdout + stderr
    assert 10 <= elapsed < 10 + 20, elapsed
    assert "rank 1 of 2 hung: it gave no report while ranks [0] failed waiting for it" in stderr
    time.sleep(0.5)
    assert not any(Path(f"/proc/{pid}").exists() for pid in ranks), "a rank was left behind"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_a_second_interrupt_stops_at_once(cache: Path, tmp_path: Path) -> None:
    """Steps of about a second (hidden 512, 1024 tokens): the first Ctrl-C asks for a save
    after the step, the second, 0.2 s later, stops the ranks at once."""
    out = tmp_path / "run"
    proc = _start(_mt("--train-steps", "100000", "--hidden", "512", "--global-batch-size",
                      "32", "--out-dir", str(out), "--cache-dir", str(cache)), out)
    try:
        ranks = _children(proc.pid)
        os.kill(proc.pid, signal.SIGINT)
        # The parent says when it has acted on the first one (two pending signals of one
        # kind would be delivered as one); the step (about a second) is not over by then.
        assert proc.stderr is not None
        first = proc.stderr.readline()
        assert first.startswith("interrupted: the ranks stop after their current step"), first
        os.kill(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stdout + stderr
    assert "interrupted twice: the ranks were stopped at once" in stderr
    time.sleep(0.5)
    assert not any(Path(f"/proc/{pid}").exists() for pid in ranks)


def test_a_second_interrupt_stops_one_process_inside_a_long_native_operation(
        cache: Path, tmp_path: Path) -> None:
    """One process, stalled in one native operation of about 25 s (the train.stall
    failpoint: as the attention of a very long sequence), during which Python runs no signal
    handler: the second SIGTERM still stops it within seconds, exit 130."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mt_pretrain", "pretrain", "--seq-len", "32", "--train-steps",
         "3", "--global-batch-size", "8", "--no-progress", "--out-dir", str(out),
         "--cache-dir", str(cache), "--eval-interval", "0", "--sample-tokens", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "MT_FAILPOINT": "train.stall"})
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        while line and not line.startswith("failpoint: stalling"):
            line = proc.stderr.readline()
        assert line, proc.communicate()
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(1.5)  # past the 1 s echo window: a second interrupt
        os.kill(proc.pid, signal.SIGTERM)
        second = time.monotonic()
        _, stderr = proc.communicate(timeout=20)
        stopped_after = time.monotonic() - second
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "interrupted twice (signal 15) inside a long operation: stopped at once" in stderr
    assert stopped_after < 10, stopped_after  # the operation alone takes about 25 s


def test_ctrl_c_in_a_terminal_saves_once_and_exits_0(cache: Path, tmp_path: Path) -> None:
    """Ctrl-C in a terminal signals the whole foreground process group: the --nproc parent
    and (were they in it) every rank. One key press is one interrupt: the ranks save after
    their step and the run exits 0."""
    out = tmp_path / "run"
    proc = _start(_mt("--train-steps", "100000", "--out-dir", str(out), "--cache-dir",
                      str(cache)), out, session=True)
    try:
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout + stderr
    step = int(stdout.split("stopped by signal after step ", 1)[1].split()[0])
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == f"step-{step:08d}"
    assert len(list((root / f"step-{step:08d}").glob("rank-*.pt"))) == 2


def _file_size_limit(limit: int) -> Callable[[], None]:
    """For ``preexec_fn``: writes past ``limit`` bytes fail (EFBIG) as on a full disk."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_full_disk_during_a_save_is_one_line_and_exit_1(prepared: Path,
                                                          tmp_path: Path) -> None:
    """The rank files of a save do not fit: one line naming the file, exit 1 (the run
    failed; the input was fine); `latest` names no half-written step."""
    cache = prepared  # the data cache, prepared: only the save can fill the disk
    out = tmp_path / "run"
    done = subprocess.run(_mt("--train-steps", "2", "--out-dir", str(out), "--cache-dir",
                              str(cache)), capture_output=True, text=True,
                          preexec_fn=_file_size_limit(200_000))
    assert done.returncode == 1, done.stdout + done.stderr
    error = done.stderr.replace("\n", "")
    assert error.startswith("error: [Errno 27] File too large: ") and "rank-0000" in error
    assert "Traceback" not in done.stderr
    assert not (out / "checkpoints" / "latest").exists()


@pytest.mark.parametrize("layout", [{"nproc": 1, "tp": 1, "pp": 1},
                                    {"nproc": 2, "tp": 2, "pp": 1}])
def test_a_damaged_dataset_shard_is_refused_at_every_layout(prepared: Path, tmp_path: Path,
                                                           layout: dict[str, int]) -> None:
    """Bytes flipped inside a shard's token ids (its index.json untouched): refused before
    training, naming the shard, at TP 1 and TP 2 alike."""
    cache = prepared
    data = tmp_path / "data"
    shutil.copytree(next((cache / "data").glob("embedded-*")), data,
                    ignore=shutil.ignore_patterns("cache"))
    shard = sorted(data.glob("*.arrow"))[0]
    _flip(shard, 64)
    with pytest.raises(ConfigError, match=rf"{shard}: damaged \(its SHA-256 differs from the "
                       r"one index.json records\); prepare the dataset again"):
        _run(tmp_path / "run", cache, train_steps=1, save="none", data=str(data),
             **{**layout, "dp": 1})


def test_a_dataset_shorter_than_one_sample_is_one_line(cache: Path, tmp_path: Path) -> None:
    """Two short documents, --seq-len 128: one line saying what to change."""
    import json

    from mt_data.filters import FilterConfig
    from mt_data.pipeline import PrepareConfig, prepare
    from mt_data.stages import CleanConfig

    raw = tmp_path / "small.jsonl"
    raw.write_text("".join(json.dumps({"text": " ".join(f"word{i}{j}" for j in range(12))})
                           + "\n" for i in range(2)))
    clean = CleanConfig(filters=FilterConfig(min_chars=1, min_words=1))
    prepare([raw], tmp_path / "data", PrepareConfig(clean, "tokenizer-1k", workers=1))
    with pytest.raises(ConfigError, match=r"train split of .*data has 2 documents and \d+ "
                       r"tokens: no sample of 129 tokens .*: use a shorter --seq-len or more "
                       r"data"):
        _run(tmp_path / "run", cache, train_steps=1, save="none", data=str(tmp_path / "data"),
             seq_len=128, nproc=1, pp=1)


def test_token_ids_outside_the_model_vocabulary_are_refused(prepared: Path,
                                                           tmp_path: Path) -> None:
    """A dataset whose ids reach past the model's vocabulary (here: imported without the
    tokenizer's size, so only the recorded largest id can tell) is refused before training,
    instead of training on zeroed rows (TP) or failing with an IndexError."""
    import json

    cache = prepared
    data = tmp_path / "data"
    shutil.copytree(next((cache / "data").glob("embedded-*")), data,
                    ignore=shutil.ignore_patterns("cache"))
    index = json.loads((data / "index.json").read_text())
    index["tokenizer"].pop("vocab_size")
    (data / "index.json").write_text(json.dumps(index))
    largest = index["max_token_id"]
    with pytest.raises(ConfigError, match=rf"dataset {data} holds token id {largest} "
                       rf"\(max_token_id in its index.json\) but the model vocabulary has "
                       rf"900 ids: use --vocab-size >= {largest + 1}"):
        _run(tmp_path / "run", cache, train_steps=1, save="none", data=str(data),
             vocab_size=900)
