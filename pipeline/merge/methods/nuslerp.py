"""NuSLERP (mergekit's ``nuslerp``): SLERP of the two task vectors τ_1, τ_2 (of the models
themselves without a base), t the second input's weight: θ = θ0 + (sin((1 − t) Ω) τ_1 + sin(t Ω) τ_2)
/ sin Ω, cos Ω the cosine of τ_1 and τ_2, linear where they are parallel (1 − cos² Ω ≤ 1e-16). By
default each tensor is one vector (``nuslerp_flatten``); otherwise each row (vectors along the
last dimension) or, with ``nuslerp_row_wise``, each column (along the first dimension), as
mergekit names them. Exactly two inputs; on DiLoCo pseudo-gradients it needs R = 2.
"""

from __future__ import annotations

import torch

from pipeline.merge.inputs import TensorInputs
from pipeline.merge.methods.slerp import arc
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, register
from pipeline.merge.span import combine, gram

EPS = 1e-8  # mergekit's: linear where 1 − cos² ≤ EPS²
MIN_NORM = 1e-7  # a norm is clamped to at least this


class Params(MethodParams):
    nuslerp_flatten: bool = True  # the whole tensor as one vector
    nuslerp_row_wise: bool = False  # when not flattened: vectors along the first dimension


def merge(inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    vectors = "tensor" if params.nuslerp_flatten else "first" if params.nuslerp_row_wise else "last"
    g = gram(inputs, vectors)
    norms = g.diagonal(dim1=1, dim2=2).sqrt().clamp_min(MIN_NORM)
    cos = (g[:, 0, 1] / (norms[:, 0] * norms[:, 1])).clamp(-1, 1)
    c = arc(float(weights[1]), cos, (1 - cos.square()) <= EPS**2)
    return combine(inputs, c, vectors)


METHOD = register(MergeMethod("nuslerp", Params, merge=merge, needs_base=False, inputs=(2, 2)))
