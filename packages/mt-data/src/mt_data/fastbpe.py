"""A faster, exact encoder for GPT-2 style byte-level BPE tokenizers.

Natural text repeats its words (Zipf): 20 MB of English has ~4M pre-tokens but ~100k distinct
ones. This encoder splits text with the GPT-2 pre-tokenization regex (Python ``re``, C speed),
runs the HF BPE model only on pre-tokens it has not seen before, and assembles the ids of a
whole batch with numpy gathers. The ids are identical to the HF pipeline's:

* it is only used for pipelines that are exactly "no normalizer, ByteLevel pre-tokenizer with
  the GPT-2 regex and no prefix space, plain BPE model" (GPT-2 and tokenizers trained here);
* documents containing characters on which Python's ``re`` classes could disagree with the
  Oniguruma classes HF uses (numbers that are not decimal digits such as "²", whitespace
  definitions, characters unassigned in Python's Unicode database, astral characters) or the
  text of an added token (``<|endoftext|>``) are handed to the HF encoder unchanged.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from itertools import chain

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

# GPT-2's pattern, with \p{L} = [^\W\d_] and \p{N} = \d: exact once Nl/No characters are
# excluded (they are routed to the HF encoder).
_PRETOKEN = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by ByteLevel."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _risky_class() -> re.Pattern[str]:
    """Characters whose regex class may differ between Python ``re`` and Oniguruma."""
    onig_space = {*range(0x09, 0x0E), 0x85}
    risky: list[int] = []
    for cp in range(0x10000):
        ch = chr(cp)
        cat = unicodedata.category(ch)
        space = cp in onig_space or cat in ("Zs", "Zl", "Zp")
        if cat in ("Nl", "No", "Cn", "Cs") or space != ch.isspace():
            risky.append(cp)
    ranges, start, prev = [], risky[0], risky[0]
    for cp in risky[1:] + [-1]:
        if cp != prev + 1:
            ranges.append(f"{re.escape(chr(start))}-{re.escape(chr(prev))}")
            start = cp
        prev = cp
    return re.compile("[" + "".join(ranges) + "\U00010000-\U0010ffff]")


def is_gpt2_style(backend: HFTokenizer) -> bool:
    """True when the pipeline is exactly what :class:`FastByteLevelBPE` reproduces."""
    pre, model = backend.pre_tokenizer, backend.model
    return (
        backend.normalizer is None
        and isinstance(pre, pre_tokenizers.ByteLevel)
        and not pre.add_prefix_space
        and pre.use_regex
        and isinstance(model, models.BPE)
        and model.dropout is None
        and not model.continuing_subword_prefix
        and not model.end_of_word_suffix
        and not model.byte_fallback
    )


class _PieceIndex(dict):
    """pre-token -> run index; a missing pre-token is learnt (``learn`` returns its index)."""

    def __init__(self, learn: Callable[[str], int]) -> None:
        super().__init__()
        self.learn = learn

    def __missing__(self, piece: str) -> int:
        index = self[piece] = self.learn(piece)
        return index


class FastByteLevelBPE:
    """Batch encoder with a pre-token cache; falls back to HF for the rare unsafe document."""

    def __init__(self, backend: HFTokenizer) -> None:
        if not is_gpt2_style(backend):
            raise ValueError("tokenizer pipeline is not plain GPT-2 style byte-level BPE")
        self.backend = backend
        self.model = backend.model
        self.byte_map = bytes_to_unicode()
        self._byte_table = {b: ch for b, ch in self.byte_map.items()}  # str.translate table
        self.risky = _risky_class()
        self.added = [t.content for t in backend.get_added_tokens_decoder().values()]
        # Cache: pre-token -> index into a growing table of token-id runs (a miss learns it).
        self.piece_index: dict[str, int] = _PieceIndex(self._learn_one)
        self.run_ids: list[int] = []
        self.run_start: list[int] = [0]
        self._tables: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def _safe(self, text: str) -> bool:
        if self.risky.search(text) is not None:
            return False
        return not any(token in text for token in self.added)

    def _learn_one(self, piece: str) -> int:
        """Encode a new pre-token with the HF model; its index in the run table."""
        # Each UTF-8 byte b -> byte_map[b]: latin-1 decoding gives chr(b), translated.
        mapped = piece.encode("utf-8").decode("latin-1").translate(self._byte_table)
        self.run_ids.extend([tok.id for tok in self.model.tokenize(mapped)])
        self.run_start.append(len(self.run_ids))
        self._tables = None
        return len(self.run_start) - 2

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._tables is None:
            starts = np.asarray(self.run_start, dtype=np.int64)
            self._tables = (np.asarray(self.run_ids, dtype=np.int64), starts[:-1],
                            np.diff(starts))
        return self._tables

    def encode_batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of all texts back to back (int64) and the number of ids of each text."""
        is_safe = [self._safe(t) for t in texts]
        safe = [t for t, ok in zip(texts, is_safe, strict=True) if ok]
        tokens, lengths = self._encode_safe(safe)
        if len(safe) == len(texts):
            return tokens, lengths
        # Rare: interleave the HF encodings of unsafe documents in input order.
        unsafe = [t for t, ok in zip(texts, is_safe, strict=True) if not ok]
        encs = iter(self.backend.encode_batch_fast(unsafe, add_special_tokens=False))
        ends = np.cumsum(lengths)
        parts, all_lengths, k = [], [], 0
        for ok in is_safe:
            if ok:
                parts.append(tokens[ends[k] - lengths[k] : ends[k]])
                k += 1
            else:
                parts.append(np.asarray(next(encs).ids, dtype=np.int64))
            all_lengths.append(len(parts[-1]))
        flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return flat, np.asarray(all_lengths, dtype=np.int64)

    def _encode_safe(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        pieces = [_PRETOKEN.findall(t) for t in texts]
        piece_counts = np.fromiter(map(len, pieces), np.int64, len(pieces))
        pid = np.fromiter(map(self.piece_index.__getitem__, chain.from_iterable(pieces)),
                          np.int64, int(piece_counts.sum()))  # new pre-tokens learnt here
        ids, starts, lengths = self._arrays()
        run_len = lengths[pid]
        total = int(run_len.sum())
        # Gather every run: output position k reads ids[starts[pid] + offset within the run].
        ends = np.cumsum(run_len)
        offset = np.arange(total, dtype=np.int64) - np.repeat(ends - run_len, run_len)
        tokens = ids[np.repeat(starts[pid], run_len) + offset]
        doc_ends = np.concatenate([[0], ends])[np.cumsum(piece_counts)] if len(texts) else ends
        return tokens, np.diff(np.concatenate([[0], doc_ends])).astype(np.int64)
