"""Against the reference implementation: checkpoints written by ``--to hf`` load into
``transformers.GPT2LMHeadModel`` with no missing/unexpected keys and the same logits, and
randomly initialised HF models saved with ``save_pretrained`` convert to mt exactly."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mt_formats import convert_checkpoint, load_model, save_model
from mt_model import GPT, preset

transformers = pytest.importorskip("transformers")

_LOAD_PROBLEMS = ("missing", "unexpected", "not initialized", "newly initialized",
                  "not used", "mismatch")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def _hf_messages() -> Iterator[list[str]]:
    """Every log record and Python warning transformers emits inside the block."""
    handler, logger = _Collect(), logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield handler.messages
        handler.messages.extend(str(w.message) for w in caught)
    finally:
        logger.removeHandler(handler)


def _problems(messages: list[str]) -> list[str]:
    return [m for m in messages if any(p in m.lower() for p in _LOAD_PROBLEMS)]


def _batch(vocab: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("gelu", ["none", "tanh"])
def test_convert_to_hf_loads_cleanly_with_same_logits(tmp_path: Path, gelu: str) -> None:
    model = GPT(preset("tiny").replace(gelu_approximate=gelu), seed=5).eval()
    save_model(model, tmp_path / "mt")
    convert_checkpoint(tmp_path / "mt", tmp_path / "hf", to="hf")
    with _hf_messages() as messages:
        hf, info = transformers.GPT2LMHeadModel.from_pretrained(
            tmp_path / "hf", output_loading_info=True)
    assert {key: bool(value) for key, value in info.items()} == {
        "missing_keys": False, "unexpected_keys": False, "mismatched_keys": False,
        "error_msgs": False}
    assert _problems(messages) == []
    assert hf.config.activation_function == ("gelu_new" if gelu == "tanh" else "gelu")
    hf.eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied
    idx = _batch(model.config.vocab_size, 48)
    with torch.no_grad():
        ours, theirs = model(idx), hf(idx).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("activation", "n_inner"), [("gelu_new", None), ("gelu", 96)])
def test_convert_from_hf_save_pretrained(tmp_path: Path, activation: str,
                                         n_inner: int | None) -> None:
    torch.manual_seed(0)  # HF's random init uses the global RNG
    config = transformers.GPT2Config(n_layer=3, n_embd=48, n_head=6, vocab_size=301,
                                     n_positions=40, n_inner=n_inner,
                                     activation_function=activation, layer_norm_epsilon=1e-6,
                                     bos_token_id=None, eos_token_id=None)
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "mt")  # detected as hf
    model = load_model(tmp_path / "mt").eval()
    assert (model.config.n_layers, model.config.hidden, model.config.ffn_hidden) == (
        3, 48, n_inner or 192)
    assert model.config.gelu_approximate == ("tanh" if activation == "gelu_new" else "none")
    idx = _batch(301, 40)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, atol=1e-4, rtol=0)
    # and back: the HF file we write holds exactly HF's tensors
    convert_checkpoint(tmp_path / "mt", tmp_path / "hf2", to="hf")
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf2")
    for name, tensor in hf.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_convert_hf_warning_capture_is_not_vacuous(tmp_path: Path) -> None:
    # Control for the test above: a file with a missing and an unexpected key is reported.
    save_model(GPT(preset("tiny"), seed=5), tmp_path / "hf", to="hf")
    path = tmp_path / "hf" / "model.safetensors"
    stored = load_file(str(path))
    del stored["transformer.h.0.ln_1.bias"]
    stored["transformer.extra"] = torch.ones(2)
    save_file(stored, str(path), metadata={"format": "pt"})
    with _hf_messages() as messages:
        _, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf",
                                                               output_loading_info=True)
    assert info["missing_keys"] == {"transformer.h.0.ln_1.bias"}
    assert info["unexpected_keys"] == {"transformer.extra"}
    assert _problems(messages) != []
