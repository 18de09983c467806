"""Cross-app: a GPT-2 saved by transformers with its defaults (``gelu_new``, initializer
0.02, 1024 positions, the 50257-token vocabulary) -> ``mt convert --to pretrain`` -> ``mt
pretrain --load`` continues pretraining at ``--seq-len 128``, with the architecture taken
from the checkpoint (no --model needed, and none of those defaults can block the load).

- One process: the first step's loss equals the loss transformers computes on the same
  global batch of the run's data (measured ~1e-7 relative; asserted 1e-5), then it falls.
- TP 2 x PP 2: the same losses as one process (fp32 round-off; asserted 1e-5).
- Flags that would change the checkpoint's model are refused, naming the fields.
The converted folder also reads back bit-identical to the HF weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from mt_convert.cli import app
from mt_data import DataLoaderState
from mt_formats import load_state_dict
from mt_pretrain.config.load import load_config
from mt_pretrain.config.resolve import resolve
from mt_pretrain.config.schema import ConfigError
from mt_pretrain.data.inputs import ensure_data, make_loaders, to_batch
from mt_pretrain.launch import launch

transformers = pytest.importorskip("transformers")

SEQ, STEPS = 128, 4


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A small random GPT2LMHeadModel with transformers' defaults but for its size, saved
    with save_pretrained and converted to a step-0 mt pretrain checkpoint."""
    root = tmp_path_factory.mktemp("hf")
    config = transformers.GPT2Config(n_embd=64, n_layer=4, n_head=4, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    assert (config.activation_function, config.initializer_range, config.n_positions,
            config.vocab_size) == ("gelu_new", 0.02, 1024, 50257)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(root / "hf")
    result = CliRunner().invoke(app, [str(root / "hf"), str(root / "ckpt"), "--to", "pretrain"])
    assert result.exit_code == 0, result.output
    gpt, back = load_state_dict(root / "ckpt")
    _, original = load_state_dict(root / "hf")
    assert (gpt.gelu_approximate, gpt.init_std, gpt.seq_len) == ("tanh", 0.02, 1024)
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    return root, model


def _config(root: Path, name: str, **options: Any) -> Any:
    return load_config(None, {
        "seq_len": SEQ, "micro_batch_size": 2, "global_batch_size": 4, "train_steps": STEPS,
        "eval_interval": 0, "sample_tokens": 0, "progress": False, "log_interval": 100,
        "timeout": 300.0, "save": "none", "load": str(root / "ckpt"),
        "out_dir": str(root / name), "cache_dir": str(root / "cache"), **options})


def _launch(config: Any) -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return launch(config, environ={}, timeout=600)
    finally:
        torch.set_num_threads(threads)


def test_hf_gpt2_defaults_continue_pretraining(converted: tuple[Path, Any]) -> None:
    root, hf = converted
    one_config = _config(root, "one", nproc=1, tp=1, pp=1, zero_stage=0)
    plan = resolve(one_config, 1)
    assert plan.gpt.seq_len == SEQ and plan.model.seq_len == 1024  # trains on 128 of 1024
    assert plan.model.gelu_approximate == "tanh" and plan.model.vocab_size == 50257
    one = _launch(one_config)
    assert len(one.losses) == STEPS

    # The run's first global batch, from its own (fresh) data loader: GPT-2 BPE ids.
    paths = ensure_data(one_config.data, plan.gpt.vocab_size, root / "cache")
    loader, _ = make_loaders(one_config.data, one_config.train, plan, paths, 0,
                             DataLoaderState())
    batch = to_batch(loader.next())
    with torch.no_grad():
        logits = hf(batch[:, :-1]).logits
    hf_loss = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                    batch[:, 1:].reshape(-1)))
    assert one.losses[0] == pytest.approx(hf_loss, rel=1e-5)
    assert one.losses[-1] < one.losses[0]  # training goes on from it

    three_d = _launch(_config(root, "tp2pp2", nproc=4, tp=2, pp=2, zero_stage=1))
    assert three_d.losses == pytest.approx(one.losses, rel=1e-5)


@pytest.mark.parametrize("options, words", [
    ({"n_layers": 2}, ["--n-layers 2 but the checkpoint has 4"]),
    ({"model": "gpt2-small"}, ["--model gpt2-small has n_layers 12, the checkpoint 4",
                               "hidden 768, the checkpoint 64"]),
    ({"seq_len": 2048}, ["--seq-len 2048 exceeds the checkpoint's 1024 positions"]),
])
def test_flags_that_change_the_checkpoint_model_are_refused(
        converted: tuple[Path, Any], options: dict[str, Any], words: list[str]) -> None:
    root, _ = converted
    with pytest.raises(ConfigError) as err:
        resolve(_config(root, "refused", nproc=1, tp=1, pp=1, **options), 1)
    for word in words:
        assert word in str(err.value)
