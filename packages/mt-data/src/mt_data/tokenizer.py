"""Tokenizers: GPT-2 BPE from vocab/merges, any HF ``tokenizer.json``, or a freshly trained one.

Every tokenizer is wrapped in :class:`Tokenizer`, which knows its end-of-document (EOD) token
and encodes batches of documents straight into one flat numpy array plus per-document lengths,
the layout the token shards store.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from itertools import chain
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from mt_data.errors import DataError
from mt_data.fastbpe import FastByteLevelBPE, bytes_to_unicode, is_gpt2_style
from mt_data.shards import atomic_write_bytes

EOD_TOKEN = "<|endoftext|>"
BUILTIN = ("gpt2", "tokenizer-1k")


_BYTE_OF = {char: byte for byte, char in bytes_to_unicode().items()}
"""ByteLevel's printable symbol -> the byte it stands for."""
_FALLBACK_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
"""A byte-fallback token's piece (a byte no other token holds)."""

class TokenizerError(DataError, ValueError):
    """A tokenizer could not be loaded or trained."""


@dataclass(frozen=True)
class EncodedBatch:
    """Token ids of several documents: ``tokens`` flat, ``lengths[i]`` tokens per document."""

    tokens: np.ndarray
    lengths: np.ndarray

    def documents(self) -> list[np.ndarray]:
        """Split the flat ids back into one array per document."""
        return np.split(self.tokens, np.cumsum(self.lengths)[:-1]) if len(self.lengths) else []


class Tokenizer:
    """A byte-level BPE tokenizer with an end-of-document token.

    Args:
        backend: the HF ``tokenizers.Tokenizer``.
        name: a short name recorded in shard indexes (``gpt2``, a file path, ...).
        eod_token: the token appended after every document.
    """

    def __init__(self, backend: HFTokenizer, name: str, eod_token: str = EOD_TOKEN) -> None:
        eod_id = backend.token_to_id(eod_token)
        if eod_id is None:
            raise TokenizerError(f"tokenizer {name!r} has no end-of-document token {eod_token!r}")
        self.backend = backend
        self.name = name
        self.eod_token = eod_token
        self.eod_id = int(eod_id)
        self._fast: FastByteLevelBPE | None = None
        self._fingerprint: str | None = None
        self.fast = is_gpt2_style(backend)
        """Use the exact cached encoder (GPT-2 style pipelines only; see ``mt_data.fastbpe``)."""

    @property
    def vocab_size(self) -> int:
        """Number of ids, added special tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the tokenizer's canonical JSON (``tokenizers``' ``to_str``): the same
        for the same vocabulary, merges, pipeline and special tokens, however they were loaded
        (``gpt2``, its vocab.json + merges.txt, or the tokenizer.json it saves)."""
        if self._fingerprint is None:
            text = self.backend.to_str().encode("utf-8")
            self._fingerprint = hashlib.sha256(text).hexdigest()
        return self._fingerprint

    @property
    def dtype(self) -> np.dtype:
        """Smallest unsigned dtype holding every id (uint16 up to 65536 ids)."""
        return np.dtype(np.uint16 if self.vocab_size <= 65536 else np.uint32)

    def encode(self, text: str, append_eod: bool = False) -> list[int]:
        """Token ids of one text, optionally followed by the EOD id."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ids + [self.eod_id] if append_eod else ids

    def encode_batch(self, texts: Sequence[str], append_eod: bool = True) -> EncodedBatch:
        """Encode many documents; EOD appended to each by default.

        GPT-2 style pipelines use the exact cached encoder of :mod:`mt_data.fastbpe` (same ids,
        several times faster on natural text); others use HF's parallel ``encode_batch``.
        """
        if not texts:
            return EncodedBatch(np.zeros(0, self.dtype), np.zeros(0, np.int64))
        if self.fast:
            if self._fast is None:
                self._fast = FastByteLevelBPE(self.backend)
            ids, lengths = self._fast.encode_batch(list(texts))
        else:
            encs = self.backend.encode_batch_fast(list(texts), add_special_tokens=False)
            lengths = np.fromiter((len(e.ids) for e in encs), np.int64, len(encs))
            ids = np.fromiter(chain.from_iterable(e.ids for e in encs), np.int64,
                              int(lengths.sum()))
        if not append_eod:
            return EncodedBatch(ids.astype(self.dtype), lengths)
        # Insert the EOD id after each document: output index of input token j is j + doc(j).
        ends = np.cumsum(lengths)
        tokens = np.empty(len(ids) + len(lengths), dtype=self.dtype)
        doc_of = np.repeat(np.arange(len(lengths)), lengths)
        tokens[np.arange(len(ids)) + doc_of] = ids
        tokens[ends + np.arange(len(lengths))] = self.eod_id
        return EncodedBatch(tokens, lengths + 1)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of a sequence of ids."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token: int) -> bytes:
        """The bytes id ``token`` stands for: a byte-level token may hold part of a
        character's UTF-8 (which ``decode`` of it alone shows as U+FFFD); an added token's
        (``<|endoftext|>``) is its text's UTF-8."""
        piece = self.backend.id_to_token(int(token))
        if piece is None:
            raise TokenizerError(f"tokenizer {self.name!r} has no id {token}")
        byte_level = isinstance(self.backend.decoder, decoders.ByteLevel)
        if not byte_level and (byte := _FALLBACK_BYTE.fullmatch(piece)) is not None:
            return bytes([int(byte[1], 16)])  # SentencePiece's byte fallback
        if int(token) in self.backend.get_added_tokens_decoder():
            return piece.encode("utf-8")
        if byte_level and all(char in _BYTE_OF for char in piece):
            return bytes(_BYTE_OF[char] for char in piece)
        return self.decode([token]).encode("utf-8")  # the text it decodes to

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as a HF ``tokenizer.json`` (atomically)."""
        atomic_write_bytes(Path(path), self.backend.to_str(pretty=True).encode("utf-8"))

    def describe(self) -> dict[str, object]:
        """Metadata recorded in a shard index."""
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "eod_id": self.eod_id,
            "eod_token": self.eod_token,
            "sha256": self.fingerprint,
        }

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"


def _byte_level(vocab: dict[str, int], merges: list[tuple[str, str]]) -> HFTokenizer:
    """A GPT-2 style byte-level BPE pipeline around the given vocabulary and merges."""
    backend = HFTokenizer(models.BPE(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    if EOD_TOKEN in vocab:
        backend.add_special_tokens([EOD_TOKEN])
    return backend


def _read_text(path: Path) -> str:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


def from_vocab_merges(vocab_path: str | Path, merges_path: str | Path, name: str = "") -> Tokenizer:
    """Load a GPT-2 style tokenizer from ``vocab.json`` + ``merges.txt`` (optionally ``.gz``)."""
    try:
        vocab = json.loads(_read_text(Path(vocab_path)))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{vocab_path}: not a readable vocab.json ({exc})") from None
    except RecursionError:
        raise TokenizerError(f"{vocab_path}: not a readable vocab.json (nested too deeply "
                             "to read)") from None
    if not isinstance(vocab, dict):
        raise TokenizerError(f"{vocab_path}: not a vocab.json (a JSON object of token -> id "
                             f"expected, got {type(vocab).__name__})")
    try:
        lines = _read_text(Path(merges_path)).splitlines()
    except (UnicodeDecodeError, EOFError, gzip.BadGzipFile) as exc:
        raise TokenizerError(f"{merges_path}: not a readable merges.txt ({exc})") from None
    merges = []
    for line in lines:
        if line and not line.startswith("#version"):
            left, _, right = line.partition(" ")
            merges.append((left, right))
    try:
        backend = _byte_level(vocab, merges)
    except Exception as exc:  # the tokenizers library raises a bare Exception
        raise TokenizerError(f"{merges_path}: merges that do not fit {vocab_path} "
                             f"({' '.join(str(exc).split())})") from None
    return Tokenizer(backend, name or str(vocab_path))


def gpt2() -> Tokenizer:
    """The GPT-2 BPE tokenizer (vocab 50257, EOD id 50256) from the shipped assets."""
    assets = resources.files("mt_data") / "assets"
    with resources.as_file(assets / "gpt2-vocab.json.gz") as vocab, resources.as_file(
        assets / "gpt2-merges.txt.gz"
    ) as merges:
        return from_vocab_merges(vocab, merges, name="gpt2")


#: The files a tokenizer folder may hold (:func:`load_tokenizer` reads one set of them).
_FOLDER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "encoder.json", "vocab.bpe")


def tokenizer_version(spec: str | Path) -> tuple[tuple[int, int] | None, ...]:
    """(size, CRC-32 of the content) of each file :func:`load_tokenizer` may read for
    ``spec`` (None where there is none; nothing for a built-in tokenizer): a cache of loaded
    tokenizers keyed by it, not by the name alone, loads a file edited since again, even one
    whose size and modification time were kept. (A tokenizer's files are a few MB: hashing
    them takes milliseconds.)"""
    if str(spec) in BUILTIN:
        return ()
    path = Path(spec)
    files = [path / name for name in _FOLDER_FILES] if path.is_dir() else [path]
    stamps: list[tuple[int, int] | None] = []
    for file in files:
        try:
            data = file.read_bytes()
        except OSError:
            stamps.append(None)
        else:
            stamps.append((len(data), zlib.crc32(data)))
    return tuple(stamps)


def load_tokenizer(spec: str | Path = "gpt2") -> Tokenizer:
    """Load a tokenizer.

    ``spec`` is ``gpt2`` (shipped GPT-2 BPE), ``tokenizer-1k`` (shipped 1000-id BPE trained on
    the embedded corpus, used by the ``tiny`` preset), a HF ``tokenizer.json`` file, or a folder
    holding ``tokenizer.json`` or GPT-2 style ``vocab.json`` + ``merges.txt``.
    """
    text = str(spec)
    if text == "gpt2":
        return gpt2()
    if text == "tokenizer-1k":
        asset = resources.files("mt_data") / "assets" / "tokenizer-1k.json"
        return Tokenizer(HFTokenizer.from_str(asset.read_text(encoding="utf-8")), "tokenizer-1k")
    path = Path(spec)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            path = path / "tokenizer.json"
        else:
            for vocab, merges in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
                if (path / vocab).is_file() and (path / merges).is_file():
                    return from_vocab_merges(path / vocab, path / merges,
                                            name=str(path.resolve()))
            raise TokenizerError(
                f"{path} holds neither tokenizer.json nor vocab.json + merges.txt"
            )
    if not path.is_file():
        raise TokenizerError(
            f"no tokenizer at {text!r}: expected one of {BUILTIN}, a tokenizer.json or a folder"
        )
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises a bare Exception
        raise TokenizerError(f"{path}: not a readable tokenizer.json ({exc})") from None
    return Tokenizer(backend, str(path.resolve()))


def recorded_tokenizer(record: Mapping[str, object], where: str) -> Tokenizer:
    """The tokenizer ``record`` (a dataset index's ``tokenizer``: name, vocab_size, eod_id,
    sha256) names, loaded and checked to be the one recorded: a tokenizer file edited or
    replaced since is refused, in one line naming ``where`` (the dataset)."""
    name = str(record.get("name") or "")
    try:
        tokenizer = load_tokenizer(name)
    except TokenizerError as err:
        raise TokenizerError(f"{where} records tokenizer {name!r}, which does not load: "
                             f"{err}") from None
    if why := tokenizer_differs(record, tokenizer.describe(), names=False):
        raise TokenizerError(f"{where} records tokenizer {name!r}, but the tokenizer there now "
                             f"is another one ({why}): restore it, or prepare the data again")
    return tokenizer


def tokenizer_differs(a: Mapping[str, object], b: Mapping[str, object],
                      names: bool = True) -> str | None:
    """Why two recorded tokenizers (index.json's ``tokenizer``, :meth:`Tokenizer.describe`)
    are not the same one, or None. Their SHA-256 decides where both record one; without it
    (datasets prepared before it was recorded) their vocabulary size, end-of-document id
    and (with ``names``) name must all agree."""
    if a.get("sha256") and b.get("sha256"):
        if a["sha256"] != b["sha256"]:
            return f"sha256 {str(a['sha256'])[:12]}... against {str(b['sha256'])[:12]}..."
        return None
    for key in ("vocab_size", "eod_id", "name") if names else ("vocab_size", "eod_id"):
        if key in a and key in b and a[key] != b[key]:
            return f"{key} {a[key]!r} against {b[key]!r}"
    return None


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, min_frequency: int = 2, name: str = "trained"
) -> Tokenizer:
    """Train a GPT-2 style byte-level BPE on ``texts``; id 0 is the EOD token.

    The initial alphabet is all 256 bytes, so any text can be encoded (no unknown token).
    """
    if vocab_size < 257 + 1:
        raise TokenizerError(
            f"vocab_size {vocab_size} is too small: a byte-level BPE needs 256 byte tokens + 1 "
            f"EOD token = 257, plus at least one merge"
        )
    if vocab_size > 2**32:
        raise TokenizerError(f"vocab_size {vocab_size} is too large: token ids are stored as "
                             f"uint32, so at most 2**32 = {2**32:,}")
    if not 0 <= min_frequency < 2**32:
        raise TokenizerError(f"min_frequency must be between 0 and 2**32 - 1, got "
                             f"{min_frequency}")
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_batched(texts, 1000), trainer=trainer)
    return Tokenizer(backend, name)


def _batched(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
