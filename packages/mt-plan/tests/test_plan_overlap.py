"""mt plan's overlap model (mt_plan.estimate.dp_overlap): which data-parallel communication
compute hides as mt-zero runs it, and what every layout's exposed communication adds up to."""

from __future__ import annotations

import dataclasses

import pytest

from mt_model import count_parameters, preset
from mt_plan.estimate import EFFICIENCY, Zero3Units, dp_overlap, estimate
from mt_plan.gpus import GPUS
from mt_plan.layout import ParallelLayout


def _layout(**kw: object) -> ParallelLayout:
    base = {"tp": 1, "pp": 1, "dp": 2, "global_batch": 16, "micro_batch": 2, "zero_stage": 1}
    return ParallelLayout(**{**base, **kw})  # type: ignore[arg-type]


def test_buckets_reduce_under_the_last_backward() -> None:
    lay = _layout()  # ZeRO 1: 4 buckets of 0.1 s gradients, 0.2 s weight gather, 0.01 small
    # A long backward hides every bucket but the last; the weight gather is exposed.
    assert dp_overlap(lay, 0.4, 0.2, 0.01, 4, 1.0, 2.0) == pytest.approx((0.31, 0.3))
    # No backward to hide under: all of it.
    assert dp_overlap(lay, 0.4, 0.2, 0.01, 4, 0.0, 0.0) == pytest.approx((0.61, 0.0))
    # Buckets slower than the backward: they queue; what is left after it ends is exposed.
    exposed, hidden = dp_overlap(lay, 0.4, 0.0, 0.0, 4, 0.1, 0.2)
    assert exposed == pytest.approx(0.4 + 0.05 - 0.2) and hidden == pytest.approx(0.15)
    # Finer buckets hide more of the same bytes.
    assert dp_overlap(lay, 0.4, 0.0, 0.0, 16, 0.1, 0.2)[0] < exposed


def test_nothing_hides_with_pipelines_or_one_replica() -> None:
    assert dp_overlap(_layout(pp=2), 0.4, 0.2, 0.01, 4, 1.0, 2.0) == pytest.approx((0.61, 0))
    assert dp_overlap(_layout(dp=1), 0.0, 0.0, 0.01, 4, 1.0, 2.0) == pytest.approx((0.01, 0))


def test_zero3_prefetches_each_unit_under_the_one_before() -> None:
    lay = _layout(zero_stage=3)  # 4 micro-batches of 2: 8 gathers per unit and step
    m = lay.num_micro_batches
    units, gather, reduce = 5, 0.01, 0.02
    weights, grads = 2 * m * units * gather, units * reduce
    # Compute longer than any unit's collectives: the first gather of every pass and the
    # last unit's reduce-scatter are exposed, the rest hidden.
    exposed, hidden = dp_overlap(lay, grads, weights, 0.0, units, 1.0, 2.0)
    assert exposed == pytest.approx(2 * m * gather + reduce)
    assert exposed + hidden == pytest.approx(weights + grads)
    # No compute: everything exposed.
    assert dp_overlap(lay, grads, weights, 0.0, units, 0.0, 0.0)[0] == pytest.approx(
        weights + grads)


def test_exposed_communication_of_an_estimate() -> None:
    gpt = preset("gpt2-small")
    for lay in (_layout(), _layout(zero_stage=3), _layout(tp=2, sequence_parallel=True),
                _layout(pp=2, dp=1)):
        est = estimate(gpt, lay, GPUS["a100-80gb"])
        parts = (est.tp_comm_time_s - est.tp_hidden_s + est.cp_comm_time_s + est.p2p_time_s
                 + est.dp_exposed_s)
        if lay.pp == 1:  # no pipeline sends, no tied embedding across stages
            assert est.exposed_comm_s == pytest.approx(parts), lay
        else:  # and the tied embedding's sum over the first and last stage
            assert est.exposed_comm_s > parts, lay
        assert 0 <= est.dp_exposed_s <= est.dp_comm_time_s
        assert est.hidden_comm_s == pytest.approx(est.dp_comm_time_s - est.dp_exposed_s
                                                  + est.tp_hidden_s)
        assert (est.tp_hidden_s > 0) == (lay.tp > 1)
        assert est.iteration_time_s == pytest.approx(
            est.pipeline_time_s + est.dp_exposed_s + est.optimizer_time_s
            + est.framework_time_s)
    dp = estimate(gpt, _layout(), GPUS["a100-80gb"])
    assert dp.hidden_comm_s > 0  # the gradient buckets under the backward
    assert dp.exposed_comm_s < dp.dp_comm_time_s


def test_tp_collectives_counted_as_mt_runs_them() -> None:
    """Per micro-batch and layer, two all-reduces in forward and two in backward; with
    sequence parallelism an all-gather and a reduce-scatter in place of each (twice the
    fixed costs for the same bytes), and in backward the two column layers' inputs gathered
    again. Around the layers: the embedding's sum (and with SP its backward), the head's
    input (backward; with SP also forward), the loss's two small all-reduces. The trace of
    a TP 4 + SP run counts 10 per layer + 6 per micro-batch (benchmarks/comm.py: 186 per
    step for 4 layers x 4 micro-batches, with the step's own)."""
    gpt = preset("gpt2-small")  # 12 layers
    latency = 1e-3
    gpu = dataclasses.replace(GPUS["a100-80gb"], nvlink_bytes_per_s=1e30, ib_bytes_per_s=1e30,
                              link_latency_s=latency, bulk_latency_s=latency)
    m = 4
    for sp, per_micro in ((False, 12 * 4 + 4), (True, 12 * 10 + 6)):
        lay = ParallelLayout(tp=2, pp=1, dp=1, global_batch=2 * m, micro_batch=2,
                             sequence_parallel=sp, recompute="none")
        assert estimate(gpt, lay, gpu).tp_comm_time_s == pytest.approx(
            m * per_micro * latency, rel=1e-6), sp


def test_collectives_under_compute_progress_at_the_given_rate() -> None:
    """gloo shares the cores with the compute: a collective under it moves at a share of
    its speed alone (GPUSpec.comm_rate_under_compute; 1 = a GPU's engines, the default)."""
    lay = _layout()  # 4 buckets of 0.1 s, ready every 0.5 s of a 2 s backward
    assert dp_overlap(lay, 0.4, 0.2, 0.01, 4, 1.0, 2.0, rate=0.25) == pytest.approx(
        dp_overlap(lay, 0.4, 0.2, 0.01, 4, 1.0, 2.0))  # still all hidden but the last
    # At a tenth of its speed the first bucket ends at 1.5 s, the second has 0.05 s left
    # when the backward ends, the last two follow at full speed: 0.25 s beyond it.
    exposed, hidden = dp_overlap(lay, 0.4, 0.2, 0.01, 4, 1.0, 2.0, rate=0.1)
    assert exposed == pytest.approx(0.25 + 0.2 + 0.01) and hidden == pytest.approx(0.15)
    z3 = _layout(zero_stage=3)  # 4 micro-batches; 5 units: 0.2 s forward, 0.4 s backward
    m, units, gather = z3.num_micro_batches, 5, 0.01
    weights = 2 * m * units * gather
    # A unit's forward covers 0.2 x 0.01 = 0.002 s of a gather, its backward 0.004 s.
    exposed = dp_overlap(z3, 0.0, weights, 0.0, units, 1.0, 2.0, rate=0.01)[0]
    assert exposed == pytest.approx(m * (gather + 4 * 0.008) + m * (gather + 4 * 0.006))


def test_zero3_rest_and_first_layer_are_exposed() -> None:
    """mt-zero gathers a pass's rest unit (embedding, head) first and the first layer right
    after its short compute: both exposed; the other layers hide under the layer before.
    The last backward reduces each unit as its backward ends: the first layer's reduction
    and then the rest's (its embedding's backward as short) are exposed whole, each at its
    own size."""
    lay = _layout(zero_stage=3)
    m, units = lay.num_micro_batches, 5  # 4 layers and the rest
    first, layer, layer_reduce, rest_reduce = 0.03, 0.01, 0.01, 0.027
    weights, grads = 2 * m * (first + 3 * layer), 4 * layer_reduce + rest_reduce
    exposed, hidden = dp_overlap(lay, grads, weights, 0.0, units, 1.0, 2.0,
                                 units=Zero3Units(first, layer, layer_reduce, rest_reduce))
    assert exposed == pytest.approx(2 * m * first + layer_reduce + rest_reduce)
    assert exposed + hidden == pytest.approx(weights + grads)


def test_zero3_gathers_at_their_own_bandwidth() -> None:
    """GPUSpec.gather_bytes_per_s: ZeRO-3's per-unit gathers move at their own measured rate
    (gloo on CPU: a few MB at about half the rate of the buckets' tens of MB); 0 keeps the
    link's. Without fixed costs, halving it adds the weights' gather seconds once more and
    leaves the gradients' reduction as it was."""
    gpt = preset("gpt2-small")
    lay = ParallelLayout(tp=1, pp=1, dp=4, global_batch=32, micro_batch=2, zero_stage=3,
                         recompute="none", precision="bf16")
    base = dataclasses.replace(GPUS["a100-80gb"], link_latency_s=0.0, bulk_latency_s=0.0)
    link = base.nvlink_bytes_per_s
    default = estimate(gpt, lay, base)
    same = estimate(gpt, lay, dataclasses.replace(base, gather_bytes_per_s=link))
    half = estimate(gpt, lay, dataclasses.replace(base, gather_bytes_per_s=link / 2))
    assert same.dp_comm_time_s == pytest.approx(default.dp_comm_time_s, rel=1e-12)
    assert same.exposed_comm_s == pytest.approx(default.exposed_comm_s, rel=1e-12)
    gathers = 2 * lay.num_micro_batches  # every micro-batch's forward and backward
    weights = count_parameters(gpt) * 2 * gathers * 3 / 4 / link  # bf16 bytes, (d-1)/d
    assert half.dp_comm_time_s - default.dp_comm_time_s == pytest.approx(weights, rel=1e-9)
    assert half.exposed_comm_s > default.exposed_comm_s


def test_zero3_units_pay_the_in_step_fixed_cost() -> None:
    """GPUSpec.stepped_latency_s: ZeRO-3's per-unit gathers and reductions, which the ranks
    reach back to back, pay it instead of the small message's and the bucket's fixed costs
    (calibrated after compute, the ranks' skew in them); 0 keeps the small message's.
    Every unit, 2 gathers per micro-batch and 1 reduction."""
    gpt = preset("gpt2-small")
    lay = ParallelLayout(tp=1, pp=1, dp=4, global_batch=32, micro_batch=2, zero_stage=3,
                         recompute="none", precision="bf16")
    base = dataclasses.replace(GPUS["a100-80gb"], link_latency_s=2e-3, bulk_latency_s=5e-3)
    default = estimate(gpt, lay, base)
    stepped = estimate(gpt, lay, dataclasses.replace(base, stepped_latency_s=1e-4))
    same = estimate(gpt, lay, dataclasses.replace(base, stepped_latency_s=2e-3))
    assert same.dp_comm_time_s == pytest.approx(default.dp_comm_time_s, rel=1e-12)
    units = gpt.n_layers + 1  # the layers and the rest
    collectives = (2 * lay.num_micro_batches + 1) * units
    assert default.dp_comm_time_s - stepped.dp_comm_time_s == pytest.approx(
        collectives * (2e-3 - 1e-4), rel=1e-9)


def test_column_layers_input_gradients_reduce_under_their_weight_gradients() -> None:
    """Per micro-batch and layer, the backward's collectives of the two column-parallel
    layers' input gradients (qkv, the MLP's first) run under those layers' weight-gradient
    GEMMs, and with sequence parallelism the gathers of their inputs under the input
    gradients' GEMMs (as long): hidden up to what the GEMM covers at the rate a collective
    moves under compute, the pass's other collectives exposed."""
    gpt = preset("gpt2-small")  # 12 layers, hidden 768, MLP 3072, no grouped heads
    m, b, t = 4, 2, 2
    for sp in (False, True):
        lay = ParallelLayout(tp=t, pp=1, dp=1, global_batch=b * m, micro_batch=b,
                             sequence_parallel=sp, recompute="none")
        fast = dataclasses.replace(GPUS["a100-80gb"], nvlink_bytes_per_s=1e30,
                                   ib_bytes_per_s=1e30, link_latency_s=1e-9)
        # Collectives shorter than any GEMM: both hidden whole, 2 of every backward's.
        est = estimate(gpt, lay, fast)
        assert est.tp_hidden_s == pytest.approx(m * 12 * 2 * (1 + sp) * 1e-9, rel=1e-6), sp
        # Collectives longer than the GEMMs: hidden for the GEMMs' time, at the rate.
        for rate in (1.0, 0.25):
            slow = dataclasses.replace(fast, link_latency_s=1.0, comm_rate_under_compute=rate)
            backward = slow.rates(EFFICIENCY)[1] * t
            wgrad = 2.0 * b * gpt.seq_len * gpt.hidden * (3 * gpt.hidden + 4 * gpt.hidden)
            est = estimate(gpt, lay, slow)
            assert est.tp_hidden_s == pytest.approx(
                m * 12 * (1 + sp) * wgrad / backward * rate), sp
            assert est.exposed_comm_s == pytest.approx(  # and the step's small ones
                est.tp_comm_time_s - est.tp_hidden_s + est.dp_exposed_s)
