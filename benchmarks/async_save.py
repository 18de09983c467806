"""Training time lost per checkpoint save: mt's foreground and background saves beside torch's
`torch.distributed.checkpoint` `save` and `async_save`, on the same state in the same run.

One process trains the GPT-2-small shape (12 x 768, vocabulary 50257; fp32 AdamW, so the
state is the weights plus two moments: about 1.5 GB) for --steps steps of --seq tokens, saving
every --every steps (never at the last: each save has --every steps of training after it to
hide behind); each side saves the same model and optimizer state dict:
- mt, foreground: `mt_checkpoint.save_rank` (one file, CRC-32C on the way, fsync), as
  `mt pretrain` without --async-save;
- mt, background: `mt_checkpoint.snapshot` to host memory on the training thread, then
  `save_rank` on `mt_checkpoint.BackgroundWrite`'s thread, as `mt pretrain --async-save`
  (a save waits for the one before it; the last is waited for before the clock stops);
- torch DCP `save` and `async_save` (its own staging to host memory and writer thread;
  the returned future is waited for before the next save and before the clock stops).
The figure is (time of the steps with saves - time of the same steps without) / saves, the
sides alternated and repeated (--repeats), medians printed; the bytes each side wrote are
printed beside it. Both sides fsync their files before they count as written (DCP's
`FileSystemWriter` syncs by default).

    PYTHONPATH=$(ls -d packages/*/src apps/*/src | tr '\\n' ':') python3 benchmarks/async_save.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from mt_checkpoint import BackgroundWrite, save_rank, snapshot
from mt_model import GPT, preset


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f} / {five:.1f}"


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


class Side:
    """One way to save: ``save(step, state)`` on the training thread, ``finish()`` at the
    end (what is still being written, waited for)."""

    def __init__(self, name: str, root: Path) -> None:
        self.name, self.root = name, root
        self.pending: Any = None
        self.writer = BackgroundWrite()

    def folder(self, step: int) -> Path:
        path = self.root / self.name / f"step-{step:08d}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def save(self, step: int, state: dict[str, Any]) -> None:
        folder = self.folder(step)
        if self.name == "mt-foreground":
            save_rank(folder, 0, (0, 0, 0), state["model"], state["optimizer"], {})
        elif self.name == "mt-background":
            model, opt = snapshot((state["model"], state["optimizer"]))
            self.writer.start(lambda: save_rank(folder, 0, (0, 0, 0), model, opt, {}))
        elif self.name == "dcp-save":
            dcp.save(state, checkpoint_id=str(folder))
        elif self.name == "dcp-async_save":
            if self.pending is not None:
                self.pending.result()  # like mt: a save waits for the one before it
            self.pending = dcp.async_save(state, checkpoint_id=str(folder))
        else:
            raise ValueError(self.name)

    def finish(self) -> None:
        self.writer.wait()
        if self.pending is not None:
            self.pending.result()
            self.pending = None


SIDES = ("mt-foreground", "mt-background", "dcp-save", "dcp-async_save")


def _train(steps: int, every: int, seq: int, save: Callable[[int, dict[str, Any]], None] | None,
           finish: Callable[[], None] | None) -> float:
    """Seconds of ``steps`` training steps (and the saves every ``every`` steps)."""
    torch.manual_seed(0)
    config = preset("gpt2-small").replace(seq_len=seq)
    model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (1, seq + 1))

    def step() -> None:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists, first-touch costs paid
    began = time.perf_counter()
    for i in range(1, steps + 1):
        step()
        if save is not None and i % every == 0 and i < steps:  # training goes on after it
            save(i, _state(model, opt))
    if finish is not None:
        finish()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=18)
    parser.add_argument("--every", type=int, default=6)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a "
                        "temporary folder on the same disk as /tmp)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # one core left to a writer
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {_load()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}; GPT-2 small, seq {args.seq}, "
          f"{args.steps} steps, a save every {args.every}")
    saves = (args.steps - 1) // args.every
    lost: dict[str, list[float]] = {name: [] for name in SIDES}
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        for repeat in range(args.repeats):
            order = SIDES if repeat % 2 == 0 else tuple(reversed(SIDES))
            base = _train(args.steps, args.every, args.seq, None, None)
            for name in order:
                side = Side(name, root)
                took = _train(args.steps, args.every, args.seq, side.save, side.finish)
                lost[name].append((took - base) / saves)
                sizes[name] = _size(root / name / f"step-{args.every:08d}")
                print(f"  repeat {repeat + 1}: {name:<15} {took:7.2f} s (no saves "
                      f"{base:.2f} s): {lost[name][-1]:.2f} s lost per save", flush=True)
                shutil.rmtree(root / name)
    print(f"training time lost per save (median of {args.repeats}), {_load()}:")
    fore = statistics.median(lost["mt-foreground"])
    for name in SIDES:
        value = statistics.median(lost[name])
        print(f"  {name:<15} {value:6.2f} s  ({value / fore:5.0%} of mt's foreground save; "
              f"{sizes[name] / 1e9:.2f} GB written)")


if __name__ == "__main__":
    sys.exit(main())
