"""The report's first table, the MERIT paper's (Table 2): lmms-eval benchmarks none of the models
trained on as columns, their average, and θ0, the joint baseline, every merge on MERIT's split
and on each control's (Random-K) split, the DiLoCo finals as rows; each row's difference to the
joint baseline and, for a merge on MERIT's split, to the same merge on the control's split.
Derived from the scores ``collect`` read (``eval/benchmarks/<model>/scores.json``, current ones only).
"""

from __future__ import annotations

from typing import Any

from pipeline.config import RunConfig
from pipeline.data.benchmark import TASKS as TOY_TASKS
from pipeline.report.quality import merge_label


def benchmark_section(
    cfg: RunConfig,
    models: list[dict[str, Any]],
    scores: dict[str, dict[str, Any]],
    controls: dict[str, tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]],
) -> dict[str, Any] | None:
    """Rows, a markdown-ready table and the verdict in words; None when no model has scores.
    ``scores``: each model's current scores.json; ``controls``: each control's models and scores."""
    tasks, k = cfg.eval.benchmarks, cfg.branch_count
    labels = {"theta0": "θ0"} | {f"merged-{entry.name}": merge_label(entry) for entry in cfg.merge.methods}
    found = _rows(models, scores, labels, f"MERIT-{k}")
    for name, (theirs, their_scores) in controls.items():
        merged = [m for m in theirs if m["kind"] == "merged"]
        found += _rows(merged, their_scores, labels, f"{name.capitalize()}-{k}")
    if not tasks or not found:
        return None
    # θ0 and joint first, then each merge on MERIT's split beside the controls', then the rest.
    order = ["theta0", "joint", *labels]
    rows = sorted(found, key=lambda r: order.index(r["model"]) if r["model"] in order else len(order))
    joint = next((r for r in rows if r["model"] == "joint"), None)
    for row in rows:
        if joint and row is not joint:
            row["vs_joint"] = row["average"] - joint["average"]
        control = next((r for r in rows if r["model"] == row["model"] and r["split"] != row["split"]), None)
        if control and row["split"] == f"MERIT-{k}":
            row["vs_control"] = row["average"] - control["average"]
    return {"tasks": tasks, "rows": rows, "table": _table(rows, tasks, k), "verdict": verdict(rows, k)}


def _rows(
    models: list[dict[str, Any]], scores: dict[str, dict[str, Any]], labels: dict[str, str], split: str
) -> list[dict[str, Any]]:
    return [
        {
            "model": m["name"],
            "label": labels.get(m["name"], m["name"]),
            "kind": m["kind"],
            "split": split if m["kind"] in ("merged", "branch") else "—",
            **{task: s["score"] for task, s in scores[m["name"]]["tasks"].items()},
            "average": scores[m["name"]]["average"],
        }
        for m in models
        if m["name"] in scores  # not benchmarked, or weights replaced since: not in the scores
    ]


def _table(rows: list[dict[str, Any]], tasks: list[str], k: int) -> dict[str, Any]:
    """Scores to one decimal, as the paper prints them; differences signed."""
    headers = ["model", "split", *tasks, "average", "Δ vs joint", f"Δ vs Random-{k}"]
    cells = []
    for row in rows:
        scores = [f"{row[key]:.1f}" for key in [*tasks, "average"]]
        deltas = [f"{row[key]:+.1f}" if key in row else "" for key in ("vs_joint", "vs_control")]
        cells.append([row["label"], row["split"], *scores, *deltas])
    return {"headers": headers, "rows": cells}


def verdict(rows: list[dict[str, Any]], k: int) -> str:
    """The headline sentence: the best merge on MERIT's split against the joint baseline, θ0 and
    the same merge on the control's split, by benchmark average."""
    merit = [r for r in rows if r["kind"] == "merged" and r["split"] == f"MERIT-{k}"]
    if not merit:
        return ""
    best = max(merit, key=lambda r: r["average"])
    by_name = {r["model"]: r for r in rows if r["split"] == "—"}
    parts = [f"{by_name[n]['label']} {by_name[n]['average']:.2f}" for n in ("theta0", "joint") if n in by_name]
    if "vs_control" in best:
        parts.append(f"the same merge on Random-{k} {best['average'] - best['vs_control']:.2f}")
    against = f" against {', '.join(parts)}" if parts else ""
    wins = sum(r.get("vs_control", 0) > 0 for r in merit)
    compared = sum("vs_control" in r for r in merit)
    tally = f"; MERIT-{k} beats Random-{k} for {wins} of {compared} merges" if compared else ""
    return f"Best merge on MERIT-{k}: **{best['label']}**, benchmark average **{best['average']:.2f}**{against}{tally}."


def stand_ins(tasks: list[str]) -> str:
    """Which of the paper's benchmarks each toy task stands for, in words ('' without toy tasks)."""
    toys = [f"`{t}` ({TOY_TASKS[t].stands_for})" for t in tasks if t in TOY_TASKS]
    return "The built-in corpus's tasks stand for the paper's benchmarks: " + ", ".join(toys) + "." if toys else ""
