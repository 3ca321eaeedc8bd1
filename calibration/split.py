"""Conflicts and the split plan (MERIT steps 3–4).

C = cosine similarities of the per-source gradients (optionally centred first). Each source gets
r scores on the principal axes of C: by default, as the paper does, PCA of the column-centred C
(each source's row of cosines an observation; its scores the top-r components), or the top-r
eigenvectors of the uncentred C. The sources are split recursively at the weighted median along
axis 1, then each half along axis 2, and so on: K = 2^r groups balanced by training examples
(the paper's text) or tokens (its project page). ``random`` is the Random-K control (random
scores, same procedure, so the balance is the same); ``given`` takes the groups from the config.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from calibration.errors import SplitError
from pipeline.checkpoint import write_json_atomic


def conflict_matrix(gradients: torch.Tensor, centre: bool = False) -> torch.Tensor:
    """Cosine similarities between the rows (sources) of an S × d gradient matrix."""
    g = gradients.double()
    if centre:
        g = g - g.mean(0, keepdim=True)
    norms = g.norm(dim=1, keepdim=True)
    zero = (norms == 0).flatten()
    if zero.any():
        raise SplitError(f"sources {zero.nonzero().flatten().tolist()} have a zero gradient: no direction to compare")
    unit = g / norms
    return (unit @ unit.T).clamp(-1, 1).float()


@dataclass
class SplitPlan:
    groups: list[list[str]]
    tokens: list[int]
    r: int | None
    explained_variance: list[float]
    method: str
    seed: int
    scores: dict[str, list[float]] = field(default_factory=dict)  # per source, one per axis
    pca: str | None = None  # centred | uncentred (method pca)
    balance: str = "tokens"  # what the median split balances: tokens | samples

    def save(self, path: str | Path) -> None:
        write_json_atomic(Path(path), asdict(self))

    def group_of(self) -> dict[str, int]:
        return {source: k for k, group in enumerate(self.groups) for source in group}


def principal_axes(conflicts: torch.Tensor, r: int, centred: bool = True) -> tuple[torch.Tensor, list[float]]:
    """Each source's scores on the top-r principal axes of C (S × r, sign fixed so each axis'
    largest entry is positive) and the share of variance (centred) or of C's spectrum each
    explains. Centred: PCA of C with its columns centred, the scores U_r S_r of its SVD (when all
    cosines are positive, the uncentred first axis ranks sources by how typical they are rather
    than by how they conflict). Uncentred: the top-r eigenvectors of C."""
    c = conflicts.double()
    if centred:
        u, s, _ = torch.linalg.svd(c - c.mean(0, keepdim=True))
        scores, spread = u * s, s**2
    else:
        values, vectors = torch.linalg.eigh(c)
        order = values.argsort(descending=True)
        scores, spread = vectors[:, order], values[order].clamp_min(0)
    scores = scores * torch.sign(scores.gather(0, scores.abs().argmax(0, keepdim=True)))
    return scores[:, :r].float(), (spread[:r] / spread.sum()).tolist()


def median_split(sources: list[str], scores: torch.Tensor, weights: dict[str, int]) -> list[list[str]]:
    """Split recursively along each score axis at the weighted median (tokens or samples of each
    source): 2^axes groups."""
    groups = [list(range(len(sources)))]
    for axis in range(scores.shape[1]):
        halves = []
        for group in groups:
            if len(group) < 2:
                raise SplitError(
                    f"group {[sources[i] for i in group]} cannot be split along axis {axis + 1}: "
                    f"2^r groups need more sources (or fewer, more balanced ones per group)"
                )
            ranked = sorted(group, key=lambda i: (float(scores[i, axis]), sources[i]))
            cumulative = torch.tensor([weights[sources[i]] for i in ranked], dtype=torch.float64).cumsum(0)
            # The cut closest to half the group's weight, keeping both sides non-empty.
            cut = 1 + int((cumulative[:-1] - cumulative[-1] / 2).abs().argmin())
            halves += [ranked[:cut], ranked[cut:]]
        groups = halves
    return [[sources[i] for i in group] for group in groups]


def plan_split(
    sources: list[str],
    token_counts: dict[str, int],
    r: int | None = None,
    method: str = "pca",
    conflicts: torch.Tensor | None = None,
    seed: int = 0,
    groups: list[list[str]] | None = None,
    pca: str = "centred",
    sample_counts: dict[str, int] | None = None,
) -> SplitPlan:
    """The split of ``sources`` into groups; balanced by ``sample_counts`` when given, else by tokens."""
    missing = sorted(set(sources) - set(token_counts) | (set(sources) - set(sample_counts or token_counts)))
    if missing:
        raise SplitError(f"no token or sample counts for sources {missing}")
    if method == "given":
        return _given(sources, token_counts, groups or [], seed)
    if r is None or r < 1:
        raise SplitError(f"r must be a positive integer, got {r}")
    if 2**r > len(sources):
        raise SplitError(f"r = {r} asks for 2^r = {2**r} groups but there are only {len(sources)} sources")
    if method == "pca":
        if conflicts is None:
            raise SplitError("the pca split needs the conflict matrix")
        if pca not in ("centred", "uncentred"):
            raise SplitError(f"unknown pca '{pca}' (centred, uncentred)")
        scores, explained = principal_axes(conflicts, r, pca == "centred")
    elif method == "random":
        g = torch.Generator().manual_seed(seed)
        scores, explained = torch.rand(len(sources), r, generator=g), []
    else:
        raise SplitError(f"unknown split method '{method}' (pca, random, given)")
    split = median_split(sources, scores, sample_counts or token_counts)
    return SplitPlan(
        split,
        [sum(token_counts[s] for s in g) for g in split],
        r,
        explained,
        method,
        seed,
        {s: scores[i].tolist() for i, s in enumerate(sources)},
        pca if method == "pca" else None,
        "samples" if sample_counts else "tokens",
    )


def _given(sources: list[str], token_counts: dict[str, int], groups: list[list[str]], seed: int) -> SplitPlan:
    listed = [s for g in groups for s in g]
    unknown = sorted(set(listed) - set(sources))
    missing = sorted(set(sources) - set(listed))
    twice = sorted({s for s in listed if listed.count(s) > 1})
    if unknown or missing or twice or any(not g for g in groups):
        raise SplitError(
            f"given groups must cover every source once, in non-empty groups: unknown {unknown}, "
            f"missing {missing}, repeated {twice}"
        )
    r = int(math.log2(len(groups))) if len(groups) & (len(groups) - 1) == 0 else None
    return SplitPlan([list(g) for g in groups], [sum(token_counts[s] for s in g) for g in groups], r, [], "given", seed)
