"""Words that name social groups (gender, race, religion) and occupations, and the counting
rules that mt's bias probes (mt-eval) and ``mt data inspect --groups`` share, so that what a
dataset carries and what a model trained on it says are counted the same way.

The lists are data (``assets/group_words.json``: its ``about`` names their sources and
limits); a user's own file in the same schema replaces them. The rules:

- text is matched as lowercase words: letters, joined by inner apostrophes or hyphens
  (:func:`words`; a typographic apostrophe counts as ``'``);
- a word names at most one group of a dimension (checked when a list is loaded);
- an occupation is mentioned by its word or its plural with ``s``;
- the gender a stretch of text gives is that of its first gendered word (:func:`first_group`);
  in a dataset, an occupation's mention is associated with the first gendered word after it
  in the same sentence (sentences end at ``.``, ``!`` or ``?``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GROUP_WORDS", "GroupCounter", "GroupWords", "first_group", "load_group_words",
           "merge_counts", "words"]

#: The lists mt ships.
GROUP_WORDS = Path(__file__).parent / "assets" / "group_words.json"

_WORD = re.compile(r"[a-z]+(?:['-][a-z]+)*")


def words(text: str) -> list[str]:
    """The lowercase words of ``text`` (the matching rule of every count)."""
    return _WORD.findall(text.lower().replace("\u2019", "'"))


def first_group(tokens: Iterable[str], lookup: Mapping[str, str]) -> str | None:
    """The group (``lookup``: word -> group) of the first word of ``tokens`` that names one,
    else None."""
    for token in tokens:
        group = lookup.get(token)
        if group is not None:
            return group
    return None


@dataclass(frozen=True)
class GroupWords:
    """Groups of each dimension, with the words that name them, and occupations."""

    dimensions: dict[str, dict[str, tuple[str, ...]]]
    """dimension -> group -> words (lowercase)."""
    occupations: tuple[str, ...]
    source: str = str(GROUP_WORDS)

    def lookup(self, dimension: str) -> dict[str, str]:
        """word -> group, for one dimension."""
        return {w: group for group, ws in self.dimensions[dimension].items() for w in ws}

    def occupation_lookup(self) -> dict[str, str]:
        """word (an occupation or its plural) -> occupation."""
        out = {}
        for occupation in self.occupations:
            out[occupation] = out[occupation + "s"] = occupation
        return out


def load_group_words(path: str | Path | None = None) -> GroupWords:
    """The lists in ``path`` (default: mt's). A ValueError names the file and the entry at
    fault."""
    path = Path(path) if path is not None else GROUP_WORDS
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable group-words JSON file: {err}") from None
    except RecursionError:
        raise ValueError(f"{path}: not a readable group-words JSON file: nested too deeply "
                         "to read") from None
    if not isinstance(raw, dict):
        raw = {}
    dims, occupations = raw.get("dimensions"), raw.get("occupations", [])
    if not isinstance(dims, dict) or not dims or not isinstance(occupations, list):
        raise ValueError(f'{path}: needs "dimensions" {{dimension: {{group: [words]}}}} and '
                         '"occupations" [words]')
    out: dict[str, dict[str, tuple[str, ...]]] = {}
    for dim, groups in dims.items():
        if not isinstance(groups, dict) or len(groups) < 2:
            raise ValueError(f"{path}: dimension {dim!r} needs two groups or more")
        seen: dict[str, str] = {}
        out[dim] = {}
        for group, ws in groups.items():
            if not isinstance(ws, list) or not ws or not all(
                    isinstance(w, str) and words(w) == [w] for w in ws):
                raise ValueError(f"{path}: {dim}.{group} must be a list of lowercase words, "
                                 f"got {json.dumps(ws)[:80]}")
            for w in ws:
                if w in seen:
                    raise ValueError(f"{path}: {w!r} names two groups of {dim}: "
                                     f"{seen[w]} and {group}")
                seen[w] = group
            out[dim][group] = tuple(ws)
    bad = [o for o in occupations if not isinstance(o, str) or words(o) != [o]]
    if bad:
        raise ValueError(f"{path}: occupations must be lowercase words, got {bad[0]!r}")
    if occupations and "gender" not in out:
        raise ValueError(f"{path}: occupations are counted against a 'gender' dimension, "
                         "which it lacks")
    if "mentions" in out.get("gender", {}):  # an occupation's row holds both keys
        raise ValueError(f"{path}: 'mentions' cannot name a gender group")
    return GroupWords(out, tuple(occupations), str(path))


def _zeros(keys: Iterable[str]) -> dict[str, int]:
    return {k: 0 for k in keys}


_KEY_BYTES = 8
"""Words are matched in bulk by their first 8 bytes (a uint64), then checked whole."""
_KEY_MASKS = np.array([(1 << (8 * n)) - 1 for n in range(_KEY_BYTES)] + [2**64 - 1],
                      dtype=np.uint64)


_HASH_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: key * m >> (64 - bits)
_HASH_SHIFT = np.uint64(64 - 20)


def _key(word: str) -> int:
    return int.from_bytes(word.encode()[:_KEY_BYTES].ljust(_KEY_BYTES, b"\0"), "little")


def _word_spans(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end byte offsets of the :func:`words` of lowercased UTF-8 ``data`` (a word's
    bytes are ASCII; every byte of a multi-byte character is >= 0x80, so it ends a word as
    the character does). A word starts at a letter that neither follows a letter nor follows
    an apostrophe / hyphen that follows a letter; it ends the same way, mirrored."""
    n = data.size
    letter = (data >= 97) & (data <= 122)
    joiner = (data == 39) | (data == 45)
    starts = letter.copy()
    starts[1:] &= ~letter[:-1]
    starts[2:] &= ~(joiner[1:-1] & letter[:-2])
    ends = letter.copy()
    ends[: n - 1] &= ~letter[1:]
    ends[: n - 2] &= ~(joiner[1:-1] & letter[2:])
    return np.flatnonzero(starts), np.flatnonzero(ends) + 1


class GroupCounter:
    """Counts over documents: every group's mentions and the documents that mention it, and
    each occupation's mentions with the gender of the first gendered word after it in its
    sentence. ``counts`` is plain JSON; :func:`merge_counts` adds two.

    :meth:`add` finds the words of a document with numpy, then looks up only the few that
    can be listed (about 50 MB/s on one core, five times a loop over :func:`words` per
    sentence); the counts are the same (tests/test_data_groups.py compares them with such a
    loop on the embedded corpus and on random text)."""

    def __init__(self, lists: GroupWords) -> None:
        self.lists = lists
        self._lookups = {dim: lists.lookup(dim) for dim in lists.dimensions}
        self._occupations = lists.occupation_lookup()
        self._gender = self._lookups.get("gender", {})
        self._groups_of: dict[str, list[tuple[str, str]]] = {}
        for dim, lookup in self._lookups.items():
            for word, group in lookup.items():
                self._groups_of.setdefault(word, []).append((dim, group))
        vocab = set(self._groups_of) | set(self._occupations)
        self._keys = np.unique(np.array([_key(w) for w in vocab], dtype=np.uint64))
        # A bit per hash of the keys: a word whose bit is clear is not listed (a cheap test
        # of every word; the few others are looked up in the sorted keys).
        self._may_list = np.zeros(1 << 20, dtype=bool)
        self._may_list[(self._keys * _HASH_MULTIPLIER) >> _HASH_SHIFT] = True
        genders = tuple(lists.dimensions.get("gender", {}))
        self.counts: dict[str, Any] = {
            "documents": 0, "words": 0,
            "mentions": {d: _zeros(g) for d, g in lists.dimensions.items()},
            "documents_with": {d: _zeros(g) for d, g in lists.dimensions.items()},
            "occupations": {o: {"mentions": 0, **_zeros(genders)} for o in lists.occupations},
        }

    def _listed(self, text: str) -> list[tuple[str, int]]:
        """(word, sentence number) of the words of ``text`` that name a group or an
        occupation, in order; also counts the document's words."""
        raw = text.lower().replace("\u2019", "'").encode("utf-8", "surrogatepass")
        data = np.frombuffer(raw, dtype=np.uint8)
        starts, ends = _word_spans(data)
        self.counts["words"] += len(starts)
        if not len(starts) or not len(self._keys):
            return []
        padded = np.zeros(data.size + _KEY_BYTES, dtype=np.uint8)
        padded[: data.size] = data
        windows = np.ndarray((data.size,), dtype="<u8", buffer=padded, strides=(1,))
        keys = windows[starts] & _KEY_MASKS[np.minimum(ends - starts, _KEY_BYTES)]
        maybe = np.flatnonzero(self._may_list[(keys * _HASH_MULTIPLIER) >> _HASH_SHIFT])
        slot = np.searchsorted(self._keys, keys[maybe]).clip(max=len(self._keys) - 1)
        hits = maybe[self._keys[slot] == keys[maybe]]
        if not len(hits):
            return []
        sentence_ends = np.flatnonzero((data == 46) | (data == 33) | (data == 63))  # . ! ?
        sentences = np.searchsorted(sentence_ends, starts[hits]).tolist()
        listed = []
        for k, sentence in zip(hits.tolist(), sentences, strict=True):
            word = raw[starts[k]:ends[k]].decode("ascii")
            if word in self._groups_of or word in self._occupations:
                listed.append((word, sentence))
        return listed

    def add(self, text: str) -> None:
        """Count one document."""
        c = self.counts
        c["documents"] += 1
        listed = self._listed(text)
        seen: set[tuple[str, str]] = set()
        for i, (word, _) in enumerate(listed):
            for dim, group in self._groups_of.get(word, ()):
                c["mentions"][dim][group] += 1
                seen.add((dim, group))
            occupation = self._occupations.get(word)
            if occupation is not None:
                row = c["occupations"][occupation]
                row["mentions"] += 1
                after = first_group(_rest_of_sentence(listed, i), self._gender)
                if after is not None:
                    row[after] += 1
        for dim, group in seen:
            c["documents_with"][dim][group] += 1


def _rest_of_sentence(listed: list[tuple[str, int]], i: int) -> Iterator[str]:
    """The listed words after the ``i``-th in its sentence."""
    for j in range(i + 1, len(listed)):
        word, sentence = listed[j]
        if sentence != listed[i][1]:
            return
        yield word


def merge_counts(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The sum of several :class:`GroupCounter` counts (of the same lists)."""
    def add(a: Any, b: Any) -> Any:
        if isinstance(a, dict):
            return {k: add(a[k], b[k]) for k in a}
        return a + b

    if not parts:
        raise ValueError("merge_counts needs one count or more")
    out = json.loads(json.dumps(parts[0]))
    for part in parts[1:]:
        out = add(out, part)
    return out
