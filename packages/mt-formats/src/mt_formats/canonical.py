"""The common language of every format: canonical tensors, references into files, and the
reader / writer interfaces.

A conversion never holds a whole model. Every format's reader presents the checkpoint as
the *canonical* mt tensors (full, unsharded, named as in ``mt_model.GPT``'s state dict,
tied embedding once) one at a time; every writer takes canonical tensors one at a time and
stores them in its own layout (transposed, sliced, renamed). Converting A -> B is then a
loop over canonical names, so peak memory stays near the largest tensor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mt_formats.errors import ConvertError
from mt_formats.spans import FileSpan
from mt_formats.tensors import TensorSpec
from mt_model import GPT, GPTConfig

__all__ = [
    "CheckpointReader",
    "CheckpointWriter",
    "Deferred",
    "Pieces",
    "ProgressFn",
    "Streamed",
    "TensorRef",
    "TrainingProgress",
    "canonical_shapes",
    "follow_pointer",
    "read_pointer",
]

ProgressFn = Callable[[str, int, int], None]
"""Called after each canonical tensor as ``(name, done, total)``."""
VerifyFn = Callable[[str | None], None]
"""Verifies a tensor read unverified, given its checksum if known (see read_deferred)."""


@dataclass(frozen=True)
class Deferred:
    """A tensor read without verification (:meth:`CheckpointReader.read_deferred`):
    ``verify`` checks it given its checksum (or None: it hashes), ``span`` is where its raw
    bytes are stored, when they are stored as-is (writers may copy from there)."""

    verify: VerifyFn
    span: FileSpan | None = None


@dataclass(frozen=True)
class Pieces:
    """A canonical tensor whose raw bytes are the concatenation of byte ranges of stored
    files (:meth:`CheckpointReader.read_pieces`), read unverified: a writer that stores it
    as-is copies the ranges in the kernel (:meth:`CheckpointWriter.write_pieces`) and
    hands ``verify`` each range's CRC (of :data:`mt_formats.crc.CHECKSUM_ALGORITHM`), from
    which it checks the source files' checksums (raises ConvertError)."""

    spec: TensorSpec
    spans: tuple[FileSpan, ...]
    verify: Callable[[list[int]], None]


class Streamed:
    """A canonical tensor's raw bytes (``spec``) as consecutive chunks, read and verified
    by the reader (:meth:`CheckpointReader.read_pieces`, :meth:`~CheckpointReader.read_stream`).
    A writer iterates it once (:meth:`CheckpointWriter.write_streamed`), writing each chunk
    (a view of the reader's memory, valid until the next is taken) or the shards it cuts
    out of it; then :attr:`crc` is the CRC (of :data:`mt_formats.crc.CHECKSUM_ALGORITHM`)
    of all the bytes. The iteration raises ConvertError where a stored file's checksum does
    not match, after the chunks of that tensor: the writer's output is then discarded, as
    after any failure."""

    def __init__(self, spec: TensorSpec, chunks: Generator[memoryview, None, int]) -> None:
        self.spec = spec
        self._chunks = chunks
        self._crc: int | None = None

    def __iter__(self) -> Iterator[memoryview]:
        self._crc = yield from self._chunks

    @property
    def crc(self) -> int:
        """The CRC of every chunk's bytes, joined (once they all were taken)."""
        if self._crc is None:
            raise RuntimeError("a Streamed tensor's CRC is known once its chunks were taken")
        return self._crc


@dataclass(frozen=True)
class TrainingProgress:
    """How far the training that wrote a checkpoint went (:meth:`CheckpointReader.progress`):
    ``step`` optimizer steps taken, ``tokens`` training tokens seen (None where the source
    does not record them)."""

    step: int
    tokens: int | None = None

    @staticmethod
    def checked(step: tuple[str, Any], tokens: tuple[str, Any], where: str
                ) -> TrainingProgress:
        """From stored ``(name, value)`` pairs (ints, or 0-d integer tensors; a token count
        of None: not recorded), or a one-line error naming ``where`` and the entry."""
        values = []
        for name, value in (step, tokens):
            if isinstance(value, torch.Tensor) and value.numel() == 1 and not (
                    value.is_floating_point() or value.is_complex()):
                value = int(value.item())
            if (value is not None or name == step[0]) and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConvertError(f"{where}: {name} is {value!r}, not a count of training "
                                   "steps or tokens (an integer >= 0)")
            values.append(value)
        return TrainingProgress(values[0], values[1])


def canonical_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Name -> full shape of every tensor of ``mt_model.GPT(config)``'s state dict, in
    module order. Built on the meta device, so it costs no memory even for 530B."""
    with torch.device("meta"):
        model = GPT(config, seed=None)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


@dataclass(frozen=True)
class TensorRef:
    """Where one stored tensor lives: ``file`` (relative to the checkpoint directory),
    ``key`` inside it, its spec, and how it relates to the canonical tensor
    (``transform``, e.g. ``"transpose"`` or ``"tp 1/2 column_qkv"``; empty for as-is)."""

    file: str
    key: str
    spec: TensorSpec
    transform: str = ""

    def describe(self) -> str:
        """One line for a dry run: ``file:key [shape] DTYPE (transform)``."""
        extra = f" ({self.transform})" if self.transform else ""
        return f"{self.file}:{self.key} {self.spec.describe()}{extra}"


class CheckpointReader(ABC):
    """A checkpoint seen as canonical mt tensors. Opening validates structure (config,
    tensor names and shapes) without reading tensor data; :meth:`read` verifies checksums.
    """

    format: str
    root: Path
    config: GPTConfig
    tokenizer: str | None = None
    """The tokenizer the model was trained with (as ``mt_data.load_tokenizer`` takes it),
    when the checkpoint says."""
    notes: tuple[str, ...] = ()
    """What a conversion from this source leaves out that the user should know (each
    printed as a ``note:`` line)."""

    @abstractmethod
    def names(self) -> list[str]:
        """Canonical tensor names, in module order."""

    @abstractmethod
    def spec(self, name: str) -> TensorSpec:
        """Full (unsharded) shape and stored dtype of canonical tensor ``name``."""

    @abstractmethod
    def sources(self, name: str) -> list[TensorRef]:
        """The stored tensors that make up canonical tensor ``name``."""

    @abstractmethod
    def read(self, name: str) -> torch.Tensor:
        """The full canonical tensor ``name`` (checksums verified)."""

    def read_deferred(self, name: str) -> tuple[torch.Tensor, Deferred | None]:
        """Like :meth:`read`, but a reader may leave the checksum verification to the
        caller (a :class:`Deferred`; None: already verified), who hashes the bytes anyway
        while writing them."""
        return self.read(name), None

    def read_pieces(self, name: str) -> Pieces | Streamed | None:
        """``name`` as byte ranges of the stored files, unverified (see :class:`Pieces`),
        or its bytes read and verified in chunks (:class:`Streamed`), or None
        where a writer storing it as-is cannot take it so (the caller then uses
        :meth:`read`)."""
        return None

    def read_stream(self, name: str) -> Streamed | None:
        """``name``'s canonical bytes read and verified in chunks (:class:`Streamed`), for
        a writer that slices them itself (:attr:`CheckpointWriter.accepts_streams`); None
        where this reader cannot (the caller then uses :meth:`read`)."""
        return None

    def optimizer_state(self, name: str) -> dict[str, torch.Tensor] | None:
        """Adam's state of canonical parameter ``name`` where the source holds one:
        ``exp_avg`` and ``exp_avg_sq`` (the parameter's canonical shape) and ``step`` (a
        scalar), and ``master`` (its fp32 main parameter) where the source keeps one apart
        from lower-precision weights; None where it holds none (weights-only formats)."""
        return None

    def optimizer_settings(self, name: str) -> dict[str, Any] | None:
        """Adam's hyperparameters that apply to canonical parameter ``name`` in the source
        (the keys of :data:`mt_formats.adam.SETTINGS` it records: ``lr``, ``betas``,
        ``eps``, ``weight_decay``, ``initial_lr``); None where it records none."""
        return None

    def check_optimizer_files(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Raise (:class:`ConvertError`) where the files of the source's optimizer state are
        found incomplete without reading them (some ranks' files absent, not regular files or
        empty): what a conversion carrying that state would refuse, asked by ``--dry-run``.
        Checks nothing by default."""

    def progress(self) -> TrainingProgress | None:
        """The optimizer steps (and tokens) the source's training had taken when it was
        saved, where the format records them (mt pretrain's meta, torchtitan's
        ``train_state``, Megatron-LM's ``iteration``, DeepSpeed's ``global_steps``); None
        where it records none. The dcp and mcore writers store it with Adam's state; the
        pretrain writer, whose schedule follows its own data loader, names it in a note."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Release open files."""

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CheckpointWriter(ABC):
    """Stores canonical tensors in one format. Constructing it only plans the layout
    (:meth:`targets` works without touching disk, for dry runs); :meth:`open` creates the
    files inside a directory, :meth:`write` takes each canonical tensor once (any order)
    and :meth:`finish` completes files and metadata."""

    format: str

    def __init__(self, config: GPTConfig, specs: dict[str, TensorSpec]) -> None:
        self.config = config
        self.specs = dict(specs)
        self.tokenizer: str | None = None
        """The tokenizer to store beside the weights (formats that carry one)."""
        self.state_source: CheckpointReader | None = None
        """Where :attr:`holds_optimizer_state`: a reader whose Adam state
        (:meth:`CheckpointReader.optimizer_state`) is stored beside the weights; None (or a
        source without one): weights only."""
        self.notes: list[str] = []
        """What the user should know about what was written (one line each)."""
        self._stated: dict[bool, list[str]] = {True: [], False: []}  # source_state's tally

    holds_optimizer_state: bool = False
    """Whether the format stores Adam's state beside the weights (:attr:`state_source`)."""

    def source_state(self, name: str) -> dict[str, torch.Tensor] | None:
        """:attr:`state_source`'s Adam state of ``name`` (None without a source or where it
        holds none), tallied for :meth:`check_states`."""
        state = None if self.state_source is None else self.state_source.optimizer_state(name)
        self._stated[state is not None].append(name)
        return state

    def check_states(self) -> None:
        """Refuse a source holding Adam's state for some parameters only (a file of one
        missing): carried as it is, a resumed run would step those from zero moments."""
        with_state, without = self._stated[True], self._stated[False]
        if with_state and without:
            root = getattr(self.state_source, "root", "the source")
            raise ConvertError(f"{root}: Adam's state of {len(with_state)} parameters but "
                               f"not of {without[0]!r} ({len(without)} without): a partial "
                               "optimizer state is not carried; --drop-optimizer converts "
                               "the weights alone")

    @abstractmethod
    def targets(self, name: str) -> list[TensorRef]:
        """The stored tensors canonical tensor ``name`` becomes."""

    @abstractmethod
    def open(self, directory: Path) -> None:
        """Start writing into ``directory`` (normally an atomic staging directory)."""

    @abstractmethod
    def write(self, name: str, tensor: torch.Tensor) -> str | None:
        """Store the full canonical tensor ``name``; may return the checksum of its bytes
        (``"crc32:..."``) when writing computed it along the way."""

    def write_from(self, name: str, tensor: torch.Tensor, span: FileSpan) -> str | None:
        """:meth:`write`, where ``tensor``'s raw bytes are also ``span`` of an open file
        (writers may copy from there instead of from memory)."""
        return self.write(name, tensor)

    accepts_pieces: bool = False
    """Whether :meth:`write_pieces` and :meth:`write_streamed` store a tensor given as byte
    ranges of files or as verified chunks."""

    accepts_streams: bool = False
    """Whether :meth:`write_streamed` stores a tensor given as the canonical tensor's bytes
    in chunks (:meth:`CheckpointReader.read_stream`), to be sliced by the writer."""

    def write_pieces(self, name: str, pieces: Pieces) -> list[int]:
        """Store ``name`` from ``pieces.spans`` as-is (only where :attr:`accepts_pieces`);
        returns each span's CRC (:data:`mt_formats.crc.CHECKSUM_ALGORITHM`)."""
        raise NotImplementedError(f"{type(self).__name__} does not write byte ranges")

    def write_streamed(self, name: str, streamed: Streamed) -> None:
        """Store ``name`` from ``streamed``'s chunks (only where :attr:`accepts_pieces`,
        as-is, with the checksum of ``streamed.crc``, or :attr:`accepts_streams`)."""
        raise NotImplementedError(f"{type(self).__name__} does not write streamed chunks")

    @abstractmethod
    def finish(self) -> None:
        """Complete every file (checksums, config); fails if a tensor was not written."""

    def abort(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Close open files after a failure (the staging directory is discarded)."""


def read_pointer(path: Path) -> str:
    """The name a pointer file (``latest``, ``latest_checkpointed_iteration.txt``) holds,
    stripped: a folder beside it. Anything else (not UTF-8 text, empty, a path, ``..``) is
    refused in one line naming the file."""
    try:
        text = path.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError as err:
        raise ConvertError(f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at "
                           f"offset {err.start})") from None
    except OSError as err:
        raise ConvertError(f"{path}: cannot be read ({err.strerror})") from None
    if not text:
        raise ConvertError(f"{path}: empty (it names the checkpoint folder beside it)")
    if text in (".", "..") or "/" in text or "\0" in text:
        raise ConvertError(f"{path}: names {text!r}, not a folder beside it")
    return text


def follow_pointer(path: Path, marker: str, pointer: str, kind: str) -> Path | None:
    """The checkpoint folder ``path`` designates: itself when it holds ``marker``, else the
    folder its ``pointer`` file (e.g. ``latest``) names, which must hold ``marker``; None when
    ``path`` has neither. ``kind`` names the format in the error for a dangling pointer."""
    if (path / marker).exists():
        return path
    if not (path / pointer).is_file():
        return None
    target = path / read_pointer(path / pointer)
    if not (target / marker).exists():
        raise ConvertError(f"{path / pointer}: names {target.name}, which has no {marker} "
                           f"(incomplete {kind})")
    return target
