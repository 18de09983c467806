"""Training-step tokens/s, MFU and peak memory of one process: mt vs Hugging Face, like for like.

For each shape and precision this times one full optimizer step (forward, backward,
clipping, AdamW) of four runners, all from the same initial weights (mt's init, copied to
HF by the ``mt convert`` name mapping) on the same batches, with the same loss, AdamW
parameter groups (lr 3e-3, betas 0.9/0.95, weight decay 0.1 on matrices), clipping 1.0 and
fused AdamW (the HF Trainer's default optimizer, ``adamw_torch_fused``, on torch >= 2.8):

- **mt**: ``mt_model.GPT`` as one pipeline stage (``PipelineStage.forward_loss``, what
  ``mt pretrain`` runs) inside ``mt_zero.ZeroOptimizer`` (ZeRO stage 1, one process);
- **mt+compile**: the same with ``torch.compile`` of ``forward_loss`` (``mt pretrain
  --compile``);
- **hf**: ``transformers.GPT2LMHeadModel`` (``LlamaForCausalLM`` for Llama shapes; sdpa
  attention), forward + cross entropy eager;
- **hf+compile**: the same with ``torch.compile`` of HF's forward + loss (the same scope as
  mt+compile; backward and the optimizer stay eager on both sides).

Compilation happens in the warm-up steps and is never timed (nor is Python's cyclic garbage
collector, paused during the timed steps after a collection). Like for like: the table puts
each eager mt row against hf eager and mt+compile against hf+compile (never a compiled
runner against an eager one). The precision recipes are the usual ones of each framework
and are named as such: mt ``bf16`` = bf16 weights + fp32 masters (bf16 parameters and
compute, fp32 master weights and AdamW state); hf ``bf16`` = fp32 weights + bf16 autocast.
``fp32`` is fp32 everywhere on both sides.

Shapes (``--shapes``, comma separated): the reduced CPU shapes ``tiny``,
``gpt2-small-l{L}s{S}`` (GPT-2 small at ``--small-layers`` / ``--small-seq``),
``llama-test`` and ``llama-1b-block-l{L}s{S}`` (Llama 3.2 1B's block at that depth and
sequence, 1k vocabulary), or any ``mt_model`` preset name at its real size (``gpt2-small``,
``1.3b``, ...); ``--seq-len`` overrides the sequence length. ``--batch`` is the micro-batch
and the global batch (one process, one micro-batch per step).

On CPU the runners' steps are interleaved (rotating order) so that background load hits
all alike; ``--sequential`` runs them one after another instead. On CUDA (``--device
cuda``) they always run sequentially: each runner is built, warmed up, timed and measured,
then freed (``torch.cuda.empty_cache()``) before the next, because four 1.3B models with
their optimizer states would not fit together. Peak memory per runner is
``torch.cuda.max_memory_allocated()`` after its steps, the counter reset once the previous
runner was freed: its weights, gradients, optimizer state and activations (n/a on CPU).

Best and median step times are reported. MFU is model FLOP/s
(``mt_model.model_flops_per_token_training``: 6N + 12 l h s per token) over ``--peak-tflops``
(989 for an H200's dense bf16; used for every precision given) or else this machine's matmul
probe in that dtype (best of the start and the end; on a GPU the probe underestimates the
peak). Beside mt's rows the plan's prediction for the same run is printed
(``mt_plan.estimate`` of TP 1 x PP 1 x DP 1, ZeRO 1, no recompute, on each ``--plan-gpu``: a
built-in GPU name or a YAML written by ``mt plan --calibrate``; default ``h200`` on CUDA,
none on CPU): tokens/s and peak memory per GPU (GB = 1e9 bytes), predicted against measured.

CPU example (2 cores, about 7 minutes)::

    PYTHONPATH=$(ls -d packages/*/src apps/*/src | tr '\\n' ':') \\
        python3 benchmarks/train.py --steps 8 --json /tmp/train_bench.json

GPU example (one H200; benchmarks/gpu.sh runs this and more)::

    PYTHONPATH=$(ls -d packages/*/src apps/*/src | tr '\\n' ':') \\
        python3 benchmarks/train.py --device cuda --peak-tflops 989 --precisions bf16 \\
        --shapes 1.3b --batch 8 --warmup 2 --steps 8 --plan-gpu h200 --json /tmp/t.json

Targets (issue 9, CPU): fp32 mt/hf >= 1.0; bf16 mt(bf16) / hf(autocast) >= 2.0.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mt_formats.hf_config import hf_config_from_gpt, hf_name
from mt_model import (
    GPT,
    PRESETS,
    TIED_WEIGHT,
    GPTConfig,
    model_flops_per_token_training,
    preset,
)
from mt_pipeline import ModelLayout, PipelineConfig, build_stage, plan_pipeline
from mt_plan import GPUSpec, ParallelLayout, estimate, load_gpu
from mt_plan.mfu import measure_peak_flops
from mt_zero import ZeroConfig, ZeroOptimizer, decay_param_groups

LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 3e-3, (0.9, 0.95), 1e-8, 0.1, 1.0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TARGETS = {"fp32": 1.0, "bf16": 2.0}
RECIPES = {  # what each framework's precision flag means here
    ("mt", "fp32"): "fp32 weights, fp32 compute",
    ("mt", "bf16"): "bf16 weights + fp32 masters",
    ("hf", "fp32"): "fp32 weights, fp32 compute",
    ("hf", "bf16"): "fp32 weights + bf16 autocast",
}
RUNNERS = ("mt", "hf", "mt+compile", "hf+compile")  # eager pair first: it needs no compile
PAIRS = (("mt", "hf"), ("mt+compile", "hf+compile"))  # like for like: eager/eager, compiled
GIB, GB = 2**30, 1e9

Batch = tuple[torch.Tensor, torch.Tensor]
State = dict[str, torch.Tensor]


# ----------------------------------------------------------------------------- machine
def matmul_peak(dtype: torch.dtype, device: torch.device, sizes: tuple[int, ...],
                repeats: int) -> float:
    """Best FLOP/s of square matmuls in ``dtype`` over ``sizes``: ``mt pretrain``'s own MFU
    probe (best of ``repeats`` each), at several sizes."""
    return max(measure_peak_flops(dtype, device, n, repeats, budget_s=None) for n in sizes)


def load_average() -> str:
    """The 1/5/15-minute load averages (other processes compete for the cores)."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Return a freed runner's memory: its compiled graphs, objects and (CUDA) cached
    blocks, so that the next runner's peak counts only its own."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def quiet_gc() -> None:
    """Collect now and pause the cyclic garbage collector for the timed steps (as ``timeit``
    does; reference counting still frees tensors): a full collection of what compilation
    left behind took 0.5-1.6 s in the middle of timed CPU steps."""
    gc.collect()
    gc.disable()


# -------------------------------------------------------------------------- frameworks
@dataclasses.dataclass
class Runner:
    """One framework's training step and its measurements."""

    name: str
    step: Callable[[Batch], float] | None
    device: torch.device
    times: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    peak_bytes: int | None = None

    def run(self, batch: Batch, timed: bool) -> None:
        assert self.step is not None, f"{self.name} was already freed"
        synchronize(self.device)
        start = time.perf_counter()
        loss = self.step(batch)  # float(loss) waits for the step's last kernels ...
        synchronize(self.device)  # ... and this for anything left on the device
        elapsed = time.perf_counter() - start
        self.losses.append(loss)
        if timed:
            self.times.append(elapsed)

    def release(self) -> None:
        """Drop the model, optimizer and compiled function (held by the step closure)."""
        self.step = None


def reference_state(config: GPTConfig, seed: int) -> State:
    """mt's fp32 initialisation (on CPU, whatever the device): what every runner starts
    from."""
    return GPT(config, seed=seed).state_dict()


def mt_runner(config: GPTConfig, precision: str, source: State, compiled: bool,
              device: torch.device) -> Runner:
    """mt's step: the model as one pipeline stage in the ZeRO wrapper (stage 1, one
    process) with fused AdamW, as ``mt pretrain`` (``--compile`` when ``compiled``); built
    on the meta device and materialised on ``device`` as ``mt pretrain`` does."""
    with torch.device("meta"):
        model = GPT(config, seed=None)
    layout = ModelLayout(tied_weight=TIED_WEIGHT if config.tied_embeddings else None)
    stage = build_stage(model, plan_pipeline(PipelineConfig(), config.n_layers, 1).stages[0],
                        layout)
    del model
    stage.to_empty(device=device)
    with torch.no_grad():
        for name, param in stage.named_parameters():
            param.copy_(source[name])
    stage.train()

    def factory(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)

    opt = ZeroOptimizer(stage, factory, None,
                        ZeroConfig(stage=1, precision=precision, clip_grad=CLIP),
                        param_groups=decay_param_groups(stage.named_parameters(),
                                                        WEIGHT_DECAY))
    forward_loss = torch.compile(stage.forward_loss) if compiled else stage.forward_loss

    def step(batch: Batch) -> float:
        loss = forward_loss(0, batch[0], batch[1])
        opt.backward(loss)
        opt.step()
        return float(loss.detach())

    return Runner("mt+compile" if compiled else "mt", step, device)


def hf_llama(config: GPTConfig, source: State, device: torch.device) -> nn.Module:
    """``LlamaForCausalLM`` equal to ``source`` (a Llama-shaped mt GPT's state dict): q /
    [k; v] and [gate; up] split into HF's separate projections."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden,
        intermediate_size=config.ffn_hidden, num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
        max_position_embeddings=config.seq_len, rms_norm_eps=config.layernorm_eps,
        rope_theta=config.rope_theta, tie_word_embeddings=config.tied_embeddings,
        attention_bias=False, mlp_bias=False, use_cache=False)
    hf_config._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(hf_config)
    mt = source  # mt parameter names
    state = {"model.embed_tokens.weight": mt["embed.tokens.weight"],
             "model.norm.weight": mt["ln_f.weight"],
             "lm_head.weight": mt.get("head.weight", mt["embed.tokens.weight"])}
    for i in range(config.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        if b + "attn.qkv.weight" in mt:
            q, k, v = mt[b + "attn.qkv.weight"].chunk(3)
        else:
            q, (k, v) = mt[b + "attn.q.weight"], mt[b + "attn.kv.weight"].chunk(2)
        gate, up = mt[b + "mlp.fc.weight"].chunk(2)
        state.update({h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k,
                      h + "self_attn.v_proj.weight": v,
                      h + "self_attn.o_proj.weight": mt[b + "attn.proj.weight"],
                      h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up,
                      h + "mlp.down_proj.weight": mt[b + "mlp.proj.weight"],
                      h + "input_layernorm.weight": mt[b + "ln1.weight"],
                      h + "post_attention_layernorm.weight": mt[b + "ln2.weight"]})
    model.load_state_dict({k: v.clone() for k, v in state.items()}, strict=True)
    return model


def hf_model(config: GPTConfig, source: State, device: torch.device) -> nn.Module:
    """The transformers model equal to ``source`` (an mt state dict), built on ``device``:
    ``GPT2LMHeadModel`` (config and weights via mt_convert names) for the GPT-2 block,
    ``LlamaForCausalLM`` for a Llama shape."""
    if config.architecture != "gpt2":
        return hf_llama(config, source, device)
    from transformers import GPT2Config, GPT2LMHeadModel

    body = hf_config_from_gpt(config, torch.float32)
    body.pop("mt")
    body.update(use_cache=False, attn_implementation="sdpa")
    with torch.device(device):  # HF initialises on the device: fast for 1.3B on a GPU
        model = GPT2LMHeadModel(GPT2Config(**body))
    state = {}
    for name, tensor in source.items():
        key, transposed = hf_name(name)
        state["transformer." + key] = tensor.t().contiguous() if transposed else tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to wte
    if missing or unexpected:
        raise RuntimeError(f"HF state dict mismatch: missing {missing}, unexpected {unexpected}")
    if model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr():
        raise RuntimeError("HF lm_head is not tied to wte")
    return model



def hf_runner(config: GPTConfig, precision: str, source: State, compiled: bool,
              device: torch.device) -> Runner:
    """HF's step: fp32 weights; bf16 through autocast (the standard HF recipe); fused AdamW
    as the HF Trainer's default. ``compiled``: ``torch.compile`` of forward + loss."""
    model = hf_model(config, source, device)
    model.train()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(decay_param_groups(params, WEIGHT_DECAY), lr=LR, betas=BETAS,
                            eps=EPS, fused=True)
    autocast = precision == "bf16"

    def forward_loss(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=idx).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               targets.reshape(-1))

    run_forward = torch.compile(forward_loss) if compiled else forward_loss

    def step(batch: Batch) -> float:
        loss = run_forward(batch[0], batch[1])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return Runner("hf+compile" if compiled else "hf", step, device)


def build_runner(name: str, config: GPTConfig, precision: str, source: State,
                 device: torch.device) -> Runner:
    compiled = name.endswith("+compile")
    if name.startswith("mt"):
        return mt_runner(config, precision, source, compiled, device)
    return hf_runner(config, precision, source, compiled, device)


# ------------------------------------------------------------------------------ driver
def make_batches(config: GPTConfig, batch: int, count: int, seed: int,
                 device: torch.device) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=gen)
        tokens = tokens.to(device)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def runner_names(args: argparse.Namespace) -> list[str]:
    names = [n for n in RUNNERS if not (args.no_compile and n.endswith("+compile"))]
    return [n for n in names if not (args.no_hf and n.startswith("hf"))]


def run_interleaved(names: list[str], config: GPTConfig, precision: str, source: State,
                    batches: list[Batch], args: argparse.Namespace) -> list[Runner]:
    """All runners alive at once; after warm-up their steps alternate in rotating order so
    that background load hits all alike (CPU only: no per-runner memory)."""
    runners = [build_runner(n, config, precision, source, args.device) for n in names]
    try:
        for i, batch in enumerate(batches):
            timed = i >= args.warmup
            if i == args.warmup:
                quiet_gc()
            shift = i % len(runners)  # none always runs first
            for runner in runners[shift:] + runners[:shift]:
                runner.run(batch, timed)
    finally:
        gc.enable()
    for runner in runners:
        runner.release()
    free_memory(args.device)
    return runners


def run_sequential(names: list[str], config: GPTConfig, precision: str, source: State,
                   batches: list[Batch], args: argparse.Namespace) -> list[Runner]:
    """One runner at a time: build, warm up, time, record its peak memory, free it."""
    runners = []
    cuda = args.device.type == "cuda"
    for name in names:
        free_memory(args.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(args.device)
        start = time.perf_counter()
        runner = Runner(name, None, args.device)
        try:
            runner = build_runner(name, config, precision, source, args.device)
            for i, batch in enumerate(batches):
                if i == args.warmup:
                    quiet_gc()
                runner.run(batch, i >= args.warmup)
        except Exception:  # e.g. out of memory: keep the other runners' results
            traceback.print_exc()
            runner.release()
            print(f"    {name}: FAILED (above); left out of the tables", flush=True)
            continue
        finally:
            gc.enable()
        if cuda:
            runner.peak_bytes = torch.cuda.max_memory_allocated(args.device)
        runner.release()
        runners.append(runner)
        # Each runner's numbers as soon as they exist: a time limit may cut the later ones.
        tokens = args.batch * config.seq_len
        peak = "n/a" if runner.peak_bytes is None else f"{runner.peak_bytes / GIB:.1f} GiB"
        print(f"    {name}: best {tokens / min(runner.times):,.0f} tokens/s, median "
              f"{tokens / statistics.median(runner.times):,.0f}, peak {peak}, loss0 "
              f"{runner.losses[0]:.4f}; {time.perf_counter() - start:.1f} s in all (build, "
              f"{args.warmup} warm-up + {args.steps} timed steps)", flush=True)
    free_memory(args.device)
    return runners


def predictions(config: GPTConfig, precision: str, batch: int,
                gpus: list[tuple[str, GPUSpec]]) -> list[dict[str, Any]]:
    """mt_plan's estimate of this run (TP 1 x PP 1 x DP 1, ZeRO 1, no recompute) on each
    GPU description."""
    out = []
    for label, gpu in gpus:
        layout = ParallelLayout(1, 1, 1, batch, batch, zero_stage=1, recompute="none",
                                precision=precision)
        est = estimate(config, layout, gpu)
        out.append({"gpu": label, "tokens_per_s": est.tokens_per_s,
                    "memory_per_gpu_gb": est.memory_per_gpu_gb, "calibrated": est.calibrated,
                    "iteration_time_s": est.iteration_time_s})
    return out


def bench_case(config: GPTConfig, precision: str, args: argparse.Namespace,
               gpus: list[tuple[str, GPUSpec]]) -> dict[str, Any]:
    """Every runner on identical batches; interleaved on CPU, one by one on CUDA."""
    source = reference_state(config, args.seed)
    batches = make_batches(config, args.batch, args.warmup + args.steps, args.seed,
                           args.device)
    names = runner_names(args)
    sequential = args.sequential or args.device.type == "cuda"
    run = run_sequential if sequential else run_interleaved
    runners = run(names, config, precision, source, batches, args)
    del source, batches
    tokens = args.batch * config.seq_len
    flops_per_token = model_flops_per_token_training(config)
    result: dict[str, Any] = {"precision": precision, "tokens_per_step": tokens,
                              "flops_per_token": flops_per_token, "batch": args.batch,
                              "seq_len": config.seq_len, "sequential": sequential,
                              "config": dataclasses.asdict(config)}
    for runner in runners:
        best, median = min(runner.times), statistics.median(runner.times)
        framework = runner.name.split("+")[0]
        result[runner.name] = {
            "recipe": RECIPES[framework, precision],
            "best_tokens_per_s": tokens / best, "median_tokens_per_s": tokens / median,
            "step_times_s": runner.times,
            "first_loss": runner.losses[0], "last_loss": runner.losses[-1],
            "peak_memory_bytes": runner.peak_bytes,
        }
    if "mt" in result and "hf" in result:
        mt0, hf0 = result["mt"]["first_loss"], result["hf"]["first_loss"]
        result["first_loss_rel_diff"] = abs(mt0 - hf0) / abs(hf0)
    result["plan"] = predictions(config, precision, args.batch, gpus)
    return result


def reduced_shapes(args: argparse.Namespace) -> dict[str, GPTConfig]:
    """The reduced CPU shapes (as before: fast enough for a 2-core machine)."""
    small = preset("gpt2-small").replace(n_layers=args.small_layers, seq_len=args.small_seq)
    # Llama 3.2 1B's block (2048 wide, 32 query / 8 key-value heads, SwiGLU 8192) at the same
    # depth and sequence as the GPT-2 shape, with the 1k vocabulary: block-dominated.
    llama = preset("llama-3.2-1b").replace(n_layers=args.small_layers, seq_len=args.small_seq,
                                           vocab_size=1000, tied_embeddings=False)
    return {"tiny": preset("tiny"), f"gpt2-small-l{args.small_layers}s{args.small_seq}": small,
            "llama-test": preset("llama-test"),
            f"llama-1b-block-l{args.small_layers}s{args.small_seq}": llama}


def shapes(args: argparse.Namespace) -> dict[str, GPTConfig]:
    """The shapes ``--shapes`` names: a reduced shape by name (or a prefix of its name), or
    any mt_model preset at its real size; all reduced shapes by default. ``--seq-len``
    overrides the sequence length of each."""
    reduced = reduced_shapes(args)
    wanted = [s for s in args.shapes.split(",") if s]
    chosen: dict[str, GPTConfig] = {}
    if not wanted:
        chosen = dict(reduced)
    for w in wanted:
        if w in reduced:
            chosen[w] = reduced[w]
        elif w in PRESETS:
            chosen[w] = preset(w)  # full size
        else:
            matches = {k: v for k, v in reduced.items() if k.startswith(w)}
            if not matches:
                raise SystemExit(f"unknown shape {w!r}: use one of {sorted(reduced)} or a "
                                 f"preset {sorted(PRESETS)}")
            chosen.update(matches)
    if args.seq_len:
        chosen = {f"{k}-s{args.seq_len}" if v.seq_len != args.seq_len else k:
                  v.replace(seq_len=args.seq_len) for k, v in chosen.items()}
    return chosen


def _mem(runner: dict[str, Any] | None) -> str:
    if runner is None or runner.get("peak_memory_bytes") is None:
        return "n/a"
    return f"{runner['peak_memory_bytes'] / GIB:.1f}"


def print_table(results: list[dict[str, Any]], peaks: dict[str, float]) -> None:
    """One row per (shape, precision, like-for-like pair): mt's tokens/s, MFU and peak
    memory against the same-mode HF runner's (eager vs eager, compiled vs compiled)."""
    print("recipes: mt bf16 = " + RECIPES["mt", "bf16"] + "; hf bf16 = " + RECIPES["hf", "bf16"]
          + "; fp32 = fp32 on both sides")
    header = (f"{'shape':<22}{'prec':<6}{'mt runner':<12}{'vs':<12}{'mt tok/s':>10}"
              f"{'peer tok/s':>11}{'ratio':>7}{'(med)':>7}{'target':>9}{'mt MFU':>8}"
              f"{'peer MFU':>9}{'mt GiB':>8}{'peer GiB':>9}{'loss0 mt/peer':>18}")
    print(header)
    print("-" * len(header))
    for r in results:
        peak = peaks[r["precision"]]
        target = TARGETS[r["precision"]]
        for name in RUNNERS:
            if name in r:
                r[name]["mfu"] = r[name]["best_tokens_per_s"] * r["flops_per_token"] / peak
        for mt_name, hf_name_ in PAIRS:
            if mt_name not in r:
                continue
            mt, hf = r[mt_name], r.get(hf_name_)
            line = (f"{r['shape']:<22}{r['precision']:<6}{mt_name:<12}"
                    f"{hf_name_ if hf else '-':<12}{mt['best_tokens_per_s']:>10.0f}")
            if hf is None:
                print(line + f"{'-':>11}{'-':>7}{'-':>7}{'':>9}{mt['mfu']:>8.1%}{'-':>9}"
                      f"{_mem(mt):>8}{'-':>9}{mt['first_loss']:>18.4f}")
                continue
            ratio = mt["best_tokens_per_s"] / hf["best_tokens_per_s"]
            ratio_med = mt["median_tokens_per_s"] / hf["median_tokens_per_s"]
            mark = "ok" if ratio >= target else "MISS"
            print(line + f"{hf['best_tokens_per_s']:>11.0f}{ratio:>7.2f}{ratio_med:>7.2f}"
                  f"{target:>5.1f}{mark:>4}{mt['mfu']:>8.1%}{hf['mfu']:>9.1%}"
                  f"{_mem(mt):>8}{_mem(hf):>9}"
                  f"{mt['first_loss']:>9.4f}/{hf['first_loss']:.4f}")
            mt.update(vs=hf_name_, ratio_best=ratio, ratio_median=ratio_med)


def print_plan(results: list[dict[str, Any]]) -> None:
    """mt's measured tokens/s and peak memory against mt_plan's prediction for the run."""
    if not any(r["plan"] for r in results):
        return
    print("mt_plan prediction (TP 1 x PP 1 x DP 1, ZeRO 1, no recompute; memory in GB = 1e9 "
          "bytes; ratio = measured / predicted)")
    header = (f"{'shape':<22}{'prec':<6}{'mt runner':<12}{'plan gpu':<22}{'meas tok/s':>11}"
              f"{'pred tok/s':>11}{'ratio':>7}{'meas GB':>9}{'pred GB':>9}{'ratio':>7}")
    print(header)
    print("-" * len(header))
    for r in results:
        for name in ("mt", "mt+compile"):
            if name not in r:
                continue
            measured = r[name]
            for pred in r["plan"]:
                gpu = pred["gpu"] if len(pred["gpu"]) < 22 else "..." + pred["gpu"][-18:]
                speed = measured["best_tokens_per_s"] / pred["tokens_per_s"]
                if measured["peak_memory_bytes"] is None:
                    mem, mem_ratio = "n/a", "-"
                else:
                    gb = measured["peak_memory_bytes"] / GB
                    mem, mem_ratio = f"{gb:.1f}", f"{gb / pred['memory_per_gpu_gb']:.2f}"
                print(f"{r['shape']:<22}{r['precision']:<6}{name:<12}{gpu:<22}"
                      f"{measured['best_tokens_per_s']:>11.0f}{pred['tokens_per_s']:>11.0f}"
                      f"{speed:>7.2f}{mem:>9}{pred['memory_per_gpu_gb']:>9.1f}{mem_ratio:>7}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--sequential", action="store_true",
                   help="run the runners one after another, not interleaved (always on cuda)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=4,
                   help="sequences per step: micro-batch = global batch (one process)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps (compilation here)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per runner")
    p.add_argument("--small-layers", type=int, default=2)
    p.add_argument("--small-seq", type=int, default=256)
    p.add_argument("--shapes", default="",
                   help="comma-separated reduced shapes (default: all) or mt_model presets "
                        "at full size (gpt2-small, 1.3b, ...)")
    p.add_argument("--seq-len", type=int, default=0, help="override each shape's sequence")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--no-compile", action="store_true",
                   help="leave out mt+compile and hf+compile")
    p.add_argument("--no-hf", action="store_true",
                   help="leave out the transformers runners (otherwise a missing transformers "
                        "is an error)")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="MFU denominator in TFLOP/s (989: H200 dense bf16) instead of the "
                        "matmul probe")
    p.add_argument("--peak-sizes", default="",
                   help="probe matrix sizes (default 512,1024,2048 on cpu, 4096,8192 on cuda)")
    p.add_argument("--peak-repeats", type=int, default=5)
    p.add_argument("--plan-gpu", action="append", default=None,
                   help="GPU (built-in name or mt plan --calibrate YAML) for mt_plan's "
                        "prediction; repeatable; default h200 on cuda, none on cpu")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default="", help="also write the results to this file")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to torch")
    args.device = torch.device(args.device)
    if not args.no_hf:
        import transformers  # a pinned peer (benchmarks/requirements.txt): fail, never skip

        hf_version = transformers.__version__
    else:
        hf_version = "not run (--no-hf)"
    torch.set_num_threads(args.threads)
    if args.device.type == "cpu" and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        # Inductor's compile-worker pool, started at the first compile, took both cores of a
        # 2-core machine for seconds and stalled the other runners' timed steps: compile in
        # this process instead (on a GPU machine the pool speeds up the Triton compiles).
        from torch._inductor import config as inductor_config

        inductor_config.compile_threads = 1
    precisions = args.precisions.split(",")
    plan_gpus = args.plan_gpu if args.plan_gpu is not None else (
        ["h200"] if args.device.type == "cuda" else [])
    gpus = [(g, load_gpu(g)) for g in plan_gpus]
    name = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, transformers {hf_version}, device {name}, "
          f"threads {torch.get_num_threads()}, load average {load_average()}")
    default_sizes = "4096,8192" if args.device.type == "cuda" else "512,1024,2048"
    sizes = tuple(int(s) for s in (args.peak_sizes or default_sizes).split(","))

    def probe() -> dict[str, float]:
        if args.peak_tflops > 0:
            return {p: args.peak_tflops * 1e12 for p in precisions}
        return {p: matmul_peak(DTYPES[p], args.device, sizes, args.peak_repeats)
                for p in precisions}

    peaks = probe()
    source = "given (--peak-tflops)" if args.peak_tflops > 0 else "matmul probe"
    print(f"peak ({source}): "
          + ", ".join(f"{p} {v / 1e12:.3f} TFLOP/s" for p, v in peaks.items()))
    results = []
    for shape, config in shapes(args).items():
        for precision in precisions:
            print(f"  {shape} {precision}: layers {config.n_layers}, hidden {config.hidden}, "
                  f"seq {config.seq_len}, batch {args.batch}", flush=True)
            result = bench_case(config, precision, args, gpus)
            result["shape"] = shape
            results.append(result)
            print(f"  done {shape} {precision} (load {load_average()})", flush=True)
    if args.peak_tflops <= 0:
        # The peak is re-measured at the end and the better value kept: background load on a
        # shared machine can only lower a measurement, and a low peak would inflate MFU.
        end = probe()
        peaks = {p: max(peaks[p], end[p]) for p in precisions}
        print("matmul peak (best of start/end): "
              + ", ".join(f"{p} {v / 1e12:.3f} TFLOP/s" for p, v in peaks.items()))
    print_table(results, peaks)
    print_plan(results)
    print(f"load average at end: {load_average()}")
    if args.json:
        saved = {k: str(v) if isinstance(v, torch.device) else v for k, v in vars(args).items()}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"peaks": peaks, "peak_source": source, "device": name,
                       "torch": torch.__version__, "transformers": hf_version,
                       "recipes": {f"{f} {p}": v for (f, p), v in RECIPES.items()},
                       "load_average": load_average(), "args": saved,
                       "results": results}, fh, indent=2, default=str)


if __name__ == "__main__":
    main()
