"""Multi-SLERP (Goddard 2025; mergekit's ``multislerp``): a weighted interpolation of K task
vectors on the sphere. Each τ_k is scaled to unit length; their weighted mean m, normalised,
is the point at which the units are projected onto the tangent space; the weighted mean T of
those projections is mapped back, m̂ cos‖T‖ + T sin‖T‖ / ‖T‖, and scaled by Σ_k w_k ‖τ_k‖.
Each tensor is one vector. Without a base the models themselves are interpolated. Everything
is a combination of the τ_k with coefficients from their inner products (``pipeline.merge.span``).
"""

from __future__ import annotations

import torch

from pipeline.merge.inputs import TensorInputs
from pipeline.merge.io import MergeInputError
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, register
from pipeline.merge.span import combine, gram


class Params(MethodParams):
    eps: float = 1e-8  # added to norms (mergekit's)


def coefficients(g: torch.Tensor, w: torch.Tensor, eps: float, name: str) -> torch.Tensor:
    """(K,) coefficients of the τ_k from their Gram matrix ``g`` and weights ``w`` (fp64)."""
    norms = g.diagonal().sqrt()
    to_units = 1 / (norms + eps)  # u_k = τ_k · to_units_k
    units = to_units[:, None] * g * to_units[None, :]  # the units' Gram matrix
    mean_norm = (w @ units @ w).clamp_min(0).sqrt()
    if not (norms > 0).any():  # a tensor no input changed (mergekit refuses it)
        return torch.zeros_like(w)
    if mean_norm < eps:
        if len(w) == 2:  # opposite units of equal weight: the linear interpolation
            return w
        raise MergeInputError(
            f"tensor {name}: the weighted mean of the inputs' directions is 0 (antipodal inputs "
            "whose weights balance): multislerp has no direction to interpolate around"
        )
    mean = w / mean_norm  # m̂ = Σ_k mean_k u_k
    dots = units @ mean
    tangent = w - (w @ dots) * mean  # T = Σ_k w_k (u_k − (u_k · m̂) m̂)
    length = (tangent @ units @ tangent).clamp_min(0).sqrt() + eps
    on_sphere = mean * torch.cos(length) + tangent * (torch.sin(length) / length)
    return on_sphere * (norms @ w) * to_units


def merge(inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    if inputs.k == 1:
        return inputs.task(0)
    g = gram(inputs)[0]
    return combine(inputs, coefficients(g, weights.double().to(g.device), params.eps, ctx.name).view(1, -1))


METHOD = register(MergeMethod("multislerp", Params, merge=merge, needs_base=False))
