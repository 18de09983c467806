"""Per-document scores and their aggregation, as lm-evaluation-harness defines them.

- ``acc`` (multiple choice): the choice of highest log-likelihood is the right one;
  ``acc_norm``: the same after dividing each log-likelihood by its choice's length in
  characters; (cloze) the target is the greedy continuation. Mean, with the standard error
  of the mean (sample standard deviation / sqrt(n)).
- ``perplexity`` (cloze): exp(-mean log-likelihood of the target); standard error by the
  delta method (lm-eval bootstraps it).
- ``word_perplexity`` / ``byte_perplexity`` / ``bits_per_byte`` (rolling): exp(-sum ll /
  sum words), exp(-sum ll / sum UTF-8 bytes), -sum ll / sum bytes / ln 2, over all
  documents; words are the pieces of ``re.split(r"\\s+", text)``. No standard error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["aggregate", "choice_scores", "mean_stderr"]


def mean_stderr(values: Sequence[float]) -> float | None:
    """Standard error of the mean (n - 1 in the variance); None below two values."""
    n = len(values)
    if n < 2:
        return None
    mu = sum(values) / n
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (n - 1)) / math.sqrt(n)


def choice_scores(lls: Sequence[float], choices: Sequence[str], gold: int) -> dict[str, float]:
    """``acc`` and ``acc_norm`` of one multiple-choice document (first maximum wins)."""
    lls_arr = np.asarray(lls, dtype=np.float64)
    lengths = np.array([float(len(c)) for c in choices])
    return {"acc": float(int(np.argmax(lls_arr)) == gold),
            "acc_norm": float(int(np.argmax(lls_arr / lengths)) == gold)}


def _exp(x: float) -> float:
    """``math.exp(x)``, infinite past the largest float (a perplexity beyond it)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def words(text: str) -> int:
    return len(re.split(r"\s+", text))


def aggregate(output_type: str, items: list[dict[str, Any]], metrics: Sequence[str]
              ) -> tuple[dict[str, float], dict[str, float | None]]:
    """(value, standard error) of each metric over per-document ``items``: multiple choice
    ``{"acc", "acc_norm"}``, cloze ``{"ll", "greedy"}``, rolling ``{"ll", "words", "bytes"}``."""
    values: dict[str, float] = {}
    errors: dict[str, float | None] = {}
    for metric in metrics:
        if output_type == "multiple_choice" or metric == "acc":
            key = "greedy" if output_type == "loglikelihood" else metric
            xs = [float(item[key]) for item in items]
            values[metric], errors[metric] = sum(xs) / len(xs), mean_stderr(xs)
        elif metric == "perplexity":
            lls = [item["ll"] for item in items]
            values[metric] = _exp(-sum(lls) / len(lls))
            err = mean_stderr(lls)
            errors[metric] = None if err is None else values[metric] * err
        else:
            total = sum(item["ll"] for item in items)
            unit = "words" if metric == "word_perplexity" else "bytes"
            per_unit = -total / sum(item[unit] for item in items)
            values[metric] = per_unit / math.log(2) if metric == "bits_per_byte" \
                else _exp(per_unit)
            errors[metric] = None
    return values, errors
