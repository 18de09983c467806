"""The correctness contract in CI, shard `bf16-b` of the CI matrix (contract_shards.py): each
case trained for 10 steps against the run it must equal (one process in the same precision;
with dropout the run at the same TP degree), comparing every step's loss, gradient norm and
learning rate, the validation loss and every final parameter (mt_pretrain.contract.runner)."""

from __future__ import annotations

from pathlib import Path

import pytest
from contract_shards import SHARDS, check_case, check_noise_floor

from mt_pretrain.contract.matrix import Case
from mt_pretrain.contract.runner import MatrixRunner

CASES = SHARDS["bf16-b"]


def test_bf16_b_noise_floor_measured_here_is_honest(matrix_runner: MatrixRunner) -> None:
    check_noise_floor("bf16", matrix_runner)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_layout_trains_like_its_reference(case: Case, matrix_runner: MatrixRunner,
                                          tmp_path: Path) -> None:
    check_case(case, matrix_runner, tmp_path)
