"""`mt plan` command line: report, --json keys, --search table, clear errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from mt_plan.estimate import EFFICIENCY
from mt_pretrain.cli.app import app

RUNNER = CliRunner()
KEYS = {"iteration_time_s", "tflops_per_gpu", "memory_per_gpu_gb", "bubble_fraction", "fits",
        "memory_weights_gb", "memory_grads_gb", "memory_optimizer_gb", "memory_activations_gb",
        "parameters_per_gpu", "model_flops_per_iteration", "efficiency", "tp_comm_time_s",
        "p2p_time_s", "dp_comm_time_s", "optimizer_time_s", "tokens_per_s", "tp", "pp", "dp",
        "world_size"}


def _plan(*args: str) -> object:
    return RUNNER.invoke(app, ["plan", *args])


def test_json_has_documented_keys() -> None:
    result = _plan("--model", "gpt2-small", "--gpu", "h100-80gb", "--gpus", "8", "--tp", "2",
                   "--pp", "2", "--global-batch-size", "64", "--micro-batch-size", "2",
                   "--zero-stage", "2", "--sequence-parallel", "--recompute", "selective",
                   "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert KEYS <= set(data)
    assert (data["tp"], data["pp"], data["dp"], data["num_micro_batches"]) == (2, 2, 2, 16)
    parts = sum(data[f"memory_{k}_gb"] for k in ("weights", "grads", "optimizer",
                                                 "activations", "temporaries"))
    assert abs(parts - data["memory_per_gpu_gb"]) < 1e-9 and data["fits"] is True
    # Stage 1 holds the head (1.8x the matmuls of six gpt2-small layers): stage 0 idles
    # more than the balanced (p - 1) / m of the schedule, about as long as it computes.
    assert 1 / 16 < data["bubble_fraction"] < 2 and data["iteration_time_s"] > 0
    help_text = RUNNER.invoke(app, ["plan", "--help"]).output
    for key in ("iteration_time_s", "tflops_per_gpu", "memory_per_gpu_gb", "bubble_fraction",
                "fits"):
        assert key in help_text


def test_report_states_the_constant_and_mtnlg_figures() -> None:
    result = _plan("--model", "mt-nlg-530b", "--gpus", "3360", "--tp", "8", "--pp", "35",
                   "--global-batch-size", "1920")
    assert result.exit_code == 0, result.output
    assert f"{EFFICIENCY} x peak" in result.output and "fits" in result.output
    assert "tp 8 x pp 35 x dp 12 = 3360" in result.output


def test_search_prints_ranked_table() -> None:
    result = _plan("--model", "gpt2-small", "--gpus", "8", "--global-batch-size", "64",
                   "--search", "--top", "4", "--gpu", "a100-40gb")
    assert result.exit_code == 0, result.output
    assert "top 4 by estimated throughput" in result.output and "tokens/s" in result.output
    ranked = json.loads(_plan("--model", "gpt2-small", "--gpus", "8", "--global-batch-size",
                              "64", "--search", "--top", "4", "--json").output)
    speeds = [row["tokens_per_s"] for row in ranked]
    assert len(ranked) == 4 and speeds == sorted(speeds, reverse=True)
    assert all(row["fits"] and row["world_size"] == 8 for row in ranked)


def test_search_drops_layouts_that_do_not_fit() -> None:
    result = _plan("--model", "mt-nlg-530b", "--gpus", "8", "--global-batch-size", "8",
                   "--search")
    assert result.exit_code == 2
    assert "none of the 30 layouts on 8 x a100-80gb fits in memory: the leanest (tp 8 x pp 1 " \
        "x dp 1, micro-batch 1, recompute full) needs " in " ".join(result.output.split())


def test_search_without_any_layout_says_why_and_what_would() -> None:
    """No layout at all: the one line says why and what GPU counts would split the run (not
    "none of 0 layouts fits")."""
    result = _plan("--model", "tiny", "--gpus", "3", "--search")
    assert result.exit_code == 2
    assert " ".join(result.output.split()) == (
        "error: no layout splits this run over 3 GPUs: tp x pp x dp = 3 needs tp to divide "
        "the 4 heads (at most 8 per node), pp the 4 layers and dp the global batch 32; 2 GPUs "
        "can")


def test_bad_inputs_name_the_value(tmp_path: Path) -> None:
    cases = [
        (["--model", "tiny", "--gpu", "b200"], "unknown GPU type 'b200'"),
        (["--model", "nope"], "unknown GPT preset 'nope'"),
        (["--model", "tiny", "--tp", "3"], "n_heads 4 is not divisible by tp 3"),
        (["--model", "tiny", "--gpus", "6", "--tp", "4"], "--gpus 6 is not divisible"),
        (["--model", "tiny", "--recompute", "half"], "recompute 'half'"),
        (["--model", "tiny", "--gpus", "4", "--global-batch-size", "6"],
         "global batch size 6 is not divisible by micro-batch size 1 x dp 4 = 4"),
        ([], "exactly one of --model"),
    ]
    for args, message in cases:
        result = _plan(*args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)
    config = tmp_path / "model.yaml"
    config.write_text("n_layers: 4\nhidden: 128\nn_heads: 4\nvocab_size: 512\nseq_len: 64\n")
    result = _plan("--config", str(config), "--gpus", "2", "--tp", "2", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["tp"] == 2
    # Not UTF-8; --calibrate onto the --config file
    #.
    garbage = tmp_path / "garbage.yaml"
    garbage.write_bytes(bytes(range(128, 256)) * 4)
    result = _plan("--config", str(garbage))
    assert result.exit_code == 2 and "is not UTF-8 text (byte 0x80 at offset 0)" in \
        result.output, result.output
    before = config.read_bytes()
    result = _plan("--config", str(config), "--calibrate", str(config))
    assert result.exit_code == 2, result.output
    assert f"--calibrate {config} is the input {config}" in " ".join(result.output.split())
    assert config.read_bytes() == before


def test_calibrate_measures_this_machine_and_is_reused(tmp_path: Path) -> None:
    """--calibrate times the kernels here (CPU), writes a --gpu file, and plans with it."""
    cal = tmp_path / "cpu.yaml"
    args = ("--model", "tiny", "--global-batch-size", "4", "--micro-batch-size", "2",
            "--precision", "fp32", "--recompute", "none")
    result = _plan(*args, "--calibrate", str(cal))
    assert result.exit_code == 0, result.output
    assert "calibrating on cpu" in result.output and f"written to {cal}" in result.output
    assert "at the rates measured on cpu (calibrated" in result.output
    data = json.loads(_plan(*args, "--gpu", str(cal), "--json").output)
    assert data["calibrated"] is True and data["gpu"].startswith("cpu (calibrated")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    assert abs(data["gpu_memory_gb"] - ram) < 1e-6 * ram  # this machine's memory
    plain = json.loads(_plan(*args, "--json").output)
    assert plain["calibrated"] is False and plain["gpu"] == "a100-80gb"
    bad = _plan(*args, "--micro-batch-size", "0", "--calibrate", str(tmp_path / "x.yaml"))
    assert bad.exit_code == 2 and "--micro-batch-size must be a positive integer, got 0" in (
        bad.output)
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    unwritable = _plan(*args, "--calibrate", str(blocked / "cal.yaml"))  # before measuring
    assert unwritable.exit_code == 2 and f"--calibrate {blocked}/cal.yaml: {blocked} is a " \
        "file, not a folder" in " ".join(unwritable.output.split())


def test_calibrate_keeps_an_existing_file_without_overwrite(tmp_path: Path) -> None:
    """An existing --calibrate FILE is refused before measuring, and kept; --overwrite
    replaces it (written beside it, then renamed: no temporary file is left)."""
    cal = tmp_path / "cpu.yaml"
    cal.write_text("mine\n")
    args = ("--model", "tiny", "--global-batch-size", "2", "--micro-batch-size", "2",
            "--precision", "fp32", "--recompute", "none", "--calibrate", str(cal))
    refused = _plan(*args)
    assert refused.exit_code == 2
    assert " ".join(refused.output.split()) == (
        f"error: --calibrate {cal} already exists; pass --overwrite to replace it")
    assert cal.read_text() == "mine\n"
    replaced = _plan(*args, "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert "peak_tflops" in cal.read_text() and [p.name for p in tmp_path.iterdir()] == [
        "cpu.yaml"]


def test_an_mt_pretrain_config_plans_its_runs_layout(tmp_path: Path) -> None:
    """--config with an mt pretrain config plans the layout its run resolves (as `mt pretrain
    --dry-run` does: degrees, batches, ZeRO stage, precision, sequence parallelism,
    recomputation), not mt plan's defaults; each flag given overrides the config's value."""
    from mt_pretrain.config.load import load_config
    from mt_pretrain.config.resolve import resolve

    config = tmp_path / "run.yaml"
    config.write_text("model: {model: tiny, seq_len: 64}\n"
                      "parallel: {nproc: 8, tp: 2, pp: 2, zero_stage: 0, precision: bf16, "
                      "sequence_parallel: true, recompute: selective}\n"
                      "train: {global_batch_size: 16, micro_batch_size: 2}\n")
    keys = ("tp", "pp", "dp", "cp", "global_batch", "micro_batch", "zero_stage", "schedule",
            "virtual_stages", "sequence_parallel", "recompute", "precision", "chunked_loss",
            "main_grads")
    result = _plan("--config", str(config), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    run = resolve(load_config(config), 8).layout
    assert {k: data[k] for k in keys} == {k: getattr(run, k) for k in keys}
    assert (data["tp"], data["pp"], data["dp"], data["global_batch"], data["micro_batch"],
            data["zero_stage"], data["precision"], data["sequence_parallel"],
            data["recompute"], data["world_size"]) == (2, 2, 2, 16, 2, 0, "bf16", True,
                                                       "selective", 8)
    over = json.loads(_plan("--config", str(config), "--pp", "1", "--micro-batch-size", "1",
                            "--precision", "fp32", "--json").output)
    assert (over["tp"], over["pp"], over["dp"], over["micro_batch"], over["precision"],
            over["zero_stage"], over["world_size"]) == (2, 1, 4, 1, "fp32", 0, 8)
    rows = json.loads(_plan("--config", str(config), "--search", "--json").output)
    assert rows and all((r["world_size"], r["global_batch"], r["zero_stage"], r["precision"])
                        == (8, 16, 0, "bf16") for r in rows)
    wider = json.loads(_plan("--config", str(config), "--gpus", "16", "--json").output)
    assert (wider["tp"], wider["pp"], wider["dp"]) == (2, 2, 4)


def test_options_that_would_do_nothing_name_what_they_need() -> None:
    """--failures-per-day without --save-interval (and the other way round), --top without
    --search, --overwrite without --calibrate, checkpoint options with --search: refused."""
    cases = [
        (["--failures-per-day", "2"],
         "--failures-per-day does nothing without --save-interval: leave it out"),
        (["--save-interval", "100"],
         "--save-interval does nothing without --failures-per-day: leave it out"),
        (["--save-interval", "100", "--restart-minutes", "5"],
         "--save-interval does nothing without --failures-per-day: leave it out; "
         "--restart-minutes does nothing without --failures-per-day: leave it out"),
        (["--top", "3"], "--top does nothing without --search: leave it out"),
        (["--overwrite"], "--overwrite does nothing without --calibrate: leave it out"),
        (["--search", "--gpus", "8", "--write-gb-per-s", "2"],
         "--write-gb-per-s does nothing with --search (it prints no checkpoint figures): "
         "leave it out"),
    ]
    for args, message in cases:
        result = _plan("--model", "tiny", *args)
        assert result.exit_code == 2, (args, result.output)
        assert " ".join(result.output.split()) == f"error: {message}", (args, result.output)


def test_context_parallel_plan_reports_the_exchange() -> None:
    """--cp: the layout line names it, the key/value exchange is timed, --json carries cp and
    cp_comm_time_s, and a GPU count CP cannot split is one line."""
    args = ("--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--tp", "8", "--cp", "4",
            "--sequence-parallel", "--global-batch-size", "8")
    text = _plan(*args)
    assert text.exit_code == 0, text.output
    assert "tp 8 x pp 1 x dp 1 x cp 4 = 32 x h100-80gb" in text.output
    assert "CP key/value exchange" in text.output
    data = json.loads(_plan(*args, "--json").output)
    assert data["cp"] == 4 and data["world_size"] == 32 and data["cp_comm_time_s"] > 0
    bad = _plan("--model", "tiny", "--gpus", "6", "--cp", "4")
    assert bad.exit_code == 2
    assert "--gpus 6 is not divisible by --tp 1 x --pp 1 x --cp 4 = 4" in bad.output


def test_search_splits_sequences_when_asked(tmp_path: Path) -> None:
    """--search --cp N also tries CP 2, 4, ... N. Llama 3.1 8B at 32k tokens on 8 GPUs of 40
    GB, one per node (so TP cannot split a layer's activations), ZeRO-3: no layout without
    CP fits, and the refusal says how many CP layouts would; with --cp 8 the search lists
    them, each row of --json naming its cp."""
    from mt_model import preset

    model, gpu = tmp_path / "llama-32k.yaml", tmp_path / "gpu.yaml"
    model.write_text(json.dumps({**preset("llama-3.1-8b").to_dict(), "seq_len": 32768}))
    gpu.write_text("peak_tflops: 312\nmemory_gb: 40\nnvlink_gb_per_s: 300\nib_gb_per_s: 25\n"
                   "gpus_per_node: 1\n")
    args = ("--config", str(model), "--gpu", str(gpu), "--gpus", "8", "--zero-stage", "3",
            "--global-batch-size", "32", "--search")
    refused = _plan(*args)
    assert refused.exit_code == 2
    text = " ".join(refused.output.split())
    assert "none of the 45 layouts on 8 x gpu fits in memory" in text
    assert text.endswith("use more GPUs or --cp 8 (splitting each sequence, 4 layouts fit)")
    rows = json.loads(_plan(*args, "--cp", "8", "--json").output)
    assert rows and all(r["fits"] and r["world_size"] == 8 and r["cp"] > 1 for r in rows)
    table = _plan(*args, "--cp", "8").output
    assert "4 of 117 layouts fit on 8 x gpu" in " ".join(table.split()) and "cp" in table


def test_numeric_flags_name_the_flag_and_value() -> None:
    """Each numeric flag out of range is named with its value (unchecked: --tp -2 --pp -2 would
    blame divisibility, "--gpus 4 is not divisible by --tp -2 x --pp -2 = 4"; a huge --gpus
    would search for hours, 1e11 micro-batches be simulated for hours)."""
    cases = [
        (["--tp", "-2", "--pp", "-2"], "--tp must be a positive integer, got -2; --pp must be "
                                       "a positive integer, got -2"),
        (["--cp", "0"], "--cp must be a positive integer, got 0"),
        (["--gpus", "0"], "--gpus must be a positive integer, got 0"),
        (["--global-batch-size", "-4"], "--global-batch-size must be a positive integer, got -4"),
        (["--micro-batch-size", "0"], "--micro-batch-size must be a positive integer, got 0"),
        (["--virtual-stages", "-1"], "--virtual-stages must be a positive integer, got -1"),
        (["--search", "--gpus", "8", "--top", "0"], "--top must be a positive integer, got 0"),
        (["--zero-stage", "-1"], "--zero-stage must be 0, 1, 2 or 3, got -1"),
        (["--global-batch-size", str(2**70)],
         "--global-batch-size must be below 2**63, got 1180591620717411303424"),
        (["--search", "--gpus", "1000000000"],
         "--gpus must be at most 1,048,576 GPUs, got 1,000,000,000"),
        (["--global-batch-size", "100000000000"],
         "--global-batch-size 100,000,000,000 is 100,000,000,000 micro-batches of 1 on each "
         "of dp 1 replicas per step; at most 100,000"),
        (["--search", "--gpus", "8", "--global-batch-size", "100000000000"],
         "--global-batch-size 100,000,000,000 is at least 1,562,500,000 micro-batches per "
         "step in every layout on 8 GPUs; at most 100,000"),
    ]
    for args, message in cases:
        result = _plan("--model", "tiny", *args)
        assert result.exit_code == 2, (args, result.output)
        assert message in " ".join(result.output.split()), (args, result.output)
        assert "Traceback" not in result.output


def test_flags_that_would_do_nothing_are_refused() -> None:
    """The rule of mt pretrain, and --search's own: it
    chooses the layout, so a --tp or --recompute given with it did nothing; it plans the
    --precision given."""
    cases = [
        (["--sequence-parallel"], "--sequence-parallel shards activations over the "
                                  "tensor-parallel ranks, and --tp 1 has none"),
        (["--virtual-stages", "2"], "--virtual-stages 2 splits each pipeline stage into model "
                                    "chunks, and --pp 1 has no pipeline"),
        (["--precision", "fp32", "--no-main-grads"], "--no-main-grads keeps 16-bit gradients"),
        (["--search", "--gpus", "8", "--tp", "2", "--recompute", "none"],
         "--search chooses --tp, --recompute itself: leave them out"),
    ]
    for args, message in cases:
        result = _plan("--model", "tiny", *args)
        assert result.exit_code == 2, (args, result.output)
        assert message in " ".join(result.output.split()), (args, result.output)
    rows = json.loads(_plan("--model", "tiny", "--gpus", "8", "--search", "--precision",
                            "fp32", "--json").output)
    assert rows and all(row["precision"] == "fp32" for row in rows)


def test_the_planned_save_is_what_a_run_writes(cache: Path, tmp_path: Path) -> None:
    """The checkpoint figures against the rank files a real run writes (tp 1 x dp 2,
    ZeRO 1): within 5% (torch.save's framing of each tensor); and the failure line."""
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "mt_pretrain", "pretrain", "--model", "tiny", "--nproc", "2",
         "--train-steps", "1", "--global-batch-size", "4", "--micro-batch-size", "2",
         "--no-progress", "--sample-tokens", "0", "--eval-interval", "0", "--out-dir",
         str(out), "--cache-dir", str(cache)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    step = out / "checkpoints" / "step-00000001"
    sizes = [(step / f"rank-{r:05d}.pt").stat().st_size for r in range(2)]
    result = _plan("--model", "tiny", "--gpus", "2", "--global-batch-size", "4",
                   "--micro-batch-size", "2", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    planned, params = data["checkpoint"], data["parameters_per_gpu"]
    assert 1.0 <= sizes[0] / planned["rank_bytes"] < 1.05, (sizes, planned)
    assert 1.0 <= sizes[1] / (params * 12 / 2) < 1.05, (sizes, planned)  # shard only
    assert 1.0 <= sum(sizes) / planned["checkpoint_bytes"] < 1.05, (sizes, planned)
    assert planned["node_bytes"] == planned["checkpoint_bytes"]  # both ranks on one node
    line = _plan("--model", "gpt2-small", "--gpus", "8", "--global-batch-size", "64",
                 "--save-interval", "100", "--failures-per-day", "2").output
    assert "a save every 100 steps" in line and "the least costly interval" in line, line
    bad = _plan("--model", "tiny", "--failures-per-day", "nan")
    assert bad.exit_code == 2 and "--failures-per-day must be a finite number >= 0" in \
        bad.output, bad.output
