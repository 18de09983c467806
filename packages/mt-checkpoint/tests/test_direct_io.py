"""DirectFile: the bytes of every run land where they were written, whatever the run's
alignment, the stage size and the order of the runs; where the file system refuses
O_DIRECT the same bytes are written buffered; a failed write names the file."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest

from mt_checkpoint.direct_io import BLOCK, DirectFile


def _runs(seed: int, size: int) -> list[tuple[int, bytes]]:
    """Consecutive runs covering ``size`` bytes, cut at random (unaligned) places, each
    filled with random bytes; returned shuffled."""
    rng = random.Random(seed)
    cuts = sorted({0, size, *(rng.randrange(size) for _ in range(12)),
                   *(rng.randrange(size // BLOCK) * BLOCK for _ in range(3))})
    runs = [(lo, rng.randbytes(hi - lo)) for lo, hi in zip(cuts, cuts[1:])]
    rng.shuffle(runs)
    return runs


def _write(path: Path, runs: list[tuple[int, bytes]], stage: int, seed: int) -> bool:
    rng = random.Random(seed)
    with DirectFile(path, stage=stage) as out:
        for offset, data in runs:
            out.seek(offset)
            view, done = memoryview(data), 0
            while done < len(data):  # in pieces of every size, as torch.save writes
                take = rng.choice([1, 7, BLOCK - 3, BLOCK, 3 * BLOCK + 5, len(data)])
                out.write(view[done:done + take])
                done += min(take, len(data) - done)
            assert out.tell() == offset + len(data)
        return out.direct


@pytest.mark.parametrize("stage", [BLOCK, 3 * BLOCK, 64 * BLOCK])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_runs_land_where_they_were_written(tmp_path: Path, stage: int, seed: int) -> None:
    size = 40 * BLOCK + 1234
    runs = _runs(seed, size)
    expected = bytearray(size)
    for offset, data in runs:
        expected[offset:offset + len(data)] = data
    _write(tmp_path / "f.bin", runs, stage, seed)
    assert (tmp_path / "f.bin").read_bytes() == bytes(expected)


def test_sequential_writes_are_direct_here(tmp_path: Path) -> None:
    """On this machine's disk the whole blocks really bypass the page cache (else the
    test above would prove nothing about direct writes)."""
    data = os.urandom(5 * BLOCK + 17)
    with DirectFile(tmp_path / "f.bin", stage=2 * BLOCK) as out:
        out.write(data)
        direct = out.direct
    assert (tmp_path / "f.bin").read_bytes() == data
    if not direct:
        pytest.skip(f"{tmp_path}: its file system refuses O_DIRECT")


@pytest.mark.parametrize("refused_at", ["open", "write"])
def test_a_file_system_without_o_direct_gets_the_same_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused_at: str) -> None:
    """Refused at the open (the platform has no O_DIRECT) or at the first direct write
    (EINVAL, as some network file systems answer): everything is written buffered."""
    import mt_checkpoint.direct_io as direct_io

    if refused_at == "open":
        monkeypatch.setattr(direct_io, "_open_direct", lambda path: -1)
    else:
        real = direct_io._pwrite
        refused: list[int] = []

        def pwrite(fd: int, data: memoryview, offset: int) -> None:
            if _flags(fd) & os.O_DIRECT and not refused:
                refused.append(fd)
                raise OSError(errno.EINVAL, "Invalid argument")
            real(fd, data, offset)

        monkeypatch.setattr(direct_io, "_pwrite", pwrite)
    size = 9 * BLOCK + 99
    runs = _runs(5, size)
    expected = bytearray(size)
    for offset, data in runs:
        expected[offset:offset + len(data)] = data
    assert not _write(tmp_path / "f.bin", runs, 2 * BLOCK, 5)
    assert (tmp_path / "f.bin").read_bytes() == bytes(expected)
    if refused_at == "write":
        assert refused  # the direct write was tried, refused, and redone buffered


def _flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def test_a_failed_write_names_the_file(tmp_path: Path) -> None:
    full = Path("/dev/full")
    if not full.exists():
        pytest.skip("no /dev/full")
    out = DirectFile(tmp_path / "f.bin", stage=BLOCK)
    os.dup2(os.open(full, os.O_WRONLY), out.fd)  # every buffered write: ENOSPC
    with pytest.raises(OSError) as caught:
        out.write(b"x" * 10)
        out.close()
    assert caught.value.errno == errno.ENOSPC and str(tmp_path / "f.bin") in str(caught.value)
