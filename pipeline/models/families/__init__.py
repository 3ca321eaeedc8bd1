"""Model families: what every stage needs to know about one architecture, declared once.

A family module (``qwen2_5_vl.py``, ``qwen3_vl.py``, …) registers one :class:`Family` per
``model_type`` of a checkpoint's ``config.json``, as the merge methods register themselves. The
stages ask the registry, never the architecture: freezing and LoRA's ``all`` (the parts, as
LLaMA-Factory names them), merge rules (the groups, by tensor name), how its checkpoints store the model's
tensors (other prefixes than the modules', experts fused or one by one, tensors transformers does not load:
``pipeline.merge.layout``), lmms-eval's model class, and the offline tiny model
(``model.name_or_path: tiny:<model_type>``).
docs/guides/adding-a-model-family.md says how to add one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal

TINY = "tiny"  # model.name_or_path of the offline Qwen2.5-VL; "tiny:<model_type>" for another family
MODULES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "internvl")  # the family modules, imported on first use


@dataclass(frozen=True)
class Experts:
    """A mixture of experts' expert matrices. transformers holds each layer's experts fused,
    ``mlp.experts.gate_up_proj`` (experts, 2 × inter, hidden: gate rows, then up rows) and
    ``mlp.experts.down_proj`` (experts, hidden, inter); checkpoints store them so, transposed, or one
    matrix per expert (``mlp.experts.<e>.gate_proj.weight``), as ``pipeline.merge.layout`` reads them."""

    # How the hub's checkpoints store them (and so the tiny model's files): fused as held, fused with
    # each expert (in, out), or one by one.
    hub: Literal["fused", "fused_in_out", "per_expert"]
    # Whether transformers reads a fused tensor stored (experts, in, out), transposing it on load.
    transposed: bool = False
    # Whether transformers reads experts stored one matrix each, fusing them on load (its conversion
    # mapping for Qwen2-MoE and the families built on it).
    one_by_one: bool = True

    @staticmethod
    def dims(config: dict[str, Any]) -> tuple[int, int]:
        """(inter, hidden) of the experts, from a checkpoint's ``config.json``."""
        text = config.get("text_config") or config
        return text["moe_intermediate_size"], text["hidden_size"]


@dataclass(frozen=True)
class Family:
    model_type: str
    # The parts ``model.freeze`` names, as LLaMA-Factory's composite model of this type: module paths
    # of the loaded model. The vision tower is ``vision`` without the projector.
    vision: str
    projector: tuple[str, ...]
    language: tuple[str, ...]
    # Merge rules' groups (``pipeline.merge.rules``): shell globs over tensor names, as stored or as the
    # modules name them (a rule matches either).
    groups: dict[str, tuple[str, ...]]
    # lmms-eval's model for a checkpoint of this family, and for θ0 + a LoRA adapter.
    lmms_model: str
    lmms_adapted: str
    # The tiny model: its config from the tiny section and the tokenizer's special-token ids, its
    # processor from (model section, tokenizer, chat template).
    tiny_config: Callable[[Any, Callable[[str], int]], Any]
    tiny_processor: Callable[[Any, Any, str], Any]
    chat_template: str  # a .jinja file beside this module: the tiny processor's template
    # Whether ``model.min_pixels`` / ``max_pixels`` size the images (Qwen); else the processor's own
    # config does (InternVL: tiles, ``min_patches`` … ``max_patches`` of them).
    pixel_bounds: bool = True
    # The tiny tokenizer's special tokens beyond Qwen's, by the tokenizer attribute that names them.
    special_tokens: dict[str, str] = field(default_factory=dict)
    # Module prefix -> on-disk prefix, where checkpoints store tensors under other names than the
    # modules' (transformers saves Qwen2.5-VL's ``model.language_model.`` as ``model.``).
    stored_as: tuple[tuple[str, str], ...] = ()
    # A mixture of experts' expert matrices (None: a dense model).
    experts: Experts | None = None
    # Globs of tensors its checkpoints store and transformers does not load (Qwen3.5's multi-token
    # prediction head ``mtp.*``): carried unchanged into every checkpoint written from one.
    unloaded: tuple[str, ...] = ()
    # The tiny model's own such tensors, made as the hub's checkpoints hold them: (model, seed) -> tensors.
    tiny_unloaded: Callable[[Any, int], dict[str, Any]] | None = None
    # Packed micro batches (pipeline.data.packed): the transformers class whose ``get_rope_index``
    # gives an example's 3-D (t, h, w) positions, None for 1-D positions; the vision tower's inputs
    # that depend on the images' grids alone (vision config, grid_thw) -> kwargs, computed by the
    # loader's workers instead of inside the step.
    rope_index: str | None = None
    vision_inputs: Callable[[Any, Any], dict[str, Any]] | None = None

    @property
    def routers(self) -> tuple[str, ...]:
        return self.groups.get("router", ())

    def is_unloaded(self, name: str) -> bool:
        return any(fnmatchcase(name, p) for p in self.unloaded)

    def module_name(self, stored: str) -> str:
        """A stored tensor's name as the model's modules spell it (the inverse of ``stored_as``); a name
        already so spelled is kept."""
        if any(stored.startswith(module) for module, _ in self.stored_as):
            return stored
        for module, prefix in self.stored_as:
            if stored.startswith(prefix):
                return module + stored[len(prefix) :]
        return stored

    def stored_name(self, module_tensor: str) -> str:
        """A module's tensor under the name the hub's checkpoints (and ``save_pretrained``) store it."""
        for module, prefix in self.stored_as:
            if module_tensor.startswith(module):
                return prefix + module_tensor[len(module) :]
        return module_tensor

    def is_router(self, name: str) -> bool:
        return any(fnmatchcase(name, p) for p in self.routers)

    def template(self) -> str:
        return (Path(__file__).parent / self.chat_template).read_text()


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    if family.model_type in FAMILIES:
        raise ValueError(f"model family '{family.model_type}' registered twice")
    FAMILIES[family.model_type] = family
    return family


def _load() -> None:
    if not FAMILIES:
        for module in MODULES:
            importlib.import_module(f"{__name__}.{module}")


def supported() -> list[str]:
    _load()
    return sorted(FAMILIES)


class UnsupportedModelError(ValueError):
    """A checkpoint or tiny name of a model type no family declares."""


def get_family(model_type: str, where: str = "") -> Family:
    _load()
    if model_type not in FAMILIES:
        at = f"{where}: " if where else ""
        raise UnsupportedModelError(
            f"{at}model type '{model_type}' is not supported; supported: {supported()} "
            "(docs/guides/adding-a-model-family.md says how to add one)"
        )
    return FAMILIES[model_type]


def family_of_config(config: dict[str, Any], where: str = "") -> Family:
    """The family of a checkpoint's ``config.json`` (as a dict)."""
    return get_family(config.get("model_type", "?"), where)


def declared_family(config: dict[str, Any]) -> Family | None:
    """The family of a checkpoint's ``config.json`` (as a dict), None where no family declares its
    type (the merge library reads any transformers checkpoint, tensor by tensor as stored)."""
    _load()
    return FAMILIES.get(config.get("model_type"))


def is_tiny_name(name_or_path: str) -> bool:
    return name_or_path == TINY or name_or_path.startswith(TINY + ":")


def tiny_family(name_or_path: str) -> Family:
    """``tiny`` is Qwen2.5-VL (the paper's model); ``tiny:<model_type>`` that family."""
    model_type = name_or_path.partition(":")[2] or "qwen2_5_vl"
    return get_family(model_type, f"model.name_or_path {name_or_path}")


def group_patterns() -> dict[str, tuple[str, ...]]:
    """Every family's merge-rule groups, united by name: no tensor is in one group in one family and in
    another group in another, so one rule serves them all."""
    _load()
    groups: dict[str, tuple[str, ...]] = {}
    for family in FAMILIES.values():
        for group, patterns in family.groups.items():
            groups[group] = tuple(dict.fromkeys((*groups.get(group, ()), *patterns)))
    return groups
