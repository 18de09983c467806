"""torch Distributed Checkpoint (DCP) folders: ``.metadata`` + ``__R_I.distcp`` files, as
``torch.distributed.checkpoint.save`` writes them (torchtitan's checkpoints, FSDP2 / TP
training scripts).

Read at any source sharding, without a process group: each tensor is assembled from the
chunks every saving rank wrote (each chunk read with ``torch.load(weights_only=True)``;
chunks stored through a DCP stream transform, e.g. zstd, are read by ``dcp.load`` itself).
The names are recognised (:mod:`mt_formats.dcp_names`: torchtitan's Llama, transformers'
GPT-2 and Llama, mt's); of the other entries saved beside the model only Adam's state under
``optimizer.state.<parameter>.*`` and its settings under ``optimizer.param_groups.<parameter>.*``
(torch's flattened optimizer state dict, as torchtitan saves it) are read.

Trust: DCP's own reader unpickles ``.metadata`` with ``pickle.load``; here it is unpickled
by an allow-list of DCP's metadata classes, and anything else is refused in one line.
Every chunk must lie in a plain file of the folder and the chunks of a tensor must tile
it exactly (no gap a reader would leave uninitialised). Non-tensor items are loaded only
for the optimizer's settings, with ``torch.load(weights_only=True)``. DCP records
no checksums: a folder mt wrote carries ``mt.json`` (the model config, and the CRC-32C of
every stored tensor and setting and of ``.metadata``, checked when read); a foreign folder
records no config
either, which ``--model`` gives (sizes are read from the tensors).

Written one tensor at a time (:class:`DCPFileWriter`: each chunk ``torch.save``d into
``__0_0.distcp`` as ``dcp.save`` stores it, then torch's own ``Metadata`` pickled into
``.metadata``), plus ``mt.json``; ``dcp.load`` fills the model's own state dict with it
(torchtitan's Llama, transformers' ``GPT2LMHeadModel``).
"""

from __future__ import annotations

import io
import os
import pickle
import threading
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from mt_checkpoint import DirectFile
from mt_formats.adam import SETTINGS, adam_step, adamw_group, settings_of
from mt_formats.canonical import (
    CheckpointReader,
    CheckpointWriter,
    TensorRef,
    TrainingProgress,
    canonical_shapes,
)
from mt_formats.crc import CHECKSUM_ALGORITHM
from mt_formats.dcp_files import (
    DCP_FORMAT,
    METADATA_FILE,
    SIDECAR,
    check_files,
    is_dcp_checkpoint,
    read_sidecar,
    write_sidecar,
)
from mt_formats.dcp_names import Naming, Part, detect_naming, writer_naming
from mt_formats.deepspeed_universal import config_fields
from mt_formats.errors import ConvertError
from mt_formats.tensors import TensorSpec, check_names, tensor_checksum
from mt_formats.torch_io import save_into
from mt_model import GPTConfig

__all__ = ["DCP_FORMAT", "DCPFileWriter", "DCPFolder", "DCPReader", "DCPWriter", "config_from",
           "is_dcp_checkpoint", "optimizer_key", "read_metadata", "read_sidecar",
           "write_sidecar"]

DATA_FILE = "__0_0.distcp"
#: Held around ``dcp.load``'s silenced warning: ``warnings.catch_warnings`` swaps the
#: process-wide filter list and puts back the one it found, so two threads inside at once
#: (the converter's read-ahead and the writer's optimizer-state reads) could put back the
#: other's silenced list, leaving every warning ignored for good.
_SILENCED = threading.Lock()

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "TensorProperties", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.planner", name) for name in (
    # Megatron-core keeps every rank's save plan in the metadata (``all_local_plans``)
    "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
     ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata classes, torch dtypes and sizes; refuses any other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_metadata(root: Path) -> Metadata:
    """The DCP metadata of folder ``root``, unpickled by the allow-list, with every storage
    location checked (a plain file of the folder, within its size)."""
    path = root / METADATA_FILE
    try:
        with path.open("rb") as file:
            metadata = _MetadataUnpickler(file).load()
    except pickle.UnpicklingError as err:
        raise ConvertError(f"{path}: holds {err}, which DCP metadata does not; refusing to "
                           "unpickle it") from None
    except Exception as err:  # noqa: BLE001 - any malformation of untrusted bytes: one line
        raise ConvertError(f"{path}: not readable DCP metadata (malformed or truncated): "
                           f"{type(err).__name__}: {err}") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise ConvertError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if not (isinstance(getattr(info, "offset", None), int)
                and isinstance(getattr(info, "length", None), int)):
            raise ConvertError(f"{path}: tensor {getattr(index, 'fqn', index)!r}: its storage "
                               "entry has no integer offset and length")
        file = getattr(info, "relative_path", None)
        if not isinstance(file, str):
            raise ConvertError(f"{path}: tensor {getattr(index, 'fqn', index)!r}: its storage "
                               f"entry names no file (a {type(file).__name__}): the metadata "
                               "is damaged")
        if Path(file).name != file or file in ("", ".", ".."):
            raise ConvertError(f"{path}: tensor {index.fqn!r} is stored in {file!r}, not a "
                               "plain file name of the folder")
        if file not in sizes:
            if not (root / file).is_file():
                raise ConvertError(f"{root / file}: file not found (tensor {index.fqn!r})")
            sizes[file] = (root / file).stat().st_size
        if info.offset < 0 or info.length < 0 or info.offset + info.length > sizes[file]:
            raise ConvertError(f"{root / file}: tensor {index.fqn!r} would be bytes "
                               f"{info.offset}..{info.offset + info.length}, the file has "
                               f"{sizes[file]} (truncated?)")
    return metadata


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _volume(extent: tuple[int, ...]) -> int:
    count = 1
    for n in extent:
        count *= n
    return count


def _check_chunks(root: Path, key: str, meta: TensorStorageMetadata) -> None:
    """The chunks of tensor ``key`` lie inside it and tile it without gap or overlap."""
    size = tuple(meta.size)
    boxes = []
    for chunk in meta.chunks:
        start, extent = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(start) != len(size) or len(extent) != len(size) or any(
                o < 0 or n < 0 or o + n > s for o, n, s in zip(start, extent, size, strict=True)):
            raise ConvertError(f"{root / METADATA_FILE}: tensor {key!r}: chunk at {list(start)} "
                               f"of size {list(extent)} lies outside its shape {list(size)}")
        if _volume(extent):
            boxes.append((start, extent))
    boxes.sort()
    for i, (start, extent) in enumerate(boxes):  # sorted by the first offset: a sweep
        for other, other_extent in boxes[i + 1:]:
            if size and other[0] >= start[0] + extent[0]:
                break
            if all(a < b + m and b < a + n for a, n, b, m in
                   zip(start, extent, other, other_extent, strict=True)):
                raise ConvertError(f"{root / METADATA_FILE}: tensor {key!r}: chunks at "
                                   f"{list(start)} and {list(other)} overlap")
    held = sum(_volume(extent) for _, extent in boxes)
    if held != _volume(size):
        raise ConvertError(f"{root / METADATA_FILE}: tensor {key!r}: its chunks hold {held} "
                           f"of its {_volume(size)} elements (a rank's file missing from the "
                           "save?)")


class _Storage(FileSystemReader):
    """DCP's file reader, given the metadata already read and checked (so ``dcp.load``
    never runs ``pickle.load`` on it)."""

    def __init__(self, root: Path, metadata: Metadata) -> None:
        super().__init__(root)
        self._checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._checked


class DCPFolder:
    """A checked DCP folder (:func:`read_metadata`) and the reads mt makes of it: whole
    tensors through ``dcp.load``, and single layers of tensors stacked along a leading axis
    (Megatron-core's) from the chunks that hold them. ``checksums`` (key -> CRC string),
    when known, are checked on every read."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.metadata = read_metadata(self.root)
        self.tensors = {key: meta for key, meta in self.metadata.state_dict_metadata.items()
                        if isinstance(meta, TensorStorageMetadata)}
        self.objects = {key for key, meta in self.metadata.state_dict_metadata.items()
                        if isinstance(meta, BytesStorageMetadata)}
        self.checksums: dict[str, str] = {}
        self._recorded = False  # mt.json read: every tensor mt wrote has a checksum there
        self._storage = _Storage(self.root, self.metadata)

    def recorded_config(self, model: object) -> GPTConfig | None:
        """The config ``mt.json`` records (its checksums then checked on every read), or
        None for a folder mt did not write; ``model`` (``--model``) is refused beside it."""
        sidecar = read_sidecar(self.root)
        if sidecar is None:
            return None
        if model is not None:
            raise ConvertError(f"{self.root / SIDECAR}: this checkpoint records its model "
                               "config; --model does not apply")
        check_files(self.root, sidecar)
        self.checksums = dict(sidecar.get("checksums") or {})
        stored = self.tensors.keys() | self.objects
        for key in self.checksums:
            if key.partition("[")[0] not in stored:  # mcore's per-layer ``key[layer]``
                raise ConvertError(f"{self.root / SIDECAR}: records a checksum of {key!r}, "
                                   f"which {METADATA_FILE} does not list: one of the two was "
                                   "changed")
        self._recorded = True
        return config_from(sidecar.get("model"), self.root / SIDECAR)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: tuple(meta.size) for key, meta in self.tensors.items()}

    def spec(self, key: str) -> TensorSpec:
        meta = self.tensors[key]
        return TensorSpec(tuple(meta.size), meta.properties.dtype)

    def file_of(self, key: str) -> str:
        """The file holding tensor ``key`` (or how many do)."""
        files = sorted({info.relative_path for index, info in self.metadata.storage_data.items()
                        if index.fqn == key})
        return files[0] if len(files) == 1 else f"{len(files)} files ({files[0]}, ...)"

    def check(self, key: str) -> None:
        """Tensor ``key``'s chunks tile it (see :func:`_check_chunks`)."""
        _check_chunks(self.root, key, self.tensors[key])

    def _failed(self, key: str, err: BaseException) -> ConvertError:
        cause = err
        if isinstance(err, CheckpointException) and err.failures:  # DCP wraps the cause
            cause = next(iter(err.failures.values()))[0]
        first = (f"{type(cause).__name__}: " + next(iter(str(cause).splitlines()), "")
                 if not isinstance(cause, pickle.UnpicklingError) else "not a plain tensor "
                 "(damaged, or other pickled objects, which are refused)")
        return ConvertError(f"{self.root / self.file_of(key)}: tensor {key!r}: not readable "
                            f"(malformed or truncated): {first}")

    def load(self, key: str) -> torch.Tensor:
        """Tensor ``key``, whole, from however many chunks it was saved in (each chunk
        ``torch.load(weights_only=True)``-ed and copied into place; chunks stored with a
        DCP transform, e.g. compression, go through ``dcp.load`` itself)."""
        meta = self.tensors[key]
        if any(getattr(info, "transform_descriptors", None) for index, info in
               self.metadata.storage_data.items() if index.fqn == key):
            return self._checked(key, None, self._dcp_load(key))
        if len(meta.chunks) == 1:  # saved whole (chunks tile the tensor: it is all of it)
            chunk = meta.chunks[0]
            return self._checked(key, None, self._chunk(key, tuple(chunk.offsets),
                                                        tuple(chunk.sizes)))
        out = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for chunk in meta.chunks:
            start, extent = tuple(chunk.offsets), tuple(chunk.sizes)
            out[tuple(slice(o, o + n) for o, n in zip(start, extent, strict=True))] = (
                self._chunk(key, start, extent))
        return self._checked(key, None, out)

    def _dcp_load(self, key: str) -> torch.Tensor:
        meta = self.tensors[key]
        out = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        try:
            with _SILENCED, warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "...assuming the intent is to load in a
                # single process": it is
                dcp.load({key: out}, storage_reader=self._storage, no_dist=True)
        except (CheckpointException, RuntimeError, OSError, EOFError, ValueError,
                AssertionError, pickle.UnpicklingError) as err:
            raise self._failed(key, err) from None
        return out

    def _chunk(self, key: str, start: tuple[int, ...], extent: tuple[int, ...]
               ) -> torch.Tensor:
        """The stored chunk of ``key`` at ``start`` (a tensor of shape ``extent``)."""
        info = self.metadata.storage_data.get(MetadataIndex(key, torch.Size(start)))
        if info is None or getattr(info, "transform_descriptors", None):
            raise ConvertError(f"{self.root / METADATA_FILE}: tensor {key!r}: chunk at "
                               f"{list(start)} has no plain storage entry")
        try:
            with open(self.root / info.relative_path, "rb") as file:
                file.seek(info.offset)
                raw = file.read(info.length)
            piece = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as err:
            raise self._failed(key, err) from None
        if not isinstance(piece, torch.Tensor) or tuple(piece.shape) != extent:
            raise ConvertError(f"{self.root / info.relative_path}: tensor {key!r}: chunk at "
                               f"{list(start)} holds {getattr(piece, 'shape', piece)!r}, "
                               f"not a tensor of shape {list(extent)}")
        recorded = self.tensors[key].properties.dtype
        if piece.dtype != recorded:  # else copied into place as the other dtype, or not
            raise ConvertError(f"{self.root / info.relative_path}: tensor {key!r}: chunk at "
                               f"{list(start)} holds {_dtype_name(piece.dtype)}, "
                               f"{METADATA_FILE} records {_dtype_name(recorded)}")
        return piece

    def load_object(self, key: str) -> Any:
        """Plain value ``key`` (DCP stores non-tensors as ``torch.save`` bytes, through the
        folder's transforms if any), read with ``weights_only=True``; its checksum checked
        where recorded (:func:`bytes_checksum`)."""
        info = self.metadata.storage_data.get(MetadataIndex(key))
        if info is None:
            raise ConvertError(f"{self.root / METADATA_FILE}: entry {key!r} has no storage "
                               "entry")
        path = self.root / info.relative_path
        try:
            with open(path, "rb") as file:
                file.seek(info.offset)
                raw = file.read(info.length)
            expected = self.checksums.get(key)
            if expected is not None and bytes_checksum(raw) != expected:
                raise ConvertError(f"{path}: entry {key!r}: checksum mismatch (recorded "
                                   f"{expected} in {SIDECAR}): the file is corrupted")
            stream = self._storage.transforms.transform_load_stream(
                None, getattr(info, "transform_descriptors", None) or (), io.BytesIO(raw))
            return torch.load(io.BytesIO(stream.read()), weights_only=True)
        except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as err:
            raise ConvertError(f"{path}: entry {key!r}: not readable (malformed, truncated or "
                               f"not a plain value): {type(err).__name__}") from None

    def _unrecorded(self, key: str, what: str = "") -> ConvertError:
        return ConvertError(f"{self.root / SIDECAR}: records no checksum of tensor {key!r}"
                            f"{what}, which mt writes for every tensor: the file was changed")

    def _checked(self, key: str, layer: int | None, tensor: torch.Tensor) -> torch.Tensor:
        name = key if layer is None else f"{key}[{layer}]"
        expected = self.checksums.get(name)
        what = "" if layer is None else f" layer {layer}"
        if expected is None and self._recorded:
            raise self._unrecorded(key, what)
        if expected is not None and tensor_checksum(tensor, expected.split(":")[0]) != expected:
            raise ConvertError(f"{self.root / self.file_of(key)}: tensor {key!r}{what}: "
                               f"checksum mismatch (recorded {expected} in {SIDECAR}): the "
                               "file is corrupted")
        return tensor

    def load_range(self, key: str, start: int, length: int) -> torch.Tensor:
        """Elements ``[start, start + length)`` of the 1-D tensor ``key``, read from the
        chunks that hold them. Checksums cover whole tensors or layers: ranges are read
        from folders mt did not write (mt writes a checksum of every tensor it stores)."""
        if self._recorded:
            raise self._unrecorded(key)
        meta = self.tensors[key]
        out = torch.empty(length, dtype=meta.properties.dtype)
        for chunk in meta.chunks:
            (offset,), (size,) = tuple(chunk.offsets), tuple(chunk.sizes)
            low, high = max(offset, start), min(offset + size, start + length)
            if low < high:
                out[low - start:high - start] = self._chunk(key, (offset,), (size,))[
                    low - offset:high - offset]
        return out

    def load_layer(self, key: str, layer: int) -> torch.Tensor:
        """``tensor[layer]`` of a tensor stacked along its first axis, read from the chunks
        that hold that layer only."""
        meta = self.tensors[key]
        out = torch.empty(tuple(meta.size)[1:], dtype=meta.properties.dtype)
        for chunk in meta.chunks:
            start, extent = tuple(chunk.offsets), tuple(chunk.sizes)
            if start[0] <= layer < start[0] + extent[0]:
                out[tuple(slice(o, o + n) for o, n in zip(start[1:], extent[1:], strict=True))] = (
                    self._chunk(key, start, extent)[layer - start[0]])
        return self._checked(key, layer, out)


class DCPReader(CheckpointReader):
    """A DCP folder as canonical mt tensors (see the module docstring). ``model`` gives the
    config of a folder mt did not write (a ``GPTConfig``, preset name or JSON file)."""

    format = DCP_FORMAT

    def __init__(self, root: Path, model: GPTConfig | str | Mapping[str, Any] | None = None
                 ) -> None:
        self.root = Path(root)
        self._folder = DCPFolder(self.root)
        recorded = self._folder.recorded_config(model)  # first: mt.json checks the files
        self.naming = detect_naming(set(self._folder.tensors), self.root / METADATA_FILE)
        shapes = self._folder.shapes()
        if recorded is not None:
            self.config = recorded
        else:
            fields, _ = config_fields(model, self.root, {})
            if fields is None:
                raise ConvertError(
                    f"{self.root}: a DCP checkpoint does not record the model config ("
                    f"{self.naming.family} names); give it with --model PRESET or --model "
                    "CONFIG.json (GPTConfig fields; sizes are read from the tensors)")
            sizes = self.naming.sizes(shapes, fields, self.root / METADATA_FILE)
            self.config = config_from({**fields, **sizes}, self.root / METADATA_FILE)
        self._shapes = canonical_shapes(self.config)
        self._parts = {name: self.naming.parts(name, self.config) for name in self._shapes}
        self._tied = self.naming.tied_copy(self.config)
        self._check(shapes)

    def _check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        where = self.root / METADATA_FILE
        expected = [part.key for parts in self._parts.values() for part in parts]
        found = [key for key in shapes if self.naming.owns(key) and key != self._tied]
        check_names(where, found, expected)
        for name, parts in self._parts.items():
            for part in parts:
                wanted = part.shape(self._shapes[name])
                if shapes[part.key] != wanted:
                    raise ConvertError(f"{where}: tensor {part.key!r} has shape "
                                       f"{list(shapes[part.key])}, the model config needs "
                                       f"{list(wanted)}")
                self._folder.check(part.key)
        if self._tied is not None and self._tied in shapes:
            if shapes[self._tied] != self._shapes["embed.tokens.weight"]:
                raise ConvertError(f"{where}: {self._tied!r} has shape "
                                   f"{list(shapes[self._tied])}, not the embedding's: an "
                                   "untied output head for a tied config")
            self._folder.check(self._tied)

    def names(self) -> list[str]:
        return list(self._shapes)

    def spec(self, name: str) -> TensorSpec:
        return TensorSpec(self._shapes[name], self._folder.spec(self._parts[name][0].key).dtype)

    def sources(self, name: str) -> list[TensorRef]:
        folder = self._folder
        refs = [TensorRef(folder.file_of(part.key), part.key, folder.spec(part.key),
                          part.transform) for part in self._parts[name]]
        if name == "embed.tokens.weight" and self._tied in folder.tensors:
            refs.append(TensorRef(folder.file_of(self._tied), self._tied,
                                  folder.spec(self._tied), "tied: must equal the embedding"))
        return refs

    def read(self, name: str) -> torch.Tensor:
        pieces = [part.load(self._folder.load(part.key)) for part in self._parts[name]]
        tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if name == "embed.tokens.weight" and self._tied in self._folder.tensors:
            recorded = self._folder.checksums
            if self._parts[name][0].key in recorded and self._tied in recorded:
                same = recorded[self._tied] == recorded[self._parts[name][0].key]
            else:  # a foreign folder: compare the copy itself
                same = torch.equal(self._folder.load(self._tied), tensor)
            if not same:
                raise ConvertError(f"{self.root}: {self._tied!r} differs from the embedding: "
                                   "an untied output head is not supported for a tied config")
        return tensor


    def _state_key(self, key: str, state: str, section: str = "state") -> str | None:
        """The DCP key of optimizer state ``state`` of stored parameter ``key``
        (:func:`optimizer_key`, with or without the model's prefix), or of its param
        group's setting ``state`` with ``section="param_groups"``."""
        stored = self._folder.tensors if section == "state" else self._folder.objects
        for fqn in (key, key.removeprefix(self.naming.prefix)):
            candidate = optimizer_key(fqn, state, section)
            if candidate in stored:
                return candidate
        return None

    def optimizer_settings(self, name: str) -> dict[str, Any] | None:
        """The settings of :data:`~mt_formats.adam.SETTINGS` recorded for ``name`` in the
        flattened optimizer state dict (``optimizer.param_groups.<fqn>.<setting>``; every
        stored part of ``name`` alike); None where none is recorded."""
        where = self.root / METADATA_FILE
        found: dict[str, Any] | None = None
        for part in self._parts[name]:
            keys = {setting: self._state_key(part.key, setting, "param_groups")
                    for setting in SETTINGS}
            settings = settings_of({setting: self._folder.load_object(key)
                                    for setting, key in keys.items() if key is not None},
                                   f"{where}: {part.key}")
            if found is not None and settings != found:
                raise ConvertError(f"{where}: the parts of {name!r} are in param groups of "
                                   f"different settings ({found} and {settings})")
            found = settings
        return found or None

    def optimizer_state(self, name: str) -> dict[str, torch.Tensor] | None:
        parts = self._parts[name]
        keys = {(part.key, state): self._state_key(part.key, state) for part in parts
                for state in ("exp_avg", "exp_avg_sq", "step")}
        if not any(keys.values()):
            return None
        missing = [f"{key} {state}" for (key, state), found in keys.items() if found is None]
        if missing:
            raise ConvertError(f"{self.root / METADATA_FILE}: optimizer state incomplete: no "
                               f"{', '.join(missing[:4])}")
        result: dict[str, torch.Tensor] = {}
        for state in ("exp_avg", "exp_avg_sq"):
            pieces = [part.load(self._folder.load(keys[(part.key, state)])) for part in parts]
            result[state] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            if tuple(result[state].shape) != self._shapes[name]:
                raise ConvertError(f"{self.root / METADATA_FILE}: {state} of {name!r} has shape "
                                   f"{list(result[state].shape)}, the parameter "
                                   f"{list(self._shapes[name])}")
        steps = {adam_step(self._folder.load(keys[(part.key, "step")]),
                           f"{self.root / METADATA_FILE}: {keys[(part.key, 'step')]}")
                 for part in parts}
        if len(steps) != 1:
            raise ConvertError(f"{self.root / METADATA_FILE}: the parts of {name!r} were "
                               f"stepped {sorted(steps)} times")
        result["step"] = torch.tensor(steps.pop())
        return result

    def progress(self) -> TrainingProgress | None:
        """torchtitan's ``train_state.step`` and ``train_state.ntokens_seen`` (plain ints,
        or a 0-d tensor for the step in torchtitan before 0.3), else its
        ``lr_scheduler.last_epoch`` (a LambdaLR steps once per optimizer step); None where
        the folder holds neither."""
        values = {key: self._entry(key) for key in PROGRESS_KEYS}
        step = TRAIN_STEP if values[TRAIN_STEP] is not None else SCHEDULER_STEP
        if values[step] is None:
            return None
        return TrainingProgress.checked((step, values[step]),
                                        (TRAIN_TOKENS, values[TRAIN_TOKENS]),
                                        str(self.root / METADATA_FILE))

    def _entry(self, key: str) -> Any:
        """Stored value ``key``, a plain value or a tensor; None where absent."""
        if key in self._folder.objects:
            return self._folder.load_object(key)
        if key in self._folder.tensors:
            return self._folder.load(key)
        return None


#: torchtitan's training progress in its checkpoints: ``Trainer.state_dict()`` under
#: ``train_state``, ``LRSchedulersContainer.state_dict()`` under ``lr_scheduler``.
TRAIN_STEP, TRAIN_TOKENS = "train_state.step", "train_state.ntokens_seen"
SCHEDULER_STEP = "lr_scheduler.last_epoch"
PROGRESS_KEYS = (TRAIN_STEP, TRAIN_TOKENS, SCHEDULER_STEP)


def optimizer_key(fqn: str, state: str, section: str = "state") -> str:
    """The DCP key of Adam's ``state`` (``exp_avg``, ``exp_avg_sq``, ``step``) of the
    parameter stored as ``fqn``, or with ``section="param_groups"`` of its param group's
    setting ``state`` (``lr``, ``betas``, ...): torch's flattened optimizer state dict
    (``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``, as torchtitan
    saves it) under ``optimizer``."""
    return f"optimizer.{section}.{fqn}.{state}"


def bytes_checksum(raw: bytes) -> str:
    """The checksum (:data:`~mt_formats.crc.CHECKSUM_ALGORITHM`) of a plain value's stored
    bytes, as ``mt.json`` records it."""
    return tensor_checksum(torch.frombuffer(bytearray(raw), dtype=torch.uint8),
                           CHECKSUM_ALGORITHM)


def config_from(fields: Any, where: Path) -> GPTConfig:
    """A GPTConfig from a dict of fields, or a one-line error naming ``where``."""
    if not isinstance(fields, dict):
        raise ConvertError(f"{where}: no model config object")
    try:
        return GPTConfig.from_dict(fields)
    except (TypeError, ValueError, KeyError) as err:
        raise ConvertError(f"{where}: the model config does not fit the stored tensors: "
                           f"{err}") from None


class DCPFileWriter:
    """Writes a DCP folder one chunk at a time: each chunk is ``torch.save``d into
    ``__0_0.distcp`` as ``dcp.save`` does, and :meth:`close` pickles torch's own
    :class:`Metadata` into ``.metadata``. ``dcp.load`` (and Megatron-core's loader, which
    uses it) reads the result; memory stays at the chunk being written. The data file goes
    past the page cache (:class:`mt_checkpoint.DirectFile`), as every safetensors file
    mt-formats writes."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._file = DirectFile(self.directory / DATA_FILE)
        self._tensors: dict[str, TensorStorageMetadata] = {}
        self._objects: dict[str, BytesStorageMetadata] = {}
        self._storage: dict[MetadataIndex, _StorageInfo] = {}

    def _append(self, index: MetadataIndex, payload: Any) -> None:
        start = self._file.tell()
        save_into(payload, self._file)
        self._storage[index] = _StorageInfo(DATA_FILE, start, self._file.tell() - start)

    def add_chunk(self, key: str, chunk: torch.Tensor, size: tuple[int, ...] | None = None,
                  offsets: tuple[int, ...] | None = None) -> None:
        """Store ``chunk`` as the part of tensor ``key`` (whole shape ``size``, default the
        chunk's own) that starts at ``offsets`` (default: the origin)."""
        size = tuple(chunk.shape) if size is None else tuple(size)
        offsets = (0,) * len(size) if offsets is None else tuple(offsets)
        meta = self._tensors.get(key)
        if meta is None:
            meta = self._tensors[key] = TensorStorageMetadata(
                TensorProperties(dtype=chunk.dtype), torch.Size(size), [])
        chunk = chunk.detach().contiguous()
        if chunk.untyped_storage().nbytes() != chunk.numel() * chunk.element_size():
            chunk = chunk.clone()  # torch.save writes a view's whole storage
        index = MetadataIndex(key, torch.Size(offsets), len(meta.chunks))
        meta.chunks.append(ChunkStorageMetadata(torch.Size(offsets), chunk.shape))
        self._append(index, chunk)

    def add_object(self, key: str, value: Any) -> bytes:
        """Store a plain value (``torch.save`` bytes, as DCP stores non-tensors); returns
        the bytes stored."""
        self._objects[key] = BytesStorageMetadata()
        buffer = io.BytesIO()
        torch.save(value, buffer)
        start = self._file.tell()
        self._file.write(buffer.getbuffer())
        self._storage[MetadataIndex(key)] = _StorageInfo(DATA_FILE, start,
                                                          self._file.tell() - start)
        return buffer.getvalue()

    def close(self) -> None:
        """Sync the data file and write ``.metadata`` (torch's pickle of :class:`Metadata`)."""
        self._file.close()
        entries: dict[str, Any] = {**self._tensors, **self._objects}
        metadata = Metadata(state_dict_metadata=entries,
                            planner_data={key: (key,) for key in entries},
                            storage_data=self._storage,
                            storage_meta=StorageMeta(save_id=str(uuid.uuid4())),
                            version="1.0.0")
        with open(self.directory / METADATA_FILE, "wb") as file:
            pickle.dump(metadata, file)
            file.flush()
            os.fsync(file.fileno())

    def abort(self) -> None:
        self._file.abort()


class DCPWriter(CheckpointWriter):
    """Writes a DCP folder with the names of :func:`~mt_formats.dcp_names.writer_naming`,
    one tensor at a time (:class:`DCPFileWriter`)."""

    format = DCP_FORMAT

    def __init__(self, config: GPTConfig, specs: dict[str, TensorSpec]) -> None:
        super().__init__(config, specs)
        self.naming: Naming = writer_naming(config)
        self._parts = {name: self.naming.parts(name, config) for name in self.specs}
        self._tied = self.naming.tied_copy(config)
        self._files: DCPFileWriter | None = None
        self._checksums: dict[str, str] = {}
        self._unset: list[str] = []  # parameters whose state came without settings
        self._carried = False  # whether any parameter's Adam state was written

    def _spec(self, name: str, part: Part) -> TensorSpec:
        return TensorSpec(part.shape(self.specs[name].shape), self.specs[name].dtype)

    def targets(self, name: str) -> list[TensorRef]:
        refs = [TensorRef(DATA_FILE, part.key, self._spec(name, part), part.transform)
                for part in self._parts[name]]
        if name == "embed.tokens.weight" and self._tied is not None:
            refs.append(TensorRef(DATA_FILE, self._tied, self.specs[name], "tied copy"))
        return refs

    def open(self, directory: Path) -> None:
        self._files = DCPFileWriter(Path(directory))

    def _store(self, key: str, tensor: torch.Tensor) -> None:
        assert self._files is not None, "open() first"
        self._files.add_chunk(key, tensor)
        self._checksums[key] = tensor_checksum(tensor, CHECKSUM_ALGORITHM)

    holds_optimizer_state = True  # torch's flattened optimizer state dict, as torchtitan's

    def _store_parts(self, name: str, tensor: torch.Tensor, key: Callable[[str], str]) -> None:
        start = 0
        for part in self._parts[name]:
            rows = tensor.shape[0] if part.rows < 0 else part.rows
            self._store(key(part.key), part.store(tensor[start:start + rows]))
            start += rows

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self._store_parts(name, tensor, lambda key: key)
        if name == "embed.tokens.weight" and self._tied is not None:
            self._store(self._tied, tensor)
        state = self.source_state(name)
        if state is not None:  # under each stored parameter's key, as the reader finds it
            for moment in ("exp_avg", "exp_avg_sq"):
                self._store_parts(name, state[moment],  # in its own dtype (fp32 masters')
                                  lambda key, m=moment: optimizer_key(key, m))
            self._carried = True
            step = torch.as_tensor(state["step"], dtype=torch.float32).reshape(())
            settings = self.state_source.optimizer_settings(name)
            if settings is None:
                self._unset.append(name)
            group = adamw_group(settings)  # every key a torch AdamW's state dict has
            for part in self._parts[name]:
                self._store(optimizer_key(part.key, "step"), step.clone())
                for setting, value in group.items():
                    key = optimizer_key(part.key, setting, "param_groups")
                    self._checksums[key] = bytes_checksum(self._files.add_object(key, value))

    def finish(self) -> None:
        assert self._files is not None, "open() first"
        missing = [name for name in self.specs if self._parts[name][0].key not in
                   self._checksums]
        if missing:
            raise ConvertError(f"{self._files.directory}: tensors never written: {missing}")
        self.check_states()
        if self._unset:
            self.notes.append(f"the source records no Adam hyperparameters of "
                              f"{len(self._unset)} parameters ({self._unset[0]}, ...): their "
                              "param groups hold torch AdamW's defaults")
        if self._carried:
            self._write_progress()
        self._files.close()
        write_sidecar(self._files.directory, {"names": self.naming.family,
                                              "model": self.config.to_dict(),
                                              "checksums": self._checksums},
                      files=(METADATA_FILE,))

    def _write_progress(self) -> None:
        """torchtitan's ``train_state`` (``step``, ``ntokens_seen``) and ``lr_scheduler``
        (``last_epoch``, the step: its LambdaLR steps once per optimizer step), from the
        source's :meth:`~mt_formats.canonical.CheckpointReader.progress`, so that a
        torchtitan run resumes the schedule where the source stopped."""
        assert self._files is not None and self.state_source is not None
        progress = self.state_source.progress()
        if progress is None:
            self.notes.append(f"the source records no training step: no {TRAIN_STEP} or "
                              f"{SCHEDULER_STEP} written (torchtitan: exclude train_state "
                              "and lr_scheduler from loading)")
            return
        if progress.tokens is None:
            self.notes.append(f"the source records no tokens seen: {TRAIN_TOKENS} is 0")
        for key, value in ((TRAIN_STEP, progress.step), (TRAIN_TOKENS, progress.tokens or 0),
                           (SCHEDULER_STEP, progress.step)):
            self._checksums[key] = bytes_checksum(self._files.add_object(key, value))

    def abort(self) -> None:
        if self._files is not None:
            self._files.abort()
