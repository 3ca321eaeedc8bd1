"""Fisher-weighted averaging (Matena & Raffel 2022) with diagonal Fisher F_k per model:
θ = Σ_k w_k F_k θ_k / Σ_k w_k F_k, F floored at ``floor``; as a task vector
τ = Σ_k w_k F_k τ_k / Σ_k w_k F_k (the θ0 terms cancel). Equal Fishers give the weighted average,
and so does a tensor the Fisher files leave out (a frozen one, the same in every branch).

The Fisher files are checkpoints with the models' tensor names (``pipeline.fisher`` estimates
them); they are read block by block beside the task vectors.
"""

from __future__ import annotations

import torch
from pydantic import Field

from pipeline.merge.inputs import TensorInputs
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, register


class Params(MethodParams):
    floor: float = Field(1e-6, gt=0.0)  # > 0: an all-zero Fisher must not divide by zero


def merge(inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    if inputs.fishers is None:
        return inputs.mean(weights)
    w = weights.to(inputs.device).view(-1, 1)

    def block(task_vectors: torch.Tensor, i: int) -> torch.Tensor:
        fisher = inputs.fisher_block(i).clamp_min_(params.floor).mul_(w)
        return (fisher * task_vectors).sum(0) / fisher.sum(0)

    return inputs.elementwise(block)


METHOD = register(MergeMethod("fisher", Params, merge=merge, needs_fisher=True))
