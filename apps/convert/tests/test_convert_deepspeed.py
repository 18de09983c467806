"""DeepSpeed universal checkpoints -> mt: an mt GPT trained 3 steps by DeepSpeed ZeRO-2 (the
client-optimizer engine of ``mt_zero.deepspeed_engine``) on 2 gloo processes, saved by
``engine.save_checkpoint``, turned universal by DeepSpeed's own ``ds_to_universal``, then
``mt convert`` to consolidated and hf: the converted model's logits equal the DeepSpeed
engine's on a fixed batch (fp32; measured max |diff| 0, asserted 1e-5).

DeepSpeed's environment (DS_ACCELERATOR=cpu, LOCAL_RANK...) is set in the child processes
and the ``ds_to_universal`` subprocess only; nothing is JIT-built (mt starts DeepSpeed
without its shm inference allreduce op).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from mt_checkpoint import load_rank, read_meta
from mt_convert.cli import app
from mt_dist.testing import run_distributed
from mt_formats import ConvertError, convert_checkpoint, load_model, open_checkpoint
from mt_model import GPT, preset
from mt_zero import ZeroConfig, consolidate, decay_param_groups
from mt_zero.deepspeed_engine import deepspeed_config, deepspeed_environ, initialize_deepspeed

# n_heads 2 differs from the tiny preset's 4: the config must come from --model, not a guess.
CONFIG = preset("tiny").replace(n_layers=2, n_heads=2, seq_len=16, vocab_size=96)
STEPS, GLOBAL_BATCH = 3, 4
EXTENSIONS = Path.home() / ".cache" / "mt" / "torch_extensions"
PROBE = torch.randint(0, CONFIG.vocab_size, (3, CONFIG.seq_len),
                      generator=torch.Generator().manual_seed(11))


def _ds_environ() -> dict[str, str]:
    return {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(EXTENSIONS),
            "OMP_NUM_THREADS": "1"}


def _train_and_save(root: str) -> tuple[list[float], torch.Tensor]:
    """Child process: DeepSpeed ZeRO-2 trains mt's GPT, saves, returns losses and logits."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(deepspeed_environ(rank, world, rank))
    os.environ.update(_ds_environ())
    model = GPT(CONFIG, seed=7)
    client = torch.optim.AdamW(decay_param_groups(model.named_parameters(), 0.1), lr=1e-2)
    config = deepspeed_config(ZeroConfig(stage=2, clip_grad=1.0), GLOBAL_BATCH // world, 1,
                              world)
    engine = initialize_deepspeed(model, client, config)
    tokens = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    mine = tokens.chunk(world)[rank]
    losses = []
    for _ in range(STEPS):  # the same batch each step: the loss must fall
        loss = engine(mine[:, :-1], mine[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.save_checkpoint(root, tag=f"global_step{STEPS}")
    engine.eval()
    with torch.no_grad():
        logits = engine(PROBE)
    return losses, logits


@pytest.fixture(scope="module")
def universal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """(checkpoint root with ``latest_universal``, the DeepSpeed engine's probe logits)."""
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("ds")
    results = run_distributed(_train_and_save, 2, str(root), timeout=240.0)
    losses, logits = results[0]
    assert losses[-1] < losses[0]  # it trained
    subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
         "--input_folder", str(root / f"global_step{STEPS}"),
         "--output_folder", str(root / "universal"), "--inject_missing_state",
         "--num_extract_workers", "1", "--num_merge_workers", "1"],
        check=True, capture_output=True, timeout=180, env={**os.environ, **_ds_environ()})
    return root, logits


def _model_json(tmp: Path) -> Path:
    path = tmp / "model.json"
    path.write_text(json.dumps(CONFIG.to_dict()), encoding="utf-8")
    return path


def test_convert_deepspeed_universal_logits_match(universal: tuple[Path, Any],
                                                  tmp_path: Path) -> None:
    root, reference = universal
    # Detected through `latest_universal`; the config from a JSON file of GPTConfig fields.
    result = CliRunner().invoke(app, [str(root), str(tmp_path / "mt"), "--model",
                                      str(_model_json(tmp_path))])
    assert result.exit_code == 0, result.output
    assert "(consolidated): 28 tensors" in result.output
    model = load_model(tmp_path / "mt").eval()
    assert model.config == CONFIG
    with torch.no_grad():
        logits = model(PROBE)
    assert (logits - reference).abs().max() <= 1e-5
    # Straight to Hugging Face GPT-2 from the universal folder itself.
    done = convert_checkpoint(root / "universal", tmp_path / "hf", to="hf",
                              from_format="deepspeed", model=CONFIG)
    assert done.source_format == "deepspeed" and done.target_format == "hf"
    with torch.no_grad():
        hf_logits = load_model(tmp_path / "hf").eval()(PROBE)
    assert (hf_logits - reference).abs().max() <= 1e-5


def test_convert_deepspeed_universal_weights_and_moments(universal: tuple[Path, Any],
                                                          tmp_path: Path) -> None:
    root, _ = universal
    folder = root / "universal"
    module = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    with open_checkpoint(folder, model="tiny") as reader:  # a preset supplies the heads
        assert reader.format == "deepspeed" and reader.config.n_heads == 4
        assert reader.config.replace(n_heads=2) == CONFIG
        assert set(reader.names()) == set(module)
        for name in reader.names():
            # The fp32 masters (from the ZeRO shards) equal the engine's module weights.
            assert torch.equal(reader.read(name), module[name]), name
        assert [ref.file for ref in reader.sources("blocks.1.attn.qkv.weight")] == [
            "zero/blocks.1.attn.qkv.weight/fp32.pt"]
        avg = reader.read_state("blocks.0.mlp.fc.weight", "exp_avg")
        assert avg.shape == (CONFIG.ffn_hidden, CONFIG.hidden) and avg.abs().sum() > 0
        assert reader.read_state("ln_f.bias", "exp_avg_sq").min() >= 0
        assert int(reader.read_state("ln_f.bias", "step")) == STEPS
        avg_sq = reader.read_state("blocks.1.attn.qkv.weight", "exp_avg_sq")
    # --to pretrain carries Adam's state: a run loading it continues DeepSpeed's optimizer
    done = convert_checkpoint(folder, tmp_path / "pre", to="pretrain", model="tiny")
    full = consolidate([load_rank(tmp_path / "pre", 0)["optimizer"]])
    state = full["state"]["blocks.0.mlp.fc.weight"]
    assert torch.equal(state["sharded"]["exp_avg"], avg)
    assert torch.equal(full["state"]["blocks.1.attn.qkv.weight"]["sharded"]["exp_avg_sq"],
                       avg_sq)
    assert int(state["replicated"]["step"]) == STEPS
    assert read_meta(tmp_path / "pre").step == 0  # mt's own schedule starts over, and
    tokens = STEPS * GLOBAL_BATCH * CONFIG.seq_len  # the engine's steps and samples say so
    assert any(f"had trained {STEPS} steps, {tokens:,} tokens" in n for n in done.notes)
    # one parameter's moments missing: refused for every target that holds Adam's state
    partial = tmp_path / "partial"
    shutil.copytree(folder, partial)
    (partial / "zero" / "ln_f.bias" / "exp_avg.pt").unlink()
    for to in ("pretrain", "dcp", "mcore"):
        with pytest.raises(ConvertError) as refused:
            convert_checkpoint(partial, tmp_path / to, to=to, model="tiny")
        assert str(refused.value) == (
            f"{partial}: Adam's state of {len(module) - 1} parameters but not of 'ln_f.bias' "
            "(1 without): a partial optimizer state is not carried; --drop-optimizer "
            "converts the weights alone")
        assert not (tmp_path / to).exists()
    convert_checkpoint(partial, tmp_path / "weights", to="pretrain", model="tiny",
                       drop_optimizer=True)


def test_convert_deepspeed_errors_name_file_and_tensor(universal: tuple[Path, Any],
                                                       tmp_path: Path) -> None:
    root, _ = universal
    with pytest.raises(ConvertError, match="does not record the model config .*n_layers 2, "
                       "hidden 64.*--model"):
        convert_checkpoint(root, tmp_path / "out")
    with pytest.raises(ConvertError, match=r"native \(per-rank\) layout.*ds_to_universal"):
        convert_checkpoint(root / f"global_step{STEPS}", tmp_path / "out", model=CONFIG)
    with pytest.raises(ConvertError, match="--model only applies to deepspeed, dcp and mcore"):
        convert_checkpoint(root / "universal", tmp_path / "out", from_format="hf",
                           model=CONFIG)
    broken = tmp_path / "broken"
    shutil.copytree(root / "universal", broken)
    step = broken / "zero" / "ln_f.bias" / "step.pt"
    for value in (torch.tensor(float("nan")), -3, 7.5, True, torch.ones(2)):
        torch.save(value, step)  # what a resumed run's Adam would take as its step count
        with pytest.raises(ConvertError, match=r"ln_f\.bias/step\.pt: tensor 'ln_f\.bias': "
                           "Adam's step is .*, not a whole number >= 0"):
            convert_checkpoint(broken, tmp_path / "out", to="pretrain", model=CONFIG)
    torch.save(torch.tensor(float(STEPS)), step)
    fp32 = broken / "zero" / "blocks.1.mlp.proj.weight" / "fp32.pt"
    fp32.write_bytes(fp32.read_bytes()[:200])  # truncated
    with pytest.raises(ConvertError, match=r"blocks\.1\.mlp\.proj\.weight/fp32\.pt: not a "
                       "readable torch checkpoint"):
        convert_checkpoint(broken, tmp_path / "out", model=CONFIG)
    torch.save({"param": torch.zeros(3)}, fp32)  # wrong shape
    with pytest.raises(ConvertError, match=r"fp32\.pt: tensor 'blocks\.1\.mlp\.proj\.weight' "
                       r"has shape \[3\], the model config needs \[64, 256\]"):
        convert_checkpoint(broken, tmp_path / "out", model=CONFIG)
    torch.save({"param": torch.zeros(64, 256), "why": Path("x")}, fp32)  # a pickled object
    with pytest.raises(ConvertError, match="refusing to unpickle"):
        convert_checkpoint(broken, tmp_path / "out", model=CONFIG)
    shutil.rmtree(fp32.parent)
    with pytest.raises(ConvertError, match=r"missing \['blocks\.1\.mlp\.proj\.weight'\]"):
        convert_checkpoint(broken, tmp_path / "out", model=CONFIG)
    assert not (tmp_path / "out").exists()
