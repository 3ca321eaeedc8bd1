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


L1_EPS = 1e-7  # a norm under this is not rescaled (mergekit's)


class Sparsified:
    """The row blocks of ``inputs`` sparsified as they are read. A tensor of one block is
    sparsified once and kept: its raw block no longer exists. With ``l1`` each τ̃_k is rescaled to
    its τ_k's L1 norm over the whole tensor (mergekit's rescale): a tensor of several blocks is read
    once more first, to sum both norms."""

    def __init__(self, inputs: TensorInputs, sparsify: Sparsifier, l1: bool = False):
        self.inputs, self.sparsify, self.l1, self.kept, self.factors = inputs, sparsify, l1, None, None

    def __call__(self, i: int) -> torch.Tensor:
        if self.kept is not None:
            return self.kept
        one_block = len(self.inputs.blocks) == 1
        if self.l1 and self.factors is None and not one_block:  # the norms over every block first
            before = after = 0
            for j in self.inputs.blocks:
                _, b, a = self._norms(j)
                before, after = before + b, after + a
            self.factors = _l1_factors(before, after)
        block, before, after = self._norms(i)
        if self.l1:
            block.mul_(_l1_factors(before, after) if one_block else self.factors)
        if one_block:
            self.inputs.forget()
            self.kept = block
        return block

    def _norms(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Block i sparsified, with each row's L1 norm before and after (with ``l1``)."""
        block = self.inputs.block(i)
        before = block.abs().sum(1, dtype=torch.float64, keepdim=True) if self.l1 else None
        self.sparsify(block, i)
        after = block.abs().sum(1, dtype=torch.float64, keepdim=True) if self.l1 else None
        return block, before, after


def _l1_factors(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """(K, 1) factors ‖τ_k‖₁ / ‖τ̃_k‖₁, 1 where either norm is about 0."""
    small = (before < L1_EPS) | (after < L1_EPS)
    return torch.where(small, 1.0, before / after.clamp_min(L1_EPS)).float()


def combine(
    inputs: TensorInputs,
    blocks: Callable[[int], torch.Tensor],
    weights: torch.Tensor,
    scale: float,
    consensus: bool,
    normalize: bool = True,
    density: float | list[float] = 1.0,
) -> torch.Tensor:
    """The merged task vector of the sparsified ``blocks``: λ Σ_k w_k τ̃_k, or with ``consensus``
    TIES on them (trimmed further to ``density``)."""
    if consensus:
        return ties.ties(inputs, blocks, weights, density, scale, normalize)
    w = weights.to(inputs.device) * scale
    return inputs.elementwise(lambda block, i: w @ block, blocks)
