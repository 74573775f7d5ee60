"""The curves of a run, drawn from its own ``metrics.csv``: training loss by step, validation loss and
accuracy by epoch, and the learning rate.

    python docs/figures/curves.py RUN_DIR/metrics.csv OUT.png

``make figures`` trains the digits example into ``runs/figures`` and draws ``docs/figures/digits-curves.png``
(the picture in the README) with this. Needs matplotlib (``pip install matplotlib``; the dev extras have it).
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend


def read_series(path: str) -> dict[str, list[tuple[int, float]]]:
    """``{column: [(step, value), ...]}`` for every numeric column of a metrics.csv (a row per step or per
    call, its empty cells skipped)."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    with open(path, newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            step = int(float(row["step"]))
            for name, value in row.items():
                if name not in ("step", "epoch") and value not in ("", None):
                    series[name].append((step, float(value)))
    return dict(series)


def draw(series: dict[str, list[tuple[int, float]]], out: str, title: str) -> None:
    lr = next((name for name in series if name.startswith("lr-")), None)
    panels = [("loss", [n for n in ("train/loss", "val/loss") if n in series]),
              ("accuracy", [n for n in series if n.endswith("/acc")])]
    if lr is not None:
        panels.append(("learning rate", [lr]))
    panels = [(label, names) for label, names in panels if names]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), dpi=110)
    for ax, (label, names) in zip(axes if len(panels) > 1 else [axes], panels):
        for name in names:
            steps, values = zip(*series[name])
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=name)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics_csv")
    parser.add_argument("out_png")
    parser.add_argument("--title", default="digits example: curves from its metrics.csv")
    args = parser.parse_args()
    draw(read_series(args.metrics_csv), args.out_png, args.title)
    print(f"wrote {args.out_png}")


if __name__ == "__main__":
    main()
