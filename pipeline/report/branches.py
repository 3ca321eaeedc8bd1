"""The report's branches, derived: each training's row (data, steps, tokens, time, last loss,
LoRA facts), the training budget, and the weights the merges gave the branches.

Merge weights: each merge's are those its manifest's spec lists (``tokens`` n_k or ``weight``
per model, normalised as the merge normalised them), shown per merge (``merge_weights``). The
branches' single "merge weight" column takes them from the first token-weighted merge of the
config, else from the first merge that recorded weights at all (equal weighting, say). Only a
run no merge has recorded weights for yet (not merged yet, or merged by a version whose manifest
lacks the spec's models) falls back to n_k / Σ n_j of the data manifest as it is now, the
weights a token-weighted merge would use, and the markdown says so.
"""

from __future__ import annotations

from typing import Any

from pipeline.config import RunConfig
from pipeline.report.collect import Merge, Training


def branch_rows(trainings: list[Training]) -> list[dict[str, Any]]:
    """Each training that has written something: its data, steps, tokens, time, last loss."""
    rows = []
    for t in trainings:
        final, records = t.final, t.metrics
        if not final and not records:
            continue  # started but nothing written yet
        last = records[-1] if records else {}
        rows.append(
            {
                "name": t.name,
                "kind": t.kind,
                "dir": t.dir,
                "sources": t.spec_sources if t.spec_sources is not None else final.get("sources", []),
                "tokens": final.get("tokens_seen", last.get("tokens")),
                "examples": final.get("examples_seen", last.get("examples")),
                "steps": final.get("step", last.get("step")),
                "train_seconds": final["train_seconds"] if "train_seconds" in final else train_seconds(records),
                "last_loss": last.get("loss"),
            }
            | adapter_facts(t)
        )
    return rows


def adapter_facts(t: Training) -> dict[str, Any]:
    """A LoRA branch's rank, modules, trainable parameters and adapter bytes."""
    lora = t.final.get("lora")
    if not lora:
        return {}
    return {
        "lora": {k: lora[k] for k in ("rank", "alpha", "modules", "modules_to_save")},
        "trainable_parameters": lora["trainable_parameters"],
        "adapter_mb": (t.adapter_bytes or 0) / 1e6,
    }


def train_seconds(records: list[dict[str, Any]]) -> float | None:
    """Cumulative training seconds from ``metrics.jsonl``: the last ``elapsed_s``, or for older
    files (without it) the sum of each step's new tokens over its throughput."""
    if not records:
        return None
    if "elapsed_s" in records[-1]:
        return float(records[-1]["elapsed_s"])
    seconds, previous = 0.0, 0
    for r in records:
        if r.get("tokens_per_s"):
            seconds += (r["tokens"] - previous) / r["tokens_per_s"]
        previous = r["tokens"]
    return seconds


def merge_weights(merges: list[Merge]) -> dict[str, dict[str, Any]]:
    """Per merge that recorded its models: how it weighted them ("tokens": n_k; "equal"; "given")
    and the normalised weight of each, by model name, as the merge computed them
    (``MergeSpec.normalized_weights``: each model's tokens, else its weight, else 1, over their sum)."""
    found = {}
    for merge in merges:
        entries = merge.models
        if not entries:
            continue
        total = sum(e.raw_weight for e in entries.values())
        if all(e.tokens is not None for e in entries.values()):
            weighting = "tokens"
        elif all(e.weight is None for e in entries.values()):
            weighting = "equal"
        else:
            weighting = "given"
        found[merge.name] = {"weighting": weighting, "weights": {n: e.raw_weight / total for n, e in entries.items()}}
    return found


def column_weights(weights: dict[str, dict[str, Any]]) -> dict[str, float] | None:
    """The branches' one "merge weight" column: the first token-weighted merge's, else the first
    merge's that recorded weights; None when none did."""
    chosen = next((w for w in weights.values() if w["weighting"] == "tokens"), next(iter(weights.values()), None))
    return chosen["weights"] if chosen else None


def budget_and_weights(
    branches: list[dict[str, Any]], sources: dict[str, dict[str, Any]], weights: dict[str, dict[str, Any]]
) -> None:
    """Each training's data (examples, tokens) and the passes over it; for the branches, the merge
    weight (``column_weights``; without a merge that recorded one, n_k / Σ n_j with n_k the tokens
    of the group's training data as prepared now) and, for contrast, the weight by tokens seen."""
    for b in branches:
        b["data_examples"] = sum(sources.get(s, {}).get("train_examples", 0) for s in b["sources"])
        b["data_tokens"] = sum(sources.get(s, {}).get("train_tokens", 0) for s in b["sources"])
        b["epochs"] = b["examples"] / b["data_examples"] if b["examples"] and b["data_examples"] else None
    groups = [b for b in branches if b["kind"] == "branch"]
    recorded = column_weights(weights)
    if recorded is None:
        total = sum(g["data_tokens"] for g in groups)
        recorded = {g["name"]: g["data_tokens"] / total for g in groups} if total else {}
    seen = [g["tokens"] for g in groups]  # what weighting by tokens seen would give, for contrast
    for b in groups:
        if b["name"] in recorded:
            b["merge_weight"] = recorded[b["name"]]
            b["weight_by_tokens_seen"] = b["tokens"] / sum(seen) if all(seen) else None


def budget(cfg: RunConfig) -> dict[str, Any]:
    t = cfg.train
    batch = {"global_batch": t.global_batch(), "batch": t.batch_text()}
    if t.steps:
        return {"steps": t.steps, "joint_steps": cfg.branch_count * t.steps} | batch
    return {"epochs": t.epochs} | batch
