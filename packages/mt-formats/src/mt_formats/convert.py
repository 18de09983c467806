"""Conversions between checkpoint formats, and saving / loading models in them.

Formats: ``"consolidated"`` (one full safetensors file, :mod:`mt_formats.consolidated`),
``"hf"`` (Hugging Face GPT-2, :mod:`mt_formats.hf`), ``"dcp"`` (torch Distributed
Checkpoint folders, :mod:`mt_formats.dcp`), ``"mcore"`` (Megatron-core ``torch_dist``,
:mod:`mt_formats.mcore`), ``"tp"`` (one file per pipeline stage
x tensor-parallel rank, :mod:`mt_formats.sharded`), ``"megatron"`` (Megatron-LM style
``iter_XXXXXXX/mp_rank_XX[_YYY]``, :mod:`mt_formats.megatron`), ``"pretrain"`` (``mt
pretrain`` checkpoints, :mod:`mt_formats.pretrain`, written by
:mod:`mt_formats.pretrain_from_weights`) and, read only, ``"deepspeed"`` (DeepSpeed universal
checkpoints, :mod:`mt_formats.deepspeed_universal`). Every conversion
streams canonical tensors one at a time from a reader to a writer inside an atomic staging
directory."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mt_formats.atomic import atomic_directory, check_destination
from mt_formats.canonical import (
    CheckpointReader,
    CheckpointWriter,
    Deferred,
    Pieces,
    ProgressFn,
    Streamed,
    TensorRef,
    canonical_shapes,
)
from mt_formats.consolidated import CONSOLIDATED_FORMAT, ConsolidatedReader, ConsolidatedWriter
from mt_formats.dcp_files import DCP_FORMAT, MCORE_FORMAT, is_dcp_checkpoint, is_mcore_checkpoint
from mt_formats.deepspeed_universal import DeepSpeedUniversalReader, is_deepspeed_checkpoint
from mt_formats.errors import ConvertError, WriteFailed, gpt2_only
from mt_formats.gguf_file import GGUF_FORMAT, GGUFReader, GGUFWriter
from mt_formats.hf import HFWriter, open_hf
from mt_formats.hf_llama import LlamaWriter, is_llama
from mt_formats.manifest import CONFIG_FILE, read_json
from mt_formats.megatron import LATEST_FILE, MegatronWriter
from mt_formats.pretrain import PretrainReader, is_pretrain_checkpoint
from mt_formats.pretrain_from_weights import PretrainWriter
from mt_formats.pretrain_relayout import PretrainTarget, convert_pretrain
from mt_formats.sharded import SHARDED_FORMAT, ShardedReader, ShardedWriter
from mt_formats.spans import read_ahead
from mt_formats.tensors import TensorSpec, check_names
from mt_model import GPT, GPTConfig
from mt_tensor_parallel import DEFAULT_PAD_MULTIPLE

__all__ = [
    "FORMATS",
    "ConversionResult",
    "MappingEntry",
    "check_options",
    "check_paths",
    "convert_checkpoint",
    "detect_format",
    "load_model",
    "load_state_dict",
    "make_writer",
    "open_checkpoint",
    "plan_conversion",
    "save_model",
    "save_state_dict",
]

#: The largest --pad-multiple (Megatron-LM pads to 128 x tp).
MAX_PAD_MULTIPLE = 2**16
FORMATS: tuple[str, ...] = ("consolidated", "hf", "tp", "megatron", "pretrain", "dcp",
                             "mcore", "gguf", "deepspeed")


if TYPE_CHECKING:  # imported on use (_on_use); named here for tools (Pants' dependencies)
    import mt_formats.dcp
    import mt_formats.mcore
    import mt_formats.megatron_mcore  # noqa: F401


def _on_use(module: str, name: str) -> Callable[..., Any]:
    """``module.name``, imported when first called: the DCP and Megatron-core formats need
    ``torch.distributed.checkpoint``, which takes about a second to import."""
    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args)
    return call


DCPReader = _on_use("mt_formats.dcp", "DCPReader")
DCPWriter = _on_use("mt_formats.dcp", "DCPWriter")
McoreReader = _on_use("mt_formats.mcore", "McoreReader")
McoreWriter = _on_use("mt_formats.mcore", "McoreWriter")
#: Megatron-LM's per-rank files: of a Megatron-core model, or of its older GPT-2 modules.
open_megatron = _on_use("mt_formats.megatron_mcore", "open_megatron")
_READERS: dict[str, Callable[[Path], CheckpointReader]] = {
    "consolidated": ConsolidatedReader,
    "hf": open_hf,
    "tp": ShardedReader,
    "megatron": open_megatron,
    "pretrain": PretrainReader,
    "dcp": DCPReader,
    "mcore": McoreReader,
    "gguf": GGUFReader,
    "deepspeed": DeepSpeedUniversalReader,
}
_WRITABLE = ("consolidated", "hf", "tp", "megatron", "pretrain", "dcp", "mcore", "gguf")
#: Formats that may record no model config: ``--model`` gives it.
_NEEDS_MODEL = {"deepspeed": DeepSpeedUniversalReader, "dcp": DCPReader, "mcore": McoreReader}


def detect_format(path: Path) -> str:
    """``"consolidated"``, ``"tp"`` or ``"hf"`` from ``path/config.json``; ``"megatron"``
    (``latest_checkpointed_iteration.txt``), ``"mcore"`` (``metadata.json`` of the
    ``torch_dist`` backend), ``"dcp"`` (``.metadata``), ``"gguf"`` (``model.gguf`` or a
    ``.gguf`` file) or ``"pretrain"`` (``mt pretrain``'s ``meta.json`` or ``latest``)."""
    path = Path(path)
    if path.suffix == ".gguf" and path.is_file() or (path / "model.gguf").is_file():
        return GGUF_FORMAT
    _check_folder(path)
    if (path / LATEST_FILE).is_file():
        return "megatron"
    if is_mcore_checkpoint(path):  # before dcp: a Megatron-core folder is a DCP folder too
        return MCORE_FORMAT
    if is_dcp_checkpoint(path):
        return DCP_FORMAT
    if is_deepspeed_checkpoint(path):  # before pretrain: both may have `latest`
        return "deepspeed"
    if is_pretrain_checkpoint(path):
        return "pretrain"
    data = read_json(path / CONFIG_FILE)
    if data.get("format") == CONSOLIDATED_FORMAT:
        return "consolidated"
    if data.get("format") == SHARDED_FORMAT:
        return "tp"
    if "model_type" in data:
        return "hf"
    raise ConvertError(f"{path / CONFIG_FILE}: not an mt or Hugging Face checkpoint config "
                       "(no 'format' or 'model_type' key)")


_EXPECTED = ("a folder holding config.json (mt consolidated or tp, Hugging Face GPT-2 or "
             "Llama), latest_checkpointed_iteration.txt (Megatron-LM), metadata.json and "
             ".metadata (Megatron-core), .metadata (torch DCP), model.gguf (or a .gguf file), "
             "meta.json or latest (mt pretrain) or zero/ (DeepSpeed universal)")


def _check_folder(path: Path) -> None:
    """A one-line :class:`ConvertError` when ``path`` is not a folder (or a ``.gguf`` file):
    not found, or a file (naming what a checkpoint is and, for a file of one, its folder)."""
    if path.is_dir() or (path.suffix == ".gguf" and path.is_file()):
        return
    if not path.exists():
        raise ConvertError(f"{path}: checkpoint directory not found")
    hint = ""
    markers = (CONFIG_FILE, LATEST_FILE, "meta.json", "latest", ".metadata")
    if path.parent != path and any((path.parent / name).is_file() for name in markers):
        hint = f"; give the folder {path.parent}, which holds it"
    raise ConvertError(f"{path} is a file, not a checkpoint folder: mt convert reads "
                       f"{_EXPECTED}{hint}")


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ConvertError(f"unknown checkpoint format {fmt!r}; known: {list(FORMATS)}")


def open_checkpoint(path: Path, fmt: str | None = None,
                    model: GPTConfig | str | None = None) -> CheckpointReader:
    """Open (and structurally validate) the checkpoint at ``path``; ``fmt`` None detects."""
    fmt = detect_format(path) if fmt is None else fmt
    _check_format(fmt)
    _check_folder(Path(path))
    if model is not None:  # only DeepSpeed, DCP and Megatron-core folders may lack one
        if fmt not in _NEEDS_MODEL:
            raise ConvertError(f"--model only applies to deepspeed, dcp and mcore sources, "
                               f"not {fmt!r}")
        return _NEEDS_MODEL[fmt](Path(path), model)
    return _READERS[fmt](Path(path))


def make_writer(fmt: str, config: GPTConfig, specs: Mapping[str, TensorSpec],
                tp: int | None = None, pp: int | None = None,
                pad_multiple: int | None = None, gguf_type: str | None = None
                ) -> CheckpointWriter:
    """A writer for ``fmt``. ``tp`` / ``pp`` / ``pad_multiple`` apply to the sharded
    ``"tp"`` format (which needs ``tp`` or ``pp``) and ``"megatron"``; unset ones default
    to 1, 1 and 128. ``gguf_type`` (f32, f16, bf16, q8_0; default f16) to ``"gguf"``."""
    _check_format(fmt)
    if gguf_type is not None and fmt != GGUF_FORMAT:
        raise ConvertError(f"--gguf-type only applies to the gguf target, not {fmt!r}")
    if fmt not in _WRITABLE:
        raise ConvertError(f"cannot write the {fmt!r} format; writable: {list(_WRITABLE)}")
    if fmt == "megatron" or (fmt == "hf" and not is_llama(config)):
        gpt2_only(config, f"writing the {fmt!r} format")
    pad = DEFAULT_PAD_MULTIPLE if pad_multiple is None else pad_multiple
    if not 1 <= pad <= MAX_PAD_MULTIPLE:
        raise ConvertError(f"--pad-multiple must be between 1 and {MAX_PAD_MULTIPLE:,} (the "
                           f"vocabulary is padded to a multiple of it x tp), got {pad:,}")
    if fmt == "tp":
        if tp is None and pp is None:
            raise ConvertError("the tp format needs a tensor- or pipeline-parallel degree "
                               "(--tp N and/or --pp N)")
        return ShardedWriter(config, dict(specs), tp or 1, pp or 1, pad)
    if fmt == "megatron":
        return MegatronWriter(config, dict(specs), tp or 1, pp or 1, pad)
    layout = {"--tp": tp, "--pp": pp, "--pad-multiple": pad_multiple}
    for option, value in layout.items():
        if value is not None:
            raise ConvertError(f"{option} {value} only applies to the tp and megatron "
                               f"formats, not {fmt!r}")
    if fmt == "pretrain":
        return PretrainWriter(config, dict(specs))
    if fmt == "consolidated":
        return ConsolidatedWriter(config, dict(specs))
    if fmt == DCP_FORMAT:
        return DCPWriter(config, dict(specs))
    if fmt == MCORE_FORMAT:
        return McoreWriter(config, dict(specs))
    if fmt == GGUF_FORMAT:
        return GGUFWriter(config, dict(specs), gguf_type or "f16")
    return (HFWriter if config.architecture == "gpt2" else LlamaWriter)(config, dict(specs))


@dataclass(frozen=True)
class MappingEntry:
    """One canonical tensor of a conversion: where it is read from and written to."""

    name: str
    sources: tuple[TensorRef, ...]
    targets: tuple[TensorRef, ...]


@dataclass(frozen=True)
class ConversionResult:
    """What a conversion did."""

    source_format: str
    target_format: str
    destination: Path
    tensors: int
    bytes: int
    seconds: float
    tokenizer: str | None = None
    """The tokenizer written beside the weights (hf, gguf), if any."""
    notes: tuple[str, ...] = ()
    """What the user should know about what was written (one line each)."""


def _specs(reader: CheckpointReader) -> dict[str, TensorSpec]:
    return {name: reader.spec(name) for name in reader.names()}


def plan_conversion(reader: CheckpointReader, writer: CheckpointWriter) -> list[MappingEntry]:
    """The source -> target tensor mapping (headers only; what ``--dry-run`` prints)."""
    return [MappingEntry(name, tuple(reader.sources(name)), tuple(writer.targets(name)))
            for name in reader.names()]


def _stream(names: list[str], get: Callable[[str], _Read]) -> Iterator[tuple[str, _Read]]:
    """``(name, get(name))`` in order, reading (and checksum-verifying) the next tensor in a
    background thread while the caller writes the current one: hashing and file I/O
    release the GIL, so reading and writing overlap. At most two tensors are alive. After
    a :class:`Streamed` tensor, whose reader reads ahead by itself, the next is asked for
    in the caller's thread."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mt-convert-read") as pool:
        pending: Future[_Read] | None = None
        try:
            for index, name in enumerate(names):
                tensor = get(name) if pending is None else pending.result()
                pending = None
                if index + 1 < len(names) and not isinstance(tensor, Streamed):
                    pending = pool.submit(_fetch, get, names[index + 1])
                yield name, tensor
                del tensor
        finally:
            if pending is not None:
                pending.cancel()


def _fetch(get: Callable[[str], _Read], name: str) -> _Read:
    item = get(name)
    if isinstance(item, Pieces):  # copied by the writer: have the kernel read them now
        read_ahead(item.spans)
    return item


_Read = tuple[torch.Tensor, Deferred | None] | Pieces | Streamed


def _write(writer: CheckpointWriter, names: list[str], get: Callable[[str], _Read],
           destination: Path, overwrite: bool, progress: ProgressFn | None) -> int:
    """Stream every tensor through ``writer`` into an atomic ``destination``; bytes moved.
    ``get`` returns a tensor and, if it was read unverified, its verification: called
    after the write with the checksum the writer computed, so verified bytes are hashed
    once when the writer could. Operating-system failures (disk full, permissions) become
    a :class:`ConvertError`."""
    total_bytes = 0
    try:
        with atomic_directory(destination, overwrite) as staging:
            writer.open(staging)
            try:
                for done, (name, item) in enumerate(_stream(names, get), 1):
                    if isinstance(item, Streamed):  # read, verified by the reader
                        writer.write_streamed(name, item)
                        total_bytes += item.spec.nbytes
                        if progress is not None:
                            progress(name, done, len(names))
                        continue
                    if isinstance(item, Pieces):  # byte ranges of the source files
                        item.verify(writer.write_pieces(name, item))
                        total_bytes += item.spec.nbytes
                        if progress is not None:
                            progress(name, done, len(names))
                        continue
                    tensor, verify = item
                    if verify is None:
                        writer.write(name, tensor)
                    else:  # a failure discards everything written
                        spanned = verify.span is not None and verify.span.length == (
                            tensor.numel() * tensor.element_size())
                        verify.verify(writer.write_from(name, tensor, verify.span) if spanned
                                      else writer.write(name, tensor))
                    total_bytes += tensor.numel() * tensor.element_size()
                    del tensor  # keep peak memory near two tensors (plus shards)
                    if progress is not None:
                        progress(name, done, len(names))
                writer.finish()
            except BaseException:
                writer.abort()
                raise
    except OSError as err:
        raise WriteFailed(f"{destination}: writing failed, nothing was written: "
                           f"{err}") from err
    return total_bytes


def check_paths(source: Path, destination: Path, overwrite: bool) -> None:
    """A one-line :class:`ConvertError` when ``destination`` is, holds or lies inside
    ``source``, or cannot be written (:func:`~mt_formats.atomic.check_destination`)."""
    src, dst = Path(source).resolve(), Path(destination).resolve()
    if dst == src or dst in src.parents or src in dst.parents:
        how = "is" if dst == src else "holds" if dst in src.parents else "lies inside"
        raise ConvertError(f"{destination}: the destination {how} the source checkpoint "
                           f"{source}; choose a destination outside it")
    check_destination(Path(destination), overwrite)


def convert_checkpoint(source: Path, destination: Path, *, to: str = "consolidated",
                       from_format: str | None = None, tp: int | None = None,
                       pp: int | None = None, pad_multiple: int | None = None,
                       overwrite: bool = False, progress: ProgressFn | None = None,
                       model: GPTConfig | str | None = None, dp: int | None = None,
                       zero_stage: int | None = None, drop_optimizer: bool = False,
                       tokenizer: str | None = None, gguf_type: str | None = None
                       ) -> ConversionResult:
    """Convert the checkpoint at ``source`` into format ``to`` at ``destination``.

    Streams tensor by tensor; ``destination`` appears only when everything succeeded (an
    existing one is replaced only with ``overwrite``). ``to="pretrain"`` from an ``mt
    pretrain`` checkpoint writes a step folder at layout ``tp`` x ``pp`` x ``dp`` with
    ZeRO stage ``zero_stage`` (unset ones keep the source's), optimizer state included
    unless ``drop_optimizer``; from other formats it carries Adam's state where the source
    holds one (pretrain, DCP, DeepSpeed universal, Megatron-core's distributed optimizer in
    a ``torch_dist`` folder or Megatron-LM's ``distrib_optim.pt``) and the target can
    (pretrain, DCP, mcore),
    unless ``drop_optimizer``. ``tokenizer`` (default: the one the source records) is
    written beside Hugging Face weights and into GGUF files; ``gguf_type`` is the GGUF
    target's matrix type. Raises :class:`ConvertError`.
    """
    source, destination = Path(source), Path(destination)
    check_paths(source, destination, overwrite)  # fail before reading anything
    relayout = check_options(source, to, from_format, pad_multiple=pad_multiple, dp=dp,
                             zero_stage=zero_stage, drop_optimizer=drop_optimizer,
                             model=model, tokenizer=tokenizer, gguf_type=gguf_type)
    if relayout:
        return _to_pretrain(source, destination, overwrite, progress,
                            PretrainTarget(tp, pp, dp, zero_stage, drop_optimizer))
    start = time.perf_counter()
    with open_checkpoint(source, from_format, model) as reader:
        writer = make_writer(to, reader.config, _specs(reader), tp, pp, pad_multiple,
                             gguf_type)
        writer.tokenizer = tokenizer or _source_tokenizer(reader, writer)
        if writer.holds_optimizer_state and not drop_optimizer:
            writer.state_source = reader  # Adam's state, where the source holds it
        get: Callable[[str], _Read] = reader.read_deferred
        if writer.accepts_pieces:  # tensors stored as-is go file to file
            get = lambda name: reader.read_pieces(name) or reader.read_deferred(name)  # noqa: E731
        elif writer.accepts_streams:  # sliced by the writer as the chunks come
            get = lambda name: reader.read_stream(name) or reader.read_deferred(name)  # noqa: E731
        moved = _write(writer, reader.names(), get, destination, overwrite, progress)
        return ConversionResult(reader.format, writer.format, destination,
                                len(reader.names()), moved, time.perf_counter() - start,
                                writer.tokenizer, (*reader.notes, *writer.notes,
                                                   *_leftovers(destination)))


def check_options(source: Path, to: str, from_format: str | None, *,
                  pad_multiple: int | None = None, dp: int | None = None,
                  zero_stage: int | None = None, drop_optimizer: bool = False,
                  model: GPTConfig | str | None = None, tokenizer: str | None = None,
                  gguf_type: str | None = None) -> bool:
    """A one-line :class:`ConvertError` for options the conversion of ``source`` to ``to``
    would not use or cannot honour (the conversion and its dry run ask the same, before
    reading any tensor); a ``tokenizer`` is loaded, so that a bad one fails here, not after
    the weights are written. Returns whether it is mt pretrain -> pretrain (a relayout)."""
    if tokenizer is not None and to not in ("hf", GGUF_FORMAT):
        raise ConvertError(f"--tokenizer only applies to the hf and gguf targets, not {to!r}")
    if gguf_type is not None and to != GGUF_FORMAT:
        raise ConvertError(f"--gguf-type only applies to the gguf target, not {to!r}")
    if to == "pretrain" and (from_format or detect_format(source)) == "pretrain":
        if pad_multiple is not None:
            raise ConvertError("--pad-multiple does not apply to the pretrain format (mt "
                               "pretrain pads the vocabulary itself)")
        if model is not None:
            raise ConvertError("--model does not apply to an mt pretrain source: its "
                               "meta.json records the model")
        return True
    if dp is not None or zero_stage is not None:
        raise ConvertError("--dp and --zero-stage only apply from an mt pretrain checkpoint "
                           f"to the pretrain format, not to {to!r}")
    if drop_optimizer and to not in ("pretrain", DCP_FORMAT, MCORE_FORMAT):
        raise ConvertError("--drop-optimizer only applies to the formats that hold optimizer "
                           f"state (pretrain, dcp, mcore), not to {to!r}")
    if to not in _WRITABLE:
        raise ConvertError(f"cannot write the {to!r} format; writable: {list(_WRITABLE)}")
    if tokenizer is not None:
        from mt_formats.hf_tokenizer import load_named_tokenizer

        load_named_tokenizer(tokenizer)
    return False


def _source_tokenizer(reader: CheckpointReader, writer: CheckpointWriter) -> str | None:
    """The source's tokenizer for a target that stores one, where mt can load it (else
    None, with a note saying why: the conversion goes on without it)."""
    if reader.tokenizer is None or writer.format not in ("hf", GGUF_FORMAT):
        return reader.tokenizer
    from mt_formats.hf_tokenizer import load_named_tokenizer

    try:
        loaded = load_named_tokenizer(reader.tokenizer)
    except ConvertError as err:
        writer.notes.append(f"the source's tokenizer is not written ({err}); pass --tokenizer")
        return None
    if loaded.vocab_size > reader.config.vocab_size:
        writer.notes.append(f"the source's tokenizer is not written: its {loaded.vocab_size} "
                            f"ids are more than the model's vocabulary of "
                            f"{reader.config.vocab_size}; pass --tokenizer")
        return None
    return reader.tokenizer


def _leftovers(destination: Path) -> tuple[str, ...]:
    """A note naming the unfinished folders of conversions to ``destination`` that were
    killed (``.NAME.partial-*``, ``.NAME.old-*`` beside it), which nothing removes: mt
    does not delete them itself (another conversion to the same place may be writing one)."""
    found = sorted(path for pattern in (".partial-*", ".old-*")
                   for path in destination.parent.glob(f".{destination.name}{pattern}"))
    if not found:
        return ()
    size = 0
    for path in found:
        for file in path.rglob("*"):
            try:
                size += file.stat().st_size if file.is_file() else 0
            except OSError:  # removed meanwhile by the conversion writing it
                pass
    return (f"{len(found)} unfinished folder(s) of earlier conversions to {destination.name} "
            f"lie beside it ({found[0].name}{', ...' if len(found) > 1 else ''}; "
            f"{size / 2**20:.1f} MiB), left by a conversion that was killed or written by "
            "one running now; delete them once no other conversion to it is running",)


def _to_pretrain(source: Path, destination: Path, overwrite: bool,
                 progress: ProgressFn | None, target: PretrainTarget) -> ConversionResult:
    """pretrain -> pretrain at another layout, optimizer state carried (or dropped)."""
    start = time.perf_counter()
    fmt, count, moved = convert_pretrain(source, destination, target, overwrite, progress)
    return ConversionResult(fmt, "pretrain", destination, count, moved,
                            time.perf_counter() - start, notes=_leftovers(destination))


def save_state_dict(state_dict: Mapping[str, torch.Tensor], config: GPTConfig,
                    destination: Path, *, to: str = "consolidated", tp: int | None = None,
                    pp: int | None = None, pad_multiple: int | None = None,
                    overwrite: bool = False, progress: ProgressFn | None = None,
                    gguf_type: str | None = None, tokenizer: str | None = None) -> Path:
    """Save an unsharded ``mt_model.GPT`` state dict in format ``to`` (atomically);
    ``gguf_type`` and ``tokenizer`` as :func:`convert_checkpoint`'s."""
    shapes = canonical_shapes(config)
    check_names(Path(destination), list(state_dict), list(shapes))
    for name, shape in shapes.items():
        if tuple(state_dict[name].shape) != shape:
            raise ConvertError(f"tensor {name!r} has shape {list(state_dict[name].shape)}, "
                               f"the config needs {list(shape)}")
    specs = {name: TensorSpec.of(state_dict[name]) for name in shapes}
    writer = make_writer(to, config, specs, tp, pp, pad_multiple, gguf_type)
    writer.tokenizer = tokenizer
    _write(writer, list(shapes), lambda n: (state_dict[n].detach(), None), Path(destination),
           overwrite, progress)
    return Path(destination)


def save_model(model: GPT, destination: Path, **options: object) -> Path:
    """Save an unsharded ``mt_model.GPT``; options as :func:`save_state_dict`."""
    return save_state_dict(model.state_dict(), model.config, destination, **options)


def load_state_dict(source: Path, fmt: str | None = None
                    ) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The config and full canonical state dict of any supported checkpoint (verified)."""
    with open_checkpoint(source, fmt) as reader:
        return reader.config, {name: reader.read(name) for name in reader.names()}


def load_model(source: Path, fmt: str | None = None) -> GPT:
    """An ``mt_model.GPT`` with the weights of any supported checkpoint, in the dtype of
    its token embedding."""
    config, state = load_state_dict(source, fmt)
    model = GPT(config, seed=None).to(state["embed.tokens.weight"].dtype)
    model.load_state_dict(state, strict=True)
    return model
