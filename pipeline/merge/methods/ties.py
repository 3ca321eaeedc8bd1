"""TIES (Yadav et al. 2023): trim, elect sign, disjoint mean.

1. Trim: keep the top ``density`` fraction of each τ_k by magnitude (paper default 20 %).
2. Elect: s = sign(Σ_k w_k τ̂_k); where that sum is exactly 0, the sign of Σ s (the tensor's
   majority; 0 when that is a tie too, so the entry stays 0), as in the reference
   implementation. This keeps TIES odd, f(−τ) = −f(τ), which DiLoCo's sign convention needs.
3. Disjoint mean over the entries that agree with s: Σ_k w_k τ̂_k [agree] / Σ_k w_k [agree],
   the denominator clamped (an entry nobody keeps stays 0). Equal weights give the paper's
   plain disjoint mean. θ = θ0 + λ τ_merged.

The trim threshold is the exact k-th largest |τ_k|. For a tensor held whole it is bracketed
from a strided sample and pinned down in one pass that counts what lies above the bracket and
keeps what lies inside it (about 1 % of the entries); a bracket that misses (a sample unlike the
rest) falls back to a radix select on the float bits: two histogram passes, no sort. A tensor
larger than the merge's block budget is processed in row blocks with the radix select: the
threshold's two passes and the merge pass each read it once.

Every pass works on column chunks with preallocated float buffers and in-place arithmetic: on a
CPU a fresh (K, chunk) temporary per operation costs its page faults, and boolean masks mixed
into float arithmetic take slow type-promoting paths; together they were 80 % of the merge.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from pydantic import Field

from pipeline.merge.inputs import TensorInputs
from pipeline.merge.registry import MergeMethod, MethodParams, TensorContext, register
from pipeline.threads import map_chunks


class Params(MethodParams):
    density: float = Field(0.2, gt=0.0, le=1.0)  # fraction of entries kept per task vector
    scale: float = 1.0  # λ


CPU_CHUNK_ENTRIES = 1 << 19  # entries per step on CPU: 2 MB fp32 buffers stay in cache, reused
GPU_CHUNK_ENTRIES = 1 << 25  # entries per step on a GPU: each buffer ≤ 128 MB in fp32
SAMPLE = 1 << 16  # entries per row of the strided sample that brackets the threshold
SPREAD = 6.0  # bracket half-width in standard deviations of the sample's rank
MAX_INSIDE = 0.25  # share of a sampled row inside the bracket above which the radix select runs instead


def _chunks(flat: torch.Tensor) -> list[slice]:
    """Column blocks: small on CPU (cache, no page faults); large on a GPU, where each block costs
    kernel launches and host synchronisations, but bounded."""
    rows, n = flat.shape
    step = max(1, (CPU_CHUNK_ENTRIES if flat.device.type == "cpu" else GPU_CHUNK_ENTRIES) // rows)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _scratch(flat: torch.Tensor, count: int) -> Callable[[], list[torch.Tensor]]:
    """A maker of ``count`` flat fp32 buffers, each as large as ``flat``'s largest chunk."""
    width = max((c.stop - c.start for c in _chunks(flat)), default=0)
    return lambda: [torch.empty(flat.shape[0] * width, device=flat.device) for _ in range(count)]


def _view(buffer: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """A contiguous view of ``buffer`` in ``chunk``'s shape: the reductions over K then run as
    they did on freshly allocated temporaries (the same summation order, so the same bits)."""
    return buffer[: chunk.numel()].view(chunk.shape)


def _workers(x: torch.Tensor) -> int:
    """Threads for the chunked passes: this thread's torch threads on CPU; one on a GPU."""
    return torch.get_num_threads() if x.device.type == "cpu" else 1


def kth_largest_abs(blocks: torch.Tensor | Callable[[], Iterable[torch.Tensor]], k: int, n: int = 0) -> torch.Tensor:
    """Exact k-th largest |x| of every row of a (K, n) fp32 tensor (1 ≤ k ≤ n); ``blocks`` is the
    tensor, or a function yielding its n columns as blocks in order, once per pass (a tensor too
    large to hold is read block by block, twice, by the radix select)."""
    if isinstance(blocks, torch.Tensor):
        tensor, n = _floats(blocks), blocks.shape[1]
        # Small tensors: a select costs less than any pass's fixed cost.
        if n < 1 << 20:
            return tensor.abs().kthvalue(n - k + 1, dim=1).values
        found = _bracketed(tensor, k)
        if found is not None:
            return found
        blocks = lambda: [tensor]
    return _radix(blocks, k)


def _bracketed(x: torch.Tensor, k: int) -> torch.Tensor | None:
    """The k-th largest |x| per row from a bracket [lo, hi] around it, found on a strided sample:
    one pass counts the entries above hi and collects those inside; None when the bracket missed."""
    rows, n = x.shape
    sample = x[:, :: max(1, n // SAMPLE)].abs()
    m = sample.shape[1]
    expected, spread = k * m / n, SPREAD * math.sqrt(m * (k / n) * (1 - k / n)) + 2
    top = max(1, math.floor(expected - spread))  # ranks from the top, within the sample
    bottom = min(m, math.ceil(expected + spread))
    hi = sample.kthvalue(m - top + 1, dim=1, keepdim=True).values
    lo = sample.kthvalue(m - bottom + 1, dim=1, keepdim=True).values
    if float(((sample >= lo) & (sample <= hi)).float().mean(1).max()) > MAX_INSIDE:
        return None  # many equal values (a frozen tensor's zeros): collecting them would copy the block

    def count(cols: slice, buffers: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, over, within = (_view(b, x[:, cols]) for b in buffers)  # float indicators: faster than bool
        torch.abs(x[:, cols], out=a)
        above = torch.gt(a, hi, out=over).sum(1)
        within = torch.ge(a, lo, out=within).sub_(over)  # lo ≤ |x| ≤ hi
        return above, within.sum(1), a[within.bool()]

    parts = map_chunks(count, _chunks(x), _scratch(x, 3), _workers(x))
    above = torch.stack([p[0] for p in parts]).sum(0, dtype=torch.float64)
    inside, counts = [p[2] for p in parts], [p[1] for p in parts]
    need = k - above.long()  # the rank of the k-th largest among the entries inside the bracket
    per_row = torch.stack(counts, 1).long()
    if bool(((need < 1) | (need > per_row.sum(1))).any()):
        return None
    values = torch.cat(inside).split(per_row.T.reshape(-1).tolist())  # row-major within chunks
    result = torch.empty(rows, device=x.device)
    for r in range(rows):
        row = torch.cat(values[r::rows])
        result[r] = row.kthvalue(row.numel() - int(need[r]) + 1).values
    return result


def _radix(blocks: Callable[[], Iterable[torch.Tensor]], k: int) -> torch.Tensor:
    """The exact k-th largest |x| per row by radix select. Non-negative IEEE floats order like
    their bit patterns read as integers, so a histogram of the top 16 bits of |x| finds, per row,
    the bucket holding the k-th largest value, and a histogram of the low 16 bits inside that
    bucket finds the value itself: two chunked linear passes, no sort, no full-size temporary."""
    high = None
    for block in blocks():
        rows, device = block.shape[0], block.device
        offsets = torch.arange(rows, device=device).view(-1, 1)
        high = torch.zeros(rows * (1 << 15), dtype=torch.int64, device=device) if high is None else high
        for cols in _chunks(block):
            bits = _floats(block[:, cols]).abs().view(torch.int32) >> 16
            high += torch.bincount((bits + offsets * (1 << 15)).view(-1), minlength=high.numel())
    bucket, k_in = _select(high.view(rows, -1), torch.full((rows,), k, device=device))
    low = torch.zeros(rows * (1 << 16), dtype=torch.int64, device=device)
    for block in blocks():
        for cols in _chunks(block):
            bits = block[:, cols].abs().view(torch.int32)
            inside = (bits >> 16) == bucket.view(-1, 1)
            low += torch.bincount(((bits & 0xFFFF) + offsets * (1 << 16))[inside], minlength=low.numel())
    value, _ = _select(low.view(rows, -1), k_in)
    return ((bucket << 16) | value).to(torch.int32).view(torch.float32)


def _floats(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:
        raise TypeError(f"kth_largest_abs works on float32 bits, got {x.dtype}")
    return x


def _select(histograms: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the highest bin b with at least k entries at or above it, and k's rank inside b."""
    at_or_above = histograms.flip(1).cumsum(1).flip(1)
    chosen = (at_or_above >= k.view(-1, 1)).sum(1) - 1
    above = at_or_above.gather(1, (chosen + 1).clamp_max(histograms.shape[1] - 1).view(-1, 1)).view(-1)
    above = torch.where(chosen + 1 < histograms.shape[1], above, torch.zeros_like(above))
    return chosen, k - above


def merge(inputs: TensorInputs, weights: torch.Tensor, ctx: TensorContext, params: Params) -> torch.Tensor:
    return ties(inputs, inputs.block, weights, params.density, params.scale)


def ties(
    inputs: TensorInputs, block: Callable[[int], torch.Tensor], weights: torch.Tensor, density: float, scale: float
) -> torch.Tensor:
    """TIES over the row blocks ``block(i)`` of ``inputs`` (its task vectors, or DARE's dropped
    ones), in two passes: trim, weight and elect every column's sign; then, with the tensor's
    majority sign known for the columns whose kept values cancel exactly, the disjoint means. A
    tensor of one block is kept trimmed in place between the passes; a larger one is read and
    trimmed again. The chunks of a pass run on ``map_chunks`` threads."""
    rows, n, device = inputs.k, inputs.numel, inputs.device
    keep = max(1, round(density * n))
    one_block = len(inputs.blocks) == 1
    if keep < n:
        blocks = block(0) if one_block else lambda: (block(i) for i in inputs.blocks)
        threshold = kth_largest_abs(blocks, keep, n).view(-1, 1)
    else:
        threshold = torch.zeros(rows, 1, device=device)
    w = weights.to(device).view(-1, 1)
    out = torch.empty(n, dtype=torch.float32, device=device)  # the elected signs, then the merged values

    def elect(flat: torch.Tensor, start: int) -> Callable[[slice, list[torch.Tensor]], float]:
        def chunk_signs(cols: slice, buffers: list[torch.Tensor]) -> float:
            chunk = flat[:, cols]
            weighted = _weigh(_trim(chunk, threshold, _view(buffers[0], chunk)), w, _view(buffers[0], chunk))
            sign = out[start + cols.start : start + cols.stop]
            return float(torch.sign(weighted.sum(0), out=sign).sum(dtype=torch.float64))  # exact

        return chunk_signs

    def average(flat: torch.Tensor, start: int, majority: int) -> Callable[[slice, list[torch.Tensor]], None]:
        def chunk_means(cols: slice, buffers: list[torch.Tensor]) -> None:
            chunk = flat[:, cols]
            trimmed = chunk if one_block else _trim(chunk, threshold, _view(buffers[0], chunk))
            weighted = _weigh(trimmed, w, _view(buffers[0], chunk))
            sign = out[start + cols.start : start + cols.stop]
            elected = sign.square().neg_().add_(1).mul_(majority).add_(sign)  # the majority where 0
            sign.copy_(_disjoint_mean(weighted, elected, w))

        return chunk_means

    balance = 0.0  # Σ of the elected signs
    for i in inputs.blocks:
        flat = block(i)
        balance += sum(map_chunks(elect(flat, inputs.span(i).start), _chunks(flat), _scratch(flat, 1), _workers(flat)))
    majority = (balance > 0) - (balance < 0)  # 0 when the tie is a tie too
    for i in inputs.blocks:
        flat = block(i)
        map_chunks(average(flat, inputs.span(i).start, majority), _chunks(flat), _scratch(flat, 1), _workers(flat))
    return out.mul_(scale).view(inputs.shape)


def _trim(chunk: torch.Tensor, threshold: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The chunk with its entries under the threshold zeroed, in place; ``a`` is scratch."""
    torch.abs(chunk, out=a).ge_(threshold)  # 1.0 where kept
    return chunk.mul_(a)


def _weigh(trimmed: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.mul(trimmed, w, out=out)


def _disjoint_mean(weighted: torch.Tensor, elected: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ_k w_k τ̂_k [agree] / Σ_k w_k [agree] per column, where agree means kept with the elected
    sign; overwrites ``weighted``. The numerator sums the agreeing magnitudes and takes the sign
    after: the same terms in the same order as summing the signed values, so the same bits."""
    agreeing = weighted.mul_(elected).clamp_min_(0)
    numerator = agreeing.sum(0).mul_(elected)
    denominator = agreeing.gt_(0).mul_(w).sum(0).clamp_min_(torch.finfo(torch.float32).tiny)  # nobody kept: 0
    return numerator.div_(denominator)


METHOD = register(MergeMethod("ties", Params, merge=merge))
