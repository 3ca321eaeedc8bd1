"""LoRA adapters as merge inputs: the task vector of each tensor of θ0, formed from the adapter.

A PEFT LoRA adapter folder holds, per adapted linear module, A (r × in) and B (out × r); the
module's task vector is τ = (alpha / r) · B A (``use_rslora``: alpha / √r; r and alpha per module
where ``rank_pattern`` / ``alpha_pattern`` say so), formed here row
block by row block (rows of B times the whole A, which is small), so a merge holds one block of
ΔW, never A and B apart: every method of the library combines ΔW. A tensor the adapter does not
touch has τ = 0; a ``modules_to_save`` tensor is stored whole and read as a model's tensor.

The adapter names modules as the model's Python modules (``model.language_model.layers.0…``);
Qwen2-VL / Qwen2.5-VL checkpoints, on the hub and as transformers saves them, name the same
tensors ``model.layers.0…`` and ``visual.…``: both spellings are matched against θ0's names.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pipeline.merge.io import DTYPES, CheckpointReader, MergeInputError, TensorInfo

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# module prefix -> checkpoint prefix (Qwen2-VL / Qwen2.5-VL's layout on disk)
CHECKPOINT_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def checkpoint_name(module_tensor: str, names: dict[str, TensorInfo]) -> str | None:
    """θ0's name of a module's tensor: as spelled, or in the checkpoint's layout."""
    if module_tensor in names:
        return module_tensor
    for module, stored in CHECKPOINT_PREFIXES:
        if module_tensor.startswith(module) and (name := stored + module_tensor[len(module) :]) in names:
            return name
    return None


class AdapterError(MergeInputError):
    """An adapter folder that cannot be used; the message names the file at fault."""


def read_adapter_config(path: str | Path) -> dict:
    """A LoRA adapter's adapter_config.json, after checking its weights are safetensors (PEFT
    falls back to a pickled ``adapter_model.bin``, which is refused)."""
    path = Path(path)
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise AdapterError(f"{path}: no {ADAPTER_WEIGHTS} (adapters are read from safetensors only, never pickle)")
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise AdapterError(f"{path / ADAPTER_CONFIG}: cannot read the adapter's config ({err})") from err
    if config.get("peft_type") != "LORA" or config.get("use_dora"):
        kind = "DoRA" if config.get("use_dora") else config.get("peft_type")
        raise AdapterError(f"{path}: a {kind} adapter; only LoRA adapters (ΔW = B A) are merged")
    return config


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module path's last parts."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return float(value)
    return default


def adapted_parameters(path: str | Path) -> set[str]:
    """The model's parameter names (as its modules spell them) that an adapter changes: each
    adapted module's weight and every tensor saved whole."""
    with safe_open(str(Path(path) / ADAPTER_WEIGHTS), framework="pt", device="cpu") as file:
        keys = list(file.keys())
    names = set()
    for key in keys:
        inner = key.removeprefix(PEFT_PREFIX)
        if ".lora_A." in inner:
            names.add(inner.split(".lora_A.")[0] + ".weight")
        elif ".lora_" not in inner:
            names.add(inner.replace(".modules_to_save.", "."))
    return names


class AdapterReader:
    """An adapter over θ0 with a :class:`CheckpointReader`'s interface (θ0's tensor names and
    shapes, rows on demand): ``reader(name)`` gives rows of τ where ``is_delta(name)``, else rows
    of the model's tensor (a ``modules_to_save`` tensor)."""

    def __init__(self, path: str | Path, base: CheckpointReader):
        self.path, self.base = Path(path), base
        self.adapter_config = read_adapter_config(self.path)
        try:
            self._file = safe_open(str(self.path / ADAPTER_WEIGHTS), framework="pt", device="cpu")
            keys = list(self._file.keys())
        except (SafetensorError, OSError) as err:
            raise MergeInputError(f"{self.path / ADAPTER_WEIGHTS}: cannot read safetensors ({err})") from err
        self.info = base.info
        self.factors: dict[str, tuple[str, str]] = {}  # θ0's tensor name -> (A key, B key)
        self.scaling: dict[str, float] = {}  # θ0's tensor name -> alpha / r of its module
        self.module: dict[str, str] = {}  # θ0's tensor name -> the adapted module's path
        self.whole: dict[str, str] = {}  # θ0's tensor name -> key of the tensor stored whole
        for key in keys:
            self._index(key, set(keys))
        self._cached: tuple[str, torch.Tensor] | None = None  # the last tensor's A

    def _index(self, key: str, keys: set[str]) -> None:
        inner = key.removeprefix(PEFT_PREFIX)
        if ".lora_B." in inner or ".lora_magnitude_vector" in inner:
            return
        if ".lora_embedding_" in inner:
            raise AdapterError(f"{self.path}: {key}: LoRA on embeddings is not supported")
        if ".lora_A." in inner:
            module, _, param = inner.partition(".lora_A.")
            name = self._stored(f"{module}.{param}", key)
            b_key = key.replace(".lora_A.", ".lora_B.")
            if b_key not in keys:
                raise AdapterError(f"{self.path}: {key} has no {b_key}")
            rank = self._check_factors(name, key, b_key)
            self.factors[name], self.module[name] = (key, b_key), module
            self.scaling[name] = self._scaling(module, rank)
            return
        name = self._stored(inner.replace(".modules_to_save.", "."), key)
        shape = tuple(self._file.get_slice(key).get_shape())
        if shape != self.info[name].shape:
            raise AdapterError(f"{self.path}: {key} is {shape}, but θ0's {name} is {self.info[name].shape}")
        self.whole[name] = key

    def _stored(self, module_tensor: str, key: str) -> str:
        name = checkpoint_name(module_tensor, self.info)
        if name is None:
            raise AdapterError(f"{self.path}: {key} adapts {module_tensor}, which θ0 ({self.base.path}) does not have")
        return name

    def _check_factors(self, name: str, a_key: str, b_key: str) -> int:
        """The module's rank, after checking A and B fit θ0's tensor."""
        a, b = (tuple(self._file.get_slice(k).get_shape()) for k in (a_key, b_key))
        shape = self.info[name].shape
        if len(shape) != 2 or len(a) != 2 or a[1] != shape[1] or b != (shape[0], a[0]):
            raise AdapterError(
                f"{self.path}: LoRA factors of {name} are A {a} and B {b}, which do not fit θ0's {shape}"
            )
        return a[0]

    def _scaling(self, module: str, rank: int) -> float:
        config = self.adapter_config
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, float(config.get("lora_alpha") or rank))
        return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)

    def is_delta(self, name: str) -> bool:
        return name not in self.whole

    def touches(self, name: str) -> bool:
        return name in self.factors or name in self.whole

    def factor_shape(self, name: str) -> tuple[int, ...]:
        """A's shape (rank × in) for θ0's tensor ``name``."""
        return tuple(self._file.get_slice(self.factors[name][0]).get_shape())

    def factor_dtype(self, name: str) -> torch.dtype:
        return DTYPES[self._file.get_slice(self.factors[name][0]).get_dtype()]

    def factor(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """An adapter tensor (rows ``[start, stop)``) in fp32."""
        view = self._file.get_slice(key)
        return (view[start:stop] if start is not None else view[:]).float()

    def reader(self, name: str):
        if name in self.whole:
            key = self.whole[name]
            return lambda start, stop: self._file.get_slice(key)[start:stop]
        if name not in self.factors:
            per_row = math.prod(self.info[name].shape[1:]) if self.info[name].shape else 1
            return lambda start, stop: torch.zeros(stop - start, per_row)
        a_key, b_key = self.factors[name]

        def rows(start: int, stop: int) -> torch.Tensor:
            if self._cached is None or self._cached[0] != name:
                self._cached = (name, self.factor(a_key))
            return (self.factor(b_key, start, stop) @ self._cached[1]).mul_(self.scaling[name])

        return rows

    def config(self) -> dict:
        return self.base.config()

    def aux_files(self) -> list[Path]:
        return self.base.aux_files()
