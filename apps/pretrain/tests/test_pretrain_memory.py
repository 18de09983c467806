"""Peak memory: reading this process's (RSS on CPU, the caching allocator on CUDA), and a real
2-process gloo run whose metrics lines, progress lines and summary carry every rank's peak
beside the planner's estimate; the --dry-run line saying what the run will report; CPU ranks
giving freed blocks back to the system (glibc's mmap threshold)."""

from __future__ import annotations

import io
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from mt_plan.memory import (
    GIB,
    MemoryPeaks,
    device_memory,
    gather_memory,
    map_large_blocks,
    read_memory,
    summary_line,
)
from mt_pretrain.cli.pretrain import pretrain_main
from mt_pretrain.config.load import load_config
from mt_pretrain.config.resolve import describe, fullest_stage_memory, resolve
from mt_pretrain.run.metrics import read_metrics
from mt_pretrain.run.progress import Reporter

MB = 2**20
RUN = {"model": "tiny", "seq_len": 32, "micro_batch_size": 2, "global_batch_size": 4,
       "train_steps": 3, "eval_interval": 0, "sample_tokens": 0, "progress": False,
       "log_interval": 1, "nproc": 2, "tp": 1, "pp": 1, "device": "cpu", "save": "none",
       "timeout": 120.0}


def test_memory_reading_on_cpu_is_rss_and_sees_a_200mb_tensor() -> None:
    before = read_memory("cpu")
    assert before.source == "rss" and before.reserved is None
    assert before.peak >= before.current > 0
    block = torch.ones(200 * MB // 4)  # 200 MB of float32, every page written
    after = read_memory("cpu")
    del block
    assert after.current >= before.current + 150 * MB
    # The peak holds the tensor even when earlier tests of this process peaked higher.
    assert after.peak >= max(before.peak, before.current + 150 * MB)
    assert read_memory("cpu").peak >= after.peak  # never falls


def test_gather_memory_without_process_group_is_this_process() -> None:
    peaks = gather_memory("cpu")
    assert peaks.source == "rss" and len(peaks.peak) == 1 and peaks.reserved is None
    line = peaks.metrics()
    assert line["peak_mem_gib"] == line["peak_mem_gib_per_rank"][0] > 0
    assert line["mem_source"] == "rss" and "peak_reserved_gib" not in line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_memory_reading_on_cuda_is_the_allocator() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    before = read_memory(device)
    block = torch.empty(200 * MB // 4, device=device)
    after = read_memory(device)
    del block
    assert after.source == "cuda-allocator"
    assert after.peak >= before.current + 200 * MB and after.reserved >= after.peak
    line = gather_memory(device).metrics()
    assert line["peak_reserved_gib"] >= line["peak_mem_gib"] > 0
    assert line["mem_source"] == "cuda-allocator"


def test_summary_line_names_source_max_and_ranks() -> None:
    peaks = MemoryPeaks("rss", [0.41 * GIB, 0.40 * GIB], [0.3 * GIB, 0.3 * GIB])
    text = summary_line(peaks, 0.031 * GIB, 0)
    assert text.startswith("memory     peak RSS 0.410 GiB (max over 2 ranks; per rank "
                           "0.41, 0.40); planned 0.031 GiB per rank (stage 0, the fullest)")
    assert "Python interpreter and torch" in text
    cuda = MemoryPeaks("cuda-allocator", [1.5 * GIB], [1.0 * GIB], [2.0 * GIB])
    assert summary_line(cuda).startswith("memory     peak allocated 1.500 GiB (max over 1 "
                                         "rank; per rank 1.50), peak reserved 2.000 GiB")


def test_progress_line_shows_memory() -> None:
    out = io.StringIO()
    reporter = Reporter(1, 0, True, False, 1, console=Console(file=out, width=300))

    class Stats:
        step, loss, lr, tokens_per_s, tflops_per_rank, grad_norm = 1, 5.0, 1e-3, 1e3, 0.5, 1.0
        mfu, peak_mem_gib = 0.1, 1.234

    reporter.step(Stats())
    assert "GFLOP/s/rank mem 1.23 GiB" in out.getvalue()


def test_two_rank_run_reports_peak_memory(tmp_path: Path, cache: Path,
                                          capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    overrides = {**RUN, "out_dir": str(out), "cache_dir": str(cache)}
    assert pretrain_main(None, overrides, environ={}) == 0
    text = capfd.readouterr().out
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    previous = [0.0, 0.0]
    for r in records:
        per_rank = r["peak_mem_gib_per_rank"]
        assert r["mem_source"] == "rss" and "peak_reserved_gib" not in r
        assert len(per_rank) == 2 and all(v > 0 for v in per_rank)
        assert r["peak_mem_gib"] == max(per_rank) > 0
        assert all(v >= p for v, p in zip(per_rank, previous))  # peaks never fall
        previous = per_rank
    # Every progress line (log interval 1) and the summary show it.
    steps = [line for line in text.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all(re.search(r" mem \d+\.\d\d GiB", s) for s in steps)
    summary = next(line for line in text.splitlines() if line.startswith("memory "))
    match = re.match(r"memory     peak RSS (\d+\.\d+) GiB \(max over 2 ranks; per rank "
                     r"(\d+\.\d\d), (\d+\.\d\d)\); planned (\d+\.\d+) GiB per rank", summary)
    assert match, summary
    peak, planned = float(match[1]), float(match[4])
    assert peak >= records[-1]["peak_mem_gib"] - 1e-3  # the end of run: at least the last step
    config = load_config(None, overrides)
    _, estimate = fullest_stage_memory(resolve(config, 2), "cpu")
    assert planned == pytest.approx(estimate["total"] / GIB, abs=1e-3)
    assert peak > planned  # RSS: the model plus the interpreter and torch


def test_dry_run_says_what_the_run_measures() -> None:
    config = load_config(None, {**RUN, "pp": 2})
    text = describe(config, resolve(config, 2))
    assert "measured   the run reports each rank's peak RSS" in text
    config = load_config(None, {**RUN, "device": "cuda"})
    assert "peak memory allocated by torch's CUDA caching allocator" in describe(
        config, resolve(config, 2))


def test_a_run_that_does_not_fit_this_machine_is_refused_before_its_ranks(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """--seq-len 100000000 (~3,000 GiB per rank): one line with the estimate and this
    machine's memory (which its ranks share), exit 2, before any rank starts (no run
    folder); was a 215-line traceback of the first allocation."""
    out = tmp_path / "run"
    ram = device_memory("cpu")[1]
    for nproc in (1, 2):
        overrides = {**RUN, "seq_len": 100_000_000, "nproc": nproc, "out_dir": str(out)}
        _, estimate = fullest_stage_memory(resolve(load_config(None, overrides), nproc), "cpu")
        assert estimate["total"] > 3000 * GIB
        each = f"~{estimate['total'] / GIB:.3f} GiB"
        need = f"{each} per rank (stage 0)" if nproc == 1 else (
            f"~{2 * estimate['total'] / GIB:.3f} GiB for its 2 ranks on this host (up to "
            f"{each} a rank, stage 0)")
        assert pretrain_main(None, overrides, environ={}) == 2
        error = " ".join(capfd.readouterr().err.split())
        assert error == (
            f"error: invalid layout: the plan needs {need}, more than {ram}; use a smaller "
            "--seq-len, --micro-batch-size or model, recomputation, or more machines"), error
        assert not out.exists()


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_failed_allocation_in_a_rank_is_one_line_and_exit_1(
        nproc: int, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """An allocation torch's CPU allocator refuses inside a rank (1 PiB, while the engine is
    built): one line naming the rank and the bytes asked for, exit 1 (the run failed, the
    input was fine), no traceback; in-process and from a spawned rank alike."""
    import mt_pretrain.run.rank as rank

    def greedy(*_args: object) -> None:
        torch.empty(2**50, dtype=torch.uint8)

    monkeypatch.setattr(rank, "make_engine", greedy)  # forked ranks inherit it
    overrides = {**RUN, "nproc": nproc, "out_dir": str(tmp_path / "run"),
                 "cache_dir": str(cache)}
    assert pretrain_main(None, overrides, environ={}) == 1
    text = capfd.readouterr()
    error = " ".join(text.err.split())
    assert re.fullmatch(
        rf"error: rank [01] of {nproc} ran out of memory on cpu: an allocation of "
        r"1,048,576\.000 GiB failed \(the plan: ~0\.0\d\d GiB per rank, stage 0; the "
        rf"[\d.]+ GiB of RAM here{', 2 ranks' if nproc == 2 else ''}\); free memory for the "
        r"run, or use a smaller --seq-len, --micro-batch-size or model, recomputation, or "
        r"more machines", error), error
    assert "Traceback" not in text.out + text.err


# In a fresh interpreter: (optionally) a 1-step `mt pretrain` on CPU in this process, then
# 100 blocks of 1 MiB, each followed by a small live one, and the RSS the 1 MiB ones give
# back when freed. An 8 MiB block freed first raises glibc's own threshold past 1 MiB, as a
# training step's activations do.
_PROBE = """
import os, sys, tempfile, torch
def _current_rss():  # as mt_plan.memory reads it; the control imports torch alone (more
    # imports leave holes in the heap that the small blocks fill, and glibc trims the rest)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
if sys.argv[1] == "run":
    from mt_pretrain.config.load import load_config
    from mt_pretrain.launch import launch
    with tempfile.TemporaryDirectory() as tmp:
        launch(load_config(None, {"model": "tiny", "seq_len": 16, "micro_batch_size": 1,
                                  "global_batch_size": 1, "train_steps": 1, "nproc": 1,
                                  "eval_interval": 0, "sample_tokens": 0, "progress": False,
                                  "save": "none", "device": "cpu", "out_dir": tmp,
                                  "cache_dir": tmp}), environ={})
torch.empty(8 << 20, dtype=torch.uint8).fill_(1)
big, small = [], []
for _ in range(100):
    big.append(torch.ones(256 * 1024))
    small.append(torch.ones(1024))
before = _current_rss()
del big
print((before - _current_rss()) / 2**20)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_cpu_training_ranks_give_freed_blocks_back() -> None:
    """A CPU rank maps every block of 64 KiB or more on its own (mt_plan.memory): freed
    activations leave the RSS, which then follows the live bytes `mt plan` counts (glibc's
    default keeps them in its heap: peak RSS 13-21% above the plan at CP 2 and 4 in
    benchmarks/cp.py). Measured here: 98-100 of 100 MiB given back after a run, 0 without one;
    a threshold the user set wins."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))}
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in sys.path if p)

    def freed_mib(mode: str) -> float:
        done = subprocess.run([sys.executable, "-c", _PROBE, mode], env=env, timeout=300,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        return float(done.stdout.split()[-1])

    assert freed_mib("run") >= 90.0
    assert freed_mib("none") < 50.0  # the run is what changed it
    assert not map_large_blocks({"MALLOC_MMAP_THRESHOLD_": "1048576"})
    assert not map_large_blocks({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"})
