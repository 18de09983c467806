"""Megatron-LM style layout: mt -> megatron -> mt bit-identical at TP 2 x PP 2, Megatron's
names and per-head qkv order, and weights-only reading that refuses other pickles."""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import pytest
import torch

from mt_formats import ConvertError, convert_checkpoint, load_model, save_model
from mt_model import GPT, preset


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def test_convert_megatron_round_trip_tp2_pp2(tmp_path: Path) -> None:
    model = GPT(preset("tiny"), seed=9).eval()
    save_model(model, tmp_path / "tp", to="tp", tp=2, pp=2)
    result = convert_checkpoint(tmp_path / "tp", tmp_path / "meg", to="megatron", tp=2, pp=2)
    assert result.target_format == "megatron"
    assert (tmp_path / "meg" / "latest_checkpointed_iteration.txt").read_text() == "0\n"
    assert sorted(str(p.relative_to(tmp_path / "meg"))
                  for p in (tmp_path / "meg").rglob("*.pt")) == [
        f"iter_0000000/mp_rank_{t:02d}_{s:03d}/model_optim_rng.pt"
        for t in range(2) for s in range(2)]
    convert_checkpoint(tmp_path / "meg", tmp_path / "back", to="tp", tp=2, pp=2)
    assert _files(tmp_path / "back") == _files(tmp_path / "tp")  # bit-identical
    idx = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "meg")(idx), model(idx), atol=0,
                                   rtol=0)


def test_convert_megatron_names_and_qkv_order(tmp_path: Path) -> None:
    model = GPT(preset("tiny"), seed=9).eval()
    save_model(model, tmp_path / "meg", to="megatron", tp=2, pp=2)
    first = _load(tmp_path / "meg/iter_0000000/mp_rank_01_000/model_optim_rng.pt")
    last = _load(tmp_path / "meg/iter_0000000/mp_rank_01_001/model_optim_rng.pt")
    assert first["checkpoint_version"] == 3.0 and first["iteration"] == 0
    embedding = first["model"]["language_model"]["embedding"]
    assert embedding["word_embeddings"]["weight"].shape == (512, 64)  # padded, tp 1 of 2
    assert torch.equal(embedding["position_embeddings"]["weight"], model.embed.positions.weight)
    assert sorted(k for k in first["model"]["language_model"]["encoder"] if "layers.1." in k) \
        == sorted(f"layers.1.{m}.{p}" for p in ("weight", "bias") for m in (
            "input_layernorm", "self_attention.query_key_value", "self_attention.dense",
            "post_attention_layernorm", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"))
    encoder = last["model"]["language_model"]["encoder"]
    assert "final_layernorm.weight" in encoder and "layers.2.input_layernorm.weight" not in encoder
    # stage 1 holds global layers 2-3 as local layers 0-1; qkv rows [heads, 3, head_dim]
    qkv = model.blocks[3].attn.qkv.weight.reshape(3, 4, 16, 64)  # [q|k|v, head, dim, in]
    want = torch.stack([qkv[:, 2], qkv[:, 3]]).reshape(96, 64)  # heads 2, 3 on tp rank 1
    assert torch.equal(encoder["layers.1.self_attention.query_key_value.weight"], want)
    assert torch.equal(encoder["layers.1.self_attention.dense.weight"],
                       model.blocks[3].attn.proj.weight[:, 32:])
    assert torch.equal(last["model"]["word_embeddings_for_head"]["weight"],
                       embedding["word_embeddings"]["weight"])


def test_convert_megatron_refuses_other_pickles(tmp_path: Path) -> None:
    save_model(GPT(preset("tiny"), seed=9), tmp_path / "meg", to="megatron")
    path = tmp_path / "meg/iter_0000000/mp_rank_00/model_optim_rng.pt"
    data = _load(path)
    torch.save({**data, "args": argparse.Namespace(num_layers=4, save=Path("/x"))}, path)
    with pytest.raises(ConvertError, match=r"mp_rank_00/model_optim_rng\.pt: holds a pickled "
                                           r"object outside the allow-list.*refusing.*PosixPath"):
        convert_checkpoint(tmp_path / "meg", tmp_path / "out")
    layers = data["model"]["language_model"]["encoder"]
    layers["layers.0.mlp.dense_h_to_4h.weight"] = layers["layers.0.mlp.dense_h_to_4h.weight"][1:]
    torch.save(data, path)
    with pytest.raises(ConvertError, match=r"tensor 'language_model\.encoder\.layers\.0\.mlp\."
                                           r"dense_h_to_4h\.weight' is \[255, 64\], the model "
                                           r"config needs \[256, 64\]"):
        convert_checkpoint(tmp_path / "meg", tmp_path / "out")
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ConvertError, match="not a readable torch checkpoint"):
        convert_checkpoint(tmp_path / "meg", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _genuine(folder: str, vocab: int | None) -> None:
    """Turn mt's megatron files into what Megatron-LM itself saves: its ``args`` (with a
    real Megatron-core enum and a torch dtype), RNG states (Python, numpy, torch) and
    scheduler state instead of mt's entry; each file's ``args.rank`` is its saver's global
    rank in a TP 2 x PP 2 x DP 2 run. Run in its own process: importing megatron.core
    widens torch's weights-only allow-list for the whole process."""
    import random

    import numpy as np
    from megatron.core.transformer.enums import AttnBackend

    args = argparse.Namespace(
        num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
        max_position_embeddings=128, seq_length=128, norm_epsilon=1e-5, init_method_std=0.02,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
        make_vocab_size_divisible_by=128, padded_vocab_size=1024, vocab_size=vocab,
        swiglu=False, normalization="LayerNorm", position_embedding_type="learned_absolute",
        untie_embeddings_and_output_weights=False, add_bias_linear=True, openai_gelu=False,
        params_dtype=torch.float32, attention_backend=AttnBackend.auto, lr=3e-4,
        data_path=["1.0", "corpus_text_document"], tokenizer_type="GPT2BPETokenizer")
    for path in sorted(Path(folder).rglob("model_optim_rng.pt")):
        data = torch.load(path, weights_only=True)
        data.pop("mt", None)
        np.random.seed(1)
        tp_rank, stage = (int(part) for part in path.parent.name.split("_")[2:])
        saver = argparse.Namespace(**vars(args), rank=tp_rank + 4 * stage, world_size=8)
        data.update(args=saver, num_floating_point_operations_so_far=0,
                    opt_param_scheduler={"max_lr": 3e-4, "num_steps": 10},
                    rng_state=[{"random_rng_state": random.getstate(),
                                "np_rng_state": np.random.get_state(),
                                "torch_rng_state": torch.get_rng_state(),
                                "rng_tracker_states": {}}])
        torch.save(data, path)


def test_convert_genuine_megatron_lm_reads_its_args(tmp_path: Path) -> None:
    """Files as Megatron-LM saves them read from their args alone; one file of another step
    or run, or the last stage's TP folders swapped, is refused in one line."""
    from mt_dist.testing import run_distributed

    model = GPT(preset("tiny").replace(seq_len=128), seed=9).eval()
    save_model(model, tmp_path / "meg", to="megatron", tp=2, pp=2)
    run_distributed(_genuine, 1, str(tmp_path / "meg"), 1000, timeout=120)
    with pytest.raises(pickle.UnpicklingError):  # plain weights-only loading refuses it
        _load(tmp_path / "meg/iter_0000000/mp_rank_00_000/model_optim_rng.pt")
    back = load_model(tmp_path / "meg")  # config and layout from args, vocab padding dropped
    assert back.config == model.config.replace(init_std=0.02)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    run_distributed(_genuine, 1, str(tmp_path / "meg"), None, timeout=120)
    assert load_model(tmp_path / "meg").config.vocab_size == 1024  # no vocab_size: padded
    for folder, words in run_distributed(_other_run, 1, str(tmp_path / "meg"),
                                         timeout=120)[0].items():
        with pytest.raises(ConvertError, match=words):
            load_model(folder)
    ranks = tmp_path / "meg" / "iter_0000000"  # the last stage's TP ranks' folders swapped
    (ranks / "mp_rank_00_001").rename(ranks / "swap")
    (ranks / "mp_rank_01_001").rename(ranks / "mp_rank_00_001")
    (ranks / "swap").rename(ranks / "mp_rank_01_001")
    with pytest.raises(ConvertError, match=r"mp_rank_00_001/model_optim_rng\.pt: saved by "
                                           r"global rank 5 of 8, which does not hold TP rank 0 "
                                           r"of pipeline stage 1"):
        load_model(tmp_path / "meg")


def _other_run(folder: str) -> dict[str, str]:
    """Copies of ``folder`` whose stage 1, TP rank 1 file is of another step, or of another
    run (its args), and the words their refusal names (in a rank process: the args unpickle
    megatron-core's enum)."""
    import shutil

    copies = {}
    for name, change, words in (
            ("step", lambda data: data.update(iteration=4),
             r"mp_rank_01_001/model_optim_rng\.pt: iteration 4, in the folder of iteration 0"),
            ("run", lambda data: setattr(data["args"], "ffn_hidden_size", 128),
             r"mp_rank_01_001/model_optim_rng\.pt: args\.ffn_hidden_size is 128, .*"
             r"mp_rank_00_000/model_optim_rng\.pt's 256: not one run's files")):
        copy = Path(folder).parent / name
        shutil.copytree(folder, copy)
        path = copy / "iter_0000000" / "mp_rank_01_001" / "model_optim_rng.pt"
        data = torch.load(path, weights_only=False)
        change(data)
        torch.save(data, path)
        copies[str(copy)] = words
    return copies


def test_rank_files_must_lie_in_the_folder_of_the_rank_that_saved_them() -> None:
    """Megatron-LM's args record the saver's global rank: with TP ranks innermost and the
    stages outermost (its default order) or inside data parallelism, any context-parallel
    rank saving, a file in another rank's folder is refused; files a one-process converter
    wrote (one rank in all), or without ranks, are not checked."""
    from mt_formats.megatron_args import check_rank_folders

    def saved(ranks: dict[tuple[int, int], int | None], world: int = 8, cp: int = 1
              ) -> dict[tuple[int, int], tuple[Path, argparse.Namespace]]:
        return {at: (Path(f"mp_rank_{at[1]:02d}_{at[0]:03d}"),
                     argparse.Namespace(rank=rank, world_size=world, context_parallel_size=cp))
                for at, rank in ranks.items()}

    grid = [(stage, tp_rank) for stage in range(2) for tp_rank in range(2)]
    for order in ({at: at[1] + 4 * at[0] for at in grid},  # tp-cp-ep-dp-pp, DP 2
                  {at: at[1] + 2 * at[0] for at in grid},  # tp-pp-dp
                  dict.fromkeys(grid, 0), dict.fromkeys(grid)):
        check_rank_folders(saved(order), 2, 2)
    # CP 2 (DP 1): before megatron-core 0.9 each context-parallel rank saved the file
    check_rank_folders(saved({at: at[1] + 2 + 4 * at[0] for at in grid}, cp=2), 2, 2)
    swapped = {at: at[1] + 4 * at[0] for at in grid} | {(1, 0): 5, (1, 1): 4}
    with pytest.raises(ConvertError, match=r"mp_rank_00_001: saved by global rank 5 of 8, "
                                           r"which does not hold TP rank 0 of pipeline stage 1 "
                                           r"\(the folder's name\)"):
        check_rank_folders(saved(swapped), 2, 2)
    stages = {at: at[1] + 4 * (1 - at[0]) for at in grid}  # the stages' folders swapped
    with pytest.raises(ConvertError, match=r"mp_rank_00_000: saved by global rank 4 of 8"):
        check_rank_folders(saved(stages), 2, 2)


def test_megatron_args_outside_the_gpt2_layout_are_refused_by_name() -> None:
    from mt_formats.megatron_args import config_from_args

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=128,
                max_position_embeddings=32)
    assert config_from_args(argparse.Namespace(**base), Path("f.pt")).n_layers == 2
    for field, value, what in (("swiglu", True, "a SwiGLU MLP"), ("normalization", "RMSNorm",
                                                                  "norm"),
                               ("position_embedding_type", "rope", "positions"),
                               ("group_query_attention", True, "grouped-query attention")):
        with pytest.raises(ConvertError, match=rf"f\.pt: args\.{field}={value!r} \({what}\) "
                                               r"is not supported by mt's megatron \(GPT-2\)"):
            config_from_args(argparse.Namespace(**base, **{field: value}), Path("f.pt"))
        # a Megatron-core checkpoint holds them: mt's Llama-family settings
        config_from_args(argparse.Namespace(**base, **{field: value}), Path("f.pt"),
                         gpt2_only=False)
    with pytest.raises(ConvertError, match=r"args\.rotary_percent=0\.5 \(partial RoPE\)"):
        config_from_args(argparse.Namespace(**base, rotary_percent=0.5), Path("f.pt"),
                         gpt2_only=False)


def test_pointer_files_name_one_folder_beside_them(tmp_path: Path) -> None:
    """``latest_checkpointed_iteration.txt`` and ``latest`` are read as one folder name: bytes
    that are not UTF-8, an empty file or a path out of the checkpoint are refused in one
    line naming the file (not a traceback, not a folder elsewhere)."""
    save_model(GPT(preset("tiny"), seed=9), tmp_path / "meg", to="megatron", tp=2)
    iteration = tmp_path / "meg" / "latest_checkpointed_iteration.txt"
    run = tmp_path / "run"
    run.mkdir()
    latest = run / "latest"
    for pointer, content, message in (
            (iteration, b"\xcf\n", "not UTF-8 text (byte 0xcf at offset 0)"),
            (iteration, b"../iter_0000000\n", "names '../iter_0000000', not a folder beside it"),
            (iteration, b" \n", "empty (it names the checkpoint folder beside it)"),
            (latest, b"/etc\n", "names '/etc', not a folder beside it"),
            (latest, b"..", "names '..', not a folder beside it"),
            (latest, b"\xff\xfe", "not UTF-8 text (byte 0xff at offset 0)")):
        pointer.write_bytes(content)
        with pytest.raises(ConvertError) as err:
            convert_checkpoint(pointer.parent, tmp_path / "out")
        assert str(err.value) == f"{pointer}: {message}"
        assert not (tmp_path / "out").exists()
    iteration.write_text("0\n")
    convert_checkpoint(tmp_path / "meg", tmp_path / "out")  # the file as Megatron-LM writes it
