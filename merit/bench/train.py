"""``merit bench train``: where a branch's time goes, with one JSON line per measured branch.

Every measurement is the branch trainer itself (DeepSpeed, its own process group) for ``--steps``
steps; its rates leave out the first ``WARMUP_STEPS`` (allocation, thread start-up) and are the
measured steps' tokens over their seconds: ``tokens_per_s`` without the time the rank waited for
its batch, ``tokens_per_s_with_wait`` with it. ``padding_share`` is the padded positions (and
filler images) over every position the model ran, all steps. ``mfu`` (on a GPU) is
:func:`flops_per_token` × tokens/s over ``--peak-tflops``. ``--profile N`` records N steps with
``torch.profiler`` into ``profile.md`` beside the branch's ``metrics.jsonl``.

``--size tiny`` (the CPU default): the run's tiny θ0; the trainer as configured beside a plain
PyTorch loop over the same batches (target: the trainer's overhead ≤ 15 %), the trainer with
``train.packing`` flipped, and the trainer on 2 ranks. ``--size small | medium | 3b`` (3b is the
GPU default): a random Qwen2.5-VL at those widths, bf16 on a GPU, ZeRO-2, one rank, trained as
``--like`` (default ``configs/qwen2_5_vl_3b.yaml``) trains: its image sizes, example length and
batch (token budget, accumulation, checkpointing, kernels). ``--corpus vision-flan`` trains on
:mod:`merit.bench.corpus` (Vision-FLAN's layout, examples of varied length) instead of the built-in
corpus, at the run's image sizes (the ``--like`` config's at real widths; at tiny width the run
config's own, so that a CPU takes it in minutes). ``--set`` overrides come last: ``--set
train.packing=false`` measures padded batches.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from merit.bench.corpus import write_corpus
from merit.bench.data import like
from merit.bench.widths import build_theta0, width_overrides
from merit.cli import add_run_options, resolve_run
from pipeline.checkpoint import is_complete
from pipeline.checkpoint import read_manifest as read_checkpoint_manifest
from pipeline.config import RunConfig
from pipeline.data import active_sources, load_split, prepare_data, read_manifest
from pipeline.layout import base_path, bench_dir, run_config
from pipeline.models import init_model, load_processor, processor_for
from pipeline.models.families import get_family
from pipeline.models.loss import mean_nll
from pipeline.train import BranchSpec, train_branch
from pipeline.train.engine import load_for_training, make_optimizer
from pipeline.train.sampling import BranchData

WARMUP_STEPS = 3  # excluded from the rates: first-step allocation and thread start-up
SHIPPED_3B = "configs/qwen2_5_vl_3b.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_options(parser)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per measurement")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--size", choices=["tiny", "small", "medium", "3b"], help="model widths (default: 3b on cuda, else tiny)"
    )
    parser.add_argument("--corpus", choices=["builtin", "vision-flan"], default="builtin", help="the training data")
    parser.add_argument(
        "--like", help=f"the config whose images and batch are trained (default at real widths: {SHIPPED_3B})"
    )
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="steps recorded by torch.profiler")
    parser.add_argument(
        "--peak-tflops", type=float, default=989.0, help="device peak for MFU (H100/H200 bf16 dense: 989)"
    )


@dataclass(frozen=True)
class ModelFlops:
    """What a token costs, torchtitan's way: 6 FLOPs (forward 2, backward 4) per parameter of the
    language model's blocks, the head on the supervised tokens alone (the only ones the loss
    projects), 12 · layers · heads · head dim · context for attention (context: the token's own
    example's length, the full square counted as torchtitan does), and the vision tower with its
    projector per image patch: 2 FLOPs per parameter when frozen (forward only), else 6. Embedding
    lookups and the linear-attention layers' own recurrence are not counted."""

    blocks: int  # language-model parameters, embeddings and head excluded
    head: int  # vocabulary × hidden
    attention_layers: int  # layers of full attention
    heads: int
    head_dim: int
    vision: int  # vision tower and projector

    def per_token(self, image_share: float, supervised_share: float, context: float, vision_trains: bool) -> float:
        patches_per_token = 4 * image_share  # 2 × 2 patches merge into one image token
        attention = 12 * self.attention_layers * self.heads * self.head_dim * context
        vision = (6 if vision_trains else 2) * self.vision * patches_per_token
        return 6 * self.blocks + 6 * self.head * supervised_share + attention + vision


def model_flops(init: str | Path) -> ModelFlops:
    config = AutoConfig.from_pretrained(str(init))
    family = get_family(config.model_type)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    params = dict(model.named_parameters())  # tied tensors once

    def under(*prefixes: str) -> int:
        return sum(p.numel() for n, p in params.items() if n.startswith(tuple(f"{x}." for x in prefixes)))

    text = config.get_text_config()
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    return ModelFlops(
        blocks=under(*family.language) - embedding.numel() - (0 if head is embedding else head.numel()),
        head=head.numel(),
        attention_layers=sum(t == "full_attention" for t in layer_types),
        heads=text.num_attention_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        vision=under(family.vision, *family.projector),
    )


def data_shape(cfg: RunConfig, run_dir: Path, sources: list[str], processor: Any) -> dict[str, float]:
    """The training examples' token statistics: image and supervised shares, the mean context a
    token attends over (Σ n² / Σ n), and the lengths' spread."""
    from pipeline.data import Encoder

    examples = [ex for exs in load_split(cfg, run_dir, "train", sources).values() for ex in exs]
    ids = [ex.token_ids for ex in examples]
    lengths = np.array([len(x) for x in ids], dtype=np.float64)
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    labels = Encoder(processor, cfg.data.max_length).assistant_labels
    supervised = sum(int((labels(x.long())[1:] != -100).sum()) for x in ids)
    return {
        "examples": len(ids),
        "image_share": float(sum(int((x == image_token).sum()) for x in ids) / lengths.sum()),
        "supervised_share": supervised / lengths.sum(),
        "context": float((lengths**2).sum() / lengths.sum()),
        "length_p50": float(np.percentile(lengths, 50)),
        "length_p90": float(np.percentile(lengths, 90)),
        "length_max": float(lengths.max()),
    }


def summary(out: Path) -> dict[str, Any]:
    """A finished branch's figures from its ``metrics.jsonl``."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tokens = np.diff([0] + [r["tokens"] for r in records])
    seconds = np.diff([0.0] + [r["elapsed_s"] for r in records])
    waits = np.array([r["data_wait_s"] for r in records])
    positions = np.array([r["positions"] for r in records])
    measured = slice(WARMUP_STEPS, None)
    memory = [r.get("peak_gpu_mb", r["peak_rss_mb"]) for r in records]
    return {
        "tokens_per_s": float(tokens[measured].sum() / (seconds[measured] - waits[measured]).sum()),
        "tokens_per_s_with_wait": float(tokens[measured].sum() / seconds[measured].sum()),
        "padding_share": float((positions - tokens).sum() / positions.sum()),
        "peak_memory_mb": max(memory),
        "memory": "gpu_allocated" if "peak_gpu_mb" in records[-1] else "rank0_rss",
        "steps": len(records),
        "examples": records[-1]["examples"],
        "tokens": int(tokens.sum()),
    }


def plain_loop(spec: BranchSpec) -> float:
    """Tokens/s of a bare single-process AdamW loop over the trainer's own batches and model."""
    cfg, t = spec.config, spec.train
    model = load_for_training(spec).train()
    data = BranchData.for_branch(spec, load_processor(spec.init, cfg.model))
    optimizer, scheduler = make_optimizer(model, t)
    tokens, seconds = 0, 0.0
    for step in range(t.steps):
        start, step_tokens = time.perf_counter(), 0
        for micro in data.micro_batches(step):
            encoded = data.encoder.encode_batch(micro)
            step_tokens += sum(e.num_tokens for e in encoded)
            (mean_nll(model, data.collator(encoded)) / t.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if step >= WARMUP_STEPS:
            tokens, seconds = tokens + step_tokens, seconds + time.perf_counter() - start
    return tokens / seconds


def corpus_overrides(args: argparse.Namespace, run_dir: Path) -> list[str]:
    if args.corpus == "builtin":
        return []
    annotation, images = write_corpus(run_dir / "corpus", tasks=24, per_task=40, seed=0)
    source = f"{{name: vision_flan, format: vision_flan, path: {annotation}, images_dir: {images}}}"
    return [f"data.sources=[{source}]", "warmup.sources=[]", "eval.sources=[]", "eval.benchmarks=[]"]


def main(args: argparse.Namespace) -> None:
    if args.steps <= WARMUP_STEPS:
        raise SystemExit(f"--steps must exceed the {WARMUP_STEPS} warm-up steps left out of the rates")
    size = args.size or ("3b" if args.device == "cuda" else "tiny")
    cuda = args.device == "cuda"
    reference = args.like or (SHIPPED_3B if size != "tiny" else None)
    settings = [*like(reference)] if reference else []
    settings += [f"model.dtype={'bfloat16' if cuda else 'float32'}", f"train.profile_steps={args.profile}"]
    settings += [f"train.steps={args.steps}", f"train.checkpoint_every={10**9}", "train.warmup_ratio=0.1"]
    if size != "tiny":
        settings += [*width_overrides(size), "data.builtin.examples_per_source=64"]
        settings += ["train.deepspeed=zero2", "train.processes=1"]
    run_dir = run_config(args.config, args.overrides, args.run_dir)[1]  # where the corpus goes
    args.overrides = [*settings, *corpus_overrides(args, run_dir), *args.overrides]  # the command line's own last
    cfg, run_dir = resolve_run(args)
    if size == "tiny":
        init_model(cfg, run_dir)
    else:
        built = Path(base_path(cfg, run_dir))
        if not is_complete(built) or read_checkpoint_manifest(built).get("config_digest") != cfg.digest("model", "run"):
            build_theta0(cfg, run_dir, args.device)  # else the same random θ0 as the last measurement
    processor = processor_for(cfg, run_dir)
    prepare_data(cfg, run_dir, processor)
    sources = list(active_sources(read_manifest(run_dir)))
    shape = data_shape(cfg, run_dir, sources, processor)
    flops = model_flops(base_path(cfg, run_dir))
    frozen = cfg.model.freeze.freeze_vision_tower and cfg.model.freeze.freeze_multi_modal_projector
    per_token = flops.per_token(shape["image_share"], shape["supervised_share"], shape["context"], not frozen)
    print(
        f"{shape['examples']:,} training examples in {len(sources)} sources: tokens per example "
        f"p50 {shape['length_p50']:,.0f}, p90 {shape['length_p90']:,.0f}, max {shape['length_max']:,.0f}; "
        f"image tokens {100 * shape['image_share']:.0f} %, supervised {100 * shape['supervised_share']:.1f} %"
    )
    print(
        f"model FLOPs a token: {per_token / 1e9:.3f} G (6 × {flops.blocks / 1e6:,.1f} M block parameters, "
        f"the head on supervised tokens, attention over a mean context of {shape['context']:,.0f}, "
        f"{'2' if frozen else '6'} × {flops.vision / 1e6:,.1f} M vision parameters per patch)"
    )
    packing = cfg.train.packing
    runs = [("trainer", packing, 1)]
    if size == "tiny":
        runs += [("trainer-flipped", not packing, 1), ("trainer-2-ranks", packing, 2)]
    results = []
    for name, packed, processes in runs:
        spec = branch(cfg, run_dir, sources, name, packing=packed, processes=processes)
        train_branch(spec, echo=False)
        result = {"name": name, "size": size, "device": device_name(cuda), "corpus": args.corpus}
        result |= {"packing": spec.train.packing, "processes": processes} | summary(Path(spec.out_dir))
        result |= kernels(spec)
        result["flops_per_token"] = per_token
        result["mfu"] = per_token * result["tokens_per_s"] / (args.peak_tflops * 1e12) if cuda else None
        if args.profile:
            result["profile"] = str(Path(spec.out_dir) / "profile.md")
        results.append(result)
        for weights in ("final", "checkpoints"):  # what it measured is in metrics.jsonl: 7.5 GB a 3B branch
            shutil.rmtree(Path(spec.out_dir) / weights, ignore_errors=True)
    if size == "tiny":
        plain = plain_loop(branch(cfg, run_dir, sources, "plain", processes=1))
        overhead = 100 * (plain / results[0]["tokens_per_s"] - 1)
        print(
            f"plain PyTorch loop, 1 process: {plain:,.0f} tokens/s; trainer overhead {overhead:.1f} % (target <= 15 %)"
        )
    for result in results:
        print(json.dumps(result))


def branch(cfg: RunConfig, run_dir: Path, sources: list[str], name: str, **train: Any) -> BranchSpec:
    """A fresh branch of the run's config with ``train`` settings, from θ0, in the run's bench folder."""
    out = bench_dir(run_dir, "train") / name
    shutil.rmtree(out, ignore_errors=True)  # a finished branch would be skipped: measure afresh
    config = cfg.model_copy(update={"train": cfg.train.model_copy(update=train)})
    return BranchSpec(
        name=name, run_dir=str(run_dir), init=base_path(cfg, run_dir), sources=sources, out_dir=str(out), config=config
    )


def kernels(spec: BranchSpec) -> dict[str, Any]:
    """The attention and kernels the branch trained with, as its log says."""
    log = (Path(spec.out_dir) / "train.log").read_text()
    said = re.search(r"attention (\S+), Liger kernels (.*)", log)
    t = spec.train
    return {
        "attention": said[1] if said else None,
        "liger": said[2] if said else None,
        "fused_optimizer": t.fused_optimizer,
        "gradient_checkpointing": t.gradient_checkpointing,
        "max_tokens": t.max_tokens if t.packing else None,
        "grad_accum": t.grad_accum,
    }


def device_name(cuda: bool) -> str:
    return torch.cuda.get_device_name() if cuda else "cpu"
