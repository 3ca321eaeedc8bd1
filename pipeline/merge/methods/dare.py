"""DARE (Yu et al. 2023): drop each entry of each τ_k with probability p, rescale the survivors
by 1 / (1 − p), then combine: ``linear`` (θ0 + λ Σ w_k τ̃_k) or ``ties`` (TIES on the τ̃_k).

The masks come from generators seeded by (seed, tensor name, model, stretch of 2^20 entries): the
same spec gives the same merge whatever the tensor order, the merge's block budget or the device
(the draws are made on the CPU). Each draw is 16 random bits (SFC64, four draws per 64-bit word,
5× faster than ``torch.rand``), so p is applied as the nearest multiple of 2^-16 (within 7.6e-6),
and the rescale uses that same p. The rescale is applied once, to the merged task vector: every
combination is linear in a common factor of its inputs (TIES trims and elects signs the same).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field, field_validator

from pipeline.merge.inputs import TensorInputs
from pipeline.merge.methods import ties
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, register

RNG_STRETCH = 1 << 20  # entries per generator
LEVELS = 1 << 16  # values of one draw


class Params(MethodParams):
    drop: float = Field(0.9, ge=0.0, lt=1.0)  # p
    combine: Literal["linear", "ties"] = "linear"
    density: float = Field(1.0, gt=0.0, le=1.0)  # TIES trim after the drop (1.0: keep all survivors)
    scale: float = 1.0  # λ

    @field_validator("drop")
    @classmethod
    def _keeps_something(cls, drop: float) -> float:
        if round(drop * LEVELS) >= LEVELS:
            raise ValueError(f"drop {drop} is 1 at the masks' resolution of 2^-16: nothing would be kept")
        return drop


def draws(ctx: TensorContext, k: int, start: int, stop: int) -> torch.Tensor:
    """Uniform int16 draws (all 2^16 values equally likely) for entries [start, stop) of model k's
    task vector. A stretch's generator yields the same prefix however much is drawn from it."""
    if stop <= start:  # a tensor without entries
        return torch.empty(0, dtype=torch.int16)
    first, last = start // RNG_STRETCH, (stop - 1) // RNG_STRETCH
    parts = []
    for stretch in range(first, last + 1):
        needed = min(RNG_STRETCH, stop - stretch * RNG_STRETCH)
        words = np.random.SFC64(ctx.key(k, stretch)).random_raw(-(-needed // 4))
        parts.append(words.view(np.int16)[:needed])
    offset = first * RNG_STRETCH
    return torch.from_numpy(np.concatenate(parts)[start - offset :])


def drop_level(p: float) -> int:
    """Entries whose draw is below this level are dropped: a share round(p · 2^16) / 2^16."""
    return round(p * LEVELS) - LEVELS // 2


class Dropped:
    """The row blocks of ``inputs`` with DARE's masks applied (in place) as they are read, not yet
    rescaled. A tensor of one block is dropped once and kept: its raw block no longer exists."""

    def __init__(self, inputs: TensorInputs, p: float, ctx: TensorContext):
        self.inputs, self.level, self.ctx, self.kept = inputs, drop_level(p), ctx, None

    def __call__(self, i: int) -> torch.Tensor:
        if self.kept is not None:
            return self.kept
        block, span = self.inputs.block(i), self.inputs.span(i)
        if self.level > -LEVELS // 2:
            keep = torch.empty(block.shape[1], device=block.device)
            for k in range(self.inputs.k):
                torch.ge(draws(self.ctx, k, span.start, span.stop).to(block.device), self.level, out=keep)
                block[k].mul_(keep)
        if len(self.inputs.blocks) == 1:
            self.inputs.forget()
            self.kept = block
        return block


def merge(inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    dropped = Dropped(inputs, params.drop, ctx)
    scale = params.scale * LEVELS / (LEVELS - round(params.drop * LEVELS))  # λ / (1 − p)
    if params.combine == "ties":
        return ties.ties(inputs, dropped, weights, params.density, scale)
    w = weights.to(inputs.device) * scale
    return inputs.elementwise(lambda block, i: w @ block, dropped)


METHOD = register(MergeMethod("dare", Params, merge=merge, aliases=("dare_linear",)))
