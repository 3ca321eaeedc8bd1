"""Per-tensor method choice: an ordered list of rules, the first whose pattern matches wins.

Patterns are shell globs over the tensor names *as stored on disk* (the safetensors keys of a
``save_pretrained`` folder, e.g. ``model.layers.3.mlp.up_proj.weight``, ``visual.merger.mlp.0.weight``),
not the in-memory ``state_dict`` names, which differ for Qwen2.5-VL in transformers 5. A rule may
name a preset group of Qwen2.5-VL instead of a pattern.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from pipeline.merge.registry import MergeMethod, MethodParams, get_method

# The natural parameter groups of Qwen2.5-VL, by on-disk name.
QWEN2_5_VL_GROUPS: dict[str, tuple[str, ...]] = {
    "embeddings": ("model.embed_tokens.*",),
    "lm_head": ("lm_head.*",),
    "vision_tower": ("visual.patch_embed.*", "visual.blocks.*"),
    "merger": ("visual.merger.*",),
    "language_blocks": ("model.layers.*", "model.norm.*"),
}


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pattern: str | None = None
    group: str | None = None
    method: str
    params: dict[str, Any] = {}

    @model_validator(mode="after")
    def _one_selector(self) -> Rule:
        if (self.pattern is None) == (self.group is None):
            raise ValueError("a rule needs exactly one of 'pattern' or 'group'")
        if self.group is not None and self.group not in QWEN2_5_VL_GROUPS:
            raise ValueError(f"unknown group '{self.group}'; known: {sorted(QWEN2_5_VL_GROUPS)}")
        get_method(self.method).validate(self.params)
        return self

    @property
    def patterns(self) -> tuple[str, ...]:
        return QWEN2_5_VL_GROUPS[self.group] if self.group else (self.pattern,)

    def matches(self, name: str) -> bool:
        return any(fnmatchcase(name, p) for p in self.patterns)


def rules_for(method: str | None, params: dict[str, Any], rules: list[Rule] | None) -> list[Rule]:
    """The rules of a merge given as one method for every tensor, or as rules."""
    return rules if rules is not None else [Rule(pattern="*", method=method, params=params)]


def choose(name: str, rules: list[Rule]) -> tuple[MergeMethod, MethodParams]:
    for rule in rules:
        if rule.matches(name):
            method = get_method(rule.method)
            return method, method.validate(rule.params)
    raise ValueError(f"tensor {name}: no merge rule matches (add a catch-all rule with pattern '*')")
