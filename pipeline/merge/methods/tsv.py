"""TSV-Merge (Gargiulo et al. 2025), per 2-D tensor: SVD each weighted task vector w_k τ_k, keep
its top ⌊min(m, n) / K⌋ components, concatenate the U's, singular values and V's, replace the
concatenated U and V by their polar factors (removing the interference between task
subspaces), and reconstruct U⊥ Σ V⊥ᵀ; θ = θ0 + α · that. Non-2-D tensors: weighted average.
"""

from __future__ import annotations

import torch

from pipeline.merge.linalg import polar
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, register, weighted_mean


class Params(MethodParams):
    scale: float = 1.0  # α


def merge(task_vectors: torch.Tensor, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    if task_vectors.dim() != 3:
        return weighted_mean(task_vectors, weights)
    k = task_vectors.shape[0]
    rank = max(1, min(task_vectors.shape[1:]) // k)
    us, ss, vs = [], [], []
    for w, tau in zip(weights.tolist(), task_vectors):
        u, s, vh = torch.linalg.svd(w * tau, full_matrices=False)
        us.append(u[:, :rank])
        ss.append(s[:rank])
        vs.append(vh[:rank].T)
    u_perp, v_perp = polar(torch.cat(us, 1)), polar(torch.cat(vs, 1))
    return params.scale * (u_perp * torch.cat(ss)) @ v_perp.T


METHOD = register(MergeMethod("tsv", Params, merge=merge, aliases=("tsv_merge",)))
