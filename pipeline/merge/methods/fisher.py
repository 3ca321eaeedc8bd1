"""Fisher-weighted averaging (Matena & Raffel 2022) with diagonal Fisher F_k per model:
θ = Σ_k w_k F_k θ_k / Σ_k w_k F_k, F floored at ``floor``; as a task vector
τ = Σ_k w_k F_k τ_k / Σ_k w_k F_k (the θ0 terms cancel). Equal Fishers give the weighted average.

:func:`estimate_fisher` computes the diagonal empirical Fisher (mean squared gradient of the
loss over calibration batches) and saves it with the model's own ``save_pretrained``, so the
Fisher file has exactly the tensor names and layout of the checkpoint it belongs to.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, register


class Params(MethodParams):
    floor: float = Field(1e-6, gt=0.0)  # > 0: an all-zero Fisher must not divide by zero


def merge(task_vectors: torch.Tensor, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    if ctx.fishers is None:
        raise ValueError(f"{ctx.name}: the fisher method needs a fisher file for every model")
    w = weights.to(task_vectors).view(-1, *([1] * (task_vectors.dim() - 1)))
    fisher = ctx.fishers.to(task_vectors).clamp_min(params.floor) * w
    return (fisher * task_vectors).sum(0) / fisher.sum(0)


METHOD = register(MergeMethod("fisher", Params, merge=merge, needs_fisher=True))


def estimate_fisher(model: Any, batches: Iterable[dict[str, torch.Tensor]], out_dir: str | Path, **meta: Any) -> Path:
    """Diagonal Fisher of ``model`` over ``batches`` (one example per batch gives the per-example
    empirical Fisher; larger batches give the Fisher of batch-mean gradients), saved to ``out_dir``
    with ``meta`` in its manifest."""
    from pipeline.checkpoint import save_pretrained_checkpoint

    squares = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in model.named_parameters()}
    count = 0
    model.eval()
    for batch in batches:
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        for name, param in model.named_parameters():
            if param.grad is not None:
                squares[name] += param.grad.float() ** 2
        count += 1
    if count == 0:
        raise ValueError("estimate_fisher needs at least one batch")
    fisher_model = copy.deepcopy(model).float()
    with torch.no_grad():
        for name, param in fisher_model.named_parameters():
            param.copy_(squares[name] / count)
    return save_pretrained_checkpoint(out_dir, fisher_model, kind="diagonal_fisher", batches=count, **meta)
