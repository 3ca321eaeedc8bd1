"""DARE (Yu et al. 2023): drop each entry of each τ_k with probability p, rescale the survivors
by 1 / (1 − p), then combine: ``linear`` (θ0 + λ Σ w_k τ̃_k) or ``ties`` (TIES on the τ̃_k).

The masks are drawn from a generator seeded by (seed, tensor name): the same spec gives the
same merge whatever the tensor order (on one device type; CPU and CUDA streams differ).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from pipeline.merge.methods import ties
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, register, weighted_mean


class Params(MethodParams):
    drop: float = Field(0.9, ge=0.0, lt=1.0)  # p
    combine: Literal["linear", "ties"] = "linear"
    density: float = Field(1.0, gt=0.0, le=1.0)  # TIES trim after the drop (1.0: keep all survivors)
    scale: float = 1.0  # λ


def drop_and_rescale(task_vectors: torch.Tensor, p: float, generator: torch.Generator) -> torch.Tensor:
    if p == 0.0:
        return task_vectors
    keep = torch.rand(task_vectors.shape, generator=generator, device=task_vectors.device) >= p
    return task_vectors.mul_(keep).div_(1.0 - p)


def merge(task_vectors: torch.Tensor, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    dropped = drop_and_rescale(task_vectors, params.drop, ctx.generator(task_vectors.device))
    if params.combine == "ties":
        return ties.merge(dropped, weights, ctx, ties.Params(density=params.density, scale=params.scale))
    return params.scale * weighted_mean(dropped, weights)


METHOD = register(MergeMethod("dare", Params, merge=merge, aliases=("dare_linear",)))
