"""DARE (Yu et al. 2023): drop each entry of each τ_k with probability p, rescale the survivors
by 1 / (1 − p), then combine: ``linear`` (θ0 + λ Σ w_k τ̃_k) or ``ties`` (TIES on the τ̃_k).

The masks come from generators seeded by (seed, tensor name, model, stretch of 2^20 entries): the
same spec gives the same merge whatever the tensor order, the merge's block budget or the device
(the draws are made on the CPU). Each draw is 16 random bits (SFC64, four draws per 64-bit word,
5× faster than ``torch.rand``), so p is applied as the nearest multiple of 2^-16 (within 7.6e-6),
and the rescale uses that same p. The rescale is applied once, to the merged task vector: every
combination is linear in a common factor of its inputs (TIES trims and elects signs the same).

``dare_linear`` and ``dare_ties`` are the same merges under mergekit's names and parameters:
``density`` is the share kept (1 − p, default 1: nothing dropped), ``rescale`` turns the
1 / density rescale off, and ``dare_ties`` sums the agreeing survivors unless ``normalize``.
``density`` may be one per model (mergekit's per-model density). mergekit rescales each τ̃_k to the L1
norm of its τ_k instead of by 1 / density (the paper's rescale, whose expectation it matches):
``rescale_norm: l1`` does the same; its masks are ``torch.bernoulli`` draws.
"""

from __future__ import annotations

import itertools
from typing import Literal

import numpy as np
import torch
from pydantic import Field, field_validator

from pipeline.merge.chunks import workers
from pipeline.merge.inputs import TensorInputs
from pipeline.merge.registry import Density, MergeMethod, MethodParams, TensorContext, per_model, register, scale_field
from pipeline.merge.sparse import Sparsified, Sparsifier, combine
from pipeline.threads import map_chunks

RNG_STRETCH = 1 << 20  # entries per generator
LEVELS = 1 << 16  # values of one draw


class Params(MethodParams):
    drop: float = Field(0.9, ge=0.0, lt=1.0)  # p
    combine: Literal["linear", "ties"] = "linear"
    density: float = Field(1.0, gt=0.0, le=1.0)  # TIES trim after the drop (1.0: keep all survivors)
    scale: float = scale_field()  # λ

    @field_validator("drop")
    @classmethod
    def _keeps_something(cls, drop: float) -> float:
        return keeps_something(drop)


def keeps_something(drop: float) -> float:
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


def dropper(
    inputs: TensorInputs, p: float | list[float], ctx: TensorContext, factors: list[float] | None = None
) -> Sparsifier:
    """DARE's masks: each entry of τ_k dropped with probability p (or p_k, one per model), the
    survivors multiplied by ``factors[k]`` if given (else left for the caller to rescale)."""
    levels = [drop_level(q) for q in per_model(p, inputs.k, inputs.name)]

    def drop(block: torch.Tensor, i: int) -> None:
        if all(level == -LEVELS // 2 for level in levels) and factors is None:
            return
        start = inputs.span(i).start

        # One stretch's columns at a time, on threads of their own: its draws and a reused keep
        # buffer stay in cache (whole rows at once allocated a fresh (n,) mask per model and drew
        # every stretch on one thread).
        def drop_columns(cols: slice, buffers: list[torch.Tensor]) -> None:
            keep = buffers[0][: cols.stop - cols.start]
            for k, level in enumerate(levels):
                torch.ge(draws(ctx, k, start + cols.start, start + cols.stop).to(block.device), level, out=keep)
                block[k, cols].mul_(keep if factors is None else keep.mul_(factors[k]))

        scratch = lambda: [torch.empty(min(RNG_STRETCH, block.shape[1]), device=block.device)]
        map_chunks(drop_columns, stretches(start, block.shape[1]), scratch, workers(block))

    return drop


def stretches(start: int, n: int) -> list[slice]:
    """Columns [0, n) of a block that starts at entry ``start``, cut where a generator's stretch
    begins: each piece's draws come from one generator (``draws`` gives the same values for any
    cut, so the cuts move only time)."""
    cuts = [0, *range(-start % RNG_STRETCH or RNG_STRETCH, n, RNG_STRETCH), n]
    return [slice(a, b) for a, b in itertools.pairwise(cuts)]


def rescale(p: float) -> float:
    """1 / (1 − p) at the masks' resolution."""
    return LEVELS / (LEVELS - round(p * LEVELS))


def merge(inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    dropped = Sparsified(inputs, dropper(inputs, params.drop, ctx))
    scale = params.scale * rescale(params.drop)
    return combine(inputs, dropped, weights, scale, params.combine == "ties", density=params.density)


class KeepParams(MethodParams):
    """mergekit's ``dare_linear`` / ``dare_ties`` parameters: ``density`` is the share kept."""

    density: Density = 1.0  # 1 − p, or one per model (mergekit's default: nothing dropped)
    rescale: bool = True  # survivors × 1 / density
    rescale_norm: Literal["l1"] | None = None  # l1: each τ̃_k × ‖τ_k‖₁ / ‖τ̃_k‖₁ instead (mergekit's)
    scale: float = scale_field()  # λ

    @field_validator("density")
    @classmethod
    def _keeps_something(cls, density: float | list[float]) -> float | list[float]:
        for d in [density] if isinstance(density, float) else density:
            keeps_something(1 - d)
        return density


class TiesKeepParams(KeepParams):
    normalize: bool = False  # mergekit's dare_ties sums the agreeing survivors (true: their mean)


def merge_keeping(inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext, params: KeepParams) -> torch.Tensor:
    drops = [1 - d for d in per_model(params.density, inputs.k, inputs.name)]
    by_density = params.rescale and params.rescale_norm is None
    # One drop rate: its rescale multiplies the merged τ once; several: each τ̃_k is rescaled as it is dropped.
    factors = [rescale(p) for p in drops] if by_density and len(set(drops)) > 1 else None
    l1 = params.rescale and params.rescale_norm == "l1"
    dropped = Sparsified(inputs, dropper(inputs, drops, ctx, factors), l1=l1)
    scale = params.scale * (rescale(drops[0]) if by_density and factors is None else 1.0)
    consensus = isinstance(params, TiesKeepParams)
    return combine(inputs, dropped, weights, scale, consensus, normalize=consensus and params.normalize)


METHOD = register(MergeMethod("dare", Params, merge=merge))
LINEAR = register(MergeMethod("dare_linear", KeepParams, merge=merge_keeping))
TIES = register(MergeMethod("dare_ties", TiesKeepParams, merge=merge_keeping))
