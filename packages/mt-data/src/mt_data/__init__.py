"""mt-data: an Arrow pipeline from raw text to deduplicated, tokenized, blended GPT samples.

Offline: :func:`prepare` (ingest -> clean/filter -> dedup -> decontaminate -> tokenize ->
token shards), :func:`export_megatron` / :func:`import_megatron`. Online: :class:`GPTDataset`,
:func:`build_blended`, :class:`DPDataLoader` with :class:`DataLoaderState`. No torch import.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported on first use (see __getattr__); named here for tools
    from mt_data.blend import BlendedDataset, blend_schedule, build_blended, parse_blend
    from mt_data.corpus import corpus_path, corpus_texts, iter_corpus
    from mt_data.decontam import DecontamConfig, NgramIndex, decontaminate_batch
    from mt_data.dedup import (
        DedupConfig,
        MinHasher,
        SignatureSpill,
        SpilledSignatures,
        UnionFind,
        content_hashes,
        fuzzy_dedup,
        fuzzy_dedup_bounded,
    )
    from mt_data.errors import DataError, DataNotFoundError, DatasetError, StreamError
    from mt_data.filters import FilterConfig, filter_batch
    from mt_data.gpt_dataset import GPTDataset, SplitSpec, build_sample_index, split_documents
    from mt_data.ingest import (
        BadInputError,
        ErrorLog,
        IngestConfig,
        InputError,
        TextKeyError,
        iter_documents,
    )
    from mt_data.loader import BatchSchedule, DataLoaderState, DPDataLoader
    from mt_data.megatron import MegatronReader, export_megatron, import_megatron, read_index
    from mt_data.paths import output_clash
    from mt_data.pipeline import (
        NoDocumentsError,
        PrepareConfig,
        PrepareError,
        prepare,
        prepare_demo,
    )
    from mt_data.quality import RULE_SETS, apply_rule_sets, parse_rule_sets
    from mt_data.shards import ShardSetWriter, TokenDataset
    from mt_data.stages import CleanConfig
    from mt_data.tokenizer import (
        EOD_TOKEN,
        Tokenizer,
        gpt2,
        load_tokenizer,
        recorded_tokenizer,
        tokenizer_differs,
        tokenizer_version,
        train_tokenizer,
    )

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
    "prepare", "prepare_demo", "read_index", "recorded_tokenizer", "split_documents",
    "tokenizer_differs", "tokenizer_version", "train_tokenizer",
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
    "mt_data.tokenizer": ("EOD_TOKEN", "Tokenizer", "gpt2", "load_tokenizer", "recorded_tokenizer",
                          "tokenizer_differs", "tokenizer_version", "train_tokenizer"),
}.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mt_data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
