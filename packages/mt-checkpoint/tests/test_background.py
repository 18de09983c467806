"""Asynchronous saves' parts on their own: host buffers kept from save to save, and the writer
process (the job runs there, its error comes back, its death is one line, it dies with the
process that started it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from mt_checkpoint import BackgroundWrite, HostBuffers, rank_payload, save_payload, save_rank


def test_host_buffers_are_reused_and_keep_views_of_one_storage() -> None:
    """The second snapshot of the same live state copies into the same host memory (shared
    memory: a writer process maps it), holds the new values, keeps views of one storage
    views of one copy; a storage no longer met is released."""
    flat = torch.arange(12.0)
    extra = torch.ones(3)
    buffers = HostBuffers()
    first = buffers.snapshot({"a": flat[:6].view(2, 3), "b": flat[6:], "x": extra, "n": 3})
    assert first["a"].untyped_storage().data_ptr() == first["b"].untyped_storage().data_ptr()
    assert first["b"].storage_offset() == 6 and first["a"].is_shared() and first["n"] == 3
    where = first["a"].untyped_storage().data_ptr()
    flat.mul_(2)
    second = buffers.snapshot({"a": flat[:6].view(2, 3), "b": flat[6:]})
    assert second["a"].untyped_storage().data_ptr() == where  # the same memory, reused
    assert second["b"].tolist() == [12.0, 14.0, 16.0, 18.0, 20.0, 22.0]
    assert buffers.nbytes == 12 * 4  # ``extra``'s buffer released


def test_a_started_snapshot_copies_while_the_caller_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """:meth:`HostBuffers.start` returns before its copies are made (here made 3 s late by
    the ``checkpoint.snapshot`` failpoint); :meth:`Snapshot.result` waits for them and holds
    the values of the moment of ``start``; later changes of the live state do not reach it."""
    live = torch.arange(1000.0)
    monkeypatch.setenv("MT_FAILPOINT", "checkpoint.snapshot")
    began = time.perf_counter()
    pending = HostBuffers().start({"w": live, "n": 1})
    assert time.perf_counter() - began < 1.0 and not pending.done
    copied = pending.result()
    assert time.perf_counter() - began >= 3.0 and pending.done
    live.mul_(-1)  # the optimizer's update, after the wait
    assert copied["w"].tolist() == list(map(float, range(1000))) and copied["n"] == 1


def _pid_into(path: Path) -> None:
    path.write_text(str(os.getpid()))


def _fail(message: str) -> None:
    raise ValueError(message)


def test_the_writer_runs_jobs_in_its_own_process_and_returns_their_errors(
        tmp_path: Path) -> None:
    writer = BackgroundWrite()
    try:
        writer.start(_pid_into, tmp_path / "pid")
        assert writer.busy
        writer.wait()
        pid = int((tmp_path / "pid").read_text())
        assert pid != os.getpid() and not writer.busy
        writer.start(_fail, "disk on fire")
        with pytest.raises(ValueError, match="disk on fire"):
            writer.wait()
        writer.start(_pid_into, tmp_path / "again")  # the same process, still serving
        writer.wait()
        assert int((tmp_path / "again").read_text()) == pid
    finally:
        writer.close()


def test_a_writer_killed_during_a_write_is_one_line(tmp_path: Path) -> None:
    writer = BackgroundWrite()
    writer.start(_pid_into, tmp_path / "pid")
    writer.wait()
    writer.start(time.sleep, 30)
    os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"^the checkpoint writer process died with exit "
                       r"code -9 during a write; that step is not published$"):
        writer.wait()
    writer.close()


def test_the_payload_written_by_the_writer_is_the_foreground_file(tmp_path: Path) -> None:
    """A rank file from a snapshot written in the writer process has the bytes of the one
    written in the foreground (strings and views shared as in the live state)."""
    flat = torch.randn(10)
    model = {"w": flat[:6].view(2, 3), "b": flat[6:]}
    shard = {"format": "mt-zero-shard/1", "shapes": {"w": [2, 3]}, "master": {"w": flat[:6]}}
    (tmp_path / "fg").mkdir()
    (tmp_path / "bg").mkdir()
    save_rank(tmp_path / "fg", 0, (0, 0, 0), model, shard, {})
    payload = HostBuffers().snapshot(rank_payload(0, (0, 0, 0), model, shard, {}))
    flat.zero_()  # training goes on: the snapshot does not follow
    assert _written_by_writer(tmp_path / "bg", payload) == _rank_file(tmp_path / "fg")


def _written_by_writer(folder: Path, payload: dict[str, Any]) -> bytes:
    """The rank file the writer process writes of ``payload`` into ``folder``."""
    writer = BackgroundWrite()
    try:
        writer.start(save_payload, folder, 0, payload)
        writer.wait()
    finally:
        writer.close()
    return _rank_file(folder)


def _rank_file(folder: Path) -> bytes:
    return (folder / "rank-00000.pt").read_bytes()


def test_torch_state_dicts_snapshot_to_the_same_file(tmp_path: Path) -> None:
    """A module's and an optimizer's own state dicts (an OrderedDict with ``_metadata``,
    tied weights, AdamW's step tensors and param groups) snapshotted and written by the
    writer: the foreground file's bytes, and the container types kept."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.LayerNorm(4),
                                torch.nn.Linear(4, 5))
    model[2].weight = model[0].weight  # tied, as GPT's embedding and head
    opt = torch.optim.AdamW(model.parameters())
    model(torch.tensor([1, 2])).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    (tmp_path / "fg").mkdir()
    (tmp_path / "bg").mkdir()
    save_rank(tmp_path / "fg", 0, (0, 0, 0), state["model"], state["optimizer"], {})
    payload = HostBuffers().snapshot(rank_payload(0, (0, 0, 0), *state.values(), {}))
    assert isinstance(payload["model"], OrderedDict)
    assert payload["model"]._metadata == state["model"]._metadata
    assert _written_by_writer(tmp_path / "bg", payload) == _rank_file(tmp_path / "fg")


def test_the_writer_dies_with_its_process(tmp_path: Path) -> None:
    """A training process killed (SIGKILL) mid-write leaves no writer behind that could go
    on and publish a step."""
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from mt_checkpoint import BackgroundWrite
        from test_background import _pid_into
        writer = BackgroundWrite()
        writer.start(_pid_into, Path({str(tmp_path / "pid")!r}))
        writer.wait()
        writer.start(time.sleep, 60)
        print("writing", flush=True)
        time.sleep(60)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent), *sys.path])}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        child = int((tmp_path / "pid").read_text())
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False



def test_too_little_shared_memory_is_one_line_before_any_copy() -> None:
    """A container's small /dev/shm would end the rank with a bus error mid-copy: the
    snapshot refuses first, naming what it needs and what is free (a terabyte of state, held
    on the meta device: nothing allocated, the real free space of /dev/shm checked)."""
    state = {"w": torch.empty(2**40, dtype=torch.uint8, device="meta")}
    with pytest.raises(OSError, match=r"an asynchronous save needs 1024\.00 GiB of shared "
                       r"memory for this rank's snapshot, and /dev/shm has [0-9.]+ GiB free "
                       r"\(a container: raise its --shm-size; or save in the foreground"):
        HostBuffers().snapshot(state)
