"""Calibration plots, saved as PNGs in the run directory."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import torch

from calibration.split import SplitPlan, principal_axes
from pipeline.figures import labelled_axis, save_figure

ANNOTATED_POINTS = 40  # sources named beside their points; past that the names would cover the plot


def plot_conflicts(conflicts: torch.Tensor, sources: list[str], plan: SplitPlan, path: Path) -> Path:
    """Heatmap of the cosine conflict matrix, sources ordered by group and, within a group, by
    hierarchical clustering (so that blocks of agreeing sources show), group borders drawn."""
    order = [i for group in plan.groups for i in clustered([sources.index(s) for s in group], conflicts)]
    ordered = conflicts[order][:, order].numpy()
    size, font = labelled_axis(len(sources))
    fig, ax = plt.subplots(figsize=(size + 1.5, size))
    image = ax.imshow(ordered, cmap="coolwarm", vmin=-1, vmax=1)
    labels = [sources[i] for i in order]
    ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=font)
    ax.set_yticks(range(len(labels)), labels, fontsize=font)
    edge = -0.5
    for group in plan.groups[:-1]:
        edge += len(group)
        ax.axhline(edge, color="black", lw=1.2)
        ax.axvline(edge, color="black", lw=1.2)
    fig.colorbar(image, ax=ax, label="cosine of mean gradients")
    ax.set_title(f"Gradient conflicts at θ0, {len(plan.groups)} groups ({plan.method})")
    return save_figure(fig, path)


def clustered(members: list[int], conflicts: torch.Tensor) -> list[int]:
    """``members`` (indices into the conflict matrix) in the leaf order of an average-linkage
    clustering on 1 − cosine."""
    if len(members) < 3:
        return members
    from scipy.cluster.hierarchy import leaves_list, linkage
    from scipy.spatial.distance import squareform

    distance = (1 - conflicts[members][:, members]).clamp(min=0).double()
    distance = (distance + distance.T) / 2
    distance.fill_diagonal_(0)
    leaves = leaves_list(linkage(squareform(distance.numpy(), checks=False), method="average"))
    return [members[i] for i in leaves]


def plot_axes(conflicts: torch.Tensor, sources: list[str], plan: SplitPlan, path: Path) -> Path:
    """Sources on the first two principal axes of the conflict matrix, coloured by group."""
    scores, explained = principal_axes(conflicts, min(2, len(sources)), plan.pca != "uncentred")
    if scores.shape[1] == 1:
        scores = torch.cat([scores, torch.zeros_like(scores)], 1)
        explained.append(0.0)
    group = plan.group_of()
    fig, ax = plt.subplots(figsize=(7, 6))
    colours = plt.get_cmap("tab10")
    for k in range(len(plan.groups)):
        idx = [i for i, s in enumerate(sources) if group[s] == k]
        ax.scatter(scores[idx, 0], scores[idx, 1], color=colours(k % 10), label=f"group {k}", s=40)
    for i, s in enumerate(sources if len(sources) <= ANNOTATED_POINTS else []):
        ax.annotate(
            s, (float(scores[i, 0]), float(scores[i, 1])), fontsize=7, xytext=(3, 3), textcoords="offset points"
        )
    ax.set_xlabel(f"axis 1 ({100 * explained[0]:.1f} %)")
    ax.set_ylabel(f"axis 2 ({100 * explained[1]:.1f} %)")
    ax.axhline(0, color="grey", lw=0.5)
    ax.axvline(0, color="grey", lw=0.5)
    ax.legend(fontsize=8)
    ax.set_title("Sources on the principal axes of the conflict matrix")
    return save_figure(fig, path)


def plot_explained_variance(conflicts: torch.Tensor, plan: SplitPlan, path: Path) -> Path:
    """The share of each principal axis of the conflict matrix, as the split computed them."""
    r = plan.r
    share = principal_axes(conflicts, len(conflicts), plan.pca != "uncentred")[1][:12]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar(range(1, len(share) + 1), [100 * v for v in share], color="tab:blue")
    for bar in bars[: r or 0]:
        bar.set_color("tab:orange")
    ax.set_xlabel("principal axis of the conflict matrix")
    ax.set_ylabel("explained variance (%)")
    ax.set_title(f"Explained variance (orange: the r = {r} axes split on)" if r else "Explained variance")
    return save_figure(fig, path)


def plot_accuracy_curve(curve: dict[int, float], reference_n: int, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ns = sorted(curve)
    ax.plot(ns, [curve[n] for n in ns], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("calibration examples per source (n)")
    ax.set_ylabel(f"mean cosine to the n={reference_n} gradient")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title("Accuracy of the n-sample mean gradient")
    return save_figure(fig, path)
