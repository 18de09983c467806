"""Megatron-LM's per-rank files (``--ckpt-format torch``) of a Megatron-core model:
``iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt``, laid out as :mod:`mt_formats.megatron`
says, whose ``model`` is megatron-core ``GPTModel``'s plain state dict. Megatron-LM wrote
these for its megatron-core models until ``torch_dist`` became its default format.

Each file holds its TP rank's shards of its pipeline stage's tensors under flat keys:
``embedding.word_embeddings.weight`` and ``embedding.position_embeddings.weight`` (first
stage), ``decoder.layers.<layer>.*`` with the layers numbered from 0 on every stage,
``decoder.final_layernorm.*`` and ``output_layer.weight`` (last stage; with tied embeddings
over several stages, a copy of the word embeddings), and ``_extra_state`` entries; with
interleaved (virtual) pipeline stages, one such state dict per model chunk (``model0``,
``model1``, ...: chunk ``c`` of pipeline rank ``p`` is virtual stage ``c * PP + p``). The
local layer spec's norms are modules of their own (``input_layernorm``,
``pre_mlp_layernorm``), Transformer Engine's are fused (``linear_qkv.layer_norm_*``,
``linear_fc1.layer_norm_*``): both are read as the Megatron-core names of
:mod:`mt_formats.mcore`.

mt numbers the layers globally (each stage's count from its files), joins each tensor's TP
shards (rows, columns, a gated MLP's gate and up halves: :func:`mt_formats.mcore_buckets.join`)
and reads the result as a Megatron-core checkpoint's tensors (``linear_qkv`` regrouped, the
vocabulary's padding dropped). Every copy is compared: a replicated tensor across TP ranks,
the last stage's copy of tied embeddings with the first stage's. The config comes from
Megatron-LM's ``args`` (allow-listed unpickling); the ranks found must be the TP x PP grid
they record.

Adam's state: the distributed optimizer's ``distrib_optim.pt`` beside each rank file
(``save_parameter_state``: per model chunk, ``{dtype pair: {"param", "exp_avg", "exp_avg_sq":
flat fp32, "numel_unpadded"}}``, its buckets' unpadded contents one after another, gathered
over data parallelism) with the step and param groups of the rank files' ``optimizer``
entries. The file records neither the buckets' sizes nor where a parameter lies: mt lays the
stage's parameters out from the state dict's order (the model's registration order) as
megatron-core does (:func:`~mt_formats.mcore_buckets.coalesced_starts`), keeping the one
layout whose every main parameter rounds to its weight. Other optimizer state (a
non-distributed optimizer's, in the ``optimizer`` entries) is not read: a note says so.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from mt_formats.adam import decays
from mt_formats.canonical import CheckpointReader, TensorRef, TrainingProgress, canonical_shapes
from mt_formats.errors import ConvertError
from mt_formats.mcore import (
    LAYERS,
    from_stored,
    mcore_parts,
    megatron_progress,
    step_and_roles,
    stored_shape,
)
from mt_formats.mcore_buckets import STATES, coalesced_starts, join
from mt_formats.megatron import MODEL_FILE, MegatronReader, iteration_folder
from mt_formats.megatron_args import (
    check_rank_folders,
    check_same_run,
    config_from_args,
    load_megatron_file,
)
from mt_formats.tensors import TensorSpec

__all__ = ["MegatronMcoreReader", "open_megatron"]

_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
#: The local layer spec's norm modules -> the names Megatron-core's checkpoints give them.
_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
          "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
_EMBEDDING, _HEAD = "embedding.word_embeddings.weight", "output_layer.weight"
OPTIMIZER_FILE = "distrib_optim.pt"

#: Where a stored tensor's TP shards are: per TP rank, (file, model entry, key in it).
Places = list[tuple[Path, str, str]]
#: A stored tensor: its Megatron-core key and global layer (-1: not stacked); the last
#: stage's copy of tied embeddings is ``(output_layer.weight, -1)``.
Where = tuple[str, int]


def is_mcore_model(model: Any) -> bool:
    """A rank file's model entry holds a Megatron-core model's flat state dict."""
    return isinstance(model, dict) and any(
        isinstance(key, str) and key.startswith(("decoder.", "embedding.")) for key in model)


def _entries(data: dict[str, Any]) -> list[str]:
    """A rank file's model entries: ``model``, or one per model chunk (``model0``, ...)."""
    found = [key for key in data if isinstance(key, str) and re.fullmatch(r"model\d*", key)]
    return sorted(found, key=lambda key: (len(key), key))


def _load(path: Path) -> dict[str, Any]:
    """A rank file (weights-only, memory-mapped, Megatron-LM's allow-list), which must hold
    a model entry."""
    data = load_megatron_file(path)
    if not isinstance(data, dict) or not _entries(data):
        raise ConvertError(f"{path}: not a Megatron-LM checkpoint (no 'model' dict)")
    return data


def _stage_layers(args: Any, layers: int, stages: int) -> list[int] | None:
    """Layers per (virtual) stage as Megatron-LM splits them for ``args``: evenly, or with
    ``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers`` taken out
    first; None for the splits it makes otherwise (a layout, embedding or loss counted)."""
    if any(getattr(args, name, None) for name in (
            "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
            "account_for_loss_in_pipeline_split", "num_layers_per_virtual_pipeline_stage")):
        return None
    first = getattr(args, "decoder_first_pipeline_num_layers", None)
    last = getattr(args, "decoder_last_pipeline_num_layers", None)
    if not all(value is None or type(value) is int for value in (first, last)):
        return None
    if stages == 1:
        return [layers]
    middle = stages - (first is not None) - (last is not None)
    rest = layers - (first or 0) - (last or 0)
    if middle < 0 or (middle == 0 and rest) or (middle and rest % middle):
        return None
    even = [rest // middle] * middle if middle else []
    return ([first] if first is not None else []) + even + ([last] if last is not None else [])


def _folder_iteration(folder: Path) -> int | None:
    """The iteration an ``iter_XXXXXXX`` folder's name gives (None: ``release``)."""
    match = re.fullmatch(r"iter_(\d+)", folder.name)
    return int(match[1]) if match else None


def open_megatron(root: Path) -> CheckpointReader:
    """The reader of Megatron-LM's per-rank files at ``root``: this module's for a
    Megatron-core model's, :class:`~mt_formats.megatron.MegatronReader` otherwise."""
    folder = iteration_folder(Path(root))
    files = sorted(folder.glob(f"mp_rank_*/{MODEL_FILE}"))
    head = _load(files[0]) if files else {}
    if files and any(is_mcore_model(head.get(entry)) for entry in _entries(head)):
        return MegatronMcoreReader(Path(root), folder, files)
    return MegatronReader(Path(root))


def _stored_key(key: str) -> tuple[str, int] | None:
    """(Megatron-core checkpoint key, stage-local layer or -1) of a state dict key; None for
    what is not a parameter (``_extra_state``)."""
    if key.endswith("_extra_state"):
        return None
    match = _LAYER.match(key)
    if match is None:
        return key, -1
    rest = match[2]
    for module, saved in _NORMS.items():
        if rest.startswith(module):
            rest = saved + rest.removeprefix(module)
    return LAYERS + rest, int(match[1])


class MegatronMcoreReader(CheckpointReader):
    """Megatron-LM's per-rank files of a Megatron-core GPT model (see the module docstring)
    as canonical mt tensors."""

    format = "megatron"

    def __init__(self, root: Path, folder: Path, files: list[Path]) -> None:
        self.root = root
        grid: dict[tuple[int, int], Path] = {}
        for path in files:
            match = _RANK.match(path.parent.name)
            if match is None:
                raise ConvertError(f"{path.parent}: not a rank folder (mp_rank_TT or "
                                   "mp_rank_TT_PPP)")
            at = (int(match[2] or 0), int(match[1]))
            if at in grid:
                raise ConvertError(f"{path.parent}: holds TP rank {at[1]} of stage {at[0]}, as "
                                   f"{grid[at].parent} does")
            grid[at] = path
        self.pp = 1 + max(stage for stage, _ in grid)
        self.tp = 1 + max(rank for _, rank in grid)
        self._files: dict[Path, dict[str, Any]] = {}  # each loaded once, memory-mapped
        self._rank_files = files
        head = self._file(files[0])
        entries = _entries(head)
        args = head.get("args")
        if args is None:
            raise ConvertError(f"{files[0]}: a Megatron-core model's state without "
                               "Megatron-LM's args, which mt reads the model config from")
        self.config = config_from_args(args, files[0], gpt2_only=False)
        try:
            recorded = (int(getattr(args, "tensor_model_parallel_size", 1) or 1),
                        int(getattr(args, "pipeline_model_parallel_size", 1) or 1))
        except (TypeError, ValueError) as err:
            raise ConvertError(f"{files[0]}: Megatron-LM's args record no usable TP and PP "
                               f"sizes: {err}") from None
        wanted = {(stage, rank) for stage in range(recorded[1]) for rank in range(recorded[0])}
        if set(grid) != wanted:
            raise ConvertError(
                f"{folder}: rank files {sorted(path.parent.name for path in files)} are not "
                f"the TP {recorded[0]} x PP {recorded[1]} grid Megatron-LM's args record")
        virtual = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
        if entries != (["model"] if virtual == 1 and "model" in head else
                       [f"model{chunk}" for chunk in range(virtual)]):
            raise ConvertError(f"{files[0]}: model entries {entries}; Megatron-LM's args "
                               f"record {virtual} model chunk(s) per pipeline rank")
        iteration = _folder_iteration(folder)
        for path in files:
            self._same_run(path, head, files[0], entries, iteration)
        check_rank_folders({at: (path, self._file(path).get("args"))
                            for at, path in grid.items()}, self.tp, self.pp)
        self._models: dict[tuple[Path, str], dict[str, Any]] = {}
        self._dtypes: dict[str, torch.dtype] = {}  # per stored key: one dtype in every layer
        self._counts: list[int] = []  # layers per (virtual) stage
        self._places: dict[tuple[str, int], Places] = {}
        self._copies: list[tuple[Places, tuple[str, int]]] = []  # the tied embeddings' copy
        # per (virtual) stage: its TP ranks' files, its parameters in registration order
        # (where, its places, whether it lies in a bucket of its own)
        self._stages: list[tuple[list[Path], list[tuple[Where, Places, bool]]]] = []
        self.notes: tuple[str, ...] = ()
        self._head = head
        offset = 0
        stages = self.pp * virtual
        for stage in range(stages):  # virtual stage c * PP + p: chunk c of rank p
            offset += self._stage(offset, [grid[stage % self.pp, rank] for rank in
                                           range(self.tp)], entries[stage // self.pp],
                                  stage == 0, stage == stages - 1)
        if offset != self.config.n_layers:
            raise ConvertError(f"{folder}: the stages hold {offset} layers; Megatron-LM's "
                               f"args record {self.config.n_layers}")
        expected = _stage_layers(args, self.config.n_layers, stages)
        if expected is not None and expected != self._counts:
            raise ConvertError(f"{folder}: the (virtual) stages hold {self._counts} layers; "
                               f"Megatron-LM's args split them {expected} (rank folders or "
                               "model chunks misplaced)")
        self._shapes = canonical_shapes(self.config)
        self._check(folder)
        self._cached: tuple[tuple[str, int], torch.Tensor] | None = None
        self._starts: dict[Where, tuple[int, int]] | None = None  # with Adam's state:
        self._buffers: list[list[dict[str, torch.Tensor]]] = []  # (stage, first element)
        self._step = 0.0
        self._roles: dict[bool, dict[str, Any]] = {}

    def _same_run(self, path: Path, head: dict[str, Any], first: Path, entries: list[str],
                  iteration: int | None) -> None:
        """Rank file ``path`` is of the run and step the first one (``head``, of ``first``)
        and its folder (``iteration``) record: its model entries, iteration and args."""
        data = self._file(path)
        found = _entries(data)
        if found != entries:
            raise ConvertError(f"{path}: model entries {found}; {first} holds {entries}")
        check_same_run(path, data, first, head, iteration)

    def _file(self, path: Path) -> dict[str, Any]:
        if path not in self._files:
            self._files[path] = _load(path)
        return self._files[path]

    def _stage(self, offset: int, paths: list[Path], entry: str, first: bool,
               last: bool) -> int:
        """Record where a (virtual) stage's tensors are (its layers from ``offset`` on; its
        TP ranks' files ``paths``, model entry ``entry`` in each; ``first`` / ``last``: the
        model's first / last stage); returns its count of layers."""
        keys: list[dict[tuple[str, int], str]] = []
        for path in paths:
            data = self._file(path)
            model = data.get(entry)
            if not is_mcore_model(model):
                raise ConvertError(f"{path}: {entry!r} is not a Megatron-core model's state "
                                   "dict, as the first rank file's is")
            if data.get("optimizer") and not (path.parent / OPTIMIZER_FILE).is_file():
                self.notes = (f"the optimizer entries of Megatron-LM's files are not read "
                              f"without its {OPTIMIZER_FILE} beside them (the distributed "
                              "optimizer's state): the conversion carries the weights only",)
            found: dict[tuple[str, int], str] = {}
            for key, value in model.items():
                stored = _stored_key(key) if isinstance(key, str) else None
                if stored is None:
                    continue
                if not isinstance(value, torch.Tensor):
                    raise ConvertError(f"{path}: model entry {key!r} is a "
                                       f"{type(value).__name__}, not a tensor")
                found[stored] = key
            keys.append(found)
            self._models[path, entry] = model
        if any(found.keys() != keys[0].keys() for found in keys):
            odd = next(rank for rank, found in enumerate(keys) if found.keys() != keys[0].keys())
            raise ConvertError(f"{paths[odd]}: holds other tensors than {paths[0]} "
                               f"({sorted(keys[odd].keys() ^ keys[0].keys())[:3]})")
        layers = sorted({layer for _, layer in keys[0] if layer >= 0})
        if layers != list(range(len(layers))):
            raise ConvertError(f"{paths[0]}: decoder layers {layers}, not 0 to "
                               f"{len(layers) - 1}")
        for (key, _), local in keys[0].items():  # each stage's own tensors
            role = (key.startswith("embedding."), key.startswith(("decoder.final_layernorm.",
                                                                   "output_layer.")))
            if (role[0] and not first) or (role[1] and not last):
                raise ConvertError(
                    f"{paths[0]}: {entry}.{local} belongs to the "
                    f"{'first' if role[0] else 'last'} pipeline stage, and this file's "
                    f"{entry} is not it (rank folders or model chunks misplaced)")
        for (key, layer), local in keys[0].items():
            shards = [self._models[path, entry][found[key, layer]]
                      for path, found in zip(paths, keys, strict=True)]
            odd = next((rank for rank, shard in enumerate(shards) if shard.dtype !=
                        shards[0].dtype or shard.shape != shards[0].shape), None)
            if odd is not None:
                raise ConvertError(
                    f"{paths[odd]}: {entry}.{local} is {shards[odd].dtype} "
                    f"{list(shards[odd].shape)}, {paths[0]}'s {shards[0].dtype} "
                    f"{list(shards[0].shape)}: TP ranks hold equal shards")
            if self._dtypes.setdefault(key, shards[0].dtype) != shards[0].dtype:
                raise ConvertError(f"{paths[0]}: {entry}.{local} is {shards[0].dtype}, the "
                                   f"other layers' {key.removeprefix(LAYERS)} "
                                   f"{self._dtypes[key]}")
        order: list[tuple[Where, Places, bool]] = []
        shared = self.config.tied_embeddings and not (first and last)
        for (key, layer), local in keys[0].items():
            places = [(path, entry, found[key, layer])
                      for path, found in zip(paths, keys, strict=True)]
            where = (key, offset + layer if layer >= 0 else -1)
            order.append((where, places, shared and key in (_EMBEDDING, _HEAD)))
            if key == _HEAD and self.config.tied_embeddings:
                self._copies.append((places, (_EMBEDDING, -1)))
                continue
            if where in self._places:
                raise ConvertError(f"{paths[0]}: {local!r} is stored on an earlier stage too")
            self._places[where] = places
        self._stages.append((paths, order))
        self._counts.append(len(layers))
        return len(layers)

    def _check(self, folder: Path) -> None:
        """Every tensor the config needs is there (and nothing else), of the shape it
        needs."""
        parts = {name: mcore_parts(name) for name in self._shapes}
        needed = {(part.key, part.layer) for part in parts.values()}
        extra = sorted(set(self._places) - needed)
        missing = sorted(needed - set(self._places))
        if extra or missing:
            raise ConvertError(f"{folder}: the rank files hold {extra[:3]} beyond the tensors "
                               f"of the model Megatron-LM's args describe, and lack "
                               f"{missing[:3]}" if extra else
                               f"{folder}: the rank files lack {missing[:3]} of the model "
                               "Megatron-LM's args describe")
        rows = self._joined_shape((_EMBEDDING, -1))[0]
        padded = getattr(self._head.get("args"), "padded_vocab_size", None)
        if type(padded) is int and padded != rows:
            raise ConvertError(f"{folder}: the embedding has {rows} rows; Megatron-LM's args "
                               f"record padded_vocab_size {padded}")
        if rows < self.config.vocab_size:
            raise ConvertError(f"{folder}: the embedding has {rows} rows, fewer than the "
                               f"vocabulary of {self.config.vocab_size}")
        for name, part in parts.items():
            shape = self._joined_shape((part.key, part.layer))
            expected = stored_shape(self.config, name, self._shapes[name], rows)
            if shape != expected:
                path, _, key = self._places[part.key, part.layer][0]
                raise ConvertError(f"{path}: {key!r} joined over TP {self.tp} is "
                                   f"{list(shape)}, the model needs {list(expected)}")
        for places, original in self._copies:
            if self._joined_shape(original, places) != self._joined_shape(original):
                raise ConvertError(f"{places[0][0]}: {places[0][2]!r} is not shaped as the "
                                   "word embeddings it is a copy of")

    def _shards(self, places: Places) -> list[torch.Tensor]:
        return [self._models[path, entry][key] for path, entry, key in places]

    def _joined_shape(self, where: tuple[str, int], places: Places | None = None
                      ) -> tuple[int, ...]:
        shards = [torch.empty(shard.shape, device="meta")
                  for shard in self._shards(places or self._places[where])]
        return tuple(join(where[0], shards, self.config.mlp == "swiglu").shape)

    def _joined(self, where: tuple[str, int]) -> torch.Tensor:
        """Stored tensor ``where`` (key, global layer) joined over TP, its copies compared."""
        cached = self._cached
        if cached is not None and cached[0] == where:  # q then kv read one qkv layer once
            return cached[1]
        places = self._places[where]
        shards = self._shards(places)
        joined = join(where[0], shards, self.config.mlp == "swiglu")
        if joined is shards[0]:  # replicated: every TP rank holds the same
            for (path, _, key), shard in zip(places[1:], shards[1:], strict=True):
                if not torch.equal(shard, shards[0]):
                    raise ConvertError(f"{path}: {key!r} differs from {places[0][0]}'s copy")
        for copy, original in self._copies:
            if original == where and not torch.equal(
                    join(where[0], self._shards(copy), self.config.mlp == "swiglu"), joined):
                raise ConvertError(f"{copy[0][0]}: {copy[0][2]!r} (the tied output layer) "
                                   f"differs from the word embeddings of {places[0][0]}")
        self._cached = (where, joined)
        return joined

    def names(self) -> list[str]:
        return list(self._shapes)

    def progress(self) -> TrainingProgress | None:
        return megatron_progress(self._head, self.root)

    def _buffer(self, path: Path, chunk: int) -> dict[str, torch.Tensor]:
        """Model chunk ``chunk``'s buffer in ``distrib_optim.pt`` file ``path``: its
        ``param``, ``exp_avg`` and ``exp_avg_sq`` (flat, ``numel_unpadded`` long)."""
        if path not in self._files:
            self._files[path] = load_megatron_file(path)
        data = self._files[path]
        if not isinstance(data, dict) or data.get("buckets_coalesced") is not True:
            raise ConvertError(f"{path}: not megatron-core's distributed optimizer state "
                               "(save_parameter_state: buckets_coalesced); give "
                               "--drop-optimizer to convert the weights alone")
        extra = sorted(map(str, set(data) - {"buckets_coalesced", *range(len(self._stages) //
                                                                          self.pp)}))
        if extra:
            raise ConvertError(f"{path}: entries {extra} beside the buffers of the "
                               f"{len(self._stages) // self.pp} model chunk(s) mt reads; give "
                               "--drop-optimizer to convert the weights alone")
        pairs = data.get(chunk)
        buffer = next(iter(pairs.values())) if isinstance(pairs, dict) and len(pairs) == 1 \
            else None
        numel = buffer.get("numel_unpadded") if isinstance(buffer, dict) else None
        if not isinstance(numel, int) or not all(
                isinstance(buffer.get(state), torch.Tensor)
                and tuple(buffer[state].shape) == (numel,) for state in STATES):
            raise ConvertError(f"{path}: buffer {chunk} is not one dtype pair's "
                               f"{', '.join(STATES)} of numel_unpadded elements each; give "
                               "--drop-optimizer to convert the weights alone")
        return buffer

    def check_optimizer_files(self) -> None:
        self._optimizer_files()

    def _optimizer_files(self) -> bool:
        """Whether every rank holds the distributed optimizer's ``distrib_optim.pt`` (False:
        none does; some but not all, or one that is no file or empty: raises)."""
        files = [path.parent / OPTIMIZER_FILE for path in self._rank_files]
        found = [path for path in files if os.path.lexists(path)]
        for path in files if found else []:
            wrong = ("absent" if not os.path.lexists(path) else
                     "a link to nothing" if not path.exists() else
                     "not a regular file" if not path.is_file() else
                     "empty" if path.stat().st_size == 0 else None)
            if wrong:
                other = (f", while {found[0]} holds the distributed optimizer's state of "
                         "another rank" if path != found[0] else "")
                raise ConvertError(f"{path}: {wrong}{other}; give --drop-optimizer to convert "
                                   "the weights alone")
        return bool(found)

    def _optimizer(self) -> bool:
        """Read where each parameter's state lies, once (see the module docstring); False
        where the files hold no distributed optimizer state."""
        if self._starts is not None:
            return bool(self._starts)
        self._starts = {}
        if not self._optimizer_files():
            return False
        for path in self._rank_files:
            groups = ((self._file(path).get("optimizer") or {}).get("optimizer") or {}).get(
                "param_groups")
            step, roles = step_and_roles(groups, f"{path}: optimizer.optimizer")
            if path == self._rank_files[0]:
                self._step, self._roles = step, roles
            elif step != self._step:
                raise ConvertError(f"{path}: optimizer.optimizer.param_groups were stepped "
                                   f"{step:g} times, {self._rank_files[0]}'s {self._step:g}")
        for stage, (paths, order) in enumerate(self._stages):
            buffers = [self._buffer(path.parent / OPTIMIZER_FILE, stage // self.pp)
                       for path in paths]
            for path, buffer in zip(paths[1:], buffers[1:], strict=True):
                if buffer["param"].numel() != buffers[0]["param"].numel():
                    raise ConvertError(
                        f"{path.parent / OPTIMIZER_FILE}: buffer {stage // self.pp} holds "
                        f"numel_unpadded {buffer['param'].numel()}, "
                        f"{paths[0].parent / OPTIMIZER_FILE}'s "
                        f"{buffers[0]['param'].numel()}: TP ranks hold equal buffers; give "
                        "--drop-optimizer to convert the weights alone")
            weights = {at: self._shards(places)[0].flatten() for at, places, _ in order}

            def rounds(at: Where, start: int, weights: dict[Where, torch.Tensor] = weights,
                       main: torch.Tensor = buffers[0]["param"]) -> bool:
                weight = weights[at]
                return torch.equal(main[start:start + weight.numel()].to(weight.dtype), weight)

            params = [(at, weights[at].numel(), alone) for at, _, alone in order]
            layouts = coalesced_starts(params, buffers[0]["param"].numel(), rounds)
            if len(layouts) != 1:
                raise ConvertError(
                    f"{paths[0].parent / OPTIMIZER_FILE}: the distributed optimizer's buffer "
                    f"{stage // self.pp} fits {'no' if not layouts else 'more than one'} "
                    "layout of the stage's parameters whose main parameters round to its "
                    "weights; give --drop-optimizer to convert the weights alone")
            self._starts.update({at: (stage, start) for at, start in layouts[0].items()
                                 if at in self._places})
            self._buffers.append(buffers)
        return True

    def optimizer_state(self, name: str) -> dict[str, torch.Tensor] | None:
        """Adam's moments of ``name``, its fp32 main parameter as ``master`` and the step,
        from ``distrib_optim.pt`` (see the module docstring); None where the files hold
        none."""
        if not self._optimizer():
            return None
        part = mcore_parts(name)
        stage, start = self._starts[part.key, part.layer]
        places = self._places[part.key, part.layer]
        pieces: dict[str, list[torch.Tensor]] = {state: [] for state in STATES}
        for buffer, shard, (path, _, key) in zip(self._buffers[stage], self._shards(places),
                                                 places, strict=True):
            for state in STATES:
                pieces[state].append(buffer[state][start:start + shard.numel()]
                                     .reshape(shard.shape))
            if not torch.equal(pieces["param"][-1].to(shard.dtype), shard):
                raise ConvertError(f"{path.parent / OPTIMIZER_FILE}: the main parameter of "
                                   f"{key!r} (from element {start}) does not round to its "
                                   "weight: the buffer is not laid out as mt derived")
        gated = self.config.mlp == "swiglu"
        states = {state: from_stored(self.config, name, join(part.key, shards, gated))
                  for state, shards in pieces.items()}
        return {"master": states["param"], "exp_avg": states["exp_avg"],
                "exp_avg_sq": states["exp_avg_sq"], "step": torch.tensor(self._step)}

    def optimizer_settings(self, name: str) -> dict[str, Any] | None:
        """The hyperparameters of the param group holding ``name`` (megatron-core's
        defaults: ``wd_mult`` 1 for matrices, 0 for biases and norms); None without Adam's
        state or where the groups do not say."""
        if not self._optimizer():
            return None
        return self._roles.get(decays(self._shapes[name]))

    def spec(self, name: str) -> TensorSpec:
        part = mcore_parts(name)
        return TensorSpec(self._shapes[name], self._shards(self._places[part.key,
                                                                        part.layer])[0].dtype)

    def sources(self, name: str) -> list[TensorRef]:
        part = mcore_parts(name)
        return [TensorRef(str(path.relative_to(self.root)), f"{entry}.{key}",
                          TensorSpec(tuple(shard.shape), shard.dtype),
                          f"tp {rank}/{self.tp}{f' {part.describe()}' if part.select else ''}")
                for rank, ((path, entry, key), shard) in enumerate(zip(
                    self._places[part.key, part.layer],
                    self._shards(self._places[part.key, part.layer]), strict=True))]

    def read(self, name: str) -> torch.Tensor:
        part = mcore_parts(name)
        return from_stored(self.config, name, self._joined((part.key, part.layer)))

    def close(self) -> None:
        self._cached = None
        self._models.clear()
        self._files.clear()
