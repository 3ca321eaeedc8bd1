"""DARE (Yu et al. 2023): drop each entry of each τ_k with probability p, rescale the survivors
by 1 / (1 − p), then combine: ``linear`` (θ0 + λ Σ w_k τ̃_k) or ``ties`` (TIES on the τ̃_k).

The masks come from generators seeded by (seed, tensor name, model, stretch of 2^20 entries): the
same spec gives the same merge whatever the tensor order or the merge's block budget (on one
device type; CPU and CUDA random streams differ).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from pipeline.merge.inputs import TensorInputs
from pipeline.merge.methods import ties
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, register

RNG_STRETCH = 1 << 20  # entries per generator


class Params(MethodParams):
    drop: float = Field(0.9, ge=0.0, lt=1.0)  # p
    combine: Literal["linear", "ties"] = "linear"
    density: float = Field(1.0, gt=0.0, le=1.0)  # TIES trim after the drop (1.0: keep all survivors)
    scale: float = 1.0  # λ


def uniforms(ctx: TensorContext, k: int, start: int, stop: int, numel: int, device: str) -> torch.Tensor:
    """U(0, 1) draws for entries [start, stop) of model k's task vector."""
    if stop <= start:  # a tensor without entries
        return torch.empty(0, device=device)
    first, last = start // RNG_STRETCH, (stop - 1) // RNG_STRETCH
    draws = []
    for stretch in range(first, last + 1):
        generator = torch.Generator(device=device).manual_seed(ctx.key(k, stretch))
        size = min(RNG_STRETCH, numel - stretch * RNG_STRETCH)
        draws.append(torch.rand(size, generator=generator, device=device))
    offset = first * RNG_STRETCH
    return torch.cat(draws)[start - offset : stop - offset]


class Dropped:
    """The row blocks of ``inputs`` with DARE's masks applied (in place) as they are read. A tensor
    of one block is dropped once and kept: its raw block no longer exists."""

    def __init__(self, inputs: TensorInputs, p: float, ctx: TensorContext):
        self.inputs, self.p, self.ctx, self.kept = inputs, p, ctx, None

    def __call__(self, i: int) -> torch.Tensor:
        if self.kept is not None:
            return self.kept
        block, span = self.inputs.block(i), self.inputs.span(i)
        if self.p:
            for k in range(self.inputs.k):
                u = uniforms(self.ctx, k, span.start, span.stop, self.inputs.numel, self.inputs.device)
                block[k].mul_(u >= self.p).div_(1.0 - self.p)
        if len(self.inputs.blocks) == 1:
            self.inputs.forget()
            self.kept = block
        return block


def merge(inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    dropped = Dropped(inputs, params.drop, ctx)
    if params.combine == "ties":
        return ties.ties(inputs, dropped, weights, params.density, params.scale)
    w = weights.to(inputs.device)
    return inputs.elementwise(lambda block, i: params.scale * (w @ block), dropped)


METHOD = register(MergeMethod("dare", Params, merge=merge, aliases=("dare_linear",)))
