"""Training data of a run: the prepared dataset (or the embedded corpus, tokenized once into
a cache folder), packed GPT samples and this data-parallel rank's loader."""

from __future__ import annotations

import fcntl
import hashlib
import warnings
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from mt_data import (
    BatchSchedule,
    DataError,
    DataLoaderState,
    DPDataLoader,
    GPTDataset,
    SplitSpec,
    TokenDataset,
    build_blended,
    prepare_demo,
    recorded_tokenizer,
)
from mt_pretrain.config.load import blend_text, dataset_paths
from mt_pretrain.config.resolve import RunPlan, loaded_checkpoint
from mt_pretrain.config.schema import ConfigError, DataArgs, PretrainConfig, TrainArgs

__all__ = ["check_load_tokenizer", "check_vocab", "default_cache_dir",
           "default_tokenizer", "ensure_data", "inputs_targets", "make_loaders",
           "tokenizer_for"]

GPT2_VOCAB = 50257


def default_cache_dir(environ: Mapping[str, str]) -> Path:
    """$MT_CACHE_DIR, else $XDG_CACHE_HOME/mt, else ~/.cache/mt."""
    if environ.get("MT_CACHE_DIR"):
        return Path(environ["MT_CACHE_DIR"])
    if environ.get("XDG_CACHE_HOME"):
        return Path(environ["XDG_CACHE_HOME"]) / "mt"
    return Path.home() / ".cache" / "mt"


def default_tokenizer(data: DataArgs, vocab_size: int) -> str:
    """Tokenizer of the embedded corpus for a model of ``vocab_size`` ids."""
    if data.tokenizer:
        return data.tokenizer
    return "tokenizer-1k" if vocab_size < GPT2_VOCAB else "gpt2"


def _demo_key(tokenizer: str) -> str:
    """What the embedded corpus' tokens depend on, hashed (12 hex digits): the tokenizer's
    fingerprint and the corpus files. A tokenizer file edited since, or another file of the
    same name, gets its own cache folder instead of tokens another tokenizer made."""
    from mt_data import corpus_path
    from mt_data.corpus import CORPORA

    digest = hashlib.sha256(_fingerprint(tokenizer).encode())
    for name in CORPORA:
        digest.update(corpus_path(name).read_bytes())
    return digest.hexdigest()[:12]


def ensure_data(data: DataArgs, vocab_size: int, cache_dir: Path) -> list[Path]:
    """The dataset folders of the run, tokenizing the embedded corpus once if needed (for a
    model of ``vocab_size`` ids). Safe to call from every rank at once: a file lock
    serializes the preparation."""
    if data.data is not None:
        return dataset_paths(data)
    tokenizer = default_tokenizer(data, vocab_size)
    folder = cache_dir / "data" / f"embedded-{Path(tokenizer).name.replace('.json', '')}-" \
        f"{_demo_key(tokenizer)}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            prepare_demo(folder, tokenizer=tokenizer)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return [folder]


def run_tokenizer(data: DataArgs, vocab_size: int) -> tuple[str | None, str | None]:
    """The tokenizer a run trains with, as ``mt_data.load_tokenizer`` takes it, and its
    fingerprint: the one its dataset's index records, else the embedded corpus' ((None,
    None) if the dataset is not here; no fingerprint for a dataset prepared before one was
    recorded)."""
    if data.data is None:
        name = default_tokenizer(data, vocab_size)
        return name, _fingerprint(name)
    paths = dataset_paths(data)
    if not all(p.exists() for p in paths):
        return None, None
    info = TokenDataset(paths[0]).tokenizer
    return (str(info["name"]) if info.get("name") else None), info.get("sha256")


def check_load_tokenizer(config: PretrainConfig, vocab_size: int) -> None:
    """The checkpoint ``--load`` names trained with the tokenizer of this run's data, where
    both record its fingerprint: ids of another tokenizer mean other text, and the run would
    go on training on it without a word. (Called after :func:`resolve`, which read the
    checkpoint already and raised on a damaged one.)"""
    if (loaded := loaded_checkpoint(config)) is None:
        return
    folder, meta = loaded
    name, fingerprint = run_tokenizer(config.data, vocab_size)
    if meta.tokenizer_sha256 and fingerprint and meta.tokenizer_sha256 != fingerprint:
        raise ConfigError(f"--load {folder}: its run trained with tokenizer {meta.tokenizer} "
                          f"(sha256 {meta.tokenizer_sha256[:12]}...), this run's data is of "
                          f"tokenizer {name} ({fingerprint[:12]}...): the same ids would mean "
                          f"other text; train on data prepared with {meta.tokenizer}")


def batch_change_note(config: PretrainConfig, plan: RunPlan) -> str | None:
    """What a run resumed at another global batch size than its checkpoint's run says (None
    when it is the same, a restart of a run that changed it included): the samples consumed,
    and the batch size it goes on at."""
    resumed = plan.resumed
    schedule = BatchSchedule(config.train.global_batch_size, plan.rampup)
    if resumed is None or schedule.consumed_at(resumed.step) == resumed.consumed_samples or \
            resumed.global_batch_size == config.train.global_batch_size:
        return None
    was = f" at global batch size {resumed.global_batch_size}" \
        if resumed.global_batch_size is not None else ""
    now = f"global batch size {schedule.batch_size(resumed.consumed_samples)}" + \
        (" (ramp-up)" if plan.rampup and schedule.batch_size(resumed.consumed_samples) <
         config.train.global_batch_size else "")
    steps = f"{resumed.step:,} step{'s' * (resumed.step != 1)}"
    return (f"its run consumed {resumed.consumed_samples:,} samples in {steps}{was}; the run "
            f"goes on from there at {now}")


def _fingerprint(tokenizer: str) -> str:
    """The fingerprint of tokenizer ``tokenizer``, read once per version of its files
    (``mt_data.tokenizer_version``): a process that runs several times (a notebook, the
    tests) never keys its data by what an edited tokenizer file held before."""
    from mt_data import tokenizer_version

    return _fingerprint_of(tokenizer, tokenizer_version(tokenizer))


@cache
def _fingerprint_of(tokenizer: str, version: tuple[Any, ...]) -> str:
    from mt_data import load_tokenizer

    return load_tokenizer(tokenizer).fingerprint


def tokenizer_for(paths: list[Path]) -> Any:
    """The tokenizer recorded in the first dataset's index (for decoding samples), checked to
    be the one it records (``mt_data.recorded_tokenizer``)."""
    return recorded_tokenizer(TokenDataset(paths[0]).tokenizer, f"dataset {paths[0]}")


def _dataset(data: DataArgs, seed: int, paths: list[Path], seq_len: int, samples: int,
             split: str) -> Any:
    spec = SplitSpec.parse(data.split, seed=seed)
    if data.data is None:
        return GPTDataset(paths[0], seq_len, samples, seed, split, spec)
    return build_blended(blend_text(data), seq_len, samples, seed, split, spec)


def check_vocab(plan: RunPlan, paths: list[Path]) -> None:
    """Every token id of the data must fit the model's vocabulary: the dataset's real largest
    id (``max_token_id``, recorded in index.json and checked by mt-data on open, the shards
    checked against their recorded SHA-256, so the record holds at every layout) and its
    tokenizer's size. A dataset mt-data refuses to open is a ConfigError too."""
    vocab = plan.gpt.vocab_size
    for path in paths:
        try:
            data = TokenDataset(path)
            data.check_shards()
            largest = data.max_token_id
        except DataError as err:
            raise ConfigError(str(err)) from None
        info = data.index.get("tokenizer", {})
        size = info.get("vocab_size") if isinstance(info, dict) else None
        if size is not None and size > vocab:
            raise ConfigError(f"dataset {path} uses a tokenizer of {size} ids but the model "
                              f"vocabulary has {vocab}: use --vocab-size >= {size} or a model "
                              f"whose vocabulary holds it (--model gpt2-small for `mt data "
                              f"prepare`'s default GPT-2 tokenizer), or prepare the data with "
                              f"a tokenizer of at most {vocab} ids (--tokenizer tokenizer-1k "
                              f"for the tiny model)")
        if largest >= vocab:
            raise ConfigError(f"dataset {path} holds token id {largest} (max_token_id in its "
                              f"index.json) but the model vocabulary has {vocab} ids: use "
                              f"--vocab-size >= {largest + 1}")


def make_loaders(data: DataArgs, train: TrainArgs, plan: RunPlan, paths: list[Path],
                 dp_rank: int, state: DataLoaderState
                 ) -> tuple[DPDataLoader, DPDataLoader | None]:
    """Train loader (resumed at ``state``) and validation loader of this DP rank."""
    check_vocab(plan, paths)
    seq_len, dp = plan.gpt.seq_len, plan.topology.dp
    schedule = BatchSchedule(train.global_batch_size, plan.rampup)
    try:
        dataset = _dataset(data, train.seed, paths, seq_len, max(plan.train_samples, 1),
                           "train")
    except ValueError as err:  # too little text for one sample of --seq-len
        raise ConfigError(f"{err}: use a shorter --seq-len or more data") from None
    loader = DPDataLoader(dataset, schedule, train.micro_batch_size, dp_rank, dp, state)
    valid = None
    if train.eval_interval and train.eval_iters:
        size = train.eval_iters * train.global_batch_size
        try:
            valid_set = _dataset(data, train.seed, paths, seq_len, size, "valid")
        except ValueError as err:  # no validation split (e.g. a tiny dataset): no eval, said
            valid_set = None
            if dp_rank == 0:
                warnings.warn(f"no validation: {err}", stacklevel=2)
        if valid_set is not None:
            valid = DPDataLoader(valid_set, size, train.micro_batch_size, dp_rank, dp)
    return loader, valid


def inputs_targets(batch: Any, cp: int = 1, cp_rank: int = 0) -> tuple[Any, Any]:
    """The model's input tokens and targets of ``batch`` ([b, seq + 1] token tensor): the first
    ``seq`` tokens and the last ``seq``; with context parallelism (``cp`` > 1) the slice of both
    that context-parallel rank ``cp_rank`` holds (mt-tensor-parallel's ``shard_sequence``)."""
    idx, targets = batch[:, :-1], batch[:, 1:]
    if cp == 1:
        return idx, targets
    from mt_tensor_parallel import shard_sequence

    return shard_sequence(idx, cp, cp_rank), shard_sequence(targets, cp, cp_rank)


def to_batch(micro_batches: list[np.ndarray]) -> Any:
    """Stack micro-batches into one int64 tensor ``[m * micro, seq + 1]``."""
    import torch

    return torch.from_numpy(np.concatenate(micro_batches).astype(np.int64, copy=False))
