"""Column chunks of a (K, n) block, for passes that run chunk by chunk over preallocated
buffers (TIES, DARE, the exact k-th selection).

On a CPU a fresh (K, chunk) temporary per operation costs its page faults, and boolean masks
mixed into float arithmetic take slow type-promoting paths: a pass reuses a few flat fp32
buffers, viewed in each chunk's shape, and works in place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CPU_CHUNK_ENTRIES = 1 << 19  # entries per step on CPU: 2 MB fp32 buffers stay in cache, reused
GPU_CHUNK_ENTRIES = 1 << 25  # entries per step on a GPU: each buffer ≤ 128 MB in fp32


def chunks(flat: torch.Tensor) -> list[slice]:
    """Column blocks: small on CPU (cache, no page faults); large on a GPU, where each block costs
    kernel launches and host synchronisations, but bounded."""
    rows, n = flat.shape
    step = max(1, (CPU_CHUNK_ENTRIES if flat.device.type == "cpu" else GPU_CHUNK_ENTRIES) // rows)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def scratch(flat: torch.Tensor, count: int) -> Callable[[], list[torch.Tensor]]:
    """A maker of ``count`` flat fp32 buffers, each as large as ``flat``'s largest chunk."""
    width = max((c.stop - c.start for c in chunks(flat)), default=0)
    return lambda: [torch.empty(flat.shape[0] * width, device=flat.device) for _ in range(count)]


def view(buffer: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """A contiguous view of ``buffer`` in ``chunk``'s shape: the reductions over K then run as
    they did on freshly allocated temporaries (the same summation order, so the same bits)."""
    return buffer[: chunk.numel()].view(chunk.shape)


def workers(x: torch.Tensor) -> int:
    """Threads for the chunked passes: this thread's torch threads on CPU; one on a GPU."""
    return torch.get_num_threads() if x.device.type == "cpu" else 1
