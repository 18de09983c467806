"""mt-data: an Arrow pipeline from raw text to deduplicated, tokenized, blended GPT samples.

Offline: :func:`prepare` (ingest -> clean/filter -> dedup -> decontaminate -> tokenize ->
token shards), :func:`export_megatron` / :func:`import_megatron`. Online: :class:`GPTDataset`,
:func:`build_blended`, :class:`DPDataLoader` with :class:`DataLoaderState`. No torch import.
"""

import importlib
from typing import Any

__all__ = [
    "EOD_TOKEN", "BadInputError", "BatchSchedule", "BlendedDataset", "CleanConfig",
    "DPDataLoader", "DataError", "DataLoaderState", "DataNotFoundError", "DatasetError",
    "DecontamConfig", "DedupConfig", "ErrorLog", "FilterConfig", "GPTDataset", "IngestConfig",
    "InputError", "MegatronReader", "MinHasher", "NgramIndex", "NoDocumentsError",
    "PrepareConfig", "PrepareError", "RULE_SETS", "ShardSetWriter", "SignatureSpill",
    "SpilledSignatures", "SplitSpec", "StreamError",
    "TextKeyError", "TokenDataset", "Tokenizer", "UnionFind", "apply_rule_sets", "blend_schedule",
    "build_blended",
    "build_sample_index", "content_hashes", "corpus_path", "corpus_texts",
    "decontaminate_batch", "export_megatron", "filter_batch", "fuzzy_dedup",
    "fuzzy_dedup_bounded", "gpt2",
    "import_megatron", "iter_corpus", "iter_documents", "load_tokenizer", "output_clash",
    "parse_blend",
    "parse_rule_sets",
    "prepare", "prepare_demo", "read_index", "split_documents", "train_tokenizer",
]

#: Names load on first use (their modules import pyarrow, numpy, tokenizers...): a program
#: that imports one module of the package (``mt_data.paths``) does not load the others.
_LAZY = {name: module for module, names in {
    "mt_data.blend": ("BlendedDataset", "blend_schedule", "build_blended", "parse_blend"),
    "mt_data.corpus": ("corpus_path", "corpus_texts", "iter_corpus"),
    "mt_data.decontam": ("DecontamConfig", "NgramIndex", "decontaminate_batch"),
    "mt_data.dedup": ("DedupConfig", "MinHasher", "SignatureSpill", "SpilledSignatures",
                      "UnionFind", "content_hashes", "fuzzy_dedup", "fuzzy_dedup_bounded"),
    "mt_data.errors": ("DataError", "DataNotFoundError", "DatasetError", "StreamError"),
    "mt_data.filters": ("FilterConfig", "filter_batch"),
    "mt_data.gpt_dataset": ("GPTDataset", "SplitSpec", "build_sample_index", "split_documents"),
    "mt_data.ingest": ("BadInputError", "ErrorLog", "IngestConfig", "InputError",
                       "TextKeyError", "iter_documents"),
    "mt_data.loader": ("BatchSchedule", "DataLoaderState", "DPDataLoader"),
    "mt_data.megatron": ("MegatronReader", "export_megatron", "import_megatron", "read_index"),
    "mt_data.paths": ("output_clash",),
    "mt_data.pipeline": ("NoDocumentsError", "PrepareConfig", "PrepareError", "prepare",
                         "prepare_demo"),
    "mt_data.quality": ("RULE_SETS", "apply_rule_sets", "parse_rule_sets"),
    "mt_data.shards": ("ShardSetWriter", "TokenDataset"),
    "mt_data.stages": ("CleanConfig",),
    "mt_data.tokenizer": ("EOD_TOKEN", "Tokenizer", "gpt2", "load_tokenizer", "train_tokenizer"),
}.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mt_data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
