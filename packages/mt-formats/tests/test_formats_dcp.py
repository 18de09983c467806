"""torch Distributed Checkpoint folders: written by torch's own ``dcp.save`` (from a
transformers GPT-2, from torchtitan-named Llama weights, from two ranks holding DTensor
shards) and read by mt; written by mt and loaded by ``dcp.load`` into the other library's
state dict. Logits are compared against transformers and against a Llama forward written
the way Meta's and torchtitan's are (complex-number RoPE over adjacent pairs), which shares
no code with mt's rotate-half RoPE, so the q/k row permutation is checked, not assumed."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from reference_llama import titan_logits, titan_state

from mt_formats import ConvertError, convert_checkpoint, load_model, open_checkpoint, save_model
from mt_formats.dcp import DATA_FILE
from mt_formats.dcp_names import from_interleaved, to_interleaved
from mt_model import GPT, GPTConfig, preset

transformers = pytest.importorskip("transformers")

LLAMA = GPTConfig(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, vocab_size=97, seq_len=24,
                  ffn_hidden=96, position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                  tied_embeddings=False, layernorm_eps=1e-6, rope_theta=500000.0)

#: What a GPT-2 DCP folder does not record: heads, activation (transformers' defaults).
GPT2_FIELDS = GPTConfig(n_layers=2, hidden=48, n_heads=6, vocab_size=211, seq_len=32,
                        gelu_approximate="tanh", layernorm_eps=1e-5)


def _tokens(vocab: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(7))


def test_interleave_is_the_rope_pair_order() -> None:
    # per head of 8 rows: rotate-half order [a0 a1 a2 a3 b0 b1 b2 b3] <-> pairs [a0 b0 a1 b1 ...]
    rows = torch.arange(16.0)[:, None]
    titan = to_interleaved(rows, heads=2).flatten().tolist()
    assert titan == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    assert torch.equal(from_interleaved(to_interleaved(rows, 2), 2), rows)


@pytest.mark.parametrize(("prefix", "legacy"), [("", False), ("model.", True)])
def test_torchtitan_dcp_saved_by_torch_reads_with_equal_logits(tmp_path: Path, prefix: str,
                                                               legacy: bool) -> None:
    state = titan_state(LLAMA, prefix, legacy)
    saved = {**state, "optimizer.state.layers.0.attention_norm.weight.exp_avg": torch.ones(64),
             "train_state": {"step": 5}}  # what torchtitan saves beside the model
    dcp.save(saved, checkpoint_id=tmp_path / "titan", no_dist=True)
    convert_checkpoint(tmp_path / "titan", tmp_path / "mt", model=LLAMA.replace(n_kv_heads=None))
    model = load_model(tmp_path / "mt").eval()
    assert model.config == LLAMA  # sizes and grouped-query heads read from the tensors
    tokens = _tokens(LLAMA.vocab_size, LLAMA.seq_len)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), titan_logits(state, tokens, LLAMA, prefix,
                                                                legacy), atol=1e-5, rtol=0)


def test_mt_llama_to_dcp_loads_into_torchtitan_names(tmp_path: Path) -> None:
    model = GPT(LLAMA, seed=3).eval()
    save_model(model, tmp_path / "dcp", to="dcp")
    target = {key: torch.zeros_like(t) for key, t in titan_state(LLAMA).items()}
    dcp.load(target, checkpoint_id=tmp_path / "dcp", no_dist=True)  # torch's own loader
    stored = dcp.FileSystemReader(tmp_path / "dcp").read_metadata().state_dict_metadata
    assert set(stored) == set(target)  # every torchtitan key, nothing else
    tokens = _tokens(LLAMA.vocab_size, LLAMA.seq_len)
    with torch.no_grad():
        torch.testing.assert_close(titan_logits(target, tokens, LLAMA), model(tokens),
                                   atol=1e-5, rtol=0)
    back = load_model(tmp_path / "dcp")  # mt.json: the config travels, no --model
    for key, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], tensor), key


def _hf_gpt2(seed: int = 0) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)  # HF's random init uses the global RNG
    config = transformers.GPT2Config(n_layer=2, n_embd=48, n_head=6, vocab_size=211,
                                     n_positions=32, activation_function="gelu_new",
                                     bos_token_id=None, eos_token_id=None)
    return transformers.GPT2LMHeadModel(config).eval()


def test_gpt2_dcp_saved_by_torch_from_transformers(tmp_path: Path) -> None:
    hf = _hf_gpt2()
    dcp.save(hf.state_dict(), checkpoint_id=tmp_path / "hf-dcp", no_dist=True)
    fields = GPT2_FIELDS.replace(n_layers=1, vocab_size=64, seq_len=8)  # sizes: the tensors'
    convert_checkpoint(tmp_path / "hf-dcp", tmp_path / "mt", model=fields)
    model = load_model(tmp_path / "mt").eval()
    assert (model.config.n_layers, model.config.hidden, model.config.vocab_size,
            model.config.seq_len) == (2, 48, 211, 32)
    tokens = _tokens(211, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-4, rtol=0)


def test_mt_gpt2_to_dcp_loads_into_transformers(tmp_path: Path) -> None:
    model = GPT(preset("tiny").replace(gelu_approximate="tanh"), seed=5).eval()
    save_model(model, tmp_path / "mt")
    convert_checkpoint(tmp_path / "mt", tmp_path / "hf", to="hf")  # only for HF's config
    convert_checkpoint(tmp_path / "mt", tmp_path / "dcp", to="dcp")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    state = hf.state_dict()
    for tensor in state.values():
        tensor.zero_()
    dcp.load(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    tokens = _tokens(model.config.vocab_size, 48)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), atol=1e-4, rtol=0)
    # dcp -> consolidated -> dcp: the same stored bytes (.metadata differs by its save_id,
    # a fresh uuid per save, as dcp.save's)
    convert_checkpoint(tmp_path / "dcp", tmp_path / "again")
    convert_checkpoint(tmp_path / "again", tmp_path / "dcp2", to="dcp")
    first, second = (json.loads((tmp_path / d / "mt.json").read_bytes()) for d in ("dcp", "dcp2"))
    assert first.pop("files").keys() == second.pop("files").keys() == {".metadata"}
    first.pop("checksum"), second.pop("checksum")  # of the files' checksums too
    assert first == second
    assert (tmp_path / "dcp" / DATA_FILE).read_bytes() == (tmp_path / "dcp2" / DATA_FILE
                                                          ).read_bytes()


def _save_sharded(directory: str) -> None:
    """On each of 2 ranks: the HF GPT-2 state dict as DTensors sharded over the ranks (rows,
    columns or replicated, by tensor), saved with torch's dcp.save."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    placements = [Shard(0), Shard(1), Replicate()]
    sharded = {}
    for i, (key, tensor) in enumerate(_hf_gpt2().state_dict().items()):
        place = placements[i % 3] if tensor.dim() > 1 else placements[(i % 2) * 2]
        sharded[key] = distribute_tensor(tensor, mesh, [place])
    dcp.save(sharded, checkpoint_id=directory)


def test_dcp_saved_by_two_ranks_reads_whole(tmp_path: Path) -> None:
    from mt_dist.testing import run_distributed

    run_distributed(_save_sharded, 2, str(tmp_path / "sharded"))
    assert len(list((tmp_path / "sharded").glob("*.distcp"))) == 2
    fields = GPT2_FIELDS
    hf = _hf_gpt2()
    with open_checkpoint(tmp_path / "sharded", model=fields) as reader:
        assert "2 files" in reader.sources("blocks.0.attn.qkv.weight")[0].file
        for name in reader.names():  # bit for bit: no arithmetic, only chunks put together
            ref, tensor = reader.sources(name)[0], reader.read(name)
            stored = hf.state_dict()[ref.key]
            assert torch.equal(tensor, stored.t() if ref.transform == "transpose" else stored)
    # a rank's file gone, or metadata whose chunks leave a gap or overlap: one line each
    metadata = dcp.FileSystemReader(tmp_path / "sharded").read_metadata()  # trusted here
    chunks = metadata.state_dict_metadata["transformer.h.0.mlp.c_fc.weight"].chunks
    for edit, message in ((chunks.pop, "chunks hold 4608 of its 9216 elements"),
                          (lambda: chunks.extend([chunks[0], chunks[0]]), "overlap")):
        edit()
        with (tmp_path / "sharded" / ".metadata").open("wb") as file:
            pickle.dump(metadata, file)
        with pytest.raises(ConvertError, match=message):
            open_checkpoint(tmp_path / "sharded", model=fields)
    (tmp_path / "sharded" / "__1_0.distcp").unlink()
    with pytest.raises(ConvertError, match=r"__1_0\.distcp: file not found"):
        open_checkpoint(tmp_path / "sharded", model=fields)


def test_dcp_hostile_inputs_are_one_line_errors(tmp_path: Path) -> None:
    save_model(GPT(preset("tiny"), seed=1), tmp_path / "ok", to="dcp")
    folder = tmp_path / "ok"
    meta = (folder / ".metadata").read_bytes()

    # a metadata pickle that would call os.system: refused before anything runs
    class Evil:
        def __reduce__(self):  # noqa: ANN204
            return (__import__("os").system, ("touch " + str(tmp_path / "pwned"),))

    bad = tmp_path / "evil"
    bad.mkdir()
    (bad / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ConvertError, match=r"\.metadata: holds posix\.system.*refusing"):
        open_checkpoint(bad, model=preset("tiny"))
    assert not (tmp_path / "pwned").exists()

    # a chunk stored outside the folder
    escape = tmp_path / "escape"
    escape.mkdir()
    (escape / "__0_0.distcp").write_bytes((folder / "__0_0.distcp").read_bytes())
    (escape / ".metadata").write_bytes(meta.replace(b"__0_0.distcp", b"../_0.distcp"))
    with pytest.raises(ConvertError, match="not a plain file name"):
        open_checkpoint(escape)

    # truncated data file
    short = tmp_path / "short"
    short.mkdir()
    (short / ".metadata").write_bytes(meta)
    (short / "mt.json").write_bytes((folder / "mt.json").read_bytes())
    (short / "__0_0.distcp").write_bytes((folder / "__0_0.distcp").read_bytes()[:5000])
    with pytest.raises(ConvertError, match=r"__0_0\.distcp: tensor .* \(truncated\?\)"):
        open_checkpoint(short)

    # a flipped byte inside a tensor: DCP cannot tell, mt.json's checksum can
    data = bytearray((folder / "__0_0.distcp").read_bytes())
    with open_checkpoint(folder) as reader:
        info = next(info for index, info in reader._folder.metadata.storage_data.items()
                    if index.fqn == "transformer.h.0.mlp.c_fc.weight")
        values = reader.read("blocks.0.mlp.fc.weight").t().contiguous().numpy().tobytes()
    at = bytes(data).index(values[:64], info.offset)
    assert at < info.offset + info.length
    data[at + 5] ^= 0x40
    (folder / "__0_0.distcp").write_bytes(bytes(data))
    with open_checkpoint(folder) as reader, pytest.raises(ConvertError,
                                                          match="checksum mismatch"):
        reader.read("blocks.0.mlp.fc.weight")
    # an item whose serialized form is damaged: torch.load's failure, in one line
    data[info.offset:info.offset + 64] = bytes(64)
    (folder / "__0_0.distcp").write_bytes(bytes(data))
    with open_checkpoint(folder) as reader, pytest.raises(ConvertError, match=(
            r"__0_0\.distcp: tensor 'transformer\.h\.0\.mlp\.c_fc\.weight': not readable")):
        reader.read("blocks.0.mlp.fc.weight")

    # no config recorded and none given
    plain = tmp_path / "plain"
    dcp.save(titan_state(LLAMA), checkpoint_id=plain, no_dist=True)
    with pytest.raises(ConvertError, match="does not record the model config.*--model"):
        open_checkpoint(plain)


def test_mt_json_checks_the_small_files_and_names_only_stored_entries(tmp_path: Path) -> None:
    """mt.json beside a DCP or Megatron-core folder records the checksums of the small files
    mt writes there (.metadata; metadata.json and common.pt, which a weights-only read never
    opens), and of stored entries only: a changed small file, a checksum of an entry the
    folder does not hold, or a tensor without one is refused in one line naming the file."""
    save_model(GPT(preset("tiny"), seed=1), tmp_path / "mt")
    convert_checkpoint(tmp_path / "mt", tmp_path / "mcore", to="mcore")
    sidecar = json.loads((tmp_path / "mcore" / "mt.json").read_bytes())
    assert sidecar["files"].keys() == {".metadata", "metadata.json", "common.pt"}
    common = tmp_path / "mcore" / "common.pt"
    common.write_bytes(common.read_bytes() + b"\0")
    with pytest.raises(ConvertError) as err:
        convert_checkpoint(tmp_path / "mcore", tmp_path / "out")
    assert str(err.value) == (f"{common}: checksum mismatch (recorded "
                              f"{sidecar['files']['common.pt']} in mt.json): the file is "
                              "corrupted")
    (tmp_path / "mcore" / "metadata.json").unlink()  # detected as plain DCP: still refused
    with pytest.raises(ConvertError, match=r"metadata\.json: cannot be read \(No such file"):
        convert_checkpoint(tmp_path / "mcore", tmp_path / "out")

    convert_checkpoint(tmp_path / "mt", tmp_path / "dcp", to="dcp")
    path = tmp_path / "dcp" / "mt.json"
    text = path.read_text()
    sidecar = json.loads(text)
    for edit in ({"rope_theta": 500000.0}, {"n_layers": 3}):  # the model no longer the weights'
        path.write_text(json.dumps({**sidecar, "model": {**sidecar["model"], **edit}}))
        with pytest.raises(ConvertError, match=rf"^{path}: edited or damaged since mt wrote it "
                           r"\(its contents give crc32c:[0-9a-f]{8}, it records "
                           rf"{sidecar['checksum']}\): the model config it holds describes"):
            convert_checkpoint(tmp_path / "dcp", tmp_path / "out")
    # A sidecar without its own checksum (an earlier mt's): its entries are still checked.
    del sidecar["checksum"]
    text = json.dumps(sidecar)
    path.write_text(text.replace('"transformer.h.1.ln_2.bias"', '"transformer/h.1.ln_2.bias"'))
    with pytest.raises(ConvertError, match=r"mt\.json: records a checksum of "
                       r"'transformer/h\.1\.ln_2\.bias', which \.metadata does not list"):
        convert_checkpoint(tmp_path / "dcp", tmp_path / "out")
    del sidecar["checksums"]["transformer.h.1.ln_2.bias"]
    path.write_text(json.dumps(sidecar))
    with pytest.raises(ConvertError, match=r"mt\.json: records no checksum of tensor "
                       r"'transformer\.h\.1\.ln_2\.bias'"):
        convert_checkpoint(tmp_path / "dcp", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_compressed_dcp_reads_through_dcp_itself(tmp_path: Path) -> None:
    # chunks stored with a DCP stream transform (zstd) are read by dcp.load, not by mt's
    # own chunk reader: the same tensors
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    state = titan_state(LLAMA)
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "zst", _extensions=[ZStandard()]),
             no_dist=True)
    plain = tmp_path / "plain"
    dcp.save(state, checkpoint_id=plain, no_dist=True)
    assert (tmp_path / "zst" / "__0_0.distcp").stat().st_size != (
        plain / "__0_0.distcp").stat().st_size
    with open_checkpoint(tmp_path / "zst", model=LLAMA) as zst, \
            open_checkpoint(plain, model=LLAMA) as ref:
        for name in ref.names():
            assert torch.equal(zst.read(name), ref.read(name)), name


def _titan_module() -> torch.nn.Module:
    """A module tree whose parameters have torchtitan's Llama names (the FQNs of its
    modules), holding :func:`titan_state`'s weights."""
    root = torch.nn.Module()
    for key, tensor in titan_state(LLAMA).items():
        *path, leaf = key.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor.clone()))
    return root


def _train(root: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    tokens = torch.randint(0, LLAMA.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    for _ in range(steps):
        params = dict(root.named_parameters())
        titan_logits(params, tokens, LLAMA).logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_per_parameter_settings_carry_to_dcp_and_are_checked(tmp_path: Path) -> None:
    """An AdamW whose attention matrices learn at another rate: DCP -> DCP keeps each
    parameter's settings (a strict ``dcp.load`` into the same two groups gives them back);
    formats of one group of matrices refuse in one line, naming two parameters that differ;
    a damaged setting in a folder mt wrote is named by its checksum."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def adamw(root: torch.nn.Module) -> torch.optim.Optimizer:
        fast = [p for n, p in root.named_parameters() if ".attention." in n]
        rest = [p for n, p in root.named_parameters() if ".attention." not in n]
        return torch.optim.AdamW([{"params": fast, "lr": 1e-2}, {"params": rest}])

    root = _titan_module()
    first = adamw(root)
    _train(root, first, 1)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    dcp.save({**get_model_state_dict(root),
              "optimizer": get_optimizer_state_dict(root, first, options=options)},
             checkpoint_id=tmp_path / "titan", no_dist=True)
    convert_checkpoint(tmp_path / "titan", tmp_path / "again", to="dcp", model=LLAMA)
    again = adamw(root)
    flat = get_optimizer_state_dict(root, again, options=options)
    flat = {k: v.clone() if isinstance(v, torch.Tensor) else None for k, v in flat.items()}
    dcp.load({"optimizer": flat}, checkpoint_id=tmp_path / "again", no_dist=True)
    set_optimizer_state_dict(root, again, flat, options=options)
    assert again.state_dict()["param_groups"] == first.state_dict()["param_groups"]

    with pytest.raises(ConvertError) as refused:
        convert_checkpoint(tmp_path / "titan", tmp_path / "mcore", to="mcore", model=LLAMA)
    message = str(refused.value)
    assert "\n" not in message and "differ" in message and "--drop-optimizer" in message
    assert "'lr': 0.01" in message and "'lr': 0.001" in message, message
    assert message.startswith(f"{tmp_path / 'titan'}: "), message  # the source, at fault
    assert not (tmp_path / "mcore").exists()

    key = "optimizer.param_groups.layers.0.attention.qkv_linear.wq.weight.lr"
    metadata = dcp.FileSystemReader(tmp_path / "again").read_metadata()
    info = metadata.storage_data[MetadataIndex(key)]
    with open(tmp_path / "again" / info.relative_path, "r+b") as file:
        file.seek(info.offset + info.length - 40)  # inside the pickled float's bytes
        byte = file.read(1)
        file.seek(-1, 1)
        file.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ConvertError) as damaged:
        convert_checkpoint(tmp_path / "again", tmp_path / "pre", to="pretrain")
    assert "checksum mismatch" in str(damaged.value) and repr(key) in str(damaged.value)


def test_torchtitan_optimizer_state_to_pretrain_and_back(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from mt_checkpoint import load_rank, read_meta
    from mt_zero import consolidate

    root = _titan_module()
    settings = {"lr": 1e-2, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.05}
    adamw = torch.optim.AdamW(root.parameters(), **settings)
    _train(root, adamw, 3)  # three real steps: moments and step counts worth carrying
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    saved = {**get_model_state_dict(root), "optimizer": get_optimizer_state_dict(
        root, adamw, options=options)}
    # torchtitan (0.3) saves its Trainer's and its LRSchedulersContainer's state beside them
    progress = {"train_state": {"step": 3, "ntokens_seen": 96},
                "lr_scheduler": {"last_epoch": 3}}
    dcp.save({**saved, **progress}, checkpoint_id=tmp_path / "titan", no_dist=True)
    titan = convert_checkpoint(tmp_path / "titan", tmp_path / "pre", to="pretrain",
                               model=LLAMA)
    meta = read_meta(tmp_path / "pre")  # mt's schedule follows its own loader's samples
    assert (meta.step, meta.data_step, meta.consumed_samples) == (0, 0, 0)
    assert len(titan.notes) == 1 and "had trained 3 steps, 96 tokens" in titan.notes[0]
    full = consolidate([load_rank(tmp_path / "pre", 0)["optimizer"]])
    theirs = adamw.state_dict()["state"]
    index = {name: i for i, (name, _) in enumerate(root.named_parameters())}
    wq = theirs[index["layers.1.attention.qkv_linear.wq.weight"]]
    ours = full["state"]["blocks.1.attn.q.weight"]
    assert torch.equal(ours["sharded"]["exp_avg"], from_interleaved(wq["exp_avg"], 4))
    assert torch.equal(ours["sharded"]["exp_avg_sq"], from_interleaved(wq["exp_avg_sq"], 4))
    assert float(ours["replicated"]["step"]) == 3.0
    up, gate = (theirs[index[f"layers.0.feed_forward.{w}.weight"]]["exp_avg"]
                for w in ("w3", "w1"))
    assert torch.equal(full["state"]["blocks.0.mlp.fc.weight"]["sharded"]["exp_avg"],
                       torch.cat([gate, up]))  # mt's fused [gate; up]
    convert_checkpoint(tmp_path / "titan", tmp_path / "fresh", to="pretrain", model=LLAMA,
                       drop_optimizer=True)
    fresh = consolidate([load_rank(tmp_path / "fresh", 0)["optimizer"]])
    assert fresh["state"]["blocks.1.attn.q.weight"]["sharded"] == {}
    assert read_meta(tmp_path / "fresh").step == 0  # a new run: its schedule from the start

    groups = full["param_groups"]  # matrices' group, then the rest's: both torchtitan's one
    assert [{k: group[k] for k in settings} for group in groups] == [settings, settings]

    # And back: pretrain -> DCP writes the state under torch's flattened optimizer keys;
    # torch loads it, param groups included (a load that requires every key of the state
    # dict), into a fresh AdamW of default settings and the same module tree: every tensor
    # of the first AdamW's state, bit for bit (the RoPE row permutation undone on the way),
    # and its settings.
    result = convert_checkpoint(tmp_path / "pre", tmp_path / "back", to="dcp")
    assert result.notes == ()
    again = torch.optim.AdamW(root.parameters())
    flat = get_optimizer_state_dict(root, again, options=options)
    wanted = {"optimizer": {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None
                            for k, v in flat.items()},
              "train_state": {"step": -1, "ntokens_seen": -1}, "lr_scheduler": {"last_epoch": -1}}
    dcp.load(wanted, checkpoint_id=tmp_path / "back", no_dist=True)
    # mt's step folder starts a new schedule (step 0), and torchtitan would resume it there
    assert (wanted["train_state"], wanted["lr_scheduler"]) == (
        {"step": 0, "ntokens_seen": 0}, {"last_epoch": 0})
    # torchtitan's own progress goes from one DCP folder to another as torchtitan loads it
    convert_checkpoint(tmp_path / "titan", tmp_path / "titan2", to="dcp", model=LLAMA)
    resumed = {"train_state": {"step": 0, "ntokens_seen": 0}, "lr_scheduler": {"last_epoch": 0}}
    dcp.load(resumed, checkpoint_id=tmp_path / "titan2", no_dist=True)
    assert resumed == progress
    # torchtitan's LRSchedulersContainer.load_state_dict: last_epoch set, the lr recomputed
    warmup = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW(root.parameters(), lr=1.0),
                                                lambda step: min(1.0, (step + 1) / 10))
    warmup.last_epoch = resumed["lr_scheduler"]["last_epoch"]
    assert warmup.get_lr() == [0.4]  # step 3 of a 10-step warmup, where the source stopped
    set_optimizer_state_dict(root, again, wanted["optimizer"], options=options)
    loaded = again.state_dict()["state"]
    assert loaded.keys() == theirs.keys()
    for index_, state_ in theirs.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(loaded[index_][key], state_[key]), (index_, key)
    assert again.state_dict()["param_groups"] == adamw.state_dict()["param_groups"]
    assert flat["param_groups.norm.weight.lr"] == 1e-3  # the default it replaced

    # A source that records no settings (torchtitan's state, its param groups cut out):
    # torch AdamW's defaults are written, and the conversion says so.
    entries = dcp.FileSystemReader(tmp_path / "titan").read_metadata().state_dict_metadata
    (tmp_path / "bare").mkdir()
    bare = {k: v for k, v in saved["optimizer"].items() if not k.startswith("param_groups.")}
    dcp.save({**get_model_state_dict(root), "optimizer": bare},
             checkpoint_id=tmp_path / "bare", no_dist=True)
    assert any(".param_groups." in key for key in entries)
    noted = convert_checkpoint(tmp_path / "bare", tmp_path / "defaults", to="dcp", model=LLAMA)
    assert len(noted.notes) == 2 and "torch AdamW's defaults" in noted.notes[0]
    assert "no training step" in noted.notes[1]  # no train_state either
    convert_checkpoint(tmp_path / "pre", tmp_path / "weights", to="dcp", drop_optimizer=True)
    stored = dcp.FileSystemReader(tmp_path / "weights").read_metadata().state_dict_metadata
    assert stored and not any(key.startswith("optimizer.") for key in stored)


def test_torchtitan_training_progress_of_each_version(tmp_path: Path) -> None:
    """The step torchtitan recorded, as each version saves it: 0.3's plain ints, an earlier
    ``train_state`` (an int32 tensor step beside pickled loss lists) and a bare LambdaLR
    state; a count that is not one is refused in one line naming the entry."""
    import io

    def saved(name: str, extra: dict[str, object]) -> Path:
        dcp.save({**titan_state(LLAMA), **extra}, checkpoint_id=tmp_path / name, no_dist=True)
        return tmp_path / name

    def progress(folder: Path) -> object:
        with open_checkpoint(folder, model=LLAMA) as reader:
            return reader.progress()

    losses = io.BytesIO()
    torch.save([2.5, 2.25], losses)
    early = saved("early", {"train_state": {"step": torch.tensor(5, dtype=torch.int32),
                                            "global_avg_losses": losses}})
    scheduler = saved("scheduler", {"lr_scheduler": {"last_epoch": 7, "base_lrs": [3e-4],
                                                     "_step_count": 8}})
    current = saved("current", {"train_state": {"step": 9, "ntokens_seen": 4608},
                                "lr_scheduler": {"last_epoch": 9}})
    assert [(p.step, p.tokens) for p in map(progress, (early, scheduler, current))] == [
        (5, None), (7, None), (9, 4608)]
    assert progress(saved("weights", {})) is None
    for name, bad in (("negative", -1), ("fraction", 2.5)):
        folder = saved(name, {"train_state": {"step": bad, "ntokens_seen": 0}})
        with pytest.raises(ConvertError) as refused:
            progress(folder)
        message = str(refused.value)
        assert "\n" not in message and "train_state.step is" in message, message
        assert repr(bad) in message and str(folder) in message, message


def test_a_folder_reads_from_several_threads_at_once(tmp_path: Path) -> None:
    """The converter reads ahead on a thread of its own: chunks read at once from several
    threads are the chunks ``dcp.save`` wrote."""
    from concurrent.futures import ThreadPoolExecutor

    from mt_formats.dcp import DCPFolder

    generator = torch.Generator().manual_seed(7)
    state = {f"t{i}": torch.randn(97 + 31 * i, 13 + i, generator=generator) for i in range(40)}
    dcp.save(state, checkpoint_id=tmp_path / "many", no_dist=True)
    folder = DCPFolder(tmp_path / "many")
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            loaded = dict(zip(state, pool.map(folder.load, state), strict=True))
            for key, tensor in state.items():
                assert torch.equal(loaded[key], tensor), key


def test_compressed_reads_from_two_threads_leave_the_warning_filters_as_they_were(
        tmp_path: Path) -> None:
    """A compressed folder carrying Adam's state, converted to DCP: the weights are read on
    the converter's read-ahead thread while the writer reads the moments on its own, both
    through ``dcp.load`` (whose "single process" warning is silenced around each call).
    Afterwards the process's warning filters are those it had: none silences every warning
    for good. (A tiny switch interval makes the threads interleave at every few bytecodes.)"""
    import sys
    import warnings

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    generator = torch.Generator().manual_seed(5)
    state = titan_state(LLAMA)
    saved = dict(state)
    for key, tensor in state.items():
        saved[f"optimizer.state.{key}.exp_avg"] = torch.randn(tensor.shape, generator=generator)
        saved[f"optimizer.state.{key}.exp_avg_sq"] = torch.rand(tensor.shape, generator=generator)
        saved[f"optimizer.state.{key}.step"] = torch.tensor(3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp.save's own "single process" warning
        dcp.save(saved, storage_writer=FileSystemWriter(tmp_path / "zst",
                                                        _extensions=[ZStandard()]), no_dist=True)
    before = list(warnings.filters)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        changed = 0
        for run in range(10):
            convert_checkpoint(tmp_path / "zst", tmp_path / f"out{run}", to="dcp", model=LLAMA)
            changed += warnings.filters != before
            warnings.filters[:] = before
    finally:
        sys.setswitchinterval(interval)
    assert changed == 0, f"{changed} of 10 conversions left the warning filters changed"
    with open_checkpoint(tmp_path / "out0") as out:
        moments = out.optimizer_state(out.names()[0])
        assert moments is not None and int(moments["step"]) == 3


def test_a_written_folder_reads_back_from_disk(tmp_path: Path) -> None:
    """The data file is written past the page cache (whole blocks directly, the ends of
    each ``torch.save`` record buffered): dropped from the cache, what the disk holds is
    what was saved, every tensor's recorded checksum checked on the way back."""
    import os

    model = GPT(preset("tiny"), seed=3)
    save_model(model, tmp_path / "dcp", to="dcp")
    for path in (tmp_path / "dcp").iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    back = load_model(tmp_path / "dcp")
    for (name, a), b in zip(model.state_dict().items(), back.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_metadata_that_misstates_a_chunk_is_one_line_naming_it(tmp_path: Path) -> None:
    """A .metadata (valid pickle) whose dtype of a tensor differs from its stored chunk's, or
    whose storage entry names no file: refused in one line naming .metadata's claim, neither
    read as the other dtype nor blamed on the destination."""
    model = GPT(preset("tiny"), seed=2)
    folder = tmp_path / "plain"
    dcp.save(model.state_dict(), checkpoint_id=folder, no_dist=True)
    original = (folder / ".metadata").read_bytes()
    metadata = pickle.loads(original)
    properties = metadata.state_dict_metadata["blocks.0.attn.proj.weight"].properties
    properties.dtype = torch.float16
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    fields = {"n_heads": 4}
    with open_checkpoint(folder, model=fields) as reader, pytest.raises(
            ConvertError, match=r"__0_0\.distcp: tensor 'blocks\.0\.attn\.proj\.weight': chunk "
            r"at \[0, 0\] holds float32, \.metadata records float16"):
        reader.read("blocks.0.attn.proj.weight")
    with pytest.raises(ConvertError) as err:
        convert_checkpoint(folder, tmp_path / "out", model=fields)
    assert "partial" not in str(err.value) and "float16" in str(err.value)
    metadata = pickle.loads(original)
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].relative_path = index  # what a damaged pickle memo yields
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ConvertError, match=rf"\.metadata: tensor {index.fqn!r}: its storage "
                       "entry names no file"):
        open_checkpoint(folder, model=fields)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("entry", "value", "said"), [
    ("step", torch.tensor(float("nan")), "Adam's step is nan, not a whole number >= 0"),
    ("step", torch.tensor(-2.0), "Adam's step is -2.0, not a whole number >= 0"),
    ("step", torch.tensor(2.5), "Adam's step is 2.5, not a whole number >= 0"),
    ("step", torch.ones(2), "Adam's step is a tensor of shape [2], not a whole number"),
    ("lr", float("nan"), "param group lr is nan, not a finite number >= 0"),
    ("eps", -1e-8, "param group eps is -1e-08, not a finite number >= 0"),
    ("betas", (0.9, 1.5), "param group betas is (0.9, 1.5), not a finite number in [0, 1)"),
])
def test_adam_steps_and_settings_out_of_range_are_one_line(tmp_path: Path, entry: str,
                                                            value: Any, said: str) -> None:
    """Adam's step count (a whole number >= 0) and its settings (finite, in torch AdamW's
    range) of a DCP folder are checked when read: a NaN step would reach the bias
    correction of the next update, and a run resumed from it would end in "loss is nan",
    pointing at the learning rate. Each is refused in one line naming the file and the
    value, for every target that carries Adam's state."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    root = _titan_module()
    adamw = torch.optim.AdamW(root.parameters(), lr=1e-2)
    _train(root, adamw, 1)
    flat = get_optimizer_state_dict(root, adamw,
                                    options=StateDictOptions(flatten_optimizer_state_dict=True))
    key = next(k for k in flat if k.endswith(f".{entry}"))
    flat[key] = value
    dcp.save({**get_model_state_dict(root), "optimizer": flat},
             checkpoint_id=tmp_path / "titan", no_dist=True)
    for to in ("pretrain", "mcore"):
        with pytest.raises(ConvertError) as refused:
            convert_checkpoint(tmp_path / "titan", tmp_path / to, to=to, model=LLAMA)
        message = str(refused.value)
        assert "\n" not in message and message.startswith(str(tmp_path / "titan")), message
        assert said in message, message
        assert not (tmp_path / to).exists()
