"""``mt data prepare --executor ray`` on a real local Ray cluster started by the test (a head
and a worker node, one CPU each, as `ray start` makes them): every stage on (quality filters,
exact and fuzzy dedup, decontamination, group counts, tokenization), the dataset equal byte
for byte to the local executor's (the run's own timings in index.json aside); a Ray worker
killed in the middle of a task, the same dataset (Ray runs the task again); the driver killed
and run again, the same dataset; fuzzy dedup as band tasks equal to the in-memory clustering
on the same signatures; the refusals."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from mt_data.corpus import iter_corpus
from mt_data.decontam import DecontamConfig
from mt_data.dedup import fuzzy_dedup
from mt_data.dedup_tasks import _Chunks, fuzzy_dedup_tasks
from mt_data.ingest import IngestConfig
from mt_data.pipeline import PrepareConfig, prepare
from mt_data.stages import CleanConfig

ray = pytest.importorskip("ray")
RAY = [sys.executable, "-m", "ray.scripts.scripts"]
TIMINGS = ("seconds", "mb_per_s", "tokens_per_s")


def _near_copy(text: str, seed: int) -> str:
    rng = random.Random(seed)
    words = text.split(" ")
    for _ in range(max(1, len(words) // 150)):
        words[rng.randrange(len(words))] = "whale"
    return " ".join(words)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The shipped corpus as JSONL in 4 files, with exact and near copies planted across
    files (so that LSH pairs documents of different tasks), and an evaluation file."""
    root = tmp_path_factory.mktemp("raw")
    docs = [{"id": d["id"], "text": d["text"]} for d in iter_corpus()]
    docs += [{"id": f"near-{i}", "text": _near_copy(docs[i]["text"], i)} for i in range(0, 60, 4)]
    docs += [{"id": f"exact-{i}", "text": docs[i]["text"]} for i in range(1, 40, 7)]
    random.Random(0).shuffle(docs)
    files = []
    for k in range(4):
        path = root / f"part-{k}.jsonl"
        path.write_text("".join(json.dumps(d) + "\n" for d in docs[k::4]))
        files.append(path)
    evals = root / "eval.jsonl"
    evals.write_text(json.dumps({"text": docs[9]["text"][1000:1800]}) + "\n")
    return {"files": files, "eval": evals}


def _config(corpus: dict[str, Any], **kw: Any) -> PrepareConfig:
    clean = CleanConfig(ingest=IngestConfig(batch_docs=8), decontam=DecontamConfig(),
                        eval_paths=(str(corpus["eval"]),))
    return PrepareConfig(clean=clean, tokenizer="tokenizer-1k", **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A head and a worker node on this machine (one CPU each); stopped afterwards. Token
    authentication is off for the cluster and every driver of this module: where
    ``~/.ray/auth_token`` exists (a local ``ray.init()`` writes one, as ``mt data prepare
    --executor ray`` without ``--ray-address`` does), ``ray start --head`` turns it on by
    itself and the worker, whose mode is off, fails to join (InvalidAuthToken)."""
    port = _free_port()
    patch = pytest.MonkeyPatch()
    patch.setenv("RAY_AUTH_MODE", "disabled")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    temp = Path("/tmp") / f"ray-mt-{os.getpid()}"  # a short path: Ray's sockets live there
    started = []
    try:
        for args in (["--head", f"--port={port}", "--include-dashboard=false",
                      f"--temp-dir={temp}"], [f"--address=127.0.0.1:{port}"]):
            done = subprocess.run([*RAY, "start", "--num-cpus=1", "--disable-usage-stats",
                                   *args], env=env, capture_output=True, text=True, timeout=180)
            assert done.returncode == 0, done.stdout + done.stderr
            started.append(args)
        yield f"127.0.0.1:{port}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([*RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
        patch.undo()


def _files(folder: Path) -> dict[str, bytes]:
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.name.startswith(".lock"):
            data = path.read_bytes()
            if path.name == "index.json":  # the run's own timings aside
                index = json.loads(data)
                for key in TIMINGS:
                    index["stats"].pop(key)
                data = json.dumps(index, sort_keys=True).encode()
            out[str(path.relative_to(folder))] = data
    return out


def _same_dataset(a: Path, b: Path) -> None:
    mine, theirs = _files(a), _files(b)
    assert sorted(mine) == sorted(theirs)
    different = [name for name in mine if mine[name] != theirs[name]]
    assert not different, different


def test_ray_makes_the_local_dataset_byte_for_byte(corpus: dict[str, Any], cluster: str,
                                                   tmp_path: Path) -> None:
    local = prepare(corpus["files"], tmp_path / "local", _config(corpus, workers=2))
    assert local["exact_duplicates"] >= 5 and local["fuzzy_duplicates"] >= 10
    assert local["dropped"]["contaminated"] >= 1
    summary = prepare(corpus["files"], tmp_path / "ray",
                      _config(corpus, executor="ray", ray_address=cluster))
    assert {k: v for k, v in summary.items() if k not in TIMINGS} == \
        {k: v for k, v in local.items() if k not in TIMINGS}
    _same_dataset(tmp_path / "local", tmp_path / "ray")
    ray.init(address=cluster, log_to_driver=False)  # the cluster ran it: two nodes, 2 CPUs
    try:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        assert ray.cluster_resources()["CPU"] == 2
        # A program that joined the cluster itself keeps its session after a prepare.
        prepare(corpus["files"][:1], tmp_path / "mine", _config(corpus, executor="ray"))
        assert ray.is_initialized()
    finally:
        ray.shutdown()


def _ray_task_pids(name: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "cmdline").read_bytes().startswith(f"ray::{name}".encode()):
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def test_a_killed_worker_leaves_the_dataset_unchanged(corpus: dict[str, Any], cluster: str,
                                                      tmp_path: Path) -> None:
    prepare(corpus["files"], tmp_path / "local", _config(corpus, workers=2))
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["summary"] = prepare(corpus["files"], tmp_path / "ray", _config(
                corpus, executor="ray", ray_address=cluster))
        except BaseException as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    killed, deadline = [], time.monotonic() + 120
    while not killed and thread.is_alive() and time.monotonic() < deadline:
        for pid in _ray_task_pids("clean_item")[:1]:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        time.sleep(0.02)
    thread.join(timeout=600)
    assert killed, "no clean task was seen running"
    assert "error" not in result, result.get("error")
    _same_dataset(tmp_path / "local", tmp_path / "ray")


def test_band_tasks_cluster_as_in_memory(corpus: dict[str, Any], tmp_path: Path) -> None:
    """fuzzy dedup as 1, 3 and 16 band tasks (run here, one after the other) against
    :func:`fuzzy_dedup` on the concatenated signatures of the same chunk files; the chunk
    files are not left mapped by a task's reads."""
    config = _config(corpus, workers=1, keep_work=True)
    prepare(corpus["files"], tmp_path / "out", config)
    chunks = sorted(str(p) for p in (tmp_path / "out" / "work").glob("clean-*.arrow"))
    assert len(chunks) > 4
    num_perm, bands, threshold = 128, 16, 0.8
    sigs, has = [], []
    for path in chunks:
        batch = pa.ipc.open_file(pa.memory_map(path, "r")).get_batch(0)
        sigs.append(batch.column("minhash").values.to_numpy().reshape(-1, num_perm)
                    [: batch.num_rows])
        has.append(batch.column("has_shingles").to_numpy(zero_copy_only=False))
    sig, valid = np.concatenate(sigs), np.concatenate(has)
    docs = np.flatnonzero(np.random.default_rng(0).random(len(sig)) < 0.9)  # some left out
    want = fuzzy_dedup(sig[docs], valid[docs], bands, threshold)
    assert want.removed >= 10
    for tasks in (1, 3, 16):
        got = fuzzy_dedup_tasks(chunks, num_perm, docs, bands, threshold, None, tasks)
        assert np.array_equal(got.keep, want.keep) and np.array_equal(got.cluster,
                                                                      want.cluster)
        assert (got.candidate_pairs, got.duplicate_pairs) == (want.candidate_pairs,
                                                              want.duplicate_pairs)


    # A task reads every page of every chunk file for each band: it must not keep them
    # mapped (they would stay in its resident memory, all the signatures by the last band).
    del sigs, has, batch
    rows = _Chunks(chunks, num_perm)
    assert np.array_equal(rows.rows(docs[::-1], 8, 16), sig[docs[::-1], 8:16])
    mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()}
    assert not mapped & set(chunks), "chunk files stay mapped"


def test_executor_flags_are_checked(corpus: dict[str, Any], tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mt_data.cli import app

    base = ["prepare", str(corpus["files"][0]), "-o", str(tmp_path / "out"), "--tokenizer",
            "tokenizer-1k"]
    for extra, message in (
            (["--executor", "spark"], "executor must be one of local, ray, got 'spark'"),
            (["--ray-address", "auto"], "a Ray address (auto) is for --executor ray"),
            (["--executor", "ray", "--workers", "4"], "with --executor ray the cluster's CPUs"),
            (["--executor", "ray", "--ray-address", "127.0.0.1:1"],
             "--ray-address 127.0.0.1:1: cannot join a Ray cluster (nothing answers"),
            (["--executor", "ray", "--ray-address", "head-node"], "expected auto or HOST:PORT")):
        result = CliRunner().invoke(app, [*base, *extra])
        assert result.exit_code == 2, (extra, result.output)
        assert message in " ".join(result.output.split()), (extra, result.output)
        assert not (tmp_path / "out").exists()


def test_a_killed_driver_resumes_on_ray(corpus: dict[str, Any], cluster: str,
                                        tmp_path: Path) -> None:
    """The driver (`python -m mt_data.cli prepare --executor ray`) SIGKILLed once some chunks
    are written; the same command again resumes from them and makes the dataset of the same
    command with the local executor."""
    def command(out: Path, *extra: str) -> list[str]:
        return [sys.executable, "-m", "mt_data.cli", "prepare",
                *(str(p) for p in corpus["files"]), "--output", str(out), "--tokenizer",
                "tokenizer-1k", "--decontaminate", str(corpus["eval"]), *extra]

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    local = subprocess.run(command(tmp_path / "local"), env=env, capture_output=True,
                           text=True, timeout=600)
    assert local.returncode == 0, local.stdout + local.stderr
    out = tmp_path / "ray"
    on_ray = command(out, "--executor", "ray", "--ray-address", cluster)
    driver = subprocess.Popen(on_ray, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(list((out / "work").glob("clean-*.arrow"))) < 2:
        assert driver.poll() is None, driver.communicate()
        assert time.monotonic() < deadline, "no chunk was written"
        time.sleep(0.05)
    driver.kill()
    driver.wait()
    assert not (out / "index.json").exists()  # killed before the end
    again = subprocess.run(on_ray, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    _same_dataset(tmp_path / "local", out)
