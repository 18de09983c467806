"""The layout matrix itself (pure): at least 60 layouts, every pair of feature values that can
occur together covered by the CI subset (the pairwise cover and two Llama rows: llama-test at
TP 2 x PP 2 x DP 2 and TP 4 x DP 2 with SP), context-parallel rows at CP 2 and 4 with TP, PP,
ZeRO, recomputation, bf16, dropout and Llama among them, references as documented, and the CI
subset split into the shards that train it (test_contract_{fp32,bf16}_{a,b}.py,
test_contract_fp16.py, test_contract_llama.py, test_contract_cp.py: each case against the run
it must equal) without dropping or repeating a case. The full matrix is
`mt matrix --set full` (README: its table).
"""

from __future__ import annotations

from pathlib import Path

from contract_shards import SHARDS

from mt_pretrain.config.load import load_config
from mt_pretrain.config.resolve import resolve
from mt_pretrain.contract.matrix import (
    COMMON,
    CP_CI,
    LLAMA_CI,
    Case,
    candidates,
    ci_matrix,
    cp_rows,
    full_matrix,
    llama_rows,
    matrix_layout,
    valid,
)

CI = ci_matrix()


def test_the_matrix_covers_every_pair_of_features() -> None:
    pool, full = candidates(), full_matrix()
    assert len(full) >= 60 and len(set(full)) == len(full)
    assert set(CI) <= set(full) <= set(pool) | set(llama_rows(pool)) | set(cp_rows())
    assert {c.name for c in llama_rows(pool)} >= {c.name for c in LLAMA_CI}
    grids = {(c.layout.tp, c.layout.pp, c.layout.dp) for c in pool}
    assert len(llama_rows(pool)) == len(grids) - 1  # one per grid but one process (the ref)
    assert all(valid(c) for c in llama_rows(pool))  # mt pretrain's own checks accept them
    wanted = set().union(*(case.pairs() for case in pool))
    covered = set().union(*(case.pairs() for case in CI if case.layout.cp == 1))
    assert wanted == covered
    # The features of the contract, each present (values of every factor).
    factors = {(k, v) for pair in covered for k, v in pair}
    for expected in [("zero", 3), ("schedule", "interleaved"), ("sp", True),
                     ("recompute", "full"), ("recompute", "selective"),
                     ("precision", "bf16"), ("precision", "fp16"), ("dropout", True),
                     ("engine", "deepspeed"), ("tp", 4), ("pp", 4), ("dp", 8)]:
        assert expected in factors, expected
    # The pairs the issues name: TP x ZeRO-3, schedule x DP, SP x ZeRO-2, AC x dropout...
    for a, b in [(("tp", 2), ("zero", 3)), (("dp", 2), ("schedule", "gpipe")),
                 (("sp", True), ("zero", 2)), (("dropout", True), ("recompute", "full")),
                 (("dropout", True), ("recompute", "selective")),
                 (("precision", "bf16"), ("recompute", "selective")),
                 (("precision", "fp16"), ("dp", 2)), (("precision", "bf16"), ("pp", 2))]:
        assert tuple(sorted((a, b))) in covered, (a, b)
    # DeepSpeed in bf16 through both of its engines: ZeRO-3 without a pipeline, and a pipeline
    # (a triple of factors, which pairs alone do not promise).
    ds_bf16 = [c.layout for c in CI if c.engine == "deepspeed" and c.layout.precision == "bf16"]
    assert any(lay.pp == 1 and lay.zero_stage == 3 for lay in ds_bf16), ds_bf16
    assert any(lay.pp > 1 for lay in ds_bf16), ds_bf16


def test_the_context_parallel_rows_hold_every_feature() -> None:
    rows = cp_rows()
    assert set(CP_CI) <= set(rows) and all(valid(c) for c in rows)
    assert {c.layout.cp for c in rows} == {2, 4} and {c.layout.cp for c in CP_CI} == {2, 4}
    assert all(c.nproc <= 8 for c in rows)
    # In CI, together: TP (with SP), PP, ZeRO 1-3, each recomputation, bf16, dropout, Llama.
    ci = [c.factors() for c in CP_CI]
    for key, value in [("tp", 2), ("sp", True), ("pp", 2), ("dp", 2), ("zero", 1), ("zero", 2),
                       ("zero", 3), ("recompute", "full"), ("recompute", "selective"),
                       ("precision", "bf16"), ("dropout", True)]:
        assert any(f.get(key) == value for f in ci), (key, value)
    assert any(c.model == "llama-test" for c in CP_CI)
    # The full matrix: every feature at both degrees (fp16, DeepSpeed refused with CP).
    for cp in (2, 4):
        at = [c for c in rows if c.layout.cp == cp]
        assert {c.layout.precision for c in at} == {"fp32", "bf16", "fp16"}
        assert any(c.dropout for c in at) and any(c.model == "llama-test" for c in at)


def test_references_are_what_the_contract_says() -> None:
    plain = Case(matrix_layout(tp=2, pp=2, dp=2, zero_stage=1, precision="bf16"))
    assert plain.reference() == Case(matrix_layout(precision="bf16"))
    dropped = Case(matrix_layout(tp=2, pp=2, sequence_parallel=True, checkpointing=True),
                   dropout=0.1)
    # Dropout: sharded TP regions draw per-rank masks, so the same TP degree and SP setting.
    assert dropped.reference() == Case(matrix_layout(tp=2, sequence_parallel=True), 0.1)
    assert Case(matrix_layout(dp=4, zero_stage=2), 0.1).reference().nproc == 1
    # Context parallelism: one process; with dropout the same CP degree (per-slice masks).
    assert Case(matrix_layout(tp=2, cp=2, zero_stage=1)).reference() == Case(matrix_layout())
    assert Case(matrix_layout(pp=2, cp=2), 0.1).reference() == Case(matrix_layout(cp=2), 0.1)


def test_the_shards_hold_every_ci_case_once() -> None:
    sharded = [case for cases in SHARDS.values() for case in cases]
    assert sorted(c.name for c in sharded) == sorted(c.name for c in CI)
    assert all(SHARDS.values())
    here = Path(__file__).parent
    for name in SHARDS:  # each shard has its test file (a Pants target of its own)
        assert (here / f"test_contract_{name.replace('-', '_')}.py").is_file(), name


def test_the_config_builds_each_case_layout_back() -> None:
    """The one translation, both ways: a case's layout becomes flags
    (:func:`~mt_pretrain.config.schema.layout_flags`), and the resolved run of those flags has
    exactly that layout again, for every case of the full matrix."""
    for case in full_matrix():
        config = load_config(None, {**COMMON, **case.options(), "train_steps": 1})
        assert resolve(config, case.nproc).layout == case.layout, case.name
