"""Pseudo-gradient compression before aggregation, and the bytes that cross the network.

- ``none``: fp32, 4 bytes an entry.
- ``bf16``: 2 bytes an entry; relative error ≤ 2⁻⁸ per entry.
- ``int8``: one signed byte an entry and one fp32 scale per row (s = max|row| / 127, q =
  round(x / s)): |x − s·q| ≤ s / 2 = max|row| / 254. Rows are the first dimension of a
  matrix; a vector (norms, biases) is one row, so its cost is not doubled by scales.
- ``int4``: 4 bits an entry, two packed in a byte (q + 8 in each nibble, q ∈ [−7, 7]: symmetric,
  so 0 stays exact), and one fp32 scale per block of INT4_BLOCK entries of a row (s = max|block|
  / 7): |x − s·q| ≤ s / 2 = max|block| / 14; 0.53 bytes an entry. A block rather than a row:
  with 4 bits one large entry would round a whole row of a 3584-wide matrix to 0.

With error feedback (Seide et al. 2014; Karimireddy et al. 2019) a worker sends C(Δ + e) and
keeps e ← (Δ + e) − D(C(Δ + e)): what compression drops in one round is sent in the next, so the
errors do not accumulate in θ. The residual e is the worker's state, saved with its inner state.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from pipeline.merge.io import TensorInfo

Compression = Literal["none", "bf16", "int4", "int8"]
SCALE_SUFFIX = ".__scale__"  # the int8 / int4 payload's scales, stored beside it
INT4_BLOCK = 128


def as_rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1) if x.dim() >= 2 else x.reshape(1, -1)


def row_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The (rows, columns) a tensor of ``shape`` is quantised as (see ``as_rows``)."""
    rows = shape[0] if len(shape) >= 2 else 1
    return rows, math.prod(shape) // rows if rows else 0


def payload_infos(name: str, shape: tuple[int, ...], kind: Compression) -> dict[str, TensorInfo]:
    """The named tensors (shape, dtype) of one tensor's payload, before it is computed."""
    rows, cols = row_shape(shape)
    if kind == "int8":
        return {name: TensorInfo(shape, torch.int8), name + SCALE_SUFFIX: TensorInfo((rows,), torch.float32)}
    if kind == "int4":
        blocks = -(-cols // INT4_BLOCK)
        return {
            name: TensorInfo((rows, -(-cols // 2)), torch.uint8),
            name + SCALE_SUFFIX: TensorInfo((rows, blocks), torch.float32),
        }
    return {name: TensorInfo(shape, torch.bfloat16 if kind == "bf16" else torch.float32)}


def compress(name: str, x: torch.Tensor, kind: Compression) -> dict[str, torch.Tensor]:
    """The payload of one fp32 tensor, as named tensors (what is written and sent)."""
    if kind == "none":
        return {name: x.float().contiguous()}
    if kind == "bf16":
        return {name: x.to(torch.bfloat16).contiguous()}
    if kind == "int4":
        packed, scale = quantise_int4(as_rows(x.float()))
        return {name: packed, name + SCALE_SUFFIX: scale}
    rows = as_rows(x.float())
    scale = rows.abs().amax(dim=1, keepdim=True) / 127.0
    q = torch.where(scale > 0, rows / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return {name: q.round_().clamp_(-127, 127).to(torch.int8).reshape(x.shape), name + SCALE_SUFFIX: scale.squeeze(1)}


def quantise_int4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) fp32 → packed (rows, ⌈cols / 2⌉) uint8 and scales (rows, ⌈cols / INT4_BLOCK⌉)."""
    n, cols = rows.shape
    blocks = -(-cols // INT4_BLOCK)
    padded = torch.nn.functional.pad(rows, (0, blocks * INT4_BLOCK - cols)).reshape(n, blocks, INT4_BLOCK)
    scale = padded.abs().amax(dim=2, keepdim=True) / 7.0
    q = torch.where(scale > 0, padded / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    nibbles = (q.round_().clamp_(-7, 7) + 8).to(torch.uint8).reshape(n, -1)[:, : cols + cols % 2]
    return (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).contiguous(), scale.reshape(n, blocks)


def dequantise_int4(packed: torch.Tensor, scale: torch.Tensor, cols: int) -> torch.Tensor:
    """The fp32 (rows, cols) that ``quantise_int4`` packed (any slice of its rows)."""
    nibbles = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(len(packed), -1)[:, :cols]
    return (nibbles.float() - 8) * scale.float().repeat_interleave(INT4_BLOCK, dim=1)[:, :cols]


def decompress(payload: dict[str, torch.Tensor], name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The fp32 tensor a payload stands for (``shape``, the tensor's own, is needed for int4:
    packing loses it)."""
    x = payload[name]
    if x.dtype == torch.uint8:
        if shape is None:
            raise ValueError(f"{name}: an int4 payload needs the tensor's shape to be unpacked")
        return dequantise_int4(x, payload[name + SCALE_SUFFIX], row_shape(tuple(shape))[1]).reshape(shape)
    if x.dtype != torch.int8:
        return x.float()
    scale = payload[name + SCALE_SUFFIX].float()
    return (as_rows(x).float() * scale.unsqueeze(1)).reshape(x.shape)


def payload_bytes(payload: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in payload.values())


def compress_with_feedback(
    name: str, delta: torch.Tensor, kind: Compression, residual: torch.Tensor | None
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Compress Δ (+ the residual of earlier rounds: pass zeros to start error feedback); returns
    the payload and the new residual (None without error feedback)."""
    if residual is None:
        return compress(name, delta, kind), None
    corrected = delta.float() + residual
    payload = compress(name, corrected, kind)
    # Out of place: without compression the payload *is* ``corrected`` (no copy), and subtracting
    # in place would zero what is sent.
    return payload, corrected - decompress(payload, name, corrected.shape)
