"""Layout features beyond the matrix (test_contract_matrix.py): compiled forward + loss
(torch.compile, through TP collectives and the pipeline executor), activation checkpointing
that replays dropout masks exactly, and the NaN stop. 6 steps each, 1-4 processes."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_pretrain

from mt_pretrain.run.train import NonFiniteLossError

COMMON: dict[str, Any] = {
    "model": "tiny", "seq_len": 32, "dropout": 0.0, "micro_batch_size": 2,
    "global_batch_size": 8, "train_steps": 6, "eval_interval": 3, "eval_iters": 1,
    "sample_tokens": 0, "progress": False, "log_interval": 100, "timeout": 120.0,
    "save": "none",
}


_run = partial(run_pretrain, COMMON)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Any:
    return _run(tmp_path_factory.mktemp("ref"), cache, nproc=1, tp=1, pp=1, zero_stage=0)


@pytest.mark.parametrize("layout", [
    # A cold compilation takes ~50 s per rank on 2 loaded cores while peers wait.
    {"nproc": 2, "tp": 1, "pp": 1, "zero_stage": 1, "compile": True, "timeout": 300.0},
    {"nproc": 4, "tp": 2, "pp": 2, "compile": True, "timeout": 300.0},
], ids=["compile-dp2", "compile-tp2-pp2"])
def test_compiled_layout_matches_one_process(layout: dict[str, Any], reference: Any,
                                             cache: Path, tmp_path: Path) -> None:
    summary = _run(tmp_path, cache, **layout)
    assert summary.losses == pytest.approx(reference.losses, rel=1e-5)
    assert summary.val_loss == pytest.approx(reference.val_loss, rel=1e-5)


@pytest.mark.parametrize("layout", [
    {"nproc": 4, "tp": 2, "pp": 2, "dp": 1, "zero_stage": 0},
    {"nproc": 2, "tp": 1, "pp": 1, "dp": 2, "zero_stage": 1},
], ids=["tp2-pp2", "dp2-zero1"])
def test_checkpointing_replays_dropout_exactly(layout: dict[str, Any], cache: Path,
                                               tmp_path: Path) -> None:
    """Dropout 0.1: with --activation-checkpointing a layout trains bit for bit as without,
    because the recomputation re-enters each layer's keyed RNG region (the default generator
    and the TP streams of attention dropout alike) and draws the forward's masks."""
    options = {**layout, "dropout": 0.1, "keep_weights": True}
    plain = _run(tmp_path / "plain", cache, **options)
    recomputed = _run(tmp_path / "ac", cache, activation_checkpointing=True, **options)
    assert recomputed.losses == plain.losses
    assert [r["grad_norm"] for r in recomputed.records] == [
        r["grad_norm"] for r in plain.records]
    assert recomputed.val_loss == plain.val_loss
    for name, weight in plain.weights.items():
        assert torch.equal(recomputed.weights[name], weight), name
    assert plain.losses[-1] < plain.losses[0]


def test_pretrain_nan_loss_stops_with_a_clear_error(cache: Path, tmp_path: Path) -> None:
    # An absurd learning rate without clipping blows the weights up after one step.
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step 2 \(lr "):
        _run(tmp_path, cache, nproc=1, tp=1, pp=1, lr=1e30, clip_grad=0.0, warmup_tokens=0)


LLAMA: dict[str, Any] = {"model": "llama-test", "keep_weights": True}


def _param_error(run: Any, ref: Any) -> float:
    """The matrix's parameter metric: worst relative L2 difference over tensors."""
    return max(float((run.weights[n] - w).norm()) / float(w.norm()) for n, w in ref.weights.items())


@pytest.fixture(scope="module")
def llama_reference(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> tuple[Any, float]:
    """One process, and its fp32 noise floor in the weights: the same run with micro-batches
    of 1 and 4 instead of 2 (the same sums in another order). Adam turns that round-off into
    weight differences of ~3e-5 after 6 steps on this model (1e-5 on the GPT-2 tiny)."""
    root = tmp_path_factory.mktemp("llama")
    ref = _run(root / "ref", cache, nproc=1, tp=1, pp=1, zero_stage=0, **LLAMA)
    floor = max(_param_error(_run(root / f"mb{m}", cache, nproc=1, tp=1, pp=1, zero_stage=0,
                                  micro_batch_size=m, **LLAMA), ref) for m in (1, 4))
    return ref, floor


@pytest.mark.parametrize("layout", [
    {"nproc": 2, "tp": 1, "pp": 1, "dp": 2, "zero_stage": 1},
], ids=["dp2-zero1"])
def test_llama_architecture_trains_like_one_process(layout: dict[str, Any], cache: Path,
                                                    tmp_path: Path,
                                                    llama_reference: tuple[Any, float]) -> None:
    """The llama-test preset (RoPE, RMSNorm, SwiGLU, 4 query / 2 key-value heads, no biases,
    untied vocab-parallel head) trains like one process at DP 2 with ZeRO-1: losses and grad
    norms within fp32 round-off (1e-5), every final weight within the matrix's plain multiple
    (3x) of the one-process noise floor. Its layouts with tensor parallelism (sequence-parallel
    RMSNorm; 4 query / 2 key-value heads split over TP 2 at TP 2 x PP 2 x DP 2, replicated at
    TP 4 x DP 2) are the contract's Llama rows (test_contract_llama.py: 10 steps, every step's
    loss, grad norm and learning rate and every final weight against one process)."""
    one, floor = llama_reference
    other = _run(tmp_path, cache, **layout, **LLAMA)
    assert one.losses[-1] < one.losses[0]
    assert other.losses == pytest.approx(one.losses, rel=1e-5)
    assert other.val_loss == pytest.approx(one.val_loss, rel=1e-5)
    assert [r["grad_norm"] for r in other.records] == pytest.approx(
        [r["grad_norm"] for r in one.records], rel=1e-5)
    assert one.weights.keys() == other.weights.keys() and "head.weight" in one.weights
    assert "blocks.0.attn.kv.weight" in one.weights
    assert 0 < floor < 1e-4
    assert _param_error(other, one) <= 3 * floor, (_param_error(other, one), floor)


def test_llama_resumes_where_kv_heads_change_slicing(cache: Path, tmp_path: Path,
                                                     llama_reference: tuple[Any, float]) -> None:
    """Saved at TP 4 (2 key/value heads replicated), resumed at TP 2 (split): the shards are
    merged as they were cut and cut as the new layout needs, so steps 5-6 continue one
    process's run."""
    one, _ = llama_reference
    saved = tmp_path / "ckpt"
    first = _run(tmp_path / "a", cache, nproc=4, tp=4, pp=1, zero_stage=0, save=str(saved),
                 exit_interval=4, model="llama-test")
    assert first.stopped == "exit-interval" and first.final_step == 4
    rest = _run(tmp_path / "b", cache, nproc=2, tp=2, pp=1, zero_stage=1, load=str(saved),
                model="llama-test")
    assert rest.start_step == 4
    assert rest.losses == pytest.approx(one.losses[4:], rel=1e-5)


def test_the_compile_cache_is_kept_per_cpu_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's inductor cache mixes kernels of different CPU capabilities (a run with
    ATEN_CPU_CAPABILITY=avx2 after AVX-512 runs reached a NaN loss at step 1): mt keeps one
    per capability, and never overrides a cache folder the user chose."""
    import getpass
    import os
    import tempfile

    from mt_pretrain.engines.mt import compile_cache_per_capability

    default = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    capability = torch.backends.cpu.get_cpu_capability().lower()
    for before in (None, default):  # unset, or set by importing inductor
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        compile_cache_per_capability()
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(default, capability)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/mine")
    compile_cache_per_capability()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/mine"
