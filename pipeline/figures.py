"""Saving a matplotlib figure whole or not at all (a report or an artifact may read it while a
stage rewrites it)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: plots are files
import matplotlib.pyplot as plt

from pipeline.checkpoint import replacing


def save_figure(fig: plt.Figure, path: str | Path, dpi: int = 120) -> Path:
    """Lay out, write as PNG under a temporary name, rename into place, close."""
    path = Path(path)
    with replacing(path) as tmp:
        fig.tight_layout()
        fig.savefig(tmp, dpi=dpi, format="png")
    plt.close(fig)
    return path


MAX_INCHES = 22.0  # a heatmap's side: past ~60 sources the labels shrink instead of the figure growing


def labelled_axis(count: int, per_label: float = 0.32, least: float = 5.0) -> tuple[float, float]:
    """Inches for an axis of ``count`` labelled cells, and the label font size that fits them
    (7 pt while each cell has room, down to 3 pt at 176 sources on the largest figure)."""
    inches = min(MAX_INCHES, max(least, per_label * count + 2))
    room = 72 * (inches - 2) / max(count, 1)  # points per label
    return inches, max(3.0, min(7.0, 0.8 * room))
