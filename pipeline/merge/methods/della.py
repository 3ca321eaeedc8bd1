"""DELLA (Deep et al. 2024; mergekit's ``della`` and ``della_linear``): MAGPRUNE drops the
entries of each τ_k at random, small magnitudes more often: in each row (of a matrix; a vector
is one row) the entry of magnitude rank r of m (r = 0 the smallest) is kept with probability
q = density − epsilon + 2 epsilon r / (m − 1), and a survivor is rescaled by 1 / q (``rescale``).
The survivors are combined by TIES's sign consensus (``della``: the agreeing survivors' mean
unless ``normalize: false``) or linearly (``della_linear``). density 1 keeps every entry.

The draws are DARE's (seeded by tensor, model and position; 2^-16 resolution). mergekit rescales
each τ̃_k to the L1 norm of its τ_k instead of by the paper's 1 / q, and ranks along the second
dimension of a tensor of more than 2 (here: each row of the first dimension, flattened).
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator

from pipeline.merge.inputs import TensorInputs
from pipeline.merge.methods.dare import LEVELS, draws
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, register, scale_field
from pipeline.merge.sparse import Sparsified, Sparsifier, combine


class LinearParams(MethodParams):
    density: float = Field(1.0, gt=0.0, le=1.0)  # mean share kept
    epsilon: float = Field(0.15, ge=0.0)  # the keep probability spans density ± epsilon
    rescale: bool = True  # survivors × 1 / q
    scale: float = scale_field()  # λ

    @model_validator(mode="after")
    def _probabilities(self):
        if self.density < 1 and not 0 < self.density - self.epsilon < self.density + self.epsilon < 1:
            raise ValueError(f"density ± epsilon must lie in (0, 1), got {self.density} ± {self.epsilon}")
        return self


class Params(LinearParams):
    normalize: bool = True  # the agreeing survivors' mean (false: their sum)


def magprune(inputs: TensorInputs, params: LinearParams, ctx: TensorContext) -> Sparsifier:
    row = inputs.numel if len(inputs.shape) < 2 else inputs.per_row
    if len(inputs.shape) < 2 and len(inputs.blocks) > 1:
        raise ValueError(f"tensor {inputs.name}: a vector larger than the block budget cannot be ranked whole")

    def drop(block: torch.Tensor, i: int) -> None:
        rows = block.view(inputs.k, -1, row)
        order = rows.abs().argsort(-1)
        ranks = torch.empty(rows.shape, device=block.device)  # each entry's magnitude rank in its row
        ranks.scatter_(-1, order, torch.arange(row, dtype=torch.float32, device=block.device).expand(rows.shape))
        q = ranks.mul_(2 * params.epsilon / max(row - 1, 1)).add_(params.density - params.epsilon)
        span = inputs.span(i)
        for k in range(inputs.k):
            uniform = draws(ctx, k, span.start, span.stop).to(block.device).float().add_(LEVELS // 2).div_(LEVELS)
            kept = uniform < q[k].view(-1)
            factor = q[k].view(-1).reciprocal() if params.rescale else torch.ones_like(uniform)
            block[k].mul_(factor.mul_(kept))

    return drop


def merge(inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext, params: LinearParams) -> torch.Tensor:
    consensus = isinstance(params, Params)
    blocks = inputs.block if params.density >= 1 else Sparsified(inputs, magprune(inputs, params, ctx))
    return combine(inputs, blocks, weights, params.scale, consensus, normalize=consensus and params.normalize)


METHOD = register(MergeMethod("della", Params, merge=merge))
LINEAR = register(MergeMethod("della_linear", LinearParams, merge=merge))
