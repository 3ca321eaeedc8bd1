"""Diagonal Fisher estimates for the Fisher merge (Matena & Raffel 2022).

The empirical Fisher of a branch at its final weights: the mean over examples of the squared
gradient of the instruction-tuning loss, one example per backward pass. One pass over the
examples, on the given device; fp32 accumulators only for the parameters that train (a frozen
tensor is the same in every branch, so the merge needs no Fisher for it: it falls back to the
weighted average there), and no copy of the model: the accumulators are written with the
model's own ``save_pretrained(state_dict=...)``, and the merge reads them as it reads the models, as
the model holds them (``pipeline.merge.layout``: each expert's matrix its own Fisher values).

Memory at 7B in bf16: weights 2 B/param, gradients 2 B/param, accumulators 4 B/param = 8 B per
trainable parameter, 61 GB with everything trainable: one 80 GB GPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from pipeline.checkpoint import save_pretrained_checkpoint
from pipeline.models.loss import supervised_nll


def estimate_fisher(
    model: Any, batches: Iterable[dict[str, torch.Tensor]], out_dir: str | Path, device: str = "cpu", **meta: Any
) -> Path:
    """Diagonal Fisher of ``model`` over ``batches`` (one example per batch gives the per-example
    empirical Fisher; larger batches give the Fisher of batch-mean gradients), saved to ``out_dir``
    with ``meta`` in its manifest."""
    model.to(device).eval()
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    squares = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in trained.items()}
    count = 0
    for batch in tqdm(batches, desc="fisher", unit="ex", leave=False):
        model.zero_grad(set_to_none=True)
        nll, tokens = supervised_nll(model, {k: v.to(device) for k, v in batch.items()})
        (nll / max(tokens, 1)).backward()
        for name, param in trained.items():
            if param.grad is not None:
                squares[name].addcmul_(param.grad, param.grad)  # in fp32: squares of bf16 grads lose nothing
        count += 1
    if count == 0:
        raise ValueError("estimate_fisher needs at least one batch")
    model.zero_grad(set_to_none=True)
    fisher = {name: square.div_(count).cpu() for name, square in squares.items()}
    return save_pretrained_checkpoint(out_dir, model, state_dict=fisher, kind="diagonal_fisher", batches=count, **meta)
