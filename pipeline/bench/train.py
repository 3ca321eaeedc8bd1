"""``merit bench train``: tokens/s of the branch trainer (DeepSpeed in its own process group)
beside a plain PyTorch loop on the same model, data order, batch and optimizer, in the same run;
then 1 vs 2 ranks. Target: the trainer's overhead ≤ 15 %."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pipeline.cli import resolve_run
from pipeline.data import Collator, Encoder, active_sources, load_split, prepare_data, read_manifest
from pipeline.models import init_model, load_model, load_processor, processor_for
from pipeline.train import BranchSpec, train_branch
from pipeline.train.sampling import BatchOrder
from pipeline.train.worker import lr_lambda

WARMUP_STEPS = 3  # excluded from the rates: first-step allocation and thread start-up


def plain_loop(spec: BranchSpec) -> float:
    """Tokens/s of a bare single-process AdamW loop over the trainer's own batches."""
    cfg, t = spec.config, spec.train
    model = load_model(spec.init, cfg.model).train()
    processor = load_processor(spec.init, cfg.model)
    encoder, collator = Encoder(processor, cfg.data.max_length), Collator(processor.tokenizer.pad_token_id)
    by_source = load_split(cfg, spec.run_dir, "train", spec.sources)
    manifest = read_manifest(spec.run_dir)["sources"]
    examples = [ex for name in spec.sources for ex in by_source[name]]
    order = BatchOrder([len(by_source[n]) for n in spec.sources], [manifest[n]["train_tokens"] for n in spec.sources],
                       t.sampling, cfg.run.seed)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t.steps, t.warmup_ratio, t.min_lr_ratio))
    rates = []
    for step in range(t.steps):
        start, tokens = time.perf_counter(), 0
        for ids in order.rank_batches(step, t.micro_batch, t.grad_accum, 0, 1):
            encoded = encoder.encode_batch([examples[i] for i in ids.tolist()])
            tokens += sum(e.num_tokens for e in encoded)
            (model(**collator(encoded)).loss / t.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates[WARMUP_STEPS:])


def trainer_rate(spec: BranchSpec) -> float:
    train_branch(spec, echo=False)
    records = [json.loads(line) for line in (Path(spec.out_dir) / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in records[WARMUP_STEPS:])


def main(args: argparse.Namespace) -> None:
    cfg, run_dir = resolve_run(args)
    cfg.train.steps, cfg.train.checkpoint_every = args.steps, 10**9
    init_model(cfg, run_dir)
    prepare_data(cfg, run_dir, processor_for(cfg, run_dir))
    sources = list(active_sources(read_manifest(run_dir)))
    with tempfile.TemporaryDirectory(prefix="merit-bench-train-") as tmp:

        def branch(name: str, processes: int) -> BranchSpec:
            config = cfg.model_copy(deep=True)
            config.train.processes = processes
            init = str(Path(run_dir) / "init") if cfg.model.name_or_path == "tiny" else cfg.model.name_or_path
            return BranchSpec(name=name, run_dir=str(run_dir), init=init, sources=sources, out_dir=f"{tmp}/{name}", config=config)

        plain = plain_loop(branch("plain", 1))
        one = trainer_rate(branch("trainer-1", 1))
        two = trainer_rate(branch("trainer-2", 2))
    t = cfg.train
    print(f"{len(sources)} sources, micro batch {t.micro_batch} x accumulation {t.grad_accum}, {t.steps} steps, "
          f"{Path(t.deepspeed).stem}, median tokens/s after {WARMUP_STEPS} steps")  # fmt: skip
    print(f"plain PyTorch loop, 1 process:   {plain:10.0f} tokens/s")
    print(f"branch trainer, 1 rank:          {one:10.0f} tokens/s  (overhead {100 * (plain / one - 1):5.1f} %, target <= 15 %)")
    print(f"branch trainer, 2 ranks (gloo):  {two:10.0f} tokens/s  ({two / one:.2f}x one rank; global batch doubles)")
