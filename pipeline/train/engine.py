"""The DeepSpeed engine of one rank: the process group, the model as this rank holds it, the
optimizer and the schedule.

Under ZeRO-3 the model is loaded partitioned (transformers' DeepSpeed integration: with a live
``HfDeepSpeedConfig``, ``from_pretrained`` builds it under ``zero.Init`` and only rank 0 reads
the checkpoint), so no rank ever holds the full weights. The engine trains the model wrapped in
:class:`SupervisedLoss`, whose forward is the loss itself: no full-vocabulary logits.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from transformers.core_model_loading import Transpose
from transformers.integrations import HfDeepSpeedConfig

from pipeline.config import TrainSection
from pipeline.models import load_model, load_processor
from pipeline.models.attention import packed_attention, prepare_for_packing
from pipeline.models.kernels import use_liger
from pipeline.models.loading import checkpoint_dtype
from pipeline.models.loss import SupervisedLoss
from pipeline.train.lora import apply_lora, lora_summary
from pipeline.train.spec import BranchSpec


@contextmanager
def experts_transposed_by_full_shape() -> Iterator[None]:
    """transformers 5.24 transposes a fused expert tensor (Qwen3-VL-MoE) when its shape differs from the
    model's parameter: the hub stores experts (in, out), transformers' modules and ``save_pretrained``
    (out, in). Under ZeRO-3 the parameter is a partition of shape (0,), so every expert tensor looked
    transposed and a θ0 transformers saved failed to load ("size mismatch for mlp.experts.down_proj").
    Here the comparison uses the parameter's full shape (DeepSpeed's ``ds_shape``), as without ZeRO-3."""
    convert = Transpose.convert

    def by_full_shape(self, input_dict, source_patterns, target_patterns, **kwargs):
        if self.check_dims:
            param = kwargs["model"].get_parameter(kwargs["full_layer_name"])
            tensor = next(iter(input_dict.values()))
            tensor = tensor[0] if isinstance(tensor, list) else tensor
            if tensor.shape == getattr(param, "ds_shape", param.shape):
                return {self.get_target_pattern(input_dict, source_patterns, target_patterns): tensor}
        return convert(self, input_dict, source_patterns, target_patterns, **kwargs)

    Transpose.convert = by_full_shape
    try:
        yield
    finally:
        Transpose.convert = convert


@dataclass
class Rank:
    rank: int
    world: int
    device: torch.device


def init_distributed() -> Rank:
    """Join the branch's process group (torchrun's environment): NCCL on GPUs, gloo on CPU."""
    cuda = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
    return Rank(dist.get_rank(), dist.get_world_size(), torch.device(f"cuda:{local}" if cuda else "cpu"))


def deepspeed_config(t: TrainSection, world: int, dtype: torch.dtype) -> dict[str, Any]:
    """The branch's DeepSpeed JSON with the batch sizes and clipping of its ``train`` section.
    ``bf16.enabled: "auto"`` follows the model's dtype: bf16 weights train in DeepSpeed's bf16
    mode (fp32 master weights), fp32 weights in fp32."""
    config = json.loads(t.deepspeed_file.read_text())
    if config.get("bf16", {}).get("enabled") == "auto":
        config["bf16"]["enabled"] = dtype == torch.bfloat16
    micro = 1 if t.packing else t.micro_batch  # a packed micro batch is one row
    config |= {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": micro * t.grad_accum * world,
        "gradient_clipping": t.clip,
    }
    return with_muon(config, t) if t.optimizer == "muon" else config


def with_muon(config: dict[str, Any], t: TrainSection) -> dict[str, Any]:
    """DeepSpeed's Muon (``MuonWithAuxAdam``): Muon on the tensors DeepSpeed tags ``use_muon`` (see
    :func:`muon_split`), AdamW on the others. torch's own ``torch.optim.Muon`` steps only ZeRO-0:
    ZeRO-2/3 hand the optimizer flat partitions ("Param gradient must be a 2D matrix"), whereas
    DeepSpeed orthogonalises whole matrices under ZeRO-0/2/3 and the three agree to the last
    digit on a step without clipping. With clipping they do not: ZeRO-2/3 clip the orthogonalised
    update, ZeRO-0 the gradient; Muon's step size is its lr, so clipping is off under Muon at
    every stage. ZeRO-3's Muon needs the gradients all-reduced, not reduce-scattered."""
    config = config | {"gradient_clipping": 0.0}
    config["optimizer"] = {
        "type": "Muon",
        "params": {
            "muon_lr": t.muon_lr,
            "momentum": t.muon_momentum,
            "adam_lr": t.lr,
            "betas": list(t.betas),
            "weight_decay": t.weight_decay,
        },
    }
    if config.get("zero_optimization", {}).get("stage") == 3:
        config["zero_optimization"] = config["zero_optimization"] | {"reduce_scatter": False}
    return config


def lr_lambda(steps: int, warmup_ratio: float, min_ratio: float):
    warmup = max(1, round(warmup_ratio * steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def schedule(t: TrainSection):
    """Linear warm-up then cosine decay, per optimizer step, of every parameter group's lr."""
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(t.steps, t.warmup_ratio, t.min_lr_ratio)
    )


def make_optimizer(model: torch.nn.Module, t: TrainSection) -> torch.optim.Optimizer | None:
    """AdamW over the trainable parameters, torch's fused AdamW (one kernel over every tensor) unless
    ``train.fused_optimizer`` is off; None for Muon, which DeepSpeed builds from its config."""
    if t.optimizer == "muon":
        if not torch.cuda.is_available():
            # DeepSpeed wraps Muon's Newton–Schulz in torch.compile; on a CPU inductor builds C++
            # for every matrix shape (98 s before a 2-layer toy's first step), so CPU ranks run it eager.
            torch._dynamo.config.disable = True
        return None
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True} if t.fused_optimizer else {}
    return torch.optim.AdamW(trainable, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, **fused)


def takes_muon(name: str, param: torch.Tensor) -> bool:
    """DeepSpeed's rule for the tensors Muon steps, for optimizers built outside DeepSpeed (the
    benchmarks): two or more dimensions (a ZeRO-3 partition's full shape) and no ``embed`` nor
    ``lm_head`` in the name."""
    shape = getattr(param, "ds_shape", param.shape)
    return len(shape) >= 2 and not any(part in name.lower() for part in ("embed", "lm_head"))


def muon_split(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """The trainable tensors Muon steps and those AdamW steps, by name, as DeepSpeed tagged them
    (``use_muon``): Muon takes every tensor of two or more dimensions whose name holds neither
    ``embed`` nor ``lm_head`` (the hidden weight matrices of the decoder, the vision blocks and the
    projector; a mixture of experts' fused experts, each expert its own matrix), AdamW the
    embeddings, ``lm_head``, norms, biases and the vision tower's patch embedding."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [n for n, p in trainable if p.use_muon], [n for n, p in trainable if not p.use_muon]


@dataclass
class Engine:
    engine: Any  # deepspeed.DeepSpeedEngine over SupervisedLoss(model)
    model: Any  # the Hugging Face model inside it
    processor: Any
    scheduler: Any
    zero3: Any = None  # keeps transformers' ZeRO-3 integration alive while the model lives
    peft: Any = None  # a LoRA branch's PeftModel over ``model`` (whose modules carry the adapters)

    @property
    def lr(self) -> float:
        """The lr of the AdamW parameters (train.lr, scheduled); Muon's follows the same schedule."""
        groups = self.scheduler.optimizer.param_groups
        return next(g["lr"] for g in groups if not g.get("use_muon"))


def load_for_training(spec: BranchSpec) -> Any:
    """θ0 as the branch trains it: with the packed micro batches' attention and preparation, and
    Liger's kernels where ``train.liger_kernel`` asks for them (rank 0 logs which)."""
    packed = packed_attention(spec.train) if spec.train.packing else None
    model = load_model(spec.init, spec.config.model, attn_implementation=packed)
    if packed is not None:
        prepare_for_packing(model)
    liger = use_liger(spec.train, model)
    if int(os.environ.get("RANK", 0)) == 0:
        attention = model.config.get_text_config()._attn_implementation
        print(f"branch {spec.name}: attention {attention}, Liger kernels {liger}", flush=True)
    return model


def build_engine(spec: BranchSpec, world: int) -> Engine:
    cfg = spec.config
    config = deepspeed_config(spec.train, world, checkpoint_dtype(cfg.model, spec.init))
    zero3 = HfDeepSpeedConfig(config) if config.get("zero_optimization", {}).get("stage") == 3 else None
    with experts_transposed_by_full_shape() if zero3 is not None else nullcontext():
        model = load_for_training(spec)
    if spec.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    peft = apply_lora(model, spec.train, spec.init) if spec.train.finetuning_type == "lora" else None
    if peft is not None and int(os.environ.get("RANK", 0)) == 0:
        summary = lora_summary(peft)
        print(
            f"branch {spec.name}: LoRA rank {summary['rank']} (alpha {summary['alpha']:g}) on "
            f"{len(summary['modules'])} modules ({', '.join(summary['modules'])}), "
            f"{summary['trainable_parameters']:,} trainable parameters",
            flush=True,
        )
    optimizer = make_optimizer(model, spec.train)
    engine, _, _, scheduler = deepspeed.initialize(
        model=SupervisedLoss(model, spec.train.loss_chunk),
        optimizer=optimizer,
        model_parameters=[p for p in model.parameters() if p.requires_grad] if optimizer is None else None,
        lr_scheduler=schedule(spec.train),
        config=config,
    )
    if int(os.environ.get("RANK", 0)) == 0:
        if zero3 is not None:
            print(f"branch {spec.name}: {partitioned(model, engine.zero_param_persistence_threshold())}", flush=True)
        if spec.train.optimizer == "muon":
            muon, adamw = muon_split(model)
            print(
                f"branch {spec.name}: Muon on {len(muon)} tensors, AdamW on {len(adamw)}; no gradient clipping",
                flush=True,
            )
    return Engine(engine, model, load_processor(spec.init, cfg.model), scheduler, zero3, peft)


def partitioned(model: Any, threshold: int) -> str:
    """Which tensors ZeRO-3 partitions across the ranks: those over its persistence threshold (the
    others stay whole on every rank, gathered never; a tiny model's experts are below the default 1e5)."""
    params = list(model.parameters())
    split = [p for p in params if not getattr(p, "ds_persist", False)]
    return (
        f"ZeRO-3 partitions {len(split)} of {len(params)} tensors ({sum(p.ds_numel for p in split):,} of "
        f"{sum(p.ds_numel for p in params):,} entries); those of at most {threshold:,} entries stay whole"
    )
