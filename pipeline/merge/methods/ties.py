"""TIES (Yadav et al. 2023): trim, elect sign, disjoint mean.

1. Trim: keep the top ``density`` fraction of each τ_k by magnitude (paper default 20 %; a list
   gives each model its own, as mergekit's per-model ``density``).
2. Elect: s = sign(Σ_k w_k τ̂_k); where that sum is exactly 0, the sign of Σ s (the tensor's
   majority; 0 when that is a tie too, so the entry stays 0), as in the reference
   implementation. This keeps TIES odd, f(−τ) = −f(τ), which DiLoCo's sign convention needs.
3. Disjoint mean over the entries that agree with s: Σ_k w_k τ̂_k [agree] / Σ_k w_k [agree],
   the denominator clamped (an entry nobody keeps stays 0). Equal weights give the paper's
   plain disjoint mean; ``normalize: false`` keeps the disjoint sum Σ_k w_k τ̂_k [agree]
   (mergekit's option). θ = θ0 + λ τ_merged.

The trim keeps ⌊density · n⌋ entries of each τ_k (at least one), as mergekit does: those at or
above the exact k-th largest |τ_k| (``pipeline.merge.selection``). A tensor
larger than the merge's block budget is processed in row blocks: the threshold's two passes and
the merge pass each read it once. Every pass works on column chunks with preallocated buffers
and in-place arithmetic (``pipeline.merge.chunks``): on a CPU, temporaries and bool masks were
80 % of the merge.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pipeline.merge.chunks import chunks, scratch, view, workers
from pipeline.merge.inputs import TensorInputs
from pipeline.merge.registry import Density, MergeMethod, MethodParams, TensorContext, per_model, register, scale_field
from pipeline.merge.selection import kth_largest_abs
from pipeline.threads import map_chunks


class Params(MethodParams):
    density: Density = 0.2  # fraction of entries kept per task vector (or one per model)
    normalize: bool = True  # the disjoint mean (false: the disjoint sum)
    scale: float = scale_field()  # λ


def merge(inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    return ties(inputs, inputs.block, weights, params.density, params.scale, params.normalize)


def ties(
    inputs: TensorInputs,
    block: Callable[[int], torch.Tensor],
    weights: torch.Tensor,
    density: float | Sequence[float],
    scale: float,
    normalize: bool = True,
) -> torch.Tensor:
    """TIES over the row blocks ``block(i)`` of ``inputs`` (its task vectors, or DARE's dropped
    ones), in two passes: trim, weight and elect every column's sign; then, with the tensor's
    majority sign known for the columns whose kept values cancel exactly, the disjoint means. A
    tensor of one block is kept trimmed in place between the passes; a larger one is read and
    trimmed again. The chunks of a pass run on ``map_chunks`` threads."""
    n, device = inputs.numel, inputs.device
    one_block = len(inputs.blocks) == 1
    threshold = _thresholds(inputs, block, [max(1, int(d * n)) for d in per_model(density, inputs.k, inputs.name)])
    w = weights.to(device)
    out = torch.empty(n, dtype=torch.float32, device=device)  # the elected signs, then the merged values

    def elect(flat: torch.Tensor, start: int) -> Callable[[slice, list[torch.Tensor]], float]:
        def chunk_signs(cols: slice, buffers: list[torch.Tensor]) -> float:
            chunk = flat[:, cols]
            trimmed = _trim(chunk, threshold, view(buffers[0], chunk))
            sign = out[start + cols.start : start + cols.stop]
            return float(torch.sign(w @ trimmed, out=sign).sum(dtype=torch.float64))  # exact

        return chunk_signs

    def average(flat: torch.Tensor, start: int, majority: int) -> Callable[[slice, list[torch.Tensor]], None]:
        def chunk_means(cols: slice, buffers: list[torch.Tensor]) -> None:
            chunk = flat[:, cols]
            trimmed = chunk if one_block else _trim(chunk, threshold, view(buffers[0], chunk))
            sign = out[start + cols.start : start + cols.stop]
            elected = sign.square().neg_().add_(1).mul_(majority).add_(sign)  # the majority where 0
            sign.copy_(_disjoint_mean(trimmed, elected, w, normalize, view(buffers[0], chunk)))

        return chunk_means

    balance = 0.0  # Σ of the elected signs
    for i in inputs.blocks:
        flat = block(i)
        balance += sum(map_chunks(elect(flat, inputs.span(i).start), chunks(flat), scratch(flat, 1), workers(flat)))
    majority = (balance > 0) - (balance < 0)  # 0 when the tie is a tie too
    for i in inputs.blocks:
        flat = block(i)
        map_chunks(average(flat, inputs.span(i).start, majority), chunks(flat), scratch(flat, 1), workers(flat))
    return out.mul_(scale).view(inputs.shape)


def _thresholds(inputs: TensorInputs, block: Callable[[int], torch.Tensor], keeps: list[int]) -> torch.Tensor:
    """(K, 1): each task vector's k-th largest |τ_k| for its own k (0 where it keeps every entry).
    Models that keep as many entries share one selection; each further count is one more (a
    tensor of several blocks: one more read of it)."""
    n, one_block = inputs.numel, len(inputs.blocks) == 1
    threshold = torch.zeros(inputs.k, 1, device=inputs.device)
    for keep in sorted(set(keeps) - {n}):
        rows = [k for k, kept in enumerate(keeps) if kept == keep]
        pick = slice(None) if len(rows) == inputs.k else torch.tensor(rows, device=inputs.device)
        blocks = block(0)[pick] if one_block else lambda pick=pick: (block(i)[pick] for i in inputs.blocks)
        threshold[rows] = kth_largest_abs(blocks, keep, n).view(-1, 1)
    return threshold


def _trim(chunk: torch.Tensor, threshold: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The chunk with its entries under the threshold zeroed, in place; ``a`` is scratch."""
    torch.abs(chunk, out=a).ge_(threshold)  # 1.0 where kept
    return chunk.mul_(a)


def _disjoint_mean(
    trimmed: torch.Tensor, elected: torch.Tensor, w: torch.Tensor, normalize: bool, a: torch.Tensor
) -> torch.Tensor:
    """Σ_k w_k τ̂_k [agree] / Σ_k w_k [agree] per column (without ``normalize``, the numerator),
    where agree means kept with the elected sign; ``a`` is scratch. The sums over k are products
    with the weight vector (one pass each, where weighing and then summing takes two); the
    numerator sums the agreeing magnitudes and takes the sign after."""
    agreeing = torch.mul(trimmed, elected, out=a).clamp_min_(0)
    numerator = (w @ agreeing).mul_(elected)
    if not normalize:
        return numerator
    denominator = (w @ agreeing.gt_(0)).clamp_min_(torch.finfo(torch.float32).tiny)  # nobody kept: 0
    return numerator.div_(denominator)


METHOD = register(MergeMethod("ties", Params, merge=merge))
