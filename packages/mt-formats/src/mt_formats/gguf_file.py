"""GGUF, llama.cpp's single-file format, through the ``gguf`` package (``mt-formats[gguf]``).

Written (``--to gguf``): ``DST/model.gguf`` for llama.cpp's ``gpt2`` architecture (GPT-2
blocks) or ``llama`` (mt's Llama family), with the tensor names and metadata keys of
llama.cpp's own converter (``convert_hf_to_gguf.py``): ``token_embd``, ``position_embd``,
``blk.N.attn_norm``, ``attn_qkv`` (GPT-2) or ``attn_q`` / ``attn_k`` / ``attn_v`` (Llama),
``attn_output``, ``ffn_norm``, ``ffn_up`` (+ ``ffn_gate``), ``ffn_down``, ``output_norm``,
``output`` (an untied head; a tied one is ``token_embd``, as llama.cpp falls back to). As
that converter does, Llama's ``attn_q`` / ``attn_k`` rows are permuted per head to the
adjacent-pair RoPE order llama.cpp computes. Matrices are stored as ``--gguf-type`` (f32,
f16, bf16 or q8_0: blocks of 32 int8 with one f16 scale; a matrix whose rows are not a
multiple of 32 stays f16, named in a note, and ``general.file_type`` is the type holding most
of the matrices' values), vectors (norms, biases) as f32; a value the type would store as
inf (beyond f16's 65504) is refused, and so is an inf or nan in q8_0 (its whole block would
read nan). The tokenizer (a byte-level BPE, as mt's are) goes in as
``tokenizer.ggml.model = gpt2``. mt's whole config rides along under ``mt.config`` (JSON),
so mt reads its own files back without guessing; GGUF has no checksums, so ``mt.json``
beside ``model.gguf`` records the CRC-32C of every tensor's stored bytes and, under
``header``, of the bytes before them (header, key/values, tensor table), checked when mt
reads the folder (a ``mt.json`` without ``header``, as mt wrote before, still reads).

Read: ``model.gguf`` (or any ``.gguf`` file) of those two architectures, also as llama.cpp's
converter writes them (config from the ``gpt2.*`` / ``llama.*`` keys; RoPE scaling or RoPE on
part of each head, which mt does not compute, is refused naming the key), every tensor
dequantised by ``gguf.quants`` (q8_0 -> f32; f32 / f16 / bf16 exactly as stored). Tensors
are streamed: the header is written from the specs, then each tensor as it arrives.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mt_formats.canonical import CheckpointReader, CheckpointWriter, TensorRef, canonical_shapes
from mt_formats.crc import CHECKSUM_ALGORITHM, algorithm_of, digest
from mt_formats.dcp_files import SIDECAR, read_sidecar, write_sidecar
from mt_formats.dcp_names import from_interleaved, to_interleaved
from mt_formats.errors import ConvertError
from mt_formats.hf_llama import is_llama
from mt_formats.tensors import TensorSpec
from mt_model import GPTConfig

__all__ = ["GGUF_FILE", "GGUF_FORMAT", "GGUF_TYPES", "GGUFReader", "GGUFWriter", "gguf_file",
           "gguf_parts"]

GGUF_FORMAT = "gguf"
GGUF_FILE = "model.gguf"
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
MT_CONFIG_KEY = "mt.config"
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
_GPT2 = {"ln1": "attn_norm", "attn.qkv": "attn_qkv", "attn.proj": "attn_output",
         "ln2": "ffn_norm", "mlp.fc": "ffn_up", "mlp.proj": "ffn_down"}
_LLAMA = {"ln1": "attn_norm", "attn.proj": "attn_output", "ln2": "ffn_norm",
          "mlp.proj": "ffn_down"}
_TOP = {"embed.tokens.weight": "token_embd.weight", "embed.positions.weight":
        "position_embd.weight", "ln_f.weight": "output_norm.weight",
        "ln_f.bias": "output_norm.bias", "head.weight": "output.weight"}


def _gguf() -> Any:
    try:
        import gguf  # pants: no-infer-dep (optional: mt-formats[gguf])
    except ImportError:
        raise ConvertError("the gguf format needs the gguf package: pip install "
                           "'mt-formats[gguf]'") from None
    return gguf


def gguf_parts(name: str, config: GPTConfig) -> list[tuple[str, int, int]]:
    """(GGUF tensor name, rows, heads to permute to adjacent-pair RoPE order or 0) of each
    stored tensor whose row concatenation is canonical tensor ``name``."""
    if name in _TOP:
        return [(_TOP[name], -1, 0)]
    match = _BLOCK.match(name)
    if match:
        layer, rest = match.groups()
        module, _, leaf = rest.rpartition(".")
        prefix = f"blk.{layer}."
        if not is_llama(config) and module in _GPT2:
            return [(f"{prefix}{_GPT2[module]}.{leaf}", -1, 0)]
        if is_llama(config):
            if module in _LLAMA:
                return [(f"{prefix}{_LLAMA[module]}.{leaf}", -1, 0)]
            q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
            splits = {"attn.qkv": [("attn_q", q, config.n_heads), ("attn_k", kv, config.n_kv_heads),
                                   ("attn_v", kv, 0)],
                      "attn.q": [("attn_q", -1, config.n_heads)],
                      "attn.kv": [("attn_k", kv, config.n_kv_heads), ("attn_v", kv, 0)],
                      "mlp.fc": [("ffn_gate", config.ffn_hidden, 0),
                                 ("ffn_up", config.ffn_hidden, 0)]}.get(module)
            if splits is not None:
                return [(f"{prefix}{key}.{leaf}", rows, heads) for key, rows, heads in splits]
    raise ConvertError(f"tensor {name!r} has no GGUF ({'llama' if is_llama(config) else 'gpt2'}"
                       ") equivalent")


def _architecture(config: GPTConfig) -> str:
    if is_llama(config):
        return "llama"
    if config.architecture == "gpt2":
        return "gpt2"
    raise ConvertError(f"the gguf format writes llama.cpp's gpt2 or llama architectures; this "
                       f"model's block ({config.architecture}) is neither")


class GGUFWriter(CheckpointWriter):
    """Streams canonical tensors into ``model.gguf`` (see the module docstring)."""

    format = GGUF_FORMAT

    def __init__(self, config: GPTConfig, specs: dict[str, TensorSpec],
                 gguf_type: str = "f16") -> None:
        super().__init__(config, specs)
        if gguf_type not in GGUF_TYPES:
            raise ConvertError(f"--gguf-type {gguf_type!r}: one of {list(GGUF_TYPES)}")
        self.arch = _architecture(config)
        self.gguf_type = gguf_type
        self._gguf = _gguf()
        self._parts = {name: gguf_parts(name, config) for name in self.specs}
        self._order = [key for name in self.specs for key, _, _ in self._parts[name]]
        self._shapes = {key: self._shape(name, rows) for name in self.specs
                        for key, rows, _ in self._parts[name]}
        self._writer: Any = None
        self._waiting: dict[str, np.ndarray] = {}
        self._next = 0
        self._checksums: dict[str, str] = {}
        self._directory: Path | None = None
        self._header_bytes = 0  # header, key/values and tensor table, padded to the data
        self._rounded: set[torch.dtype] = set()  # source dtypes stored in fewer bits

    def _shape(self, name: str, rows: int) -> tuple[int, ...]:
        shape = self.specs[name].shape
        return (shape[0] if rows < 0 else rows, *shape[1:])

    def qtype(self, shape: tuple[int, ...]) -> Any:
        """The GGML type a tensor of ``shape`` is stored as."""
        types = self._gguf.GGMLQuantizationType
        if len(shape) < 2 or self.gguf_type == "f32":
            return types.F32
        if self.gguf_type == "q8_0" and shape[-1] % 32:
            return types.F16  # q8_0 blocks run along rows of 32
        return {"f16": types.F16, "bf16": types.BF16, "q8_0": types.Q8_0}[self.gguf_type]

    def _file_type(self) -> Any:
        """``general.file_type``: the GGML type that holds most of the matrices' values."""
        sizes: dict[str, int] = {}
        for shape in self._shapes.values():
            if len(shape) >= 2:
                kind = self.qtype(shape).name
                sizes[kind] = sizes.get(kind, 0) + int(np.prod(shape))
        types = self._gguf.LlamaFileType
        return {"F32": types.ALL_F32, "F16": types.MOSTLY_F16, "BF16": types.MOSTLY_BF16,
                "Q8_0": types.MOSTLY_Q8_0}[max(sizes, key=sizes.__getitem__, default="F32")]

    def _fallbacks(self) -> list[str]:
        """The matrices ``--gguf-type q8_0`` stores as f16 (``blk.*`` for every layer's)."""
        if self.gguf_type != "q8_0":
            return []
        keys = [re.sub(r"^blk\.\d+\.", "blk.*.", key) for key, shape in self._shapes.items()
                if len(shape) >= 2 and self.qtype(shape).name == "F16"]
        return list(dict.fromkeys(keys))

    def targets(self, name: str) -> list[TensorRef]:
        refs = []
        for key, _, heads in self._parts[name]:
            shape = self._shapes[key]
            transform = " ".join(filter(None, [f"interleave {heads}" if heads else "",
                                               self.qtype(shape).name]))
            refs.append(TensorRef(GGUF_FILE, key, TensorSpec(shape, torch.float32), transform))
        return refs

    def open(self, directory: Path) -> None:
        gguf = self._gguf
        self._directory = Path(directory)
        writer = gguf.GGUFWriter(self._directory / GGUF_FILE, self.arch)
        config = self.config
        writer.add_name(f"mt {self.arch} {config.n_layers}x{config.hidden}")
        writer.add_context_length(config.seq_len)
        writer.add_embedding_length(config.hidden)
        writer.add_feed_forward_length(config.ffn_hidden)
        writer.add_block_count(config.n_layers)
        writer.add_head_count(config.n_heads)
        if self.arch == "llama":
            writer.add_head_count_kv(config.n_kv_heads)
            writer.add_layer_norm_rms_eps(config.layernorm_eps)
            writer.add_rope_freq_base(config.rope_theta)
            writer.add_rope_dimension_count(config.head_dim)
            writer.add_vocab_size(config.vocab_size)
        else:
            writer.add_layer_norm_eps(config.layernorm_eps)
        writer.add_file_type(int(self._file_type()))
        writer.add_string(MT_CONFIG_KEY, json.dumps(config.to_dict(), sort_keys=True))
        if self.tokenizer is not None:
            _add_tokenizer(writer, self.tokenizer, config.vocab_size)
        for key in self._order:
            shape, qtype = self._shapes[key], self.qtype(self._shapes[key])
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(shape)) // block * size
            writer.add_tensor_info(key, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()  # flushed: tell() is where the header ends
        self._header_bytes = writer.ggml_pad(writer.fout[0].tell(), writer.data_alignment)
        self._writer = writer

    def _encode(self, name: str, key: str, tensor: torch.Tensor) -> np.ndarray:
        qtype = self.qtype(self._shapes[key])
        data = tensor.detach().to(torch.float32).contiguous().numpy()
        _check_range(name, data, qtype.name)
        if tensor.dtype not in _EXACT.get(qtype.name, ()):
            self._rounded.add(tensor.dtype)
        types = self._gguf.GGMLQuantizationType
        if qtype == types.F32:
            return data
        if qtype == types.F16:
            return data.astype(np.float16)
        return self._gguf.quants.quantize(data, qtype)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        assert self._writer is not None, "open() first"
        start = 0
        for key, rows, heads in self._parts[name]:
            count = tensor.shape[0] if rows < 0 else rows
            piece = tensor[start:start + count]
            start += count
            self._waiting[key] = self._encode(name, key, to_interleaved(piece, heads) if heads
                                              else piece)
        while self._next < len(self._order) and self._order[self._next] in self._waiting:
            key = self._order[self._next]
            data = self._waiting.pop(key)
            self._checksums[key] = digest(np.ascontiguousarray(data).view(np.uint8).reshape(-1),
                                          CHECKSUM_ALGORITHM)
            self._writer.write_tensor_data(data)
            self._next += 1  # tensors are written in header order; early ones wait here

    def finish(self) -> None:
        assert self._writer is not None, "open() first"
        if self._next != len(self._order):
            raise ConvertError(f"tensors never written: {self._order[self._next:][:5]}")
        self._writer.close()
        assert self._directory is not None
        with open(self._directory / GGUF_FILE, "rb+") as file:  # durable before it is published
            os.fsync(file.fileno())
            header = digest(file.read(self._header_bytes), CHECKSUM_ALGORITHM)
        write_sidecar(self._directory, {"names": "gguf", "file": GGUF_FILE, "header": header,
                                        "checksums": self._checksums})
        stored = sorted({self.qtype(s).name.lower() for s in self._shapes.values() if len(s) >= 2},
                        key=lambda kind: kind != self.gguf_type)
        if self._rounded:
            dtypes = ", ".join(sorted(str(d).removeprefix("torch.") for d in self._rounded))
            self.notes.append(f"matrices stored as {' / '.join(stored)} (--gguf-type): their "
                              f"{dtypes} values rounded; --gguf-type f32 keeps every value")
        if fallbacks := self._fallbacks():
            self.notes.append(f"--gguf-type q8_0: {', '.join(fallbacks)} stored as f16, not "
                              "q8_0: their rows are not a multiple of q8_0's blocks of 32")
        if self.arch == "gpt2" and self.config.gelu_approximate != "tanh":
            self.notes.append("llama.cpp's gpt2 computes the tanh approximation of GELU; this "
                              "model uses the exact GELU (gelu_approximate "
                              f"{self.config.gelu_approximate!r}), so llama.cpp's logits differ "
                              "from mt's by that much (mt reads its own file back exactly)")

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()


#: The source dtypes each GGML type stores without rounding.
_EXACT = {"F32": (torch.float32, torch.float16, torch.bfloat16), "F16": (torch.float16,),
          "BF16": (torch.bfloat16,)}
_F16_MAX = 65504.0
#: The largest magnitude each GGML type stores finite (q8_0: 127 x its f16 block scale).
_LIMITS = {"F16": _F16_MAX, "Q8_0": 127 * _F16_MAX}


def _check_range(name: str, data: np.ndarray, qtype: str) -> None:
    """Refuse (one line naming the tensor) a finite value that GGML type ``qtype`` would
    store as inf, and an inf or nan in q8_0 (which would make its whole block of 32 nan)."""
    limit = _LIMITS.get(qtype)
    if limit is None or data.size == 0 or max(float(data.max()), -float(data.min())) <= limit:
        return  # nan compares false: a tensor holding one goes on below
    finite = np.isfinite(data)
    if qtype == "Q8_0" and not finite.all():
        raise ConvertError(f"tensor {name!r} holds {data[~finite][0]}, which q8_0 cannot store "
                           "(its block of 32 values would all read nan): --gguf-type f16, "
                           "bf16 or f32 keeps it")
    finite = np.abs(data[finite])  # f16 stores an inf or nan of the source as it is
    if finite.size == 0 or (largest := float(finite.max())) <= limit:
        return
    raise ConvertError(f"tensor {name!r} holds {largest:g}, beyond what {qtype.lower()} stores "
                       f"(|x| <= {limit:g}; it would be inf): --gguf-type f32 or bf16 keeps it")


def _add_tokenizer(writer: Any, tokenizer: str, vocab_size: int) -> None:
    """llama.cpp's ``gpt2`` tokenizer model from a byte-level BPE ``tokenizers`` tokenizer:
    tokens by id (padded with unused tokens up to the model's vocabulary), merges, and the
    end-of-text token as BOS / EOS."""
    from mt_formats.hf_tokenizer import load_named_tokenizer

    gguf = _gguf()
    loaded = load_named_tokenizer(tokenizer)
    body = json.loads(loaded.backend.to_str())
    model = body["model"]
    if model.get("type") != "BPE":
        raise ConvertError(f"tokenizer {tokenizer!r}: a {model.get('type')} model; GGUF export "
                           "writes byte-level BPE tokenizers")
    by_id = {index: token for token, index in model["vocab"].items()}
    for added in body.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
    if max(by_id) >= vocab_size:
        raise ConvertError(f"tokenizer {tokenizer!r} has ids up to {max(by_id)}, the model's "
                           f"vocabulary is {vocab_size}")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED
             for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(loaded.eod_id)  # GPT-2's <|endoftext|>: both, as GPT-2 uses it
    writer.add_eos_token_id(loaded.eod_id)


def gguf_file(path: Path) -> Path:
    """The ``.gguf`` file ``path`` designates: itself, or ``model.gguf`` in a folder."""
    path = Path(path)
    return path / GGUF_FILE if path.is_dir() else path


def _config_from_keys(fields: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                      where: Path) -> GPTConfig:
    """An mt config from llama.cpp's metadata keys (a file mt did not write); what mt cannot
    reproduce (RoPE scaling, RoPE on part of each head) raises :class:`ConvertError` naming
    the key."""
    arch = fields.get("general.architecture")
    if arch not in ("gpt2", "llama"):
        raise ConvertError(f"{where}: architecture {arch!r}; mt reads gpt2 and llama")

    def key(name: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{name}", default)
        if value is None:
            raise ConvertError(f"{where}: no {arch}.{name} key")
        return value

    if "token_embd.weight" not in shapes:
        raise ConvertError(f"{where}: no tensor 'token_embd.weight' (the token embedding, "
                           "whose rows give the vocabulary size)")
    common: dict[str, Any] = {
        "n_layers": int(key("block_count")), "hidden": int(key("embedding_length")),
        "n_heads": int(key("attention.head_count")), "seq_len": int(key("context_length")),
        "ffn_hidden": int(key("feed_forward_length")),
        "vocab_size": shapes["token_embd.weight"][0]}
    if arch == "gpt2":
        return GPTConfig(**common, layernorm_eps=float(key("attention.layer_norm_epsilon")),
                         gelu_approximate="tanh")

    def refuse(name: str, allowed: str) -> None:
        raise ConvertError(f"{where}: {arch}.{name}={fields[f'{arch}.{name}']!r} is not "
                           f"supported by mt's Llama ({allowed})")

    if key("rope.scaling.type", "none") not in ("none", "linear"):
        refuse("rope.scaling.type", "none: no RoPE scaling")
    for name in ("rope.scaling.factor", "rope.scale_linear"):  # llama.cpp's linear scaling
        if float(key(name, 1.0)) not in (0.0, 1.0):
            refuse(name, "1: no RoPE scaling")
    head_dim = common["hidden"] // max(common["n_heads"], 1)
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        refuse("rope.dimension_count", f"embedding_length / attention.head_count = {head_dim}:"
                                       " RoPE on the whole head")
    return GPTConfig(**common, position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                     n_kv_heads=int(key("attention.head_count_kv", common["n_heads"])),
                     layernorm_eps=float(key("attention.layer_norm_rms_epsilon")),
                     rope_theta=float(key("rope.freq_base", 10000.0)),
                     tied_embeddings="output.weight" not in shapes)


class GGUFReader(CheckpointReader):
    """A GGUF file of llama.cpp's gpt2 or llama architecture as canonical mt tensors."""

    format = GGUF_FORMAT

    def __init__(self, root: Path) -> None:
        gguf = _gguf()
        self.root = Path(root)
        self.file = gguf_file(self.root)
        try:
            self._reader = gguf.GGUFReader(self.file)
        except (ValueError, OSError, IndexError, KeyError) as err:
            raise ConvertError(f"{self.file}: not a readable GGUF file (truncated or damaged): "
                               f"{err}") from None
        sidecar = read_sidecar(self.file.parent) if self.file.name == GGUF_FILE else None
        self._checksums: dict[str, str] = dict((sidecar or {}).get("checksums") or {})
        if sidecar is not None and "header" in sidecar:  # absent in files written before it
            self._check_header(str(sidecar["header"]))
        self._tensors = {t.name: t for t in self._reader.tensors}
        if unknown := sorted(self._checksums.keys() - self._tensors.keys()):
            raise ConvertError(f"{self.file.parent / SIDECAR}: records a checksum of "
                               f"{unknown[0]!r}, which {self.file.name} does not hold: one of "
                               "the two was changed")
        shapes = {name: tuple(int(n) for n in reversed(t.shape.tolist()))
                  for name, t in self._tensors.items()}
        fields = {name: field.contents() for name, field in self._reader.fields.items()
                  if not name.startswith("tokenizer.ggml.")}
        try:
            self.config = (GPTConfig.from_dict(json.loads(fields[MT_CONFIG_KEY]))
                           if MT_CONFIG_KEY in fields else
                           _config_from_keys(fields, shapes, self.file))
        except (TypeError, ValueError) as err:
            raise ConvertError(f"{self.file}: cannot build an mt config: {err}") from None
        self._shapes = canonical_shapes(self.config)
        self._parts = {name: gguf_parts(name, self.config) for name in self._shapes}
        expected = {key: (shape[0] if rows < 0 else rows, *shape[1:])
                    for name, shape in self._shapes.items()
                    for key, rows, _ in self._parts[name]}
        missing = sorted(set(expected) - set(shapes))
        unexpected = sorted(set(shapes) - set(expected) - {"output.weight"})
        if missing or unexpected:
            raise ConvertError(f"{self.file}: missing tensors {missing[:6]}, unexpected "
                               f"{unexpected[:6]}")
        for key, shape in expected.items():
            if shapes[key] != shape:
                raise ConvertError(f"{self.file}: tensor {key!r} has shape {list(shapes[key])}, "
                                   f"the model config needs {list(shape)}")

    def _check_header(self, expected: str) -> None:
        """The bytes before the tensor data (header, key/values, tensor table) against the
        checksum ``mt.json`` records of them: one edited (a config value, a tensor's type or
        offset) is refused in one line."""
        try:
            algorithm = algorithm_of(expected)
        except ConvertError as err:
            raise ConvertError(f"{self.file.parent / SIDECAR}: header: {err}") from None
        found = digest(np.ascontiguousarray(self._reader.data[:self._reader.data_offset]),
                       algorithm)
        if found != expected:
            raise ConvertError(f"{self.file}: header (metadata keys and tensor table): checksum "
                               f"mismatch (recorded {expected} in {SIDECAR}, found {found}): "
                               "the file was edited or damaged")

    def names(self) -> list[str]:
        return list(self._shapes)

    def _dtype(self, key: str) -> torch.dtype:
        kind = self._tensors[key].tensor_type.name
        return {"F16": torch.float16, "BF16": torch.bfloat16}.get(kind, torch.float32)

    def spec(self, name: str) -> TensorSpec:
        return TensorSpec(self._shapes[name], self._dtype(self._parts[name][0][0]))

    def sources(self, name: str) -> list[TensorRef]:
        refs = []
        for key, _, heads in self._parts[name]:
            stored = self._tensors[key]
            shape = tuple(int(n) for n in reversed(stored.shape.tolist()))
            transform = " ".join(filter(None, [f"interleave {heads}" if heads else "",
                                               stored.tensor_type.name]))
            refs.append(TensorRef(self.file.name, key, TensorSpec(shape, self._dtype(key)),
                                  transform))
        return refs

    def _load(self, key: str) -> torch.Tensor:
        gguf = _gguf()
        stored = self._tensors[key]
        expected = self._checksums.get(key)
        if expected is None and self._checksums:
            raise ConvertError(f"{self.file.parent / SIDECAR}: records no checksum of tensor "
                               f"{key!r}, which mt writes for every tensor: the file was "
                               "changed")
        if expected is not None and digest(np.ascontiguousarray(stored.data).view(np.uint8)
                                           .reshape(-1), expected.split(":")[0]) != expected:
            raise ConvertError(f"{self.file}: tensor {key!r}: checksum mismatch (recorded "
                               f"{expected} in {SIDECAR}): the file is corrupted")
        shape = tuple(int(n) for n in reversed(stored.shape.tolist()))
        kind = stored.tensor_type
        if kind == gguf.GGMLQuantizationType.BF16:  # exact: the raw 16 bits are bfloat16's
            raw = np.ascontiguousarray(stored.data).view(np.int16).reshape(shape)
            return torch.from_numpy(raw.copy()).view(torch.bfloat16)
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            return torch.from_numpy(np.array(stored.data).reshape(shape))
        return torch.from_numpy(gguf.quants.dequantize(stored.data, kind).reshape(shape).copy())

    def read(self, name: str) -> torch.Tensor:
        pieces = []
        for key, _, heads in self._parts[name]:
            tensor = self._load(key)
            pieces.append(from_interleaved(tensor, heads) if heads else tensor)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def close(self) -> None:
        self._tensors = {}
