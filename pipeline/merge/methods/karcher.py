"""The Karcher mean (mergekit's ``karcher``; the Riemannian centre of mass on the unit sphere):
each task vector's direction u_k = τ_k / ‖τ_k‖, the point m of the sphere minimising
Σ_k w_k d(m, u_k)², found by at most ``max_iter`` steps m ← exp_m(Σ_k w_k θ_k / sin θ_k (u_k − cos θ_k m)),
then scaled by Σ_k w_k ‖τ_k‖. Inputs shorter than ``tol`` take no part in the direction, and the
iteration stops when the step is shorter than ``tol``. Each tensor is one vector. Every step is
on K coefficients (m is a combination of the u_k, its angles come from their Gram matrix): the
tensor is read twice (once when it fits the block budget), however many steps.

mergekit averages its inputs with equal weights, the base model included when one is given; here
the weights are the merge's and, with a base, the task vectors are averaged (θ0 is added back), as
every method of this library does. Without a base and with equal weights the two are the same.
"""

from __future__ import annotations

import torch
from pydantic import Field

from pipeline.merge.inputs import TensorInputs
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, register
from pipeline.merge.span import combine, gram


class Params(MethodParams):
    max_iter: int = Field(10, ge=0)
    tol: float = Field(1e-5, gt=0.0)


def coefficients(g: torch.Tensor, w: torch.Tensor, max_iter: int, tol: float) -> torch.Tensor:
    """(K,) coefficients of the τ_k (fp64) from their Gram matrix ``g`` and weights ``w``."""
    norms = g.diagonal().clamp_min(0).sqrt()
    valid = norms > tol
    if not valid.any():
        return torch.zeros_like(w)
    to_units = torch.where(norms > 0, 1 / norms, torch.zeros_like(norms))
    units = to_units[:, None] * g * to_units[None, :]
    alphas = torch.where(valid, w, torch.zeros_like(w))
    alphas = alphas / alphas.sum()

    def length(c: torch.Tensor) -> torch.Tensor:
        return (c @ units @ c).clamp_min(0).sqrt()

    mean = alphas.clone()  # m = Σ_k mean_k u_k
    if length(mean) < tol:
        mean = torch.zeros_like(w)
        mean[int(valid.nonzero()[0])] = 1.0
    else:
        mean = mean / length(mean)
    for _ in range(max_iter):
        dots = (units @ mean).clamp(-1, 1)
        theta = torch.arccos(dots)
        moving = valid & (theta >= tol)
        factor = torch.where(moving, alphas * theta / torch.sin(theta), torch.zeros_like(theta))
        tangent = factor - (factor @ dots) * mean  # Σ_k factor_k (u_k − dot_k m)
        step = length(tangent)
        if step < tol:
            break
        mean = torch.cos(step) * mean + torch.sin(step) * tangent / step
        size = length(mean)
        if size > tol:
            mean = mean / size
    return mean * (w @ norms) * to_units


def merge(inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    if inputs.k == 1:
        return inputs.task(0)
    g = gram(inputs)[0]
    c = coefficients(g, weights.double().to(g.device), params.max_iter, params.tol)
    return combine(inputs, c.view(1, -1))


METHOD = register(MergeMethod("karcher", Params, merge=merge, needs_base=False))
