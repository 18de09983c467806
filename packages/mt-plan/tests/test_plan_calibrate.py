"""`mt plan --calibrate`'s measurements, their YAML, and the estimator against measured runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mt_model import preset
from mt_plan import GPUS, GPUSpecError, ParallelLayout, attention_flops, estimate, load_gpu
from mt_plan.calibrate import block_linear_shapes, calibrated, measure, write_calibration

#: One H200, torch 2.11, bf16, GPT `1.3b`, micro-batch 8 x 2048, dropout 0, fused AdamW
#: (../shared/notes/gpu-h200.md, issue #17): tokens/s (median of steps 5-14) and
#: torch.cuda.max_memory_allocated in bytes, without and with full recomputation.
H200_RUNS = {"none": (57_300, 53.2 * 2**30), "full": (47_700, 30.7 * 2**30)}


def test_h200_runs_from_the_data_sheet() -> None:
    """Data-sheet planning (MT-NLG's efficiency, flash attention's causal FLOPs and stored
    bytes) is within 10% of the measured peak memory and 15% of the measured speed."""
    gpt = preset("1.3b")
    for recompute, (tokens_per_s, peak_bytes) in H200_RUNS.items():
        # Measured before the chunked loss and fp32 main gradients existed: the logits, then
        # the loss; bf16 gradients.
        layout = ParallelLayout(1, 1, 1, 8, 8, recompute=recompute, chunked_loss=False,
                                main_grads=False)
        est = estimate(gpt, layout, GPUS["h200"])
        assert est.memory_per_gpu_gb * 1e9 == pytest.approx(peak_bytes, rel=0.10), recompute
        assert est.tokens_per_s == pytest.approx(tokens_per_s, rel=0.15), recompute
        # Storing the s x s scores (an unfused kernel) would not fit the measurement.
        unfused = estimate(gpt, layout, dataclasses.replace(GPUS["h200"],
                                                            fused_attention=False))
        if recompute == "none":
            assert unfused.memory_per_gpu_gb * 1e9 > 1.3 * peak_bytes


def test_attention_flops_of_a_causal_fused_kernel() -> None:
    gpt = preset("gpt2-small")
    full = 4.0 * 2 * gpt.seq_len**2 * gpt.hidden
    assert attention_flops(gpt, 2, fused=False) == (full, 2 * full)
    assert attention_flops(gpt, 2, fused=True) == (full / 2, 1.25 * full)


def test_block_linear_shapes_cover_the_matmul_parameters() -> None:
    from mt_model import block_matmul_parameters

    for name in ("gpt2-small", "llama-test"):
        gpt = preset(name)
        shapes = block_linear_shapes(gpt, 1)
        per_layer = sum(i * o for i, o, uses in shapes if uses == gpt.n_layers)
        assert per_layer == block_matmul_parameters(gpt)
        assert shapes[-1] == (gpt.hidden, gpt.vocab_size, 1)
        # Tensor parallelism splits each matmul's work over the ranks.
        assert sum(i * o for i, o, _ in block_linear_shapes(gpt, 2)) * 2 == pytest.approx(
            sum(i * o for i, o, _ in shapes), rel=1e-3)


def test_measured_rates_drive_the_estimate(tmp_path: Path) -> None:
    gpt = preset("tiny")
    rates = measure(gpt, micro_batch=2, precision="fp32", device="cpu", repeats=3)
    assert set(rates) == {"gemm_fwd_tflops", "gemm_bwd_tflops", "attention_fwd_tflops",
                          "attention_bwd_tflops", "memory_bandwidth_gb_per_s",
                          "optimizer_gparams_per_s"}
    assert all(v > 0 for v in rates.values()), rates
    spec = calibrated(GPUS["a100-80gb"], rates, "this cpu")
    assert spec.calibrated and not GPUS["a100-80gb"].calibrated
    layout = ParallelLayout(1, 1, 1, 4, 2, recompute="none", precision="fp32")
    est = estimate(gpt, layout, spec)
    assert est.calibrated and est.gpu == "this cpu"
    # The rates, not efficiency x peak, set the time: the efficiency no longer matters,
    # and matmuls twice as fast shorten the step.
    assert estimate(gpt, layout, spec, 0.1).iteration_time_s == est.iteration_time_s
    fast = dataclasses.replace(spec, gemm_fwd_flops=2 * spec.gemm_fwd_flops,
                               gemm_bwd_flops=2 * spec.gemm_bwd_flops)
    assert estimate(gpt, layout, fast).iteration_time_s < est.iteration_time_s
    # Stored and read back as the same description.
    path = tmp_path / "cal" / "cpu.yaml"
    write_calibration(path, spec, rates, {"device": "cpu", "model": "tiny"})
    back = load_gpu(str(path))
    for field in ("peak_flops", "memory_bytes", "gemm_fwd_flops", "attention_bwd_flops",
                  "memory_bytes_per_s", "optimizer_params_per_s"):
        assert getattr(back, field) == pytest.approx(getattr(spec, field), rel=1e-3), field
    assert back.name == "this cpu" and back.fused_attention
    assert [p.name for p in path.parent.iterdir()] == ["cpu.yaml"]  # no temporary left


def test_calibration_yaml_errors_name_the_key(tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text("peak_tflops: 10\nmemory_gb: 1\nnvlink_gb_per_s: 1\nib_gb_per_s: 1\n"
                    "fused_attention: 'yes'\n")
    with pytest.raises(GPUSpecError, match="fused_attention must be true or false"):
        load_gpu(str(spec))
    spec.write_text("peak_tflops: 10\nmemory_gb: 1\nnvlink_gb_per_s: 1\nib_gb_per_s: 1\n"
                    "gemm_fwd_tflops: -2\n")
    with pytest.raises(GPUSpecError, match="gemm_fwd_flops -2"):
        load_gpu(str(spec))
