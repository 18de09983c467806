"""Hugging Face GPT-2 checkpoints (``GPT2LMHeadModel``): reader and writer.

Written: ``config.json`` + one ``model.safetensors`` with keys ``transformer.*`` (the tied
``lm_head`` is not stored, as ``save_pretrained`` does), loadable by
``GPT2LMHeadModel.from_pretrained`` without missing or unexpected keys.

Read: ``model.safetensors``, a sharded ``model.safetensors.index.json``, or a legacy
``pytorch_model.bin`` (loaded with ``torch.load(weights_only=True)``: plain tensors only,
nothing else is unpickled). Keys may carry the ``transformer.`` prefix or not.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from mt_formats.canonical import CheckpointReader, CheckpointWriter, TensorRef, canonical_shapes
from mt_formats.errors import ConvertError
from mt_formats.hf_config import HF_IGNORED, gpt_config_from_hf, hf_config_from_gpt, hf_name
from mt_formats.hf_llama import LlamaReader
from mt_formats.hf_tokenizer import write_hf_config
from mt_formats.manifest import read_json
from mt_formats.safetensors_io import SafetensorsReader, SafetensorsWriter
from mt_formats.tensors import TensorSpec, check_names
from mt_model import GPTConfig

__all__ = ["HFReader", "HFWriter", "open_hf"]

PREFIX = "transformer."
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
HEAD = "lm_head.weight"


class _TorchFile:
    """A ``pytorch_model.bin`` with the reader interface of :class:`SafetensorsReader`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            state = self._load(path)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as err:
            raise ConvertError(f"{path}: cannot load as plain tensors (malformed, truncated "
                               f"or not weights-only): {_first_line(err)}") from None
        if not isinstance(state, dict) or not all(
                isinstance(v, torch.Tensor) for v in state.values()):
            raise ConvertError(f"{path}: expected a flat dict of tensors")
        self._state: dict[str, torch.Tensor] = state

    @staticmethod
    def _load(path: Path) -> object:
        try:  # memory-mapped: tensors are paged in one at a time as they are converted
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
        # files from torch < 1.6 (not zip-based) cannot be memory-mapped
        return torch.load(path, map_location="cpu", weights_only=True)

    def keys(self) -> list[str]:
        return list(self._state)

    def spec(self, key: str) -> TensorSpec:
        return TensorSpec.of(self._state[key])

    def get(self, key: str) -> torch.Tensor:
        return self._state[key].clone()

    def close(self) -> None:
        self._state = {}


def _open_weight_files(root: Path) -> dict[str, SafetensorsReader | _TorchFile]:
    """Relative file name -> open reader, for whichever weight layout ``root`` holds."""
    if (root / SAFETENSORS).is_file():
        return {SAFETENSORS: SafetensorsReader(root / SAFETENSORS)}
    if (root / SAFETENSORS_INDEX).is_file():
        index = read_json(root / SAFETENSORS_INDEX)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConvertError(f"{root / SAFETENSORS_INDEX}: no 'weight_map' object")
        files: dict[str, SafetensorsReader | _TorchFile] = {}
        for name in sorted(set(map(str, weight_map.values()))):
            if Path(name).name != name:  # never follow "../" out of the checkpoint
                raise ConvertError(f"{root / SAFETENSORS_INDEX}: weight file {name!r} is not "
                                   "a plain file name")
            files[name] = SafetensorsReader(root / name)
        return files
    if (root / TORCH_BIN).is_file():
        return {TORCH_BIN: _TorchFile(root / TORCH_BIN)}
    raise ConvertError(f"{root}: no {SAFETENSORS}, {SAFETENSORS_INDEX} or {TORCH_BIN}")


class HFReader(CheckpointReader):
    """Reads a Hugging Face GPT-2 directory as canonical mt tensors."""

    format = "hf"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.config = gpt_config_from_hf(read_json(self.root / "config.json"),
                                         self.root / "config.json")
        self._shapes = canonical_shapes(self.config)
        self._files = _open_weight_files(self.root)
        try:
            self._index_keys()
            self._check_shapes()
        except BaseException:
            self.close()
            raise

    def _index_keys(self) -> None:
        # normalised HF key (no "transformer." prefix) -> (file name, key in the file)
        self._where: dict[str, tuple[str, str]] = {}
        for file, reader in self._files.items():
            for key in reader.keys():
                short = key.removeprefix(PREFIX)
                if HF_IGNORED.match(short):
                    continue
                if short in self._where:
                    raise ConvertError(f"{self.root / file}: tensor {key!r} also stored in "
                                       f"{self._where[short][0]}")
                self._where[short] = (file, key)
        expected = [hf_name(name)[0] for name in self._shapes]
        found = [key for key in self._where if key != HEAD]
        where = self.root / next(iter(self._files)) if len(self._files) == 1 else self.root
        check_names(where, found, expected)

    def _check_shapes(self) -> None:
        for name, shape in self._shapes.items():
            short, transposed = hf_name(name)
            stored = self._ref(short).spec.shape
            wanted = tuple(reversed(shape)) if transposed else shape
            if stored != wanted:
                file, key = self._where[short]
                raise ConvertError(f"{self.root / file}: tensor {key!r} has shape "
                                   f"{list(stored)}, config.json needs {list(wanted)}")
        if HEAD in self._where:
            head = self._ref(HEAD).spec.shape
            if head != self._shapes["embed.tokens.weight"]:
                raise ConvertError(f"{self.root}: {HEAD} has shape {list(head)}, not that of "
                                   "wte: an untied output head is not supported")

    def _ref(self, short: str, transform: str = "") -> TensorRef:
        file, key = self._where[short]
        return TensorRef(file, key, self._files[file].spec(key), transform)

    def names(self) -> list[str]:
        return list(self._shapes)

    def spec(self, name: str) -> TensorSpec:
        return TensorSpec(self._shapes[name], self._ref(hf_name(name)[0]).spec.dtype)

    def sources(self, name: str) -> list[TensorRef]:
        short, transposed = hf_name(name)
        refs = [self._ref(short, "transpose" if transposed else "")]
        if name == "embed.tokens.weight" and HEAD in self._where:
            refs.append(self._ref(HEAD, "tied: must equal wte"))
        return refs

    def read(self, name: str) -> torch.Tensor:
        short, transposed = hf_name(name)
        file, key = self._where[short]
        tensor = self._files[file].get(key)
        if name == "embed.tokens.weight" and HEAD in self._where:
            head_file, head_key = self._where[HEAD]
            if not torch.equal(self._files[head_file].get(head_key), tensor):
                raise ConvertError(f"{self.root / head_file}: {head_key!r} differs from "
                                   f"{key!r}: an untied output head is not supported")
        return tensor.t().contiguous() if transposed else tensor

    def close(self) -> None:
        for reader in getattr(self, "_files", {}).values():
            reader.close()


class HFWriter(CheckpointWriter):
    """Writes ``config.json`` and ``model.safetensors`` for ``GPT2LMHeadModel``, and the
    tokenizer when one is known (:func:`write_hf_tokenizer`)."""

    format = "hf"

    def __init__(self, config: GPTConfig, specs: dict[str, TensorSpec]) -> None:
        super().__init__(config, specs)
        self._stored: dict[str, tuple[str, bool, TensorSpec]] = {}
        for name, spec in self.specs.items():
            short, transposed = hf_name(name)
            shape = tuple(reversed(spec.shape)) if transposed else spec.shape
            self._stored[name] = (PREFIX + short, transposed, TensorSpec(shape, spec.dtype))
        self._writer: SafetensorsWriter | None = None
        self._directory: Path | None = None

    def targets(self, name: str) -> list[TensorRef]:
        key, transposed, spec = self._stored[name]
        return [TensorRef(SAFETENSORS, key, spec, "transpose" if transposed else "")]

    def open(self, directory: Path) -> None:
        self._directory = Path(directory)
        entries = {key: spec for key, _, spec in self._stored.values()}
        self._writer = SafetensorsWriter(self._directory / SAFETENSORS, entries)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        assert self._writer is not None, "open() first"
        key, transposed, _ = self._stored[name]
        self._writer.write(key, tensor.t().contiguous() if transposed else tensor)

    def finish(self) -> None:
        assert self._writer is not None and self._directory is not None, "open() first"
        self._writer.close()
        dtype = self.specs["embed.tokens.weight"].dtype
        body = hf_config_from_gpt(self.config, dtype)
        write_hf_config(self._directory, body, self.tokenizer, self.config)

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()


def open_hf(root: Path) -> CheckpointReader:
    """A Hugging Face folder's reader: ``LlamaForCausalLM`` (``model_type: llama``) or GPT-2."""
    data = read_json(Path(root) / "config.json")
    reader: CheckpointReader = (LlamaReader(Path(root), data, _open_weight_files(Path(root)))
                                if data.get("model_type") == "llama" else HFReader(Path(root)))
    if (Path(root) / "tokenizer.json").is_file():  # carried to the targets that store one
        reader.tokenizer = str(root)
    return reader


def _first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (torch's weights-only refusal spans many: the
    command line says one)."""
    return next(iter(str(err).splitlines()), type(err).__name__)
