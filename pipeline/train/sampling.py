"""The data order: a pure function of (seed, step), so a resumed run sees exactly the batches
an uninterrupted one would have, with no sampler state to checkpoint. Packed micro batches
(``pipeline.train.packing``) by default; padded ones of a fixed number of examples here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.config import TrainSection
from pipeline.data import Collator, Encoder, Example, load_split
from pipeline.data.packed import PackedCollator
from pipeline.data.store import StoredExamples
from pipeline.models.loading import model_config
from pipeline.train.packing import PackOrder


class BatchOrder:
    """Example ids for every step: the branch's examples in a seeded permutation per epoch, read
    in order, so an epoch draws every example exactly once (without replacement) and sources
    appear in proportion to their examples. Epoch e's permutation depends only on (seed, e)."""

    def __init__(self, examples: int, seed: int):
        if examples < 1:
            raise ValueError("a branch needs at least one training example")
        self.examples, self.seed = examples, seed
        self._recent: dict[int, np.ndarray] = {}

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._recent:
            if len(self._recent) >= 2:  # steps move forward: the oldest epoch is done with
                del self._recent[min(self._recent)]
            self._recent[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.examples)
        return self._recent[epoch]

    def global_batch(self, step: int, size: int) -> np.ndarray:
        positions = np.arange(step * size, (step + 1) * size)
        epochs, within = np.divmod(positions, self.examples)
        return np.concatenate([self._permutation(int(e))[within[epochs == e]] for e in np.unique(epochs)])

    def rank_batches(self, step: int, micro_batch: int, grad_accum: int, rank: int, world: int) -> list[np.ndarray]:
        """This rank's micro batches for ``step``: rank r takes every world-th micro batch."""
        ids = self.global_batch(step, micro_batch * grad_accum * world).reshape(grad_accum * world, micro_batch)
        return [ids[m * world + rank] for m in range(grad_accum)]


@dataclass
class BranchData:
    """A branch's training examples (flat, in ``spec.sources`` order; only its group's rows, never
    the corpus), their order (packed micro
    batches of ``train.max_tokens``, or padded ones of ``train.micro_batch`` examples), and the
    encoder and collator that turn them into batches."""

    examples: StoredExamples  # read from the prepared store when drawn
    order: BatchOrder | PackOrder
    encoder: Encoder
    collator: Collator | PackedCollator
    train: TrainSection

    @classmethod
    def for_branch(cls, spec: Any, processor: Any) -> BranchData:
        cfg, t = spec.config, spec.train
        by_source = load_split(cfg, spec.run_dir, "train", spec.sources)
        examples = StoredExamples.joined([by_source[name] for name in spec.sources])
        if spec.shard:
            examples = examples[spec.shard[0] :: spec.shard[1]]
        if t.packing:
            order = PackOrder(examples.lengths(), t.max_tokens, t.packing_window, cfg.run.seed)
            collator = PackedCollator(model_config(spec.init, cfg.model))
        else:
            order, collator = BatchOrder(len(examples), cfg.run.seed), Collator(processor.tokenizer.pad_token_id)
        return cls(examples, order, Encoder(processor, cfg.data.max_length), collator, t)

    def micro_batches(self, step: int, rank: int = 0, world: int = 1) -> list[list[Example]]:
        """This rank's micro batches of ``step``, as examples."""
        t = self.train
        if isinstance(self.order, PackOrder):
            batches = self.order.rank_batches(step, t.grad_accum, rank, world)
        else:
            batches = self.order.rank_batches(step, t.micro_batch, t.grad_accum, rank, world)
        return [[self.examples[i] for i in ids.tolist()] for ids in batches]
