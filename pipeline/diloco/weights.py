"""A worker's weights as DiLoCo sees them, inside a live DeepSpeed engine: the fp32 master copy
of every trained tensor (what the optimizer steps; bf16 weights would round Δ away), read and
set by the names the model holds them under (fused experts and all): the payload is written so, and
the aggregator reads it and the globals through ``pipeline.merge.layout`` whatever θ0's layout.

ZeRO stages 0–2 (every rank holds whole parameters). Reading a master copy is a collective
under ZeRO-1/2 (each rank owns a slice): every rank calls these functions in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

from pipeline.merge.layout import ModelView


def trained_parameters(model: Any) -> dict[str, torch.nn.Parameter]:
    """The trained parameters by the names the model holds them under."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def check_masters(params: dict[str, torch.nn.Parameter]) -> None:
    """Every trained parameter that is not fp32 has a master copy DeepSpeed exposes (ZeRO-1/2, or
    its bf16 optimizer). Under ZeRO-0 with bf16 weights DeepSpeed's unfused optimizer keeps fp32
    copies of its own that nothing outside can set: a new global would be overwritten by the
    next inner step, silently. Refused instead."""
    hidden = [n for n, p in params.items() if p.dtype != torch.float32 and not hasattr(p, "_hp_mapping")]
    if hidden:
        raise ValueError(
            f"DiLoCo: tensor {hidden[0]} is {params[hidden[0]].dtype} without a master copy DeepSpeed exposes; "
            "train bf16 workers with ZeRO stage 1 or 2 (train.deepspeed: zero2)"
        )


def master(param: torch.nn.Parameter) -> torch.Tensor:
    """The fp32 master copy of a parameter (the parameter itself when the optimizer steps it)."""
    full = safe_get_full_fp32_param(param)
    return (param.detach() if full is None else full).float().cpu()


def masters(params: dict[str, torch.nn.Parameter]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, param in params.items():
        yield name, master(param)


def set_weights(params: dict[str, torch.nn.Parameter], checkpoint: str) -> None:
    """Set every trained parameter (and its master copy) from a checkpoint, read as the model holds it;
    the optimizer's moments are left as they are (DiLoCo: each worker keeps its inner state across rounds)."""
    theta = ModelView.open(checkpoint)
    with torch.no_grad():
        for name, param in params.items():
            value = theta.get_loaded(name).to(param.device, torch.float32)
            safe_set_full_fp32_param(param, value)  # no-op when the optimizer steps the parameter itself
            param.data.copy_(value)
