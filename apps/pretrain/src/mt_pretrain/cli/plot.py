"""`mt plot`: draw the loss curve (and validation loss) of metrics JSONL files to a PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mt_pretrain.run.metrics import read_metrics

__all__ = ["plot_metrics"]


def plot_metrics(paths: Sequence[str | Path], output: str | Path, key: str = "loss",
                 x: str = "step", log_y: bool = False) -> Path:
    """Plot ``key`` against ``x`` for every metrics file (plus ``val_loss`` if present)."""
    try:
        import matplotlib  # pants: no-infer-dep (optional: mt-pretrain[plot])
    except ImportError:
        raise ValueError("mt plot needs matplotlib, which is not installed: "
                         "pip install 'mt-pretrain[plot]'") from None
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt  # pants: no-infer-dep

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    drawn = 0
    for path in paths:
        records = read_metrics(path)
        label = Path(path).parent.name or Path(path).stem
        points = [(r[x], r[key]) for r in records if r.get(key) is not None and x in r]
        if points:
            ax.plot(*zip(*points), label=f"{label} {key}", linewidth=1.2)
            drawn += 1
        if key == "loss":
            val = [(r[x], r["val_loss"]) for r in records if r.get("val_loss") is not None]
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
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output)
    plt.close(fig)
    return output
