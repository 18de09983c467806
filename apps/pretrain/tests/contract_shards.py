"""The CI matrix (`ci_matrix`) in shards, one test file each, so that Pants runs them as
separate targets (each well under its timeout, side by side when cores allow) and every shard
trains the references and noise floor it needs once.

A shard groups cases that share references: the fp32 GPT-2 cases and the bf16 ones (each in
two halves, by estimated cost: bf16 matmuls are emulated, ten times slower, on AVX2-only
CPUs), the fp16 cases, the Llama rows (context-parallel ones too), the fp32 GPT-2
context-parallel rows (a 16-bit one joins its precision's shards, which measure the floor).
`test_contract_matrix.py` checks that the shards hold every CI case exactly once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from mt_pretrain.contract.matrix import Case, _cost, ci_matrix
from mt_pretrain.contract.runner import FP32, MatrixRunner, cpu_isa

#: Optimizer steps of every CI run.
STEPS = 10


def _by_cost(cases: list[Case]) -> list[Case]:
    return sorted(cases, key=_cost, reverse=True)


def _shards() -> dict[str, list[Case]]:
    cases = ci_matrix()
    tiny = [c for c in cases if c.model == "tiny"]
    fp32 = _by_cost([c for c in tiny if c.layout.precision == "fp32" and c.layout.cp == 1])
    bf16 = _by_cost([c for c in tiny if c.layout.precision == "bf16"])
    return {  # halves alternate by estimated cost, so each gets its share of the dearest
        "fp32-a": fp32[0::2],
        "fp32-b": fp32[1::2],
        "bf16-a": bf16[0::2],
        "bf16-b": bf16[1::2],
        "fp16": [c for c in tiny if c.layout.precision == "fp16"],
        "llama": [c for c in cases if c.model != "tiny"],
        "cp": [c for c in tiny if c.layout.precision == "fp32" and c.layout.cp > 1],
    }


SHARDS = _shards()


def check_case(case: Case, runner: MatrixRunner, tmp_path: Path) -> None:
    """Train ``case`` and assert it equals its reference within its tolerance."""
    outcome = runner.check(case, tmp_path)
    assert outcome.diff is not None and outcome.diff.steps == STEPS
    assert outcome.tolerance is not None and outcome.diff.within(outcome.tolerance), (
        f"{case.name}: {outcome.diff} exceeds {outcome.tolerance} ({cpu_isa()})")
    if outcome.fp32_gap is not None:  # a 16-bit run, not an fp32 one by mistake
        assert outcome.fp32_gap > FP32.grad_norm, (case.name, outcome.fp32_gap)
    assert outcome.passed


def check_noise_floor(precision: str, runner: MatrixRunner) -> None:
    """The floor the 16-bit tolerances are derived from, measured on this machine, is an
    honest one: every regrouping of the batch changes every quantity (a floor of zero would
    come from runs that reordered nothing, and make every tolerance zero), and the floor
    stays below the distance between the 16-bit run and the fp32 one on every quantity (it
    measures reordering in 16 bits, not a change of format)."""
    measured = runner.noise_floor(precision)
    floor, gap = runner.floor(precision), measured["fp32-gap"]
    print(f"{precision} noise floor on {cpu_isa()}: {floor}; fp32 gap: {gap}")
    for name, diff in measured.items():
        assert diff.steps == STEPS and diff.lr == 0.0, (name, diff)
        assert min(diff.loss, diff.grad_norm, diff.params) > 0.0, (precision, name, diff)
    for key in ("loss", "grad_norm", "params"):
        assert getattr(floor, key) < getattr(gap, key), (precision, key, floor, gap, cpu_isa())


def layout_test(shard: str) -> Callable[..., None]:
    """The test of a shard file: every case of ``shard`` against its reference (the
    ``matrix_runner`` fixture of conftest.py trains each reference once per file)."""
    cases = SHARDS[shard]

    @pytest.mark.parametrize("case", cases, ids=[c.name for c in cases])
    def test_layout_trains_like_its_reference(case: Case, matrix_runner: MatrixRunner,
                                              tmp_path: Path) -> None:
        check_case(case, matrix_runner, tmp_path)

    return test_layout_trains_like_its_reference


def floor_test(precision: str) -> Callable[..., None]:
    """The test of a 16-bit shard file that its floor, measured here, is honest."""
    def test_noise_floor_measured_here_is_honest(matrix_runner: MatrixRunner) -> None:
        check_noise_floor(precision, matrix_runner)

    return test_noise_floor_measured_here_is_honest
