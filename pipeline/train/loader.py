"""Step batches, encoded ahead of the step that trains on them.

One item is one optimizer step of one rank: its micro batches, encoded and collated (packed rows,
or padded batches), with their token, example and position counts. A ``DataLoader`` over step
numbers runs the encoding (the image processor, most of the cost) and the packing (positions,
boundaries, supervised indices) in ``train.loader_workers`` processes, ``PREFETCH`` steps ahead, so
the rank only waits for the encoder when the encoder is slower than the step; the wait is measured
and logged (``data_wait_s`` in ``metrics.jsonl``). The batches are a function of the step alone
(``PackOrder``, ``BatchOrder``), so a resumed run simply starts the loader at its step.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from PIL import Image

from pipeline.config import TrainSection
from pipeline.data import IGNORE_INDEX, Encoded, Encoder, Example
from pipeline.train.sampling import BranchData

PREFETCH = 2  # steps each worker keeps ready


@dataclass
class StepBatch:
    step: int
    micro: list[dict[str, Any]]  # collated micro batches of this rank
    tokens: int  # input tokens of this rank's examples (padding and filler excluded)
    supervised: list[int]  # tokens that carry a label, per micro batch
    examples: int  # this rank's examples
    positions: int  # positions the model runs: tokens, padding and filler

    def pin_memory(self) -> StepBatch:  # called by the DataLoader's pinning thread on GPUs
        pinned = [{k: v.pin_memory() if torch.is_tensor(v) else v for k, v in m.items()} for m in self.micro]
        return replace(self, micro=pinned)


class StepBatches(torch.utils.data.Dataset):
    """Step ``s`` → this rank's :class:`StepBatch` for ``s``."""

    def __init__(
        self, data: BranchData, train: TrainSection, rank: int, world: int, pixel_dtype: torch.dtype = torch.float32
    ):
        self.data, self.train, self.rank, self.world = data, train, rank, world
        self.filler = image_filler(data.encoder) if world > 1 else None
        # Images travel from the workers in the model's dtype: the vision tower casts them to it
        # first thing anyway, and in bf16 a step of 448 px images is half the bytes to hand over.
        self.pixel_dtype = pixel_dtype

    def __len__(self) -> int:
        return self.train.steps

    def __getitem__(self, step: int) -> StepBatch:
        micro, tokens, supervised, examples, positions = [], 0, [], 0, 0
        for group in self.data.micro_batches(step, self.rank, self.world):
            encoded = self.data.encoder.encode_batch(group)
            tokens += sum(e.num_tokens for e in encoded)
            examples += len(encoded)
            if self.filler is not None and all(e.pixel_values is None for e in encoded):
                encoded.append(self.filler)
            batch = self.data.collator(encoded)
            supervised.append(len(batch["loss_positions"]))
            positions += batch["input_ids"].numel()
            if "pixel_values" in batch:
                batch["pixel_values"] = batch["pixel_values"].to(self.pixel_dtype)
            micro.append(batch)
        return StepBatch(step, micro, tokens, supervised, examples, positions)


def step_batches(batches: StepBatches, start: int, pin_memory: bool) -> Iterator[StepBatch]:
    """The step batches from ``start`` to the last step, prefetched by worker processes and handed
    over in a thread of this process: receiving a step's tensors from a worker costs ~0.5 ms each
    (~12 ms for a step of 4 micro batches), which the thread does while the previous step trains."""
    workers = batches.train.loader_workers
    loader = torch.utils.data.DataLoader(
        batches,
        batch_size=None,  # one item is already a whole step
        sampler=range(start, len(batches)),
        num_workers=workers,
        prefetch_factor=PREFETCH if workers else None,
        pin_memory=pin_memory,
    )
    return _ahead(iter(loader), depth=PREFETCH)


def _ahead(items: Iterator[StepBatch], depth: int) -> Iterator[StepBatch]:
    """``items``, read up to ``depth`` ahead by a daemon thread; its exception is raised here."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def read() -> None:
        try:
            for item in items:
                ready.put(item)
            ready.put(done)
        except BaseException as err:  # raised in the reading thread: handed to the rank below
            ready.put(err)

    threading.Thread(target=read, daemon=True).start()
    while (item := ready.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


def image_filler(encoder: Encoder) -> Encoded:
    """An example with one small image and no labels, added to a micro batch that has no image
    when several ranks train. Without it that rank would skip the vision tower: ZeRO-2's gradient
    buckets then differ between ranks (gloo aborts on the collective mismatch) and ZeRO-3, which
    gathers each module's weights collectively, hangs. Without labels it changes no loss and no
    gradient value; it only keeps every rank running the same modules in the same order."""
    messages = [
        {"role": "user", "content": [{"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": ""}]},
    ]
    filler = encoder(Example("filler", 0, "filler", messages, [Image.new("RGB", (56, 56))]))
    filler.labels.fill_(IGNORE_INDEX)
    return filler
