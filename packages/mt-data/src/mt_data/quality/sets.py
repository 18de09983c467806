"""The named rule sets, ``--filters`` parsing, and applying rule sets to a record batch."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from mt_data.filters import FILTERS, FilterConfig, enabled_filters, failed_filters
from mt_data.quality.base import KEPT, RuleSet, Verdicts
from mt_data.quality.c4 import C4Quality
from mt_data.quality.fineweb import FineWebQuality
from mt_data.quality.gopher import GopherQuality, GopherRepetition


@dataclass(frozen=True)
class MtBasic(RuleSet):
    """mt's original filters (:class:`mt_data.filters.FilterConfig`: length, words, symbols,
    alphabetic words, HTML tags, repeated lines). Its rules keep their historic bare names
    (``too_short``, ``html``, ...) in counts; the config's ``normalize`` is not applied here
    (normalisation runs once, before every rule set)."""

    name = "mt-basic"
    source = "mt-data (FilterConfig)"

    config: FilterConfig = FilterConfig()

    def rule_names(self) -> tuple[str, ...]:
        return FILTERS

    def counted_rules(self) -> tuple[str, ...]:
        return tuple(enabled_filters(self.config))

    def qualified(self, rule: str) -> str:
        return rule

    def apply(self, texts: pa.Array) -> Verdicts:
        return Verdicts(failed_filters(texts, self.config))


RULE_SETS: dict[str, type[RuleSet]] = {
    cls.name: cls for cls in (MtBasic, GopherQuality, GopherRepetition, C4Quality, FineWebQuality)
}
"""Rule-set name -> its config class (a frozen dataclass whose defaults are the reference's)."""

DEFAULT_RULE_SETS = ("mt-basic",)


def parse_rule_sets(spec: str | Sequence[str], basic: FilterConfig = FilterConfig()
                    ) -> tuple[RuleSet, ...]:
    """Rule sets from names (``"gopher-quality,c4"`` or a list), each with default thresholds
    (``mt-basic`` with ``basic``); ``ValueError`` names an unknown or repeated set."""
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec)]
    names = [n for n in names if n]
    if not names:
        raise ValueError(f"no rule set named in {spec!r}; known: {', '.join(RULE_SETS)}")
    out: list[RuleSet] = []
    for name in names:
        if name not in RULE_SETS:
            raise ValueError(f"unknown rule set {name!r}; known: {', '.join(RULE_SETS)}")
        if names.count(name) > 1:
            raise ValueError(f"rule set {name!r} is named twice in {spec!r}")
        out.append(MtBasic(basic) if name == "mt-basic" else RULE_SETS[name]())
    return tuple(out)


def rule_names(rule_sets: Sequence[RuleSet]) -> list[str]:
    """The rules of the sets counted in the prepare summary (``set/rule``; mt-basic: bare)."""
    return [rs.qualified(rule) for rs in rule_sets for rule in rs.counted_rules()]


SAMPLES_PER_RULE = 5
"""Dropped documents kept as examples per rule (per chunk, and per run)."""
SAMPLE_CHARS = 5_000
"""Characters of a dropped document kept in its example."""


def apply_rule_sets(batch: pa.RecordBatch, rule_sets: Sequence[RuleSet],
                    samples: int = SAMPLES_PER_RULE
                    ) -> tuple[pa.RecordBatch, Counter[str], dict[str, list[dict[str, Any]]]]:
    """Apply rule sets in order to a batch with ``id`` / ``source`` / ``text`` columns.

    A document is dropped by the first rule it fails (sets in order, rules in each set's order);
    a set that edits texts (C4) hands its edited texts to the next. Returns the kept rows, the
    drop count of every rule (0 included) and up to ``samples`` dropped documents per rule
    (``id``, ``source``, ``chars``, ``text`` as the rule saw it, cut to ``SAMPLE_CHARS``).
    """
    counts: Counter[str] = Counter({name: 0 for name in rule_names(rule_sets)})
    examples: dict[str, list[dict[str, Any]]] = {}
    column = batch.schema.get_field_index("text")
    for rule_set in rule_sets:
        if batch.num_rows == 0:
            break
        verdicts = rule_set.apply(batch.column("text"))
        names = [rule_set.qualified(rule) for rule in rule_set.rule_names()]
        failed = verdicts.failed
        if verdicts.texts is not None:
            batch = batch.set_column(column, batch.schema.field(column),
                                     pa.array(verdicts.texts, batch.schema.field(column).type))
        for k in np.unique(failed[failed != KEPT]):
            rows = np.flatnonzero(failed == k)
            counts[names[k]] += len(rows)
            if samples:
                examples[names[k]] = [_example(batch, int(i)) for i in rows[:samples]]
        batch = batch.filter(pa.array(failed == KEPT))
    return batch, counts, examples


def _example(batch: pa.RecordBatch, row: int) -> dict[str, Any]:
    text = batch.column("text")[row].as_py()
    return {"id": batch.column("id")[row].as_py(), "source": batch.column("source")[row].as_py(),
            "chars": len(text), "text": text[:SAMPLE_CHARS]}
