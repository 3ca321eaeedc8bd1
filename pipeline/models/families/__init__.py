"""Model families: what every stage needs to know about one architecture, declared once.

A family module (``qwen2_5_vl.py``, ``qwen3_vl.py``, …) registers one :class:`Family` per
``model_type`` of a checkpoint's ``config.json``, as the merge methods register themselves. The
stages ask the registry, never the architecture: freezing and LoRA's ``all`` (the parts, as
LLaMA-Factory names them), merge rules (the groups, by on-disk tensor name), the merge of mixture-of-
experts tensors (the fused expert tensors, merged expert by expert; the routers), lmms-eval's model
class, and the offline tiny model (``model.name_or_path: tiny:<model_type>``).
docs/guides/adding-a-model-family.md says how to add one.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

TINY = "tiny"  # model.name_or_path of the offline Qwen2.5-VL; "tiny:<model_type>" for another family
MODULES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "internvl")  # the family modules, imported on first use


@dataclass(frozen=True)
class Family:
    model_type: str
    # The parts ``model.freeze`` names, as LLaMA-Factory's composite model of this type: module paths
    # of the loaded model. The vision tower is ``vision`` without the projector.
    vision: str
    projector: tuple[str, ...]
    language: tuple[str, ...]
    # Merge rules' groups (``pipeline.merge.rules``): shell globs over on-disk tensor names.
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
    # Fused expert tensors (experts, out, in) on disk: a per-matrix method merges each expert alone.
    stacked_experts: tuple[str, ...] = ()
    # Packed micro batches (pipeline.data.packed): the transformers class whose ``get_rope_index``
    # gives an example's 3-D (t, h, w) positions, None for 1-D positions; the vision tower's inputs
    # that depend on the images' grids alone (vision config, grid_thw) -> kwargs, computed by the
    # loader's workers instead of inside the step.
    rope_index: str | None = None
    vision_inputs: Callable[[Any, Any], dict[str, Any]] | None = None

    @property
    def routers(self) -> tuple[str, ...]:
        return self.groups.get("router", ())

    def is_stacked_experts(self, name: str) -> bool:
        return any(fnmatchcase(name, p) for p in self.stacked_experts)

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


def stacked_experts(checkpoint: str | Path) -> Callable[[str], bool]:
    """Which tensors of a checkpoint folder are fused experts, by its family; none where its model
    type is not declared (a merge of any transformers checkpoint works, expert by expert only where
    a family says so)."""
    config = Path(checkpoint) / "config.json"
    if config.is_file():
        _load()
        family = FAMILIES.get(json.loads(config.read_text()).get("model_type"))
        if family is not None:
            return family.is_stacked_experts
    return lambda name: False


def is_tiny_name(name_or_path: str) -> bool:
    return name_or_path == TINY or name_or_path.startswith(TINY + ":")


def tiny_family(name_or_path: str) -> Family:
    """``tiny`` is Qwen2.5-VL (the paper's model); ``tiny:<model_type>`` that family."""
    model_type = name_or_path.partition(":")[2] or "qwen2_5_vl"
    return get_family(model_type, f"model.name_or_path {name_or_path}")


def checkpoint_prefixes() -> tuple[tuple[str, str], ...]:
    """Every family's (module prefix, on-disk prefix) pairs: a module's tensor is looked up under each
    spelling, and only one exists in a given checkpoint."""
    _load()
    return tuple(dict.fromkeys(pair for family in FAMILIES.values() for pair in family.stored_as))


def group_patterns() -> dict[str, tuple[str, ...]]:
    """Every family's merge-rule groups, united by name: tensor names never collide across families
    (Qwen2.5-VL stores ``visual.…``, Qwen3-VL ``model.visual.…``), so one rule serves them all."""
    _load()
    groups: dict[str, tuple[str, ...]] = {}
    for family in FAMILIES.values():
        for group, patterns in family.groups.items():
            groups[group] = tuple(dict.fromkeys((*groups.get(group, ()), *patterns)))
    return groups
