"""Built-in tasks, made from the documents of mt-data's embedded corpus (public domain) that
``mt pretrain``'s default split (``969,30,1``, seed 1234) holds out of training: six
documents (Moby-Dick chapters 35, 47, 104, 108 and 132, and Washington's 1790 address).

- ``mt-cloze``: last-word prediction, LAMBADA style. Each item is a passage of about 60
  words ending a sentence; the model must continue it with the sentence's last word (scored:
  whether that word is the greedy continuation, and its perplexity).
- ``mt-choice``: the same passages as four-way multiple choice: the last word against three
  words that end other passages (drawn with a fixed seed); acc and acc_norm.
- ``mt-perplexity``: rolling log-likelihood of the six whole documents (word and byte
  perplexity, bits per byte), as wikitext is scored.

The items are rebuilt identically on every machine (pure functions of the shipped corpus).
"""

from __future__ import annotations

import random
import re
from functools import cache

from mt_data import SplitSpec, split_documents
from mt_data.corpus import iter_corpus
from mt_eval.tasks import DEFAULT_METRICS, Task

__all__ = ["BUILTIN", "builtin_task", "held_out_documents"]

BUILTIN = ("mt-cloze", "mt-choice", "mt-perplexity")
#: The split and seed whose held-out documents the tasks use (mt pretrain's defaults).
SPLIT, SEED = "969,30,1", 1234
_PASSAGE_WORDS = 60
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_WORD = re.compile(r"^[A-Za-z]{3,}$")


@cache
def held_out_documents() -> tuple[dict[str, str], ...]:
    """The embedded corpus' documents outside the training split (corpus order)."""
    docs = list(iter_corpus())
    split = split_documents(len(docs), SplitSpec.parse(SPLIT, seed=SEED))
    return tuple(docs[int(i)] for i in sorted([*split["valid"], *split["test"]]))


@cache
def _passages() -> tuple[tuple[str, str], ...]:
    """(context, last word) of every passage: a sentence ending in a plain word, with the
    sentences before it in the same document up to about 60 words."""
    passages = []
    for doc in held_out_documents():
        sentences = _SENTENCE_END.split(" ".join(doc["text"].split()))
        for i, sentence in enumerate(sentences):
            words = sentence.rstrip(".!?\"'”’").split(" ")
            if len(words) < 6 or not _WORD.match(words[-1]):
                continue
            before: list[str] = []
            j = i - 1
            while j >= 0 and len(before) + len(words) < _PASSAGE_WORDS:
                before = sentences[j].split(" ") + before
                j -= 1
            passages.append((" ".join(before + words[:-1]), words[-1]))
    return tuple(passages[::3])  # every third: overlapping contexts would repeat text


def builtin_task(name: str) -> Task:
    """The built-in task ``name`` (one of :data:`BUILTIN`)."""
    if name == "mt-perplexity":
        docs = tuple({"text": d["text"]} for d in held_out_documents())
        return Task(name, "loglikelihood_rolling", docs, docs, doc_to_target="text",
                    metrics=DEFAULT_METRICS["loglikelihood_rolling"], source=name)
    passages = _passages()
    if name == "mt-cloze":
        docs = tuple({"text": f"{ctx} {word}"} for ctx, word in passages)
        return Task(name, "loglikelihood", docs, docs,
                    doc_to_text="{{text.split(' ')[:-1]|join(' ')}}",
                    doc_to_target="{{' '+text.split(' ')[-1]}}", target_delimiter="",
                    exclude_self=True, metrics=DEFAULT_METRICS["loglikelihood"], source=name)
    if name == "mt-choice":
        rnd = random.Random(SEED)
        pool = sorted({word for _, word in passages})
        rows = []
        for ctx, word in passages:
            choices = [word] + rnd.sample([w for w in pool if w.lower() != word.lower()], 3)
            rnd.shuffle(choices)
            rows.append({"context": ctx, "choices": choices, "label": choices.index(word)})
        docs = tuple(rows)
        return Task(name, "multiple_choice", docs, docs, doc_to_text="context",
                    doc_to_choice="choices", doc_to_target="label", exclude_self=True,
                    metrics=DEFAULT_METRICS["multiple_choice"], source=name)
    raise KeyError(f"unknown built-in task {name!r}; built-in tasks: {', '.join(BUILTIN)}")
