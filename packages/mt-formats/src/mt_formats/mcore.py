"""Megatron-core distributed checkpoints (``megatron.core.dist_checkpointing``, backend
``torch_dist``), as Megatron-LM and NeMo save them: a DCP folder (``.metadata``,
``__R_I.distcp``) plus ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``) and
``common.pt`` (what every rank shares).

Names: ``megatron.core.models.gpt.GPTModel``'s sharded state dict, which is the same for the
Transformer Engine and the local layer specs (the local spec's norms are saved under TE's
names): ``embedding.word_embeddings.weight``, ``embedding.position_embeddings.weight``,
``decoder.layers.self_attention.linear_qkv.{weight,bias,layer_norm_weight,layer_norm_bias}``,
``decoder.layers.self_attention.linear_proj.*``, ``decoder.layers.mlp.linear_fc1.*`` (its
``layer_norm_*`` are the second norm; a gated MLP's rows are [gate; up], as mt's),
``decoder.layers.mlp.linear_fc2.*``, ``decoder.final_layernorm.*``, ``output_layer.weight``
(absent when tied). Every ``decoder.layers.*`` tensor is stacked over the layers along a
leading axis, whatever TP / PP split saved it; mt reads one layer at a time from the chunks
that hold it (:meth:`~mt_formats.dcp.DCPFolder.load_layer`). ``linear_qkv``'s rows are
ordered per query group, [groups, heads/groups q heads + 1 k + 1 v, head_dim] (mt: all q,
then all k, then all v); Megatron's RoPE rotates halves, as mt's, so no other permutation.

The model config: ``mt.json`` in a folder mt wrote, Megatron-LM's ``args`` in ``common.pt``
(allow-listed unpickling, :mod:`mt_formats.megatron_args`; its padded vocabulary's extra rows
are dropped when ``args.vocab_size`` is recorded), or ``--model`` (sizes, grouped-query
heads, norm kind, biases, positions and tying are read from the tensors). Written: per-layer
chunks as Megatron-core saves them, the ``_extra_state`` entries its loader expects,
``metadata.json``, ``common.pt`` (empty without Adam's state) and ``mt.json`` (config,
CRC-32C of every chunk and of those three small files, checked when read).
The vocabulary is stored unpadded.

Adam's state: the ``fully_reshardable`` layout of megatron-core's ``DistributedOptimizer``
(``optimizer.state.{param,exp_avg,exp_avg_sq}.<parameter key>``, each stored as its
parameter; the step in ``common.pt``'s param groups) is read (:meth:`McoreReader.
optimizer_state`) and written (:class:`McoreWriter`, :func:`optimizer_common`); its
``dp_reshardable`` layout (per gradient bucket, Megatron-LM's default) is read from runs of
any TP x PP split, interleaved stages included (:mod:`mt_formats.mcore_buckets`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mt_formats.adam import adam_step, adamw_group, by_role, decays, settings_of
from mt_formats.canonical import (
    CheckpointReader,
    CheckpointWriter,
    TensorRef,
    TrainingProgress,
    canonical_shapes,
)
from mt_formats.crc import CHECKSUM_ALGORITHM
from mt_formats.dcp import DATA_FILE, DCPFileWriter, DCPFolder, config_from
from mt_formats.dcp_files import (
    MCORE_FORMAT,
    METADATA_FILE,
    METADATA_JSON,
    is_mcore_checkpoint,
    write_sidecar,
)
from mt_formats.deepspeed_universal import config_fields
from mt_formats.errors import ConvertError
from mt_formats.manifest import read_json
from mt_formats.mcore_buckets import BUCKET_STATE, BucketState
from mt_formats.megatron_args import config_from_args, load_megatron_file
from mt_formats.tensors import TensorSpec, check_names, tensor_checksum
from mt_formats.torch_io import save_into
from mt_model import GPTConfig

__all__ = ["MCORE_FORMAT", "McoreReader", "McoreWriter", "from_stored", "is_mcore_checkpoint",
           "mcore_parts", "megatron_progress", "state_key", "step_and_roles", "stored_shape"]

COMMON_FILE = "common.pt"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
           "common_backend": "torch", "common_backend_version": 1}
LAYERS = "decoder.layers."
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
_TOP = {"embed.tokens.weight": "embedding.word_embeddings.weight",
        "embed.positions.weight": "embedding.position_embeddings.weight",
        "ln_f.weight": "decoder.final_layernorm.weight",
        "ln_f.bias": "decoder.final_layernorm.bias", "head.weight": "output_layer.weight"}
_MODULES = {"ln1": "self_attention.linear_qkv.layer_norm_", "ln2": "mlp.linear_fc1.layer_norm_",
            "attn.qkv": "self_attention.linear_qkv.", "attn.q": "self_attention.linear_qkv.",
            "attn.kv": "self_attention.linear_qkv.", "attn.proj": "self_attention.linear_proj.",
            "mlp.fc": "mlp.linear_fc1.", "mlp.proj": "mlp.linear_fc2."}
STATE_PREFIX = "optimizer.state."
#: The distributed optimizer's sharding type whose state mt writes (and reads, with
#: ``dp_reshardable``: :mod:`mt_formats.mcore_buckets`).
SHARDING = "fully_reshardable"
BUCKETED = "dp_reshardable"
MOMENTS = ("exp_avg", "exp_avg_sq")
#: Megatron-core's param group identifiers (``param_group_identifier_keys``) of its default
#: groups: weight decay on matrices (wd_mult 1), none on biases and norms (wd_mult 0).
_GROUPS = ({"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False,
            "is_decoupled_lr": False},
           {"wd_mult": 0.0, "lr_mult": 1.0, "is_expert_parallel": False,
            "is_decoupled_lr": False})
#: Modules whose (empty, for a plain torch model) ``_extra_state`` Megatron-core saves per layer.
_EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                "mlp.linear_fc2")


@dataclass(frozen=True)
class McorePart:
    """Where canonical tensor lives: ``key``, its ``layer`` along the stacked axis (-1: not
    stacked) and which rows of a fused ``linear_qkv`` (``select``: ``qkv``, ``q``, ``kv``
    or ``""`` for all rows as stored)."""

    key: str
    layer: int = -1
    select: str = ""

    def describe(self) -> str:
        where = f"[{self.layer}]" if self.layer >= 0 else ""
        return f"{where} {self.select} per-group rows".strip() if self.select else where


def mcore_parts(name: str) -> McorePart:
    """The Megatron-core tensor canonical tensor ``name`` is (a layer of)."""
    if name in _TOP:
        return McorePart(_TOP[name])
    match = _BLOCK.match(name)
    if match:
        layer, rest = match.groups()
        module, _, leaf = rest.rpartition(".")
        if module in _MODULES:
            select = module.removeprefix("attn.") if module in ("attn.qkv", "attn.q",
                                                                "attn.kv") else ""
            return McorePart(LAYERS + _MODULES[module] + leaf, int(layer), select)
    raise ConvertError(f"tensor {name!r} has no Megatron-core equivalent")


def state_key(state: str, key: str) -> str:
    """The key of distributed optimizer state ``state`` (``exp_avg``, ``exp_avg_sq``,
    ``param``: the fp32 main parameter) of the parameter stored as ``key``."""
    return f"{STATE_PREFIX}{state}.{key}"


def _grouped(config: GPTConfig) -> tuple[int, int, int]:
    """(query groups, q heads per group, head_dim)."""
    groups = config.n_kv_heads or config.n_heads
    return groups, config.n_heads // groups, config.head_dim


def from_groups(stored: torch.Tensor, select: str, config: GPTConfig) -> torch.Tensor:
    """mt's rows (``qkv``: [q; k; v], ``q``, ``kv``: [k; v]) of a per-group ``linear_qkv``."""
    groups, per, dim = _grouped(config)
    rest = stored.shape[1:]
    parts = stored.reshape(groups, per + 2, dim, *rest)
    q = parts[:, :per].reshape(groups * per * dim, *rest)
    k = parts[:, per].reshape(groups * dim, *rest)
    v = parts[:, per + 1].reshape(groups * dim, *rest)
    chosen = {"qkv": (q, k, v), "q": (q,), "kv": (k, v)}[select]
    return torch.cat(chosen).contiguous()


def to_groups(q: torch.Tensor, kv: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """The per-group ``linear_qkv`` rows of mt's q rows and [k; v] rows."""
    groups, per, dim = _grouped(config)
    rest = q.shape[1:]
    k, v = kv.reshape(2, groups, 1, dim, *rest).unbind(0)
    return torch.cat([q.reshape(groups, per, dim, *rest), k, v], dim=1).reshape(
        groups * (per + 2) * dim, *rest).contiguous()


def stored_shape(config: GPTConfig, name: str, shape: tuple[int, ...], rows: int
                 ) -> tuple[int, ...]:
    """The shape canonical tensor ``name`` of ``shape`` is stored in (one layer of it;
    ``rows``: the vocabulary as padded)."""
    if name in ("embed.tokens.weight", "head.weight"):  # Megatron-LM pads the vocabulary
        shape = (rows, *shape[1:])
    if mcore_parts(name).select:
        groups, per, dim = _grouped(config)
        shape = (groups * (per + 2) * dim, *shape[1:])
    return shape


def from_stored(config: GPTConfig, name: str, stored: torch.Tensor) -> torch.Tensor:
    """Canonical tensor ``name`` from its stored form (one layer of it where stacked): the
    vocabulary's padding rows dropped, ``linear_qkv``'s rows regrouped."""
    if name in ("embed.tokens.weight", "head.weight"):
        return stored[:config.vocab_size].contiguous()
    select = mcore_parts(name).select
    return from_groups(stored, select, config) if select else stored


def _sizes(shapes: Mapping[str, tuple[int, ...]], fields: Mapping[str, Any],
           where: Path) -> dict[str, Any]:
    """Config fields the stored tensors decide, given ``n_heads`` and ``mlp`` from fields."""
    def shape(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise ConvertError(f"{where}: no tensor {key!r}: not a Megatron-core GPT")
        return shapes[key]

    vocab, hidden = shape(_TOP["embed.tokens.weight"])
    layers = shape(LAYERS + "self_attention.linear_proj.weight")[0]
    heads = fields.get("n_heads")
    if not isinstance(heads, int) or heads < 1 or hidden % heads:
        raise ConvertError(f"{where}: n_heads {heads!r} of the given config does not divide "
                           f"the hidden size {hidden}")
    qkv_rows = shape(LAYERS + "self_attention.linear_qkv.weight")[1]
    fc_rows = shape(LAYERS + "mlp.linear_fc1.weight")[1]
    sizes: dict[str, Any] = {
        "n_layers": layers, "hidden": hidden, "vocab_size": vocab,
        "n_kv_heads": (qkv_rows // (hidden // heads) - heads) // 2,
        "ffn_hidden": fc_rows // 2 if fields.get("mlp") == "swiglu" else fc_rows,
        "norm": "layernorm" if LAYERS + "self_attention.linear_qkv.layer_norm_bias" in shapes
        else "rmsnorm",
        "bias": LAYERS + "self_attention.linear_proj.bias" in shapes,
        "tied_embeddings": _TOP["head.weight"] not in shapes,
        "position": "learned" if _TOP["embed.positions.weight"] in shapes else "rope"}
    if sizes["position"] == "learned":
        sizes["seq_len"] = shapes[_TOP["embed.positions.weight"]][0]
    return sizes


class McoreReader(CheckpointReader):
    """A Megatron-core ``torch_dist`` checkpoint as canonical mt tensors (see the module
    docstring); ``model`` gives the config where the folder does not record one."""

    format = MCORE_FORMAT

    def __init__(self, root: Path, model: GPTConfig | str | Mapping[str, Any] | None = None
                 ) -> None:
        self.root = Path(root)
        backend = read_json(self.root / METADATA_JSON)
        if backend.get("sharded_backend") != "torch_dist":
            raise ConvertError(f"{self.root / METADATA_JSON}: sharded_backend "
                               f"{backend.get('sharded_backend')!r}; mt reads 'torch_dist'")
        self._folder = DCPFolder(self.root)
        shapes = self._folder.shapes()
        recorded = self._folder.recorded_config(model)
        if recorded is not None:
            self.config = recorded
        elif model is None and (args := self._args()) is not None:  # Megatron-LM's own
            self.config = config_from_args(args, self.root / COMMON_FILE, gpt2_only=False)
        else:
            fields, _ = config_fields(model, self.root, {})
            if fields is None:
                raise ConvertError(
                    f"{self.root}: this Megatron-core checkpoint records no model config "
                    f"(no mt.json, no Megatron-LM args in {COMMON_FILE}); give it with "
                    "--model PRESET or --model CONFIG.json (GPTConfig fields: heads, "
                    "activation, norm epsilon; sizes are read from the tensors)")
            self.config = config_from({**fields, **_sizes(shapes, fields, self.root)},
                                      self.root / METADATA_FILE)
        self._rows = shapes.get(_TOP["embed.tokens.weight"], (self.config.vocab_size,))[0]
        if self.config.vocab_size > self._rows:
            raise ConvertError(f"{self.root / METADATA_FILE}: the embedding has {self._rows} "
                               f"rows, fewer than the vocabulary of {self.config.vocab_size}")
        self._shapes = canonical_shapes(self.config)
        self._parts = {name: mcore_parts(name) for name in self._shapes}
        self._check(shapes)
        self._cached: tuple[tuple[str, int], torch.Tensor] | None = None
        self._step: float | bool | None = None  # read on the first optimizer_state()
        self._buckets: BucketState | None = None  # with the step, where the folder has them
        self._roles: dict[bool, dict[str, Any]] = {}  # with the step

    def _common(self) -> dict[str, Any]:
        """``common.pt`` (allow-listed unpickling: Megatron-LM's ``args``), or {}."""
        if not (self.root / COMMON_FILE).is_file():
            return {}
        common = load_megatron_file(self.root / COMMON_FILE)
        return common if isinstance(common, dict) else {}

    def _args(self) -> Any:
        """Megatron-LM's ``args`` from ``common.pt``, or None."""
        return self._common().get("args")

    def progress(self) -> TrainingProgress | None:
        """Megatron-LM's ``iteration`` in ``common.pt`` (the steps taken) and, where its
        ``args`` record them, the tokens seen (``consumed_train_samples`` x
        ``seq_length``); None where ``common.pt`` holds no iteration."""
        return megatron_progress(self._common(), self.root / COMMON_FILE)

    def _stored_shape(self, name: str) -> tuple[int, ...]:
        shape = stored_shape(self.config, name, self._shapes[name], self._rows)
        return (self.config.n_layers, *shape) if self._parts[name].layer >= 0 else shape

    def _check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        where = self.root / METADATA_FILE
        expected = sorted({part.key for part in self._parts.values()})
        found = [key for key in shapes if key.startswith(("embedding.", "decoder.",
                                                          "output_layer."))]
        check_names(where, found, expected)
        for name, part in self._parts.items():
            if shapes[part.key] != self._stored_shape(name):
                raise ConvertError(f"{where}: tensor {part.key!r} has shape "
                                   f"{list(shapes[part.key])}, the model config needs "
                                   f"{list(self._stored_shape(name))}")
        for key in expected:
            self._folder.check(key)

    def names(self) -> list[str]:
        return list(self._shapes)

    def spec(self, name: str) -> TensorSpec:
        return TensorSpec(self._shapes[name], self._folder.spec(self._parts[name].key).dtype)

    def sources(self, name: str) -> list[TensorRef]:
        part = self._parts[name]
        return [TensorRef(self._folder.file_of(part.key), part.key,
                          self._folder.spec(part.key), part.describe())]

    def read(self, name: str) -> torch.Tensor:
        return self._canonical(name, self._parts[name].key)

    def _canonical(self, name: str, key: str) -> torch.Tensor:
        """Canonical tensor ``name`` from stored tensor ``key`` (the parameter's own or one
        of its optimizer states, which share its layout)."""
        return self._shaped(name, self._stored(key, self._parts[name].layer))

    def _stored(self, key: str, layer: int) -> torch.Tensor:
        """Stored tensor ``key`` (``layer`` of it where stacked: >= 0)."""
        if layer < 0:
            return self._folder.load(key)
        at, cached = (key, layer), self._cached
        if cached is None or cached[0] != at:  # q then kv read one qkv layer once
            # A local reference: the writer asks for optimizer state in its thread while the
            # next tensor is read in another (convert's read-ahead), both through here.
            cached = self._cached = (at, self._folder.load_layer(*at))
        return cached[1]

    def _shaped(self, name: str, stored: torch.Tensor) -> torch.Tensor:
        return from_stored(self.config, name, stored)

    def optimizer_state(self, name: str) -> dict[str, torch.Tensor] | None:
        """Adam's moments of ``name`` from the distributed optimizer's ``fully_reshardable``
        state (``optimizer.state.<moment>.<parameter key>``, the parameter's stored shape,
        permuted as the weight), its fp32 main parameter as ``master`` where the folder
        holds one (``optimizer.state.param.<key>``: a bf16 model's weights are a rounding of
        it), the step from the param groups in ``common.pt``; or the same from its
        ``dp_reshardable`` buckets (:mod:`mt_formats.mcore_buckets`); None where the folder
        holds no optimizer state."""
        if self._step is None:
            self._step = self._optimizer_step()
        if self._step is False:
            return None
        part = self._parts[name]
        if self._buckets is not None:
            states = self._buckets.read((part.key, part.layer),
                                        self._stored(part.key, part.layer))
            return {"master": self._shaped(name, states["param"]),
                    **{moment: self._shaped(name, states[moment]) for moment in MOMENTS},
                    "step": torch.tensor(self._step)}
        result: dict[str, torch.Tensor] = {}
        for state in ("param", *MOMENTS):
            key = state_key(state, part.key)
            meta = self._folder.tensors.get(key)
            if meta is None and state == "param":
                continue
            stored = None if meta is None else tuple(meta.size)
            if stored != self._stored_shape(name):
                found = "absent" if stored is None else f"of shape {list(stored)}"
                raise ConvertError(f"{self.root / METADATA_FILE}: optimizer state {key!r} is "
                                   f"{found}; its parameter {part.key!r} is "
                                   f"{list(self._stored_shape(name))}")
            self._folder.check(key)
            result["master" if state == "param" else state] = self._canonical(name, key)
        result["step"] = torch.tensor(self._step)
        return result

    def _optimizer_step(self) -> float | bool:
        """The distributed optimizer's step count (its param groups' ``step``: in
        ``common.pt``, or beside the buckets), or False where the folder holds no optimizer
        state."""
        keys = self._folder.tensors
        bucketed = any(key.startswith(BUCKET_STATE) for key in keys)
        if not bucketed and not any(key.startswith(STATE_PREFIX) for key in keys):
            return False
        path = self.root / COMMON_FILE
        common = load_megatron_file(path)
        try:
            sharding = common["optimizer"]["param_state_sharding_type"]
        except (KeyError, TypeError) as err:
            raise ConvertError(f"{path}: no optimizer.param_state_sharding_type: "
                               f"{err!r}") from None
        if sharding != (BUCKETED if bucketed else SHARDING):
            stored = f"{BUCKET_STATE}* buckets" if bucketed else f"{STATE_PREFIX}* tensors"
            raise ConvertError(f"{path}: optimizer state of sharding type {sharding!r} beside "
                               f"{stored}; mt reads {SHARDING!r} and {BUCKETED!r}")
        if bucketed:
            self._buckets = BucketState(
                self._folder, self._folder.shapes(), self.config.mlp == "swiglu",
                "or give --drop-optimizer to convert the weights alone",
                common.get("args"))
            self._buckets.locate(self._stored)
            groups: Any = self._buckets.groups
            where = f"{self.root / METADATA_FILE}: {BUCKET_STATE}dp_group_idx_0.optimizer"
        else:
            groups = (common["optimizer"].get("optimizer") or {}).get("param_groups")
            where = f"{path}: optimizer.optimizer"
        step, self._roles = step_and_roles(groups, where)
        return step

    def optimizer_settings(self, name: str) -> dict[str, Any] | None:
        """The hyperparameters of the param group holding ``name`` in ``common.pt``:
        megatron-core's group of ``wd_mult`` 1 for matrices, of ``wd_mult`` 0 for biases
        and norms (:func:`_role_settings`); None without optimizer state or where the
        groups do not say which holds ``name``."""
        if self._step is None:
            self._step = self._optimizer_step()
        if self._step is False:
            return None
        return self._roles.get(decays(self._shapes[name]))

    def close(self) -> None:
        self._cached = None


class McoreWriter(CheckpointWriter):
    """Writes a Megatron-core ``torch_dist`` folder that ``dist_checkpointing.load`` reads
    into a ``GPTModel`` of the same config, one layer at a time; with a :attr:`state_source`
    holding Adam's state, also the distributed optimizer's ``fully_reshardable`` state that
    ``DistributedOptimizer.load_state_dict`` takes (see :meth:`finish`)."""

    format = MCORE_FORMAT
    holds_optimizer_state = True

    def __init__(self, config: GPTConfig, specs: dict[str, TensorSpec]) -> None:
        super().__init__(config, specs)
        self._parts = {name: mcore_parts(name) for name in self.specs}
        self._files: DCPFileWriter | None = None
        self._checksums: dict[str, str] = {}
        self._pending: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self._steps: dict[str, float] = {}  # parameter -> step, where the source holds state
        self._settings: dict[str, dict[str, Any] | None] = {}  # and its Adam settings

    def targets(self, name: str) -> list[TensorRef]:
        part, spec = self._parts[name], self.specs[name]
        shape = spec.shape
        if part.select:
            groups, per, dim = _grouped(self.config)
            shape = (groups * (per + 2) * dim, *shape[1:])
        if part.layer >= 0:
            shape = (self.config.n_layers, *shape)
        return [TensorRef(DATA_FILE, part.key, TensorSpec(shape, spec.dtype), part.describe())]

    def open(self, directory: Path) -> None:
        self._files = DCPFileWriter(Path(directory))

    def _store(self, key: str, part: McorePart, tensor: torch.Tensor) -> None:
        """``tensor`` (in the stored layout) as ``key``, or as its layer ``part.layer``."""
        assert self._files is not None, "open() first"
        if part.layer < 0:
            self._files.add_chunk(key, tensor)
            self._checksums[key] = tensor_checksum(tensor, CHECKSUM_ALGORITHM)
            return
        layers = self.config.n_layers
        self._files.add_chunk(key, tensor[None], (layers, *tensor.shape),
                              (part.layer,) + (0,) * tensor.dim())
        self._checksums[f"{key}[{part.layer}]"] = tensor_checksum(tensor, CHECKSUM_ALGORITHM)

    def _put(self, key: str, part: McorePart, tensor: torch.Tensor) -> None:
        """Canonical ``tensor`` as stored tensor ``key`` of ``part``'s layout (a fused
        ``linear_qkv`` reordered per query group, once its q and kv rows are both here)."""
        if part.select == "qkv":
            groups, per, dim = _grouped(self.config)
            q_rows = groups * per * dim
            self._store(key, part, to_groups(tensor[:q_rows], tensor[q_rows:], self.config))
        elif part.select:
            pending = self._pending.setdefault((key, part.layer), {})
            pending[part.select] = tensor
            if len(pending) == 2:
                del self._pending[(key, part.layer)]
                self._store(key, part, to_groups(pending["q"], pending["kv"], self.config))
        else:
            self._store(key, part, tensor)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        part = self._parts[name]
        self._put(part.key, part, tensor)
        state = self.source_state(name)
        if state is None:
            return
        # megatron-core's distributed optimizer keeps fp32 main params and fp32 moments
        master = state.get("master", tensor)  # the source's fp32 master, else the weight
        self._put(state_key("param", part.key), part, master.to(torch.float32))
        for moment in MOMENTS:
            self._put(state_key(moment, part.key), part, state[moment].to(torch.float32))
        self._steps[name] = float(state["step"])
        self._settings[name] = self.state_source.optimizer_settings(name)

    def finish(self) -> None:
        """Completes the folder: ``_extra_state`` entries, ``metadata.json``, ``mt.json``
        and ``common.pt``; with optimizer state, ``common.pt`` holds what megatron-core's
        ``DistributedOptimizer.state_dict()`` puts there (:func:`optimizer_common`)."""
        assert self._files is not None, "open() first"
        if self._pending:
            raise ConvertError(f"{self._files.directory}: half-written layers "
                               f"{sorted(self._pending)}")
        self.check_states()
        common = self._optimizer_common()
        layers = self.config.n_layers
        for layer in range(layers):
            for module in _EXTRA_STATE:
                self._files.add_object(  # as Megatron-core stores a torch module's: [None]
                    f"{LAYERS}{module}._extra_state/shard_{layer}_{layers}", [None])
        self._files.close()
        directory = self._files.directory
        with open(directory / COMMON_FILE, "wb") as file:
            save_into(common, file)
            file.flush()
            os.fsync(file.fileno())
        with open(directory / METADATA_JSON, "w", encoding="utf-8") as file:
            file.write(json.dumps(BACKEND))
            file.flush()
            os.fsync(file.fileno())
        write_sidecar(directory, {"names": "megatron-core", "model": self.config.to_dict(),
                                  "checksums": self._checksums},
                      files=(METADATA_FILE, METADATA_JSON, COMMON_FILE))

    def _optimizer_common(self) -> dict[str, Any]:
        """``common.pt``'s content: empty without optimizer state, else its param groups."""
        if not self._steps:
            return {}
        where = self._files.directory if self._files is not None else Path(".")
        missing = [name for name in self.specs if name not in self._steps]
        if missing:
            raise ConvertError(f"{where}: the source holds Adam's state for some parameters "
                               f"only; none for {missing[:4]}")
        steps = sorted(set(self._steps.values()))
        if len(steps) != 1:
            raise ConvertError(f"{where}: the source's parameters were stepped {steps} times; "
                               "megatron-core keeps one step for all")
        shapes = {name: self.specs[name].shape for name in self._settings}
        assert self.state_source is not None  # settings come with its state
        roles = by_role(self._settings, shapes, str(self.state_source.root))
        for role, group in ((True, "matrices"), (False, "biases and norms")):
            if role not in roles:
                self.notes.append(f"the source records no Adam hyperparameters of its "
                                  f"{group}: their param group in {COMMON_FILE} holds torch "
                                  "AdamW's defaults (megatron-core's scheduler sets lr and "
                                  "weight decay before every step)")
        common = optimizer_common(steps[0], roles)
        progress = self.state_source.progress()
        if progress is None:
            self.notes.append(f"the source records no training step: {COMMON_FILE} holds no "
                              "iteration (Megatron-LM: load it with --finetune)")
        else:  # what Megatron-LM's loader resumes its schedule and data from
            common["iteration"] = progress.step
        return common

    def abort(self) -> None:
        if self._files is not None:
            self._files.abort()


def megatron_progress(common: Mapping[str, Any], where: Path) -> TrainingProgress | None:
    """Megatron-LM's ``iteration`` in a file's ``common`` state (the steps taken) and, where
    its ``args`` record them, the tokens seen (``consumed_train_samples`` x
    ``seq_length``); None without an iteration."""
    if "iteration" not in common:
        return None
    args = common.get("args")
    samples, seq = (getattr(args, key, None) for key in ("consumed_train_samples",
                                                         "seq_length"))
    tokens = samples * seq if isinstance(samples, int) and isinstance(seq, int) else None
    return TrainingProgress.checked(("iteration", common["iteration"]),
                                    ("args.consumed_train_samples x seq_length", tokens),
                                    str(where))


def step_and_roles(groups: Any, where: str) -> tuple[float, dict[bool, dict[str, Any]]]:
    """The step count of megatron-core's distributed optimizer's param groups (``where``
    names them: their step must agree) and their settings per role
    (:func:`_role_settings`)."""
    try:
        steps = {adam_step(group["step"], f"{where}.param_groups") for group in groups}
    except (KeyError, TypeError) as err:
        raise ConvertError(f"{where}: no param groups with a step (param_groups[*].step): "
                           f"{err!r}") from None
    if len(steps) != 1:
        raise ConvertError(f"{where}: the optimizer's param groups were stepped "
                           f"{sorted(steps)} times" if steps else
                           f"{where}: holds no optimizer param groups")
    return steps.pop(), _role_settings(groups, f"{where}.param_groups")


def _role_settings(groups: list[Mapping[str, Any]], where: str) -> dict[bool, dict[str, Any]]:
    """The settings per role (:func:`~mt_formats.adam.by_role`'s keys) of megatron-core's
    param groups: matrices are in the groups of ``wd_mult`` 1, biases and norms in those of
    ``wd_mult`` 0; a group's ``max_lr`` (its scheduler's peak) is the ``initial_lr``. A role
    whose groups differ (a decoupled learning rate, ``lr_mult``) is
    absent: the groups do not record which parameters they hold."""
    roles: dict[bool, dict[str, Any]] = {}
    for role in (True, False):
        found = [settings_of({**group, "initial_lr": group["max_lr"]} if "max_lr" in group
                             else group, where)
                 for group in groups if float(group.get("wd_mult", 1.0)) == float(role)]
        if found and all(settings == found[0] for settings in found):
            roles[role] = found[0]
    return roles


def optimizer_common(step: float, roles: Mapping[bool, Mapping[str, Any]] | None = None
                     ) -> dict[str, Any]:
    """The common (non-sharded) part of megatron-core's distributed optimizer state as
    ``common.pt`` holds it for ``fully_reshardable``: ``{"optimizer": {"optimizer":
    {"param_groups": [...]}, "param_state_sharding_type": "fully_reshardable"}}``. Its
    loader matches groups by :data:`_GROUPS`' identifier keys and loads each group's
    hyperparameters with it: those of ``roles`` (:func:`~mt_formats.adam.by_role`: the
    matrices' for the ``wd_mult`` 1 group, the others' for the ``wd_mult`` 0 one; the
    source's ``initial_lr`` as the group's ``max_lr``, the peak its scheduler warms up
    to), torch AdamW's defaults for a role without any (megatron-core's
    ``OptimizerParamScheduler`` sets lr and weight decay before every step)."""
    groups = []
    for identity in _GROUPS:
        settings = dict((roles or {}).get(identity["wd_mult"] == 1.0) or {})
        peak = settings.pop("initial_lr", None)
        groups.append({**identity, **adamw_group(settings), "default_config": True,
                       **({} if peak is None else {"max_lr": peak}), "step": float(step)})
    return {"optimizer": {"optimizer": {"param_groups": groups},
                          "param_state_sharding_type": SHARDING}}
