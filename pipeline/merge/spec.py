"""The merge spec, mergekit-like YAML validated by pydantic:

```yaml
base_model: runs/demo/init            # θ0 (optional for weighted_average)
models:
  - {path: runs/demo/branches/0/final, tokens: 41200}   # or weight: 0.5; optional fisher: DIR
  - {adapter: runs/lora/branches/1/final, tokens: 39800}  # a PEFT LoRA adapter over base_model
method: iso_c                          # or rules: [{group|pattern, method, params}, ...]
params: {scale: 1.0}
out_path: runs/demo/merged/iso_c
out_dtype: null                        # default: the models' dtype (the wider one if they differ)
out_format: model                      # or adapter: a PEFT LoRA adapter (every input an adapter)
adapter_rank: null                     # out_format adapter, methods other than the linear ones
device: cpu                            # or cuda
block_mb: 1024                         # working memory of TIES, DARE and Fisher per block
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.merge.registry import get_method
from pipeline.merge.rules import Rule, rules_for


class MergeSpecError(ValueError):
    """A merge spec file that cannot be read or does not validate."""


OUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | None = None  # a checkpoint folder (or safetensors file)
    adapter: str | None = None  # or a PEFT LoRA adapter folder over base_model
    weight: float | None = Field(None, ge=0.0)  # its weight (default 1), normalised over the models' sum
    tokens: int | None = Field(None, ge=0)  # or its training tokens, weighted in proportion (for every model or none)
    fisher: str | None = None  # a checkpoint of diagonal Fisher values with the same tensor names

    @model_validator(mode="after")
    def _weight_or_tokens(self) -> ModelEntry:
        if (self.path is None) == (self.adapter is None):
            raise ValueError(f"model {self.source}: give path or adapter, not both")
        if self.weight is not None and self.tokens is not None:
            raise ValueError(f"model {self.source}: give weight or tokens, not both")
        return self

    @property
    def source(self) -> str:
        return self.path or self.adapter or "(neither path nor adapter)"

    @property
    def raw_weight(self) -> float:
        if self.tokens is not None:
            return float(self.tokens)
        return 1.0 if self.weight is None else self.weight


class MergeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # θ0, the checkpoint the task vectors are taken from; needed by adapters and by every method but
    # weighted_average, slerp, nuslerp, multislerp and karcher
    base_model: str | None = None
    models: list[ModelEntry] = Field(min_length=1)  # the models merged, each a checkpoint or an adapter
    # One merge method for every tensor (routers averaged), e.g. iso_c (docs/concepts/merge-methods.md); or rules.
    method: str | None = None
    params: dict[str, Any] = {}  # the method's parameters, e.g. {scale: 1.0}
    rules: list[Rule] | None = None  # per tensor: the first rule whose pattern or group matches gives its method
    out_path: str  # the folder the merged model is written to
    # the output's dtype; default: the models' (the wider one if they differ). Compute is in fp32.
    out_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    out_format: Literal["model", "adapter"] = "model"  # a full checkpoint, or a PEFT LoRA adapter (inputs: adapters)
    # out_format adapter: the rank each merged ΔW is truncated to by SVD (the linear methods need
    # none: their ΔW is the inputs' B A side by side, exact at rank Σ r_k).
    adapter_rank: int | None = Field(None, ge=1)
    device: Literal["cpu", "cuda"] = "cpu"  # where the tensors are merged
    seed: int = 0  # seeds the random draws of DARE and DELLA (with each tensor's name)
    max_shard_size: int = Field(2 * 1024**3, ge=1)  # bytes per output shard
    # The fp32 working set of an element-wise method (TIES, DARE, Fisher): a tensor whose K task
    # vectors exceed it is merged in row blocks, each pass reading it again.
    block_mb: int = Field(1024, ge=1)

    @model_validator(mode="after")
    def _method_or_rules(self) -> MergeSpec:
        if (self.method is None) == (self.rules is None):
            raise ValueError("give either 'method' (with 'params') or 'rules'")
        if self.method is not None:
            get_method(self.method).validate(self.params)
        if self.base_model is None and any(get_method(m).needs_base for m in self.method_names):
            raise ValueError(f"methods {self.method_names} need base_model (θ0)")
        for m in self.method_names:
            get_method(m).check_inputs(len(self.models))
        if self.base_model is None and any(e.adapter for e in self.models):
            raise ValueError("adapters need base_model (the θ0 they were trained on)")
        if self.out_format == "adapter":
            if not all(e.adapter for e in self.models):
                raise ValueError("out_format adapter needs every model to be an adapter")
            nonlinear = [m for m in self.method_names if not get_method(m).is_linear]
            if nonlinear and self.adapter_rank is None:
                raise ValueError(
                    f"out_format adapter: the merged ΔW of {nonlinear} is not low-rank; give adapter_rank "
                    "(the rank its SVD is truncated to, e.g. the inputs' rank)"
                )
        if any(get_method(m).needs_fisher for m in self.method_names) and any(e.fisher is None for e in self.models):
            raise ValueError("the fisher method needs 'fisher' for every model")
        if len({e.tokens is None for e in self.models}) > 1:
            raise ValueError("give tokens for every model or for none")
        if sum(e.raw_weight for e in self.models) <= 0:
            raise ValueError(f"model weights must sum to a positive number, got {[e.raw_weight for e in self.models]}")
        return self

    @property
    def method_names(self) -> list[str]:
        return [self.method] if self.method else [r.method for r in self.rules]

    @property
    def effective_rules(self) -> list[Rule]:
        return rules_for(self.method, self.params, self.rules)

    def normalized_weights(self) -> torch.Tensor:
        raw = torch.tensor([e.raw_weight for e in self.models], dtype=torch.float64)
        return (raw / raw.sum()).float()

    @classmethod
    def from_yaml(cls, path: str | Path) -> MergeSpec:
        try:
            return cls.model_validate(read_yaml(path))
        except ValidationError as err:
            raise MergeSpecError(f"invalid merge spec {path}:\n{err}") from None


def read_yaml(path: str | Path) -> Any:
    """A merge YAML's contents (safe loading)."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise MergeSpecError(f"cannot read merge spec {path}: {err}") from err
