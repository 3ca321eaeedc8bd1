"""Attention over packed micro batches, each example its own sequence, with nothing downloaded.

``varlen`` is torch's variable-length flash attention (``torch.nn.attention.varlen``) over the
boundaries the loader computed: ``cu_seq_lens_q`` for the language model, each image's (and each
window's) ``cu_seqlens`` for the vision tower. transformers gives it those boundaries where its
model code passes them to an attention function: the language model forwards the batch's
``cu_seq_lens_*`` to every attention call, and builds no mask for an implementation it has no mask
function for (so no dense T × T mask exists); a Qwen vision tower hands its ``cu_seqlens`` to the
attention function only for an implementation whose name holds "flash" (else it loops over images
and windows in Python, a small SDPA call each), so the vision config gets the name
:data:`VISION_VARLEN`, set after loading: transformers resolves a "flash" name at load time to the
flash-attn package or a Hub kernel, neither wanted here. On the CPU (tests) the same function runs
SDPA one sequence at a time: the same attention, without the GPU kernel.
"""

from __future__ import annotations

import inspect
from functools import cache
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F

VARLEN = "merit_varlen"  # the name models are loaded with
VISION_VARLEN = "merit_flash_varlen"  # the vision config's: "flash" selects the towers' cu_seqlens path


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: (batch, heads, T, dim) in, (batch, T, heads, dim) out.
    Without boundaries (a tower that attends within fixed-size tiles, InternViT's), plain SDPA."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if cu_seq_lens_q is None:
        gqa = query.shape[1] != key.shape[1]
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=dropout,
            is_causal=causal and attention_mask is None,
            scale=scaling,
            enable_gqa=gqa,
        )
        return out.transpose(1, 2).contiguous(), None
    if query.shape[0] != 1:
        raise ValueError(f"varlen attention takes one packed row, got a batch of {query.shape[0]}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, heads, dim)
    if q.is_cuda:
        varlen_attn, accepts = _varlen_kernel()
        cu = cu_seq_lens_q.to(torch.int32)
        longest = int(max_length_q) if max_length_q is not None else int((cu[1:] - cu[:-1]).max())
        options = (
            {"window_size": (-1, 0) if causal else (-1, -1)} if "window_size" in accepts else {"is_causal": causal}
        )
        if q.shape[1] != k.shape[1]:  # grouped-query attention
            if "enable_gqa" in accepts:
                options["enable_gqa"] = True
            else:
                k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        q, k, v = (t.contiguous() for t in (q, k, v))  # a no-op where the projections laid them out so
        out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, **options)
    else:
        out = torch.cat([_one_sequence(q, k, v, a, b, causal, scaling) for a, b in _bounds(cu_seq_lens_q)])
    return out[None], None


@cache
def _varlen_kernel() -> tuple[Any, frozenset[str]]:
    """torch's varlen attention and the keyword arguments it takes (torch 2.9 … 2.14 differ), looked
    up once, not in every layer's call."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    return list(pairwise(cu_seqlens.tolist()))


def _one_sequence(q, k, v, start: int, end: int, causal: bool, scaling: float | None) -> torch.Tensor:
    """SDPA over positions start … end − 1 alone, as (T, heads, dim)."""
    q, k, v = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def confine_linear_attention(model: torch.nn.Module) -> None:
    """Qwen3.5's Gated DeltaNet layers carry a state and a short convolution along the row, which
    must start afresh with each example: in a packed row they run once per example
    (``sequence_lengths``, the loader's), an exact reset at the cost of a call per example."""
    for module in model.modules():
        if type(module).__name__.endswith("GatedDeltaNet"):
            module.forward = _per_sequence(module.forward)


def _per_sequence(forward):
    def run(hidden_states: torch.Tensor, *args: Any, sequence_lengths: tuple[int, ...] | None = None, **kwargs: Any):
        if sequence_lengths is None:
            return forward(hidden_states, *args, **kwargs)
        for row_wide in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            kwargs.pop(row_wide, None)  # the row's boundaries: each call below is one sequence
        parts = hidden_states.split(list(sequence_lengths), dim=1)
        return torch.cat([forward(part, *args, **kwargs) for part in parts], dim=1)

    return run


def packed_attention(train: Any) -> str:
    """The attention implementation a branch loads its model with for packed micro batches."""
    if train.packed_attention == "varlen":
        _register()
        return VARLEN
    return train.packed_attention


def prepare_for_packing(model: torch.nn.Module) -> None:
    """A loaded model ready for packed rows: its Qwen vision tower on the cu_seqlens path (varlen
    attention only), its linear-attention layers reset at each example."""
    vision = getattr(model.config, "vision_config", None)
    if vision is not None and vision._attn_implementation == VARLEN and hasattr(vision, "spatial_merge_size"):
        vision._attn_implementation = VISION_VARLEN  # a Qwen tower: the others attend within tiles
    confine_linear_attention(model)


def _register() -> None:
    """Make :data:`VARLEN` and :data:`VISION_VARLEN` names transformers accepts."""
    from transformers import AttentionInterface

    for name in (VARLEN, VISION_VARLEN):
        AttentionInterface.register(name, varlen_attention)
