"""`runs/<name>/reward.png`: accuracy, reward, response length and engine–trainer KL over the steps.

Rewritten after every step from the metrics rows (matplotlib's Agg backend: no display needed), through a
temporary file and a rename, so the file is always a complete image. A plot of the run without W&B.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

PANELS = (  # (metric key, title, y-axis scale)
    ("reward/accuracy", "accuracy", "linear"),
    ("reward/mean", "reward (mean)", "linear"),
    ("response/length_mean", "response length (tokens)", "linear"),
    ("mismatch/k3_kl", "engine–trainer KL (k3, steps with an update)", "log"),
)


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, skipping rows without it or with a non-finite value."""
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            steps.append(int(row["step"]))
            values.append(float(value))
    return steps, values


def write_reward_plot(rows: list[dict], path: Path, title: str = "") -> Path:
    """Draw the four panels for `rows` (dicts with `step` and metric keys) into `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(10, 6.5), layout="constrained")
    axes = figure.subplots(2, 2, sharex=True)
    for ax, (key, label, scale) in zip(axes.flat, PANELS):
        steps, values = series(rows, key)
        ax.plot(steps, values, marker="o", markersize=3, linewidth=1.5)
        ax.set_title(label, fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if not values:
            ax.text(0.5, 0.5, "no values yet", ha="center", va="center", transform=ax.transAxes, color="gray")
        elif scale == "log" and min(values) > 0:
            ax.set_yscale("log")
        if key == "reward/accuracy":
            ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    if title:
        figure.suptitle(title, fontsize=11)
    tmp = path.with_name(path.name + ".tmp.png")
    figure.savefig(tmp, dpi=90)
    os.replace(tmp, path)
    return path


def sparkline(values: list[float]) -> str:
    """A one-line terminal chart (▁▂▃▄▅▆▇█) of at most 40 points (evenly picked from longer series)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return ""
    if len(finite) > 40:
        finite = [finite[round(i * (len(finite) - 1) / 39)] for i in range(40)]
    low, high = min(finite), max(finite)
    bars = "▁▂▃▄▅▆▇█"
    if high == low:
        return bars[0] * len(finite)
    return "".join(bars[round((v - low) / (high - low) * (len(bars) - 1))] for v in finite)
