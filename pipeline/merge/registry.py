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
- A general method reads its inputs through :class:`~pipeline.merge.inputs.TensorInputs`
  (whole task vectors one at a time, their weighted mean, or row blocks under a memory budget),
  never all K of a large tensor at once.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field

from pipeline.merge.inputs import TensorInputs


class MethodParams(BaseModel):
    # Fields may carry mergekit's name as an alias (``lambda`` for ``scale``): either name is accepted.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


Share = Annotated[float, Field(gt=0.0, le=1.0)]
Density = Share | list[Share]  # a share of entries kept: one for every model, or one per model (mergekit's)


def per_model(value: float | Sequence[float], k: int, tensor: str) -> list[float]:
    """A parameter given once or per model, as K values."""
    if isinstance(value, (int, float)):
        return [float(value)] * k
    if len(value) != k:
        raise ValueError(f"tensor {tensor}: {len(value)} per-model values for {k} models")
    return [float(v) for v in value]


def scale_field(default: float = 1.0):
    """λ, the scale of the merged task vector, also accepted as mergekit's ``lambda``."""
    return Field(default, alias="lambda")


@dataclass(frozen=True)
class TensorContext:
    """What a method may need beyond the task vectors: the tensor's name (for seeding and
    messages; an expert's matrix is a tensor of its own, ``…mlp.experts.<e>.gate_proj.weight``,
    however its checkpoint stores it) and a seed."""

    name: str
    seed: int = 0

    def key(self, *parts: int) -> int:
        """A seed for (seed, tensor name, parts): results do not depend on tensor order."""
        return zlib.crc32(repr((self.seed, self.name, *parts)).encode())


@dataclass(frozen=True)
class MergeMethod:
    name: str
    params: type[MethodParams]
    # General methods: (the tensor's inputs, weights (K,), context, params) -> merged τ, fp32, on the
    # inputs' device. Blocks are scratch space: a method may overwrite them, never return a view.
    merge: Callable[[TensorInputs, torch.Tensor, TensorContext, MethodParams], torch.Tensor] | None = None
    # Linear methods: (weights, params) -> (coefficient of θ0, coefficients of θ_k).
    coefficients: Callable[[torch.Tensor, MethodParams], tuple[float, torch.Tensor]] | None = None
    needs_fisher: bool = False
    needs_base: bool = True  # θ0 given (without it, the inputs themselves are combined)
    inputs: tuple[int, int | None] = (1, None)  # how many inputs it merges: at least, at most
    aliases: tuple[str, ...] = field(default=())

    @property
    def is_linear(self) -> bool:
        return self.coefficients is not None

    def check_inputs(self, k: int) -> None:
        least, most = self.inputs
        if k < least or (most is not None and k > most):
            wanted = f"exactly {least}" if least == most else f"at least {least}" if most is None else f"{least}-{most}"
            raise ValueError(f"merge method '{self.name}' merges {wanted} inputs, got {k}")

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
    import pipeline.merge.methods  # noqa: F401  (the methods register themselves when imported)

    if name not in METHODS:
        raise ValueError(f"unknown merge method '{name}'; known: {sorted(METHODS)}")
    return METHODS[name]
