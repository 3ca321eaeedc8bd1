"""Merges whose result is a combination of the task vectors (and θ0) with coefficients that
depend only on their inner products: SLERP, NuSLERP, Multi-SLERP, Karcher, Model Stock.

Such a method needs two passes over a tensor's inputs, whatever K: one for the Gram matrix of
[τ_1 … τ_K (, θ0)], in fp64, and one to combine them with the coefficients the method computes
from it (on K × K numbers, not on the tensor). A tensor that fits the merge's block budget is
read once (its block is kept between the passes); a larger one twice. Memory: one block, an fp64
copy of a column chunk of it for the Gram, and the output.

``vectors`` says what a "vector" is, as mergekit's options do: the whole tensor (``tensor``), each
vector along the last dimension (``last``: a matrix's rows), or each vector along the first
dimension (``first``: a matrix's columns). A 1-D tensor is one vector whatever the option. The
Gram is then one K' × K' matrix per vector: (V, K', K').
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from pipeline.merge.chunks import chunks
from pipeline.merge.inputs import TensorInputs

Vectors = Literal["tensor", "last", "first"]


def layout(shape: tuple[int, ...], vectors: Vectors) -> tuple[Vectors, int]:
    """The effective option for this shape and how many vectors it makes."""
    if len(shape) < 2 or vectors == "tensor":
        return "tensor", 1
    if vectors == "last":
        return "last", math.prod(shape[:-1])
    return "first", math.prod(shape[1:])


def _stack(inputs: TensorInputs, i: int, with_base: bool) -> torch.Tensor:
    """Block i's task vectors, with θ0's row last when asked (K', n_i), fp32."""
    block = inputs.block(i)
    if not with_base:
        return block
    return torch.cat([block, inputs.base_block(i).float().view(1, -1)])


def gram(inputs: TensorInputs, vectors: Vectors = "tensor", with_base: bool = False) -> torch.Tensor:
    """The inner products of [τ_1 … τ_K (, θ0)] per vector, (V, K', K') in fp64, one pass."""
    mode, count = layout(inputs.shape, vectors)
    size = inputs.k + with_base
    out = torch.zeros(count, size, size, dtype=torch.float64, device=inputs.device)
    for i in inputs.blocks:
        stack = _stack(inputs, i, with_base)
        if mode == "tensor":
            for cols in chunks(stack):
                part = stack[:, cols].double()
                out[0] += part @ part.T
        elif mode == "last":
            last = inputs.shape[-1]
            first = inputs.span(i).start // last
            part = stack.view(size, -1, last).double()
            out[first : first + part.shape[1]] += torch.einsum("kml,jml->mkj", part, part)
        else:
            part = stack.view(size, -1, inputs.per_row).double()
            out += torch.einsum("krc,jrc->ckj", part, part)
    return out


def combine(
    inputs: TensorInputs, coefficients: torch.Tensor, vectors: Vectors = "tensor", with_base: bool = False
) -> torch.Tensor:
    """Σ_k c_k τ_k (+ c_θ0 θ0) per vector, fp32 in the tensor's shape; ``coefficients`` (V, K')."""
    mode, _ = layout(inputs.shape, vectors)
    c = coefficients.to(device=inputs.device, dtype=torch.float32)
    out = torch.empty(inputs.numel, dtype=torch.float32, device=inputs.device)
    for i in inputs.blocks:
        stack, span = _stack(inputs, i, with_base), inputs.span(i)
        if mode == "tensor":
            out[span] = c[0] @ stack
        elif mode == "last":
            last = inputs.shape[-1]
            first = span.start // last
            part = stack.view(stack.shape[0], -1, last)
            out[span] = torch.einsum("mk,kml->ml", c[first : first + part.shape[1]], part).reshape(-1)
        else:
            part = stack.view(stack.shape[0], -1, inputs.per_row)
            out[span] = torch.einsum("ck,krc->rc", c, part).reshape(-1)
    return out.view(inputs.shape)


def raw_gram(g: torch.Tensor, with_base: bool) -> torch.Tensor:
    """The inner products of the models x_k = τ_k + θ0 from those of [τ_1 … τ_K, θ0]
    (unchanged without a base: the inputs are then the models themselves)."""
    if not with_base:
        return g
    k = g.shape[-1] - 1
    to_models = torch.cat([torch.eye(k, dtype=g.dtype), torch.ones(k, 1, dtype=g.dtype)], 1).to(g.device)
    return to_models @ g @ to_models.T


def raw_coefficients(c: torch.Tensor, with_base: bool) -> torch.Tensor:
    """Coefficients over [τ_1 … τ_K, θ0] of Σ_k c_k x_k − θ0 (the task vector of a combination of
    the models); unchanged without a base."""
    if not with_base:
        return c
    return torch.cat([c, c.sum(-1, keepdim=True) - 1], -1)
