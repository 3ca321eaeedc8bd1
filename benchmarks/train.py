"""``merit bench train``: tokens/s of the branch trainer (DeepSpeed in its own process group)
beside a plain PyTorch loop on the same model, data order, batch and optimizer, in the same run;
then 1 vs 2 ranks. Target: the trainer's overhead ≤ 15 %.

``--size 3b`` (the default with ``--device cuda``): a randomly initialised Qwen2.5-VL at the 3B
model's widths, bf16, ZeRO-2, one GPU, trained by the same branch trainer on the built-in corpus
with 448×448 images: tokens/s and model FLOPs utilisation (:func:`flops_per_token`).
``--size small`` runs that path at a width a CPU can take, to check it without a GPU."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.widths import build_theta0, width_overrides
from merit.cli import add_run_options, resolve_run
from pipeline.data import active_sources, load_split, prepare_data, read_manifest
from pipeline.layout import INIT, base_path, bench_dir
from pipeline.models import (
    init_model,
    load_model,
    load_processor,
    processor_for,
)
from pipeline.models.loss import mean_nll
from pipeline.train import BranchSpec, train_branch
from pipeline.train.engine import make_optimizer
from pipeline.train.sampling import BranchData

WARMUP_STEPS = 3  # excluded from the rates: first-step allocation and thread start-up


def plain_loop(spec: BranchSpec) -> float:
    """Tokens/s of a bare single-process AdamW loop over the trainer's own batches."""
    cfg, t = spec.config, spec.train
    model = load_model(spec.init, cfg.model).train()
    data = BranchData.for_branch(spec, load_processor(spec.init, cfg.model))
    optimizer, scheduler = make_optimizer(model, t)
    rates = []
    for step in range(t.steps):
        start, tokens = time.perf_counter(), 0
        for micro in data.micro_batches(step, t.micro_batch, t.grad_accum):
            encoded = data.encoder.encode_batch(micro)
            tokens += sum(e.num_tokens for e in encoded)
            (mean_nll(model, data.collator(encoded)) / t.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates[WARMUP_STEPS:])


def trainer_rate(spec: BranchSpec) -> float:
    train_branch(spec, echo=False)
    return trainer_rate_from(Path(spec.out_dir))


def trainer_rate_from(out: Path) -> float:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in records[WARMUP_STEPS:])


def flops_per_token(n_total: int, n_vision: int, image_share: float, vision_trains: bool) -> float:
    """Model FLOPs a trained token costs: 6 per language parameter (forward 2, backward 4), and per
    vision parameter 4 · f times that, f the share of image tokens (each is 2×2 = 4 patches). A
    frozen vision tower (the default) runs forward only, 2 per parameter: nothing ahead of it
    needs its input's gradient. The projector is counted with the tower (it runs once per image
    token, not per patch: under 1 % of the total at 3B); attention's own FLOPs are left out."""
    per_vision_parameter = 6 if vision_trains else 2
    return 6 * (n_total - n_vision) + per_vision_parameter * 4 * image_share * n_vision


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_options(parser)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per measurement")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--size", choices=["tiny", "small", "medium", "3b"], help="model widths (default: 3b on cuda, else tiny)"
    )
    parser.add_argument("--micro-batch", type=int, default=8, help="micro batch of the real-width run")
    parser.add_argument(
        "--peak-tflops", type=float, default=989.0, help="device peak for MFU (H100/H200 bf16 dense: 989)"
    )


def main(args: argparse.Namespace) -> None:
    if args.steps <= WARMUP_STEPS:
        raise SystemExit(f"--steps must exceed the {WARMUP_STEPS} warm-up steps left out of the rates")
    size = args.size or ("3b" if args.device == "cuda" else "tiny")
    if size != "tiny":
        return real_width(args, size)
    cfg, run_dir = resolve_run(args)
    cfg.train.steps, cfg.train.checkpoint_every = args.steps, 10**9
    init_model(cfg, run_dir)
    prepare_data(cfg, run_dir, processor_for(cfg, run_dir))
    sources = list(active_sources(read_manifest(run_dir)))
    with tempfile.TemporaryDirectory(prefix="merit-bench-train-") as tmp:

        def branch(name: str, processes: int) -> BranchSpec:
            config = cfg.model_copy(deep=True)
            config.train.processes = processes
            return BranchSpec(
                name=name,
                run_dir=str(run_dir),
                init=base_path(cfg, run_dir),
                sources=sources,
                out_dir=f"{tmp}/{name}",
                config=config,
            )

        plain = plain_loop(branch("plain", 1))
        one = trainer_rate(branch("trainer-1", 1))
        two = trainer_rate(branch("trainer-2", 2))
    t = cfg.train
    print(
        f"{len(sources)} sources, micro batch {t.micro_batch} x accumulation {t.grad_accum}, {t.steps} steps, "
        f"{Path(t.deepspeed).stem}, median tokens/s after {WARMUP_STEPS} steps"
    )
    print(f"plain PyTorch loop, 1 process:   {plain:10.0f} tokens/s")
    overhead = 100 * (plain / one - 1)
    print(f"branch trainer, 1 rank:          {one:10.0f} tokens/s  (overhead {overhead:5.1f} %, target <= 15 %)")
    print(f"branch trainer, 2 ranks (gloo):  {two:10.0f} tokens/s  ({two / one:.2f}x one rank; global batch doubles)")


def real_width(args: argparse.Namespace, size: str) -> None:
    """One branch of a random Qwen2.5-VL at a real width on one device: tokens/s and MFU."""
    cuda = args.device == "cuda"
    args.overrides = [
        *args.overrides,
        *width_overrides(size),
        f"model.dtype={'bfloat16' if cuda else 'float32'}",
        "model.min_pixels=200704",
        "model.max_pixels=200704",
        "data.builtin.image_size=448",
        "data.builtin.examples_per_source=64",
        f"train.steps={args.steps}",
        f"train.micro_batch={args.micro_batch}",
        "train.deepspeed=configs/deepspeed/zero2.json",
        "train.processes=1",
        f"train.checkpoint_every={10**9}",
        "train.warmup_ratio=0.1",
    ]
    cfg, run_dir = resolve_run(args)
    built = build_theta0(cfg, run_dir, "cuda" if cuda else "cpu")
    n_total, n_vision = built["total"], built["vision"]
    processor = processor_for(cfg, run_dir)
    prepare_data(cfg, run_dir, processor)
    sources = list(active_sources(read_manifest(run_dir)))
    train = load_split(cfg, run_dir, "train", sources)
    ids = torch.cat([ex.token_ids for exs in train.values() for ex in exs])
    image_share = float((ids == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).float().mean())
    out = bench_dir(run_dir, "train")
    shutil.rmtree(out, ignore_errors=True)  # a finished branch would be skipped: measure afresh
    spec = BranchSpec(
        name="bench",
        run_dir=str(run_dir),
        init=str(Path(run_dir) / INIT),
        sources=sources,
        out_dir=str(out),
        config=cfg,
    )
    start = time.perf_counter()
    train_branch(spec, echo=False)
    trained = time.perf_counter() - start
    rate = trainer_rate_from(out)
    frozen = cfg.model.freeze.freeze_vision_tower
    flops = flops_per_token(n_total, n_vision, image_share, vision_trains=not frozen)
    device = torch.cuda.get_device_name() if cuda else "CPU"
    print(
        f"Qwen2.5-VL at the {size} widths: {n_total / 1e6:,.1f} M parameters ({n_vision / 1e6:,.1f} M vision), "
        f"{cfg.model.dtype}, ZeRO-2, 1 {device}, vision tower {'frozen' if frozen else 'trained'}"
    )
    print(
        f"micro batch {cfg.train.micro_batch}, {args.steps} steps, "
        f"image tokens {100 * image_share:.0f} % of the input; "
        f"model built and saved in {built['seconds']:.0f} s, branch trained in {trained:.0f} s"
    )
    print(f"tokens/s (median after {WARMUP_STEPS} steps): {rate:,.0f}")
    if args.peak_tflops:
        print(
            f"model FLOPs utilisation: {100 * flops * rate / (args.peak_tflops * 1e12):.1f} % "
            f"of {args.peak_tflops:.0f} TFLOP/s"
        )
