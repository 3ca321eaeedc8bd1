"""TSV-Merge (Gargiulo et al. 2025), per 2-D tensor: SVD each weighted task vector w_k τ_k, keep
its top ⌊min(m, n) / K⌋ components (those of its support: a LoRA task vector of rank r keeps at
most r, ``linalg.support``), concatenate the U's, singular values and V's, replace the
concatenated U and V by their polar factors (removing the interference between task
subspaces), and reconstruct U⊥ Σ V⊥ᵀ; θ = θ0 + α · that. Non-2-D tensors: weighted average.
"""

from __future__ import annotations

import torch

from pipeline.merge.inputs import TensorInputs
from pipeline.merge.linalg import polar, support
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, register


class Params(MethodParams):
    scale: float = 1.0  # α


def merge(inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    if len(inputs.shape) != 2:
        return inputs.mean(weights)
    rank = max(1, min(inputs.shape) // inputs.k)
    us, ss, vs = [], [], []
    for k, w in enumerate(weights.tolist()):  # one task vector at a time: its top components are kept
        u, s, vh = torch.linalg.svd(inputs.task(k).mul_(w), full_matrices=False)
        kept = min(rank, support(s, inputs.shape))
        us.append(u[:, :kept].clone())  # copies: a view would keep the whole factor alive
        ss.append(s[:kept].clone())
        vs.append(vh[:kept].T.clone())
    if not sum(len(s) for s in ss):
        return torch.zeros(inputs.shape, dtype=torch.float32, device=inputs.device)
    u_perp, v_perp = polar(torch.cat(us, 1)), polar(torch.cat(vs, 1))
    return params.scale * (u_perp * torch.cat(ss)) @ v_perp.T


METHOD = register(MergeMethod("tsv", Params, merge=merge, aliases=("tsv_merge",)))
