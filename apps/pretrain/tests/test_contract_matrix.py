"""The correctness contract in CI: the pairwise cover of the layout matrix and two Llama rows
(llama-test at TP 2 x PP 2 x DP 2 and TP 4 x DP 2 with SP), each case trained
for 10 steps against the run it must equal (one process in the same precision; with dropout
the run at the same TP degree), comparing every step's loss, gradient norm and learning rate,
the validation loss and every final parameter (see mt_pretrain.contract.runner for the metrics and
the tolerances). The full matrix is `mt matrix --set full` (README: its table).

Also the matrix itself (pure): at least 60 layouts, every pair of feature values that can
occur together covered by the CI subset, references as documented; and the bf16 noise floor
the 16-bit tolerances are derived from, measured again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mt_pretrain.contract.matrix import (
    LLAMA_CI,
    Case,
    candidates,
    ci_matrix,
    full_matrix,
    llama_rows,
    matrix_layout,
    valid,
)
from mt_pretrain.contract.runner import FLOORS, FP32, MatrixRunner, noise_floor

STEPS = 10
CI = ci_matrix()


def test_the_matrix_covers_every_pair_of_features() -> None:
    pool, full = candidates(), full_matrix()
    assert len(full) >= 60 and len(set(full)) == len(full)
    assert set(CI) <= set(full) <= set(pool) | set(llama_rows(pool))
    assert {c.name for c in llama_rows(pool)} >= {c.name for c in LLAMA_CI}
    grids = {(c.layout.tp, c.layout.pp, c.layout.dp) for c in pool}
    assert len(llama_rows(pool)) == len(grids) - 1  # one per grid but one process (the ref)
    assert all(valid(c) for c in llama_rows(pool))  # mt pretrain's own checks accept them
    wanted = set().union(*(case.pairs() for case in pool))
    covered = set().union(*(case.pairs() for case in CI))
    assert wanted == covered
    # The features of the contract, each present (values of every factor).
    factors = {(k, v) for pair in covered for k, v in pair}
    for expected in [("zero", 3), ("schedule", "interleaved"), ("sp", True), ("ac", True),
                     ("precision", "bf16"), ("precision", "fp16"), ("dropout", True),
                     ("engine", "deepspeed"), ("tp", 4), ("pp", 4), ("dp", 8)]:
        assert expected in factors, expected
    # The pairs the issue names: TP x ZeRO-3, schedule x DP, SP x ZeRO-2, AC x dropout...
    for a, b in [(("tp", 2), ("zero", 3)), (("dp", 2), ("schedule", "gpipe")),
                 (("sp", True), ("zero", 2)), (("ac", True), ("dropout", True)),
                 (("precision", "fp16"), ("dp", 2)), (("precision", "bf16"), ("pp", 2))]:
        assert tuple(sorted((a, b))) in covered, (a, b)


def test_references_are_what_the_contract_says() -> None:
    plain = Case(matrix_layout(tp=2, pp=2, dp=2, zero_stage=1, precision="bf16"))
    assert plain.reference() == Case(matrix_layout(precision="bf16"))
    dropped = Case(matrix_layout(tp=2, pp=2, sequence_parallel=True, checkpointing=True),
                   dropout=0.1)
    # Dropout: sharded TP regions draw per-rank masks, so the same TP degree and SP setting.
    assert dropped.reference() == Case(matrix_layout(tp=2, sequence_parallel=True), 0.1)
    assert Case(matrix_layout(dp=4, zero_stage=2), 0.1).reference().nproc == 1


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> MatrixRunner:
    """Trains each distinct reference once for the whole module."""
    return MatrixRunner(STEPS, tmp_path_factory.mktemp("matrix"))


@pytest.mark.parametrize("case", CI, ids=[c.name for c in CI])
def test_layout_trains_like_its_reference(case: Case, runner: MatrixRunner,
                                          tmp_path: Path) -> None:
    outcome = runner.check(case, tmp_path)
    assert outcome.diff is not None and outcome.diff.steps == STEPS
    assert outcome.diff.within(outcome.tolerance), (
        f"{case.name}: {outcome.diff} exceeds {outcome.tolerance}")
    if outcome.fp32_gap is not None:  # a 16-bit run, not an fp32 one by mistake
        assert outcome.fp32_gap > FP32.grad_norm, (case.name, outcome.fp32_gap)
    assert outcome.passed


def test_bf16_noise_floor_is_the_documented_one() -> None:
    """The floor the bf16 tolerances are derived from, measured again (deterministic on a
    CPU: the stored figures must not be stale or optimistic)."""
    measured = noise_floor("bf16", STEPS)
    floor = FLOORS["bf16"]
    worst = {k: max(getattr(d, k) for name, d in measured.items() if name != "fp32-gap")
             for k in ("loss", "grad_norm", "params")}
    for key, value in worst.items():
        assert 0.5 * getattr(floor, key) <= value <= getattr(floor, key), (key, value, floor)
