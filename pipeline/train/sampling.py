"""The data order: a pure function of (seed, step), so a resumed run sees exactly the batches
an uninterrupted one would have, with no sampler state to checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.data import Collator, Encoder, Example, load_split, read_manifest


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


@dataclass
class BranchData:
    """A branch's training examples (flat, in ``spec.sources`` order), their order, and the
    encoder and collator that turn them into batches."""

    examples: list[Example]
    order: BatchOrder
    encoder: Encoder
    collator: Collator

    @classmethod
    def for_branch(cls, spec: Any, processor: Any) -> BranchData:
        cfg = spec.config
        by_source = load_split(cfg, spec.run_dir, "train", spec.sources)
        manifest = read_manifest(spec.run_dir)["sources"]
        order = BatchOrder(
            [len(by_source[n]) for n in spec.sources],
            [manifest[n]["train_tokens"] for n in spec.sources],
            spec.train.sampling,
            cfg.run.seed,
        )
        return cls(
            [ex for name in spec.sources for ex in by_source[name]],
            order,
            Encoder(processor, cfg.data.max_length),
            Collator(processor.tokenizer.pad_token_id),
        )

    def micro_batches(
        self, step: int, micro_batch: int, grad_accum: int, rank: int = 0, world: int = 1
    ) -> list[list[Example]]:
        """This rank's micro batches of ``step``, as examples."""
        return [
            [self.examples[i] for i in ids.tolist()]
            for ids in self.order.rank_batches(step, micro_batch, grad_accum, rank, world)
        ]
