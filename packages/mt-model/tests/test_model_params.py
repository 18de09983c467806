"""Analytic parameter counts and the MT-NLG FLOPs formula against published numbers."""

from __future__ import annotations

import pytest
import torch

from mt_model import (
    GPT,
    PRESETS,
    count_parameters,
    model_flops_per_iteration,
    model_flops_per_token_training,
    preset,
    tflops_per_gpu,
)


def test_analytic_count_matches_built_models() -> None:
    for cfg in (preset("tiny"), preset("tiny").replace(ffn_hidden=100, n_layers=3)):
        model = GPT(cfg, seed=None)
        assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg)


def test_gpt2_small_has_the_known_parameter_count() -> None:
    # HF GPT2LMHeadModel("gpt2") has 124,439,808 parameters (tied head).
    assert count_parameters(preset("gpt2-small")) == 124_439_808


@pytest.mark.parametrize("name", ["gpt2-xl", "8.3b", "mt-nlg-530b"])
def test_presets_build_on_meta_with_the_analytic_count(name: str) -> None:
    """Built on the meta device: no storage anywhere (so no init runs and nothing is
    allocated, whatever the size), the parameter count the analytic formula gives."""
    cfg = PRESETS[name]
    with torch.device("meta"):
        model = GPT(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg)


def test_mt_nlg_530b_has_529_6_billion_parameters() -> None:
    count = count_parameters(preset("mt-nlg-530b"))
    assert count == pytest.approx(529.6e9, rel=1e-3)


@pytest.mark.parametrize(
    ("gpus", "iteration_seconds", "published_tflops"),
    [(2240, 60.1, 126.0), (2800, 50.2, 121.0), (3360, 44.4, 113.0)],
)
def test_flops_formula_reproduces_mt_nlg_throughput(
    gpus: int, iteration_seconds: float, published_tflops: float
) -> None:
    cfg = preset("mt-nlg-530b")
    achieved = tflops_per_gpu(cfg, 1920, iteration_seconds, gpus)
    assert achieved == pytest.approx(published_tflops, rel=0.02)
    direct = model_flops_per_iteration(cfg, 1920) / (iteration_seconds * gpus) / 1e12
    assert achieved == pytest.approx(direct, rel=1e-12)


def test_flops_formula_terms() -> None:
    cfg = preset("tiny")
    b, s, n_layers, h, v = 8, 32, cfg.n_layers, cfg.hidden, cfg.vocab_size
    expected = 96 * b * s * n_layers * h**2 * (1 + s / (6 * h) + v / (16 * n_layers * h))
    assert model_flops_per_iteration(cfg, b, seq_len=s) == pytest.approx(expected, rel=1e-12)
    assert model_flops_per_iteration(cfg, 2) == pytest.approx(
        2 * model_flops_per_iteration(cfg, 1), rel=1e-12
    )
    with pytest.raises(ValueError, match="global_batch"):
        model_flops_per_iteration(cfg, 0)
    with pytest.raises(ValueError, match="n_gpus=0"):
        tflops_per_gpu(cfg, 1, 1.0, 0)


def test_per_token_flops_is_close_to_the_recompute_free_formula() -> None:
    """Without recompute the iteration formula's 96 becomes 72 (3 passes instead of 4);
    6N + 12lhs is the same quantity counted from parameters, within a few percent."""
    cfg = preset("mt-nlg-530b")
    tokens = 1920 * cfg.seq_len
    no_recompute = model_flops_per_iteration(cfg, 1920) * 72 / 96
    per_token = model_flops_per_token_training(cfg)
    assert per_token == pytest.approx(6 * count_parameters(cfg) + 12 * 105 * 20480 * 2048)
    assert per_token * tokens == pytest.approx(no_recompute, rel=0.03)


def test_parameter_stages_of_every_gpt_parameter() -> None:
    """Where each parameter of a 4-layer GPT lives on 2 stages, and on 2 interleaved stages
    holding blocks {0, 2} and {1, 3}: blocks with their block, the embedding first, the
    final norm last, the tied token embedding on both ends."""
    from mt_model import GPT, TIED_WEIGHT, parameter_stages, preset

    names = [n for n, _ in GPT(preset("tiny")).named_parameters()]
    assert TIED_WEIGHT in names
    for layers in ([range(0, 2), range(2, 4)], [{0, 2}, {1, 3}]):
        where = {n: parameter_stages(n, layers) for n in names}
        assert where[TIED_WEIGHT] == [0, 1] and where["embed.positions.weight"] == [0]
        assert where["ln_f.weight"] == [1]
        for n, stages in where.items():
            if n.startswith("blocks."):
                block = int(n.split(".")[1])
                assert stages == [s for s, held in enumerate(layers) if block in held], n
    assert parameter_stages(TIED_WEIGHT, [range(0, 4)]) == [0]  # one stage holds it once
