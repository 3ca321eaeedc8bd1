"""``merit bench data``: encoding throughput on the built-in corpus beside the tiny model's
training rate on the same examples, in the same run. Encoding must stay well ahead of training
(target: ≥ 10× the training rate) so that it never limits training speed.

Then the trainer's own step loader (``pipeline.train.loader``: a rank's micro batches of a step,
encoded by ``train.loader_workers`` processes ahead of the step) against a training step that
lasts as long as a real model's: ``--like configs/qwen2_5_vl_3b.yaml`` takes that config's image
sizes, batch and loader workers, and a step lasts its FLOPs, 6 · N · tokens, at ``--mfu`` of
``--peak-tflops`` (a GPU step leaves the CPU to the encoders, so it is slept here). The figure
that matters is how long the rank waits for its next batch once the pipeline has filled. Last,
``--pack N`` times the first-fit packer over an epoch of N examples of the prepared corpus's
lengths (default a million) at the config's token budget.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time

import numpy as np
import torch

from merit.cli import add_run_options, resolve_run
from pipeline.config import RunConfig, load_config
from pipeline.data import Collator, EncodedDataset, Encoder, load_split, prepare_data
from pipeline.layout import base_path, bench_dir
from pipeline.models import build_tiny_model, init_model, processor_for
from pipeline.models.loading import DTYPES
from pipeline.train import BranchSpec
from pipeline.train.loader import StepBatches, step_batches
from pipeline.train.packing import PackOrder
from pipeline.train.plan import all_sources
from pipeline.train.sampling import BranchData

BATCH = 16


# How another config's branches batch and run their steps (benchmarks take them with --like).
BATCH_KEYS = ("packing", "max_tokens", "packing_window", "micro_batch", "grad_accum", "gradient_checkpointing")
BATCH_KEYS += ("loader_workers", "packed_attention", "liger_kernel", "fused_optimizer")


def like(path: str) -> list[str]:
    """Overrides that give a run another config's image sizes, example length, frozen parts, batch
    and loader workers."""
    other = load_config(path)
    side = math.isqrt(other.model.min_pixels)
    return [
        f"model.min_pixels={other.model.min_pixels}",
        f"model.max_pixels={other.model.max_pixels}",
        f"data.builtin.image_size={side}",  # drawn at the smallest size the processor keeps as it is
        f"model.dtype={other.model.dtype}",  # the images reach the rank in it
        f"model.freeze.freeze_vision_tower={other.model.freeze.freeze_vision_tower}",
        f"model.freeze.freeze_multi_modal_projector={other.model.freeze.freeze_multi_modal_projector}",
        f"data.max_length={other.data.max_length}",
        *(f"train.{key}={getattr(other.train, key)}" for key in BATCH_KEYS),
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_options(parser)
    parser.add_argument("--examples", type=int, default=1024, help="examples to encode")
    parser.add_argument("--steps", type=int, default=10, help="training steps timed for the reference rate")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    parser.add_argument("--like", help="a config whose image sizes, batch and loader workers the step loader takes")
    parser.add_argument("--step-seconds", type=float, help="simulated training step (default: from the FLOPs below)")
    parser.add_argument("--model-params", type=float, default=3.75e9, help="parameters of the simulated model")
    parser.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation of the simulated step")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the simulated device's peak")
    parser.add_argument(
        "--pack", type=int, default=10**6, metavar="N", help="examples in the packed epoch timed (0: none)"
    )


def main(args: argparse.Namespace) -> None:
    if args.like:
        args.overrides = [*like(args.like), *args.overrides]  # the command line's own --set win
    cfg, run_dir = resolve_run(args)
    if cfg.model.name_or_path != "tiny":
        raise SystemExit(
            "merit bench data compares against the tiny model's training rate: use model.name_or_path=tiny"
        )
    init_model(cfg, run_dir)  # the step loader's packed rows read θ0's config
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
    _step_loader(cfg, run_dir, processor, args)
    if args.pack:
        _packing(cfg, [len(ex.token_ids) for exs in train.values() for ex in exs], args.pack)


def _packing(cfg: RunConfig, lengths: list[int], n: int) -> None:
    """How long the first-fit packer takes over an epoch of ``n`` examples, their lengths drawn
    (seeded, with replacement) from the prepared training examples', and how full it packs them."""
    drawn = np.random.default_rng(0).choice(np.array(lengths), size=n)
    t = cfg.train
    start = time.perf_counter()
    packs = PackOrder(drawn, t.max_tokens, t.packing_window, cfg.run.seed).epoch(0)
    seconds = time.perf_counter() - start
    print(
        f"packing an epoch of {n:,} examples ({np.median(drawn):.0f} tokens at the median) into micro batches of "
        f"{t.max_tokens:,} tokens, windows of {t.packing_window:,}: {seconds:.2f} s, {len(packs):,} micro batches, "
        f"{100 * drawn.sum() / (t.max_tokens * len(packs)):.1f} % of their budget filled"
    )


def _step_loader(cfg: RunConfig, run_dir, processor, args: argparse.Namespace) -> None:
    """How long the trainer's step loader keeps the rank waiting while simulated steps run."""
    warm = max(1, cfg.train.loader_workers)  # steps until every worker has delivered once
    t = cfg.train.model_copy(update={"steps": args.steps + warm, "processes": 1})
    spec = BranchSpec(
        name="bench",
        run_dir=str(run_dir),
        init=base_path(cfg, run_dir),
        sources=all_sources(run_dir),
        out_dir=str(bench_dir(run_dir, "data")),
        config=cfg.model_copy(update={"train": t}),
    )
    data = BranchData.for_branch(spec, processor)
    loader = StepBatches(data, t, 0, 1, pixel_dtype=DTYPES[cfg.model.dtype])
    batches = step_batches(loader, 0, pin_memory=False)
    waits, step_s, tokens = [], 0.0, 0
    for _ in range(t.steps):
        start = time.perf_counter()
        tokens = next(batches).tokens
        waits.append(time.perf_counter() - start)
        step_s = args.step_seconds or 6 * args.model_params * tokens / (args.mfu * args.peak_tflops * 1e12)
        time.sleep(step_s)
    sides = math.isqrt(cfg.model.min_pixels), math.isqrt(cfg.model.max_pixels)
    batch = f"packed micro batches of {t.max_tokens:,} tokens" if t.packing else f"micro batch {t.micro_batch}"
    print(
        f"step loader: {batch} x {t.grad_accum}, {t.loader_workers} workers, "
        f"images {cfg.data.builtin.image_size} px drawn ({sides[0]}-{sides[1]} px kept), {tokens} tokens a step"
    )
    rate = f"{args.model_params / 1e9:.2f} B parameters at {100 * args.mfu:.0f} % MFU of {args.peak_tflops:.0f} TFLOP/s"
    steady = waits[warm:]
    print(
        f"simulated step {step_s:.2f} s ({rate}): the first {warm} batches (the workers starting) "
        f"{sum(waits[:warm]):.2f} s, then the rank waits {1e3 * statistics.mean(steady):.1f} ms a step on average, "
        f"{1e3 * max(steady):.1f} ms at most ({len(steady)} steps)"
    )


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
