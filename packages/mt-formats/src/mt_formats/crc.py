"""Checksum strings, and CRC arithmetic: the checksum of joined byte strings from the
checksums of the pieces, for any reflected 32-bit CRC polynomial.

Checksums are self-describing strings, ``"<kind>:<8 hex>"`` for the CRCs or a bare 64-digit
hex digest for SHA-256:

- ``"crc32c:1a2b3c4d"``: CRC-32C (Castagnoli, the ``crc32c`` package, which uses the CPU's
  CRC instructions: about 3x zlib's speed here). What writers record (format version 3).
- ``"crc32:1a2b3c4d"``: zlib's CRC-32 (format version 2; still verified).
- a bare SHA-256 hex digest (format version 1; still verified).

A conversion writes each shard as views of the tensor it read, hashing the pieces as they
are written. When the pieces tile the source tensor (column, fused-qkv, vocabulary and
replicated slicing do; row slicing does not), :func:`join_crcs` assembles the source
tensor's CRC from them, so verifying what was read costs no second pass over the bytes.
:func:`crc_combine` is zlib's ``crc32_combine`` (which Python does not expose) made generic
over the polynomial: multiplication of the first CRC by x^(8 len2) modulo the polynomial,
in reflected bit order. CRC-32 and CRC-32C both detect every burst error up to 32 bits;
neither resists deliberate tampering.
"""

from __future__ import annotations

import functools
import hashlib
import types
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import crc32c as _crc32c

from mt_formats.errors import ConvertError

__all__ = [
    "CHECKSUM_ALGORITHM",
    "CRC32C_POLY",
    "CRC32_POLY",
    "KNOWN_ALGORITHMS",
    "CrcKind",
    "algorithm_of",
    "crc32_combine",
    "crc_combine",
    "crc_kind",
    "digest",
    "join_crcs",
]

CHECKSUM_ALGORITHM = "crc32c"
"""What writers record (see :func:`digest`)."""
CRC32_POLY = 0xEDB88320  # zlib's CRC-32, reflected
CRC32C_POLY = 0x82F63B78  # Castagnoli, reflected


def _multmodp(a: int, b: int, poly: int) -> int:
    """a * b modulo ``poly`` (a must be non-zero: it always is a power of x)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ poly if b & 1 else b >> 1


def _powers(poly: int) -> tuple[int, ...]:
    """x^(2^k) mod ``poly``, k = 0..31."""
    p, table = 1 << 30, []  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p, poly)
    return tuple(table)


@dataclass(frozen=True)
class CrcKind:
    """One CRC checksum kind: its name in checksum strings, its reflected polynomial, the
    incremental function ``update(data, crc) -> crc`` and x^(2^k) modulo the polynomial."""

    name: str
    poly: int
    update: Callable[[Any, int], int]
    x2n: tuple[int, ...]

    def format(self, crc: int) -> str:
        """The checksum string of a CRC value."""
        return f"{self.name}:{crc:08x}"


def _crc32c_update(data: Any, crc: int) -> int:
    return _crc32c.crc32c(data, crc)  # releases the GIL on large buffers


_KINDS: Mapping[str, CrcKind] = types.MappingProxyType({
    "crc32c": CrcKind("crc32c", CRC32C_POLY, _crc32c_update, _powers(CRC32C_POLY)),
    "crc32": CrcKind("crc32", CRC32_POLY, zlib.crc32, _powers(CRC32_POLY)),
})
KNOWN_ALGORITHMS: tuple[str, ...] = (*_KINDS, "sha256")
"""Every checksum kind a reader verifies."""


def crc_kind(algorithm: str) -> CrcKind | None:
    """The CRC kind named ``algorithm`` (None for sha256; ConvertError if unknown)."""
    if algorithm == "sha256":
        return None
    if algorithm not in _KINDS:
        raise ConvertError(f"unknown checksum algorithm {algorithm!r}; supported: "
                           f"{', '.join(KNOWN_ALGORITHMS)}")
    return _KINDS[algorithm]


def _x2nmodp(n: int, k: int, kind: CrcKind) -> int:
    """x^(n * 2^k) modulo the polynomial."""
    p = 1 << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(kind.x2n[k & 31], p, kind.poly)
        n >>= 1
        k += 1
    return p


def crc_combine(crc1: int, crc2: int, len2: int, algorithm: str = CHECKSUM_ALGORITHM) -> int:
    """The CRC of ``a + b`` from ``crc1`` (of ``a``), ``crc2`` (of ``b``) and ``len2 =
    len(b)``, for the CRC kind ``algorithm`` (``"crc32c"`` or ``"crc32"``)."""
    kind = crc_kind(algorithm)
    if kind is None:
        raise ConvertError("sha256 digests cannot be combined")
    return _multmodp(_shift(len2, algorithm), crc1, kind.poly) ^ crc2 if len2 else crc1


@functools.lru_cache(maxsize=4096)
def _shift(length: int, algorithm: str) -> int:
    """x^(8 * length) modulo the polynomial of ``algorithm``: what appending ``length``
    bytes does to a CRC (cached: a merge combines many pieces of a few lengths)."""
    kind = crc_kind(algorithm)
    assert kind is not None
    return _x2nmodp(length, 3, kind)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` from ``zlib.crc32(a)``, ``zlib.crc32(b)`` and ``len(b)``."""
    return crc_combine(crc1, crc2, len2, "crc32")


def join_crcs(pieces: Iterable[tuple[int, int, int]], total: int,
              algorithm: str = CHECKSUM_ALGORITHM) -> int | None:
    """CRC of ``total`` bytes from ``(offset, length, crc)`` pieces (duplicates allowed),
    or None unless they tile ``[0, total)`` exactly."""
    crc, position = 0, 0
    for offset, length, piece in sorted(set(pieces)):  # a copy of the same bytes: once
        if offset != position:
            return None
        crc, position = crc_combine(crc, piece, length, algorithm), position + length
    return crc if position == total else None


class _Hasher:
    """Incremental :func:`digest` (bytes fed in pieces give the digest of their join)."""

    def __init__(self, algorithm: str) -> None:
        self._kind = crc_kind(algorithm)
        self._sha = hashlib.sha256() if self._kind is None else None
        self._crc = 0

    def update(self, data: Any) -> None:
        if self._kind is not None:
            self._crc = self._kind.update(data, self._crc)
        else:
            assert self._sha is not None
            self._sha.update(data)

    def hexdigest(self) -> str:
        if self._kind is not None:
            return self._kind.format(self._crc)
        assert self._sha is not None
        return self._sha.hexdigest()


def digest(data: Any, algorithm: str = CHECKSUM_ALGORITHM) -> str:
    """Checksum string of a bytes-like ``data``: ``"crc32c:%08x"``, ``"crc32:%08x"`` or a
    sha256 hex digest. All three release the GIL on large buffers, so threads hash in
    parallel."""
    hasher = _Hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


def algorithm_of(checksum: str) -> str:
    """The algorithm a checksum string was made with (raises ConvertError if unknown)."""
    if len(checksum) == 64 and ":" not in checksum:
        return "sha256"
    name, _, value = checksum.partition(":")
    if name in _KINDS and len(value) == 8:
        return name
    raise ConvertError(f"unrecognised checksum {checksum!r} (supported: 'crc32c:' or "
                       "'crc32:' + 8 hex digits, or a 64-digit sha256 hex digest)")
