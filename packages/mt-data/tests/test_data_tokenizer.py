"""Tokenizers on real text: GPT-2 ids, round trips, EOD, training, loading from files."""

from __future__ import annotations

import gzip
import os
import shutil
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from mt_data.corpus import corpus_texts
from mt_data.tokenizer import (
    EOD_TOKEN,
    TokenizerError,
    gpt2,
    load_tokenizer,
    recorded_tokenizer,
    tokenizer_differs,
    tokenizer_version,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return corpus_texts()


def test_gpt2_known_ids() -> None:
    tok = gpt2()
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.vocab_size == 50257
    assert tok.eod_id == 50256
    assert tok.dtype == np.uint16


@pytest.mark.parametrize("name", ["gpt2", "tokenizer-1k"])
def test_round_trip_and_eod(name: str, texts: list[str]) -> None:
    tok = load_tokenizer(name)
    sample = texts[::15]  # Moby-Dick chapters and State of the Union addresses
    batch = tok.encode_batch(sample)
    docs = batch.documents()
    assert len(docs) == len(sample)
    assert int(batch.lengths.sum()) == len(batch.tokens)
    for text, ids in zip(sample, docs, strict=True):
        assert ids[-1] == tok.eod_id  # one EOD per document, at its end
        assert (ids[:-1] != tok.eod_id).all()
        assert tok.decode(ids[:-1]) == text
        assert list(ids[:-1]) == tok.encode(text)
    plain = tok.encode_batch(sample[:2], append_eod=False)
    assert int(plain.lengths.sum()) == int(batch.lengths[:2].sum()) - 2


def test_shipped_tokenizer_1k(texts: list[str]) -> None:
    tok = load_tokenizer("tokenizer-1k")
    assert tok.vocab_size == 1000
    assert tok.eod_id == 0
    # Trained on this corpus it compresses it better than bytes (about 3 bytes per token).
    batch = tok.encode_batch(texts[:20], append_eod=False)
    assert sum(len(t.encode()) for t in texts[:20]) / len(batch.tokens) > 2.5


def test_shipped_tokenizer_1k_is_reproducible(texts: list[str]) -> None:
    # The asset is exactly train_tokenizer(embedded corpus, 1000): provenance is checkable.
    retrained = train_tokenizer(texts, 1000)
    assert retrained.backend.get_vocab() == load_tokenizer("tokenizer-1k").backend.get_vocab()


def test_train_is_deterministic(texts: list[str], tmp_path: Path) -> None:
    a = train_tokenizer(texts[:40], 600)
    b = train_tokenizer(texts[:40], 600)
    assert a.vocab_size == 600
    assert a.backend.get_vocab() == b.backend.get_vocab()
    assert a.encode(EOD_TOKEN) == [0]
    a.save(tmp_path / "tok.json")
    loaded = load_tokenizer(tmp_path / "tok.json")
    assert loaded.encode(texts[50][:2000]) == a.encode(texts[50][:2000])
    # A folder holding tokenizer.json works too.
    shutil.copy(tmp_path / "tok.json", tmp_path / "tokenizer.json")
    assert load_tokenizer(tmp_path).vocab_size == 600


def test_vocab_merges_folder(tmp_path: Path, texts: list[str]) -> None:
    assets = resources.files("mt_data") / "assets"
    for name in ("gpt2-vocab.json", "gpt2-merges.txt"):
        data = gzip.decompress((assets / f"{name}.gz").read_bytes())
        (tmp_path / name.replace("gpt2-", "")).write_bytes(data)
    tok = load_tokenizer(tmp_path)
    assert tok.encode(texts[0][:3000]) == gpt2().encode(texts[0][:3000])


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer"):
        load_tokenizer(tmp_path / "missing.json")
    with pytest.raises(TokenizerError, match="neither"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="257"):
        train_tokenizer(["some text"], 100)


def test_malformed_merges_are_one_line_naming_the_file(tmp_path: Path) -> None:
    assets = resources.files("mt_data") / "assets"
    (tmp_path / "vocab.json").write_bytes(gzip.decompress(
        (assets / "gpt2-vocab.json.gz").read_bytes()))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nĠ t\nnot-a-token zz-not-either\n")
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(tmp_path)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'merges.txt'}: merges that do not fit ")
    assert "\n" not in message
    (tmp_path / "merges.txt").write_bytes(b"\xff\xfe merges")
    with pytest.raises(TokenizerError, match="merges.txt: not a readable merges.txt"):
        load_tokenizer(tmp_path)


def test_fingerprint_names_the_tokenizer_however_it_is_loaded(tmp_path: Path,
                                                               monkeypatch) -> None:
    shipped = gpt2()
    shipped.save(tmp_path / "gpt2.json")
    monkeypatch.chdir(tmp_path)
    saved = load_tokenizer("gpt2.json")  # a relative path, recorded as absolute
    assert saved.name == str(tmp_path / "gpt2.json")
    assert saved.fingerprint == shipped.fingerprint == shipped.describe()["sha256"]
    other = load_tokenizer("tokenizer-1k")
    assert other.fingerprint != shipped.fingerprint
    assert tokenizer_differs(shipped.describe(), saved.describe()) is None
    assert "sha256" in tokenizer_differs(shipped.describe(), other.describe())
    # Records without a fingerprint (datasets prepared before it) compare what they hold.
    old = {k: v for k, v in shipped.describe().items() if k != "sha256"}
    assert tokenizer_differs(old, {**old, "name": "/elsewhere/gpt2.json"}) == \
        "name 'gpt2' against '/elsewhere/gpt2.json'"
    assert tokenizer_differs(old, saved.describe(), names=False) is None


def test_an_edited_tokenizer_is_not_the_recorded_one(tmp_path: Path, texts: list[str]) -> None:
    path = tmp_path / "tok.json"
    train_tokenizer(texts[:50], 400).save(path)
    record = load_tokenizer(path).describe()
    assert recorded_tokenizer(record, "dataset d").fingerprint == record["sha256"]
    train_tokenizer(texts[50:100], 400).save(path)  # the same size, other merges
    with pytest.raises(TokenizerError) as err:
        recorded_tokenizer(record, "dataset d")
    assert str(err.value).startswith(f"dataset d records tokenizer '{path}', but the "
                                     "tokenizer there now is another one (sha256 ")
    path.unlink()
    with pytest.raises(TokenizerError, match="does not load: no tokenizer at"):
        recorded_tokenizer(record, "dataset d")


def test_a_tokenizer_version_follows_its_content(tmp_path: Path, texts: list[str]) -> None:
    """tokenizer_version (the key mt's tokenizer caches use) changes with a file's content,
    even when an edit keeps its size and its modification time (``cp -p``, ``touch -r``);
    built-in tokenizers have none."""
    path = tmp_path / "tok.json"
    train_tokenizer(texts[:50], 400).save(path)
    before, status = tokenizer_version(path), path.stat()
    data = bytearray(path.read_bytes())
    at = data.index(b'"merges"')
    data[at + 1:at + 7] = b"MERGES"  # the same size
    path.write_bytes(bytes(data))
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert path.stat().st_size == status.st_size
    assert path.stat().st_mtime_ns == status.st_mtime_ns
    assert tokenizer_version(path) != before
    assert tokenizer_version("gpt2") == ()
    assert tokenizer_version(tmp_path / "missing.json") == (None,)


TRICKY = [
    "x² + y² = z²", "a\x1cb\x1fc", "end<|endoftext|>start", "emoji 😀 here", "naïve café",
    "中文字符 测试", "tab\tsep  \n  lines\n\n", "it's don't we'll I'd 'S", "_foo_ __bar__",
    "12,345.67 and 3rd", "Ⅻ roman ½", "\u00a0nbsp\u2009thin\u3000ideo", "a\u0085b", "x\u200by",
    "e\u0301 combining", " leading", "trailing  ", "", "   ", "\n", "Ünïcödé Ωmega",
]


@pytest.mark.parametrize("name", ["gpt2", "tokenizer-1k"])
def test_fast_encoder_matches_hf_exactly(name: str, texts: list[str]) -> None:
    fast = load_tokenizer(name)
    slow = load_tokenizer(name)
    slow.fast = False  # the plain HF encode_batch path
    assert fast.fast
    docs = texts[::9] + TRICKY + [texts[0][:500] + t for t in TRICKY]
    a, b = fast.encode_batch(docs), slow.encode_batch(docs)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    for text in TRICKY:  # one at a time too (exercises the all-safe and all-unsafe paths)
        assert list(fast.encode_batch([text], append_eod=False).tokens) == slow.encode(text)


def test_fast_encoder_only_for_gpt2_style(tmp_path: Path) -> None:
    from tokenizers import normalizers

    tok = train_tokenizer(corpus_texts()[:5], 400)
    tok.backend.normalizer = normalizers.Lowercase()
    tok.save(tmp_path / "lower.json")
    lowered = load_tokenizer(tmp_path / "lower.json")
    assert not lowered.fast  # a normalizer: the HF pipeline is used as is
    assert list(lowered.encode_batch(["Call Me"], append_eod=False).tokens) == \
        lowered.encode("call me")


@pytest.mark.parametrize("name", ["gpt2", "tokenizer-1k"])
def test_token_bytes_are_the_text_s_bytes(name: str) -> None:
    """A byte-level token's bytes (part of a character for "日本語", "€"): joined they are
    the text's UTF-8, though each such token decodes alone to U+FFFD; an added token's
    bytes are its text."""
    tokenizer = load_tokenizer(name)
    text = "café 日本語 € naïve"
    ids = tokenizer.encode(text)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    assert tokenizer.token_bytes(tokenizer.eod_id) == b"<|endoftext|>"


def test_token_bytes_of_a_tokenizer_that_is_not_byte_level(tmp_path: Path) -> None:
    """A SentencePiece-style tokenizer (Metaspace pieces, byte fallback): a piece's bytes
    are its text's, not GPT-2's byte table read over it ("é" is one of that table's
    symbols), and a byte-fallback piece ``<0xE6>`` is that byte."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, trainers

    backend = HFTokenizer(models.BPE(byte_fallback=True, unk_token=None))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    alphabet = [f"<0x{i:02X}>" for i in range(256)]
    backend.train_from_iterator(["the café is open", "naïve résumé"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", *alphabet], initial_alphabet=["é"]))
    backend.save(str(tmp_path / "sp.json"))
    tokenizer = load_tokenizer(str(tmp_path / "sp.json"))
    assert tokenizer.token_bytes(backend.token_to_id("é")) == "é".encode()
    assert tokenizer.token_bytes(backend.token_to_id("<0xE6>")) == b"\xe6"
    ids = tokenizer.encode("café 日")  # 日: three byte-fallback pieces
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == "café 日".encode()
