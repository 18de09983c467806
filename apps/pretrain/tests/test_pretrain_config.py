"""Config loading, validation errors that name the numbers, --help and --dry-run (no
processes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mt_pretrain.cli.app import app
from mt_pretrain.cli.pretrain import dry_run
from mt_pretrain.config.load import field_docs, flat_fields, load_config, replace_config
from mt_pretrain.config.resolve import memory_estimate, resolve, runtime_spec
from mt_pretrain.config.schema import SECTIONS, ConfigError, PretrainConfig
from mt_zero import LRSchedule


def test_defaults_are_one_process_and_the_demo_is_3d() -> None:
    config = PretrainConfig()
    plan = resolve(config, config.world_size_hint())
    assert (plan.topology.tp, plan.topology.pp, plan.topology.dp) == (1, 1, 1)
    # Every degree defaults to 1; data parallelism takes the processes left.
    two = load_config(None, {"nproc": 2})
    assert (two.parallel.tp, two.parallel.pp) == (1, 1)
    assert resolve(two, 2).topology.dp == 2
    demo = load_config("demo-3d")  # the shipped config `mt pretrain` runs with no arguments
    plan = resolve(demo, demo.world_size_hint())
    assert (plan.topology.tp, plan.topology.pp, plan.topology.dp) == (2, 2, 2)
    assert plan.gpt.vocab_size == 1000 and plan.pipeline.num_micro_batches == 4
    assert plan.train_steps == 300 and plan.train_samples == 300 * 32
    with pytest.raises(ConfigError, match=r"config file nope not found \(shipped configs: "
                       r"\['demo-3d'\]\)"):
        load_config("nope")


def test_yaml_sections_flat_keys_and_cli_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("parallel:\n  tp: 1\n  pp: 4\ntrain_tokens: 1.2e4\nlr: 1\n"
                    "model: {model: tiny, seq_len: 32}\n")
    config = load_config(path, {"pp": 2, "nproc": 4})
    assert (config.parallel.tp, config.parallel.pp, config.parallel.nproc) == (1, 2, 4)
    assert config.train.train_tokens == 12000 and config.train.lr == 1.0
    assert config.model.seq_len == 32
    plan = resolve(config, 4)
    # 12000 tokens / 32 per sample = 375 samples -> 12 steps of 32 samples.
    assert plan.train_steps == 12 and plan.train_samples == 384
    again = replace_config(config, tp=2)
    assert again.parallel.tp == 2 and again.train.train_tokens == 12000


@pytest.mark.parametrize("overrides, message", [
    ({"nproc": 8, "tp": 2, "pp": 2, "global_batch_size": 36},
     r"global batch size 36 is not divisible by micro-batch size 4 x dp 2 = 8"),
    ({"nproc": 6, "tp": 2, "pp": 2}, r"world size 6 is not divisible by tp 2 x pp 2 = 4"),
    ({"nproc": 8, "tp": 2, "pp": 2, "dp": 4},
     r"tp 2 x pp 2 x dp 4 = 16 processes, but the world size is 8"),
    ({"nproc": 3, "tp": 1, "pp": 3, "global_batch_size": 12},
     r"n_layers 4 is not divisible by pp 3 x virtual stages 1 = 3"),
    ({"nproc": 8, "tp": 8, "pp": 1}, r"n_heads.*4.*tp.*8|tp.*8.*n_heads.*4"),
    ({"data": "/nonexistent/dataset"}, r"data path\(s\) not found: \['/nonexistent/dataset'\]"),
    ({"train_steps": 5, "train_tokens": 100}, r"--train-steps \(5\) or --train-tokens \(100\)"),
    ({"rampup_start": 8, "rampup_increment": 5, "rampup_tokens": 10},
     r"ramp-up from 8 by 5 does not reach global batch size 32"),
    ({"zero_stage": 5}, r"invalid parallel arguments: zero stage 5 is not 0, 1, 2 or 3"),
    ({"timeout": 0.001}, r"--timeout must be at least 1 seconds \(the ranks must first "
                         r"connect to each other\), got 0.001"),
    ({"pp": 2, "schedule": "interleaved", "virtual_stages": 1},
     r"schedule 'interleaved' needs virtual_stages >= 2, got 1"),
    ({"unknown_flag": 1}, r"unknown config keys \['unknown_flag'\]"),
    ({"nproc": 4, "tp": 1, "pp": 2, "schedule": "interleaved", "virtual_stages": 2,
      "global_batch_size": 24, "micro_batch_size": 4},
     r"schedule 'interleaved' needs pp 2 >= 2 and micro-batches 3 divisible by pp 2"),
    ({"zero_stage": 3, "compile": True}, r"--zero-stage 3 with --compile is not supported"),
    ({"engine": "deepspeed", "compile": True},
     r"--compile is not supported with --engine deepspeed"),
    ({"zero_stage": 3, "activation_checkpointing": True},
     r"--zero-stage 3 with --activation-checkpointing is not supported yet; use ZeRO stage "
     r"0-2 with recomputation"),
    ({"zero_stage": 3, "nproc": 2, "recompute": "selective"},
     r"--zero-stage 3 with --recompute selective is not supported yet"),
    ({"compile": True, "recompute": "selective"},
     r"--compile with --recompute selective: torch.compile already recomputes cheap "
     r"operations"),
    ({"activation_checkpointing": True, "recompute": "selective"},
     r"--activation-checkpointing is --recompute full, not --recompute selective: give one "
     r"of them"),
    ({"recompute": "some"}, r"recompute 'some' is not one of full, selective, none"),
    ({"nproc": 8, "compile": True, "activation_checkpointing": True, "dropout": 0.1},
     r"--compile with --activation-checkpointing and dropout 0.1 is not supported.*leave out "
     r"--compile"),
    # The hostile-user sweep of session 8.
    ({"nproc": 1, "train_steps": 2, "global_batch_size": 4, "seq_len": 32,
      "warmup_tokens": 999999999},
     r"--warmup-tokens 999,999,999 is longer than the decay: 256 tokens \(the whole run's "
     r"tokens \(2 steps\)\); the learning rate would never reach --lr"),
    ({"adam_eps": 0.0}, r"--adam-eps must be > 0 \(Adam divides by sqrt\(v\) \+ eps\), got 0"),
    ({"quiet": True, "log_level": "debug"},
     r"--quiet is --log-level warning; give one of them, not --quiet with --log-level debug"),
    # Context parallelism: what it cannot run, each with what to do.
    ({"nproc": 4, "cp": 4, "seq_len": 100}, r"seq_len 100 is not divisible by 2 x cp 4 = 8"),
    ({"nproc": 8, "tp": 4, "cp": 2, "seq_len": 12, "sequence_parallel": True},
     r"seq_len 12 / cp 2 = 6 is not divisible by tp 4"),
    ({"nproc": 6, "cp": 4}, r"world size 6 is not divisible by tp 1 x pp 1 x cp 4 = 4"),
    ({"nproc": 2, "cp": 2, "engine": "deepspeed"},
     r"--cp 2 is not supported with --engine deepspeed"),
    ({"cp": 2, "compile": True}, r"--cp 2 with --compile is not supported yet"),
    ({"eval_task": "mt-cloze,mt-choice,mt-cloze"},
     r"--eval-task: mt-cloze is given twice: give each task once"),
    ({"cp": 2, "eval_task": "lambada"},
     r"--eval-task with --cp 2 is not supported.*score the checkpoint after training"),
    ({"cp": 0}, r"cp must be >= 1|--cp must be"),
    ({"nproc": 1, "micro_batch_size": 1, "global_batch_size": 80_000_000_000},
     r"global batch size 80,000,000,000 is 80,000,000,000 micro-batches of 1 on each of dp 1 "
     r"replicas per step; at most 100,000"),
    # --async-save where it would write nothing in the background.
    ({"async_save": True, "save": "none", "save_interval": 5},
     r"--async-save writes checkpoints in the background, and --save none keeps none: leave "
     r"out one of them"),
    ({"async_save": True},
     r"--async-save writes the checkpoints of --save-interval in the background, and "
     r"--save-interval 0 saves only when the run ends \(in the foreground\): give "
     r"--save-interval N or leave out --async-save"),
])
def test_bad_configs_name_the_numbers(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_every_field_has_help_text_and_a_flag() -> None:
    for name, (section, _) in flat_fields().items():
        assert field_docs(SECTIONS[section]).get(name), f"{name} has no docstring"
    result = CliRunner().invoke(app, ["pretrain", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for flag in ("--tp", "--pp", "--dp", "--nproc", "--zero-stage", "--schedule",
                 "--virtual-stages", "--sequence-parallel", "--activation-checkpointing",
                 "--compile", "--micro-batch-size", "--global-batch-size", "--train-tokens",
                 "--precision", "--save-interval", "--load", "--metrics", "--dry-run", "--config"):
        assert flag in result.output
    assert "Pipeline schedule: gpipe, 1f1b or interleaved" in result.output
    from mt_model import PRESETS

    model_help = field_docs(SECTIONS["model"])["model"]
    assert all(name in model_help for name in PRESETS), model_help  # none forgotten


def test_cli_rejects_bad_layout_with_exit_code_2() -> None:
    result = CliRunner().invoke(app, ["pretrain", "--nproc", "8", "--tp", "2", "--pp", "2",
                                      "--global-batch-size", "36", "--dry-run"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert "global batch size 36 is not divisible by micro-batch size 4 x dp 2 = 8" in (
        result.output)


def test_dry_run_prints_ranks_groups_stages_memory() -> None:
    # No run flag: the shipped 3D demo, said first; output flags (--dry-run) apply to it.
    result = CliRunner().invoke(app, ["pretrain", "--dry-run"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = result.output
    assert text.startswith("no run given: the 3D demo, ") and "demo-3d.yaml" in text
    assert "tp 2 x pp 2 x dp 2 = 8 ranks" in text
    assert "268,160 parameters" in text
    assert "stage 0: layers [0, 2) embedding" in text and "stage 1: layers [2, 4) head+loss" in text
    assert "dp        [0, 2], [1, 3], [4, 6], [5, 7]" in text
    assert "rank    7: pp 1 dp 1 tp 1" in text
    assert "memory per rank" in text
    # A run flag: not the demo, and said so.
    result = CliRunner().invoke(app, ["pretrain", "--train-steps", "5", "--dry-run"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert result.output.startswith("--train-steps given, so not the 3D demo: every degree is "
                                    "1, on one process unless --nproc (add --config demo-3d")
    assert "tp 1 x pp 1 x dp 1 = 1 ranks" in result.output


def test_dry_run_of_mt_nlg_530b_on_2240_ranks() -> None:
    config = load_config(None, {"model": "mt-nlg-530b", "tp": 8, "pp": 35, "dp": 8,
                                "micro_batch_size": 1, "global_batch_size": 1920,
                                "precision": "bf16", "activation_checkpointing": True,
                                "rampup_start": 32, "rampup_increment": 32,
                                "rampup_tokens": 12_000_000_000, "train_tokens": 340e9})
    text = dry_run(config, {})
    assert "tp 8 x pp 35 x dp 8 = 2240 ranks" in text
    assert "529,6" in text  # ~529.6B parameters
    plan = resolve(config, 2240)
    assert plan.stages.stages[0].chunks == ((0, 3),)
    mem = memory_estimate(plan, 1, runtime_spec(config.parallel.device))
    # 3 layers x 20480^2 x 12 / 8 = 1.89e9 parameters per rank of a middle stage.
    assert mem["params"] == pytest.approx(1.888e9, rel=1e-3)
    assert 10 * 2**30 < mem["total"] < 80 * 2**30


def test_lr_schedule_warmup_cosine_floor() -> None:
    lr = LRSchedule.create(1.0, None, 100, 1100, 5000)
    assert lr(0) == 0.0 and lr(50) == pytest.approx(0.5) and lr(100) == pytest.approx(1.0)
    assert lr(600) == pytest.approx(0.55)  # half way: floor + (peak - floor) / 2
    assert lr(1100) == pytest.approx(0.1) and lr(4000) == pytest.approx(0.1)


def test_load_takes_the_model_from_the_checkpoint() -> None:
    """A standard GPT-2 small as transformers saves it (tanh GeLU, init 0.02, 1024
    positions) continues with --model gpt2-small at --seq-len 128: only shape flags count."""
    from mt_model import preset

    saved = preset("gpt2-small").replace(gelu_approximate="tanh", init_std=0.02)
    args = load_config(None, {"model": "gpt2-small", "seq_len": 128, "dropout": 0.1}).model
    model, seq_len = args.on_checkpoint(saved, "ck")
    assert seq_len == 128 and model.seq_len == 1024 and model.init_std == 0.02
    assert model.gelu_approximate == "tanh" and model.dropout == 0.1
    # No flags at all: the checkpoint's model and its full length.
    model, seq_len = load_config(None, {}).model.on_checkpoint(saved, "ck")
    assert model == saved and seq_len == 1024
    with pytest.raises(ConfigError, match=r"--load ck: .*--model gpt2-medium has n_layers 24, "
                       r"the checkpoint 12; .*hidden 1024, the checkpoint 768"):
        load_config(None, {"model": "gpt2-medium"}).model.on_checkpoint(saved, "ck")


def test_the_command_line_that_started_a_run_resumes_it() -> None:
    """A preset reshaped by flags is compared as the model the flags resolve to (the SLURM
    chain runs the same command with --load), not as the bare preset."""
    flags = {"model": "tiny", "hidden": 64, "n_layers": 2}
    saved = load_config(None, flags).model.gpt_config()
    model, _ = load_config(None, flags).model.on_checkpoint(saved, "ck")
    assert (model.hidden, model.n_layers) == (64, 2)
    with pytest.raises(ConfigError, match=r"--load ck: .*--model tiny with --n-layers 3 "
                       r"--hidden 64 has "
                       r"n_layers 3, the checkpoint 2"):
        load_config(None, {**flags, "n_layers": 3}).model.on_checkpoint(saved, "ck")


@pytest.mark.parametrize("text, message", [
    (b"train_steps: abc\n", r"run.yaml: train_steps must be an integer, got 'abc'"),
    (b"tp: 1.5\n", r"run.yaml: tp must be an integer, got 1.5"),
    (b"lr: fast\n", r"run.yaml: lr must be a number, got 'fast'"),
    (b"sequence_parallel: maybe\n", r"run.yaml: sequence_parallel must be true or false, "
                                    r"got 'maybe'"),
    (b"model:\n  - tiny\n", r"run.yaml: model must be a string, got \['tiny'\]"),
    (b"tp: [1\npp: 2\n", r"run.yaml line 2, column 3: YAML syntax error: expected ',' or ']'"),
    (b"lr: \xff\xfe\n", r"run.yaml is not UTF-8 text \(byte 0xff at offset 4\)"),
    (b"- 1\n- 2\n", r"run.yaml: expected a mapping at the top level, got list"),
    (b"train: 5\n", r"run.yaml: train is a section of fields \(for example `train: "
                    r"\{micro_batch_size: ...\}`\), got 5"),
    (b"train_steps: 5\ntrain_steps: 6\n", r"run.yaml line 2: train_steps is given twice; "
                                          r"keep one"),
    (b"train_steps: 5\ntrain:\n  train_steps: 6\n", r"run.yaml: train_steps is given twice "
                                                    r"\(as train_steps and as "
                                                    r"train.train_steps\); keep one"),
    # null where the field has no "none": refused, naming the field and its default
    (b"split: null\n", r"run.yaml: split is null: give a value or leave the key out "
                       r"\(default: '969,30,1'\)"),
    (b"save_interval: null\n", r"run.yaml: save_interval is null: give a value"),
    (b"overwrite: null\n", r"run.yaml: overwrite is null: give a value"),
    # integers YAML 1.1 (PyYAML) and YAML 1.2 read differently
    (b"train:\n  train_steps: 010\n", r"run.yaml line 2: 010 is octal 8 to YAML 1.1 and 10 "
                                      r"to YAML 1.2; write 8 or 10$"),
    (b"train_steps: 1:30\n", r"run.yaml line 1: 1:30 is a base-60 number to YAML 1.1 \(90\) "
                            r"and a string to YAML 1.2; write 90, or quote it$"),
    # an alias bomb: its value is named in a bounded line (not its whole repr)
    (b"".join(b"%c: &%c [%s]\n" % (c, c, b",".join([b"*%c" % (c - 1)] * 9) if c > 97 else
              b"1") for c in range(97, 106)) + b"prompt: *i\n",
     r"run.yaml: prompt must be a string, got \[\[\[\.\.\.\], \[\.\.\.\], "),
])
def test_bad_yaml_is_one_line_naming_file_field_and_line(tmp_path: Path, text: bytes,
                                                          message: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_bytes(text)
    with pytest.raises(ConfigError, match=message) as err:
        load_config(path)
    assert "\n" not in str(err.value) and len(str(err.value)) < 300


def test_yaml_anchors_and_merge_keys_are_read_as_yaml_defines_them(tmp_path: Path) -> None:
    """A merge key (``<<: *base``, then a key of its own that overrides the merged one) is
    YAML: read as YAML defines it, not refused as a syntax error; a key given twice beside
    the merge is still refused."""
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  <<: &base {train_steps: 2, lr: 0.001}\n  lr: 0.002\n")
    config = load_config(path)
    assert (config.train.train_steps, config.train.lr) == (2, 0.002)
    path.write_text("train:\n  <<: {train_steps: 2}\n  lr: 0.002\n  lr: 0.003\n")
    with pytest.raises(ConfigError, match=r"run.yaml line 4: lr is given twice; keep one"):
        load_config(path)


def test_a_config_path_that_is_not_there_is_not_a_shipped_one(tmp_path: Path) -> None:
    """A bare name finds a shipped config; a path that does not exist is refused, even where
    its file name is a shipped config's."""
    assert load_config("demo-3d").parallel.tp == 2
    with pytest.raises(ConfigError, match=f"config file {tmp_path}/demo-3d.yaml not found"):
        load_config(tmp_path / "demo-3d.yaml")


def test_a_toml_config_and_bad_data_flags_are_named_for_what_they_are(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("[train]\nsteps = 5\n")
    with pytest.raises(ConfigError, match=r"run.toml: config files are YAML \(section: then "
                       r"indented key: value lines\), not TOML"):
        load_config(toml)
    raw = tmp_path / "raw.jsonl"  # raw text, not a prepared dataset or a blend file
    raw.write_text("\n".join(f'{{"text": "document {i} of many words"}}' for i in range(2000)))
    with pytest.raises(ConfigError) as err:
        load_config(None, {"data": str(raw)})
    assert str(err.value) == (f'--data {raw} is a file but not a blend file ("WEIGHT PATH" '
                              f"pairs); raw text is prepared first: `mt data prepare {raw} -o "
                              "DIR`, then --data DIR")
    folder = tmp_path / "ds"
    folder.mkdir()
    with pytest.raises(ConfigError, match=rf"--data: the blend weight of {folder} is 0; every "
                       r"weight must be positive"):
        load_config(None, {"data": f"0 {folder} 1 {folder}"})


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None,
                    reason="tensorboard is installed here")
def test_tensorboard_without_its_package_is_refused_up_front() -> None:
    """--tensorboard without its package is one line before the run (not a warning in the
    middle of the run, which would go on without it)."""
    with pytest.raises(ConfigError, match=r"--tensorboard needs the tensorboard package, which "
                       r"is not installed: pip install tensorboard"):
        load_config(None, {"tensorboard": True})


def test_too_few_processes_for_the_layout_says_what_to_pass() -> None:
    with pytest.raises(ConfigError, match=r"world size 1 is not divisible by tp 2 x pp 2 = 4; "
                       r"with 1 process pass --tp and --pp whose product divides 1, e.g. "
                       r"--tp 1 --pp 1"):
        load_config("demo-3d", {"nproc": 1})


def test_paths_the_flags_name_are_checked_before_anything_starts(tmp_path: Path) -> None:
    """--metrics naming a folder, --cache-dir naming a file, --tokenizer naming no file or
    given with --data (where the dataset's own tokenizer applies): one line each, before any
    rank starts."""
    (tmp_path / "mdir").mkdir()
    (tmp_path / "afile").write_text("x")
    data = tmp_path / "data"
    data.mkdir()
    for overrides, message in (
            ({"metrics": str(tmp_path / "mdir")}, "--metrics .*mdir is a folder; name the JSONL"),
            ({"cache_dir": str(tmp_path / "afile")}, "--cache-dir .*afile is a file; name a "
                                                     "folder"),
            ({"tokenizer": str(tmp_path / "no-such-tok.json")}, "--tokenizer: no tokenizer at"),
            ({"tokenizer": "gpt2", "data": str(data)},
             "--tokenizer gpt2 applies to the embedded corpus only")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)
    # A command line that names the dataset's own tokenizer ran before and still runs.
    (data / "index.json").write_text('{"tokenizer": {"name": "gpt2"}}')
    assert load_config(None, {"tokenizer": "gpt2", "data": str(data)}).data.tokenizer == "gpt2"
    with pytest.raises(ConfigError, match=r"prepared with \(gpt2\); leave out --tokenizer"):
        load_config(None, {"tokenizer": "tokenizer-1k", "data": str(data)})


def test_a_path_through_a_link_loop_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    """A symbolic link loop as (or on the way to) an output, the data or --load: one line
    naming the flag, not a RuntimeError from Path.resolve."""
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "back")
    (tmp_path / "back").symlink_to(loop)
    for flag, path in (("out_dir", loop), ("save", loop / "ck"), ("metrics", loop / "m.jsonl"),
                       ("cache_dir", loop), ("data", loop), ("load", loop)):
        with pytest.raises(ConfigError) as err:
            load_config(None, {"out_dir": str(tmp_path / "run"), flag: str(path)})
        assert str(err.value) == (f"--{flag.replace('_', '-')} {path}: a symbolic link on "
                                  "the way loops back on itself; name another path")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "loop"]


def test_metrics_that_is_no_regular_file_or_where_checkpoints_go_is_refused(
        tmp_path: Path) -> None:
    """--metrics naming a pipe or a device (opening a pipe waits for a reader forever,
    /dev/full fails after the run started), the checkpoint folder itself, its `latest` or a
    place inside a step folder (a save replaces those, and the metrics with them): one line,
    before anything starts; /dev/null is taken (the metrics thrown away)."""
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    run = tmp_path / "run"
    ck = run / "checkpoints"
    for overrides, line in (
            ({"metrics": str(fifo)}, f"--metrics {fifo} is not a regular file; name the JSONL "
                                     "file to write (or 'none')"),
            ({"metrics": "/dev/full"}, "--metrics /dev/full is not a regular file; name the "
                                       "JSONL file to write (or 'none')"),
            ({"metrics": str(ck / "latest")}, f"--metrics {ck / 'latest'} lies where the "
             f"checkpoints of {ck} go (latest): a save would replace it; choose another "
             "--metrics"),
            ({"metrics": str(ck / "step-00000001" / "m.jsonl")}, f"--metrics "
             f"{ck / 'step-00000001' / 'm.jsonl'} lies where the checkpoints of {ck} go "
             "(step-00000001): a save would replace it; choose another --metrics"),
            ({"save": str(run / "metrics.jsonl")}, f"--metrics {run / 'metrics.jsonl'} is "
             "the checkpoint folder (--save); choose another --metrics or --save")):
        with pytest.raises(ConfigError) as err:
            load_config(None, {"out_dir": str(run), **overrides})
        assert str(err.value) == line
    assert not run.exists()
    assert load_config(None, {"out_dir": str(run), "metrics": str(ck / "m.jsonl")})
    assert load_config(None, {"out_dir": str(run), "metrics": "/dev/null"}).metrics_path == \
        Path("/dev/null")  # thrown away, as the command line asks


def _dataset(folder: Path, tokenizer: str) -> Path:
    """A one-shard dataset of the embedded corpus' first documents, by ``tokenizer``."""
    from mt_data import ShardSetWriter, load_tokenizer
    from mt_data.corpus import iter_corpus

    tok, docs = load_tokenizer(tokenizer), list(iter_corpus())[:5]
    batch = tok.encode_batch([d["text"] for d in docs])
    writer = ShardSetWriter(folder, tok.describe(), tok.dtype.name)
    writer.add("shard-0.arrow", batch.tokens, batch.lengths, [d["id"] for d in docs],
               [d["source"] for d in docs])
    writer.finish()
    return folder


def test_the_datasets_tokenizer_is_one_and_the_one_they_record(tmp_path: Path) -> None:
    """A blend of datasets of two tokenizers, and a dataset whose tokenizer file was edited
    since it was prepared, are refused before anything starts."""
    from mt_data import train_tokenizer
    from mt_data.corpus import corpus_texts

    small, gpt2 = _dataset(tmp_path / "small", "tokenizer-1k"), _dataset(tmp_path / "g", "gpt2")
    with pytest.raises(ConfigError) as err:
        load_config(None, {"data": f"0.5 {small} 0.5 {gpt2}"})
    assert str(err.value).startswith(f"blend: {gpt2} was prepared with tokenizer 'gpt2' and "
                                     f"{small} with 'tokenizer-1k' (sha256 ")
    assert load_config(None, {"data": f"0.5 {small} 0.5 {small}"}).data.data
    texts = corpus_texts()
    path = tmp_path / "tok.json"
    train_tokenizer(texts[:40], 400).save(path)
    mine = _dataset(tmp_path / "mine", str(path))
    assert load_config(None, {"data": str(mine)}).data.data == str(mine)
    train_tokenizer(texts[40:80], 400).save(path)  # edited after the data was prepared
    with pytest.raises(ConfigError, match=rf"^dataset {mine} records tokenizer '{path}', but "
                       r"the tokenizer there now is another one \(sha256 [0-9a-f]{12}\.\.\. "
                       r"against [0-9a-f]{12}\.\.\.\): restore it, or prepare the data again$"):
        load_config(None, {"data": str(mine)})


def test_a_tokenizer_file_edited_between_runs_of_one_process_is_read_again(
        tmp_path: Path) -> None:
    """The embedded corpus' cache key and a run's tokenizer fingerprint follow a tokenizer
    file edited in place between two runs of one process (a notebook): not the file as the
    first run read it."""
    from mt_data import load_tokenizer, train_tokenizer
    from mt_data.corpus import corpus_texts
    from mt_pretrain.data.inputs import _demo_key, run_tokenizer

    texts, path = corpus_texts(), tmp_path / "tok.json"
    train_tokenizer(texts[:40], 400).save(path)
    data = load_config(None, {"tokenizer": str(path)}).data
    before = run_tokenizer(data, 400)[1], _demo_key(str(path))
    assert before[0] == load_tokenizer(str(path)).fingerprint
    train_tokenizer(texts[40:80], 400).save(path)
    after = run_tokenizer(data, 400)[1], _demo_key(str(path))
    assert after[0] == load_tokenizer(str(path)).fingerprint
    assert after[0] != before[0] and after[1] != before[1]


@pytest.mark.parametrize("overrides, message", [
    # Unchecked: a traceback from torch.manual_seed ("Overflow when unpacking long long").
    ({"seed": 2**70}, r"--seed must be between 0 and 2\*\*63 - 1, got 1180591620717411303424"),
    # Unchecked: numpy's "expected non-negative integer" from the data shuffle, caught as
    # too little text: "use a shorter --seq-len or more data".
    ({"seed": -1}, r"--seed must be between 0 and 2\*\*63 - 1, got -1"),
    # Unchecked: an OverflowError in every rank's process group.
    ({"timeout": float("inf")}, r"--timeout must be at most 1e\+09 seconds .*got inf"),
    ({"timeout": 1e300}, r"--timeout must be at most 1e\+09 seconds .*got 1e\+300"),
    ({"timeout": float("nan")}, r"--timeout must be at least 1 seconds .*got nan"),
    # Unchecked: accepted, doing nothing (never exits; every MFU 0).
    ({"exit_duration": float("inf")}, r"--exit-duration must be a finite number of minutes"),
    ({"peak_tflops": float("inf")}, r"--peak-tflops must be a finite number, got inf"),
    ({"split": "inf,1,1"}, r"--split must be three weights like '969,30,1', got 'inf,1,1'"),
    ({"log_interval": 2**70}, r"--log-interval must be below 2\*\*63, got 1180591620717411303424"),
    ({"save_interval": 2**63}, r"--save-interval must be below 2\*\*63"),
    ({"eval_iters": 2**64}, r"--eval-iters must be below 2\*\*63"),
    ({"zero_stage": 2**64}, r"--zero-stage must be below 2\*\*63"),
    ({"dropout": float("nan")}, r"--dropout must be in \[0, 1\), got nan"),
    # A prompt that is not UTF-8, refused before the run, not at its sample. A byte of a
    # command line that is not UTF-8 reaches Python as a lone surrogate (surrogateescape).
    ({"prompt": b"caf\xe9".decode("utf-8", "surrogateescape")},
     r"--prompt holds the byte 0xe9, not UTF-8, at character 3: give UTF-8 text"),
    ({"prompt": "a \ud800"}, r"--prompt holds a lone surrogate \\ud800 at character 2"),
    # Unchecked: torch's "Storage size calculation overflowed" in the rank, as a traceback.
    ({"nproc": 1, "hidden": 2**40, "n_heads": 1},
     r"invalid model: 4 layers, hidden 1,099,511,627,776, .* more than 2\*\*63 bytes"),
    ({"nproc": 1, "vocab_size": 2**62}, r"invalid model: .*vocab 4,611,686,018,427,387,904"),
    ({"nproc": 1, "train_steps": 2**62},
     r"4,611,686,018,427,387,904 steps of 32 sequences of 64 tokens: .* tokens; at most "
     r"2\*\*63 - 1 \(fewer --train-steps or --train-tokens\)"),
    ({"nproc": 2**21, "global_batch_size": 2**23},
     r"world size 2,097,152 \(--nproc, --dp or the launcher's\); at most 1,048,576"),
])
def test_numbers_that_would_overflow_or_do_nothing_are_refused(overrides: dict,
                                                               message: str) -> None:
    """Every number the config takes is range-checked where it is read, naming the flag and
    the value (house rule: one line, before anything starts)."""
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)


def test_the_seed_range_holds_on_the_command_line_and_in_yaml(tmp_path: Path) -> None:
    """`mt pretrain --seed -1`
    and a YAML seed beyond 2**63 - 1; the largest seed itself is kept exactly."""
    result = CliRunner().invoke(app, ["pretrain", "--seed", "-1", "--dry-run"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert "--seed must be between 0 and 2**63 - 1, got -1" in result.output
    assert "--seq-len" not in result.output and "Traceback" not in result.output
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  seed: 1180591620717411303424\n")
    with pytest.raises(ConfigError, match=r"--seed must be between 0 and 2\*\*63 - 1, got "
                       r"1180591620717411303424"):
        load_config(path)
    path.write_text("seed: 9223372036854775807\n")
    assert load_config(path).train.seed == 2**63 - 1
    path.write_text("seed: '9223372036854775807'\n")
    assert load_config(path).train.seed == 2**63 - 1


@pytest.mark.parametrize("flags, message", [
    (["--sequence-parallel"], "--sequence-parallel shards activations over the "
                              "tensor-parallel ranks, and --tp 1 has none"),
    (["--virtual-stages", "2"], "--virtual-stages 2 splits each pipeline stage into model "
                                "chunks, and --pp 1 has no pipeline"),
    (["--virtual-stages", "2", "--schedule", "interleaved"], "--virtual-stages 2 splits each "
                                                             "pipeline stage"),
    (["--no-main-grads"], "--no-main-grads keeps 16-bit gradients with --precision bf16 or "
                          "fp16; with --precision fp32 the gradients are fp32 anyway"),
    # A schedule of one chunk per stage with --virtual-stages: refused at every --pp alike.
    (["--nproc", "2", "--pp", "2", "--virtual-stages", "2", "--schedule", "1f1b"],
     "schedule '1f1b' runs one chunk per stage, got virtual_stages 2"),
])
def test_options_that_would_do_nothing_are_refused(flags: list[str], message: str) -> None:
    """Options that would change nothing (sequence parallelism without TP, model chunks
    without a pipeline, fp32 main gradients of fp32 gradients) are refused in one line, not
    accepted in silence."""
    result = CliRunner().invoke(app, ["pretrain", *flags, "--dry-run"],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output


def test_the_same_options_where_they_apply_are_accepted() -> None:
    for overrides in ({"nproc": 2, "tp": 2, "sequence_parallel": True},
                      {"nproc": 2, "pp": 2, "virtual_stages": 2, "schedule": "interleaved",
                       "global_batch_size": 8, "micro_batch_size": 1},
                      {"precision": "bf16", "main_grads": False}):
        load_config(None, overrides)
