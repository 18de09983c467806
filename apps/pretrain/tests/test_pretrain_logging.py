"""What a run prints (--log-level) and where its metrics go besides metrics.jsonl: Weights &
Biases in its offline mode, read back here by an independent reader of W&B's run files."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from wandb.proto import wandb_internal_pb2

from mt_pretrain.run.metrics import read_metrics

_RUN = ["--train-steps", "2", "--seq-len", "32", "--global-batch-size", "4",
        "--eval-interval", "2", "--sample-tokens", "0", "--no-progress"]


def _pretrain(tmp_path: Path, *flags: str, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mt_pretrain", "pretrain", *_RUN, *flags,
         "--out-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def test_log_level_error_prints_nothing_and_debug_places_every_rank(tmp_path: Path) -> None:
    """error: a good run prints nothing at all (the metrics file still gets every step);
    debug: a line per rank saying where it sits, and a log line every step."""
    quiet = _pretrain(tmp_path, "--log-level", "error", "--log-interval", "5")
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr
    assert quiet.stdout == "" and quiet.stderr == "", quiet.stdout + quiet.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]

    loud = _pretrain(tmp_path, "--log-level", "debug", "--log-interval", "5", "--nproc", "2",
                     "--dp", "2", "--micro-batch-size", "2", "--overwrite")
    assert loud.returncode == 0, loud.stdout + loud.stderr
    assert "rank 0: tp 0 pp 0 dp 0, cpu, pid " in loud.stdout, loud.stdout
    assert "rank 1: tp 0 pp 0 dp 1, cpu, pid " in loud.stdout, loud.stdout
    steps = [line for line in loud.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps[:2]] == ["1/2", "2/2"], loud.stdout


def test_log_level_is_checked() -> None:
    result = subprocess.run([sys.executable, "-m", "mt_pretrain", "pretrain", "--log-level",
                             "verbose", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--log-level must be one of debug, info, warning, error, got 'verbose'" in \
        " ".join(result.stderr.split()), result.stderr


def _wandb_records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    """The records of a .wandb file: a 7-byte file header, then LevelDB-log records
    (crc32, length, type) in 32 KiB blocks, their payloads wandb's protobuf Record."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, payload = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        body = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        payload = body if kind in (1, 2) else payload + body  # FULL/FIRST start a record
        if kind in (1, 4):  # FULL or LAST end one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            yield record


def _wandb_history(run_dir: Path) -> tuple[set[str], dict[int, dict[str, float]]]:
    """(run ids, {step: {key: value}}) of every offline W&B run in ``run_dir``."""
    ids, history = set(), {}
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                         for i in record.history.item}
                history[int(items["_step"])] = items
    return ids, history


def test_wandb_offline_gets_every_step_and_a_resume_continues_the_run(tmp_path: Path) -> None:
    """--wandb-project in W&B's offline mode: each step's loss, lr and grad norm as in
    metrics.jsonl, the config recorded, and the resumed job logging to the same W&B run."""
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    first = _pretrain(tmp_path, "--wandb-project", "mt-test", env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "W&B run " in first.stdout and "(offline, upload with `wandb sync`)" in first.stdout
    resumed = _pretrain(tmp_path, "--wandb-project", "mt-test", "--train-steps", "4", "--load",
                        str(tmp_path / "run" / "checkpoints"), env=env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    ids, history = _wandb_history(tmp_path / "run")
    assert len(ids) == 1, ids  # one W&B run across both jobs
    assert ids == {(tmp_path / "run" / "wandb" / "mt-run-id").read_text().strip()}
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert sorted(history) == [r["step"] for r in metrics] == [1, 2, 3, 4]
    for record in metrics:
        logged = history[record["step"]]
        for key in ("loss", "lr", "grad_norm", "tokens"):
            assert logged[f"train/{key}"] == record[key], (record["step"], key)


def test_wandb_without_a_login_is_one_line(tmp_path: Path) -> None:
    """Online mode with no API key: W&B's own message in one line, exit 2, no traceback."""
    env = {"WANDB_MODE": "online", "WANDB_API_KEY": "", "HOME": str(tmp_path),
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")}
    result = _pretrain(tmp_path, "--wandb-project", "mt-test", env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "--wandb-project mt-test: W&B did not start:" in " ".join(result.stderr.split())
