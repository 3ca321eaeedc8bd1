"""Model Breadcrumbs (Davari and Belilovsky, ECCV 2024; mergekit's ``breadcrumbs`` and
``breadcrumbs_ties``): each τ_k keeps a band of its entries by magnitude, dropping the smallest
and the largest outliers, then the survivors are combined linearly (``breadcrumbs``) or by TIES's
sign consensus (``breadcrumbs_ties``, a disjoint sum unless ``normalize``). As mergekit counts it,
of n entries ⌊density · n⌋ are kept, below the ⌊gamma · n⌋ largest where there is room (fewer
outliers are dropped when density + gamma > 1); density 1 keeps every entry. The band's bounds
are exact k-th largest |τ_k| (``pipeline.merge.selection``): two selections per tensor.
mergekit's ``rescale`` (to each τ_k's L1 norm) is not offered.
"""

from __future__ import annotations

import torch
from pydantic import Field

from pipeline.merge.inputs import TensorInputs
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, register, scale_field
from pipeline.merge.selection import kth_largest_abs
from pipeline.merge.sparse import Sparsified, Sparsifier, combine


class Params(MethodParams):
    density: float = Field(1.0, gt=0.0, le=1.0)  # share of entries kept
    gamma: float = Field(0.01, ge=0.0, lt=1.0)  # share of the largest entries dropped as outliers
    scale: float = scale_field()  # λ


class TiesParams(Params):
    normalize: bool = False  # the agreeing survivors' mean (mergekit's default: their sum)


def band(inputs: TensorInputs, density: float, gamma: float) -> Sparsifier:
    """Each task vector's entries outside its magnitude band zeroed."""
    n = inputs.numel
    kept, outliers = int(density * n), int(gamma * n)
    above = n - max(0, n - kept - outliers) - kept  # the largest entries dropped
    if kept == 0:
        return lambda block, i: block.zero_()
    whole = len(inputs.blocks) == 1
    blocks = inputs.block(0) if whole else lambda: (inputs.block(i) for i in inputs.blocks)
    low = kth_largest_abs(blocks, above + kept, n).view(-1, 1)
    high = kth_largest_abs(blocks, above, n).view(-1, 1) if above else None

    def mask(block: torch.Tensor, i: int) -> None:
        magnitude = block.abs()
        inside = magnitude >= low
        if high is not None:
            inside &= magnitude < high
        block.mul_(inside)

    return mask


def merge(inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    consensus = isinstance(params, TiesParams)
    blocks = Sparsified(inputs, band(inputs, params.density, params.gamma)) if params.density < 1 else inputs.block
    return combine(inputs, blocks, weights, params.scale, consensus, normalize=consensus and params.normalize)


METHOD = register(MergeMethod("breadcrumbs", Params, merge=merge))
TIES = register(MergeMethod("breadcrumbs_ties", TiesParams, merge=merge))
