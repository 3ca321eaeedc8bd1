"""The report's answer to "did the split pay off?": θ0, the joint baseline, and every merge on
MERIT's split beside the same merge on each control's split (Random-K), with held-out loss,
exact-match accuracy on the trained, unseen and retention sources, the distance from θ0 and the
loss barrier between the branches; the differences MERIT − control and MERIT − joint in words.
"""

from __future__ import annotations

from typing import Any

from pipeline.config import EVALUATED_ROLES as ROLES
from pipeline.config import MergeEntry, RunConfig
from pipeline.layout import tuned_name
from pipeline.merge.registry import get_method

SCALED = ("iso_c", "iso_cts")  # whose scale the report must state: it is not the paper's by default


def merge_label(entry: MergeEntry) -> str:
    """A merge as the report names it: its method and the parameters it was given; the scale of
    Iso-C always, since ours applies to the mean update (1/K of the paper's sum form)."""
    if entry.method is None:
        return f"{entry.name} (per-group rules)"
    params = dict(entry.params)
    if entry.method in SCALED:
        params.setdefault("scale", get_method(entry.method).validate({}).scale)
    shown = ", ".join(f"{k} {v}" for k, v in params.items())
    name = entry.name if entry.name == entry.method else f"{entry.name}: {entry.method}"
    return f"{name} ({shown})" if shown else name


def tuned_label(entry: MergeEntry) -> str:
    """The label of the merge ``merge.search`` chose for ``entry``."""
    return f"{merge_label(entry)}, weights searched"


def quality_section(
    cfg: RunConfig,
    models: list[dict[str, Any]],
    controls: dict[str, list[dict[str, Any]]],
    diagnostics: dict[str, dict[str, Any]],
) -> dict[str, Any] | None:
    """Rows, a markdown-ready table, the differences in words and the barriers; None without a merge."""
    k = cfg.branch_count
    splits = {f"MERIT-{k}": ("merit", {m["name"]: m for m in models})}
    splits |= {f"{name.capitalize()}-{k}": (name, {m["name"]: m for m in ms}) for name, ms in controls.items()}
    by_name = splits[f"MERIT-{k}"][1]
    rows = [_row(by_name[n], n, "—", diagnostics.get("merit", {})) for n in ("theta0", "joint") if n in by_name]
    for entry in cfg.merge.methods:
        for split, (key, found) in splits.items():
            if m := found.get(f"merged-{entry.name}"):
                rows.append(_row(m, merge_label(entry), split, diagnostics.get(key, {})) | {"merge": entry.name})
            if entry.name == cfg.merge.search.merge and (m := found.get(tuned_name(cfg))):
                label = tuned_label(entry)
                rows.append(_row(m, label, split, diagnostics.get(key, {})) | {"merge": f"{entry.name}-tuned"})
    if not any("merge" in r for r in rows):
        return None
    barriers = {split: _barrier(diagnostics.get(key, {})) for split, (key, _) in splits.items()}
    barriers = {split: b for split, b in barriers.items() if b is not None}  # 0.0 is a result: no barrier
    return {
        "rows": rows,
        "table": _table(rows),
        "verdict": verdict(rows, list(splits), searched=not cfg.merge.search.tasks),
        "differences": _differences(rows, list(splits)),
        "barriers": barriers,
    }


def _row(model: dict[str, Any], label: str, split: str, diagnostics: dict[str, Any]) -> dict[str, Any]:
    roles = model.get("roles", {})
    distance = diagnostics.get("distance_from_theta0", {}).get(model["name"], {})
    return {
        "model": label,
        "split": split,
        "loss": model["loss"],
        **{f"accuracy_{role}": roles[role]["accuracy"] for role in ROLES if "accuracy" in roles.get(role, {})},
        "distance": 0.0 if model["name"] == "theta0" else distance.get("relative"),
    }


def _barrier(diagnostics: dict[str, Any]) -> float | None:
    return (diagnostics.get("barrier") or {}).get("barrier")  # None: fewer than two branches


def _table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    columns = {"model": "model", "split": "split", "loss": "held-out loss"}
    columns |= {f"accuracy_{r}": f"accuracy, {r}" for r in ROLES if any(f"accuracy_{r}" in row for row in rows)}
    columns["distance"] = "‖θ − θ0‖ / ‖θ0‖"
    return {
        "headers": list(columns.values()),
        "rows": [[_round(row.get(key)) for key in columns] for row in rows],
    }


def _round(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


def _differences(rows: list[dict[str, Any]], splits: list[str]) -> list[str]:
    """One line per merge: MERIT − each control and MERIT − joint, loss and accuracy points."""
    joint = next((r for r in rows if r["model"] == "joint"), None)
    lines = []
    for merge in dict.fromkeys(r["merge"] for r in rows if "merge" in r):
        mine = {r["split"]: r for r in rows if r.get("merge") == merge}
        merit = mine.get(splits[0])
        if merit is None:
            continue
        against = [(s, mine[s]) for s in splits[1:] if s in mine] + ([("joint", joint)] if joint else [])
        parts = [f"{splits[0]} − {name}: {_delta(merit, other)}" for name, other in against]
        if parts:
            lines.append(f"`{merge}`: " + "; ".join(parts))
    return lines


def _delta(a: dict[str, Any], b: dict[str, Any]) -> str:
    text = [f"loss {a['loss'] - b['loss']:+.4f}"]
    for role in ROLES:
        key = f"accuracy_{role}"
        if a.get(key) is not None and b.get(key) is not None:
            text.append(f"{role} accuracy {100 * (a[key] - b[key]):+.1f} pts")
    return ", ".join(text)


def verdict(rows: list[dict[str, Any]], splits: list[str], searched: bool = True) -> str:
    """The headline sentence: how often MERIT's split beats each control and the joint baseline.
    A merge whose weights were searched by held-out loss (``searched``) is not counted: the losses
    compared here are that search's own objective."""
    tuned = [r for r in rows if searched and r.get("merge", "").endswith("-tuned")]
    merges = [r for r in rows if "merge" in r and r["split"] == splits[0] and r not in tuned]
    if not merges:
        return ""
    words = []
    for control in splits[1:]:
        other = {r["merge"]: r for r in rows if r.get("split") == control}
        pairs = [(m, other[m["merge"]]) for m in merges if m["merge"] in other]
        if pairs:
            wins = sum(m["loss"] < o["loss"] for m, o in pairs)
            words.append(f"beats {control} by held-out loss for {wins} of {len(pairs)} merges")
    joint = next((r for r in rows if r["model"] == "joint"), None)
    if joint:
        wins = sum(m["loss"] < joint["loss"] for m in merges)
        words.append(f"beats the joint baseline for {wins} of {len(merges)}")
    if words and tuned:
        words[-1] += " (the merge whose weights were searched by held-out loss not counted)"
    return f"{splits[0]} " + "; ".join(words) + "." if words else ""
