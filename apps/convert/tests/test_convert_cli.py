"""``mt convert`` on the command line: conversions, --dry-run, error exits, mounting under
the root ``mt`` Typer app, and ``python -m mt_convert``."""

from __future__ import annotations

import io
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from mt_convert.cli import app
from mt_data import load_tokenizer
from mt_formats import load_state_dict, save_model
from mt_model import GPT, preset

runner = CliRunner()


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    save_model(GPT(preset("tiny"), seed=4), tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_convert_cli_converts_and_round_trips(checkpoint: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, [str(checkpoint), str(tmp_path / "hf"), "--to", "hf"])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and "52 tensors" in result.output
    # options may come after or before the positional arguments; --tp implies --to tp
    result = runner.invoke(app, ["--tp", "2", str(tmp_path / "hf"), str(tmp_path / "tp")])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, [str(tmp_path / "tp"), str(tmp_path / "back"), "--from", "tp"])
    assert result.exit_code == 0, result.output
    assert (checkpoint / "model.safetensors").read_bytes() == (
        tmp_path / "back" / "model.safetensors").read_bytes()


def test_convert_cli_dry_run_prints_mapping_and_writes_nothing(checkpoint: Path,
                                                               tmp_path: Path) -> None:
    result = runner.invoke(app, [str(checkpoint), str(tmp_path / "out"), "--to", "tp",
                                 "--tp", "2", "--dry-run"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "(consolidated) ->" in lines[0] and "52 tensors" in lines[0]
    at = lines.index("blocks.0.attn.qkv.weight")
    assert lines[at + 1:at + 4] == [
        "  <- model.safetensors:blocks.0.attn.qkv.weight [192, 64] F32",
        "  -> tp_rank_00/model.safetensors:blocks.0.attn.qkv.weight [96, 64] F32 "
        "(tp 0/2 column_qkv)",
        "  -> tp_rank_01/model.safetensors:blocks.0.attn.qkv.weight [96, 64] F32 "
        "(tp 1/2 column_qkv)",
    ]
    result = runner.invoke(app, [str(checkpoint), str(tmp_path / "out"), "--to", "hf",
                                 "--dry-run"])
    assert ("  -> model.safetensors:transformer.h.0.mlp.c_fc.weight [64, 256] F32 (transpose)"
            in result.output.splitlines())
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("options", "said"), [
    (["--dp", "2", "--to", "consolidated"], "--dp and --zero-stage only apply"),
    (["--zero-stage", "2", "--to", "hf"], "--dp and --zero-stage only apply"),
    (["--drop-optimizer", "--to", "hf"], "--drop-optimizer only applies"),
    (["--tokenizer", "gpt2", "--to", "tp"], "--tokenizer only applies to the hf and gguf"),
    (["--gguf-type", "q8_0", "--to", "hf"], "--gguf-type only applies to the gguf target"),
    (["--tokenizer", "/nonexistent/tokenizer.json", "--to", "hf"], "tokenizer: "),
])
def test_convert_cli_dry_run_refuses_what_the_conversion_refuses(
        checkpoint: Path, tmp_path: Path, options: list[str], said: str) -> None:
    """The dry run refuses, in the same line and exit 2, the options the conversion would:
    ones that do not apply to the target, and a tokenizer that cannot be loaded (found
    before any tensor is written)."""
    for dry in (["--dry-run"], []):
        result = runner.invoke(app, [str(checkpoint), str(tmp_path / "out"), *options, *dry],
                               env={"COLUMNS": "400"})
        assert result.exit_code == 2, (dry, result.output)
        assert said in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_convert_cli_pipeline_and_megatron_layouts(checkpoint: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, [str(checkpoint), str(tmp_path / "out"), "--pp", "2",
                                 "--tp", "2", "--pad-multiple", "8", "--dry-run"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    at = lines.index("embed.tokens.weight")
    assert lines[at + 2:at + 6] == [  # 1000 rows padded to 1008 = 2 x 504; tied on stage 1
        f"  -> pp_rank_{s:02d}_tp_rank_{t:02d}/model.safetensors:embed.tokens.weight "
        f"[504, 64] F32 (pp {s}/2 tp {t}/2 vocab)" for s in range(2) for t in range(2)]
    result = runner.invoke(app, [str(checkpoint), str(tmp_path / "meg"), "--to", "megatron",
                                 "--pp", "2"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, [str(tmp_path / "meg"), str(tmp_path / "back"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "  <- iter_0000000/mp_rank_00_001/model_optim_rng.pt:language_model.encoder.layers." \
        "1.self_attention.query_key_value.weight [192, 64] F32 (tp 0/1 column (per-head " \
        "q,k,v order))" in result.output.splitlines()
    result = runner.invoke(app, [str(tmp_path / "meg"), str(tmp_path / "back")])
    assert result.exit_code == 0, result.output
    assert (checkpoint / "model.safetensors").read_bytes() == (
        tmp_path / "back" / "model.safetensors").read_bytes()


def test_convert_cli_bad_input_exits_2_with_one_message(checkpoint: Path, tmp_path: Path) -> None:
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    result = runner.invoke(app, [str(checkpoint), str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "error:" in result.output and "model.safetensors: not a readable safetensors " \
        "file (malformed or truncated)" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()
    result = runner.invoke(app, [str(tmp_path / "nowhere"), str(tmp_path / "out")])
    assert result.exit_code == 2 and "checkpoint directory not found" in result.output
    result = runner.invoke(app, [str(checkpoint), str(tmp_path / "out"), "--to", "bogus"])
    assert result.exit_code == 2  # usage error from the option's choices
    result = runner.invoke(app, [str(checkpoint), str(tmp_path / "out"), "--to", "deepspeed"])
    assert result.exit_code == 2 and "cannot write the 'deepspeed' format" in result.output


def test_convert_cli_mounts_under_the_root_mt_app(checkpoint: Path, tmp_path: Path) -> None:
    # what mt_pretrain's root CLI does with the "mt.commands" entry point
    root = typer.Typer()

    @root.callback()
    def _root() -> None:
        """mt"""

    root.add_typer(app, name="convert")
    result = runner.invoke(root, ["convert", str(checkpoint), str(tmp_path / "hf"),
                                  "--to", "hf"])
    assert result.exit_code == 0, result.output
    config, _ = load_state_dict(tmp_path / "hf")
    assert config.n_layers == 4
    usage = runner.invoke(root, ["convert", "--help"]).output
    assert "root convert [OPTIONS]" in usage and "COMMAND" not in usage  # no sub-command


def test_convert_cli_python_dash_m(checkpoint: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "mt_convert", str(checkpoint),
                           str(tmp_path / "hf"), "--to", "hf", "--dry-run"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "transformer.wte.weight" in proc.stdout


def test_convert_cli_sigterm_mid_way_leaves_nothing(checkpoint: Path, tmp_path: Path) -> None:
    """SIGTERM (a scheduler's, a container's stop) during the write is an interrupt like
    Ctrl-C: exit 130, one line, no half-written staging folder left beside the destination;
    a rerun then converts."""
    script = (  # SIGTERM to itself after the third tensor
        "import os, signal, sys\n"
        "import mt_formats.convert as convert\n"
        "stream = convert._stream\n"
        "def stopped(names, get):\n"
        "    for done, item in enumerate(stream(names, get)):\n"
        "        if done == 3:\n"
        "            os.kill(os.getpid(), signal.SIGTERM)\n"
        "        yield item\n"
        "convert._stream = stopped\n"
        "from mt_convert.cli import main\n"
        "sys.argv = ['mt-convert', *sys.argv[1:]]\n"
        "main()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", script, str(checkpoint), str(out), "--to",
                           "hf"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 130, (proc.returncode, proc.stderr)
    assert "interrupted: nothing was written" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    result = runner.invoke(app, [str(checkpoint), str(out), "--to", "hf"])
    assert result.exit_code == 0, result.output


def _file_size_limit(limit: int) -> None:
    """For ``preexec_fn``: writes past ``limit`` bytes fail (EFBIG) as on a full disk."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.parametrize("to", ["megatron", "mcore"])
def test_convert_cli_a_full_disk_inside_torch_save_is_a_failed_write(
        checkpoint: Path, tmp_path: Path, to: str) -> None:
    """Targets written with ``torch.save`` (megatron's rank files, mcore's chunks): a write
    that fails inside it (torch's zip writer reports it as a RuntimeError of its own) is
    the one line of any failed write, exit 1, and nothing is left."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "mt_convert", str(checkpoint), str(out),
                           "--to", to], capture_output=True, text=True, env=env, timeout=120,
                          preexec_fn=lambda: _file_size_limit(100_000))
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    error = proc.stderr.replace("\n", "")
    assert f"{out}: writing failed, nothing was written: [Errno 27] File too large" in error
    assert "Traceback" not in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_an_interrupt_inside_torch_save_stays_an_interrupt() -> None:
    """A signal's KeyboardInterrupt raised by a write in the middle of ``torch.save`` (which
    its zip writer would report as a RuntimeError) reaches the caller as KeyboardInterrupt."""
    from mt_formats.torch_io import save_into

    class Interrupted(io.BytesIO):
        def write(self, data: object) -> int:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_into({"w": torch.zeros(1000)}, Interrupted())


def test_convert_cli_dcp_folders(tmp_path: Path) -> None:
    # mt's own state dict saved by torch's dcp.save (no model config): exit 2 with one
    # line asking for --model; with it, the same tensors
    import json

    import torch.distributed.checkpoint as dcp

    model = GPT(preset("tiny"), seed=6)
    dcp.save(model.state_dict(), checkpoint_id=tmp_path / "plain", no_dist=True)
    result = runner.invoke(app, [str(tmp_path / "plain"), str(tmp_path / "out")])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1
    assert "does not record the model config" in result.output
    (tmp_path / "fields.json").write_text(json.dumps({"n_heads": 4}))
    result = runner.invoke(app, [str(tmp_path / "plain"), str(tmp_path / "out"), "--model",
                                 str(tmp_path / "fields.json")])
    assert result.exit_code == 0, result.output
    _, state = load_state_dict(tmp_path / "out")
    for name, tensor in model.state_dict().items():
        assert state[name].equal(tensor), name
    # --to dcp, read back by detection; the dry run names torchtitan / HF keys and files
    result = runner.invoke(app, [str(tmp_path / "out"), str(tmp_path / "dcp"), "--to", "dcp"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, [str(tmp_path / "dcp"), str(tmp_path / "x"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "(dcp) -> " in result.output.splitlines()[0]
    assert ("  <- __0_0.distcp:transformer.h.0.mlp.c_fc.weight [64, 256] F32 (transpose)"
            in result.output.splitlines())


def test_convert_cli_carries_a_hugging_face_source_s_tokenizer(checkpoint: Path,
                                                               tmp_path: Path) -> None:
    """A Hugging Face folder's own tokenizer travels to the targets that store one (hf,
    gguf) without --tokenizer; one mt cannot load, or one of more ids than the model's
    vocabulary, is left out with a note saying why, and the weights convert."""
    hf = tmp_path / "hf"
    result = runner.invoke(app, [str(checkpoint), str(hf), "--to", "hf", "--tokenizer",
                                 "tokenizer-1k"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    again = tmp_path / "again"
    result = runner.invoke(app, [str(hf), str(again), "--to", "hf"], env={"COLUMNS": "400"})
    assert result.exit_code == 0 and "no tokenizer written" not in result.output, result.output
    assert (again / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    load_tokenizer("gpt2").save(hf / "tokenizer.json")  # 50257 ids: more than the model's
    result = runner.invoke(app, [str(hf), str(tmp_path / "second"), "--to", "hf"],
                           env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "its 50257 ids are more than the model's vocabulary of" in result.output
    (hf / "tokenizer.json").write_text("{not json")
    result = runner.invoke(app, [str(hf), str(tmp_path / "third"), "--to", "hf"],
                           env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "note: the source's tokenizer is not written (tokenizer: " in result.output
    assert not (tmp_path / "third" / "tokenizer.json").exists()
