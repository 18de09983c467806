"""Named, documented quality rule sets that agree with Hugging Face datatrove 0.10.1.

``mt-basic`` (mt's original filters), ``gopher-quality`` and ``gopher-repetition`` (Rae et al.
2021), ``c4`` (Raffel et al. 2020) and ``fineweb`` (Penedo et al. 2024): each a frozen dataclass
of thresholds whose defaults are datatrove's, selected by name with :func:`parse_rule_sets` (or
``mt data prepare --filters``) and applied with :func:`apply_rule_sets`. English words are split
as datatrove splits them (spaCy's tokenizer, reimplemented in :mod:`mt_data.quality.words`).
"""

from mt_data.quality.base import KEPT, RuleSet, Verdicts
from mt_data.quality.c4 import C4Quality
from mt_data.quality.fineweb import FineWebQuality
from mt_data.quality.gopher import GopherQuality, GopherRepetition
from mt_data.quality.sets import (
    DEFAULT_RULE_SETS,
    RULE_SETS,
    SAMPLES_PER_RULE,
    MtBasic,
    apply_rule_sets,
    parse_rule_sets,
    rule_names,
)
from mt_data.quality.words import english, split_words

__all__ = [
    "DEFAULT_RULE_SETS", "KEPT", "RULE_SETS", "SAMPLES_PER_RULE", "C4Quality", "FineWebQuality",
    "GopherQuality", "GopherRepetition", "MtBasic", "RuleSet", "Verdicts", "apply_rule_sets",
    "english", "parse_rule_sets", "rule_names", "split_words",
]
