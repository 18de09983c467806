"""How far bf16 training drifts from fp32 with fp32 main gradients and without.

The contract matrix's tiny GPT-2 on its embedded corpus (`mt pretrain` through the contract
runner, so the runs are exactly the matrix's), one process, 50 steps of a global batch of 16
sequences in micro-batches of 1: 16 gradients summed per step. Three runs with the same seed
and data: fp32, bf16 with `--main-grads` (each micro-batch's bf16 gradient added into an fp32
buffer) and bf16 with `--no-main-grads` (summed in bf16). Printed: each bf16 run's distance
from the fp32 run (the contract runner's measure: the largest per-tensor relative L2 distance
of the parameters but for rows no gradient reaches, the worst relative difference of the
loss and of the gradient norm over the steps), then the bf16 noise floor both ways
(micro-batches of 2, 4, 8 against 1: what the contract matrix derives its tolerances from).

    PYTHONPATH=$(ls -d packages/*/src apps/*/src | tr '\\n' ':') python3 benchmarks/main_grads.py
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
from dataclasses import replace
from pathlib import Path

from mt_plan import ParallelLayout
from mt_pretrain.contract.matrix import Case
from mt_pretrain.contract.runner import GROUPINGS, MatrixRunner, compare, cpu_isa, run_case


def _layout(precision: str, main_grads: bool, global_batch: int) -> ParallelLayout:
    return ParallelLayout(1, 1, 1, global_batch, 1, zero_stage=0, recompute="none",
                          precision=precision, main_grads=main_grads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--micro-batches", type=int, default=16)
    parser.add_argument("--floor-steps", type=int, default=10)
    args = parser.parse_args()
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {cpu_isa()}, "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="mt-main-grads-") as tmp:
        root = Path(tmp)
        cache = root / "cache"
        skip = MatrixRunner(1, root).skip  # the contract's measure: no gradient-free rows
        runs = {}
        for name, precision, main in (("fp32", "fp32", True), ("bf16 main grads", "bf16", True),
                                      ("bf16 bf16 grads", "bf16", False)):
            case = Case(_layout(precision, main, args.micro_batches))
            runs[name] = run_case(case, args.steps, root / name.replace(" ", "-"), cache)
        print(f"\n{args.steps} steps, {args.micro_batches} micro-batches per step: distance "
              "from the fp32 run")
        for name in ("bf16 main grads", "bf16 bf16 grads"):
            d = compare(runs[name], runs["fp32"], skip)
            print(f"  {name}: params {d.params:.3e}  loss {d.loss:.3e}  "
                  f"grad norm {d.grad_norm:.3e}  (final loss {runs[name].records[-1]['loss']:.4f}"
                  f" vs {runs['fp32'].records[-1]['loss']:.4f})")
        print(f"\nbf16 noise floor ({args.floor_steps} steps, batch 8, micro-batches of "
              f"{'/'.join(map(str, GROUPINGS))} against 1; worst of them)")
        for main in (True, False):
            base = Case(_layout("bf16", main, 8))
            ref = run_case(base, args.floor_steps, root / f"floor-{main}", cache)
            diffs = [compare(run_case(base, args.floor_steps, root / f"floor-{main}-{mb}",
                                      cache, mb), ref, skip) for mb in GROUPINGS]
            worst = replace(diffs[0], loss=max(d.loss for d in diffs),
                            grad_norm=max(d.grad_norm for d in diffs),
                            params=max(d.params for d in diffs))
            print(f"  {'main grads' if main else 'bf16 grads'}: loss {worst.loss:.2e}  "
                  f"grad norm {worst.grad_norm:.2e}  params {worst.params:.2e}")


if __name__ == "__main__":
    main()
