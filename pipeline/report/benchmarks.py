"""The report's first table, the MERIT paper's (Table 2): lmms-eval benchmarks none of the models
trained on as columns, their average, and θ0, the joint baseline, every merge on MERIT's split
and on each control's (Random-K) split, the DiLoCo finals as rows; each row's difference to the
joint baseline and, for a merge on MERIT's split, to the same merge on the control's split; the
toy tasks' constant-answer baseline first. Derived from the scores ``collect`` read (the jobs'
``eval/benchmarks/<model>/<task>/score.json``, those of each model's current weights).
"""

from __future__ import annotations

from typing import Any

from pipeline.config import RunConfig
from pipeline.data.benchmark import TASKS as TOY_TASKS
from pipeline.eval.benchmarks import CONSTANT, benchmark_tasks
from pipeline.layout import tuned_name
from pipeline.report.quality import merge_label, tuned_label

CONSTANT_NOTE = (
    " The *constant answer* row answers every question of a toy task with the task's best single answer"
    " (a letter, word or number; for `toy_chat` one reference sentence, rated by the judge):"
    " a model scores above it only with the skill the task asks for."
)


def benchmark_section(
    cfg: RunConfig,
    models: list[dict[str, Any]],
    scores: dict[str, dict[str, Any]],
    controls: dict[str, tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]],
) -> dict[str, Any] | None:
    """Rows, a markdown-ready table, the verdict in words and notes (how a group was scored, the
    judge's failures, the jobs that got no score); None when no model has scores. ``scores``: each
    model's current scores (``read_scores``), the constant baseline's under ``constant``;
    ``controls``: each control's models and scores."""
    tasks, k = benchmark_tasks(cfg), cfg.branch_count
    labels = {"theta0": "θ0"} | {f"merged-{entry.name}": merge_label(entry) for entry in cfg.merge.methods}
    labels |= {tuned_name(cfg): tuned_label(e) for e in cfg.merge.methods if e.name == cfg.merge.search.merge}
    found = _rows(models, scores, labels, f"MERIT-{k}")
    for name, (theirs, their_scores) in controls.items():
        merged = [m for m in theirs if m["kind"] == "merged"]
        found += _rows(merged, their_scores, labels, f"{name.capitalize()}-{k}")
    if not tasks or not found:
        return None
    # θ0 and joint first, then each merge on MERIT's split beside the controls', then the rest.
    order = ["theta0", "joint", *labels]
    rows = sorted(found, key=lambda r: order.index(r["model"]) if r["model"] in order else len(order))
    if CONSTANT in scores:  # first: the floor every model is read against
        rows.insert(0, _row(CONSTANT, "constant answer", "baseline", "—", scores[CONSTANT]))
    joint = next((r for r in rows if r["model"] == "joint" and r["average"] is not None), None)
    for row in rows:
        if row["average"] is None:
            continue
        if joint and row is not joint and row["kind"] != "baseline":
            row["vs_joint"] = row["average"] - joint["average"]
        control = next((r for r in rows if r["model"] == row["model"] and r["split"] != row["split"]), None)
        if control and control["average"] is not None and row["split"] == f"MERIT-{k}":
            row["vs_control"] = row["average"] - control["average"]
    everyone = scores | {f"{c}/{m}": s for c, (_, theirs) in controls.items() for m, s in theirs.items()}
    return {
        "tasks": tasks,
        "rows": rows,
        "table": _table(rows, tasks, k),
        "verdict": verdict(rows, k),
        "notes": notes(everyone),
    }


def _rows(
    models: list[dict[str, Any]], scores: dict[str, dict[str, Any]], labels: dict[str, str], split: str
) -> list[dict[str, Any]]:
    return [
        _row(
            m["name"],
            labels.get(m["name"], m["name"]),
            m["kind"],
            split if m["kind"] in ("merged", "branch") else "—",
            scores[m["name"]],
        )
        for m in models
        if m["name"] in scores  # not benchmarked, or weights replaced since: not in the scores
    ]


def _row(model: str, label: str, kind: str, split: str, scores: dict[str, Any]) -> dict[str, Any]:
    """A model's scores per task (a task without one: no key) and their average (None unless every task has one)."""
    figures = {task: s["score"] for task, s in scores["tasks"].items()}
    return {"model": model, "label": label, "kind": kind, "split": split, **figures, "average": scores["average"]}


def _table(rows: list[dict[str, Any]], tasks: list[str], k: int) -> dict[str, Any]:
    """Scores to one decimal, as the paper prints them; differences signed; "—" where a job got no score."""
    headers = ["model", "split", *tasks, "average", "Δ vs joint", f"Δ vs Random-{k}"]
    cells = []
    for row in rows:
        scores = [f"{row[key]:.1f}" if row.get(key) is not None else "—" for key in [*tasks, "average"]]
        deltas = [f"{row[key]:+.1f}" if key in row else "" for key in ("vs_joint", "vs_control")]
        cells.append([row["label"], row["split"], *scores, *deltas])
    return {"headers": headers, "rows": cells}


def verdict(rows: list[dict[str, Any]], k: int) -> str:
    """The headline sentence: the best merge on MERIT's split against the joint baseline, θ0 and
    the same merge on the control's split, by benchmark average."""
    merit = [r for r in rows if r["kind"] == "merged" and r["split"] == f"MERIT-{k}" and r["average"] is not None]
    if not merit:
        return ""
    best = max(merit, key=lambda r: r["average"])
    by_name = {r["model"]: r for r in rows if r["split"] == "—" and r["average"] is not None}
    parts = [f"{by_name[n]['label']} {by_name[n]['average']:.2f}" for n in ("theta0", "joint") if n in by_name]
    if "vs_control" in best:
        parts.append(f"the same merge on Random-{k} {best['average'] - best['vs_control']:.2f}")
    against = f" against {', '.join(parts)}" if parts else ""
    wins = sum(r.get("vs_control", 0) > 0 for r in merit)
    compared = sum("vs_control" in r for r in merit)
    tally = f"; MERIT-{k} beats Random-{k} for {wins} of {compared} merges" if compared else ""
    return f"Best merge on MERIT-{k}: **{best['label']}**, benchmark average **{best['average']:.2f}**{against}{tally}."


def notes(scores: dict[str, dict[str, Any]]) -> list[str]:
    """What a reader must know to read the table: how each group without an aggregate was scored,
    each judge's failed judgements (under ``eval.judge.max_failures``), each job without a score
    (a failed re-run named as such), each earlier score left out because its settings differ."""
    found = []
    groups = {task: list(s["parts"]) for m in scores.values() for task, s in m["tasks"].items() if "parts" in s}
    for group, parts in groups.items():
        found.append(
            f"`{group}` is a group lmms-eval reports no aggregate for: its score is the mean of "
            f"{', '.join(f'`{p}`' for p in parts)}, weighted by their numbers of examples."
        )
    for model, s in scores.items():
        for task, count in s.get("judge_failures", {}).items():
            if count:
                found.append(f"{model}, `{task}`: {count} failed judgements (within eval.judge.max_failures).")
        stale = s.get("stale", {})
        for task, failure in s.get("failed", {}).items():
            if task in stale:
                found.append(
                    f"{model}, `{task}`: no score: the re-run under this run's settings failed: {failure['error']}"
                )
            else:
                found.append(f"{model}, `{task}`: no score: {failure['error']}")
        for task, old in stale.items():
            found.append(
                f"{model}, `{task}`: an earlier score, {old['score']:.1f}, is kept on disk but not shown: "
                f"it was scored with another {', '.join(old['differs'])} than this run's."
            )
    return found


def stand_ins(tasks: list[str]) -> str:
    """Which of the paper's benchmarks each toy task stands for, in words ('' without toy tasks)."""
    toys = [f"`{t}` ({TOY_TASKS[t].stands_for})" for t in tasks if t in TOY_TASKS]
    return "The built-in corpus's tasks stand for the paper's benchmarks: " + ", ".join(toys) + "." if toys else ""
