"""SCE (Wan et al. 2024, FuseChat; mergekit's ``sce``): Select the entries where the task vectors
vary most across models (the top ``select_topk`` share of the non-zero variances, the same
entries for every model), Calculate each model's weight as its selected τ_k's mean square over
the tensor (normalised to sum to 1; equal when they all vanish), Erase the entries whose sign
disagrees with that of Σ_k τ_k, and take the weighted mean of the rest:
θ = θ0 + Σ_k c_k τ_k [agrees] / max(Σ_k c_k [agrees], 1e-6).

SCE sets its own weights, so the merge's weights are not used (as in mergekit). Where Σ_k τ_k is
exactly 0 the entry stays at θ0 (mergekit keeps its positive entries there), so SCE stays odd.
Passes over a tensor: the variance's selection (two when the tensor is read in blocks), the mean
squares, the merge; a tensor that fits the block budget is read once.
"""

from __future__ import annotations

import torch
from pydantic import Field

from pipeline.merge.inputs import TensorInputs
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, register
from pipeline.merge.selection import kth_largest_abs

MIN_WEIGHTS = 1e-6  # floor of the agreeing weights' sum, and of the mean squares' sum (mergekit's)


class Params(MethodParams):
    select_topk: float = Field(1.0, ge=0.0, le=1.0)  # share of the non-zero variances selected


def selection(inputs: TensorInputs, share: float):
    """The selector of block i's entries (None: all of them)."""
    if share >= 1:
        return None

    def variance(i: int) -> torch.Tensor:
        return inputs.block(i).var(0, unbiased=False).view(1, -1)

    nonzero = sum(int(variance(i).count_nonzero()) for i in inputs.blocks)
    k = int(nonzero * share)
    if k == 0:
        return lambda i: torch.zeros(inputs.span(i).stop - inputs.span(i).start, device=inputs.device)
    whole = len(inputs.blocks) == 1
    threshold = kth_largest_abs(variance(0) if whole else lambda: (variance(i) for i in inputs.blocks), k, inputs.numel)
    return lambda i: (variance(i)[0] >= threshold).float()


def merge(inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    selected = selection(inputs, params.select_topk)

    def block(i: int) -> torch.Tensor:
        taus = inputs.block(i)
        return taus if selected is None else taus * selected(i)

    squares = sum(block(i).square().sum(1, dtype=torch.float64) for i in inputs.blocks) / inputs.numel
    total = float(squares.sum())
    c = squares / total if abs(total) >= MIN_WEIGHTS else torch.full_like(squares, 1 / inputs.k)
    c = c.float().view(-1, 1)

    def merged(taus: torch.Tensor, i: int) -> torch.Tensor:
        taus = taus if selected is None else taus * selected(i)
        agree = taus.sign() == taus.sum(0).sign()
        agree &= taus != 0
        return (taus * c * agree).sum(0) / (c * agree).sum(0).clamp_min(MIN_WEIGHTS)

    return inputs.elementwise(merged)


METHOD = register(MergeMethod("sce", Params, merge=merge))
