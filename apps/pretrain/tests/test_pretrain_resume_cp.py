"""Checkpoints of context-parallel runs: CP changes nothing on disk but the number of ZeRO
shards (the dp x cp ranks of a model shard hold them, in rank order), so a CP 2 checkpoint
resumes exactly at CP 2 (12 steps == 6 + resume + 6, bit for bit) and at CP 1 and CP 4 (the
shards consolidated and cut again) continues the uninterrupted run's losses and ends at its
weights within fp32 round-off: every layout trains like one process, only the order of sums
differs."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_pretrain

from mt_formats import load_state_dict

STEPS, HALF = 12, 6
COMMON: dict[str, Any] = {
    "model": "llama-test", "seq_len": 32, "dropout": 0.0, "micro_batch_size": 2,
    "global_batch_size": 4, "train_steps": STEPS, "eval_interval": 0, "sample_tokens": 0,
    "progress": False, "log_interval": 100, "timeout": 120.0, "zero_stage": 1,
}
_run = partial(run_pretrain, COMMON)


@pytest.fixture(scope="module")
def cp2_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """12 steps of llama-test (rotary positions) at CP 2 with ZeRO-1 over the two CP ranks,
    checkpoints after steps 6 and 12."""
    cache = tmp_path_factory.mktemp("mt-cache")
    out = tmp_path_factory.mktemp("cp2")
    summary = _run(out, cache, nproc=2, cp=2, save_interval=HALF, keep_last=5)
    return out, cache, summary


def test_a_cp2_checkpoint_resumes_exactly(cp2_run: tuple[Path, Path, Any], tmp_path: Path
                                          ) -> None:
    out, cache, full = cp2_run
    meta = (out / "checkpoints" / "step-00000006" / "meta.json").read_text()
    assert '"cp": 2' in meta  # the layout records it; rank files 0 and 1 hold the shards
    resumed = _run(tmp_path, cache, nproc=2, cp=2, save="none",
                   load=str(out / "checkpoints" / "step-00000006"))
    assert resumed.start_step == HALF and resumed.losses == full.losses[HALF:]


@pytest.mark.parametrize("cp", [1, 4])
def test_a_cp2_checkpoint_resumes_at_another_cp(cp2_run: tuple[Path, Path, Any],
                                                tmp_path: Path, cp: int) -> None:
    out, cache, full = cp2_run
    resumed = _run(tmp_path, cache, nproc=cp, cp=cp, keep_last=5,
                   load=str(out / "checkpoints" / "step-00000006"))
    assert resumed.start_step == HALF
    assert resumed.losses == pytest.approx(full.losses[HALF:], rel=1e-5, abs=0)
    _, want = load_state_dict(out / "checkpoints" / "step-00000012")
    _, got = load_state_dict(tmp_path / "checkpoints" / "step-00000012")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
