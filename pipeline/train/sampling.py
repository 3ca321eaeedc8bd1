"""The data order: a pure function of (seed, step), so a resumed run sees exactly the batches
an uninterrupted one would have, with no sampler state to checkpoint."""

from __future__ import annotations

import numpy as np


class BatchOrder:
    """Example ids (positions in a flat list over the branch's sources) for every step.

    ``tokens``: a source is drawn with probability proportional to its training tokens, then an
    example uniformly inside it; ``uniform``: examples uniformly over all sources.
    """

    def __init__(self, sizes: list[int], tokens: list[int], sampling: str, seed: int):
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])
        self.sizes, self.seed = np.asarray(sizes), seed
        weights = np.asarray(tokens if sampling == "tokens" else sizes, dtype=np.float64)
        self.source_p = weights / weights.sum()

    def global_batch(self, step: int, size: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        sources = rng.choice(len(self.sizes), size=size, p=self.source_p)
        within = (rng.random(size) * self.sizes[sources]).astype(np.int64)
        return self.offsets[sources] + within

    def rank_batches(self, step: int, micro_batch: int, grad_accum: int, rank: int, world: int) -> list[np.ndarray]:
        """This rank's micro batches for ``step``: rank r takes every world-th micro batch."""
        ids = self.global_batch(step, micro_batch * grad_accum * world).reshape(grad_accum * world, micro_batch)
        return [ids[m * world + rank] for m in range(grad_accum)]
