"""The method registry: one file per method under ``methods/``, each registering itself here.

Conventions every method follows (so MERIT merging and DiLoCo aggregation agree):
- Weights are normalised (Σ w_k = 1) before a method sees them.
- A method works on task vectors τ_k = θ_k − θ0 (or DiLoCo pseudo-gradients Δ_k = θ0 − θ_k:
  every method is odd, f(−τ) = −f(τ), so the sign convention passes straight through) and
  returns the merged task vector; the driver adds θ0 back.
- Scales (λ, α) multiply the *weighted mean* form: λ = α = 1 keeps the magnitude of the
  weighted average; with equal weights, λ = K gives the papers' sum forms (task arithmetic,
  Iso-C, TSV).
- A *linear* method is a fixed combination c0·θ0 + Σ c_k θ_k; the driver streams it one input
  at a time without materialising task vectors (the fast path for averaging).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, ConfigDict


class MethodParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class TensorContext:
    """What a method may need beyond the task vectors: the tensor's name (for seeding and
    messages), a seed, and per-model diagonal Fisher values when the method asks for them."""

    name: str
    seed: int = 0
    fishers: torch.Tensor | None = None  # (K, *shape), fp32

    def generator(self, device: torch.device | str) -> torch.Generator:
        """A generator seeded by (seed, tensor name): results do not depend on tensor order."""
        return torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + zlib.crc32(self.name.encode()))


@dataclass(frozen=True)
class MergeMethod:
    name: str
    params: type[MethodParams]
    # General methods: (task vectors stacked (K, *shape), weights (K,), context, params) -> merged τ.
    # The stacked task vectors are scratch space: a method may overwrite them, never return a view.
    merge: Callable[[torch.Tensor, torch.Tensor, TensorContext, MethodParams], torch.Tensor] | None = None
    # Linear methods: (weights, params) -> (coefficient of θ0, coefficients of θ_k).
    coefficients: Callable[[torch.Tensor, MethodParams], tuple[float, torch.Tensor]] | None = None
    needs_fisher: bool = False
    aliases: tuple[str, ...] = field(default=())

    @property
    def is_linear(self) -> bool:
        return self.coefficients is not None

    def validate(self, params: dict | None) -> MethodParams:
        try:
            return self.params.model_validate(params or {})
        except Exception as err:
            raise ValueError(f"method '{self.name}': invalid params {params}: {err}") from None


METHODS: dict[str, MergeMethod] = {}


def register(method: MergeMethod) -> MergeMethod:
    for name in (method.name, *method.aliases):
        if name in METHODS:
            raise ValueError(f"merge method '{name}' registered twice")
        METHODS[name] = method
    return method


def get_method(name: str) -> MergeMethod:
    if name not in METHODS:
        raise ValueError(f"unknown merge method '{name}'; known: {sorted(METHODS)}")
    return METHODS[name]


def weighted_mean(task_vectors: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_k w_k τ_k over the first axis: the fallback of the spectral methods for non-2-D tensors."""
    return torch.tensordot(weights.to(task_vectors), task_vectors, dims=1)
