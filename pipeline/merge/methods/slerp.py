"""SLERP (Shoemake 1985; mergekit's ``slerp``): the two models θ_1, θ_2 interpolated along the great
circle between them, each tensor as one vector: with cos Ω = θ_1·θ_2 / (‖θ_1‖ ‖θ_2‖),
θ = sin((1 − t) Ω) / sin Ω · θ_1 + sin(t Ω) / sin Ω · θ_2, and linear interpolation where the two
are (anti)parallel (|cos Ω| > 0.9995). Exactly two inputs; t is the second input's weight unless
``t`` is given (mergekit's base model is the first input). The models themselves are
interpolated, not their task vectors (θ0 is only added back): NuSLERP with a base interpolates
the task vectors. On DiLoCo pseudo-gradients (R = 2 only) both are the same.
"""

from __future__ import annotations

import torch
from pydantic import Field

from pipeline.merge.inputs import TensorInputs
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, register
from pipeline.merge.span import combine, gram, raw_coefficients, raw_gram

EPS = 1e-8  # a norm under this counts as 1 (mergekit's)
PARALLEL = 0.9995  # |cos Ω| above which the interpolation is linear (mergekit's)


class Params(MethodParams):
    t: float | None = Field(None, ge=0.0, le=1.0)  # None: the second input's share of the weights


def arc(t: float, cos: torch.Tensor, linear: torch.Tensor) -> torch.Tensor:
    """(V, 2) coefficients of the two endpoints: along the arc, or linear where ``linear``."""
    theta = torch.acos(torch.where(linear, torch.zeros_like(cos), cos))
    sin = torch.sin(theta)
    first = torch.where(linear, torch.full_like(cos, 1 - t), torch.sin((1 - t) * theta) / sin)
    second = torch.where(linear, torch.full_like(cos, t), torch.sin(t * theta) / sin)
    return torch.stack([first, second], -1)


def merge(inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    t = float(weights[1]) if params.t is None else params.t
    with_base = inputs.base is not None
    g = raw_gram(gram(inputs, with_base=with_base), with_base)[0]
    norms = g.diagonal().sqrt()
    norms = torch.where(norms > EPS, norms, torch.ones_like(norms))
    cos = (g[0, 1] / (norms[0] * norms[1])).clamp(-1, 1).view(1)
    c = arc(t, cos, cos.abs() > PARALLEL)
    return combine(inputs, raw_coefficients(c, with_base), with_base=with_base)


METHOD = register(MergeMethod("slerp", Params, merge=merge, needs_base=False, inputs=(2, 2)))
