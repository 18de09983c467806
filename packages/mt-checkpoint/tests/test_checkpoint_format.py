"""The checkpoint format without training: names, rank order, the publish protocol (a
rollback and a kill after every phase included), finding the step to load, damaged files."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mt_checkpoint import (
    LATEST,
    META,
    RANK_FORMAT,
    CheckpointError,
    CheckpointMeta,
    SavedLayout,
    clean_stale,
    find_checkpoint,
    fresh_rng,
    fresh_start,
    load_rank,
    publish_step,
    rank_file,
    rank_seed,
    read_meta,
    save_rank,
    step_dir,
)
from mt_checkpoint.checksums import ChecksumWriter, collect_sums, file_sum
from mt_dist import Topology

LAYOUT = SavedLayout(tp=2, pp=2, dp=2, zero_stage=1)


def test_names_and_rank_order_follow_mt_dist() -> None:
    assert (rank_file(7), step_dir(300)) == ("rank-00007.pt", "step-00000300")
    topology = Topology(tp=2, pp=2, dp=2)
    for rank in range(8):
        pp, dp, tp = topology.coord(rank).pp, topology.coord(rank).dp, topology.coord(rank).tp
        assert LAYOUT.rank(pp, dp, tp) == rank and LAYOUT.file(pp, dp, tp) == rank_file(rank)
    assert LAYOUT.replicas(1, 0) == [topology.rank_of(pp=1, dp=d, tp=0) for d in range(2)]
    assert SavedLayout.from_dict(LAYOUT.to_dict(), "m") == LAYOUT
    with pytest.raises(CheckpointError, match=r"m: layout world_size 6 is not tp 2 x pp 2"):
        SavedLayout.from_dict({**LAYOUT.to_dict(), "world_size": 6}, "m")
    with pytest.raises(CheckpointError, match=r"m: bad layout \{'tp': 2\}"):
        SavedLayout.from_dict({"tp": 2}, "m")


def _write_step(root: Path, step: int, layout: SavedLayout = LAYOUT) -> Path:
    """A step's rank files in its hidden temporary folder, as the ranks leave them."""
    tmp = root / f".{step_dir(step)}.tmp"
    tmp.mkdir(parents=True)
    for rank in range(layout.world_size):
        with open(tmp / rank_file(rank), "wb") as f:  # as save_rank does, another payload
            checked = ChecksumWriter(f)
            torch.save({"format": RANK_FORMAT, "rank": rank, "step": torch.tensor(step)},
                       checked)
        checked.record(tmp / rank_file(rank))
    return tmp


def _meta(step: int) -> CheckpointMeta:
    return CheckpointMeta(step=step, layout=LAYOUT, model={"n_layers": 2},
                          styles={"w": "column"}, stage_params={0: ["w"], 1: ["v"]},
                          consumed_samples=8 * step, data_step=step,
                          config={"train": {"seed": 5}, "parallel": {"tp": 2, "nproc": 8}})


def _publish(root: Path, step: int, **kw: object) -> Path:
    return publish_step(root, _write_step(root, step), _meta(step), keep_last=2, **kw)


def test_publish_switches_latest_and_prunes(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        folder = _publish(tmp_path, step)
        assert (tmp_path / LATEST).read_text().strip() == folder.name == step_dir(step)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [step_dir(4), step_dir(6)]
    assert find_checkpoint(tmp_path) == tmp_path / step_dir(6)
    meta = read_meta(tmp_path / step_dir(6))
    assert replace(meta, files={}) == _meta(6)
    assert meta.files == {rank_file(r): {"bytes": (tmp_path / step_dir(6) / rank_file(r)).stat(
        ).st_size, "crc32c": file_sum(tmp_path / step_dir(6) / rank_file(r))[1]}
        for r in range(8)}
    assert json.loads((tmp_path / step_dir(6) / META).read_text())["format"] == "mt-pretrain/1"
    assert int(load_rank(tmp_path / step_dir(6), 7)["step"]) == 6
    assert not list(tmp_path.glob(".*"))  # no temporary left


class _Killed(Exception):
    """Stands for a SIGKILL at a phase of the protocol (nothing after it runs)."""


@pytest.mark.parametrize("phase, loads", [
    ("meta", 4), ("replace", 2), ("rename", 4), ("pointer", 4), ("prune", 4)])
def test_a_kill_after_any_phase_of_a_rollback_save_leaves_a_loadable_step(
        tmp_path: Path, phase: str, loads: int) -> None:
    """Steps 2 and 4 published; the run goes back to step 2 and saves step 4 again, killed
    after ``phase``: `latest` (or the fallback) always leads to a complete step."""
    _publish(tmp_path, 2)
    _publish(tmp_path, 4)

    def kill(name: str) -> None:
        if name == phase:
            raise _Killed(name)

    with pytest.raises(_Killed):
        _publish(tmp_path, 4, phase=kill)
    if phase == "replace":  # `latest` names step 4, moved aside: the newest complete one
        with pytest.warns(UserWarning, match=r"latest names step-00000004, which is missing: "
                          r"loading step-00000002"):
            folder = find_checkpoint(tmp_path)
    else:
        folder = find_checkpoint(tmp_path)
    assert folder.name == step_dir(loads)
    assert int(load_rank(folder, 0)["step"]) == loads
    clean_stale(tmp_path)  # what the next save does first
    assert not list(tmp_path.glob(".step-*"))


def test_damaged_files_are_one_line_and_latest_falls_back(tmp_path: Path) -> None:
    _publish(tmp_path, 2)
    _publish(tmp_path, 4)
    step4 = tmp_path / step_dir(4)
    (step4 / rank_file(3)).write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"rank-00003.pt: empty; load an earlier step"):
        load_rank(step4, 3)
    good = (tmp_path / step_dir(2) / rank_file(1)).read_bytes()
    (step4 / rank_file(1)).write_bytes(good[:100])
    with pytest.raises(CheckpointError, match=r"rank-00001.pt: damaged or truncated \(100 "):
        load_rank(step4, 1)
    with pytest.warns(UserWarning, match=r"step-00000004, which is missing or empty: "
                      r"rank-00003.pt: loading step-00000002"):
        assert find_checkpoint(tmp_path) == tmp_path / step_dir(2)
    (step4 / "meta.json").write_text('{"format": "mt-pretrain/1", "st')
    with pytest.raises(CheckpointError, match=r"meta.json: damaged \("):
        read_meta(step4)
    (step4 / "meta.json").write_text(json.dumps({"format": "other/1"}))
    with pytest.raises(CheckpointError, match=r"format 'other/1', expected 'mt-pretrain/1'"):
        read_meta(step4)
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*nowhere: no such folder"):
        find_checkpoint(tmp_path / "nowhere")
    # A file given as the checkpoint; a `latest` that is empty or
    # names a path outside the folder.
    with pytest.raises(CheckpointError, match=r"rank-00001.pt: a file, not a checkpoint "
                                              r"folder"):
        find_checkpoint(step4 / rank_file(1))
    for text, why in (("", "latest is empty"), ("/etc", "latest is damaged \\(it names "
                                                         "'/etc', not a step folder of")):
        (tmp_path / "latest").write_text(text)
        with pytest.warns(UserWarning, match=why + r".*loading step-00000002"):
            assert find_checkpoint(tmp_path) == tmp_path / step_dir(2)


def test_a_chain_may_load_its_own_empty_folder(tmp_path: Path) -> None:
    own = tmp_path / "ck"
    assert fresh_start(str(own), own)  # not created yet
    own.mkdir()
    assert fresh_start(str(own), own)  # empty
    _publish(own, 2)
    assert not fresh_start(str(own), own)  # it holds a step: resume
    assert not fresh_start(str(tmp_path / "other"), own)  # another folder: must exist
    assert not fresh_start(None, own)


def test_meta_is_typed_and_moves_to_another_layout(tmp_path: Path) -> None:
    meta = _meta(4)
    data = meta.to_dict()
    assert CheckpointMeta.from_dict(data, "m") == meta
    assert data["data"] == {"consumed_samples": 32, "step": 4} and data["data_order"] == 2
    assert meta.seed == 5
    old = {k: v for k, v in data.items() if k != "data_order"}  # written before order 2
    assert CheckpointMeta.from_dict(old, "m").data_order == 1
    new = meta.relaid(SavedLayout(tp=1, pp=1, dp=4, zero_stage=2), {0: ["w", "v"]})
    assert new.layout.world_size == 4 and new.stage_params == {0: ["w", "v"]}
    assert new.config["parallel"] == {"tp": 1, "pp": 1, "dp": 4, "zero_stage": 2,
                                      "virtual_stages": 1, "nproc": 4}
    assert meta.config["parallel"] == {"tp": 2, "nproc": 8}  # the original is untouched
    with pytest.raises(CheckpointError, match=r"m: damaged \(no styles, stage_params\)"):
        CheckpointMeta.from_dict({k: v for k, v in data.items()
                                  if k not in ("styles", "stage_params")}, "m")
    with pytest.raises(CheckpointError, match=r"m: stage_params names stages \[0\], the "
                       r"layout has pp 2"):
        CheckpointMeta.from_dict({**data, "stage_params": {"0": ["w"]}}, "m")
    with pytest.raises(CheckpointError, match=r'm: damaged \(step is "four", expected a '
                       r"whole number >= 0\)"):
        CheckpointMeta.from_dict({**data, "step": "four"}, "m")


def test_rank_files_round_trip_and_fresh_rng_follows_the_rank_seed(tmp_path: Path) -> None:
    rng = fresh_rng(5, pp_rank=1, dp_rank=1)
    size = save_rank(tmp_path, 3, (1, 1, 1), {"w": torch.ones(2)}, {"format": "x"}, rng)
    assert size == (tmp_path / rank_file(3)).stat().st_size
    sums = collect_sums(tmp_path, [rank_file(3)])  # what publishing puts in meta.json
    assert sums == {rank_file(3): {"bytes": size,
                                   "crc32c": file_sum(tmp_path / rank_file(3))[1]}}
    data = load_rank(tmp_path, 3, replace(_meta(0), files=sums))
    assert data["coord"] == [1, 1, 1] and torch.equal(data["model"]["w"], torch.ones(2))
    assert rank_seed(5, 1, 1) == 5 + 100 + 10007
    torch.manual_seed(rank_seed(5, 1, 1))  # what a training rank at (pp 1, dp 1) does
    expected = torch.rand(3)
    generator = torch.Generator()
    generator.set_state(data["rng"]["torch"])
    assert torch.equal(torch.rand(3, generator=generator), expected)
    assert data["rng"]["cuda"] is None and data["rng"]["tracker"] == {}


def test_flipped_bytes_in_a_rank_file_or_meta_are_refused(tmp_path: Path) -> None:
    """64 flipped bytes inside a rank file (the same size, still a loadable pickle where
    they fall inside tensor data) and a changed number in meta.json are one line naming the
    file, never loaded. A step folder from before checksums loads, with a warning."""
    folder = _publish(tmp_path, 2)
    path = folder / rank_file(5)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{path}: damaged \(its checksum is crc32c:"
                       r"[0-9a-f]{8}, meta.json recorded crc32c:[0-9a-f]{8}: bytes changed on "
                       r"disk\); load an earlier step folder of"):
        load_rank(folder, 5)
    assert int(load_rank(folder, 4)["step"]) == 2  # the others are intact
    meta = json.loads((folder / META).read_text())
    (folder / META).write_text(json.dumps({**meta, "step": 3}, indent=1))
    with pytest.raises(CheckpointError, match=r"meta.json: damaged \(its content does not "
                       r"match its checksum crc32c:"):
        read_meta(folder)
    # Before checksums: no "files", no "crc32c" in meta.json.
    old = {k: v for k, v in meta.items() if k not in ("files", "crc32c")}
    (folder / META).write_text(json.dumps(old, indent=1))
    with pytest.warns(UserWarning, match="written before checkpoints carried checksums"):
        assert int(load_rank(folder, 4)["step"]) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _publish(tmp_path, 4)  # a new one verifies silently
        assert int(load_rank(tmp_path / step_dir(4), 5)["step"]) == 4
