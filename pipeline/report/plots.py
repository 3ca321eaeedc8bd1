"""The report's plots, as PNGs: benchmark average and held-out loss per model, per-source change
against θ0, training curves, merges on MERIT's split against the controls'."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from pipeline.config import EVALUATED_ROLES
from pipeline.figures import labelled_axis, save_figure

KIND_COLOURS = {
    "theta0": "tab:grey",
    "branch": "tab:blue",
    "joint": "tab:green",
    "merged": "tab:orange",
    "diloco": "tab:red",
    "other": "tab:purple",
    "baseline": "tab:brown",  # the constant-answer baseline of the benchmarks
}
ANNOTATE_CELLS = 200  # above this many heatmap cells the numbers would be unreadable


def plot_model_bars(
    names: list[str], kinds: list[str], values: list[float], path: Path, label: str, title: str
) -> Path:
    """One bar per model in the given order, coloured by kind; merged models hatched and outlined."""
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(names) + 2), 4))
    bars = ax.bar(range(len(names)), values, color=[KIND_COLOURS[k] for k in kinds])
    for bar, kind in zip(bars, kinds):
        if kind == "merged":
            bar.set(edgecolor="black", linewidth=1.5, hatch="//")
    ax.bar_label(bars, fmt="%.3f" if max(values, default=0) < 10 else "%.1f", fontsize=7)
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    # Models of one run differ by a few percent: an axis from 0 would hide the differences.
    low, high = min(values), max(values)
    ax.set_ylim(0.9 * low if low > 0 else low, 1.05 * high if high > 0 else 1.0)
    ax.set_ylabel(label)
    ax.legend(handles=[Patch(color=KIND_COLOURS[k], label=k) for k in dict.fromkeys(kinds)], fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title)
    return save_figure(fig, path)


def plot_per_source(models: list[str], sources: list[str], delta: np.ndarray, path: Path) -> Path:
    """Heatmap models × sources of held-out loss minus θ0's, centred at 0 (blue: better than θ0)."""
    finite = np.abs(delta[np.isfinite(delta)])
    limit = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    width, font = labelled_axis(len(sources), per_label=0.4, least=6.0)
    fig, ax = plt.subplots(figsize=(width + 1, max(3.0, 0.4 * len(models) + 2)))
    image = ax.imshow(delta, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    ax.set_xticks(range(len(sources)), sources, rotation=90, fontsize=font)
    ax.set_yticks(range(len(models)), models, fontsize=8)
    if delta.size <= ANNOTATE_CELLS:
        for (i, j), value in np.ndenumerate(delta):
            if np.isfinite(value):
                colour = "white" if abs(value) > 0.6 * limit else "black"  # readable on the dark ends
                ax.text(j, i, f"{value:+.2f}", ha="center", va="center", fontsize=7, color=colour)
    fig.colorbar(image, ax=ax, label="held-out loss − θ0's")
    ax.set_title("Per-source held-out loss against θ0")
    return save_figure(fig, path)


def plot_training_curves(curves: dict[str, tuple[list[int], list[float]]], path: Path) -> Path:
    """Training loss per optimizer step of the warm-up, every branch and the joint baseline."""
    styles = {"warmup": {"color": "grey", "ls": ":"}, "joint": {"color": "black", "ls": "--"}}
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (steps, losses) in curves.items():
        ax.plot(steps, losses, lw=1.2, label=name, **styles.get(name, {}))
    ax.set_xlabel("optimizer step (branches and joint from the end of the warm-up)")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=7, ncol=max(1, len(curves) // 8))
    ax.grid(alpha=0.3)
    ax.set_title("Training loss")
    return save_figure(fig, path)


def plot_quality(rows: list[dict], path: Path) -> str:
    """Per merge, MERIT's split beside each control's: benchmark average (when given), held-out
    loss, then accuracy per role;
    θ0 and the joint baseline as reference lines. Returns the file name, as the report links it."""
    merges = list(dict.fromkeys(r["merge"] for r in rows if "merge" in r))
    splits = list(dict.fromkeys(r["split"] for r in rows if "merge" in r))
    refs = {r["model"]: r for r in rows if "merge" not in r}
    accuracies = [f"accuracy_{role}" for role in EVALUATED_ROLES]
    metrics = ["benchmark", "loss", *accuracies]  # the benchmark average where the rows have it
    metrics = [k for k in metrics if k == "loss" or any(r.get(k) is not None for r in rows)]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.8), squeeze=False)
    width = 0.8 / len(splits)
    for ax, metric in zip(axes[0], metrics):
        for i, split in enumerate(splits):
            got = {r["merge"]: r.get(metric) for r in rows if r.get("split") == split and "merge" in r}
            values = [got.get(m) if got.get(m) is not None else np.nan for m in merges]
            ax.bar(np.arange(len(merges)) + (i - (len(splits) - 1) / 2) * width, values, width, label=split)
        for (name, ref), style in zip(refs.items(), (":", "--")):
            if ref.get(metric) is not None:
                ax.axhline(ref[metric], color="black", ls=style, lw=1, label=name)
        ax.set_xticks(range(len(merges)), merges, rotation=30, ha="right", fontsize=8)
        ax.set_title(metric.replace("_", ", ") + (" (lower is better)" if metric == "loss" else ""), fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    return save_figure(fig, path).name


def plot_diloco(runs: dict[str, list[dict]], path: Path) -> Path:
    """Per DiLoCo variant (labelled with its sync mode): held-out loss of the global model against
    rounds, against the wall time since the first round began and against the bytes the workers
    sent, the workers' mean pairwise cosine (drift), and where a round's time went."""
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    for variant, records in runs.items():
        evaluated = [r for r in records if r.get("heldout_loss") is not None]
        losses = [r["heldout_loss"] for r in evaluated]
        sent = np.cumsum([r["bytes"]["sent"] for r in records])
        wall = np.cumsum([r["seconds"]["wall"] for r in records])
        axes[0, 0].plot([outer_round(r) for r in evaluated], losses, marker="o", ms=3, label=variant)
        axes[0, 1].plot([wall[r["round"]] for r in evaluated], losses, marker="o", ms=3, label=variant)
        axes[0, 2].plot([sent[r["round"]] for r in evaluated], losses, marker="o", ms=3, label=variant)
        drift = [r for r in records if r["mean_cosine"] is not None]
        axes[1, 0].plot([outer_round(r) for r in drift], [r["mean_cosine"] for r in drift], label=variant)
    variants = list(runs)
    shares = [round_time_shares(runs[v]) for v in variants]
    for part in shares[0]:
        axes[1, 1].bar(variants, [x[part] for x in shares], bottom=_stacked(axes[1, 1], len(variants)), label=part)
    axes[1, 2].axis("off")
    titles = [
        ("round (async: R arrivals)", "held-out loss", "Held-out loss of the global model"),
        ("wall seconds (cumulative, from the first round)", "held-out loss", "Loss against wall time"),
        ("bytes sent by the workers (cumulative)", "held-out loss", "Loss against communication"),
        ("round", "mean pairwise cosine of Δ_k", "Worker drift"),
        ("", "% of the rounds' wall time", "Where a round's time goes (rounds after the first)"),
    ]
    for ax, (x, y, title) in zip(axes.flat, titles):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0, 2].set_xscale("log")
    return save_figure(fig, path)


def outer_round(record: dict) -> float:
    """Where a record lies in rounds: a synchronous round's number, an async arrival's R-th."""
    return record.get("outer_round", record["round"] + 1)


def _stacked(ax: plt.Axes, n: int) -> np.ndarray:
    """The tops of the bars already on ``ax``: where the next stack segment starts."""
    tops = np.zeros(n)
    for container in ax.containers:
        tops += np.array([bar.get_height() for bar in container])
    return tops


def round_time_shares(records: list[dict]) -> dict[str, float]:
    """% of the rounds' wall time in each part of a round, over the rounds after the first (whose
    wall time includes starting the workers). Async records are arrivals of R workers training
    side by side (R is the momentum ``window``): % of the R machines' time."""
    s = [r["seconds"] for r in records[1:] or records]
    total = sum(x["wall"] for x in s) * records[-1].get("window", 1) or 1.0
    parts = {
        "inner steps": sum(x["inner"] for x in s),
        "worker IO": sum(x["worker_io"] for x in s),
        "merge": sum(x["merge"] for x in s),
        "drift": sum(x.get("drift", 0.0) for x in s),
        "outer step": sum(x["outer"] for x in s),
        "aggregator IO": sum(x["aggregate"] - x["merge"] - x.get("drift", 0.0) - x["outer"] for x in s),
    }
    parts["other (waits)"] = max(total - sum(parts.values()), 0.0)
    return {k: 100 * v / total for k, v in parts.items()}
