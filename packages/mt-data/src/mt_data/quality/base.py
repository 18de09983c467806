"""What every quality rule set is: named rules, checked in order, first failure drops.

A rule set is a frozen dataclass of thresholds (``None`` switches a rule off) whose
:meth:`RuleSet.apply` returns, for a batch of texts, the index of the first rule each document
fails (-1: kept), and the rewritten texts when the set edits documents (C4 removes lines).
Errors name the rule set and the threshold at fault.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np
import pyarrow as pa

KEPT = -1


@dataclass(frozen=True)
class Verdicts:
    """Result of one rule set on a batch."""

    failed: np.ndarray
    """int16 per document: index (into ``rule_names()``) of the first rule failed, -1 kept."""
    texts: list[str] | None = None
    """New text of every document (None: texts unchanged); only kept ones matter."""


class RuleSet:
    """Base of the rule-set dataclasses (subclasses are frozen dataclasses)."""

    name: ClassVar[str]
    source: ClassVar[str]
    """Where the rules come from (paper and reference implementation)."""

    def rule_names(self) -> tuple[str, ...]:
        """The rules, in the order they are checked."""
        raise NotImplementedError

    def apply(self, texts: pa.Array) -> Verdicts:
        """Check every text (a pyarrow string array)."""
        raise NotImplementedError

    def counted_rules(self) -> tuple[str, ...]:
        """The rules listed in drop counts, even at 0 (default: all)."""
        return self.rule_names()

    def qualified(self, rule: str) -> str:
        """The rule's name in counts and samples: ``set/rule``."""
        return f"{self.name}/{rule}"

    def _check(self, nonnegative: tuple[str, ...] = (), fractions: tuple[str, ...] = ()) -> None:
        """Validate thresholds: ``ValueError`` naming the rule set, field and value."""
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None or f.name not in nonnegative + fractions:
                continue
            if value < 0 or (f.name in fractions and value > 1):
                bounds = "in [0, 1]" if f.name in fractions else ">= 0"
                raise ValueError(f"{self.name}: {f.name} must be {bounds} or None (off), "
                                 f"got {value}")


def first_failure(checks: list[np.ndarray | None], n: int) -> np.ndarray:
    """Index of the first true check per document (-1 if none); None checks are off."""
    failed = np.full(n, KEPT, dtype=np.int16)
    for k, check in enumerate(checks):
        if check is not None:
            failed[(failed == KEPT) & check] = k
    return failed


def ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``num / den`` as Python divides (exact float64); 0/0 is 0 and x/0 is inf."""
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    out = np.zeros_like(num)
    np.divide(num, den, out=out, where=den != 0)
    out[(den == 0) & (num > 0)] = np.inf
    return out
