"""Model Stock (Jang et al., ECCV 2024; mergekit's ``model_stock``): for K ≥ 2 fine-tunes of one
base, the mean cosine c of their task vectors' pairs gives the interpolation ratio
t = K c / (1 + (K − 1) c) between their average and θ0: θ = θ0 + t Σ_k w_k τ_k (t = 0 where
1 + (K − 1) c is 0). Each tensor is one vector, or each vector along its last dimension with
``filter_wise`` (a matrix's rows). mergekit averages with equal weights; here the average is
weighted by the merge's weights (equal weights give mergekit's). Two passes (one when the tensor
fits the block budget): the task vectors' inner products, then the combination.
"""

from __future__ import annotations

import torch

from pipeline.merge.inputs import TensorInputs
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, register
from pipeline.merge.span import combine, gram

MIN_NORMS = 1e-6  # floor of ‖τ_a‖ ‖τ_b‖ in a cosine (mergekit's)
SINGULAR = 1e-6  # |1 + (K − 1) c| under which θ0 is kept (mergekit's)


class Params(MethodParams):
    filter_wise: bool = False  # a ratio per row (per vector along the last dimension)


def ratio(g: torch.Tensor) -> torch.Tensor:
    """(V,) interpolation ratios t from (V, K, K) Gram matrices."""
    k = g.shape[-1]
    norms = g.diagonal(dim1=1, dim2=2).clamp_min(0).sqrt()
    first, second = torch.triu_indices(k, k, 1)
    cos = g[:, first, second] / (norms[:, first] * norms[:, second]).clamp_min(MIN_NORMS)
    c = cos.clamp(-1, 1).mean(-1)
    denominator = 1 + (k - 1) * c
    singular = denominator.abs() < SINGULAR
    return torch.where(singular, torch.zeros_like(c), k * c / torch.where(singular, 1.0, denominator))


def merge(inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    vectors = "last" if params.filter_wise else "tensor"
    g = gram(inputs, vectors)
    return combine(inputs, ratio(g)[:, None] * weights.double().to(g.device)[None, :], vectors)


METHOD = register(MergeMethod("model_stock", Params, merge=merge, inputs=(2, None)))
