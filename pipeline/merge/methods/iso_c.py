"""Iso-C (Marczak et al., ICML 2025): M = Σ_k w_k τ_k, Iso(M) = mean(S) · U Vᵀ, θ = θ0 + α Iso(M).

Every singular direction of the merged update gets the same weight, so directions shared by
few tasks are not drowned by the dominant ones. The same function is IsoLoCo's aggregator on
mean pseudo-gradients. Non-2-D tensors fall back to the weighted average. ``orthogonaliser``:
``svd`` (exact) or ``newton_schulz`` (fast; see :mod:`pipeline.merge.linalg` for the schedule
and the two scale estimates).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from pipeline.merge.inputs import TensorInputs
from pipeline.merge.linalg import DEFAULT_SCHEDULE, iso
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, register


class Params(MethodParams):
    scale: float = 1.0  # α
    orthogonaliser: Literal["svd", "newton_schulz"] = "svd"
    ns_scale: Literal["inner", "rms"] = "inner"
    ns_schedule: list[tuple[float, float, float]] = Field(default_factory=lambda: list(DEFAULT_SCHEDULE))


def merge(inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    mean = inputs.mean(weights)  # streamed: one input at a time, whatever K
    if mean.dim() != 2:
        return mean
    return params.scale * iso(mean, params.orthogonaliser, params.ns_scale, params.ns_schedule)


METHOD = register(MergeMethod("iso_c", Params, merge=merge, aliases=("isoc",)))
