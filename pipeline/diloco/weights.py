"""A worker's weights as DiLoCo sees them, inside a live DeepSpeed engine: the fp32 master copy
of every trained tensor (what the optimizer steps; bf16 weights would round Δ away), read and
set by on-disk name, so pseudo-gradients and global checkpoints share the merge rules' names.

ZeRO stages 0–2 (every rank holds whole parameters). Reading a master copy is a collective
under ZeRO-1/2 (each rank owns a slice): every rank calls these functions in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param
from transformers.core_model_loading import revert_weight_conversion

from pipeline.merge.io import CheckpointReader


def disk_names(model: Any) -> dict[str, torch.nn.Parameter]:
    """The trained parameters by the name ``save_pretrained`` writes them under."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    on_disk = revert_weight_conversion(model, dict(params))
    if {id(p) for p in on_disk.values()} != {id(p) for p in params.values()}:
        # Qwen3.5-MoE: experts fused in memory, stored one by one. A worker's Δ and the global it
        # loads would need the split and the fusion at every round: not done, so refused up front.
        raise ValueError(
            f"{type(model).__name__}: its checkpoint conversion does more than rename tensors (experts fused in "
            "memory, stored one by one), which full-weight DiLoCo workers do not handle; train LoRA workers "
            "(train.finetuning_type: lora) or use the MERIT flow"
        )
    return on_disk


def check_masters(params: dict[str, torch.nn.Parameter]) -> None:
    """Every trained parameter that is not fp32 has a master copy DeepSpeed exposes (ZeRO-1/2, or
    its bf16 optimizer). Under ZeRO-0 with bf16 weights DeepSpeed's unfused optimizer keeps fp32
    copies of its own that nothing outside can set: a new global would be overwritten by the
    next inner step, silently. Refused instead."""
    hidden = [n for n, p in params.items() if p.dtype != torch.float32 and not hasattr(p, "_hp_mapping")]
    if hidden:
        raise ValueError(
            f"DiLoCo: tensor {hidden[0]} is {params[hidden[0]].dtype} without a master copy DeepSpeed exposes; "
            "train bf16 workers with ZeRO stage 1 or 2 (configs/deepspeed/zero2.json)"
        )


def master(param: torch.nn.Parameter) -> torch.Tensor:
    """The fp32 master copy of a parameter (the parameter itself when the optimizer steps it)."""
    full = safe_get_full_fp32_param(param)
    return (param.detach() if full is None else full).float().cpu()


def masters(params: dict[str, torch.nn.Parameter]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, param in params.items():
        yield name, master(param)


def set_weights(params: dict[str, torch.nn.Parameter], checkpoint: str) -> None:
    """Set every trained parameter (and its master copy) from a checkpoint; the optimizer's
    moments are left as they are (DiLoCo: each worker keeps its inner state across rounds)."""
    reader = CheckpointReader(checkpoint)
    with torch.no_grad():
        for name, param in params.items():
            value = reader.get(name).to(param.device, torch.float32)
            safe_set_full_fp32_param(param, value)  # no-op when the optimizer steps the parameter itself
            param.data.copy_(value)
