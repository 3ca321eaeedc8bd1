"""The inputs of one tensor's merge, read lazily and in bounded memory.

:class:`TensorInputs` holds K readers (one per model, or per DiLoCo pseudo-gradient), θ0's
reader and, for the Fisher merge, K readers of Fisher values. A reader returns rows
``[start, stop)`` of a stored tensor as stored (a safetensors slice: only those bytes are read),
or, for an input marked as a delta (a LoRA adapter, ``pipeline.merge.adapter``), rows of τ_k itself.
Methods see the inputs through four views, each in fp32 on the compute device:

- ``combine(c, c0)``: Σ_k c_k x_k + c0 θ0, one input at a time (averages, Iso-C's mean);
- ``task(k)``: τ_k = x_k − θ0, whole, one at a time (TSV, Iso-CTS);
- ``block(i)``: the (K, n_i) task vectors of row block i (element-wise methods: TIES, DARE,
  Fisher), whose fp32 size with θ0's rows stays under ``block_bytes``; a tensor that fits is one
  block, read once and kept; a larger one (the 7B embedding: 545 M entries × K = 8 is 17 GB in
  fp32) is read block by block, once per pass of the method;
- ``fisher_block(i)``: the Fisher values of the same rows.

So a merge holds at most one input tensor, θ0's and the output whole, plus one block: its peak
memory grows with K only through the block, which the budget bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from pipeline.merge.chunks import chunks, workers
from pipeline.merge.io import MergeInputError
from pipeline.threads import map_chunks

Reader = Callable[[int, int], torch.Tensor]  # rows [start, stop) of one input tensor, as stored


def rows_of(shape: Sequence[int]) -> tuple[int, int]:
    """(rows, entries per row): blocks are whole rows of the first dimension."""
    return (shape[0], math.prod(shape[1:])) if shape else (1, 1)


def finite(tensor: torch.Tensor) -> bool:
    """No NaN or Inf: the sum first (one cheap reduction), the entries only when the sum is not
    (a finite tensor whose sum overflows is finite)."""
    return bool(torch.isfinite(tensor.sum()) or torch.isfinite(tensor).all())


def tensor_reader(tensor: torch.Tensor) -> Reader:
    """A reader over a tensor already in memory."""
    flat = tensor.reshape(rows_of(tensor.shape))
    return lambda start, stop: flat[start:stop]


class Workspace:
    """Scratch space reused from block to block and tensor to tensor within one merge:
    allocating (K, n) fresh every time costs a page fault per 4 KiB, as much as the merge
    arithmetic itself on CPU. Owned by one merge (never shared between threads)."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.device: str | None = None  # as asked ("cuda" is cuda:0 once allocated: compare the request)

    def get(self, numel: int, device: str) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < numel or self.device != device:
            self.buffer = None
            self.buffer, self.device = torch.empty(numel, dtype=torch.float32, device=device), device
        return self.buffer[:numel]


class TensorInputs:
    def __init__(
        self,
        name: str,
        shape: Sequence[int],
        inputs: Sequence[Reader],
        labels: Sequence[str],
        base: Reader | None = None,
        base_label: str = "base model",
        device: str = "cpu",
        block_bytes: int = 1 << 30,
        workspace: Workspace | None = None,
        fishers: Sequence[Reader] | None = None,
        deltas: Sequence[bool] | None = None,
    ):
        self.name, self.shape, self.device, self.block_bytes = name, tuple(shape), device, block_bytes
        self.inputs, self.labels, self.base, self.base_label = list(inputs), list(labels), base, base_label
        # Inputs whose reader gives τ_k itself (a LoRA adapter's B A), not a model's θ_k.
        self.deltas = list(deltas) if deltas is not None else [False] * len(self.inputs)
        self.fishers, self.workspace = fishers, workspace or Workspace()
        rows, per_row = rows_of(self.shape)
        # fp32 rows a block holds: the K task vectors and θ0's, and with Fisher values their K rows
        # and the product of the two.
        slots = len(self.inputs) + 1 + (2 * len(fishers) if fishers else 0)
        step = max(1, block_bytes // (4 * slots * max(per_row, 1)))
        self.row_blocks = [(a, min(a + step, rows)) for a in range(0, rows, step)]
        self.per_row = per_row
        self._kept: tuple[int, torch.Tensor] | None = None  # the one block of a tensor that fits

    @property
    def k(self) -> int:
        return len(self.inputs)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def blocks(self) -> range:
        return range(len(self.row_blocks))

    def span(self, i: int) -> slice:
        """Block i's entries in the flattened tensor."""
        a, b = self.row_blocks[i]
        return slice(a * self.per_row, b * self.per_row)

    def _read(self, reader: Reader, label: str, start: int, stop: int, check: bool = True) -> torch.Tensor:
        tensor = reader(start, stop).to(self.device)  # moved in the stored dtype (bf16: half the bytes)
        if check and tensor.is_floating_point() and not finite(tensor):
            raise MergeInputError(f"{label}: tensor {self.name} contains NaN or Inf")
        return tensor

    def _whole(self, reader: Reader, label: str, check: bool = True) -> torch.Tensor:
        return self._read(reader, label, 0, rows_of(self.shape)[0], check).reshape(self.shape)

    def base_tensor(self) -> torch.Tensor:
        return self._whole(self.base, self.base_label)

    def combine(self, coefficients: Sequence[float], base_coefficient: float = 0.0) -> torch.Tensor:
        """Σ_k c_k x_k + c0 θ0 in fp32, one input at a time, x_k = θ0 + τ_k for a task-vector
        input; θ0 is read only when its coefficient is not 0."""
        base_coefficient += sum(c for c, delta in zip(coefficients, self.deltas) if delta)
        with_base = self.base is not None and base_coefficient
        out = None
        # The inputs are checked through the sum: a NaN or Inf in any of them (even at
        # coefficient 0: 0 · Inf is NaN) leaves one in it. Checking each input instead costs one
        # more pass over all of them; the one at fault is found after, when there is one.
        for c, reader, label in zip(coefficients, self.inputs, self.labels):
            x = self._whole(reader, label, check=False)
            # The first input is scaled into a new tensor (never in place: it may be the caller's).
            out = torch.mul(x.to(torch.float32), c) if out is None else out.add_(x, alpha=c)
        if with_base:
            out.add_(self._whole(self.base, self.base_label, check=False), alpha=base_coefficient)
        if not finite(out):
            read = [*zip(self.inputs, self.labels), *([(self.base, self.base_label)] if with_base else [])]
            for reader, label in read:
                self._whole(reader, label)  # raises for the first input with a NaN or Inf
            raise MergeInputError(f"tensor {self.name}: the merged values overflow float32")
        return out

    def mean(self, weights: torch.Tensor) -> torch.Tensor:
        """Σ_k w_k τ_k (weights summing to 1): Σ_k w_k x_k − θ0."""
        return self.combine(weights.tolist(), -1.0 if self.base is not None else 0.0)

    def task(self, k: int) -> torch.Tensor:
        """τ_k = x_k − θ0, whole, in fp32."""
        x = self._whole(self.inputs[k], self.labels[k]).to(torch.float32, copy=True)  # never the caller's tensor
        return x.sub_(self.base_tensor()) if self.base is not None and not self.deltas[k] else x

    def block(self, i: int) -> torch.Tensor:
        """The (K, n_i) fp32 task vectors of block i: scratch space, which a method may overwrite
        (then it must not ask for the block again). Built column chunk by column chunk: each
        input's entries copied in, θ0's subtracted and the result checked while the chunk is in
        cache (whole rows copied, then subtracted, then checked took three passes over the block
        in memory; on a CPU the inputs are memory-map views, so this is their only copy)."""
        if self._kept is not None and self._kept[0] == i:
            return self._kept[1]
        a, b = self.row_blocks[i]
        n = (b - a) * self.per_row
        stack = self.workspace.get(self.k * n, self.device).view(self.k, n)
        sources = [reader(a, b).reshape(-1) for reader in self.inputs]  # as stored, where stored
        models = [k for k, delta in enumerate(self.deltas) if not delta] if self.base is not None else []
        base = self.base(a, b).reshape(-1) if models else None

        def fill(cols: slice, _: list[torch.Tensor]) -> None:
            chunk = stack[:, cols]
            for row, source in zip(chunk, sources):
                row.copy_(source[cols])
            if base is not None:
                theta0 = base[cols].to(self.device)
                if len(models) == self.k:
                    chunk.sub_(theta0)
                else:
                    for k in models:
                        chunk[k].sub_(theta0)
            if not finite(chunk):
                self._blame(sources, base, cols)

        map_chunks(fill, chunks(stack), list, workers(stack))
        if len(self.row_blocks) == 1:
            self._kept = (i, stack)
        return stack

    def _blame(self, sources: list[torch.Tensor], base: torch.Tensor | None, cols: slice) -> None:
        """Raise for the input (or θ0) whose entries ``cols`` hold a NaN or Inf; if none does, the
        task vectors overflow float32."""
        for source, label in [*zip(sources, self.labels), (base, self.base_label)]:
            if source is not None and not finite(source[cols]):
                raise MergeInputError(f"{label}: tensor {self.name} contains NaN or Inf")
        raise MergeInputError(f"tensor {self.name}: a task vector (θ_k − θ0) overflows float32")

    def base_block(self, i: int) -> torch.Tensor | None:
        """θ0's entries of block i, flat, as stored (None without a base)."""
        if self.base is None:
            return None
        a, b = self.row_blocks[i]
        return self._read(self.base, self.base_label, a, b).reshape(-1)

    def forget(self) -> None:
        """Drop the kept block (after a method overwrote it): the next ``block`` reads again."""
        self._kept = None

    def fisher_block(self, i: int) -> torch.Tensor | None:
        """The (K, n_i) Fisher values of block i; None when the Fisher files lack this tensor."""
        if self.fishers is None:
            return None
        a, b = self.row_blocks[i]
        rows = [self._read(f, f"Fisher of {label}", a, b) for f, label in zip(self.fishers, self.labels)]
        return torch.stack([r.reshape(-1).float() for r in rows])

    def elementwise(
        self, fn: Callable[[torch.Tensor, int], torch.Tensor], block: Callable[[int], torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The merged tensor of an element-wise method: ``fn(block(i), i)`` gives block i's (n_i,)
        entries; ``block`` defaults to the task vectors' (DARE passes its dropped ones)."""
        out = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        for i in self.blocks:
            out[self.span(i)] = fn((block or self.block)(i), i)
        return out.view(self.shape)
