"""`mt pretrain --engine deepspeed` trains like `--engine mt`: the same per-step losses on
the same global batches of the embedded corpus (tiny preset, sequence 32, global batch 8,
fp32, dropout 0).

- tp = pp = 1, DP 2 (2 ranks x 2 micro-batches x 2), DeepSpeed ZeRO 1-3, 10 steps,
  validation at step 5. Measured: every step's loss within 4e-8 relative of mt's (ZeRO 1, 2
  and 3), validation loss equal; asserted 1e-5. bf16 and more layouts: the matrix
  (test_contract_matrix.py) compares DeepSpeed rows with one process, grad norms and
  parameters included, with tolerances derived from the bf16 noise floor.
- TP 2 x PP 2 x DP 2, ZeRO-1, 8 processes through DeepSpeed's PipelineModule and
  PipelineEngine (mt's TP layers inside) against mt on one process. Measured: within
  9.7e-8 relative over 20 steps; asserted 1e-5, the documented tolerance.
- TP 2 x DP 2 ZeRO 1-3 + sequence parallel (DeepSpeedEngine with mt's groups as mpu) vs one
  process, the replicated gradients summed over TP once per step (traced).
- Exact resume from DeepSpeed checkpoints (DP 2 with ZeRO 1 and 3; the 3D layout).

DeepSpeed's environment (LOCAL_RANK...) is set by the app inside the rank processes, never in
this process; only DS_ACCELERATOR=cpu is set here, where `--nproc` imports DeepSpeed once
before forking the ranks of a CPU run (`DeepSpeedEngine.preload`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from conftest import run_pretrain

from mt_checkpoint import MANIFEST, CheckpointError
from mt_pretrain.config.load import load_config
from mt_pretrain.config.schema import ConfigError

STEPS = 10
COMMON: dict[str, Any] = {
    "model": "tiny", "seq_len": 32, "dropout": 0.0, "micro_batch_size": 2,
    "global_batch_size": 8, "train_steps": STEPS, "eval_interval": 5, "eval_iters": 1,
    "sample_tokens": 4, "progress": False, "log_interval": 100, "timeout": 120.0,
    "nproc": 2, "tp": 1, "pp": 1,
}


_run = partial(run_pretrain, COMMON)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Any:
    """mt's own engine (its ZeRO stages agree to fp32 round-off, tested in mt-zero)."""
    return _run(tmp_path_factory.mktemp("mt"), cache, engine="mt", zero_stage=1, save="none")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_pretrain_deepspeed_matches_mt_engine(stage: int, reference: Any, cache: Path,
                                              tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    ds = _run(tmp_path, cache, engine="deepspeed", zero_stage=stage)
    assert len(ds.losses) == len(reference.losses) == STEPS
    for step, (a, b) in enumerate(zip(reference.losses, ds.losses), start=1):
        assert b == pytest.approx(a, rel=1e-5), f"ZeRO-{stage} step {step}: {a} vs {b}"
    assert ds.val_loss == pytest.approx(reference.val_loss, rel=1e-5)
    assert ds.losses[-1] < ds.losses[0] - 0.4  # it learns (10 steps: 7.00 -> 6.54)
    # The greedy continuation of the same weights: the same text (the prompt is only its
    # beginning, so compare all of it).
    assert ds.sample is not None and ds.sample == reference.sample
    assert len(ds.sample) > len("The whale")
    # DeepSpeed-format checkpoint of the last step, its `latest` tag written last.
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == f"step-{STEPS:08d}"
    assert ds.checkpoint == str(root / f"step-{STEPS:08d}")
    assert len(list((root / f"step-{STEPS:08d}").glob("*optim_states.pt"))) == 2


FAST: dict[str, Any] = {"train_steps": 6, "eval_interval": 3, "eval_iters": 1,
                        "sample_tokens": 0}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Any:
    """mt on one process, 6 steps (validation at steps 3 and 6): the reference."""
    return _run(tmp_path_factory.mktemp("one"), cache, engine="mt", nproc=1, save="none",
                **{**FAST, "sample_tokens": 4})


def _assert_close(reference: list[float], losses: list[float], rel: float) -> None:
    assert len(reference) == len(losses) == FAST["train_steps"]
    for step, (a, b) in enumerate(zip(reference, losses), start=1):
        assert b == pytest.approx(a, rel=rel), f"step {step}: {a} vs {b}"
    assert losses[-1] < losses[0] - 0.2  # it learns (6 steps: 7.00 -> 6.75)


def test_pretrain_deepspeed_3d_matches_one_process_and_resumes(one_process: Any, cache: Path,
                                                                tmp_path: Path) -> None:
    """TP 2 x PP 2 x DP 2, ZeRO-1, on 8 processes through DeepSpeed's PipelineModule /
    PipelineEngine (mt's TP layers inside) against mt on one process, same global batches.
    Measured: within 9.7e-8 relative over 20 steps (6 here); asserted 1e-5 (the documented
    tolerance: fp32 round-off of the different reduction orders). Validation (mt's forward
    over the same stages) and the greedy sample agree too. Then an exact resume of the 3D
    run from its step-3 DeepSpeed checkpoint."""
    pytest.importorskip("deepspeed")
    layout = {"engine": "deepspeed", "nproc": 8, "tp": 2, "pp": 2, "dp": 2, "zero_stage": 1}
    three_d = _run(tmp_path / "3d", cache, save_interval=3, **layout,
                   **{**FAST, "sample_tokens": 4})
    _assert_close(one_process.losses, three_d.losses, 1e-5)
    assert three_d.val_loss == pytest.approx(one_process.val_loss, rel=1e-5)
    assert three_d.sample is not None and three_d.sample == one_process.sample
    folder = tmp_path / "3d" / "checkpoints" / "step-00000003"
    assert sorted(p.name for p in folder.glob("mt-rank-*.pt")) == [
        f"mt-rank-{r:05d}.pt" for r in range(8)]
    resumed = _run(tmp_path / "resumed", cache, save="none", load=str(folder), **layout,
                   **FAST)
    assert resumed.start_step == 3 and resumed.final_step == 6
    assert resumed.losses == three_d.losses[3:]  # identical, not just close


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_pretrain_deepspeed_tp_sequence_parallel(one_process: Any, cache: Path,
                                                 tmp_path: Path, stage: int) -> None:
    """TP 2 x DP 2 (pp = 1: DeepSpeedEngine with mt's groups as its mpu), sequence parallel,
    ZeRO 1-3, against one process, the replicated parameters' partial gradients summed over
    TP once per step at DeepSpeed's accumulation boundary. Measured: within 4e-8 relative;
    asserted 1e-5. Traced, over TP per step: the vocabulary-parallel loss's two all-reduces
    per micro-batch, then the one sum of the replicated gradients (all of them at ZeRO 1;
    at ZeRO 2 and 3 each data-parallel rank's part, the parts adding up to all of them),
    then DeepSpeed's two for the norm; nothing per replicated parameter (27 of them)."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    ds = _run(out, cache, engine="deepspeed", nproc=4, tp=2, pp=1, dp=2, zero_stage=stage,
              sequence_parallel=True, save="none", trace_collectives=True, **FAST)
    _assert_close(one_process.losses, ds.losses, 1e-5)
    assert ds.val_loss == pytest.approx(one_process.val_loss, rel=1e-5)
    gpt = load_config(None, {"model": "tiny", "seq_len": 32}).model.gpt_config()
    replicated = (6 * gpt.n_layers + 2 + gpt.seq_len) * gpt.hidden * 4  # bytes, fp32
    micro = COMMON["global_batch_size"] // (COMMON["micro_batch_size"] * 2)
    buckets = {}
    for rank in (0, 2):  # TP rank 0 of each data-parallel rank
        steps = (out / "collectives" / f"rank-{rank:05d}.jsonl").read_text().splitlines()
        assert len(steps) == FAST["train_steps"]
        for line in steps:
            sums = [r[2] for r in json.loads(line)["records"]
                    if r[0] == "all_reduce" and r[1] == "tp"]
            assert len(sums) == 2 * micro + 3, sums
            buckets.setdefault(rank, set()).add(sums[2 * micro])
    [ours], [theirs] = buckets.values()
    if stage == 1:
        assert ours == theirs == replicated
    elif stage == 2:
        assert ours + theirs == replicated
    else:  # each parameter's partition, padded to equal halves
        assert ours == theirs and replicated <= 2 * ours < replicated + 2 * 4 * 27


@pytest.mark.parametrize("stage", [1, 3])
def test_pretrain_deepspeed_exact_resume(stage: int, cache: Path, tmp_path: Path) -> None:
    """6 steps == 3 steps, stop, resume from the DeepSpeed checkpoint (model, ZeRO shards,
    mt's data position and RNG), 3 more steps: identical losses (tp = pp = 1, DP 2)."""
    pytest.importorskip("deepspeed")
    fast = {"engine": "deepspeed", "zero_stage": stage, "train_steps": 6,
            "eval_interval": 0, "sample_tokens": 0}
    full = _run(tmp_path / "full", cache, save_interval=3, **fast)
    resumed = _run(tmp_path / "resumed3", cache, save="none",
                   load=str(tmp_path / "full" / "checkpoints" / "step-00000003"), **fast)
    assert resumed.start_step == 3 and resumed.final_step == 6
    assert resumed.losses == full.losses[3:]


def test_pretrain_deepspeed_refuses_another_layout_and_damaged_files(cache: Path,
                                                                     tmp_path: Path) -> None:
    """A DeepSpeed-engine checkpoint resumes only at its layout and batch schedule, and only
    undamaged: mt's checksums (mt-checksums.json) list every file of the step folder,
    DeepSpeed's own included, and 64 flipped bytes inside a ZeRO optimizer shard are one line
    naming it."""
    pytest.importorskip("deepspeed")
    fast = {"engine": "deepspeed", "train_steps": 1, "eval_interval": 0, "sample_tokens": 0}
    _run(tmp_path / "a", cache, **fast)
    with pytest.raises(Exception, match="same layout"):
        _run(tmp_path / "b", cache, tp=2, save="none",
             load=str(tmp_path / "a" / "checkpoints"), **{**fast, "train_steps": 2})
    with pytest.raises(ConfigError, match=r"its run consumed 8 samples in 1 step, where this "
                       r"run's batch schedule \(--global-batch-size 16\) consumes 16: --engine "
                       "deepspeed resumes at the global batch size and ramp-up its run "
                       "started with"):
        _run(tmp_path / "b", cache, global_batch_size=16, save="none",
             load=str(tmp_path / "a" / "checkpoints"), **{**fast, "train_steps": 2})
    folder = tmp_path / "a" / "checkpoints" / "step-00000001"
    listed = json.loads((folder / MANIFEST).read_text())["files"]
    assert set(listed) == {p.name for p in folder.iterdir() if p.name != MANIFEST}
    shard = next(folder / name for name in sorted(listed) if "optim_states" in name)
    with open(shard, "r+b") as f:  # flip 64 bytes in the middle, size unchanged
        f.seek(shard.stat().st_size // 2)
        middle = f.read(64)
        f.seek(-64, 1)
        f.write(bytes(b ^ 0xFF for b in middle))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: damaged \(its checksum is "
                       r"crc32c:[0-9a-f]{8}, mt-checksums.json recorded"):
        _run(tmp_path / "c", cache, save="none", load=str(folder), **{**fast, "train_steps": 2})


@pytest.mark.parametrize("options, words", [
    ({"tp": 1, "pp": 2, "schedule": "interleaved", "virtual_stages": 2}, ["1F1B"]),
    ({"tp": 1, "pp": 2, "schedule": "gpipe"}, ["1F1B", "--schedule gpipe needs --engine mt"]),
    ({"zero_stage": 0}, ["--zero-stage 0 does not train like one process", "no gradient norm",
                         "use --zero-stage 1"]),
    ({"tp": 1, "pp": 2, "zero_stage": 2}, ["--zero-stage 2 with --pp 2"]),
    ({"precision": "fp16"}, ["fp16"]),
    ({"activation_checkpointing": True}, ["--activation-checkpointing"]),
    ({"rampup_start": 4, "rampup_increment": 4, "rampup_tokens": 1000}, ["ramp-up"]),
])
def test_pretrain_deepspeed_rejects_unsupported(options: dict[str, Any],
                                                words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, {**COMMON, "engine": "deepspeed", **options})
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_deepspeed_is_imported_before_the_fork_only_for_cpu_ranks(device: str) -> None:
    """The launching process imports DeepSpeed and the optimizer module its initialize
    imports (it loads inductor: 8 s per rank, 30 s of an 8-rank run on 2 cores), for CPU
    ranks only: for CUDA ranks the import could initialize CUDA before the fork. Each
    process prepares CUDA ranks first (nothing imported yet), then ``device``'s."""
    pytest.importorskip("deepspeed")
    code = (
        "import sys, torch\n"
        "from mt_pretrain.config.load import load_config\n"
        "from mt_pretrain.engines.deepspeed_engine import DeepSpeedEngine\n"
        f"for device in ('cuda', {device!r}):\n"
        "    config = load_config(None, {'engine': 'deepspeed', 'device': device})\n"
        "    DeepSpeedEngine.preload(config)\n"
        "    print('deepspeed.runtime.zero.muon.muon_optimizer' in sys.modules)\n"
        "print(torch.backends.cuda.is_built())\n")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in sys.path if p)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    for_cuda, loaded, cuda_built = run.stdout.split()
    assert for_cuda == "False"
    assert loaded == str(not (device == "auto" and cuda_built == "True"))
