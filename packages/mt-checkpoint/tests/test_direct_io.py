"""DirectFile: the bytes of every run land where they were written, whatever the run's
alignment, the stage size and the order of the runs; where the file system refuses
O_DIRECT the same bytes are written buffered; a failed write names the file; the buffers of
direct requests lie in memory the kernel may back with huge pages."""

from __future__ import annotations

import ctypes
import errno
import os
import random
import re
from pathlib import Path

import pytest

from mt_checkpoint.direct_io import BLOCK, DirectFile, direct_buffer


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


def _mapping(address: int) -> str:
    """This process's ``/proc/self/smaps`` entry of the mapping holding ``address``."""
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        low, high = (int(part, 16) for part in entry.split(None, 1)[0].split("-"))
        if low <= address < high:
            return entry
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("size", [1, BLOCK + 1, (2 << 20) - 1, 2 << 20, (8 << 20) + 5])
def test_direct_buffers_are_aligned_and_huge_page_eligible_from_2_mib(size: int) -> None:
    """The size asked, writable, page-aligned; from 2 MiB on at a 2 MiB boundary in private
    memory the kernel may back with transparent huge pages (a shared mapping may not: a
    direct request from it leaves in pieces of a few hundred KiB)."""
    buffer = direct_buffer(size)
    assert len(buffer) == size and not buffer.readonly
    buffer[-1:] = b"\x07"
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    assert address % (2 << 20 if size >= 2 << 20 else BLOCK) == 0
    mapping = _mapping(address)
    assert mapping.split()[1].endswith("p"), mapping.splitlines()[0]  # private
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if size >= 2 << 20 and enabled.exists() and "[never]" not in enabled.read_text():
        assert re.search(r"^THPeligible:\s+1$", mapping, re.M), mapping


def test_a_refused_buffer_leaves_no_file_and_names_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The staging buffers are allocated before the file is created: where memory is refused
    no empty file is left behind, no descriptor stays open, and the error names the file.
    A negative size is no buffer."""
    import mt_checkpoint.direct_io as direct_io

    def refused(size: int) -> memoryview:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(direct_io, "direct_buffer", refused)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError) as caught:
        DirectFile(tmp_path / "f.bin")
    assert caught.value.errno == errno.ENOMEM and str(tmp_path / "f.bin") in str(caught.value)
    assert not (tmp_path / "f.bin").exists() and len(os.listdir("/proc/self/fd")) == fds
    monkeypatch.undo()
    with pytest.raises(ValueError, match="a buffer of -1 bytes"):
        direct_buffer(-1)
