"""Task arithmetic (Ilharco et al. 2023): θ = θ0 + λ Σ_k w_k τ_k = (1 − λ) θ0 + λ Σ_k w_k θ_k.

λ = 1 is the weighted average; with equal weights λ = K·λ' gives the paper's θ0 + λ' Σ τ_k.
"""

from __future__ import annotations

import torch

from pipeline.merge.registry import MergeMethod, MethodParams, register, scale_field


class Params(MethodParams):
    scale: float = scale_field()  # λ


def coefficients(weights: torch.Tensor, params: Params) -> tuple[float, torch.Tensor]:
    return 1.0 - params.scale, params.scale * weights


METHOD = register(MergeMethod("task_arithmetic", Params, coefficients=coefficients))
