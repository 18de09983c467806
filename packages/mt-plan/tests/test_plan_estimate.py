"""mt plan's estimator against published numbers: MT-NLG 530B and the ZeRO paper."""

import dataclasses
from pathlib import Path

import pytest

from mt_model import count_parameters, preset, tflops_per_gpu
from mt_plan.estimate import (
    EFFICIENCY,
    MTNLG_GPU,
    MTNLG_PUBLISHED,
    activation_bytes_per_layer,
    calibrate_efficiency,
    estimate,
    zero_bytes,
)
from mt_plan.gpus import GPUS, GPUSpec, GPUSpecError, load_gpu
from mt_plan.layout import LayoutError, ParallelLayout, enumerate_layouts
from mt_zero import paper_bytes

MTNLG = preset("mt-nlg-530b")
A100 = MTNLG_GPU  # MT-NLG's machine and kernels (scores stored)


def _mtnlg(dp: int) -> ParallelLayout:
    # Megatron's loss of the time: the logits, then the vocabulary-parallel cross entropy.
    return ParallelLayout(tp=8, pp=35, dp=dp, global_batch=1920, micro_batch=1, zero_stage=1,
                          chunked_loss=False)


def test_flops_formula_gives_published_tflops() -> None:
    for dp, seconds, published in MTNLG_PUBLISHED:
        got = tflops_per_gpu(MTNLG, 1920, seconds, 280 * dp)
        assert got == pytest.approx(published, rel=0.02), (dp, got, published)


def test_one_calibrated_constant_predicts_published_iteration_times() -> None:
    """Leave one out: the constant fitted to two of MT-NLG's published configurations
    predicts the third within 15% (the stored constant is the fit of all three)."""
    cases = [(_mtnlg(dp), seconds) for dp, seconds, _ in MTNLG_PUBLISHED]
    assert calibrate_efficiency(MTNLG, cases, A100) == pytest.approx(EFFICIENCY, rel=0.01)
    for held_out, (layout, seconds) in enumerate(cases):
        others = [case for i, case in enumerate(cases) if i != held_out]
        fitted = calibrate_efficiency(MTNLG, others, A100)
        est = estimate(MTNLG, layout, A100, fitted)
        assert est.iteration_time_s == pytest.approx(seconds, rel=0.15), (layout.dp, fitted)
    for layout, _ in cases:
        est = estimate(MTNLG, layout, A100)
        assert est.fits and 10 < est.memory_per_gpu_gb < 40
        assert est.efficiency == EFFICIENCY
    # More replicas: shorter iterations, larger bubble (fewer micro-batches per pipeline).
    times = [estimate(MTNLG, _mtnlg(dp), A100) for dp in (8, 12)]
    assert times[1].iteration_time_s < times[0].iteration_time_s
    assert times[1].bubble_fraction > times[0].bubble_fraction


def test_zero_paper_memory_figure() -> None:
    psi, n = 7.5e9, 64
    expected = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in expected.items():
        got = zero_bytes(psi, n, stage)["total"] / 1e9
        assert round(got, 1) == gb, (stage, got)
        assert got * 1e9 == pytest.approx(paper_bytes(int(psi), n, stage)["total"])
    with pytest.raises(LayoutError, match="ZeRO stage 4"):
        zero_bytes(psi, n, 4)


def test_korthikanti_activation_formulas() -> None:
    s, b, h, a, t = 2048, 1, 20480, 128, 8
    sbh = s * b * h
    full = activation_bytes_per_layer(MTNLG, b, t, False, "none")
    assert full == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert activation_bytes_per_layer(MTNLG, b, t, True, "none") == pytest.approx(
        sbh / t * (34 + 5 * a * s / h))
    # Selective: no attention term; the GeLU output (8 of the 24, sharded) and the two norm
    # outputs (4 of the replicated 10; sharded with SP) too.
    assert activation_bytes_per_layer(MTNLG, b, t, True, "selective") == pytest.approx(
        22 * sbh / t)
    assert activation_bytes_per_layer(MTNLG, b, t, False, "selective") == pytest.approx(
        sbh * (6 + 16 / t))
    assert activation_bytes_per_layer(MTNLG, b, t, False, "full") == 2 * sbh
    # fp32 doubles; SP + selective needs far less than no SP / no recompute.
    assert activation_bytes_per_layer(MTNLG, b, t, False, "none", "fp32") == 2 * full
    assert activation_bytes_per_layer(MTNLG, b, t, True, "selective") < full / 4.5


def test_memory_decides_fit_and_search_ranks() -> None:
    one_gpu = estimate(MTNLG, ParallelLayout(1, 1, 1, 8, 1), A100, simulate_pipeline=False)
    assert not one_gpu.fits and one_gpu.memory_per_gpu_gb > 8000
    layouts = list(enumerate_layouts(preset("gpt2-small"), 8, 64))
    assert {(lay.tp, lay.pp, lay.dp) for lay in layouts} >= {(1, 1, 8), (2, 2, 2), (4, 2, 1)}
    assert all(lay.world_size == 8 for lay in layouts)
    # Faster GPU, same layout: shorter iteration.
    lay = ParallelLayout(2, 2, 2, 64, 1, sequence_parallel=True)
    small = preset("gpt2-small")
    assert (estimate(small, lay, GPUS["h100-80gb"]).iteration_time_s
            < estimate(small, lay, A100).iteration_time_s)


def test_layout_errors_name_the_numbers() -> None:
    with pytest.raises(LayoutError, match="global batch size 10 is not divisible by "
                                          "micro-batch size 4 x dp 2 = 8"):
        ParallelLayout(1, 1, 2, 10, 4)
    with pytest.raises(LayoutError, match="recompute 'some'"):
        ParallelLayout(1, 1, 1, 8, recompute="some")
    with pytest.raises(LayoutError, match="n_layers 105 is not divisible by pp 4"):
        ParallelLayout(8, 4, 1, 8).check(MTNLG)
    with pytest.raises(LayoutError, match="tp 0"):
        ParallelLayout(0, 1, 1, 8)


def test_gpu_table_and_custom_yaml(tmp_path: Path) -> None:
    assert load_gpu("H200").memory_bytes == 141e9
    assert GPUS["a100-80gb"].peak_flops == 312e12
    spec = tmp_path / "mi300x.yaml"
    spec.write_text("peak_tflops: 1307\nmemory_gb: 192\nnvlink_gb_per_s: 448\n"
                    "ib_gb_per_s: 50\n")
    gpu = load_gpu(str(spec))
    assert (gpu.name, gpu.peak_flops, gpu.memory_bytes, gpu.gpus_per_node) == (
        "mi300x", 1307e12, 192e9, 8)
    spec.write_text("peak_tflops: 1307\nmemory_gb: -1\nnvlink_gb_per_s: 448\nib_gb_per_s: 50\n")
    with pytest.raises(GPUSpecError, match="memory_bytes -1"):
        load_gpu(str(spec))
    with pytest.raises(GPUSpecError, match="unknown GPU type 'b200'"):
        load_gpu("b200")


@pytest.mark.parametrize(("extra", "message"), [
    ("memory_gb: 40\n", "line 5: memory_gb is given twice; keep one"),
    ("gpus_per_node: 2.5\n", ": gpus_per_node must be an integer, got 2.5"),
    ("gpus_per_node: 010\n", "line 5: 010 is ambiguous: YAML 1.1 reads it as octal 8, YAML "
                              "1.2 as 10; write the number without the leading zero"),
    ("gpus_per_node: 1:30\n", "line 5: 1:30 is ambiguous: YAML 1.1 reads it as 90 (base 60), "
                               "YAML 1.2 as text; write the number in decimal"),
])
def test_gpu_yaml_refuses_what_yaml_reads_silently(tmp_path: Path, extra: str,
                                                   message: str) -> None:
    """PyYAML keeps the last of a key given twice, reads 2.5 GPUs a node as 2 (int), 010 as 8
    and 1:30 as 90: each is one error naming the file and the line or the key."""
    spec = tmp_path / "gpu.yaml"
    spec.write_text("peak_tflops: 100\nmemory_gb: 80\nnvlink_gb_per_s: 300\n"
                    "ib_gb_per_s: 25\n" + extra)
    with pytest.raises(GPUSpecError) as err:
        load_gpu(str(spec))
    assert str(err.value) == f"{spec}{' ' if message.startswith('line') else ''}{message}"
    spec.write_text("peak_tflops: 100\nmemory_gb: 80\nnvlink_gb_per_s: 300\n"
                    "ib_gb_per_s: 25\ngpus_per_node: 10\nname: '010'\n")
    assert (load_gpu(str(spec)).gpus_per_node, load_gpu(str(spec)).name) == (10, "010")


def test_gpu_yaml_numbers_are_finite_and_read_in_exponent_form(tmp_path: Path) -> None:
    """A GPU YAML's numbers are finite (.inf, or a number past the largest float once in
    bytes or FLOP/s, is refused in one line), and 1e3 is a number there as in mt pretrain's
    configs (PyYAML alone reads it as text)."""
    spec = tmp_path / "gpu.yaml"
    links = "nvlink_gb_per_s: 300\nib_gb_per_s: 25\n"
    spec.write_text("peak_tflops: .inf\nmemory_gb: 80\n" + links)
    with pytest.raises(GPUSpecError, match=r"gpu.yaml: peak_tflops must be a finite number, "
                                           r"got inf"):
        load_gpu(str(spec))
    spec.write_text("peak_tflops: 100\nmemory_gb: 1.0e+300\n" + links)  # 1e309 bytes
    with pytest.raises(GPUSpecError, match=r"memory_gb must be a finite number, got 1e\+300"):
        load_gpu(str(spec))
    spec.write_text("peak_tflops: 1" + "0" * 400 + "\nmemory_gb: 80\n" + links)
    with pytest.raises(GPUSpecError, match=r"peak_tflops must be a finite number, got 401 digits"):
        load_gpu(str(spec))  # too large for a float
    spec.write_text("peak_tflops: 1e3\nmemory_gb: 8E+1\n" + links)
    assert (load_gpu(str(spec)).peak_flops, load_gpu(str(spec)).memory_bytes) == (1e15, 80e9)


def test_calibrated_machine_costs_and_peak_phases() -> None:
    """A measured machine (CPU-like GPUSpec): fixed costs slow the estimate down, and the
    peak memory is the persistent states plus the largest short-lived phase."""
    small = preset("gpt2-small").replace(seq_len=128)
    lay = ParallelLayout(1, 1, 2, 4, 1, zero_stage=1, recompute="none", precision="fp32")
    cpu = GPUSpec("cpu", 50e9, 24 * 2**30, 1e9, 1e9, 2, 10e9, fused_attention=True)
    slow = dataclasses.replace(cpu, layer_overhead_s=1e-3, link_latency_s=1e-3,
                               tensor_overhead_s=1e-4)
    base, over = estimate(small, lay, cpu, 1.0), estimate(small, lay, slow, 1.0)
    # Two micro-batches per rank through 12 layers, 1 ms of fixed cost each, at least.
    assert over.iteration_time_s > base.iteration_time_s + 2 * 12 * 1e-3
    psi = base.parameters_per_gpu
    persistent = base.memory_weights_gb + base.memory_grads_gb + base.memory_optimizer_gb
    assert persistent * 1e9 == pytest.approx((4 + 4 + 8 / 2) * psi)  # fp32, Adam over dp 2
    # pp = 1 holds both uses of the tied embedding: two [V, h] gradients and their sum,
    # beyond the stored activations, and the loss's buffers: unchunked, three fp32 [s, V];
    # chunked, two fp32 chunks of logits (here the s tokens of the micro-batch: one chunk
    # holds up to 333 of GPT-2's vocabulary).
    v, h, s = small.vocab_size, small.hidden, small.seq_len
    assert base.memory_temporaries_gb * 1e9 == pytest.approx(3 * v * h * 4 + 2 * 4 * s * v)
    full = estimate(small, dataclasses.replace(lay, chunked_loss=False), cpu, 1.0)
    assert full.memory_temporaries_gb * 1e9 == pytest.approx(3 * v * h * 4 + 3 * 4 * s * v)
    long = preset("gpt2-small").replace(seq_len=2048)
    for chunked, loss in ((True, 2 * 4 * 333 * v), (False, 3 * 4 * 8 * 2048 * v)):
        big = ParallelLayout(1, 1, 1, 8, 8, recompute="full", precision="fp32",
                             chunked_loss=chunked)
        assert estimate(long, big, cpu, 1.0).memory_temporaries_gb * 1e9 == pytest.approx(
            3 * v * h * 4 + loss)
    # No dropout, fused attention: 32 sbh 16-bit bytes per layer (no masks, no scores).
    assert activation_bytes_per_layer(small, 1, 1, False, "none", "fp32",
                                      fused_attention=True, dropout_masks=False) == (
        2 * 32 * s * h)
    with pytest.raises(GPUSpecError, match="layer_overhead_s -1"):
        dataclasses.replace(cpu, layer_overhead_s=-1.0)


def test_framework_costs_add_per_step_micro_batch_and_tensor() -> None:
    """The calibrated framework costs: a fixed cost per step, one per micro-batch on each
    stage (through the schedule), one per parameter tensor of the fullest stage."""
    gpt = preset("tiny")
    cpu = GPUSpec("cpu", 50e9, 24 * 2**30, 1e9, 1e9, 2, 10e9, fused_attention=True)
    for lay in (ParallelLayout(1, 1, 2, 16, 4, recompute="none", precision="fp32"),
                ParallelLayout(1, 2, 1, 16, 4, recompute="none", precision="fp32")):
        base = estimate(gpt, lay, cpu, 1.0)
        assert base.framework_time_s == 0.0
        step = estimate(gpt, lay, dataclasses.replace(cpu, step_overhead_s=1e-3), 1.0)
        assert step.iteration_time_s == pytest.approx(base.iteration_time_s + 1e-3)
        tensors = 12 * gpt.n_layers // lay.pp + (5 if lay.pp == 1 else 3)  # embeddings, ln_f
        per = estimate(gpt, lay, dataclasses.replace(cpu, param_overhead_s=1e-5), 1.0)
        assert per.framework_time_s == pytest.approx(tensors * 1e-5)
        micro = estimate(gpt, lay, dataclasses.replace(cpu, micro_batch_overhead_s=1e-3), 1.0)
        # m micro-batches on one stage; through 2 stages the pipeline adds (p - 1) more.
        extra = (lay.num_micro_batches + lay.pp - 1) * 1e-3
        assert micro.iteration_time_s - base.iteration_time_s == pytest.approx(extra, rel=0.05)
    # The data-sheet GPUs have none, so the MT-NLG fit above is unchanged.
    assert estimate(MTNLG, _mtnlg(8), A100).framework_time_s == 0.0


def test_gloo_collectives_as_all_reduces_and_bucket_latency() -> None:
    """On gloo mt-zero runs ZeRO's reduce-scatter and all-gather as all-reduces (twice the
    bytes each), and a bucket-sized collective has a fixed cost of its own."""
    gpt = preset("tiny")
    lay = ParallelLayout(1, 1, 2, 16, 4, zero_stage=1, recompute="none", precision="fp32")
    cpu = GPUSpec("cpu", 50e9, 24 * 2**30, 1e9, 1e9, 2, 10e9, link_latency_s=1e-4,
                  fused_attention=True)
    grads = count_parameters(gpt) * 4.0  # one bucket: tiny is below 2**22 parameters
    small = 3 * 1e-4  # loss mean, gradient norm, loss broadcast
    ideal = estimate(gpt, lay, cpu, 1.0)
    # NCCL-like: all-reduce (2 (d-1)/d) + all-gather ((d-1)/d) = 1.5 x the bytes at d = 2.
    assert ideal.dp_comm_time_s == pytest.approx(1.5 * grads / 1e9 + 2 * 1e-4 + small)
    gloo = estimate(gpt, lay, dataclasses.replace(cpu, gather_via_all_reduce=True,
                                                  bulk_latency_s=2e-3), 1.0)
    assert gloo.dp_comm_time_s == pytest.approx(2.0 * grads / 1e9 + 2 * 2e-3 + small)


def test_llama_family_parameters_flops_and_activations() -> None:
    """The planner counts what mt builds for the Llama family too: per-stage parameters sum
    to mt_model's count (published Llama sizes included), the per-token forward FLOPs are 2x
    the block's weights, and the activation term follows GQA and SwiGLU (24 sbh for GPT-2)."""
    from mt_model import count_block_parameters, count_parameters, preset
    from mt_plan.estimate import (
        _layer_matmul_flops,
        _sharded_activation_units,
        _stage_params,
    )
    from mt_plan.layout import ParallelLayout

    one = ParallelLayout(1, 1, 1, 8, 1)
    for name in ("tiny", "gpt2-small", "llama-test", "llama-3.2-1b", "llama-3.1-8b"):
        gpt = preset(name)
        assert sum(_stage_params(gpt, one)) == count_parameters(gpt), name
        h, kv = gpt.hidden, gpt.n_kv_heads * gpt.head_dim
        norms = 2 * h * (2 if gpt.norm == "layernorm" and gpt.bias else 1)
        fc = gpt.ffn_hidden * (2 if gpt.mlp == "swiglu" else 1)
        biases = (h + 2 * kv) + h + fc + h if gpt.bias else 0  # qkv, proj, fc, proj
        assert count_block_parameters(gpt) == norms + biases + _layer_matmul_flops(gpt) / 2, (
            name)
    assert _sharded_activation_units(preset("gpt2-small"), 1) == 24.0
    llama = preset("llama-3.1-8b")  # kv = h / 4, f = 3.5 h: 4 + 1 + 28
    assert _sharded_activation_units(llama, 8) == pytest.approx(4 + 1 + 8 * 14336 / 4096)
    # Pipeline stages of an untied model: the head on the last, the embedding on the first.
    two = ParallelLayout(1, 2, 1, 8, 1)
    small = preset("llama-test")
    assert sum(_stage_params(small, two)) == count_parameters(small)


def test_the_loss_chunks_are_mt_tensor_parallels() -> None:
    """The planner counts the chunked loss's chunks as mt-tensor-parallel cuts them (its own
    copy of the rule: importing it would bring torch into `mt plan`'s start)."""
    from mt_plan.estimate import LOSS_CHUNK_BYTES, loss_chunk_tokens
    from mt_tensor_parallel.loss import CHUNK_BYTES, chunk_tokens

    assert LOSS_CHUNK_BYTES == CHUNK_BYTES
    for vocab in (1, 1000, 25216, 50257, 50304, 128256, 2**25):
        assert loss_chunk_tokens(vocab) == chunk_tokens(vocab), vocab


def test_fp32_main_gradients_memory_and_traffic() -> None:
    """bf16 with main gradients: 4 bytes of gradient per parameter instead of 2; ZeRO 2-3
    hold them whole while micro-batches accumulate; the DP reduction moves them in fp32."""
    gpt = preset("gpt2-small")
    psi = count_parameters(gpt)
    gpu = GPUS["a100-80gb"]
    for stage, micro in ((1, 1), (2, 1), (2, 4)):
        # global batch 8 on dp 2: one micro-batch of 4, or four of 1, per rank
        lay = ParallelLayout(1, 1, 2, 8, micro, zero_stage=stage, precision="bf16")
        main, half = (estimate(gpt, dataclasses.replace(lay, main_grads=m), gpu)
                      for m in (True, False))
        shard = 2 if stage >= 2 and lay.num_micro_batches == 1 else 1
        assert main.memory_grads_gb * 1e9 == pytest.approx(4 * psi / shard)
        assert half.memory_grads_gb * 1e9 == pytest.approx(2 * psi / shard)
        assert main.memory_per_gpu_gb - half.memory_per_gpu_gb == pytest.approx(
            2 * psi / shard / 1e9)
        assert main.dp_comm_time_s > half.dp_comm_time_s
    assert zero_bytes(psi, 4, 2, "bf16", main_grads=True)["grads"] == pytest.approx(
        paper_bytes(psi, 4, 2, grad_bytes=4)["grads"])


def test_context_parallelism_divides_activations_and_times_its_exchange() -> None:
    """CP: each rank's activations are those of s / cp tokens, plus the whole sequence's
    gathered keys and values ((cp - 1) 4kv/h sbh/cp more); its matmuls and attention a 1 / cp
    share; the key/value exchange timed (forward all-gather, backward reduce-scatter, once
    more under full recomputation); model states sharded over dp x cp by ZeRO."""
    gpt = preset("llama-3.1-8b").replace(seq_len=32768)
    h, kv = gpt.hidden, gpt.n_kv_heads * gpt.head_dim
    one = activation_bytes_per_layer(gpt, 1, 8, True, "none", fused_attention=True)
    for cp in (2, 4, 8):
        got = activation_bytes_per_layer(gpt, 1, 8, True, "none", fused_attention=True, cp=cp)
        sbh = gpt.seq_len // cp * h
        assert got == pytest.approx(one / cp + (cp - 1) * 4 * kv / h * sbh / 8)
        # Full recomputation keeps only each layer's input slice.
        assert activation_bytes_per_layer(gpt, 1, 8, True, "full", cp=cp) == pytest.approx(
            activation_bytes_per_layer(gpt, 1, 8, True, "full") / cp)
    gpu = GPUS["h100-80gb"]
    base = ParallelLayout(8, 1, 1, 8, 1, zero_stage=1, sequence_parallel=True, recompute="full")
    alone, split = (estimate(gpt, dataclasses.replace(base, cp=cp), gpu) for cp in (1, 4))
    assert alone.cp_comm_time_s == 0 < split.cp_comm_time_s < split.pipeline_time_s
    assert split.layout.world_size == 32
    assert split.memory_activations_gb < alone.memory_activations_gb / 3.5
    assert split.memory_optimizer_gb == pytest.approx(alone.memory_optimizer_gb / 4)
    assert split.pipeline_time_s < alone.pipeline_time_s / 3
    assert split.tokens_per_s > alone.tokens_per_s
    with pytest.raises(LayoutError, match="seq_len 32768 / cp 4 = 8192 is not divisible by "
                                          "tp 3"):
        ParallelLayout(3, 1, 1, 8, cp=4, sequence_parallel=True).check(
            gpt.replace(n_heads=48, n_kv_heads=48, hidden=48 * 128))
    with pytest.raises(LayoutError, match="seq_len 100 is not divisible by 2 x cp 4 = 8"):
        ParallelLayout(1, 1, 1, 8, cp=4).check(preset("tiny").replace(seq_len=100))
