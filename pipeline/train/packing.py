"""The packed data order: micro batches as token budgets, a pure function of (seed, step).

Each epoch draws the branch's examples in a seeded permutation, as the padded order does, and
packs them first-fit, one window of ``window`` examples at a time, into micro batches of at most
``budget`` tokens: an example goes into the first open micro batch of its window it fits in, or
opens a new one. The micro batches of a window keep the order they were opened in, so the data
order stays the permutation's up to the window, every example is in exactly one micro batch per
epoch, and a window is packed as tightly as first-fit packs items of ~1/10 of the budget (about 95 %
full here). The micro batches of all epochs form one sequence; step ``s`` of rank ``r`` takes its
``grad_accum`` micro batches from it as the padded order takes examples (rank r every world-th), so
a resumed run starts on the same batches with no sampler state to checkpoint.
"""

from __future__ import annotations

import numpy as np


def first_fit(lengths: np.ndarray, budget: int) -> list[np.ndarray]:
    """Positions of ``lengths`` in micro batches of at most ``budget`` tokens, first-fit in order."""
    room = np.empty(len(lengths), dtype=np.int64)  # free tokens of each micro batch opened so far
    packs: list[list[int]] = []
    first_open = 0  # micro batches before it have no room for even the shortest example
    shortest = int(lengths.min()) if len(lengths) else 0
    for position, length in enumerate(lengths.tolist()):
        fits = np.flatnonzero(room[first_open : len(packs)] >= length)
        if len(fits):
            pack = first_open + int(fits[0])
            room[pack] -= length
            packs[pack].append(position)
        else:
            room[len(packs)] = budget - length
            packs.append([position])
        while first_open < len(packs) and room[first_open] < shortest:
            first_open += 1
    return [np.array(p, dtype=np.int64) for p in packs]


class PackOrder:
    """Micro batches (arrays of example indices) of every epoch and step."""

    def __init__(self, lengths: np.ndarray, budget: int, window: int, seed: int):
        if len(lengths) < 1:
            raise ValueError("a branch needs at least one training example")
        if (longest := int(lengths.max())) > budget:
            raise ValueError(f"an example of {longest} tokens does not fit a micro batch of {budget}")
        self.lengths, self.budget, self.window, self.seed = np.asarray(lengths), budget, window, seed
        self._recent: dict[int, list[np.ndarray]] = {}
        self._counts: list[int] = []  # micro batches of epochs 0, 1, …, as far as computed

    def epoch(self, epoch: int) -> list[np.ndarray]:
        """The micro batches of ``epoch``, in order."""
        if epoch not in self._recent:
            if len(self._recent) >= 2:  # steps move forward: the oldest epoch is done with
                del self._recent[min(self._recent)]
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.lengths))
            self._recent[epoch] = [
                chunk[pack]
                for start in range(0, len(order), self.window)
                for chunk in [order[start : start + self.window]]
                for pack in first_fit(self.lengths[chunk], self.budget)
            ]
        return self._recent[epoch]

    def per_epoch(self) -> int:
        """Micro batches in an epoch (epoch 0's count: another permutation may pack into one more
        or fewer, as a padded epoch's last step borrows from the next epoch)."""
        return self._count(0)

    def _count(self, epoch: int) -> int:
        while len(self._counts) <= epoch:
            self._counts.append(len(self.epoch(len(self._counts))))
        return self._counts[epoch]

    def micro_batches(self, first: int, count: int) -> list[np.ndarray]:
        """Micro batches ``first`` … ``first + count - 1`` of the sequence over all epochs."""
        out, epoch, start = [], 0, 0
        while len(out) < count:
            size = self._count(epoch)
            if first + len(out) < start + size:
                out.append(self.epoch(epoch)[first + len(out) - start])
            else:
                epoch, start = epoch + 1, start + size
        return out

    def rank_batches(self, step: int, grad_accum: int, rank: int, world: int) -> list[np.ndarray]:
        """This rank's micro batches for ``step``: rank r takes every world-th of the step's."""
        step_batches = self.micro_batches(step * grad_accum * world, grad_accum * world)
        return [step_batches[m * world + rank] for m in range(grad_accum)]
