"""The instruction-tuning loss without full-vocabulary logits.

Qwen2.5-VL's own ``forward(labels=...)`` projects every position onto the 151,936-word vocabulary
and upcasts the logits to fp32: at 2,048 tokens that is 1.2 GB per sequence before the backward
pass, although only the answer tokens (a small share of a sequence) carry labels. Here the
decoder's hidden states are gathered at the supervised positions first and only those are
projected, in chunks of ``CHUNK`` positions; with more than one chunk each chunk's logits are
recomputed in the backward pass instead of kept (activation checkpointing of the head), so the
peak is one chunk of logits whatever the number of answer tokens.

Every consumer (the trainer, calibration, Fisher, evaluation) scores through here, so the loss a
branch trains on is the loss it is evaluated with: next-token cross-entropy summed over the
supervised positions, with the token count beside it for exact token-weighted means.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pipeline.models.families import get_family

CHUNK = 1024  # positions per projection: 1024 × 151,936 fp32 logits = 0.6 GB


LOSS_INPUTS = ("labels", "loss_positions", "loss_targets")  # what the loss reads, never the model


def supervised_hidden(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's last hidden states at the positions that predict a label, and those labels,
    as the collators gathered them (``loss_positions`` into the flattened rows × length states,
    ``loss_targets``): an index, so no boolean mask makes the host wait for the device."""
    hidden = decoder_states(model, batch)
    positions = batch["loss_positions"].to(hidden.device)
    return hidden.flatten(0, 1).index_select(0, positions), batch["loss_targets"].to(hidden.device)


def decoder_states(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The decoder's last hidden states of a batch, (rows, length, hidden)."""
    inputs = {k: v for k, v in batch.items() if k not in LOSS_INPUTS}
    if "pixel_values" in inputs:
        inputs["mm_encoder_outputs"] = {"image": image_features(model, inputs)}
    return model.model(**inputs, use_cache=False).last_hidden_state


def image_features(model: torch.nn.Module, inputs: dict[str, Any]) -> Any:
    """The vision tower's (and projector's) output for the batch's images, taking their pixels and
    precomputed inputs out of ``inputs``; with no gradient when none of their parameters trains
    (the shipped configs' frozen tower and projector: nothing of the step's backward reaches them)."""
    vision = {k: inputs.pop(k) for k in list(inputs) if k == "pixel_values" or k.startswith("image_")}
    if "image_grid_thw" in vision:  # the model's own 3-D positions read it too
        inputs["image_grid_thw"] = vision["image_grid_thw"]
    family = get_family(model.config.model_type)
    parts = [model.get_submodule(path) for path in (family.vision, *family.projector)]
    trains = any(p.requires_grad for part in parts for p in part.parameters())
    with nullcontext() if trains else torch.no_grad():
        return model.model.get_image_features(**vision, return_dict=True)


def pieces_for(n: int, chunk: int = CHUNK) -> int:
    """How many projections ``n`` supervised positions take at ``chunk`` positions each."""
    return max(1, -(-n // chunk))


def _chunk_nll(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum")


def supervised_nll(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk: int = CHUNK, pieces: int | None = None
) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL over the supervised positions (fp32, differentiable) and their number.

    The positions are projected in ``pieces`` parts (default: enough of ``chunk`` positions each),
    recomputed in the backward pass when there are several. Under ZeRO-3 every projection gathers
    the head's weights collectively, so ranks must make the same number of them: the trainer
    passes the most any rank needs (a rank with fewer positions projects empty parts). A batch
    without supervised positions gives an NLL of 0 that is still connected to the head."""
    hidden, targets = supervised_hidden(model, batch)
    pieces = pieces or pieces_for(len(targets), chunk)
    if pieces == 1:
        return _chunk_nll(model.lm_head, hidden, targets), len(targets)
    parts = zip(hidden.tensor_split(pieces), targets.tensor_split(pieces))
    nll = sum(checkpoint(_chunk_nll, model.lm_head, h, t, use_reentrant=False) for h, t in parts)
    return nll, len(targets)


def mean_nll(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean over supervised tokens, as the model's own ``loss`` (for a batch that has some)."""
    nll, count = supervised_nll(model, batch)
    return nll / max(count, 1)


class SupervisedLoss(torch.nn.Module):
    """A model whose forward returns ``(summed NLL, supervised tokens)``: the module DeepSpeed
    wraps, so that ZeRO-3's hooks see the head's projection as part of the forward pass."""

    def __init__(self, model: torch.nn.Module, chunk: int = CHUNK):
        super().__init__()
        self.model, self.chunk = model, chunk

    def forward(self, pieces: int | None = None, **batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        return supervised_nll(self.model, batch, self.chunk, pieces)
