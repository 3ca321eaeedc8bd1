"""Weighted average: θ = Σ_k w_k θ_k (MERIT's merge with w_k = tokens_k / Σ tokens)."""

from __future__ import annotations

import torch

from pipeline.merge.registry import MergeMethod, MethodParams, register


class Params(MethodParams):
    pass


def coefficients(weights: torch.Tensor, params: Params) -> tuple[float, torch.Tensor]:
    return 0.0, weights


METHOD = register(
    MergeMethod(
        "weighted_average",
        Params,
        coefficients=coefficients,
        needs_base=False,
        aliases=("linear", "token_weighted"),
    )
)
