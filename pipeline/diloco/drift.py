"""How far the workers drifted apart in a round: the norms of their pseudo-gradients Δ_k and
their mean pairwise cosine, accumulated tensor by tensor (a K × K Gram matrix, in float64), so
the whole Δ_k never needs to be in memory at once."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class DriftMeter:
    def __init__(self, workers: int):
        self.gram = torch.zeros(workers, workers, dtype=torch.float64)

    def add(self, tensors: Sequence[torch.Tensor]) -> None:
        """One tensor's Δ_k of every worker."""
        flat = torch.stack([t.reshape(-1).float() for t in tensors])
        self.gram += (flat @ flat.T).double()

    def norms(self) -> list[float]:
        return self.gram.diagonal().sqrt().tolist()

    def mean_cosine(self) -> float | None:
        """Mean cosine over worker pairs (None with one worker)."""
        k = len(self.gram)
        if k < 2:
            return None
        n = self.gram.diagonal().sqrt().clamp_min(1e-30)
        cos = self.gram / (n[:, None] * n[None, :])
        return float((cos.sum() - cos.diagonal().sum()) / (k * (k - 1)))
