"""Loading `mt pretrain` configs: YAML (sections or flat keys) + flat overrides, checked
against the data, the task files and the engines."""

from __future__ import annotations

import dataclasses
import errno
import fnmatch
import importlib.util
import json
import math
import os
import reprlib
from collections.abc import Iterable, Mapping
from dataclasses import fields
from functools import cache
from pathlib import Path
from typing import Any

from mt_data.paths import blocking_file, output_clash, unwritable
from mt_eval import TaskError, load_tasks
from mt_pretrain.config.fields import field_docs, flat_fields
from mt_pretrain.config.refusals import unsupported
from mt_pretrain.config.resolve import elastic_world, resolve
from mt_pretrain.config.schema import SECTIONS, ConfigError, DataArgs, PretrainConfig

# field_docs and flat_fields live in config.fields (pure); re-exported here.
__all__ = ["SHIPPED", "blend_text", "build_config", "dataset_paths", "field_docs",
           "flat_fields", "load_config", "read_yaml", "replace_config"]

#: Configs shipped with mt pretrain, usable by name: ``--config demo-3d``.
SHIPPED = Path(__file__).parent.parent / "configs"


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxstring = 2, 4, 4, 60


def _shown(value: Any) -> str:
    """``value`` for an error message, bounded (a YAML alias bomb is a value whose full repr
    would not fit in memory)."""
    return _SHOWN.repr(value)


def _coerce(name: str, value: Any, f: dataclasses.Field) -> Any:
    """``value`` as the field's type (YAML gives '1e9' as a string, 5 for a float); a value
    of the wrong kind, or null where the field has no "none", is a ConfigError naming the
    field, the value and what is allowed."""
    kind = str(f.type).split(" ")[0].rstrip("|")
    if value is None:
        if "None" in str(f.type):
            return None
        default = "" if f.default is dataclasses.MISSING else f" (default: {f.default!r})"
        raise ConfigError(f"{name} is null: give a value or leave the key out{default}")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{name} must be true or false, got {_shown(value)}")
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value  # exact (through a float, 2**63 - 1 became 2**63)
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            return int(value)
        try:
            number = float(value) if isinstance(value, (str, float, int)) and not isinstance(
                value, bool) else math.nan
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number != int(number):
            raise ConfigError(f"{name} must be an integer, got {_shown(value)}")
        return int(number)
    if kind == "float":
        try:
            if isinstance(value, (int, float, str)) and not isinstance(value, bool):
                return float(value)
        except ValueError:
            pass
        raise ConfigError(f"{name} must be a number, got {_shown(value)}")
    if kind == "str" and not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {_shown(value)}")
    return value


def build_config(nested: Mapping[str, Any], flat: Mapping[str, Any],
                 source: str | None = None) -> PretrainConfig:
    """Config from a YAML-like mapping (sections or flat keys) and flat overrides; errors
    about ``nested`` values name ``source`` (the YAML file)."""
    known = flat_fields()
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    unknown: list[str] = []

    def put(key: Any, value: Any, where: str | None) -> None:
        name = str(key).replace("-", "_")
        if name not in known:
            unknown.append(str(key))
            return
        section, f = known[name]
        try:
            values[section][name] = _coerce(name, value, f)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}" if where else str(err)) from None

    where = f"{source}: " if source else ""
    seen: dict[str, str] = {}

    def put_nested(key: Any, value: Any, spelled: str) -> None:
        name = str(key).replace("-", "_")
        if name in seen:
            raise ConfigError(f"{where}{name} is given twice (as {seen[name]} and as "
                              f"{spelled}); keep one")
        seen[name] = spelled
        put(key, value, source)

    for key, value in nested.items():
        if key in SECTIONS and (isinstance(value, Mapping) or key not in known):
            if not isinstance(value, Mapping):
                first = fields(SECTIONS[key])[0].name
                raise ConfigError(f"{where}{key} is a section of fields (for example "
                                  f"`{key}: {{{first}: ...}}`), got {value!r}")
            for sub, v in value.items():
                put_nested(sub, v, f"{key}.{sub}")
        else:
            put_nested(key, value, str(key))
    for key, value in flat.items():
        put(key, value, None)
    if unknown:
        raise ConfigError(f"{where}unknown config keys {sorted(unknown)}; valid keys: "
                          f"{sorted(known)} (optionally under sections {sorted(SECTIONS)})")
    try:
        sections = {s: SECTIONS[s](**values[s]) for s in SECTIONS}
    except TypeError as err:
        raise ConfigError(str(err)) from None
    config = PretrainConfig(**sections)
    if config.log.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard needs the tensorboard package, which is not "
                          "installed: pip install tensorboard (or leave out --tensorboard)")
    if config.log.wandb_project is not None and \
            importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb-project needs the wandb package, which is not installed: "
                          "pip install 'mt-pretrain[wandb]' (or leave out --wandb-project)")
    _check_paths(config)
    _check_blend(config.data)
    _check_link_loops(("--data", path) for path in dataset_paths(config.data))
    _check_outputs(config, source)
    missing = [str(p) for p in dataset_paths(config.data) if not p.is_dir()]
    if missing:
        raise ConfigError(f"invalid configuration: data path(s) not found: {missing} (prepare "
                          "them with `mt data prepare`, or omit --data for the embedded corpus)")
    if config.data.data is not None:
        _check_prepared_tokenizer(dataset_paths(config.data), config.data.tokenizer)
    try:  # read now: a bad task file fails before training
        load_tasks(config.train.eval_tasks)
    except TaskError as err:
        raise ConfigError(f"--eval-task: {err}") from None
    if config.parallel.nproc is not None or config.parallel.dp is not None:
        resolve(config, config.world_size_hint())  # the flags fix the world size: check now
        _check_elastic(config)
    elif unsupported(config):  # resolve checks this too; without a world size, here
        raise ConfigError("invalid configuration: " + "; ".join(unsupported(config)))
    return config


def _check_elastic(config: PretrainConfig) -> None:
    """An elastic run can continue on fewer ranks than it starts with: else refused now,
    not after the first failure."""
    par = config.parallel
    if par.min_nproc is None or par.nproc is None or par.min_nproc == par.nproc:
        return
    if elastic_world(config, par.nproc - 1) is None:
        raise ConfigError(
            f"--min-nproc {par.min_nproc}: no world size from {par.nproc - 1} down to "
            f"{par.min_nproc} fits the layout (tp {par.tp} x cp {par.cp} x pp {par.pp} "
            f"divides it; global batch {config.train.global_batch_size} splits into "
            f"micro-batches of {config.train.micro_batch_size} per data-parallel rank): the "
            "run could not continue after a failure")


def replace_config(config: PretrainConfig, **flat: Any) -> PretrainConfig:
    """A copy of ``config`` with flat field overrides (``tp=1``, ``train_steps=10``...)."""
    return build_config(config.to_dict(), flat)


def load_config(path: str | Path | None = None,
                overrides: Mapping[str, Any] | None = None) -> PretrainConfig:
    """Defaults <- YAML file ``path`` (or a shipped config's name) <- ``overrides`` (flat
    field names)."""
    nested: Mapping[str, Any] = {}
    if path is not None:
        path = Path(path)
        shipped = SHIPPED / f"{path.name.removesuffix('.yaml')}.yaml"
        if not path.is_file() and len(path.parts) == 1 and shipped.is_file():  # a bare name
            path = shipped
        if path.exists() and not path.is_file():  # a device (/dev/null), a pipe, a folder
            raise ConfigError(f"config file {path} is not a regular file; name a YAML file")
        if not path.is_file():
            names = sorted(p.stem for p in SHIPPED.glob("*.yaml"))
            raise ConfigError(f"config file {path} not found (shipped configs: {names})")
        loaded = read_yaml(path)
        if not isinstance(loaded, Mapping):
            raise ConfigError(f"{path}: expected a mapping at the top level, got "
                              f"{type(loaded).__name__}")
        nested = loaded
    return build_config(nested, dict(overrides or {}), str(path) if path else None)


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path`` ({} when empty); a file that is TOML, not UTF-8, not
    YAML, or gives a key twice is a :class:`ConfigError` naming the file (and line)."""
    import yaml

    if path.suffix.lower() in (".toml", ".ini", ".cfg"):
        raise ConfigError(f"{path}: config files are YAML (section: then indented "
                          f"key: value lines), not {path.suffix[1:].upper()}")
    try:
        loaded = yaml.load(path.read_text(encoding="utf-8"), Loader=_unique_keys_loader())
    except ConfigError as err:  # a key given twice
        raise ConfigError(f"{path} {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text (byte {err.object[err.start]:#04x} "
                          f"at offset {err.start})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{path}{where}: YAML syntax error: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: YAML nested too deeply to read") from None
    return {} if loaded is None else loaded


@cache
def _unique_keys_loader() -> type:
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last
    one silently; a key a merge ``<<:`` brings in is overridden by the mapping's own, as YAML
    defines it), reading ``1e-05`` as a number as YAML 1.2 does (PyYAML's YAML 1.1 wants a
    dot, ``1.0e-05``, and gives the string '1e-05'), and refusing the integers YAML 1.1 and
    1.2 read differently: ``010`` (octal 8 to PyYAML, 10 to YAML 1.2) and base 60 ``1:30``
    (90 to PyYAML, a string to YAML 1.2)."""
    import re

    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # construct_mapping merges it
                key = self.construct_object(key_node, deep=deep)
                mark = key_node.start_mark
                if not isinstance(key, (str, int, float, bool, type(None))):

                    raise ConfigError(f"line {mark.line + 1}: a key must be a name, got "
                                      f"{type(key).__name__} {key!r}")
                if key in seen:
                    raise ConfigError(f"line {mark.line + 1}: {key} is given twice; keep "
                                      "one")
                seen.add(key)
            return super().construct_mapping(node, deep)

        def construct_yaml_int(self, node: Any) -> int:
            value = super().construct_yaml_int(node)
            text, line = node.value.replace("_", ""), node.start_mark.line + 1
            if ":" in text:
                raise ConfigError(f"line {line}: {node.value} is a base-60 number to YAML 1.1 "
                                  f"({value}) and a string to YAML 1.2; write {value}, or quote "
                                  "it")
            if re.fullmatch(r"[-+]?0[0-7]+", text):
                decimal = int(text)
                raise ConfigError(f"line {line}: {node.value} is octal {value} to YAML 1.1 and "
                                  f"{decimal} to YAML 1.2; write {value} or {decimal}")
            return value

    UniqueKeys.add_constructor("tag:yaml.org,2002:int", UniqueKeys.construct_yaml_int)
    exponent = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")
    UniqueKeys.add_implicit_resolver("tag:yaml.org,2002:float", exponent,
                                     list("-+0123456789."))
    return UniqueKeys


def _check_paths(config: PretrainConfig) -> None:
    """Files and folders the flags name, checked before anything starts."""
    data, ckpt = config.data, config.checkpoint
    metrics = config.metrics_path
    _check_link_loops((("--out-dir", ckpt.out_dir), ("--save", ckpt.save_dir),
                       ("--metrics", metrics), ("--cache-dir", data.cache_dir),
                       ("--load", ckpt.load)))
    if metrics is not None and metrics.is_dir():
        raise ConfigError(f"--metrics {metrics} is a folder; name the JSONL file to write "
                          "(or 'none')")
    if metrics is not None and metrics.exists() and not metrics.is_file() and \
            metrics != Path(os.devnull):  # /dev/null: the metrics thrown away, as asked
        raise ConfigError(f"--metrics {metrics} is not a regular file; name the JSONL file "
                          "to write (or 'none')")
    if metrics is not None and ckpt.save_dir is not None:
        _check_metrics_beside_checkpoints(metrics, ckpt.save_dir)
    if data.cache_dir is not None and Path(data.cache_dir).exists() and \
            not Path(data.cache_dir).is_dir():
        raise ConfigError(f"--cache-dir {data.cache_dir} is a file; name a folder")
    for flag, path in (("--out-dir", ckpt.out_dir), ("--save", ckpt.save_dir),
                       ("--metrics", metrics), ("--cache-dir", data.cache_dir)):
        if path is not None and (blocker := blocking_file(path)) is not None:

            raise ConfigError(f"{flag} {path}: {blocker} is a file, not a folder; name a "
                              "path in a folder")
    if metrics is not None and (why := unwritable("--metrics", metrics)):
        raise ConfigError(why)
    if data.tokenizer is None or data.data is not None:  # --data's: _check_prepared_tokenizer
        return
    if data.tokenizer not in ("gpt2", "tokenizer-1k"):
        from mt_data import DataError, load_tokenizer

        try:
            load_tokenizer(data.tokenizer)
        except (DataError, OSError, ValueError) as err:
            raise ConfigError(f"--tokenizer: {err}") from None


def _check_link_loops(paths: Iterable[tuple[str, str | Path | None]]) -> None:
    """No path of ``paths`` ((flag, path) pairs) goes through a symbolic link that leads
    back to itself."""
    for flag, path in paths:
        if path is not None and _link_loop(path):
            raise ConfigError(f"{flag} {path}: a symbolic link on the way loops back on "
                              "itself; name another path")


def _link_loop(path: str | Path) -> bool:
    """Whether a symbolic link on the way to ``path`` leads back to itself."""
    try:
        os.stat(path)
    except OSError as err:
        return err.errno == errno.ELOOP
    return False


#: What a save writes, replaces or prunes in the checkpoint folder (mt_checkpoint's
#: ``latest`` and step folders, mt pretrain's run lock).
_CHECKPOINT_NAMES = ("latest", "step-*", ".step-*", ".mt-run.lock")


def _check_metrics_beside_checkpoints(metrics: Path, save_dir: Path) -> None:
    """The metrics file is not the checkpoint folder, nor anything a save replaces in it."""
    out, folder = metrics.resolve(), save_dir.resolve()
    if out == folder:
        raise ConfigError(f"--metrics {metrics} is the checkpoint folder (--save); choose "
                          "another --metrics or --save")
    if folder not in out.parents:
        return
    name = out.relative_to(folder).parts[0]
    if any(fnmatch.fnmatchcase(name, pattern) for pattern in _CHECKPOINT_NAMES):
        raise ConfigError(f"--metrics {metrics} lies where the checkpoints of {save_dir} go "
                          f"({name}): a save would replace it; choose another --metrics")


def _check_outputs(config: PretrainConfig, source: str | None) -> None:
    """No output of the run inside one of its inputs: a dataset folder, a blend, task or
    tokenizer file, the config file."""
    data, ckpt = config.data, config.checkpoint
    inputs = [*dataset_paths(data), *(p for p in (data.data, data.tokenizer, source,
                                                  *config.train.eval_tasks)
                                      if p is not None and Path(p).exists())]
    for flag, path in (("--out-dir", ckpt.out_dir), ("--save", ckpt.save_dir),
                       ("--metrics", config.metrics_path)):
        if path is None:
            continue
        out = Path(path).resolve()
        for given in inputs:  # a run folder holding its data is fine: nothing deletes it
            if out == Path(given).resolve() or Path(given).resolve() in out.parents:
                raise ConfigError(str(output_clash(flag, path, [given])))


def _check_prepared_tokenizer(paths: list[Path], given: str | None) -> None:
    """The datasets of ``--data`` were prepared with one tokenizer, which loads from here and
    is still the one they record (not edited or replaced since); ``--tokenizer``, if
    ``given``, is that one too (it applies to the embedded corpus only)."""
    from mt_data import DataError, load_tokenizer, recorded_tokenizer, tokenizer_differs
    from mt_data.blend import check_one_tokenizer

    records = _prepared_with(paths)
    try:
        if records:
            check_one_tokenizer(records)
            recorded_tokenizer(records[0][1], f"dataset {records[0][0]}")
        mine = load_tokenizer(given).describe() if given is not None else None
    except DataError as err:
        raise ConfigError(str(err)) from None
    if mine is not None and (not records or tokenizer_differs(records[0][1], mine)):
        used = records[0][1].get("name") if records else "unknown"
        raise ConfigError(f"--tokenizer {given} applies to the embedded corpus only: a "
                          f"prepared dataset (--data) keeps the tokenizer it was prepared with "
                          f"({used}); leave out --tokenizer")


def _prepared_with(paths: list[Path]) -> list[tuple[str, dict]]:
    """(folder, the tokenizer its index.json records) of each readable dataset folder."""
    records = []
    for path in paths:
        try:
            record = json.loads((path / "index.json").read_text())["tokenizer"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a missing or damaged dataset is reported by the checks that follow
        if isinstance(record, dict):
            records.append((str(path), record))
    return records


def blend_text(data: DataArgs) -> str:
    """``--data`` as one line: the text of a blend file, or the flag itself."""
    assert data.data is not None
    path = Path(data.data)
    return " ".join((path.read_text(encoding="utf-8") if path.is_file() else data.data).split())


def _check_blend(data: DataArgs) -> None:
    """``--data`` is a dataset folder, a blend ("WEIGHT PATH" pairs, every weight positive)
    or a file holding one; anything else is one line saying what it is and what to do."""
    if data.data is None:
        return
    from mt_data.blend import parse_blend

    try:
        pairs = parse_blend(blend_text(data))
    except ValueError as err:
        if Path(data.data).is_file():
            raise ConfigError(
                f"--data {data.data} is a file but not a blend file (\"WEIGHT PATH\" pairs); "
                f"raw text is prepared first: `mt data prepare {data.data} -o DIR`, then "
                "--data DIR") from None
        raise ConfigError(f"--data {data.data!r}: {err}") from None
    zero = [path for weight, path in pairs if not weight > 0]
    if zero:
        raise ConfigError(f"--data: the blend weight of {zero[0]} is 0; every weight must be "
                          "positive (leave the dataset out instead)")


def dataset_paths(data: DataArgs) -> list[Path]:
    """The dataset folders ``--data`` names (none for the embedded corpus)."""
    if data.data is None:
        return []
    words = blend_text(data).split()
    return [Path(w) for w in words if len(words) == 1 or not _is_number(w)]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
