"""Fixtures shared by the mt pretrain tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


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
