"""mt's bias suite, model-free: the generation probes (prompts, seeds) and their statistics
from logged samples. The likelihood probes are lm-eval's own tasks (CrowS-Pairs,
Winogender); `mt bias` (mt-pretrain) runs both on a checkpoint and writes the report."""

from mt_eval.bias.probes import PROBES, Probe, Probes, load_probes, sample_seed
from mt_eval.bias.stats import (
    LEXICON,
    STOPWORDS,
    group_stats,
    load_lexicon,
    load_stopwords,
    occupation_stats,
    sentiment,
)

__all__ = ["LEXICON", "PROBES", "STOPWORDS", "Probe", "Probes", "group_stats", "load_lexicon",
           "load_probes", "load_stopwords", "occupation_stats", "sample_seed", "sentiment"]
