"""Generalised task arithmetic, mergekit's name for a family: each τ_k is sparsified on its own
(DARE's random drop, Breadcrumbs' magnitude band, DELLA's ranked drop), then the survivors are
combined linearly, θ0 + λ Σ_k w_k τ̃_k, or by TIES's sign consensus (a disjoint mean, or with
``normalize: false`` a disjoint sum). A sparsifier masks a block of task vectors in place and
must give the same mask every time a block is read (a tensor larger than the block budget is
read once per pass): its randomness is seeded by the tensor and the entries' positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipeline.merge.inputs import TensorInputs
from pipeline.merge.methods import ties

Sparsifier = Callable[[torch.Tensor, int], None]  # (block i's (K, n_i) task vectors, i): masks in place


class Sparsified:
    """The row blocks of ``inputs`` sparsified as they are read. A tensor of one block is
    sparsified once and kept: its raw block no longer exists."""

    def __init__(self, inputs: TensorInputs, sparsify: Sparsifier):
        self.inputs, self.sparsify, self.kept = inputs, sparsify, None

    def __call__(self, i: int) -> torch.Tensor:
        if self.kept is not None:
            return self.kept
        block = self.inputs.block(i)
        self.sparsify(block, i)
        if len(self.inputs.blocks) == 1:
            self.inputs.forget()
            self.kept = block
        return block


def combine(
    inputs: TensorInputs,
    blocks: Callable[[int], torch.Tensor],
    weights: torch.Tensor,
    scale: float,
    consensus: bool,
    normalize: bool = True,
    density: float = 1.0,
) -> torch.Tensor:
    """The merged task vector of the sparsified ``blocks``: λ Σ_k w_k τ̃_k, or with ``consensus``
    TIES on them (trimmed further to ``density``)."""
    if consensus:
        return ties.ties(inputs, blocks, weights, density, scale, normalize)
    w = weights.to(inputs.device) * scale
    return inputs.elementwise(lambda block, i: w @ block, blocks)
