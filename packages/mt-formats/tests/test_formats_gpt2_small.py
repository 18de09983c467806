"""GPT-2-small shape (124M parameters, vocab 50257 not a multiple of anything): exact round
trips through the HF and TP 2 x PP 2 layouts, and logits against transformers. The model is built
and saved once per module to keep the suite fast."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mt_formats import convert_checkpoint, save_model
from mt_model import GPT, preset


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[GPT, Path]:
    model = GPT(preset("gpt2-small").replace(gelu_approximate="tanh"), seed=0).eval()
    root = tmp_path_factory.mktemp("gpt2_small")
    save_model(model, root / "full")
    convert_checkpoint(root / "full", root / "hf", to="hf")
    return model, root


def _same_files(a: Path, b: Path) -> bool:
    return all((a / name).read_bytes() == (b / name).read_bytes()
               for name in ("model.safetensors", "config.json"))


def test_convert_gpt2_small_round_trips_are_bit_identical(small: tuple[GPT, Path]) -> None:
    _, root = small
    convert_checkpoint(root / "hf", root / "from_hf")
    assert _same_files(root / "full", root / "from_hf")
    convert_checkpoint(root / "full", root / "tp2pp2", to="tp", tp=2, pp=2)
    convert_checkpoint(root / "tp2pp2", root / "from_tp2pp2")
    assert _same_files(root / "full", root / "from_tp2pp2")


def test_convert_gpt2_small_logits_match_transformers(small: tuple[GPT, Path]) -> None:
    transformers = pytest.importorskip("transformers")
    model, root = small
    hf, info = transformers.GPT2LMHeadModel.from_pretrained(root / "hf",
                                                            output_loading_info=True)
    assert not any(info.values())
    hf.eval()
    idx = torch.randint(0, 50257, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), atol=1e-4, rtol=0)
