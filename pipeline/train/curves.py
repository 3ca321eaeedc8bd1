"""Loss curves from ``metrics.jsonl`` as PNGs."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt

from pipeline.figures import save_figure


def plot_loss(metrics: Path, out: Path, title: str) -> Path:
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return save_figure(fig, out)
