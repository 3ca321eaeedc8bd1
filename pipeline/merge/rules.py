"""Per-tensor method choice: an ordered list of rules, the first whose pattern matches wins.

Patterns are shell globs over a tensor's names: as θ0's files store it (e.g. Qwen2.5-VL's
``model.layers.3.mlp.up_proj.weight``, ``visual.merger.mlp.0.weight``) or as the model's modules name it
(``model.language_model.layers.3.mlp.up_proj.weight``); a rule matches either. An expert's matrix is a
tensor of its own, ``…mlp.experts.<e>.gate_proj.weight`` (``up_proj``, ``down_proj``), whether its
checkpoint stores it so or fused into ``…mlp.experts.gate_up_proj`` (``pipeline.merge.layout``). A rule may
name a group instead of a pattern: each model family declares its groups (``embeddings``, ``lm_head``,
``vision_tower``, ``merger``, ``language_blocks``; ``experts`` and ``router`` for mixtures of experts) in
``pipeline.models.families``, and a group matches its tensors in every family.

A merge given as one method for every tensor merges routers by the weighted average: a router scores
experts against each other, and a per-matrix method (Iso-C, TSV) would rescale scores the experts
were trained to compete on. Rules that want otherwise name the ``router`` group.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from pipeline.merge.registry import MergeMethod, MethodParams, get_method


def groups() -> dict[str, tuple[str, ...]]:
    from pipeline.models.families import group_patterns  # the families' modules import the config, which imports this

    return group_patterns()


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pattern: str | None = None  # a shell glob over a tensor's names (as stored, or as its module names it)
    group: str | None = None  # or a group the model families declare (embeddings, lm_head, vision_tower, router...)
    method: str  # the merge method of the tensors it matches
    params: dict[str, Any] = {}  # that method's parameters

    @model_validator(mode="after")
    def _one_selector(self) -> Rule:
        if (self.pattern is None) == (self.group is None):
            raise ValueError("a rule needs exactly one of 'pattern' or 'group'")
        if self.group is not None and self.group not in groups():
            raise ValueError(f"unknown group '{self.group}'; known: {sorted(groups())}")
        get_method(self.method).validate(self.params)
        return self

    @property
    def patterns(self) -> tuple[str, ...]:
        return groups()[self.group] if self.group else (self.pattern,)

    def matches(self, name: str) -> bool:
        return any(fnmatchcase(name, p) for p in self.patterns)


def rules_for(method: str | None, params: dict[str, Any], rules: list[Rule] | None) -> list[Rule]:
    """The rules of a merge given as one method for every tensor (routers averaged), or as rules."""
    if rules is not None:
        return rules
    return [Rule(group="router", method="weighted_average"), Rule(pattern="*", method=method, params=params)]


def choose(names: str | tuple[str, ...], rules: list[Rule]) -> tuple[MergeMethod, MethodParams]:
    """The method of the first rule matching one of a tensor's ``names`` (as stored, as its module names it)."""
    names = (names,) if isinstance(names, str) else names
    for rule in rules:
        if any(rule.matches(name) for name in names):
            method = get_method(rule.method)
            return method, method.validate(rule.params)
    raise ValueError(f"tensor {names[0]}: no merge rule matches (add a catch-all rule with pattern '*')")
