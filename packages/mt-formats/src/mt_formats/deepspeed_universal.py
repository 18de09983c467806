"""Reading DeepSpeed *universal* checkpoints of mt's GPT as a conversion source.

``python -m deepspeed.checkpoint.ds_to_universal --input_folder CKPT/global_stepN
--output_folder OUT`` turns a DeepSpeed checkpoint of any ZeRO stage, DP, TP and PP size
into one folder per parameter: ``OUT/zero/<param name>/fp32.pt`` holds ``{"param": full fp32
tensor, ...}`` (the fp32 master weights), beside ``exp_avg.pt`` / ``exp_avg_sq.pt`` (Adam's
moments, same layout) and ``step.pt``; the engine's ``mp_rank_*_model_states.pt`` are copied
next to ``zero/``. It joins each parameter's tensor-parallel slices by the rules of the
checkpoint's ``universal_checkpoint_info``, which ``mt pretrain --engine deepspeed`` writes
(``mt_zero.deepspeed_universal``) with the model config (``mt_model``); without it
(``--inject_missing_state``) only a tp = 1 checkpoint joins right. The parameter names are
``mt_model.GPT``'s own (``embed.tokens.weight``, ``blocks.0.attn.qkv.weight``, ...; a
``module.`` prefix, of a wrapped model, is accepted too), or, from pipeline stages,
DeepSpeed's ``PipelineModule`` names (``3.attn.qkv.weight``,
``tied_modules.embed.inner.tokens.weight``) with mt's name of each in ``mt_names``, or
Megatron-DeepSpeed's ``GPTModelPipe`` names (``tied_modules.embed.word_embeddings.weight``,
``2.self_attention.query_key_value.weight``, ...: the format MT-NLG was trained in), whose
per-head ``query_key_value`` rows become mt's [q; k; v] order.

DeepSpeed itself does not record the model's configuration. The sizes (layers, hidden, ffn,
vocabulary, sequence length) are read from the tensors; the rest (attention heads above
all) comes, in this order, from the ``model`` argument (a ``GPTConfig``, a preset name or a
JSON file of ``GPTConfig`` fields, ``mt convert --model``), an ``"mt_model"`` entry of the
model-states file's client state, Megatron-LM's ``args`` there (Megatron-DeepSpeed), or an
mt ``config.json`` in the folder.

Every file is read with ``torch.load(weights_only=True, mmap=True)``; the model-states file
with the allow-list of Megatron-LM files (:mod:`mt_formats.megatron_args`), the parameter
files with an inert stand-in for DeepSpeed's ``SubparamShape`` record.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mt_formats.adam import adam_step, decays, two_groups
from mt_formats.canonical import (
    CheckpointReader,
    TensorRef,
    TrainingProgress,
    canonical_shapes,
    follow_pointer,
    read_pointer,
)
from mt_formats.errors import ConvertError
from mt_formats.megatron import _LAYER, _from_megatron_qkv
from mt_formats.megatron_args import config_from_args, load_megatron_file
from mt_formats.tensors import TensorSpec
from mt_formats.torch_io import load_weights_only
from mt_model import GPTConfig, preset

__all__ = [
    "DEEPSPEED_FORMAT",
    "DeepSpeedUniversalReader",
    "config_fields",
    "is_deepspeed_checkpoint",
    "universal_folder",
]

DEEPSPEED_FORMAT = "deepspeed"
ZERO_DIR = "zero"
FP32_FILE = "fp32.pt"
OPTIMIZER_STATE = "optimizer_state.pt"  # ds_to_universal's copy of the param groups
LATEST_UNIVERSAL = "latest_universal"
MODEL_STATES = "mp_rank_*_model_states.pt"
_PREFIX = "module."
_CONVERT_HINT = ("convert it first: python -m deepspeed.checkpoint.ds_to_universal "
                 "--input_folder {src} --output_folder OUT (with --inject_missing_state if "
                 "it has no universal_checkpoint_info: tensor-parallel degree 1 only)")
UNIVERSAL_INFO = "universal_checkpoint_info"


def _native_step(path: Path) -> Path | None:
    """The DeepSpeed (non-universal) step folder ``path`` designates, if any: itself, or
    the one DeepSpeed's ``latest`` tag file names."""
    if any(path.glob(MODEL_STATES)):
        return path
    latest = path / "latest"
    if latest.is_file():
        tag = read_pointer(latest)
        if any((path / tag).glob(MODEL_STATES)):
            return path / tag
    return None


def is_deepspeed_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a DeepSpeed universal folder (``zero/``), a folder whose
    ``latest_universal`` names one, or a native DeepSpeed checkpoint (which is refused
    later with the ``ds_to_universal`` command to run)."""
    return ((path / ZERO_DIR).is_dir() or (path / LATEST_UNIVERSAL).is_file()
            or _native_step(path) is not None)


def universal_folder(path: Path) -> Path:
    """The universal checkpoint folder ``path`` designates (itself or ``latest_universal``'s
    target); a native DeepSpeed checkpoint is an error saying how to convert it."""
    folder = follow_pointer(path, ZERO_DIR, LATEST_UNIVERSAL, "universal checkpoint")
    if folder is not None:
        return folder
    native = _native_step(path)
    if native is not None:
        raise ConvertError(f"{native}: a DeepSpeed checkpoint in its native (per-rank) "
                           "layout, not a universal one; " + _CONVERT_HINT.format(src=native))
    raise ConvertError(f"{path}: not a DeepSpeed universal checkpoint (no {ZERO_DIR}/ folder)")


class SubparamShape:
    """An inert stand-in for DeepSpeed's record, in a universal file, of how a fused
    parameter's blocks were joined (``sub_param_shape``: patterns, shape, partition_dim);
    unpickled under DeepSpeed's name without importing DeepSpeed, its fields only."""


class LossScaler:
    """An inert stand-in for DeepSpeed's loss scaler, pickled in ``optimizer_state.pt``
    beside the param groups; its fields only."""


class ZeroStageEnum(int):
    """An inert stand-in for DeepSpeed's ZeRO stage enumeration (an ``int``), pickled in
    ``optimizer_state.pt``."""


_UNIVERSAL_GLOBALS = [(SubparamShape, "deepspeed.checkpoint.universal_checkpoint.SubparamShape")]
#: What ``zero/optimizer_state.pt`` may hold beside plain containers.
_OPTIMIZER_GLOBALS = [(LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
                      (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum")]


def _load_param(path: Path, name: str) -> torch.Tensor:
    """The ``"param"`` tensor of a universal ``<state>.pt`` file of parameter ``name``."""
    data = load_weights_only(path, missing=f"file not found (tensor {name!r})",
                             allowed=_UNIVERSAL_GLOBALS)
    tensor = data.get("param") if isinstance(data, dict) else None
    if not isinstance(tensor, torch.Tensor):
        got = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise ConvertError(f"{path}: tensor {name!r}: expected a dict with a 'param' tensor, "
                           f"got {got}")
    if not tensor.is_floating_point():
        raise ConvertError(f"{path}: tensor {name!r} has dtype {tensor.dtype}, expected a "
                           "floating-point tensor")
    return tensor


def _infer_sizes(shapes: Mapping[str, tuple[int, ...]], root: Path) -> dict[str, int]:
    """Layers, hidden, ffn, vocabulary and sequence length from the parameter shapes."""
    try:
        vocab, hidden = shapes["embed.tokens.weight"]
        seq_len, _ = shapes["embed.positions.weight"]
        ffn, _ = shapes["blocks.0.mlp.fc.weight"]
    except (KeyError, ValueError) as err:
        raise ConvertError(f"{root / ZERO_DIR}: not mt's GPT: cannot read the model sizes "
                           f"({err!r}; parameters: {sorted(shapes)[:8]} ...)") from None
    layers = {int(m.group(1)) for n in shapes if (m := re.match(r"blocks\.(\d+)\.", n))}
    if layers != set(range(len(layers))):
        raise ConvertError(f"{root / ZERO_DIR}: block numbers {sorted(layers)} are not "
                           f"0..{len(layers) - 1}")
    return {"n_layers": len(layers), "hidden": hidden, "ffn_hidden": ffn,
            "vocab_size": vocab, "seq_len": seq_len}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConvertError(f"{path}: not valid JSON: {err}") from None


def config_fields(model: GPTConfig | str | Mapping[str, Any] | None, root: Path,
                   client: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """GPTConfig fields from the first available source (``model``, the client state's
    ``mt_model`` or Megatron-LM ``args``, an mt ``config.json`` in ``root``), and where they
    came from; (None, "")
    when there is none. Also used for torch DCP folders, which record no config either."""
    if isinstance(model, GPTConfig):
        return model.to_dict(), "the given config"
    if isinstance(model, Mapping):
        return dict(model), "the given config"
    if isinstance(model, str):
        path = Path(model)
        if path.is_file():
            data = _read_json(path)
            if isinstance(data, dict) and isinstance(data.get("model"), dict):
                data = data["model"]  # an mt config.json or meta.json
            if not isinstance(data, dict):
                raise ConvertError(f"{path}: expected a JSON object of GPTConfig fields")
            return data, str(path)
        try:
            return preset(model).to_dict(), f"preset {model!r}"
        except (KeyError, ValueError) as err:
            raise ConvertError(f"--model {model!r}: neither a JSON file nor a model preset "
                               f"({err})") from None
    if isinstance(client.get("mt_model"), dict):
        return dict(client["mt_model"]), "the model-states file's mt_model entry"
    if isinstance(client.get("args"), argparse.Namespace):  # Megatron-DeepSpeed
        args = argparse.Namespace(**vars(client["args"]))
        norm = str(getattr(args, "normalization", "layernorm")).lower()
        args.normalization = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get(norm, norm)
        where = next(iter(sorted(root.glob(MODEL_STATES))), root)  # the file they came from
        return config_from_args(args, where).to_dict(), f"{where} (Megatron-LM args)"
    config_json = root / "config.json"
    if config_json.is_file():
        data = _read_json(config_json)
        if isinstance(data, dict) and isinstance(data.get("model"), dict):
            return dict(data["model"]), str(config_json)
    return None, ""


def resolve_config(model: GPTConfig | str | Mapping[str, Any] | None, root: Path,
                   shapes: Mapping[str, tuple[int, ...]],
                   client: Mapping[str, Any]) -> GPTConfig:
    """The GPTConfig of a universal checkpoint: sizes from ``shapes``, the rest (heads,
    norms, activation, init) from the first config source (see the module docstring)."""
    sizes = _infer_sizes(shapes, root)
    fields, origin = config_fields(model, root, client)
    if fields is None:
        found = ", ".join(f"{k} {v}" for k, v in sizes.items())
        raise ConvertError(f"{root}: a DeepSpeed checkpoint does not record the model config "
                           f"(read from the tensors: {found}; the number of attention heads "
                           "is not); give it with --model PRESET or --model CONFIG.json "
                           "(GPTConfig fields, e.g. an mt config.json)")
    try:
        return GPTConfig.from_dict({**fields, **sizes})
    except (TypeError, ValueError, KeyError) as err:
        raise ConvertError(f"{root}: the config from {origin} does not fit the checkpoint's "
                           f"sizes {sizes}: {err}") from None


def _client_state(root: Path) -> dict[str, Any]:
    """The engine's model-states file (copied beside ``zero/``), when present: weights-only,
    plus the allow-list of Megatron-LM's pickled ``args`` (Megatron-DeepSpeed saves them
    there)."""
    files = sorted(root.glob(MODEL_STATES))
    if not files:
        return {}
    data = load_megatron_file(files[0])
    return data if isinstance(data, dict) else {}


#: Megatron-DeepSpeed's names inside a transformer layer -> mt's (``megatron._LAYER``).
_MDS_LEAF = {meg + mt[len(prefix):]: mt
             for prefix, (meg, _) in _LAYER.items()
             for mt in ((prefix,) if prefix.endswith(("weight", "bias"))
                        else (prefix + ".weight", prefix + ".bias"))}


def _megatron_deepspeed_names(names: list[str], root: Path) -> dict[str, str]:
    """mt's name of each parameter of Megatron-DeepSpeed's ``GPTModelPipe`` (its layer list:
    a cast, the embedding, the transformer layers, the final norm, the head), e.g.
    ``tied_modules.embed.word_embeddings.weight`` -> ``embed.tokens.weight``,
    ``2.self_attention.query_key_value.weight`` -> ``blocks.0.attn.qkv.weight``,
    ``{last + 1}.weight`` -> ``ln_f.weight``; {} when ``names`` are not its."""
    layers = sorted({int(m[1]) for n in names
                     if (m := re.fullmatch(r"(\d+)\.input_layernorm\.weight", n))})
    if not layers:
        return {}
    if layers != list(range(layers[0], layers[0] + len(layers))):
        raise ConvertError(f"{root / ZERO_DIR}: Megatron-DeepSpeed layers {layers} are not "
                           "consecutive")
    out = {}
    for name in names:
        top = re.fullmatch(r"(?:tied_modules\.embed|\d+)\.(word|position)_embeddings\.weight",
                           name)
        numbered = re.fullmatch(r"(\d+)\.(.+)", name)
        if top:
            out[name] = f"embed.{'tokens' if top[1] == 'word' else 'positions'}.weight"
        elif numbered and numbered[2] == "lm_head.weight":
            out[name] = "head.weight"
        elif numbered and int(numbered[1]) == layers[-1] + 1 and numbered[2] in ("weight",
                                                                               "bias"):
            out[name] = f"ln_f.{numbered[2]}"
        elif numbered and int(numbered[1]) in layers and numbered[2] in _MDS_LEAF:
            out[name] = f"blocks.{int(numbered[1]) - layers[0]}.{_MDS_LEAF[numbered[2]]}"
        else:
            raise ConvertError(f"{root / ZERO_DIR / name}: not a parameter of "
                               "Megatron-DeepSpeed's GPTModelPipe that mt reads")
    return out


def _mt_names(client: Mapping[str, Any], root: Path) -> dict[str, str]:
    """mt's name of each parameter DeepSpeed named otherwise (``mt_names`` of a checkpoint
    of mt's pipeline stages: ``3.attn.qkv.weight`` -> ``blocks.2.attn.qkv.weight``)."""
    names = client.get("mt_names", {})
    if not isinstance(names, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in names.items()):
        raise ConvertError(f"{root}: the model-states file's mt_names is not a mapping of "
                           "names to names")
    return names


class DeepSpeedUniversalReader(CheckpointReader):
    """The fp32 master weights of a DeepSpeed universal checkpoint of mt's GPT.

    ``model`` supplies what the tensors cannot (see the module docstring). Opening checks
    every parameter folder against the model (missing, unexpected, shape) through
    memory-mapped loads; :meth:`read` returns the full tensor; :meth:`read_state` reads
    ``exp_avg`` / ``exp_avg_sq`` / ``step`` the same way."""

    format = DEEPSPEED_FORMAT

    def __init__(self, root: Path,
                 model: GPTConfig | str | Mapping[str, Any] | None = None) -> None:
        self.root = universal_folder(Path(root))
        zero = self.root / ZERO_DIR
        folders = sorted(p.name for p in zero.iterdir() if p.is_dir())
        client = _client_state(self.root)
        mds = _megatron_deepspeed_names(folders, self.root)
        renamed = mds or _mt_names(client, self.root)
        self._per_head_qkv = bool(mds)  # Megatron's [heads, 3, head_dim] rows
        self._stored = {renamed.get(name) or name.removeprefix(_PREFIX): name
                        for name in folders}
        self._params = {name: _load_param(zero / stored / FP32_FILE, name)
                        for name, stored in self._stored.items()}
        shapes = {name: tuple(t.shape) for name, t in self._params.items()}
        dims = client.get("checkpoint_parallel_dimensions")
        tp = dims.get("tp_degree", 1) if isinstance(dims, dict) else 1
        if tp != 1 and not client.get(UNIVERSAL_INFO):
            raise ConvertError(f"{self.root}: made from a tensor-parallel degree {tp} "
                               f"checkpoint without {UNIVERSAL_INFO} (--inject_missing_state): its "
                               "slices were joined without their rules (replicated, row, "
                               "fused blocks, padded vocabulary); convert a checkpoint that "
                               "carries them (mt pretrain --engine deepspeed writes them)")
        self._roles: dict[bool, dict[str, Any]] | None = None  # on first use
        self._client = client
        self.config = resolve_config(model, self.root, shapes, client)
        self._shapes = canonical_shapes(self.config)
        missing = sorted(set(self._shapes) - set(self._params))
        extra = sorted(set(self._params) - set(self._shapes))
        if missing or extra:
            raise ConvertError(f"{zero}: parameters do not match mt's GPT: missing {missing}, "
                               f"unexpected {extra}")
        for name, shape in self._shapes.items():
            if shapes[name] != shape:
                raise ConvertError(f"{self._file(name)}: tensor {name!r} has shape "
                                   f"{list(shapes[name])}, the model config needs "
                                   f"{list(shape)}")

    def _file(self, name: str, state: str = "fp32") -> Path:
        return self.root / ZERO_DIR / self._stored[name] / f"{state}.pt"

    def names(self) -> list[str]:
        return list(self._shapes)

    def spec(self, name: str) -> TensorSpec:
        return TensorSpec(self._shapes[name], self._params[name].dtype)

    def sources(self, name: str) -> list[TensorRef]:
        file = self._file(name).relative_to(self.root).as_posix()
        return [TensorRef(file, "param", self.spec(name))]

    def _mt_layout(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Megatron's per-head ``query_key_value`` rows in mt's [q; k; v] order."""
        if self._per_head_qkv and ".attn.qkv." in name:
            return _from_megatron_qkv(tensor, self.config.n_heads)
        return tensor.contiguous()

    def read(self, name: str) -> torch.Tensor:
        return self._mt_layout(name, self._params[name])

    def read_state(self, name: str, key: str) -> torch.Tensor:
        """Optimizer state ``key`` (``exp_avg``, ``exp_avg_sq``: full tensors shaped like
        the parameter; ``step``: a scalar) of parameter ``name``."""
        path = self._file(name, key)
        if key == "step":
            value = load_weights_only(path, missing=f"file not found (tensor {name!r})")
            return torch.tensor(adam_step(value, f"{path}: tensor {name!r}"))
        tensor = _load_param(path, name)
        if tuple(tensor.shape) != self._shapes[name]:
            raise ConvertError(f"{path}: tensor {name!r} has shape {list(tensor.shape)}, "
                               f"the parameter has {list(self._shapes[name])}")
        return self._mt_layout(name, tensor)

    def optimizer_state(self, name: str) -> dict[str, torch.Tensor] | None:
        """Adam's ``exp_avg``, ``exp_avg_sq`` and ``step`` of ``name`` (None when the
        universal folder holds no moments for it)."""
        if not self._file(name, "exp_avg").is_file():
            return None
        return {key: self.read_state(name, key) for key in ("exp_avg", "exp_avg_sq", "step")}

    def optimizer_settings(self, name: str) -> dict[str, Any] | None:
        """The hyperparameters of ``name``'s param group from ``zero/optimizer_state.pt``
        (the engine's param groups, which do not say which parameters each holds:
        :func:`~mt_formats.adam.two_groups`); None where the folder has none or groups
        them otherwise."""
        if not self._file(name, "exp_avg").is_file():  # no state (optimizer_state's test)
            return None
        if self._roles is None:
            path = self.root / ZERO_DIR / OPTIMIZER_STATE
            data = (load_weights_only(path, missing="file not found",
                                      allowed=_OPTIMIZER_GLOBALS) if path.is_file() else {})
            groups = data.get("param_groups") if isinstance(data, dict) else None
            valid = isinstance(groups, list) and all(isinstance(g, dict) for g in groups)
            self._roles = (two_groups(groups, f"{path}: param_groups") if valid else None) or {}
        return self._roles.get(decays(self._shapes[name]))

    def progress(self) -> TrainingProgress | None:
        """The engine's ``global_steps`` and, as tokens, its ``global_samples`` x the
        model's sequence length (the run's tokens where it trained at that length: DeepSpeed
        does not record the length it trained at), from the model-states file; None where
        it holds no step count."""
        client = self._client
        if "global_steps" not in client:
            return None
        samples = client.get("global_samples")
        tokens = samples * self.config.seq_len if isinstance(samples, int) else None
        where = next(iter(sorted(self.root.glob(MODEL_STATES))), self.root)
        return TrainingProgress.checked(("global_steps", client["global_steps"]),
                                        ("global_samples x seq_len", tokens), str(where))

    def close(self) -> None:
        self._params.clear()
