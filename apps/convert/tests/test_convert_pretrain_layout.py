"""pretrain -> pretrain at another (TP, PP, DP, ZeRO) layout: the AdamW state of a real
mt_zero optimizer (after two steps) survives A -> B -> A bit for bit, every target rank holds
exactly its ZeRO partition, ``drop_optimizer`` leaves fresh state, and broken sources fail
with the file named. (``tests/test_e2e_convert_pretrain.py`` resumes ``mt pretrain`` from a
converted checkpoint.)"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from mt_convert.cli import app
from mt_formats import ConvertError, convert_checkpoint, load_state_dict
from mt_model import GPT, preset
from mt_tensor_parallel import GPT_PLAN, param_styles
from mt_zero import (
    ZeroConfig,
    ZeroOptimizer,
    consolidate,
    decay_param_groups,
    optimizer_shard_state,
    partition,
)


def _trained() -> tuple[GPT, ZeroOptimizer]:
    torch.manual_seed(0)
    model = GPT(preset("tiny").replace(n_layers=2, seq_len=16), seed=1)
    opt = ZeroOptimizer(model, lambda g: torch.optim.AdamW(g, lr=1e-2), None,
                        ZeroConfig(stage=0),
                        param_groups=decay_param_groups(model.named_parameters(), 0.1))
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
        opt.backward(model(idx, idx.roll(-1, 1)))
        opt.step()
    return model, opt


def _save(model: GPT, opt: ZeroOptimizer, folder: Path) -> None:
    """A one-rank ``mt pretrain`` step folder, as its Checkpointer writes it."""
    folder.mkdir(parents=True)
    names = [n for n, _ in model.named_parameters()]
    torch.save({"format": "mt-pretrain-rank/1", "rank": 0, "coord": [0, 0, 0],
                "model": {n: p.detach().clone() for n, p in model.named_parameters()},
                "optimizer": optimizer_shard_state(opt),
                "rng": {"torch": torch.get_rng_state(), "cuda": None, "tracker": {}}},
               folder / "rank-00000.pt")
    meta = {"format": "mt-pretrain/1", "step": 2, "data": {"consumed_samples": 4, "step": 2},
            "tokens": 64, "model": model.config.to_dict(),
            "layout": {"tp": 1, "pp": 1, "dp": 1, "world_size": 1, "virtual_stages": 1,
                       "zero_stage": 0, "precision": "fp32"},
            "styles": param_styles(names, GPT_PLAN), "stage_params": {"0": names},
            "config": {"train": {"seed": 5}, "parallel": {"tp": 1, "pp": 1, "dp": 1,
                                                          "zero_stage": 0, "nproc": 1}}}
    (folder / "meta.json").write_text(json.dumps(meta))


def _ranks(folder: Path) -> list[dict[str, Any]]:
    return [torch.load(p, weights_only=True) for p in sorted(folder.glob("rank-*.pt"))]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT, dict[str, Any]]:
    model, opt = _trained()
    folder = tmp_path_factory.mktemp("src") / "step-00000002"
    _save(model, opt, folder)
    return folder, model, consolidate([optimizer_shard_state(opt)])


def test_convert_pretrain_optimizer_round_trip_is_bit_identical(
        source: tuple[Path, GPT, dict[str, Any]], tmp_path: Path) -> None:
    folder, model, reference = source
    convert_checkpoint(folder, tmp_path / "b", to="pretrain", tp=2, pp=2, dp=2, zero_stage=1)
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    assert meta["layout"] | {"precision": "fp32"} == {
        "tp": 2, "pp": 2, "dp": 2, "world_size": 8, "virtual_stages": 1, "zero_stage": 1,
        "precision": "fp32"}
    assert meta["config"]["parallel"] == {"tp": 2, "pp": 2, "dp": 2, "zero_stage": 1,
                                          "nproc": 8, "virtual_stages": 1}
    assert meta["step"] == 2 and meta["data"] == {"consumed_samples": 4, "step": 2}
    ranks = _ranks(tmp_path / "b")
    assert [r["coord"] for r in ranks] == [[p, d, t] for p in range(2) for d in range(2)
                                           for t in range(2)]
    for rank in ranks:  # each DP rank holds exactly its ZeRO-1 partition of its stage
        shard, (pp, dp, _) = rank["optimizer"], rank["coord"]
        assert (shard["dp_size"], shard["dp_rank"], shard["stage"]) == (2, dp, 1)
        names = meta["stage_params"][str(pp)]
        layout = partition([torch.Size(shard["shapes"][n]).numel() for n in names], 2)
        assert [(p["name"], p["offset"], p["length"]) for p in shard["pieces"]] == [
            (names[p.param_index], p.param_offset, p.length) for p in layout.pieces(dp)]
        assert bool(rank["model"]) == (dp == 0)
        assert rank["rng"]["tracker"] == {}  # another layout: dropout streams restart
    _, weights = load_state_dict(tmp_path / "b")
    assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())

    convert_checkpoint(tmp_path / "b", tmp_path / "a", to="pretrain", tp=1, pp=1, dp=1,
                       zero_stage=0)
    back = consolidate([_ranks(tmp_path / "a")[0]["optimizer"]])
    assert back["group_of"] == reference["group_of"]
    assert back["param_groups"] == reference["param_groups"]
    for name, master in reference["master"].items():
        assert torch.equal(back["master"][name], master), name
        want, got = reference["state"][name], back["state"][name]
        assert want["sharded"].keys() == got["sharded"].keys() == {"exp_avg", "exp_avg_sq"}
        assert all(torch.equal(got["sharded"][k], t) for k, t in want["sharded"].items())
        assert torch.equal(got["replicated"]["step"], want["replicated"]["step"])
        assert float(got["replicated"]["step"]) == 2.0


def test_convert_pretrain_same_layout_keeps_rng_and_drop_optimizer(
        source: tuple[Path, GPT, dict[str, Any]], tmp_path: Path) -> None:
    folder, model, _ = source
    convert_checkpoint(folder, tmp_path / "same", to="pretrain", drop_optimizer=True)
    (rank,) = _ranks(tmp_path / "same")
    original = torch.load(folder / "rank-00000.pt", weights_only=True)
    assert torch.equal(rank["rng"]["torch"], original["rng"]["torch"])
    shard = rank["optimizer"]
    assert all(state == {} for state in shard["state"])  # fresh Adam: no moments, no step
    full = consolidate([shard])
    assert all(torch.equal(full["master"][n], p) for n, p in model.named_parameters())


def test_convert_pretrain_errors_name_the_file(source: tuple[Path, GPT, dict[str, Any]],
                                               tmp_path: Path) -> None:
    folder, _, _ = source
    with pytest.raises(ConvertError, match="--dp and --zero-stage only apply"):
        convert_checkpoint(folder, tmp_path / "x", to="tp", tp=2, dp=2)
    with pytest.raises(ConvertError, match=r"--zero-stage must be 0, 1, 2 or 3, got 4"):
        convert_checkpoint(folder, tmp_path / "x", to="pretrain", zero_stage=4)
    with pytest.raises(ConvertError, match=r"cannot split the model into pp=3 stages"):
        convert_checkpoint(folder, tmp_path / "x", to="pretrain", pp=3)
    with pytest.raises(ConvertError, match=r"--model does not apply to an mt pretrain source"):
        convert_checkpoint(folder, tmp_path / "x", to="pretrain", model="tiny")
    with pytest.raises(ConvertError, match=r"--gguf-type only applies to the gguf target"):
        convert_checkpoint(folder, tmp_path / "x", to="pretrain", gguf_type="q8_0")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "meta.json").write_text((folder / "meta.json").read_text())
    data = torch.load(folder / "rank-00000.pt", weights_only=True)
    data["optimizer"]["pieces"] = data["optimizer"]["pieces"][1:]  # a shard went missing
    data["optimizer"]["master"] = data["optimizer"]["master"][1:]
    data["optimizer"]["state"] = data["optimizer"]["state"][1:]
    torch.save(data, broken / "rank-00000.pt")
    with pytest.raises(ConvertError, match=r"broken: optimizer shards of pipeline stage 0: "
                                           r"shards from 1 ranks leave parameters incomplete"):
        convert_checkpoint(broken, tmp_path / "x", to="pretrain", dp=2)
    assert not (tmp_path / "x").exists()


def test_convert_pretrain_cli_defaults_to_pretrain_and_dry_run(
        source: tuple[Path, GPT, dict[str, Any]], tmp_path: Path) -> None:
    folder, _, _ = source
    runner = CliRunner()
    plan = runner.invoke(app, [str(folder), str(tmp_path / "b"), "--pp", "2", "--dp", "2",
                               "--dry-run"])
    assert plan.exit_code == 0, plan.output
    assert "(pretrain 1x1x1, ZeRO 0) -> pretrain 1x2x2, ZeRO 0, optimizer state carried" \
        in plan.output
    assert "rank-00003.pt (pp 1, dp 1, tp 0): layers 1-1 <- rank-00000.pt" in plan.output
    assert not (tmp_path / "b").exists()
    done = runner.invoke(app, [str(folder), str(tmp_path / "b"), "--pp", "2", "--dp", "2"])
    assert done.exit_code == 0, done.output
    assert "(pretrain)" in done.output
    assert len(_ranks(tmp_path / "b")) == 4
    bad = runner.invoke(app, [str(folder), str(tmp_path / "c"), "--to", "tp", "--tp", "2",
                              "--dp", "2"])
    assert bad.exit_code == 2 and "--dp and --zero-stage only apply" in bad.output


def test_convert_refuses_a_pretrain_checkpoint_with_flipped_bytes(tmp_path: Path) -> None:
    """A checkpoint as mt pretrain now writes it (rank file and meta.json checksummed): it
    converts without a word; with 64 bytes of its weights inverted it is refused naming the
    file, and nothing is written."""
    from mt_checkpoint import CheckpointMeta, SavedLayout, fresh_rng, save_rank, write_meta

    model, opt = _trained()
    folder = tmp_path / "step-00000002"
    folder.mkdir()
    names = [n for n, _ in model.named_parameters()]
    save_rank(folder, 0, (0, 0, 0), {n: p.detach().clone() for n, p in model.named_parameters()},
              optimizer_shard_state(opt), fresh_rng(5, 0, 0))
    write_meta(folder, CheckpointMeta(step=2, layout=SavedLayout(1, 1, 1),
                                      model=model.config.to_dict(),
                                      styles=param_styles(names, GPT_PLAN),
                                      stage_params={0: names}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_checkpoint(folder, tmp_path / "good", to="consolidated")
    rank = folder / "rank-00000.pt"
    data = bytearray(rank.read_bytes())
    at = len(data) // 3
    data[at:at + 64] = bytes(b ^ 0xFF for b in data[at:at + 64])
    rank.write_bytes(bytes(data))
    for to in ("consolidated", "pretrain"):
        with pytest.raises(ConvertError, match=rf"{rank}: damaged \(its checksum is crc32c:"):
            convert_checkpoint(folder, tmp_path / to, to=to, dp=2 if to == "pretrain" else None)
        assert not (tmp_path / to).exists()


def test_convert_folders_follow_the_umask(source: tuple[Path, GPT, dict[str, Any]],
                                          tmp_path: Path) -> None:
    """Teammates on a shared cluster can read an export."""
    import os

    folder, _, _ = source
    old = os.umask(0o022)
    try:
        convert_checkpoint(folder, tmp_path / "shared", to="consolidated")
    finally:
        os.umask(old)
    assert (tmp_path / "shared").stat().st_mode & 0o777 == 0o755


def test_convert_never_writes_into_or_over_its_source(
        source: tuple[Path, GPT, dict[str, Any]], tmp_path: Path) -> None:
    folder, _, _ = source
    for destination, how in ((folder, "is"), (folder / "export", "lies inside"),
                             (folder.parent, "holds")):
        with pytest.raises(ConvertError, match=rf"the destination {how} the source checkpoint"):
            convert_checkpoint(folder, destination, to="consolidated", overwrite=True)
    assert (folder / "rank-00000.pt").is_file() and (folder / "meta.json").is_file()
