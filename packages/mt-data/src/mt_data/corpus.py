"""The embedded public-domain corpus: Moby-Dick chapters and State of the Union addresses.

It is small (about 2.4 MB of English) but real, so demos and tests run offline on real text.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

CORPORA = ("moby-dick", "sotu")


def corpus_path(name: str) -> Path:
    """Path of an embedded corpus file (gzip JSONL with keys id/source/text)."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; embedded corpora: {CORPORA}")
    return Path(str(resources.files("mt_data") / "corpus" / f"{name}.jsonl.gz"))


def iter_corpus(names: tuple[str, ...] = CORPORA) -> Iterator[dict[str, str]]:
    """Yield the documents (dicts with id, source, text) of the named embedded corpora."""
    for name in names:
        with gzip.open(corpus_path(name), "rt", encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)


def corpus_texts(names: tuple[str, ...] = CORPORA) -> list[str]:
    """The texts of the named embedded corpora, in file order."""
    return [doc["text"] for doc in iter_corpus(names)]
