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
