"""The exact k-th largest |x| of every row of a (K, n) fp32 block: the trim threshold of TIES.

For a block held whole the value is bracketed from a strided sample and pinned down in one pass
that counts what lies above the bracket and keeps what lies inside it (about 2 % of the entries);
a bracket that misses (a sample unlike the rest) falls back to a radix select on the float bits:
two histogram passes, no sort. A block too large to hold is read in column blocks by the radix
select. ``torch.kthvalue`` gives the same values (it is the tests' reference) but sorts a copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from pipeline.merge.chunks import chunks, scratch, view, workers
from pipeline.threads import map_chunks

SAMPLE = 1 << 16  # entries per row of the strided sample that brackets the threshold
SPREAD = 6.0  # bracket half-width in standard deviations of the sample's rank
MAX_INSIDE = 0.25  # share of a sampled row inside the bracket above which the radix select runs instead


def kth_largest_abs(blocks: torch.Tensor | Callable[[], Iterable[torch.Tensor]], k: int, n: int = 0) -> torch.Tensor:
    """Exact k-th largest |x| of every row of a (K, n) fp32 tensor (1 ≤ k ≤ n); ``blocks`` is the
    tensor, or a function yielding its n columns as blocks in order, once per pass (a tensor too
    large to hold is read block by block, twice, by the radix select)."""
    if isinstance(blocks, torch.Tensor):
        tensor, n = _floats(blocks), blocks.shape[1]
        # Short rows: a select costs less than the bracket's fixed cost (the two costs meet near
        # 2^18 entries a row; at 2^19, 8 rows: 34 ms against 16 ms, a 3B model's k_proj).
        if n < 1 << 18:
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
        a, over, within = (view(b, x[:, cols]) for b in buffers)  # float indicators: faster than bool
        torch.abs(x[:, cols], out=a)
        above = torch.gt(a, hi, out=over).sum(1)
        within = torch.ge(a, lo, out=within).sub_(over)  # lo ≤ |x| ≤ hi
        return above, within.sum(1), _selected(a, within.bool())

    parts = map_chunks(count, chunks(x), scratch(x, 3), workers(x))
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


def _selected(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x[mask]``. On a CPU through NumPy, whose boolean indexing took 0.2 ms where torch's took
    0.9 ms on a chunk of 0.5 M entries with 2 % kept: the pass over an (8, 11.5 M) block went
    from 183 to 145 ms."""
    if x.device.type != "cpu":
        return x[mask]
    return torch.from_numpy(x.numpy()[mask.numpy()])


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
        for cols in chunks(block):
            bits = _floats(block[:, cols]).abs().view(torch.int32) >> 16
            high += torch.bincount((bits + offsets * (1 << 15)).view(-1), minlength=high.numel())
    bucket, k_in = _select(high.view(rows, -1), torch.full((rows,), k, device=device))
    low = torch.zeros(rows * (1 << 16), dtype=torch.int64, device=device)
    for block in blocks():
        for cols in chunks(block):
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
