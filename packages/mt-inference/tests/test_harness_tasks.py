"""The task index mt hands lm-eval follows the task files a user's --include-path holds."""

from __future__ import annotations

import os
from pathlib import Path

from mt_inference.harness import task_files_version


def test_the_task_index_is_built_again_when_an_include_folder_changes(tmp_path: Path) -> None:
    """The key the lm-eval task index is cached by (one index per process, it takes seconds to
    build) changes when a task YAML is added, edited or removed under an --include-path
    folder, so that a second evaluation in one process (a notebook) finds the task added
    since; other files do not count."""
    folder = tmp_path / "tasks"
    (folder / "deep").mkdir(parents=True)
    (folder / "a.yaml").write_text("task: a\n")
    first = task_files_version((str(folder),))
    assert [Path(p).name for p, _, _ in first] == ["a.yaml"]
    (folder / "notes.txt").write_text("not a task")
    assert task_files_version((str(folder),)) == first
    (folder / "deep" / "b.yml").write_text("task: b\n")
    added = task_files_version((str(folder),))
    assert [Path(p).name for p, _, _ in added] == ["a.yaml", "b.yml"]
    (folder / "a.yaml").write_text("task: a2\n")
    os.utime(folder / "a.yaml", ns=(1, 1))  # edited: another time (and size)
    edited = task_files_version((str(folder),))
    assert edited != added and len(edited) == 2
    (folder / "deep" / "b.yml").unlink()
    assert len(task_files_version((str(folder),))) == 1
    assert task_files_version((str(tmp_path / "missing"),)) == ()
