"""Token id ranges and outputs, on real files: Megatron import never wraps ids, index.json
records and checks the largest id, broken .bin/.idx pairs are refused, writes are atomic."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from mt_data.cli import app
from mt_data.corpus import iter_corpus
from mt_data.errors import DatasetError
from mt_data.gpt_dataset import GPTDataset
from mt_data.megatron import MegatronReader, encode_index, export_megatron, import_megatron
from mt_data.shards import ShardSetWriter, TokenDataset
from mt_data.tokenizer import load_tokenizer

runner = CliRunner()
TOK_1K = load_tokenizer("tokenizer-1k").describe()


def _megatron(prefix: Path, docs: list[list[int]], dtype: type = np.int32) -> None:
    """A real MMIDIDX pair, one sequence per document."""
    ids = [np.array(d, dtype) for d in docs]
    Path(f"{prefix}.bin").write_bytes(np.concatenate(ids).tobytes() if ids else b"")
    Path(f"{prefix}.idx").write_bytes(encode_index(np.dtype(dtype), [len(d) for d in docs],
                                                   np.arange(len(docs) + 1)))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The whole embedded corpus tokenized with tokenizer-1k, in 3 shards."""
    tok = load_tokenizer("tokenizer-1k")
    docs = list(iter_corpus())
    batch = tok.encode_batch([d["text"] for d in docs])
    out = tmp_path_factory.mktemp("ds")
    writer = ShardSetWriter(out, tok.describe(), tok.dtype.name)
    ends = np.concatenate([[0], np.cumsum(batch.lengths)])
    for k, (a, b) in enumerate([(0, 60), (60, 120), (120, len(docs))]):
        writer.add(f"shard-{k:05d}.arrow", batch.tokens[ends[a] : ends[b]], batch.lengths[a:b],
                   [d["id"] for d in docs[a:b]], [d["source"] for d in docs[a:b]])
    writer.finish()
    return out


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.glob("*.arrow"):
        (dst / f.name).write_bytes(f.read_bytes())
    (dst / "index.json").write_bytes((src / "index.json").read_bytes())
    return dst


def test_import_refuses_ids_outside_the_vocabulary(tmp_path: Path) -> None:
    prefix = tmp_path / "big"
    _megatron(prefix, [[5, 7, 0], [3, 70_000, 0]])  # 70000 wrapped to 4464 in uint16 before
    with pytest.raises(DatasetError) as info:
        import_megatron(prefix, tmp_path / "out", TOK_1K)
    assert str(info.value) == (
        f"{prefix}.bin: token id 70000 (int32) in document 1 is outside the vocabulary of "
        f"tokenizer 'tokenizer-1k' (1000 ids): import with the --tokenizer the ids come from")
    assert not (tmp_path / "out" / "index.json").exists()  # checked before anything is written
    _megatron(tmp_path / "neg", [[5, -3, 0]])
    with pytest.raises(DatasetError, match=r"neg\.bin: token id -3 \(int32\) in document 0 "):
        import_megatron(tmp_path / "neg", tmp_path / "out2", TOK_1K)
    result = runner.invoke(app, ["import-megatron", str(prefix), str(tmp_path / "out3")],
                           env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert (f"error: {prefix}.bin: token id 70000 (int32) in document 1 is outside the "
            f"vocabulary of tokenizer 'gpt2' (50257 ids)") in result.output


def test_import_keeps_large_ids_exact(tmp_path: Path) -> None:
    docs = [[5, 7, 0], [3, 70_000, 99_999, 0], [65_535, 0]]
    _megatron(tmp_path / "big", docs)
    tokenizer = {"name": "big-vocab", "vocab_size": 100_000, "eod_id": 0}
    index = import_megatron(tmp_path / "big", tmp_path / "out", tokenizer)
    assert index["dtype"] == "uint32" and index["max_token_id"] == 99_999
    ds = TokenDataset(tmp_path / "out", verify=True)
    assert [ds.document(i).tolist() for i in range(len(ds))] == docs
    assert ds.max_token_id == 99_999
    # Ids up to 65535 with a vocabulary of 65536 fit uint16 exactly.
    _megatron(tmp_path / "edge", [[65_535, 1, 0]])
    index = import_megatron(tmp_path / "edge", tmp_path / "out2",
                            {"name": "v64k", "vocab_size": 65_536, "eod_id": 0})
    assert index["dtype"] == "uint16" and index["max_token_id"] == 65_535
    assert TokenDataset(tmp_path / "out2").document(0).tolist() == [65_535, 1, 0]


def test_broken_megatron_pairs_are_refused(dataset: Path, tmp_path: Path) -> None:
    export_megatron(dataset, tmp_path / "mg")
    bin_path = tmp_path / "mg.bin"
    size = bin_path.stat().st_size
    bin_path.write_bytes(bin_path.read_bytes()[:-10])
    expected = (f"{bin_path}: {size - 10} bytes but {tmp_path / 'mg'}.idx describes {size} (a "
                f"truncated .bin, or one of another .idx)")
    with pytest.raises(DatasetError) as info:
        MegatronReader(tmp_path / "mg")
    assert str(info.value) == expected
    result = runner.invoke(app, ["import-megatron", str(tmp_path / "mg"), str(tmp_path / "o"),
                                 "--tokenizer", "tokenizer-1k"], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and f"error: {expected}\n" in result.output
    _megatron(tmp_path / "none", [])
    with pytest.raises(DatasetError, match=r"none\.idx: holds no documents"):
        import_megatron(tmp_path / "none", tmp_path / "o2", TOK_1K)
    (tmp_path / "short.idx").write_bytes(b"MMIDIDX")
    (tmp_path / "short.bin").write_bytes(b"")
    with pytest.raises(DatasetError, match="7 bytes is too short for an MMIDIDX header"):
        MegatronReader(tmp_path / "short")


def test_index_records_the_largest_token_id(dataset: Path) -> None:
    index = json.loads((dataset / "index.json").read_text())
    ds = TokenDataset(dataset, verify=True)
    every = np.concatenate([ds.document(i) for i in range(len(ds))])
    assert index["max_token_id"] == int(every.max()) == ds.max_token_id
    assert ds.max_token_id < ds.tokenizer["vocab_size"] == 1000
    ends = np.cumsum(ds.doc_lengths)
    for shard, (a, b) in zip(index["shards"], [(0, 60), (60, 120), (120, len(ds))]):
        lo = int(ends[a - 1]) if a else 0
        assert shard["max_token_id"] == int(every[lo : int(ends[b - 1])].max())
    assert GPTDataset(ds, 64, cache=False).max_token_id == ds.max_token_id
    result = runner.invoke(app, ["inspect", str(dataset), "--verify"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "max token id" in result.output
    assert f"{ds.max_token_id:,}" in result.output


def test_resumed_shards_of_an_older_run_get_their_largest_id(dataset: Path,
                                                             tmp_path: Path) -> None:
    """Shards logged in progress.jsonl without max_token_id (an older run) are read once."""
    ds = TokenDataset(dataset)
    out = tmp_path / "resume"
    writer = ShardSetWriter(out, ds.tokenizer, "uint16")
    writer.add("shard-00000.arrow", np.concatenate([ds.document(i) for i in range(60)]),
               ds.doc_lengths[:60], [str(i) for i in range(60)], ["x"] * 60)
    progress = out / "progress.jsonl"
    entries = [json.loads(line) for line in progress.read_text().splitlines()]
    progress.write_text("".join(json.dumps({k: v for k, v in e.items() if k != "max_token_id"})
                                + "\n" for e in entries))
    index = ShardSetWriter(out, ds.tokenizer, "uint16", resume=True).finish()
    expected = int(np.concatenate([ds.document(i) for i in range(60)]).max())
    assert index["max_token_id"] == expected == index["shards"][0]["max_token_id"]


def test_opening_checks_the_recorded_largest_id(dataset: Path, tmp_path: Path) -> None:
    real = TokenDataset(dataset).max_token_id
    index = json.loads((dataset / "index.json").read_text())

    def variant(name: str, top: object, shards: object) -> Path:
        folder = _copy(dataset, tmp_path / name)
        data = json.loads(json.dumps(index))
        for shard in data["shards"]:
            if shards is None:
                shard.pop("max_token_id")
            elif shard["max_token_id"] == real:  # the shard(s) holding the largest id
                shard["max_token_id"] = shards
        if top is None:
            data.pop("max_token_id")
        else:
            data["max_token_id"] = top
        (folder / "index.json").write_text(json.dumps(data))
        return folder

    folder = variant("vocab", 1000, 1000)  # ids of 1000 cannot come from a 1000-id tokenizer
    with pytest.raises(DatasetError) as info:
        TokenDataset(folder)
    assert str(info.value) == (f"{folder / 'index.json'}: token id 1000 is outside the "
                               f"vocabulary of tokenizer 'tokenizer-1k' (1000 ids)")
    folder = variant("disagree", real + 1, real)
    with pytest.raises(DatasetError) as info:
        TokenDataset(folder)
    assert str(info.value) == (f"{folder / 'index.json'}: max_token_id {real + 1} disagrees "
                               f"with its shards' largest id {real}")
    folder = variant("understated", real - 1, real - 1)
    assert TokenDataset(folder).max_token_id == real - 1  # opening reads no token
    with pytest.raises(DatasetError, match=rf"shard-0000\d\.arrow: largest token id is {real} "
                                           rf"but index\.json records {real - 1}"):
        TokenDataset(folder, verify=True)
    result = runner.invoke(app, ["inspect", str(folder), "--verify"], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "but index.json records" in result.output
    folder = variant("garbage", "many", None)
    with pytest.raises(DatasetError, match="max_token_id must be an integer >= -1, got 'many'"):
        TokenDataset(folder)
    # A dataset written before the key existed: computed from the shards once, then cached.
    folder = variant("old", None, None)
    assert TokenDataset(folder).max_token_id == real
    cached = json.loads((folder / "cache" / "max-token-id.json").read_text())
    assert cached == {"shards": [s["sha256"] for s in index["shards"]], "max_token_id": real}
    (folder / "cache" / "max-token-id.json").write_text(json.dumps(dict(cached,
                                                                        max_token_id=7)))
    assert TokenDataset(folder).max_token_id == 7  # read back, not recomputed


def test_cut_or_missing_shard_is_named(dataset: Path, tmp_path: Path) -> None:
    folder = _copy(dataset, tmp_path / "cut")
    shard = folder / "shard-00001.arrow"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(DatasetError, match=rf"^{shard}: unreadable shard \("):
        TokenDataset(folder)
    shard.unlink()
    result = runner.invoke(app, ["inspect", str(folder)], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and f"error: {shard}: unreadable shard (" in result.output


def test_outputs_are_whole_and_leave_no_temporaries(dataset: Path, tmp_path: Path) -> None:
    export_megatron(dataset, tmp_path / "mg")
    first = (tmp_path / "mg.idx").read_bytes()
    small = tmp_path / "small"
    _copy(dataset, small)
    export_megatron(dataset, tmp_path / "mg")  # replacing an existing pair
    assert (tmp_path / "mg.idx").read_bytes() == first
    import_megatron(tmp_path / "mg", tmp_path / "back", TOK_1K)
    load_tokenizer("tokenizer-1k").save(tmp_path / "tok.json")
    assert load_tokenizer(tmp_path / "tok.json").vocab_size == 1000
    assert not [p for p in tmp_path.rglob(".*") if ".tmp" in p.name]
    # A cache file cut short (say by a power cut before this fix) is rebuilt, not fatal.
    ds = GPTDataset(small, 64, seed=3)
    cache = next((small / "cache").glob("gpt-train-*.npz"))
    cache.write_bytes(cache.read_bytes()[:100])
    again = GPTDataset(small, 64, seed=3)
    np.testing.assert_array_equal(again[5], ds[5])
    assert np.load(cache)["epochs"] == ds.epochs  # and written again whole


def _swap_shard(folder: Path, batch: pa.RecordBatch | None) -> Path:
    """Replace the dataset's first shard with an Arrow file holding ``batch`` (None: no
    batch at all); returns the shard's path."""
    shard = folder / "shard-00000.arrow"
    schema = batch.schema if batch is not None else pa.schema([("tokens", pa.list_(pa.uint16()))])
    with pa.ipc.new_file(str(shard), schema) as writer:
        if batch is not None:
            writer.write_batch(batch)
    return shard


def test_foreign_shard_is_named_not_read(dataset: Path, tmp_path: Path) -> None:
    """A valid Arrow file that is not the shard index.json records (no tokens column, tokens
    of another type, other counts, no batch) is one line naming it, never a traceback nor
    other documents shown as the dataset's."""
    text = pa.array(["a", "b"])
    cases = {
        "no-tokens": (pa.record_batch({"text": text}), "no 'tokens' column"),
        "text-tokens": (pa.record_batch({"tokens": text, "id": text, "source": text}),
                        "'tokens' is string"),
        "wide-tokens": (pa.record_batch({"tokens": pa.array([[1, 2], [3]], pa.list_(pa.int64())),
                                         "id": text, "source": text}),
                        "'tokens' is list<item: int64>"),
        "other-counts": (pa.record_batch({"tokens": pa.array([[1, 2], [3]],
                                                             pa.list_(pa.uint16())),
                                          "id": text, "source": text}),
                         "holds 2 documents and 3 tokens"),
        "no-batch": (None, "holds no record batch"),
    }
    for name, (batch, why) in cases.items():
        shard = _swap_shard(_copy(dataset, tmp_path / name), batch)
        with pytest.raises(DatasetError) as info:
            TokenDataset(shard.parent)
        assert str(info.value).startswith(f"{shard}: ") and why in str(info.value), name
        result = runner.invoke(app, ["inspect", str(shard.parent)], env={"COLUMNS": "300"})
        assert result.exit_code == 2 and f"error: {shard}: " in result.output, name
        assert result.exception is None or isinstance(result.exception, SystemExit), name
