"""``merit bench quality``: does the conflict-aware split pay off? On the built-in corpus, with one
token budget for all: θ0, the joint baseline (1 and 2 epochs), and each merge on MERIT's split
beside the same merge on a Random-K split, for K = 2 and 4, both conflict kinds, several seeds
(mean ± std). Then one factor at a time, from the first kind's first seed: how merge-ready θ0 is
(warm-up steps), the branches' learning rate and epochs, and the model's width.

Every case is the real ``merit`` flow (Prefect, DeepSpeed branches, the merge library, the
evaluation) on a run directory of its own under ``--workdir``; a case that changes neither data
nor θ0 (K, learning rate, epochs) links to its base case's data and θ0 instead of remaking them.
A finished case is not recomputed: rerunning the bench after an interruption continues it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean, stdev
from typing import Any

from pipeline.config import load_config
from pipeline.controls import SPLIT_OF, control_dir, linked_run
from pipeline.data.builtin import CONFLICTS
from pipeline.layout import CALIBRATION, REPORT, start_run
from pipeline.report import markdown_table
from pipeline.report.plots import plot_quality
from pipeline.report.quality import ROLES

METRICS = ("loss", *(f"accuracy_{r}" for r in ROLES))
# factor: (what it shows, its levels as overrides, whether a level remakes θ0)
FACTORS: dict[str, tuple[str, dict[str, list[str]], bool]] = {
    "warmup": (
        "warm-up steps: how merge-ready θ0 is",
        {"0": ["warmup.steps=0"], "100": ["warmup.steps=100"], "1000": ["warmup.steps=1000"]},
        True,
    ),
    "lr": ("branch learning rate", {"3e-4": ["train.lr=3.0e-4"], "3e-3": ["train.lr=3.0e-3"]}, False),
    "epochs": ("branch epochs (the joint baseline's as well)", {"2": ["train.epochs=2"]}, False),
    "width": (
        "model width (hidden size; intermediate 2×)",
        {
            "128": ["model.tiny.hidden_size=128", "model.tiny.intermediate_size=256"],
            "256": ["model.tiny.hidden_size=256", "model.tiny.intermediate_size=512"],
        },
        True,
    ),
}


@dataclass
class Case:
    """One run directory of the bench: a flow on a config plus overrides, optionally sharing the
    data and θ0 of an earlier case."""

    name: str
    overrides: list[str]
    labels: dict[str, Any]
    base: str | None = None
    flow: str = "merit"
    rows: list[dict[str, Any]] = field(default_factory=list)


def plan_cases(args: argparse.Namespace) -> list[Case]:
    common = [*args.overrides, "flow.controls=[random]"]
    # The warm-up trains at train.lr unless warmup.lr is set: then a learning-rate level remakes θ0.
    lr_keeps_theta0 = load_config(args.config, args.overrides).warmup.lr is not None
    cases = []
    for kind in args.kinds:
        for seed in args.seeds:
            base = f"{kind}-s{seed}"
            sets = [*common, f"run.seed={seed}", f"data.builtin.conflicts={kind}"]
            labels = {"kind": kind, "seed": seed}
            ks = sorted(args.k)
            cases.append(Case(base, [*sets, f"calibration.r={_r(ks[0])}"], labels | {"K": ks[0]}))
            cases += [
                Case(
                    f"{base}-k{k}",
                    [*sets, f"calibration.r={_r(k)}", "flow.joint_baseline=false"],
                    labels | {"K": k},
                    base,
                )
                for k in ks[1:]
            ]
            cases.append(Case(f"{base}-joint2", [*sets, "train.epochs=2"], labels | {"joint_epochs": 2}, base, "joint"))
    first, k = f"{args.kinds[0]}-s{args.seeds[0]}", min(args.k)  # factors: from the first base case, at its K
    for factor in args.factors:
        _, levels, fresh = FACTORS[factor]
        fresh = fresh or (factor == "lr" and not lr_keeps_theta0)
        sets = [
            *common,
            f"run.seed={args.seeds[0]}",
            f"data.builtin.conflicts={args.kinds[0]}",
            f"calibration.r={_r(k)}",
        ]
        for level, overrides in levels.items():
            labels = {"factor": factor, "level": level, "K": k}
            cases.append(Case(f"{factor}-{level}", [*sets, *overrides], labels, None if fresh else first))
    return cases


def _r(k: int) -> int:
    if k < 2 or k & (k - 1):
        raise ValueError(f"K must be a power of two ≥ 2, got {k}")
    return k.bit_length() - 1


def run_case(case: Case, config: str, workdir: Path) -> None:
    """The case's flow on its run directory (a no-op for the stages already done)."""
    from flows.merit import joint, merit

    run_dir = workdir / case.name
    if case.base:
        linked_run(load_config(config, case.overrides), workdir / case.base, run_dir)
    else:
        start_run(config, case.overrides, run_dir)
    {"merit": merit, "joint": joint}[case.flow](config=None, run_dir=str(run_dir))
    case.rows = case_rows(run_dir, case)


def case_rows(run_dir: Path, case: Case) -> list[dict[str, Any]]:
    """θ0, joint and the merges of one case, from its report, labelled with the case."""
    report = json.loads((run_dir / REPORT / "report.json").read_text())
    if case.flow == "joint":
        joint = next(m for m in report["models"] if m["name"] == "joint")
        return [case.labels | {"model": "joint", "split": "—"} | _figures(joint)]
    barriers = report.get("quality", {}).get("barriers", {})
    k = case.labels["K"]
    apart = {f"MERIT-{k}": pairs_apart(run_dir)}
    apart |= {f"{name.capitalize()}-{k}": pairs_apart(control_dir(run_dir, name)) for name in SPLIT_OF}
    return [
        case.labels | r | {"barrier": barriers.get(r["split"]), "pairs_apart": apart.get(r["split"])}
        for r in report.get("quality", {}).get("rows", [])
        if r["model"] != "theta0" or case.base is None  # θ0 once per θ0 made
    ]


def pairs_apart(run_dir: Path) -> int | None:
    """How many of the built-in corpus's designed conflict pairs the run's split puts in different groups."""
    path = run_dir / CALIBRATION / "split.json"
    if not path.is_file():
        return None
    group = {s: g for g, sources in enumerate(json.loads(path.read_text())["groups"]) for s in sources}
    return sum(group[a] != group[b] for a, b in CONFLICTS if a in group and b in group)


def _figures(model: dict[str, Any]) -> dict[str, Any]:
    roles = model.get("roles", {})
    return {"loss": model["loss"], **{f"accuracy_{r}": roles[r].get("accuracy") for r in ROLES if r in roles}}


def aggregate(rows: list[dict[str, Any]], by: tuple[str, ...]) -> list[dict[str, Any]]:
    """Mean and std over seeds of every metric, per distinct ``by`` key, in first-seen order."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row.get(k) for k in by), []).append(row)
    out = []
    for key, members in groups.items():
        agg = {k: v for k, v in zip(by, key) if v is not None} | {"seeds": len(members)}
        for metric in (*METRICS, "barrier", "distance", "pairs_apart"):
            values = [m[metric] for m in members if m.get(metric) is not None]
            if values:
                agg[metric] = mean(values)
                agg[f"{metric}_std"] = stdev(values) if len(values) > 1 else 0.0
        out.append(agg)
    return out


def _pm(row: dict[str, Any], metric: str, scale: float = 1.0) -> str:
    if metric not in row:
        return ""
    return f"{scale * row[metric]:.3f} ± {scale * row[f'{metric}_std']:.3f}"


def main_table(rows: list[dict[str, Any]]) -> str:
    """Per kind: one line per model and split, mean ± std over seeds."""
    headers = [
        "model",
        "split",
        "held-out loss",
        *(f"accuracy, {r} (%)" for r in ROLES),
        "barrier",
        f"pairs apart (of {len(CONFLICTS)})",
    ]
    lines = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        agg = aggregate(mine, ("model", "split", "joint_epochs"))
        table = [
            [
                a["model"] + (" (2 epochs)" if a.get("joint_epochs") else ""),
                a["split"],
                _pm(a, "loss"),
                *(_pm(a, f"accuracy_{r}", 100) for r in ROLES),
                _pm(a, "barrier"),
                f"{a['pairs_apart']:.1f}" if "pairs_apart" in a else "",
            ]
            for a in agg
        ]
        seeds = max(a["seeds"] for a in agg)
        lines.append(f"**{kind} conflicts**, {seeds} seed(s):\n\n" + markdown_table(headers, table))
    return "\n\n".join(lines)


def factor_table(rows: list[dict[str, Any]], factor: str, base: list[dict[str, Any]]) -> str:
    """One line per level (the base case's first): loss and trained accuracy of θ0, joint and each
    merge as ``MERIT / Random``, at the base case's K."""
    levels = {"base": base}
    levels |= {level: [r for r in rows if r.get("level") == level] for level in FACTORS[factor][1]}
    merges = list(dict.fromkeys(r["merge"] for r in rows + base if "merge" in r))
    headers = ["level", "θ0", "joint", *merges]
    out = []
    for metric, scale in (("loss", 1), ("accuracy_trained", 100)):
        table = []
        for level, got in levels.items():
            by = {(r["model"] if "merge" not in r else r["merge"], r["split"]): r for r in got}
            cells = [_cell(by.get(("theta0", "—")), metric, scale), _cell(by.get(("joint", "—")), metric, scale)]
            for merge in merges:
                pair = [v for (m, split), v in by.items() if m == merge and split != "—"]
                cells.append(" / ".join(_cell(v, metric, scale) for v in pair))
            table.append([level, *cells])
        k = base[0]["K"]
        out.append(
            f"{metric.replace('_', ', ')} (merges: MERIT-{k} / Random-{k}):\n\n" + markdown_table(headers, table)
        )
    return f"**{FACTORS[factor][0]}**\n\n" + "\n\n".join(out)


def _cell(row: dict[str, Any] | None, metric: str, scale: float) -> str:
    return "" if row is None or row.get(metric) is None else f"{scale * row[metric]:.3f}"


def main(args: argparse.Namespace) -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")  # the figures, not every task's log
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    workdir = Path(args.workdir)
    cases = plan_cases(args)
    start = time.perf_counter()
    for n, case in enumerate(cases, 1):
        began = time.perf_counter()
        run_case(case, args.config, workdir)
        print(f"[{n}/{len(cases)}] {case.name}: {time.perf_counter() - began:.0f} s", flush=True)
    main_rows = [r for c in cases if "factor" not in c.labels for r in c.rows]
    text = [f"## Quality: `merit {' '.join(sys.argv[1:])}`", "", main_table(main_rows)]
    first = cases[0].rows  # the first base case
    for factor in args.factors:
        rows = [r for c in cases if c.labels.get("factor") == factor for r in c.rows]
        text += ["", factor_table(rows, factor, first)]
    minutes = (time.perf_counter() - start) / 60
    text += ["", f"{len(cases)} cases in {minutes:.1f} min (a case finished before is reused, not rerun)."]
    (workdir / "quality.md").write_text("\n".join(text) + "\n")
    (workdir / "quality.json").write_text(json.dumps([r for c in cases for r in c.rows], indent=1))
    for kind in args.kinds:
        agg = aggregate([r for r in main_rows if r["kind"] == kind], ("model", "split", "merge", "joint_epochs"))
        plot_quality([a for a in agg if not a.get("joint_epochs")], workdir / f"quality-{kind}.png")
    print("\n".join(text))
    print(f"\nwritten: {workdir / 'quality.md'}, quality.json, quality-<kind>.png")
