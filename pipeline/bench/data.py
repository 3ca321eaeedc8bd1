"""``merit bench data``: encoding throughput on the built-in corpus beside the tiny model's
training rate on the same examples, in the same run. Encoding must stay well ahead of training
(target: ≥ 10× the training rate) so that it never limits training speed."""

from __future__ import annotations

import argparse
import itertools
import time

import torch

from pipeline.cli import resolve_run
from pipeline.data import Collator, EncodedDataset, Encoder, load_split, prepare_data
from pipeline.models import build_tiny_model, processor_for

BATCH = 16


def main(args: argparse.Namespace) -> None:
    cfg, run_dir = resolve_run(args)
    if cfg.model.name_or_path != "tiny":
        raise SystemExit(
            "merit bench data compares against the tiny model's training rate: use model.name_or_path=tiny"
        )
    processor = processor_for(cfg, run_dir)
    prepare_data(cfg, run_dir, processor)
    train = load_split(cfg, run_dir, "train")
    # Round-robin over sources so image and text-only examples mix as in training.
    pool = [ex for group in itertools.zip_longest(*train.values()) for ex in group if ex is not None]
    examples = (pool * (args.examples // len(pool) + 1))[: args.examples]
    uncached = [ex.__class__(**{**vars(ex), "token_ids": None}) for ex in examples]
    encoder = Encoder(processor, cfg.data.max_length)
    collate = Collator(processor.tokenizer.pad_token_id)

    _timed_encode(encoder, examples[: 4 * BATCH])  # warm-up
    cached, encoded = _timed_encode(encoder, examples)
    full, _ = _timed_encode(encoder, uncached)
    loader = torch.utils.data.DataLoader(
        EncodedDataset(examples, encoder),
        batch_size=BATCH,
        collate_fn=collate,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )
    next(iter(loader))  # start the workers before timing
    start = time.perf_counter()
    for _ in loader:
        pass
    parallel = len(examples) / (time.perf_counter() - start)
    training = _training_rate(cfg, encoded, collate, args.steps)

    tokens = sum(e.num_tokens for e in encoded) / len(encoded)
    print(f"examples: {len(examples)} ({tokens:.0f} tokens each, {len(train)} sources, batches of {BATCH})")
    print(f"encode, template + processor, 1 process: {full:8.0f} examples/s")
    print(f"encode, cached token ids, 1 process:     {cached:8.0f} examples/s")
    print(f"encode, cached, DataLoader {args.workers} workers:  {parallel:8.0f} examples/s")
    threads = torch.get_num_threads()
    print(f"tiny model training step:                {training:8.0f} examples/s  (AdamW, {threads} threads)")
    print(f"encoding / training:                     {max(cached, parallel) / training:8.1f}x  (target >= 10x)")


def _timed_encode(encoder: Encoder, examples: list) -> tuple[float, list]:
    start = time.perf_counter()
    encoded = [enc for i in range(0, len(examples), BATCH) for enc in encoder.encode_batch(examples[i : i + BATCH])]
    return len(examples) / (time.perf_counter() - start), encoded


def _training_rate(cfg, encoded: list, collate: Collator, steps: int) -> float:
    model, _ = build_tiny_model(cfg.model, cfg.run.seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [collate(encoded[i : i + BATCH]) for i in range(0, BATCH * (steps + 2), BATCH)]
    for i, batch in enumerate(batches):
        if i == 2:  # two warm-up steps, then time
            start = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return BATCH * steps / (time.perf_counter() - start)
