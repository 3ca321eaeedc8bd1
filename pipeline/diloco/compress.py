"""Pseudo-gradient compression before aggregation, and the bytes that cross the network.

- ``none``: fp32, 4 bytes an entry.
- ``bf16``: 2 bytes an entry; relative error ≤ 2⁻⁸ per entry.
- ``int8``: one signed byte an entry and one fp32 scale per row (s = max|row| / 127, q =
  round(x / s)): |x − s·q| ≤ s / 2 = max|row| / 254. Rows are the first dimension of a
  matrix; a vector (norms, biases) is one row, so its cost is not doubled by scales.

With error feedback (Seide et al. 2014; Karimireddy et al. 2019) a worker sends C(Δ + e) and
keeps e ← (Δ + e) − D(C(Δ + e)): what compression drops in one round is sent in the next, so the
errors do not accumulate in θ. The residual e is the worker's state, saved with its inner state.
"""

from __future__ import annotations

from typing import Literal

import torch

Compression = Literal["none", "bf16", "int8"]
SCALE_SUFFIX = ".__scale__"  # the int8 payload's per-row scales, stored beside it


def as_rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1) if x.dim() >= 2 else x.reshape(1, -1)


def compress(name: str, x: torch.Tensor, kind: Compression) -> dict[str, torch.Tensor]:
    """The payload of one fp32 tensor, as named tensors (what is written and sent)."""
    if kind == "none":
        return {name: x.float().contiguous()}
    if kind == "bf16":
        return {name: x.to(torch.bfloat16).contiguous()}
    rows = as_rows(x.float())
    scale = rows.abs().amax(dim=1, keepdim=True) / 127.0
    q = torch.where(scale > 0, rows / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return {name: q.round_().clamp_(-127, 127).to(torch.int8).reshape(x.shape), name + SCALE_SUFFIX: scale.squeeze(1)}


def decompress(payload: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The fp32 tensor a payload stands for."""
    x = payload[name]
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
    return payload, corrected.sub_(decompress(payload, name))
