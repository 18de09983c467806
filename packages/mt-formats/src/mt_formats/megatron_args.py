"""Genuine Megatron-LM checkpoint files: an explicit allow-list for the Python objects they
pickle beside the tensors, and the mt config their ``args`` describe.

Megatron-LM's ``model_optim_rng.pt`` (and a Megatron-core ``common.pt``) carries ``args``,
an ``argparse.Namespace`` of every command-line setting (torch dtypes, and Megatron-core
enums such as ``AttnBackend``), and RNG states (Python's ``random`` tuple, numpy's
``(name, uint32 array, ...)``). ``torch.load(weights_only=True)`` refuses all of them. They
are loaded here with that same weights-only unpickler and a named allow-list: the
Namespace, numpy's array and dtype reconstruction, and the Megatron-core enums below as
inert stand-ins that only keep their value (nothing of Megatron is imported). Any other
class is refused in one line naming it.
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mt_formats.errors import ConvertError
from mt_model import GPTConfig

__all__ = ["MegatronEnum", "config_from_args", "layout_from_args", "load_megatron_file"]

#: Megatron-core enums that ``args`` may hold (by their pickled module path).
MEGATRON_ENUMS = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.AttnType",
    "megatron.core.transformer.enums.LayerType",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.enums.ModelType",
    "megatron.core.enums.Fp8Recipe",
)


class MegatronEnum:
    """An inert stand-in for a Megatron-core enum member in ``args``: its value only."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"MegatronEnum({self.value!r})"


def _numpy_globals() -> list[Any]:
    """numpy's array reconstruction (an RNG state's uint32 key), under numpy 1 and 2 names."""
    core = getattr(np, "_core", None) or np.core  # numpy 2 / 1
    reconstruct = core.multiarray._reconstruct
    dtypes = [type(np.dtype(kind)) for kind in ("uint32", "float64", "int64")]
    return [(reconstruct, "numpy.core.multiarray._reconstruct"),
            (reconstruct, "numpy._core.multiarray._reconstruct"), np.ndarray, np.dtype, *dtypes]


def load_megatron_file(path: Path) -> Any:
    """``torch.load`` of a Megatron-LM file, weights-only plus the allow-list above; a
    missing, damaged or other-object file raises a one-line ConvertError naming it."""
    if not path.is_file():
        raise ConvertError(f"{path}: file not found")
    allowed = [argparse.Namespace, *_numpy_globals(),
               *((MegatronEnum, name) for name in MEGATRON_ENUMS)]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        lines = str(err).splitlines()
        what = next((line.strip() for line in lines if "GLOBAL" in line or "Unsupported" in
                     line), lines[0] if lines else "")
        raise ConvertError(f"{path}: holds a pickled object outside the allow-list for "
                           f"Megatron-LM files (argparse.Namespace, numpy arrays, "
                           f"Megatron-core enums); refusing to unpickle it: {what}") from None
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        first = next(iter(str(err).splitlines()), type(err).__name__)
        raise ConvertError(f"{path}: not a readable torch checkpoint (malformed or "
                           f"truncated): {first}") from None


def _get(args: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        if hasattr(args, name) and getattr(args, name) is not None:
            return getattr(args, name)
    return default


def config_from_args(args: Any, where: Path, gpt2_only: bool = True) -> GPTConfig:
    """The mt config Megatron-LM's ``args`` describe. ``gpt2_only`` (the legacy megatron
    layout): SwiGLU, RMSNorm, RoPE and grouped-query attention are refused by setting name;
    otherwise (Megatron-core checkpoints) they map to mt's Llama-family settings. Either
    way post-norm residuals, other activations, partial or interleaved RoPE and q/k norms
    are refused."""
    if not isinstance(args, argparse.Namespace):
        raise ConvertError(f"{where}: 'args' is a {type(args).__name__}, not Megatron-LM's "
                           "argparse.Namespace")
    swiglu = bool(_get(args, "swiglu", default=False))
    norm = _get(args, "normalization", default="LayerNorm")
    position = _get(args, "position_embedding_type", default="learned_absolute")
    grouped = bool(_get(args, "group_query_attention", default=False))
    refusals = [
        ("swiglu", gpt2_only and swiglu, "a SwiGLU MLP"),
        ("normalization", norm not in (("LayerNorm",) if gpt2_only else ("LayerNorm",
                                                                         "RMSNorm")), "norm"),
        ("position_embedding_type", position not in (
            ("learned_absolute",) if gpt2_only else ("learned_absolute", "rope")),
         "positions"),
        ("group_query_attention", gpt2_only and grouped, "grouped-query attention"),
        ("apply_residual_connection_post_layernorm",
         bool(_get(args, "apply_residual_connection_post_layernorm", default=False)),
         "post-norm residuals"),
        ("squared_relu", bool(_get(args, "squared_relu", default=False)), "squared ReLU"),
        ("qk_layernorm", bool(_get(args, "qk_layernorm", default=False)), "q/k norms"),
        ("rotary_interleaved", bool(_get(args, "rotary_interleaved", default=False)),
         "interleaved RoPE"),
        ("rotary_percent", float(_get(args, "rotary_percent", default=1.0)) != 1.0,
         "partial RoPE"),
    ]
    for name, bad, what in refusals:
        if bad:
            where_to = ("; convert it through mcore instead" if gpt2_only else "")
            raise ConvertError(f"{where}: args.{name}={getattr(args, name)!r} ({what}) is not "
                               f"supported by mt's "
                               f"{'megatron (GPT-2) layout' if gpt2_only else 'models'}"
                               f"{where_to}")
    padded = _get(args, "padded_vocab_size")
    vocab = _get(args, "vocab_size", default=padded)
    hidden = _get(args, "hidden_size")
    heads = _get(args, "num_attention_heads")
    try:
        return GPTConfig(
            n_layers=int(_get(args, "num_layers")), hidden=int(hidden), n_heads=int(heads),
            vocab_size=int(vocab),
            seq_len=int(_get(args, "max_position_embeddings", "seq_length")),
            ffn_hidden=int(_get(args, "ffn_hidden_size", default=4 * int(hidden))),
            layernorm_eps=float(_get(args, "norm_epsilon", "layernorm_epsilon", default=1e-5)),
            gelu_approximate="tanh" if _get(args, "openai_gelu", default=False) else "none",
            bias=bool(_get(args, "add_bias_linear", default=True)),
            tied_embeddings=not _get(args, "untie_embeddings_and_output_weights",
                                     default=False),
            init_std=float(_get(args, "init_method_std", default=0.02)),
            mlp="swiglu" if swiglu else "gelu", norm="rmsnorm" if norm == "RMSNorm" else
            "layernorm", position="rope" if position == "rope" else "learned",
            rope_theta=float(_get(args, "rotary_base", default=10000)),
            n_kv_heads=int(_get(args, "num_query_groups", default=heads)) if grouped else None)
    except (TypeError, ValueError) as err:
        raise ConvertError(f"{where}: Megatron-LM's args do not make an mt config: "
                           f"{err}") from None


def layout_from_args(args: Any, config: GPTConfig, where: Path) -> dict[str, Any]:
    """``{"tp", "pp", "pad_multiple", "stage_layers"}`` of a Megatron-LM run (uniform
    stages, as Megatron splits the layers by default)."""
    tp = int(_get(args, "tensor_model_parallel_size", default=1))
    pp = int(_get(args, "pipeline_model_parallel_size", default=1))
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                 "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage"):
        if _get(args, name) is not None:
            raise ConvertError(f"{where}: args.{name}={getattr(args, name)!r}: only uniform, "
                               "non-interleaved pipeline stages are read")
    if config.n_layers % pp:
        raise ConvertError(f"{where}: {config.n_layers} layers do not split evenly over "
                           f"{pp} pipeline stages")
    per = config.n_layers // pp
    padded = _get(args, "padded_vocab_size", default=config.vocab_size)
    multiple = int(_get(args, "make_vocab_size_divisible_by", default=128))
    if padded != config.vocab_size and -(-config.vocab_size // (multiple * tp)) * (
            multiple * tp) != padded:
        raise ConvertError(f"{where}: padded_vocab_size {padded} is not vocab_size "
                           f"{config.vocab_size} padded to a multiple of {multiple} x {tp}")
    return {"tp": tp, "pp": pp, "pad_multiple": multiple if padded != config.vocab_size else 1,
            "stage_layers": [[s * per, (s + 1) * per] for s in range(pp)]}


def check_rank_folders(saved: dict[tuple[int, int], tuple[Path, Any]], tp: int, pp: int) -> None:
    """Each rank file (``saved``: (stage, TP rank) -> (path, its ``args``)) lies in the folder
    of the model-parallel rank that saved it. Megatron-LM records the saving process's global
    rank and the world size in ``args.rank`` and ``args.world_size``; the data-parallel rank
    0 of each model-parallel rank saves, TP ranks innermost, then context parallelism, and
    the pipeline stages outermost (its default order) or inside data parallelism
    (``--use-tp-pp-dp-mapping``). Any context-parallel rank is accepted: megatron-core before
    0.9 let each of them save the file, the last one's landing. Skipped where the files do not
    record distinct ranks (a converter writing every rank from one process records its own
    rank in all)."""
    ranks = {at: (getattr(args, "rank", None), getattr(args, "world_size", None))
             for at, (_, args) in saved.items()}
    if len(saved) < 2 or len({rank for rank, _ in ranks.values()}) != len(saved) or not all(
            type(rank) is int and type(world) is int and world > 0 and world % (tp * pp) == 0
            for rank, world in ranks.values()):
        return
    for (stage, tp_rank), (rank, world) in sorted(ranks.items()):
        cp = getattr(saved[stage, tp_rank][1], "context_parallel_size", 1)
        cp = cp if type(cp) is int and cp > 0 else 1
        if not any(offset % tp == 0 and 0 <= offset // tp < cp for offset in (
                rank - tp_rank - world // pp * stage, rank - tp_rank - tp * cp * stage)):
            raise ConvertError(
                f"{saved[stage, tp_rank][0]}: saved by global rank {rank} of {world}, which "
                f"does not hold TP rank {tp_rank} of pipeline stage {stage} (the folder's "
                "name) in Megatron-LM's rank orders: rank folders renamed or swapped")


#: Megatron-LM's args that every rank of one run records alike.
_RUN_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
             "padded_vocab_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
             "virtual_pipeline_model_parallel_size", "swiglu", "normalization")


def check_same_run(path: Path, data: dict[str, Any], first: Path, head: dict[str, Any],
                   iteration: int | None) -> None:
    """Rank file ``path`` (loaded: ``data``) is of the run and step of the first one
    (``first``, loaded: ``head``) and of its folder (``iteration``; None: ``release``): its
    ``iteration`` and the args of :data:`_RUN_ARGS`."""
    if iteration is not None and data.get("iteration") != iteration:
        raise ConvertError(f"{path}: iteration {data.get('iteration')!r}, in the folder of "
                           f"iteration {iteration}")
    args = data.get("args")
    for name in _RUN_ARGS:
        if getattr(args, name, None) != getattr(head.get("args"), name, None):
            raise ConvertError(f"{path}: args.{name} is {getattr(args, name, None)!r}, "
                               f"{first}'s {getattr(head.get('args'), name, None)!r}: not one "
                               "run's files")
