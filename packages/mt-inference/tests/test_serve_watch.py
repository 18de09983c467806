"""mt serve notices when the checkpoint it loaded is no longer what its path holds: a run's
``latest`` moved to a new step, or the step folder's files replaced or edited. ``/health``
then answers 503 with a line saying what changed (an orchestrator restarts the server, which
loads the change), the change is announced once, and the model card names the folder the
server answers from (``root``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from starlette.testclient import TestClient

from mt_inference.serving.api import Limits
from mt_inference.serving.engine import Inbox
from mt_inference.serving.http import ServerConfig, build_app
from mt_inference.serving.watch import CheckpointWatch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(root: Path) -> Path:
    """A run folder: two complete step folders of one rank (a tiny payload, a real
    ``meta.json``) and ``latest`` naming the first."""
    from mt_checkpoint import CheckpointMeta, SavedLayout, save_rank, write_meta

    for step in (2, 4):
        folder = root / f"step-{step:08d}"
        folder.mkdir(parents=True)
        save_rank(folder, 0, (0, 0, 0), {"w": torch.full((2,), float(step))}, {}, {})
        write_meta(folder, CheckpointMeta(step=step, layout=SavedLayout(tp=1, pp=1, dp=1),
                                          model={}, styles={"w": "replicate"},
                                          stage_params={0: ["w"]}, consumed_samples=step))
    (root / "latest").write_text("step-00000002\n")
    return root


def test_a_moved_latest_and_an_edited_file_are_each_a_change(tmp_path: Path) -> None:
    said: list[str] = []
    clock = Clock()
    run = _run(tmp_path / "run")
    watch = CheckpointWatch(run, said.append, every=5.0, clock=clock)
    assert watch.folder == str((run / "step-00000002").resolve())
    clock.now = 10.0
    assert watch.change() is None and said == []
    (run / "latest").write_text("step-00000004\n")
    clock.now = 12.0  # looked at again at most every 5 s
    assert watch.change() is None
    clock.now = 16.0
    change = watch.change()
    assert change is not None and f"now designates {run / 'step-00000004'}" in change
    assert said == [f"warning: {change}"]
    assert watch.change() == change and len(said) == 1  # said once
    (run / "latest").write_text("step-00000002\n")  # undone: what was loaded again
    clock.now = 22.0
    assert watch.change() is None
    step = tmp_path / "run" / "step-00000004"
    edited = CheckpointWatch(step, said.append, every=0.0, clock=clock)
    rank = step / "rank-00000.pt"
    before = rank.stat()
    rank.write_bytes(b"other weights!!")  # same folder, another content
    os.utime(rank, ns=(before.st_atime_ns, before.st_mtime_ns + 1))
    assert "its files changed" in (edited.change() or "")


def test_health_answers_503_once_the_checkpoint_changed(tmp_path: Path) -> None:
    said: list[str] = []
    clock = Clock()
    run = _run(tmp_path / "run")
    watch = CheckpointWatch(run, said.append, every=1.0, clock=clock)
    config = ServerConfig("run", Limits(64, 100), lambda text: [1], lambda ids: "x", (0,),
                          watch=watch)
    client = TestClient(build_app(config, Inbox(4)))
    assert client.get("/health").status_code == 200
    card = client.get("/v1/models").json()["data"][0]
    assert card["root"] == str((run / "step-00000002").resolve())
    (run / "latest").write_text("step-00000004\n")
    clock.now = 2.0
    answer = client.get("/health")
    assert answer.status_code == 503 and answer.json()["status"] == "stale"
    assert "restart mt serve to serve the change" in answer.json()["message"]
    assert len(said) == 1


def test_a_long_unknown_model_name_is_cut_in_the_404(tmp_path: Path) -> None:
    """The 404 of an unknown model names it, cut to 60 characters (not echoed whole)."""
    config = ServerConfig("run", Limits(64, 100), lambda text: [1], lambda ids: "x", (0,))
    answer = TestClient(build_app(config, Inbox(4))).get("/v1/models/" + "x" * 5000)
    message = answer.json()["error"]["message"]
    assert answer.status_code == 404 and "x" * 57 + "..." in message and len(message) < 200


def test_a_file_gone_while_looked_at_is_a_change_not_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A training run pruning a step folder while the server looks at it (a file listed,
    then gone before its ``stat``): a change, never an exception out of /health."""
    from mt_inference.serving.watch import checkpoint_state

    run = _run(tmp_path / "run")
    before = checkpoint_state(run)
    stat = Path.stat

    def gone(self: Path, *args: object, **kwargs: object) -> os.stat_result:
        if self.name == "rank-00000.pt":
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return stat(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "stat", gone)
    assert checkpoint_state(run) != before
