"""Fixtures shared by the mt pretrain tests."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from mt_pretrain.config.load import load_config
from mt_pretrain.contract.runner import MatrixRunner
from mt_pretrain.launch import launch


def run_pretrain(common: Mapping[str, Any], out: Path, cache: Path, keep_weights: bool = False,
                 **options: Any) -> Any:
    """One ``mt pretrain`` run (``launch`` as the CLI does) from a test module's ``common``
    options with ``options`` on top, writing to ``out`` and sharing the data ``cache``
    (``keep_weights``: the final full weights in the summary)."""
    config = load_config(None, {**common, **options, "out_dir": str(out),
                                "cache_dir": str(cache)})
    return launch(config, environ={}, timeout=300, keep_weights=keep_weights)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """In-process (--nproc 1) runs share this 2-core machine with the other ranks and
    tests: one intra-op thread avoids spin-waiting threads fighting for cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenized-data cache shared by the runs of one test module."""
    return tmp_path_factory.mktemp("mt-cache")


@pytest.fixture(scope="module")
def matrix_runner(tmp_path_factory: pytest.TempPathFactory) -> MatrixRunner:
    """A contract-matrix runner for one test module: it trains each distinct reference and
    measures each noise floor once (contract_shards.STEPS steps per run)."""
    from contract_shards import STEPS

    return MatrixRunner(STEPS, tmp_path_factory.mktemp("matrix"))
