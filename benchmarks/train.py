"""Single-process training throughput and MFU: mt against Hugging Face GPT-2 and Llama.

For each shape (``tiny``, a reduced GPT-2-small, ``llama-test`` and Llama 3.2 1B's block at
the reduced depth) and each precision (fp32, bf16) this times one full optimizer step
(forward, backward, clipping, AdamW) of

- **mt**: ``mt_model.GPT`` as one pipeline stage (``PipelineStage.forward_loss``, the
  function ``mt pretrain`` runs) inside ``mt_zero.ZeroOptimizer`` (ZeRO stage 1 on one
  process), with the optimizer of ``mt pretrain``: fused AdamW, lr 3e-3, betas 0.9/0.95,
  weight decay 0.1 on matrices, clip 1.0. bf16 means bf16 parameters and compute with fp32
  master weights and optimizer state;
- **mt+compile**: the same with ``mt pretrain --compile`` (``torch.compile`` of
  ``forward_loss``; compilation happens in the warm-up step and is not timed);
- **hf**: ``transformers.GPT2LMHeadModel`` (``LlamaForCausalLM`` for the Llama shapes;
  sdpa attention) with the same config, the
  same initial weights (copied from mt by the ``mt convert`` name mapping), the same
  batches, loss, AdamW parameter groups and clipping, and fused AdamW (the HF Trainer's
  default optimizer, ``adamw_torch_fused``, on torch >= 2.8). bf16 means the usual HF
  recipe: fp32 weights under ``torch.autocast("cpu", torch.bfloat16)``.

Steps of the frameworks are interleaved (mt, hf, ... in rotating order) after warmup so
that background load hits all alike; best and median step time are reported. MFU is model
FLOP/s (``mt_model.model_flops_per_token_training``: 6N + 12 l h s per token) over this
machine's matmul peak in that dtype, measured at the start and at the end (the better kept).
Example (2 cores, about 5 minutes)::

    PYTHONPATH=$(ls -d packages/*/src apps/*/src | tr '\\n' ':') \\
        python3 benchmarks/train.py --steps 8 --json /tmp/train_bench.json

Targets (issue 9): fp32 mt/hf >= 1.0; bf16 mt(bf16) / hf(autocast) >= 2.0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mt_convert.hf_config import hf_config_from_gpt, hf_name
from mt_model import GPT, TIED_WEIGHT, GPTConfig, model_flops_per_token_training, preset
from mt_pipeline import ModelLayout, PipelineConfig, build_stage, plan_pipeline
from mt_plan.mfu import measure_peak_flops
from mt_zero import ZeroConfig, ZeroOptimizer, decay_param_groups

LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 3e-3, (0.9, 0.95), 1e-8, 0.1, 1.0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TARGETS = {"fp32": 1.0, "bf16": 2.0}

Batch = tuple[torch.Tensor, torch.Tensor]


# ----------------------------------------------------------------------------- machine
def matmul_peak(dtype: torch.dtype, sizes: tuple[int, ...], repeats: int) -> float:
    """Best FLOP/s of square matmuls in ``dtype`` over ``sizes``: ``mt pretrain``'s own MFU
    probe (best of ``repeats`` each), at several sizes."""
    return max(measure_peak_flops(dtype, torch.device("cpu"), n, repeats) for n in sizes)


def load_average() -> str:
    """The 1/5/15-minute load averages (other processes compete for the 2 cores)."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


# -------------------------------------------------------------------------- frameworks
@dataclass
class Runner:
    """One framework's training step and its measurements."""

    name: str
    step: Callable[[Batch], float]
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def run(self, batch: Batch, timed: bool) -> None:
        start = time.perf_counter()
        loss = self.step(batch)
        elapsed = time.perf_counter() - start
        self.losses.append(loss)
        if timed:
            self.times.append(elapsed)


def mt_runner(config: GPTConfig, precision: str, seed: int, compiled: bool
              ) -> tuple[Runner, GPT]:
    """mt's step: the model as one pipeline stage in the ZeRO wrapper (stage 1, one
    process) with fused AdamW, as ``mt pretrain`` (``--compile`` when ``compiled``)."""
    model = GPT(config, seed=seed)
    reference = GPT(config, seed=None)
    reference.load_state_dict(model.state_dict())  # fp32 init, before ZeRO casts to bf16
    layout = ModelLayout(tied_weight=TIED_WEIGHT if config.tied_embeddings else None)
    stage = build_stage(model, plan_pipeline(PipelineConfig(), config.n_layers, 1).stages[0],
                        layout)
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

    return Runner("mt+compile" if compiled else "mt", step), reference


def hf_llama(config: GPTConfig, source: GPT) -> nn.Module:
    """``LlamaForCausalLM`` equal to ``source`` (a Llama-shaped mt GPT): q / [k; v] and
    [gate; up] split into HF's separate projections."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden,
        intermediate_size=config.ffn_hidden, num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
        max_position_embeddings=config.seq_len, rms_norm_eps=config.layernorm_eps,
        rope_theta=config.rope_theta, tie_word_embeddings=config.tied_embeddings,
        attention_bias=False, mlp_bias=False, use_cache=False)
    hf_config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(hf_config)
    mt = source.state_dict()
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


def hf_model(config: GPTConfig, source: GPT) -> nn.Module:
    """The transformers model equal to ``source``: ``GPT2LMHeadModel`` (config and weights
    via mt_convert names) for the GPT-2 block, ``LlamaForCausalLM`` for a Llama shape."""
    if config.architecture != "gpt2":
        return hf_llama(config, source)
    from transformers import GPT2Config, GPT2LMHeadModel

    body = hf_config_from_gpt(config, torch.float32)
    body.pop("mt")
    body.update(use_cache=False, attn_implementation="sdpa")
    model = GPT2LMHeadModel(GPT2Config(**body))
    state = {}
    for name, tensor in source.state_dict().items():
        key, transposed = hf_name(name)
        state["transformer." + key] = tensor.t().contiguous() if transposed else tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to wte
    if missing or unexpected:
        raise RuntimeError(f"HF state dict mismatch: missing {missing}, unexpected {unexpected}")
    if model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr():
        raise RuntimeError("HF lm_head is not tied to wte")
    return model


def hf_runner(config: GPTConfig, precision: str, source: GPT) -> Runner:
    """HF's step: fp32 weights; bf16 through autocast (the standard HF CPU recipe); fused
    AdamW as the HF Trainer's default."""
    model = hf_model(config, source)
    model.train()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(decay_param_groups(params, WEIGHT_DECAY), lr=LR, betas=BETAS,
                            eps=EPS, fused=True)
    autocast = precision == "bf16"

    def step(batch: Batch) -> float:
        idx, targets = batch
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=idx).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return Runner("hf", step)


# ------------------------------------------------------------------------------ driver
def make_batches(config: GPTConfig, batch: int, count: int, seed: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def bench_case(config: GPTConfig, precision: str, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, then interleave timed steps of mt, mt+compile and hf on identical batches."""
    mt, reference = mt_runner(config, precision, args.seed, compiled=False)
    hf = hf_runner(config, precision, reference)
    del reference
    runners = [mt, hf]
    if not args.no_compile:
        runners.insert(1, mt_runner(config, precision, args.seed, compiled=True)[0])
    batches = make_batches(config, args.batch, args.warmup + args.steps, args.seed)
    for i, batch in enumerate(batches):
        timed = i >= args.warmup
        shift = i % len(runners)  # none always runs first
        for runner in runners[shift:] + runners[:shift]:
            runner.run(batch, timed)
    tokens = args.batch * config.seq_len
    flops_per_token = model_flops_per_token_training(config)
    result: dict[str, Any] = {"precision": precision, "tokens_per_step": tokens,
                              "flops_per_token": flops_per_token}
    for runner in runners:
        best, median = min(runner.times), statistics.median(runner.times)
        result[runner.name] = {
            "best_tokens_per_s": tokens / best, "median_tokens_per_s": tokens / median,
            "first_loss": runner.losses[0], "last_loss": runner.losses[-1],
        }
    result["first_loss_rel_diff"] = abs(mt.losses[0] - hf.losses[0]) / abs(hf.losses[0])
    return result


def shapes(args: argparse.Namespace) -> dict[str, GPTConfig]:
    small = preset("gpt2-small").replace(n_layers=args.small_layers, seq_len=args.small_seq)
    # Llama 3.2 1B's block (2048 wide, 32 query / 8 key-value heads, SwiGLU 8192) at the same
    # depth and sequence as the GPT-2 shape, with the 1k vocabulary: block-dominated.
    llama = preset("llama-3.2-1b").replace(n_layers=args.small_layers, seq_len=args.small_seq,
                                           vocab_size=1000, tied_embeddings=False)
    return {"tiny": preset("tiny"), f"gpt2-small-l{args.small_layers}s{args.small_seq}": small,
            "llama-test": preset("llama-test"),
            f"llama-1b-block-l{args.small_layers}s{args.small_seq}": llama}


def print_table(results: list[dict[str, Any]], peaks: dict[str, float]) -> None:
    """One row per (shape, precision, mt variant): tokens/s and MFU against hf's."""
    header = (f"{'shape':<22}{'prec':<6}{'mt variant':<12}{'mt tok/s':>10}{'hf tok/s':>10}"
              f"{'ratio':>7}{'(med)':>7}{'target':>9}{'mt MFU':>8}{'hf MFU':>8}"
              f"{'loss0 mt/hf':>18}")
    print(header)
    print("-" * len(header))
    for r in results:
        peak, hf = peaks[r["precision"]], r["hf"]
        target = TARGETS[r["precision"]]
        hf_mfu = hf["best_tokens_per_s"] * r["flops_per_token"] / peak
        for variant in ("mt", "mt+compile"):
            if variant not in r:
                continue
            mt = r[variant]
            ratio = mt["best_tokens_per_s"] / hf["best_tokens_per_s"]
            ratio_med = mt["median_tokens_per_s"] / hf["median_tokens_per_s"]
            mfu = mt["best_tokens_per_s"] * r["flops_per_token"] / peak
            mark = "ok" if ratio >= target else "MISS"
            print(f"{r['shape']:<22}{r['precision']:<6}{variant:<12}"
                  f"{mt['best_tokens_per_s']:>10.0f}{hf['best_tokens_per_s']:>10.0f}"
                  f"{ratio:>7.2f}{ratio_med:>7.2f}{target:>5.1f}{mark:>4}{mfu:>8.1%}"
                  f"{hf_mfu:>8.1%}{mt['first_loss']:>9.4f}/{hf['first_loss']:.4f}")
            mt.update(ratio_best=ratio, ratio_median=ratio_med, mfu=mfu)
        hf["mfu"] = hf_mfu


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=6, help="timed steps per framework")
    p.add_argument("--small-layers", type=int, default=2)
    p.add_argument("--small-seq", type=int, default=256)
    p.add_argument("--shapes", default="", help="comma-separated subset (default: all)")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--no-compile", action="store_true", help="leave out mt+compile")
    p.add_argument("--peak-sizes", default="512,1024,2048")
    p.add_argument("--peak-repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default="", help="also write the results to this file")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    precisions = args.precisions.split(",")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load average {load_average()}")
    sizes = tuple(int(s) for s in args.peak_sizes.split(","))
    peaks = {p: matmul_peak(DTYPES[p], sizes, args.peak_repeats) for p in precisions}
    print("matmul peak: " + ", ".join(f"{p} {v / 1e9:.1f} GFLOP/s" for p, v in peaks.items()))
    wanted = [s for s in args.shapes.split(",") if s]
    results = []
    for shape, config in shapes(args).items():
        if wanted and not any(shape.startswith(w) for w in wanted):
            continue
        for precision in precisions:
            result = bench_case(config, precision, args)
            result["shape"] = shape
            results.append(result)
            print(f"  done {shape} {precision} (load {load_average()})", flush=True)
    # The peak is re-measured at the end and the better value kept: background load on a
    # shared machine can only lower a measurement, and a low peak would inflate MFU.
    end = {p: matmul_peak(DTYPES[p], sizes, args.peak_repeats) for p in precisions}
    peaks = {p: max(peaks[p], end[p]) for p in precisions}
    print("matmul peak (best of start/end): "
          + ", ".join(f"{p} {v / 1e9:.1f} GFLOP/s" for p, v in peaks.items()))
    print_table(results, peaks)
    print(f"load average at end: {load_average()}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"peaks": peaks, "load_average": load_average(), "args": vars(args),
                       "results": results}, fh, indent=2)


if __name__ == "__main__":
    main()
