"""`mt plot`: draw the loss curve (and validation loss) of metrics JSONL files to a PNG."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_metrics"]


def plot_metrics(paths: Sequence[str | Path], output: str | Path, key: str = "loss",
                 x: str = "step", log_y: bool = False, overwrite: bool = False) -> Path:
    """Plot ``key`` against ``x`` for every metrics file (plus ``val_loss`` if present).

    ``output`` is checked first (:func:`check_output`; an existing file is replaced only with
    ``overwrite``): a ValueError in one line, before any metrics file is read or anything
    drawn."""
    output = Path(output)
    check_output(output, paths, overwrite)
    try:
        import matplotlib  # pants: no-infer-dep (optional: mt-pretrain[plot])
    except ImportError:
        raise ValueError("mt plot needs matplotlib, which is not installed: "
                         "pip install 'mt-pretrain[plot]'") from None
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt  # pants: no-infer-dep
    from matplotlib.backend_bases import FigureCanvasBase  # pants: no-infer-dep

    formats = FigureCanvasBase.get_supported_filetypes()
    if output.suffix and output.suffix[1:].lower() not in formats:
        raise ValueError(f"--output {output}: {output.suffix!r} is not a format mt plot "
                         f"writes; end the name in one of {', '.join(sorted(formats))}")

    from mt_inference.figures import save_figure

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    drawn = 0
    for path in paths:
        label = Path(path).parent.name or Path(path).stem
        points = _points(Path(path), key, x, log_y)
        if points:
            ax.plot(*zip(*points), label=f"{label} {key}", linewidth=1.2)
            drawn += 1
        if key == "loss":
            val = _points(Path(path), "val_loss", x, log_y)
            if val:
                ax.plot(*zip(*val), "o--", label=f"{label} val_loss", markersize=4)
    if not drawn:
        plt.close(fig)
        raise ValueError(f"no {key!r} values against {x!r} in {list(map(str, paths))}")
    ax.set_xlabel(x)
    ax.set_ylabel(key)
    if log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        save_figure(fig, output)
    except OSError as err:  # e.g. a full disk, or the folder changed since it was checked
        raise ValueError(f"--output {output}: writing failed: {err.strerror or err}") from None
    finally:
        plt.close(fig)
    return output


def check_output(output: Path, inputs: Sequence[str | Path], overwrite: bool = False) -> None:
    """A ValueError (one line) when ``output`` cannot be written as an image: it is one of
    the metrics files (``output_clash``), a folder, lies under a file, in a folder that does
    not exist (none is created) or one where this process cannot create a file
    (``unwritable``), or is a file already there and ``overwrite`` is off
    (``existing_file``)."""
    from mt_data.paths import existing_file, output_clash, unwritable

    clash = output_clash("--output", output, inputs)
    if clash:
        raise ValueError(clash)
    if output.is_dir():
        raise ValueError(f"--output {output} is a folder; name the image file to write")
    if why := unwritable("--output", output):
        raise ValueError(why)
    if not output.parent.is_dir():
        raise ValueError(f"--output {output}: the folder {output.parent} does not exist; "
                         "create it first or name a file in an existing folder")
    if why := existing_file("--output", output, overwrite):
        raise ValueError(why)


def _number(value: Any) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond any float
        return False


def _points(path: Path, key: str, x: str, log_y: bool) -> list[tuple[float, float]]:
    """(x, key) of every line of a metrics file that has both; a value that is not a number,
    or not positive under --log-y, is a ValueError naming the file and line (mt writes a
    non-finite value as null: such lines are left out, as the run's metrics say)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a metrics file (not UTF-8 text: byte "
                         f"{err.object[err.start]:#04x} at offset {err.start})") from None
    points = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not a JSON line ({err.msg})") from None
        except RecursionError:
            raise ValueError(f"{path}:{number}: not a metrics line (JSON nested too deeply "
                             "to read)") from None
        if not isinstance(record, dict) or record.get(key) is None or record.get(x) is None:
            continue
        for name in (x, key):
            if not _number(record[name]):
                raise ValueError(f"{path}:{number}: {name} is {repr(record[name])[:40]}, not "
                                 "a number")
        if log_y and record[key] <= 0:
            raise ValueError(f"{path}:{number}: {key} {record[key]} cannot be drawn on --log-y "
                             "(not positive)")
        points.append((record[x], record[key]))
    return points
