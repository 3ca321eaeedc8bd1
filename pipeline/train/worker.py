"""One rank of a branch: ``python -m torch.distributed.run ... -m pipeline.train.worker SPEC.json``.

Resumable: every ``checkpoint_every`` steps all ranks save the DeepSpeed engine state (weights,
optimizer, scheduler) under ``checkpoints/step<N>`` with the step and tokens seen, then rank 0
points ``checkpoints/latest.json`` at it (atomic rename). A run killed at any moment restarts
from the last checkpoint that ``latest.json`` names, which is complete by construction; the
data order is a function of (seed, step), so the resumed run trains on the same batches.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from PIL import Image

from pipeline.checkpoint import save_pretrained_checkpoint, write_json_atomic
from pipeline.data import IGNORE_INDEX, Encoded, Encoder, Example
from pipeline.models import load_model, load_processor
from pipeline.train.curves import plot_loss
from pipeline.train.lifetime import die_with_parent
from pipeline.train.sampling import BranchData
from pipeline.train.spec import BranchSpec

LATEST = "latest.json"


def deepspeed_config(spec: BranchSpec, world: int) -> dict:
    config = json.loads(Path(spec.train.deepspeed).read_text())
    bf16 = config.get("bf16", {}).get("enabled")
    if bf16 == "auto":  # bf16 where the device supports it, fp32 on CPU
        config["bf16"]["enabled"] = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    t = spec.train
    return config | {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch * t.grad_accum * world,
        "gradient_clipping": t.clip,
    }


def lr_lambda(steps: int, warmup_ratio: float, min_ratio: float):
    warmup = max(1, round(warmup_ratio * steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def make_optimizer(model: torch.nn.Module, t) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters, linear warm-up then cosine decay (per optimizer step)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t.steps, t.warmup_ratio, t.min_lr_ratio))


def main(spec_path: str) -> None:
    die_with_parent()  # a killed launcher takes its ranks with it
    spec = BranchSpec.load(spec_path)
    cfg, t, out = spec.config, spec.train, Path(spec.out_dir)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.manual_seed(cfg.run.seed)

    model = load_model(spec.init, cfg.model)
    processor = load_processor(spec.init, cfg.model)
    data = BranchData.for_branch(spec, processor)
    encoder, collator = data.encoder, data.collator
    optimizer, scheduler = make_optimizer(model, t)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(spec, world)
    )

    ckpt_dir, digest = out / "checkpoints", spec.digest()
    step, tokens_seen, elapsed = 0, 0, 0.0  # elapsed: training seconds, summed over resumed runs
    if (ckpt_dir / LATEST).is_file():
        tag = json.loads((ckpt_dir / LATEST).read_text())["tag"]
        # DeepSpeed asserts (no message) on a missing tag folder and returns None on an unreadable one.
        path, state = engine.load_checkpoint(str(ckpt_dir), tag=tag) if (ckpt_dir / tag).is_dir() else (None, None)
        if path is None:
            raise RuntimeError(
                f"branch {spec.name}: {ckpt_dir / LATEST} names {tag}, which cannot be loaded; "
                "delete it to train the branch from its start"
            )
        step, tokens_seen, elapsed = state["step"], state["tokens_seen"], state.get("elapsed_s", 0.0)
        if rank == 0:
            print(f"branch {spec.name}: resumed from {tag} (step {step})", flush=True)
    metrics_path = out / "metrics.jsonl"
    if rank == 0:
        _truncate_metrics(metrics_path, step)

    filler = _image_filler(encoder) if world > 1 else None
    engine.train()
    while step < t.steps:
        start, lr = time.perf_counter(), scheduler.get_last_lr()[0]  # the lr this step trains with
        losses, step_tokens = [], 0
        for micro in data.micro_batches(step, t.micro_batch, t.grad_accum, rank, world):
            encoded = encoder.encode_batch(micro)
            step_tokens += sum(e.num_tokens for e in encoded)
            if filler is not None and all(e.image_grid_thw is None for e in encoded):
                encoded.append(filler)
            batch = {k: v.to(engine.device) for k, v in collator(encoded).items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        totals = torch.tensor(
            [torch.stack(losses).mean().item(), step_tokens], dtype=torch.float64, device=engine.device
        )
        dist.all_reduce(totals)
        step += 1
        tokens_seen += int(totals[1])
        seconds = time.perf_counter() - start
        elapsed += seconds
        if rank == 0:
            norm = engine.get_global_grad_norm()
            record = {
                "step": step,
                "loss": float(totals[0]) / world,
                "lr": lr,
                "tokens": tokens_seen,
                "tokens_per_s": float(totals[1]) / seconds,
                "grad_norm": None if norm is None else float(norm),
                "elapsed_s": round(elapsed, 3),
            }
            with open(metrics_path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        if step % t.checkpoint_every == 0 and step < t.steps:
            state = {"step": step, "tokens_seen": tokens_seen, "elapsed_s": elapsed, "spec_digest": digest}
            _checkpoint(engine, ckpt_dir, state, rank)

    state = {"step": step, "tokens_seen": tokens_seen, "train_seconds": round(elapsed, 3), "spec_digest": digest}
    _save_final(engine, processor, spec, state, rank)
    if rank == 0:
        plot_loss(metrics_path, out / "loss.png", title=f"branch {spec.name}")
    dist.barrier()


def _image_filler(encoder: Encoder) -> Encoded:
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


def _checkpoint(engine, ckpt_dir: Path, state: dict, rank: int) -> None:
    step = state["step"]
    tag = f"step{step}"
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=state)
    dist.barrier()  # every rank's shard is on disk before the pointer moves
    if rank == 0:
        previous = json.loads((ckpt_dir / LATEST).read_text())["tag"] if (ckpt_dir / LATEST).is_file() else None
        write_json_atomic(ckpt_dir / LATEST, {"tag": tag, "step": step, "spec_digest": state["spec_digest"]})
        if previous and previous != tag:
            shutil.rmtree(ckpt_dir / previous, ignore_errors=True)
    dist.barrier()


def _save_final(engine, processor, spec: BranchSpec, state: dict, rank: int) -> None:
    """A full Hugging Face checkpoint on rank 0; under ZeRO-3 the partitioned weights are gathered.
    It is written in the engine's dtype: bf16 where DeepSpeed trains in bf16 (GPUs), fp32 on CPU."""
    meta = {**state, "parent": spec.init, "branch": spec.name, "sources": spec.sources}
    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            if rank == 0:
                save_pretrained_checkpoint(Path(spec.out_dir) / "final", engine.module, processor, **meta)
    elif rank == 0:
        save_pretrained_checkpoint(Path(spec.out_dir) / "final", engine.module, processor, **meta)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records a killed run wrote after its last checkpoint: the resumed run rewrites them."""
    if path.is_file():
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))


if __name__ == "__main__":
    main(sys.argv[1])
