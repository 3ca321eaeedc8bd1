"""Iso-CTS (Marczak et al., ICML 2025), per 2-D tensor of shape (m, n), r = min(m, n):
1. Common subspace: the top ⌊common · r⌋ singular directions of M = Σ_k w_k τ_k.
2. Each task adds the top ⌊(r − common·r) / K⌋ directions of its residual (I − U_c U_cᵀ) w_k τ_k.
   (Both within the support, ``linalg.support``: a LoRA merge's M has rank ≤ Σ r_k, and
   directions of singular value 0 are arbitrary.)
3. Orthogonalise the concatenated left and right bases (polar factors), give every direction
   the mean of all the concatenated singular values, reconstruct; θ = θ0 + α · that.
Non-2-D tensors: weighted average.
"""

from __future__ import annotations

import torch
from pydantic import Field

from pipeline.merge.inputs import TensorInputs
from pipeline.merge.linalg import polar, support
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, register


class Params(MethodParams):
    scale: float = 1.0  # α
    common: float = Field(0.8, gt=0.0, le=1.0)  # fraction of the rank kept for the common subspace


def merge(inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    mean = inputs.mean(weights)
    if mean.dim() != 2:
        return mean
    rank = min(mean.shape)
    n_common = max(1, int(params.common * rank))
    per_task = (rank - n_common) // inputs.k
    u, s, vh = torch.linalg.svd(mean, full_matrices=False)
    n_common, top = min(n_common, support(s, mean.shape)), float(s[0])
    if n_common == 0:
        return torch.zeros_like(mean)
    us, ss, vs = [u[:, :n_common].clone()], [s[:n_common].clone()], [vh[:n_common].T.clone()]
    del u, s, vh, mean  # only the kept directions stay: the full factors are as large as the tensor
    if per_task > 0:
        projector = us[0]
        for k, w in enumerate(weights.tolist()):  # one task vector at a time
            tau = inputs.task(k).mul_(w)
            residual = tau - projector @ (projector.T @ tau)
            ut, st, vht = torch.linalg.svd(residual, full_matrices=False)
            kept = min(per_task, support(st, residual.shape, top))
            us.append(ut[:, :kept].clone())
            ss.append(st[:kept].clone())
            vs.append(vht[:kept].T.clone())
    u_perp, v_perp = polar(torch.cat(us, 1)), polar(torch.cat(vs, 1))
    return params.scale * torch.cat(ss).mean() * (u_perp @ v_perp.T)


METHOD = register(MergeMethod("iso_cts", Params, merge=merge, aliases=("isocts",)))
