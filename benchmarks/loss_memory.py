"""Peak memory and speed of `mt pretrain` with the chunked loss and without, beside `mt plan`'s
prediction of each.

A GPT-2-small-shaped model (12 x 768, GPT-2's vocabulary of 50257, sequence 1024), one
process, fp32, micro-batch 2 (2048 tokens: each [b, s, vocab] float32 buffer is 412 MB),
full recomputation (so that the loss, not the stored activations, sets the peak), 3 steps:
`--chunked-loss` (the head and the loss in one, 64 MiB chunks) against
`--no-chunked-loss` (the logits, their float32 copy and gradient), alternated and repeated.
Measured: the peak RSS of the run (max RSS, benchmarks/plan.py's wrapper) and tokens/s
(median of the steps after the first). Predicted: the estimator's peak for the same layout
plus the runtime's own memory (a run of the same command with a model of hidden size 8 and
sequence 8, minus the estimator's figure for that model).

    PYTHONPATH=$(ls -d packages/*/src apps/*/src | tr '\\n' ':') python3 benchmarks/loss_memory.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from plan import _run  # noqa: E402 - benchmarks/plan.py's measured run

from mt_model import preset  # noqa: E402
from mt_plan import GPUSpec, ParallelLayout, estimate  # noqa: E402

BASE = {"model": "gpt2-small", "seq_len": 1024, "nproc": 1, "micro_batch_size": 2,
        "global_batch_size": 2, "train_steps": 3, "precision": "fp32",
        "activation_checkpointing": True, "eval_interval": 0}
#: Memory-only machine spec: the estimator's bytes do not depend on its speeds.
CPU = GPUSpec("cpu", 50e9, 24 * 2**30, 1e9, 1e9, 1, 10e9, fused_attention=True)


def _predicted(chunked: bool, hidden: int | None = None, seq: int | None = None,
               recompute: str = "full") -> float:
    """The estimator's peak bytes for BASE's run (``hidden`` / ``seq``: the runtime probe's
    micro model, micro-batch 1)."""
    gpt = preset("gpt2-small")
    if hidden is not None:
        gpt = gpt.replace(hidden=hidden, n_heads=1)
    if seq is not None:
        gpt = gpt.replace(seq_len=seq)
    else:
        gpt = gpt.replace(seq_len=BASE["seq_len"])
    micro = 1 if seq is not None else BASE["micro_batch_size"]
    layout = ParallelLayout(1, 1, 1, micro, micro, zero_stage=1, recompute=recompute,
                            precision="fp32", chunked_loss=chunked)
    return estimate(gpt, layout, CPU, 1.0).memory_per_gpu_gb * 1e9


def runtime_bytes(base: dict, workdir: Path) -> float:
    """The runtime's own resident memory: a run of ``base`` with a model of hidden size 8
    and sequence 8, minus the estimator's figure for that model."""
    small = {**base, "hidden": 8, "n_heads": 1, "seq_len": 8, "micro_batch_size": 1,
             "global_batch_size": 1, "chunked_loss": True}
    rss, _, _ = _run(small, workdir)
    return rss - _predicted(True, hidden=8, seq=8, recompute=base.get("recompute", "full"))


def _load() -> str:
    return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {_load()}, "
          f"{os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        runtime = runtime_bytes(BASE, Path(tmp))
        print(f"runtime (hidden 8, sequence 8): {runtime / 2**20:.0f} MB")
        print(f"{'loss':<10} {'pred MB':>8} {'meas MB':>8} {'err':>6} | {'model pred':>10} "
              f"{'meas':>6} {'err':>6} | {'tok/s':>6}")
        for _ in range(args.repeats):
            for chunked in (True, False):
                rss, tps, _ = _run({**BASE, "chunked_loss": chunked}, Path(tmp))
                model = _predicted(chunked)
                pred = model + runtime
                print(f"{'chunked' if chunked else 'full':<10} {pred / 2**20:>8.0f} "
                      f"{rss / 2**20:>8.0f} {100 * (pred / rss - 1):>+5.1f}% | "
                      f"{model / 2**20:>10.0f} {(rss - runtime) / 2**20:>6.0f} "
                      f"{100 * (model / (rss - runtime) - 1):>+5.1f}% | {tps:>6.1f}  "
                      f"{_load()}", flush=True)


if __name__ == "__main__":
    main()
