"""Training time lost per checkpoint save: mt's foreground and background saves beside torch's
`torch.distributed.checkpoint` `save` and `async_save`, on the same state in the same run.

One process trains the GPT-2-small shape (12 x 768, vocabulary 50257; fp32 AdamW, so the
state is the weights plus two moments: about 1.5 GB) for --steps steps of --batch sequences of
--seq tokens, saving every --every steps (never at the last: each save has --every steps of
training after it to hide behind); each side saves the same model and optimizer state dict.
On --device cuda the weights and moments live on the GPU, the forward runs under bf16 autocast,
each step ends with a synchronize (as a loop that logs its loss does), and the host copies are
pinned on both sides that keep them (mt's shared buffers registered with CUDA; DCP's stager
with pinned shared memory). The sides:
- mt, foreground: `mt_checkpoint.save_rank` (one file, CRC-32C on the way, fsync), as
  `mt pretrain` without --async-save;
- mt, background: `mt_checkpoint.HostBuffers.start` of the rank file's payload (host
  memory reused from save to save; the copies made by a thread during the next step's
  forward and backward, waited for before its optimizer step), then `save_payload` in
  `mt_checkpoint.BackgroundWrite`'s writer process, as `mt pretrain --async-save` (a save
  waits for the one before it; the last is waited for before the clock stops);
- torch DCP `save`, and `async_save` twice: as torch defaults it (its writer a thread, fresh
  staging memory each save), and with its writer a process (`AsyncCheckpointerType.PROCESS`)
  and its staging kept in shared memory from save to save and made in the background
  (`DefaultStager` with `use_shared_memory` and `use_async_staging`, its staging waited for
  before the optimizer step), mt's own arrangement; the write's future is waited for before
  the next save and before the clock stops.
Every side saves once before the clock starts (first-save costs paid: host memory touched,
writer processes started), as training's first step is taken before it. The figure is what
the saves cost the training loop: the seconds each save call blocked it (and the wait for the
last write at the end), plus what the steps that began while a write was in flight took
beyond the median step of the same run, per save; the sides alternated and repeated
(--repeats), medians printed; the bytes each side wrote are printed beside it. Both
sides fsync their files before they count as written (DCP's `FileSystemWriter` syncs by
default).

    PYTHONPATH=$(ls -d packages/*/src apps/*/src | tr '\\n' ':') python3 benchmarks/async_save.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from mt_checkpoint import (
    BackgroundWrite,
    HostBuffers,
    Snapshot,
    rank_payload,
    save_payload,
    save_rank,
)
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

    def __init__(self, name: str, root: Path, device: torch.device) -> None:
        self.name, self.root, self.device = name, root, device
        self.pending: Any = None
        self.copying: tuple[Snapshot, Path] | None = None
        self.writer = BackgroundWrite()
        self.buffers = HostBuffers()
        self.stager: DefaultStager | None = None

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
            self.writer.wait()  # like mt pretrain: a save waits for the one before it
            self.copying = (self.buffers.start(
                rank_payload(0, (0, 0, 0), state["model"], state["optimizer"], {})), folder)
        elif self.name == "dcp-save":
            dcp.save(state, checkpoint_id=str(folder))
        elif self.name.startswith("dcp-async_save"):
            if self.pending is not None:
                _upload(self.pending).result()  # like mt: a save waits for the one before it
            if self.name == "dcp-async_save":
                self.pending = dcp.async_save(state, checkpoint_id=str(folder))
            else:
                if self.stager is None:
                    self.stager = DefaultStager(StagingOptions(
                        use_pinned_memory=self.device.type == "cuda",
                        use_shared_memory=True, use_async_staging=True,
                        use_non_blocking_copy=self.device.type == "cuda"))
                self.pending = dcp.async_save(
                    state, checkpoint_id=str(folder), async_stager=self.stager,
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        else:
            raise ValueError(self.name)

    def settle(self) -> None:
        """Before the optimizer changes the state: the copies of it made (mt's snapshot,
        then handed to its writer; DCP's staging)."""
        if self.copying is not None:
            snapshot, folder = self.copying
            self.copying = None
            self.writer.start(save_payload, folder, 0, snapshot.result())
        staged = getattr(self.pending, "staging_completion", None)
        if staged is not None:
            staged.result()

    def finish(self) -> None:
        self.settle()
        self.writer.wait()
        if self.pending is not None:
            _upload(self.pending).result()
            self.pending = None

    def in_flight(self) -> bool:
        """Whether a background copy or write is still running (never blocks)."""
        if self.name == "mt-background":
            return self.copying is not None or self.writer.running
        return self.pending is not None and not _upload(self.pending).done()

    def close(self) -> None:
        self.writer.close()
        if self.stager is not None:
            self.stager.close()


SIDES = ("mt-foreground", "mt-background", "dcp-save", "dcp-async_save",
         "dcp-async_save-process")


@dataclass
class Timing:
    """One side's run: seconds the saves blocked the training loop, the steps' seconds and
    whether a write was in flight when each began."""

    blocked: float = 0.0
    steps: list[float] = field(default_factory=list)
    during_write: list[bool] = field(default_factory=list)

    def lost(self, saves: int) -> float:
        """Training seconds lost per save: the blocking, plus what the steps that began
        during a write took beyond the median of the run's other steps."""
        clean = statistics.median(t for t, w in zip(self.steps, self.during_write) if not w)
        slowed = sum(t - clean for t, w in zip(self.steps, self.during_write) if w)
        return (self.blocked + slowed) / saves


def _upload(pending: Any) -> Any:
    """The future of a DCP ``async_save``'s write (its response holds two with async
    staging)."""
    return getattr(pending, "upload_completion", pending)


def _trainer(batch: int, seq: int, device: torch.device
             ) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[..., None]]:
    """The GPT-2-small model, its AdamW and one training step on fixed tokens (with the
    call to make before the optimizer's update)."""
    torch.manual_seed(0)
    config = preset("gpt2-small").replace(seq_len=seq)
    model = GPT(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), device=device)
    cuda = device.type == "cuda"

    def step(before_update: Callable[[], None] = lambda: None) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        before_update()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)

    return model, opt, step


def _same_bytes(root: Path, batch: int, seq: int, device: torch.device) -> bool:
    """Whether mt's background save (host snapshot, writer process) writes the foreground
    save's file byte for byte, for the state after one step on ``device``."""
    model, opt, step = _trainer(batch, seq, device)
    step()
    state = _state(model, opt)
    fore, back = root / "same-fore", root / "same-back"
    fore.mkdir()
    back.mkdir()
    save_rank(fore, 0, (0, 0, 0), state["model"], state["optimizer"], {})
    writer = BackgroundWrite()
    try:
        writer.start(save_payload, back, 0, HostBuffers().snapshot(
            rank_payload(0, (0, 0, 0), state["model"], state["optimizer"], {})))
        writer.wait()
    finally:
        writer.close()
    files = sorted(f.name for f in fore.iterdir())
    same = files == sorted(f.name for f in back.iterdir()) and all(
        (fore / name).read_bytes() == (back / name).read_bytes() for name in files)
    shutil.rmtree(fore)
    shutil.rmtree(back)
    return same


def _train(steps: int, every: int, batch: int, seq: int, side: Side) -> Timing:
    """``steps`` training steps and the saves every ``every`` steps, timed."""
    model, opt, step = _trainer(batch, seq, side.device)

    step()  # the optimizer's state exists, first-touch costs paid
    side.save(0, _state(model, opt))  # and so are the first save's
    side.finish()
    timing = Timing()
    for i in range(1, steps + 1):
        timing.during_write.append(side.in_flight())
        began = time.perf_counter()
        step(side.settle)
        timing.steps.append(time.perf_counter() - began)
        if i % every == 0 and i < steps:  # training goes on after it
            began = time.perf_counter()
            side.save(i, _state(model, opt))
            timing.blocked += time.perf_counter() - began
    began = time.perf_counter()
    side.finish()
    timing.blocked += time.perf_counter() - began
    return timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=18)
    parser.add_argument("--every", type=int, default=6)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (the state on the GPU)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a "
                        "temporary folder on the same disk as /tmp)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # one core left to a writer
    # A process group of one: DCP's process-based writer joins it from its own process.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {_load()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, {_device_name(device)}; GPT-2 "
          f"small, {args.batch} x {args.seq} tokens a step, {args.steps} steps, a save every "
          f"{args.every}")
    saves = (args.steps - 1) // args.every
    lost: dict[str, list[float]] = {name: [] for name in SIDES}
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        print(f"  mt's background file == its foreground file, byte for byte: "
              f"{_same_bytes(root, args.batch, args.seq, device)}", flush=True)
        for repeat in range(args.repeats):
            order = SIDES if repeat % 2 == 0 else tuple(reversed(SIDES))
            for name in order:
                side = Side(name, root, device)
                try:
                    timing = _train(args.steps, args.every, args.batch, args.seq, side)
                finally:
                    side.close()
                lost[name].append(timing.lost(saves))
                sizes[name] = _size(root / name / f"step-{args.every:08d}")
                slowed = sum(timing.during_write)
                print(f"  repeat {repeat + 1}: {name:<22} {sum(timing.steps):6.2f} s of steps "
                      f"({slowed} during a write), {timing.blocked:5.2f} s blocked: "
                      f"{lost[name][-1]:.2f} s lost per save", flush=True)
                shutil.rmtree(root / name)
    dist.destroy_process_group()
    print(f"training time lost per save (median of {args.repeats}), {_load()}:")
    fore = statistics.median(lost["mt-foreground"])
    for name in SIDES:
        value = statistics.median(lost[name])
        print(f"  {name:<22} {value:6.2f} s  ({value / fore:5.0%} of mt's foreground save; "
              f"{sizes[name] / 1e9:.2f} GB written)")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
