"""A Megatron-LM style layout: ``iter_XXXXXXX/mp_rank_XX[_YYY]/model_optim_rng.pt``.

``latest_checkpointed_iteration.txt`` names the iteration; ``mp_rank_XX`` is the file of
TP rank ``XX`` when there is one pipeline stage, ``mp_rank_XX_YYY`` of TP rank ``XX`` on
stage ``YYY`` otherwise. Each file is ``torch.save`` of plain containers and tensors::

    {"model": {"language_model": {
         "embedding": {"word_embeddings": {"weight"}, "position_embeddings": {"weight"}},
         "encoder": {"layers.N.input_layernorm.weight", ...,
                     "layers.N.self_attention.query_key_value.weight",
                     "layers.N.self_attention.dense.weight",
                     "layers.N.post_attention_layernorm.weight",
                     "layers.N.mlp.dense_h_to_4h.weight", "layers.N.mlp.dense_4h_to_h.weight",
                     "final_layernorm.weight", ...}},
               "word_embeddings_for_head": {"weight"}},     # last stage, pp > 1
     "checkpoint_version": 3.0, "iteration": N,
     "mt": {"model": GPTConfig dict, "layout": {...}, "sha256": {flat key: hex}}}

As in Megatron, layer numbers are local to the stage, ``query_key_value`` rows are ordered
per head ``[heads, 3 (q, k, v), head_dim]`` (mt stores ``[3, heads, head_dim]``), and the
word embeddings are padded to a multiple of ``pad_multiple * tp`` rows. mt's files carry
the model config in the ``"mt"`` entry; genuine Megatron-LM files carry ``args`` (an
``argparse.Namespace``) and RNG states, read with weights-only loading plus an explicit
allow-list (:mod:`mt_formats.megatron_args`), and the config and layout come from ``args``.
Any other pickled object is refused.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from mt_formats.canonical import (
    CheckpointReader,
    CheckpointWriter,
    TensorRef,
    canonical_shapes,
    read_pointer,
)
from mt_formats.errors import ConvertError
from mt_formats.megatron_args import (
    check_rank_folders,
    check_same_run,
    config_from_args,
    layout_from_args,
    load_megatron_file,
)
from mt_formats.sharded import stage_layers, stages_of
from mt_formats.tensors import TensorSpec, tensor_sha256
from mt_formats.torch_io import save_into
from mt_model import GPTConfig
from mt_tensor_parallel import (
    DEFAULT_PAD_MULTIPLE,
    check_divisibility,
    merge_shards,
    shard_tensor,
)

__all__ = ["LATEST_FILE", "MegatronReader", "MegatronWriter", "iteration_folder",
           "megatron_name", "rank_file"]

LATEST_FILE = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
_LAYER = {  # mt block tensor -> (Megatron encoder tensor, TP style in Megatron's order)
    "ln1": ("input_layernorm", "replicate"),
    "attn.qkv": ("self_attention.query_key_value", "column"),
    "attn.proj.weight": ("self_attention.dense.weight", "row"),
    "attn.proj.bias": ("self_attention.dense.bias", "replicate"),
    "ln2": ("post_attention_layernorm", "replicate"),
    "mlp.fc": ("mlp.dense_h_to_4h", "column"),
    "mlp.proj.weight": ("mlp.dense_4h_to_h.weight", "row"),
    "mlp.proj.bias": ("mlp.dense_4h_to_h.bias", "replicate"),
}
_TOP = {  # mt tensor -> (flat Megatron key, style)
    "embed.tokens.weight": ("language_model.embedding.word_embeddings.weight", "vocab"),
    "embed.positions.weight": ("language_model.embedding.position_embeddings.weight",
                               "replicate"),
    "ln_f.weight": ("language_model.encoder.final_layernorm.weight", "replicate"),
    "ln_f.bias": ("language_model.encoder.final_layernorm.bias", "replicate"),
}
HEAD_KEY = "word_embeddings_for_head.weight"


def rank_file(folder: str, tp_rank: int, pp_rank: int, pp: int) -> str:
    """Relative path of one rank's file in iteration folder ``folder`` (``iter_0000300``)."""
    rank = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
    return f"{folder}/{rank}/{MODEL_FILE}"


def megatron_name(name: str, ranges: list[tuple[int, int]]) -> tuple[str, str]:
    """(flat Megatron key, Megatron TP style) of canonical tensor ``name`` on its first
    stage; layer numbers become stage-local."""
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".")
    if parts[0] != "blocks":
        raise ConvertError(f"tensor {name!r} has no Megatron-LM equivalent")
    layer = int(parts[1])
    local = layer - ranges[stages_of(name, ranges)[0]][0]
    rest = ".".join(parts[2:])
    for prefix, (target, style) in _LAYER.items():
        if rest == prefix or rest.startswith(prefix + "."):
            return (f"language_model.encoder.layers.{local}.{target}{rest[len(prefix):]}",
                    style)
    raise ConvertError(f"tensor {name!r} has no Megatron-LM equivalent")


def _to_megatron_qkv(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """[3, heads, head_dim, ...] rows (mt) -> [heads, 3, head_dim, ...] rows (Megatron)."""
    rest = tensor.shape[1:]
    view = tensor.reshape(3, heads, tensor.shape[0] // (3 * heads), *rest)
    return view.transpose(0, 1).reshape(tensor.shape).contiguous()


def _from_megatron_qkv(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    rest = tensor.shape[1:]
    view = tensor.reshape(heads, 3, tensor.shape[0] // (3 * heads), *rest)
    return view.transpose(0, 1).reshape(tensor.shape).contiguous()


def _nest(flat: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Megatron's nesting: ``language_model`` -> ``embedding`` (module dicts) /
    ``encoder`` (flat keys); ``word_embeddings_for_head`` -> ``weight``."""
    model: dict[str, Any] = {}
    for key, tensor in flat.items():
        if key.startswith("language_model.embedding."):
            module, param = key.removeprefix("language_model.embedding.").split(".")
            lm = model.setdefault("language_model", {})
            lm.setdefault("embedding", {}).setdefault(module, {})[param] = tensor
        elif key.startswith("language_model.encoder."):
            encoder = model.setdefault("language_model", {}).setdefault("encoder", {})
            encoder[key.removeprefix("language_model.encoder.")] = tensor
        else:
            model.setdefault("word_embeddings_for_head", {})["weight"] = tensor
    return model


def _flatten(tree: dict[str, Any], prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys of a nested dict (the inverse of :func:`_nest`)."""
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            _flatten(value, name, out)
        else:
            out[name] = value
    return out


class _Plan:
    """Which flat Megatron key of which file every canonical tensor becomes."""

    def __init__(self, config: GPTConfig, specs: dict[str, TensorSpec], tp: int, pp: int,
                 pad_multiple: int, ranges: list[tuple[int, int]] | None,
                 iteration: int) -> None:
        try:
            check_divisibility(tp=tp, n_heads=config.n_heads, hidden=config.hidden,
                               ffn_hidden=config.ffn_hidden)
        except ValueError as err:
            raise ConvertError(str(err)) from None
        self.config, self.tp, self.pp, self.pad_multiple = config, tp, pp, pad_multiple
        self.iteration = iteration
        self.folder = f"iter_{iteration:07d}" if iteration >= 0 else "release"
        self.ranges = stage_layers(config.n_layers, pp) if ranges is None else ranges
        # name -> (style, [(stage, flat key)]); rank shapes via meta slicing
        self.places: dict[str, tuple[str, list[tuple[int, str]]]] = {}
        self.shapes: dict[tuple[str, int], tuple[int, ...]] = {}
        self.keys: dict[tuple[int, int], dict[str, TensorSpec]] = {
            (s, r): {} for s in range(pp) for r in range(tp)}
        for name, spec in specs.items():
            key, style = megatron_name(name, self.ranges)
            stages = stages_of(name, self.ranges)
            places = [(s, HEAD_KEY if s != stages[0] else key) for s in stages]
            self.places[name] = (style, places)
            full = torch.empty(spec.shape, device="meta")
            for rank in range(tp):
                shape = tuple(shard_tensor(style, full, rank, tp,
                                           pad_multiple=pad_multiple).shape)
                self.shapes[(name, rank)] = shape
                for stage, flat in places:
                    self.keys[(stage, rank)][flat] = TensorSpec(shape, spec.dtype)

    def file(self, stage: int, rank: int) -> str:
        return rank_file(self.folder, rank, stage, self.pp)

    def refs(self, name: str) -> list[TensorRef]:
        style, places = self.places[name]
        order = " (per-head q,k,v order)" if name.endswith(("qkv.weight", "qkv.bias")) else ""
        return [TensorRef(self.file(stage, rank), flat, self.keys[(stage, rank)][flat],
                          f"tp {rank}/{self.tp} {style}{order}")
                for stage, flat in places for rank in range(self.tp)]

    def layout(self) -> dict[str, Any]:
        return {"tp": self.tp, "pp": self.pp, "pad_multiple": self.pad_multiple,
                "stage_layers": [list(r) for r in self.ranges]}


def _is_qkv(name: str) -> bool:
    return name.endswith(("attn.qkv.weight", "attn.qkv.bias"))


class MegatronWriter(CheckpointWriter):
    """Writes the Megatron-LM style layout. ``torch.save`` needs a whole file at once, so
    each file is buffered until its last tensor arrives (one pipeline stage at a time in
    module order) and then saved."""

    format = "megatron"

    def __init__(self, config: GPTConfig, specs: dict[str, TensorSpec], tp: int = 1,
                 pp: int = 1, pad_multiple: int = DEFAULT_PAD_MULTIPLE,
                 iteration: int = 0) -> None:
        super().__init__(config, specs)
        self._plan = _Plan(config, self.specs, tp, pp, pad_multiple, None, iteration)
        self._buffers: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._saved: set[tuple[int, int]] = set()
        self._directory: Path | None = None

    def targets(self, name: str) -> list[TensorRef]:
        return self._plan.refs(name)

    def open(self, directory: Path) -> None:
        self._directory = Path(directory)
        self._buffers = {key: {} for key in self._plan.keys}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        plan = self._plan
        style, places = plan.places[name]
        if _is_qkv(name):
            tensor = _to_megatron_qkv(tensor, self.config.n_heads)
        for rank in range(plan.tp):
            shard = shard_tensor(style, tensor, rank, plan.tp, pad_multiple=plan.pad_multiple)
            for stage, flat in places:
                self._buffers[(stage, rank)][flat] = shard
                if len(self._buffers[(stage, rank)]) == len(plan.keys[(stage, rank)]):
                    self._save(stage, rank)

    def _save(self, stage: int, rank: int) -> None:
        assert self._directory is not None, "open() first"
        flat = self._buffers.pop((stage, rank))
        mt = {"model": self.config.to_dict(), "layout": self._plan.layout(),
              "tp_rank": rank, "pp_rank": stage,
              "sha256": {key: tensor_sha256(t) for key, t in flat.items()}}
        payload = {"model": _nest(flat), "checkpoint_version": 3.0,
                   "iteration": self._plan.iteration, "mt": mt}
        path = self._directory / self._plan.file(stage, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as handle:
            save_into(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        self._saved.add((stage, rank))

    def finish(self) -> None:
        assert self._directory is not None, "open() first"
        missing = sorted(set(self._plan.keys) - self._saved)
        if missing:
            left = {self._plan.file(*key): sorted(self._buffers[key].keys() ^
                                                  self._plan.keys[key].keys())
                    for key in missing}
            raise ConvertError(f"{self._directory}: tensors never written: {left}")
        (self._directory / LATEST_FILE).write_text(f"{self._plan.iteration}\n",
                                                   encoding="utf-8")


def _load(path: Path) -> dict[str, Any]:
    """A weights-only ``torch.load`` (memory-mapped) with the allow-list of Megatron-LM's
    pickled objects (:mod:`mt_formats.megatron_args`), errors naming the file."""
    data = load_megatron_file(path)
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ConvertError(f"{path}: not a Megatron-LM checkpoint (no 'model' dict)")
    return data


def _iteration(root: Path) -> int:
    """The iteration ``latest_checkpointed_iteration.txt`` names (-1 for ``release``)."""
    latest = root / LATEST_FILE
    if not latest.is_file():
        raise ConvertError(f"{latest}: file not found (not a Megatron-LM checkpoint)")
    text = read_pointer(latest)
    if text == "release":
        return -1
    if not text.isdigit():
        raise ConvertError(f"{latest}: expected an iteration number or 'release', got "
                           f"{text!r}")
    return int(text)


def iteration_folder(root: Path) -> Path:
    """The folder of the iteration ``latest_checkpointed_iteration.txt`` names."""
    iteration = _iteration(root)
    return root / (f"iter_{iteration:07d}" if iteration >= 0 else "release")


class MegatronReader(CheckpointReader):
    """Reads the Megatron-LM style layout written by :class:`MegatronWriter` (weights-only,
    memory-mapped), checking names, shapes, checksums and that copies agree."""

    format = "megatron"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        iteration = _iteration(self.root)
        folder = self.root / (f"iter_{iteration:07d}" if iteration >= 0 else "release")
        first = sorted(folder.glob(f"mp_rank_*/{MODEL_FILE}"))
        if not first:
            raise ConvertError(f"{folder}: no mp_rank_*/{MODEL_FILE} files")
        head = _load(first[0])
        info = head.get("mt")
        try:
            if info is None and "args" in head:  # genuine Megatron-LM: its own args
                self.config = config_from_args(head["args"], first[0])
                layout = layout_from_args(head["args"], self.config, first[0])
                version = float(head.get("checkpoint_version", 0))
                if version < 2.0:
                    raise ConvertError(f"{first[0]}: checkpoint_version {version}: mt reads "
                                       "2.0 and later (query_key_value rows per head)")
            else:
                self.config = GPTConfig.from_dict(info["model"])
                layout = info["layout"]
            tp, pp = int(layout["tp"]), int(layout["pp"])
            pad = int(layout["pad_multiple"])
            ranges = [(int(a), int(b)) for a, b in layout["stage_layers"]]
        except (TypeError, KeyError, ValueError) as err:
            raise ConvertError(f"{first[0]}: neither a usable 'mt' entry nor Megatron-LM "
                               f"'args' (model config and layout): {err!r}") from None
        self._shapes = canonical_shapes(self.config)
        specs = {name: TensorSpec(shape, torch.float32) for name, shape in self._shapes.items()}
        self._plan = _Plan(self.config, specs, tp, pp, pad, ranges, iteration)
        found = {str(p.relative_to(self.root)) for p in folder.glob(f"mp_rank_*/{MODEL_FILE}")}
        wanted = {self._plan.file(s, r) for s, r in self._plan.keys}
        if found != wanted:
            raise ConvertError(f"{folder}: files {sorted(found)} do not match tp={tp} pp={pp} "
                               f"(expected {sorted(wanted)})")
        self._flat: dict[tuple[int, int], dict[str, Any]] = {}
        self._sha: dict[tuple[int, int], dict[str, str]] = {}
        saved: dict[tuple[int, int], tuple[Path, Any]] = {}  # Megatron-LM's args, per file
        for key, expected in self._plan.keys.items():
            path, data = self._open(key, expected)
            if info is None:  # genuine Megatron-LM files: one run's, of this iteration
                check_same_run(path, data, first[0], head, iteration if iteration >= 0 else None)
            saved[key] = path, data.get("args")
        check_rank_folders(saved, tp, pp)

    def _open(self, key: tuple[int, int], expected: dict[str, TensorSpec]
              ) -> tuple[Path, dict[str, Any]]:
        """Load rank file ``key`` (stage, TP rank) and check its tensors; its path and
        contents."""
        path = self.root / self._plan.file(*key)
        data = _load(path)
        flat = _flatten(data["model"], "", {})
        missing, extra = sorted(expected.keys() - flat.keys()), sorted(flat.keys() - expected)
        if missing or extra:
            raise ConvertError(f"{path}: missing tensors {missing}, unexpected {extra}")
        for name, spec in expected.items():
            tensor = flat[name]
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != spec.shape:
                got = list(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor)
                raise ConvertError(f"{path}: tensor {name!r} is {got}, the model config "
                                   f"needs {list(spec.shape)}")
        self._flat[key] = flat
        self._sha[key] = dict((data.get("mt") or {}).get("sha256") or {})
        return path, data

    def names(self) -> list[str]:
        return list(self._shapes)

    def spec(self, name: str) -> TensorSpec:
        stage, flat = self._plan.places[name][1][0]
        return TensorSpec(self._shapes[name], self._flat[(stage, 0)][flat].dtype)

    def sources(self, name: str) -> list[TensorRef]:
        return self._plan.refs(name)

    def _shard(self, stage: int, rank: int, flat: str) -> torch.Tensor:
        tensor = self._flat[(stage, rank)][flat]
        expected = self._sha[(stage, rank)].get(flat)
        if expected is not None and tensor_sha256(tensor) != expected:
            raise ConvertError(f"{self.root / self._plan.file(stage, rank)}: tensor {flat!r} "
                               "fails its sha256 checksum (corrupted)")
        return tensor

    def read(self, name: str) -> torch.Tensor:
        style, places = self._plan.places[name]
        copies = [[self._shard(stage, rank, flat) for rank in range(self._plan.tp)]
                  for stage, flat in places]
        shards = copies[0]
        for (stage, flat), copy in zip(places, copies, strict=True):
            for rank, shard in enumerate(copy):
                if not torch.equal(shard, shards[0 if style == "replicate" else rank]):
                    raise ConvertError(f"{self.root / self._plan.file(stage, rank)}: copy "
                                       f"{flat!r} of {name!r} differs from "
                                       f"{self._plan.file(places[0][0], 0)}'s")
        vocab = self.config.vocab_size if style == "vocab" else None
        full = merge_shards(style, shards, vocab_size=vocab)
        return _from_megatron_qkv(full, self.config.n_heads) if _is_qkv(name) else full

    def close(self) -> None:
        self._flat.clear()
