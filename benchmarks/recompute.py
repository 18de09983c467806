"""Peak memory and speed of `mt pretrain --recompute none | selective | full`, beside
`mt plan`'s prediction of each.

The run of benchmarks/loss_memory.py (GPT-2-small shape: 12 x 768, vocabulary 50257,
sequence 1024; one process, fp32, micro-batch 2, the chunked loss, 3 steps) at each
recomputation mode, alternated and repeated. Measured: the peak RSS of the run and tokens/s
(median of the steps after the first). Predicted: the estimator's peak for the same layout
plus the runtime's own memory (a run with a model of hidden size 8 and sequence 8, minus
the estimator's figure for it).

    PYTHONPATH=$(ls -d packages/*/src apps/*/src | tr '\\n' ':') python3 benchmarks/recompute.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from loss_memory import BASE, _load, _predicted, runtime_bytes  # noqa: E402 - the same run
from plan import _run  # noqa: E402 - benchmarks/plan.py's measured run

MODES = ("none", "selective", "full")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {_load()}, "
          f"{os.cpu_count()} cores")
    base = {k: v for k, v in BASE.items() if k != "activation_checkpointing"}
    with tempfile.TemporaryDirectory() as tmp:
        runtime = runtime_bytes({**base, "recompute": "none"}, Path(tmp))
        print(f"runtime (hidden 8, sequence 8): {runtime / 2**20:.0f} MB")
        print(f"{'recompute':<10} {'pred MB':>8} {'meas MB':>8} {'err':>6} | {'tok/s':>6}")
        for _ in range(args.repeats):
            for mode in MODES:
                rss, tps, _ = _run({**base, "chunked_loss": True, "recompute": mode},
                                   Path(tmp))
                pred = _predicted(True, recompute=mode) + runtime
                print(f"{mode:<10} {pred / 2**20:>8.0f} {rss / 2**20:>8.0f} "
                      f"{100 * (pred / rss - 1):>+5.1f}% | {tps:>6.1f}  {_load()}", flush=True)


if __name__ == "__main__":
    main()
