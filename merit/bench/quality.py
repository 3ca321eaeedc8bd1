"""``merit bench quality``: does the conflict-aware split pay off, judged as the MERIT paper judges
it, on a toy where the paper's premises are measured first? Per kind of designed conflict (by
default ``opposed``) and seed: the four premises (:mod:`merit.bench.premises`: θ0 above each task's
constant answer, the designed pairs' cosines in C and the split, interference of a pair trained
together, the loss barrier), then θ0, the joint baseline (1 epoch, the branches' budget; other
budgets with ``--joint-epochs``) and each merge on MERIT's split beside the same merge on a
Random-K split, for K = 2, 4, 8, scored on the toy benchmark suite through lmms-eval (the
headline: the benchmark average, as the paper's Table 2), with the fine-tuning sources' held-out
loss and accuracy as secondary columns. Per seed, with the same θ0 and data: MERIT − Random and
MERIT − joint, their mean with a 95 % interval and a one-sided paired Wilcoxon p, as the paper
reports them. Optionally factors, one at a time from the base cases: calibration's PCA (centred
or not) and balance (samples or tokens), LoRA, how merge-ready θ0 is, the branches' learning
rate and epochs, the model's width.

Every case is the real flow (Prefect, DeepSpeed branches, the merge library, held-out evaluation,
lmms-eval) on a run directory of its own under ``--workdir``; a case that changes neither data
nor θ0 links to its base case's. θ0 is made once per kind (the ``theta0`` flow, at the config's
seed) and every seed fine-tunes it, as the paper fine-tunes one pre-trained model: seeds vary the
data, the calibration sample and the branches (``--no-shared-theta0``: a warm-up per seed).
Every seed runs the smallest K (every merge of the config), its Random-K control and the 1-epoch
joint baseline first, then the larger K (the token-weighted average only, MERIT's merge, and its
Random-K); ``--full-seeds N`` keeps the larger K, the control and the other joint budgets to the
first N seeds. A finished case is not recomputed:
rerunning the bench after an interruption continues it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean, stdev
from typing import Any

from merit.bench import premises
from pipeline.checkpoint import write_text_atomic
from pipeline.config import load_config
from pipeline.controls import SPLIT_OF, control_dir, linked_run
from pipeline.data.builtin import CONFLICT_KINDS, CONFLICTS
from pipeline.eval.benchmarks import BENCHMARKS, CONSTANT
from pipeline.layout import CALIBRATION, EVAL, REPORT, init_path, start_run
from pipeline.report import markdown_table
from pipeline.report.plots import plot_quality
from pipeline.report.quality import ROLES

CONSTANT_LABEL = "constant answer"
MERIT_MERGE = "token_average"  # the merge of the larger K, and of the factor cases
SECONDARY = ("loss", *(f"accuracy_{r}" for r in ROLES))
# factor: (what it shows, its levels as overrides, whether a level remakes θ0)
FACTORS: dict[str, tuple[str, dict[str, list[str]], bool]] = {
    "pca": ("principal axes of C (default: centred, the paper's)", {"uncentred": ["calibration.pca=uncentred"]}, False),
    "balance": ("what the split balances (default: samples)", {"tokens": ["calibration.balance=tokens"]}, False),
    "lora": (
        "branches as LoRA adapters on every linear layer (alpha 2 × rank, the same lr) against full fine-tuning",
        {
            "r8": ["train.finetuning_type=lora", "train.lora_rank=8"],
            "r32": ["train.finetuning_type=lora", "train.lora_rank=32"],
        },
        False,
    ),
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


def seed_overrides(args: argparse.Namespace, kind: str, seed: int) -> list[str]:
    """What a seed's cases of one kind of conflict set over the config: their data (and their own θ0)."""
    return [*args.overrides, f"run.seed={seed}", f"data.builtin.conflicts={kind}"]


def theta0_case(args: argparse.Namespace, kind: str) -> Case:
    """The θ0 every seed of a kind shares with ``--shared-theta0``: the config's warm-up at its own seed."""
    return Case(f"{kind}-theta0", [*args.overrides, f"data.builtin.conflicts={kind}"], {"kind": kind}, flow="theta0")


def shared_overrides(args: argparse.Namespace, kind: str, seed: int) -> list[str]:
    """A seed's data over the config and, with ``--shared-theta0``, the kind's θ0 as its model."""
    sets = seed_overrides(args, kind, seed)
    if not args.shared_theta0:
        return sets
    case = theta0_case(args, kind)
    theta0 = init_path(load_config(args.config, case.overrides), Path(args.workdir).absolute() / case.name)
    return [*sets, f"model.name_or_path={theta0}", "warmup.steps=0"]


def full(args: argparse.Namespace, i: int) -> bool:
    """Whether the i-th seed runs the larger K, Random-K and the other joint budgets."""
    return args.full_seeds is None or i < args.full_seeds


def plan_cases(args: argparse.Namespace) -> list[Case]:
    ks = sorted(args.k)
    only_merit_merge = f"merge.methods=[{{name: {MERIT_MERGE}, method: weighted_average}}]"
    cases = [theta0_case(args, kind) for kind in args.kinds] if args.shared_theta0 else []
    for kind in args.kinds:
        for i, seed in enumerate(args.seeds):
            base = f"{kind}-s{seed}"
            sets = [*shared_overrides(args, kind, seed), f"flow.controls={'[random]' if full(args, i) else '[]'}"]
            labels = {"kind": kind, "seed": seed}
            cases.append(Case(base, [*sets, f"calibration.r={_r(ks[0])}"], labels | {"K": ks[0]}))
            for k in ks[1:] if full(args, i) else ():
                overrides = [*sets, f"calibration.r={_r(k)}", "flow.joint_baseline=false", only_merit_merge]
                cases.append(Case(f"{base}-k{k}", overrides, labels | {"K": k}, base))
            for epochs in args.joint_epochs if full(args, i) else ():
                sets_e = [*sets, f"train.epochs={epochs}"]
                cases.append(Case(f"{base}-joint{epochs:g}", sets_e, labels | {"joint_epochs": epochs}, base, "joint"))
    # Factors: from the first kind's base cases at the smallest K, MERIT's split and merge only.
    lr_keeps_theta0 = load_config(args.config, args.overrides).warmup.lr is not None
    for factor in args.factors:
        _, levels, fresh = FACTORS[factor]
        fresh = fresh or (factor == "lr" and not lr_keeps_theta0)
        for seed in [s for i, s in enumerate(args.seeds) if full(args, i)]:
            sets = [
                *(seed_overrides if fresh else shared_overrides)(args, args.kinds[0], seed),
                f"calibration.r={_r(ks[0])}",
                "flow.controls=[]",
                only_merit_merge,
            ]
            base = f"{args.kinds[0]}-s{seed}"
            for level, overrides in levels.items():
                labels = {"factor": factor, "level": level, "K": ks[0], "seed": seed, "kind": args.kinds[0]}
                joint = [] if fresh else ["flow.joint_baseline=false"]  # the same θ0: the base case's joint
                cases.append(
                    Case(f"{factor}-{level}-s{seed}", [*sets, *joint, *overrides], labels, None if fresh else base)
                )
    # Every seed's base case first (θ0, the smallest K, its control, the joint baseline, the
    # premises): a bench stopped early has every seed's premises and smallest K.
    return sorted(cases, key=lambda case: case.base is not None)


def _r(k: int) -> int:
    if k < 2 or k & (k - 1):
        raise ValueError(f"K must be a power of two ≥ 2, got {k}")
    return k.bit_length() - 1


def run_case(case: Case, config: str, workdir: Path) -> None:
    """The case's flow on its run directory (a no-op for the stages already done)."""
    from flows.merit import joint, merit, theta0

    run_dir = workdir / case.name
    if case.base:
        linked_run(load_config(config, case.overrides), workdir / case.base, run_dir)
        reuse_theta0_evaluations(workdir / case.base, run_dir)
    else:
        start_run(config, case.overrides, run_dir)
    {"merit": merit, "joint": joint, "theta0": theta0}[case.flow](config=None, run_dir=str(run_dir))
    case.rows = [] if case.flow == "theta0" else case_rows(run_dir, case)


def reuse_theta0_evaluations(base: Path, run_dir: Path) -> None:
    """A linked case's θ0 is its base case's: its held-out evaluation and benchmark results are
    copied rather than computed again (the evaluation stages check their identity, and redo what
    does not match)."""
    for part in (Path(EVAL) / "theta0.json", Path(EVAL) / BENCHMARKS / "theta0"):
        source, target = base / part, run_dir / part
        if not source.exists() or target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)


def case_rows(run_dir: Path, case: Case) -> list[dict[str, Any]]:
    """θ0, joint and the merges of one case, from its report (held-out figures, benchmark scores,
    barrier, pairs apart), labelled with the case."""
    report = json.loads((run_dir / REPORT / "report.json").read_text())
    bench = report.get("benchmarks", {"tasks": [], "rows": []})
    scores = {(r["model"], r["split"]): r for r in bench["rows"]}

    def scored(model: str, split: str) -> dict[str, Any]:
        """A model's benchmark scores, per task (``bench/<task>``) and their average (``benchmark``)."""
        row = scores.get((model, split))
        if row is None:
            return {}
        return {"benchmark": row["average"], **{f"bench/{t}": row.get(t) for t in bench["tasks"]}}

    if case.flow == "joint":
        joint = next(m for m in report["models"] if m["name"] == "joint")
        return [case.labels | {"model": "joint", "split": "—"} | _figures(joint) | scored("joint", "—")]
    barriers = report.get("quality", {}).get("barriers", {})
    k, kind = case.labels["K"], case.labels["kind"]
    apart = {f"MERIT-{k}": pairs_apart(run_dir, kind)}
    apart |= {f"{name.capitalize()}-{k}": pairs_apart(control_dir(run_dir, name), kind) for name in SPLIT_OF}
    rows = []
    if case.base is None and (CONSTANT, "—") in scores:  # the toy tasks' constant answers: once per data made
        rows.append(case.labels | {"model": CONSTANT_LABEL, "split": "—"} | scored(CONSTANT, "—"))
    for r in report.get("quality", {}).get("rows", []):
        if r["model"] == "theta0" and case.base is not None:
            continue  # θ0 once per θ0 made
        model = f"merged-{r['merge']}" if "merge" in r else r["model"]
        extra = {"barrier": barriers.get(r["split"]), "pairs_apart": apart.get(r["split"])}
        rows.append(case.labels | r | extra | scored(model, r["split"]))
    return rows


def pairs_apart(run_dir: Path, kind: str) -> int | None:
    """How many of the built-in corpus's designed conflict pairs the run's split puts in different groups."""
    path = run_dir / CALIBRATION / "split.json"
    if not path.is_file():
        return None
    group = {s: g for g, sources in enumerate(json.loads(path.read_text())["groups"]) for s in sources}
    return sum(group[a] != group[b] for a, b in CONFLICTS[kind] if a in group and b in group)


def _figures(model: dict[str, Any]) -> dict[str, Any]:
    roles = model.get("roles", {})
    return {"loss": model["loss"], **{f"accuracy_{r}": roles[r].get("accuracy") for r in ROLES if r in roles}}


def _metrics(rows: list[dict[str, Any]]) -> list[str]:
    tasks = sorted({key for row in rows for key in row if key.startswith("bench/")})
    return ["benchmark", *tasks, *SECONDARY, "barrier", "distance", "pairs_apart"]


def aggregate(rows: list[dict[str, Any]], by: tuple[str, ...]) -> list[dict[str, Any]]:
    """Mean and std over seeds of every metric, per distinct ``by`` key, in first-seen order;
    ``n`` counts the values of the benchmark average (else the rows)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row.get(k) for k in by), []).append(row)
    out = []
    for key, members in groups.items():
        agg = {k: v for k, v in zip(by, key) if v is not None} | {"seeds": len(members)}
        for metric in _metrics(members):
            values = [m[metric] for m in members if m.get(metric) is not None]
            if values:
                agg[metric] = mean(values)
                agg[f"{metric}_std"] = stdev(values) if len(values) > 1 else 0.0
                agg[f"{metric}_n"] = len(values)
        out.append(agg)
    return out


def paired(differences: list[float]) -> dict[str, Any]:
    """Mean of per-seed differences, its 95 % t interval, and the one-sided paired Wilcoxon
    signed-rank p for "greater than 0" (exact for small n, as the paper's p = 0.031 at n = 5)."""
    from scipy import stats

    n = len(differences)
    out: dict[str, Any] = {"n": n, "mean": mean(differences) if n else None, "low": None, "high": None, "p": None}
    if n >= 2:
        half = stats.t.ppf(0.975, n - 1) * stdev(differences) / math.sqrt(n)
        out["low"], out["high"] = out["mean"] - half, out["mean"] + half
    if n >= 1 and any(differences):
        out["p"] = float(stats.wilcoxon(differences, alternative="greater").pvalue)
    return out


def paired_tests(rows: list[dict[str, Any]], metric: str = "benchmark") -> list[dict[str, Any]]:
    """Per kind, K and merge: MERIT − Random-K and MERIT − joint (1 epoch) seed by seed, on one metric."""
    tests = []
    merit_rows = [r for r in rows if str(r.get("split", "")).startswith("MERIT-") and "factor" not in r]
    joints = {(r["kind"], r["seed"]): r for r in rows if r["model"] == "joint" and not r.get("joint_epochs")}
    for kind, k, merge in dict.fromkeys((r["kind"], r["K"], r["merge"]) for r in merit_rows):
        mine = {r["seed"]: r for r in merit_rows if (r["kind"], r["K"], r["merge"]) == (kind, k, merge)}
        others = {
            f"Random-{k}": {
                r["seed"]: r
                for r in rows
                if (r.get("kind"), r.get("K"), r.get("merge"), r["split"]) == (kind, k, merge, f"Random-{k}")
            },
            "joint": {seed: joints[(kind, seed)] for seed in mine if (kind, seed) in joints},
        }
        for against, theirs in others.items():
            seeds = [s for s in mine if s in theirs and mine[s].get(metric) is not None]
            diffs = [mine[s][metric] - theirs[s][metric] for s in seeds if theirs[s].get(metric) is not None]
            if diffs:
                tests.append(
                    {"kind": kind, "K": k, "merge": merge, "against": against, "metric": metric} | paired(diffs)
                )
    return tests


def _pm(row: dict[str, Any], metric: str, scale: float = 1.0, digits: int = 3) -> str:
    if metric not in row:
        return ""
    return f"{scale * row[metric]:.{digits}f} ± {scale * row[f'{metric}_std']:.{digits}f}"


def _label(row: dict[str, Any]) -> str:
    if row.get("joint_epochs"):
        return f"joint ({row['joint_epochs']:g} epochs)"
    return "joint (1 epoch)" if row["model"] == "joint" else row["model"]


def main_table(rows: list[dict[str, Any]]) -> str:
    """Per kind: one line per model and split, mean ± std over seeds (n: the seeds behind it)."""
    lines = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        agg = aggregate(mine, ("model", "split", "K", "joint_epochs"))
        agg.sort(key=_order)
        tasks = [m for m in _metrics(mine) if m.startswith("bench/")]
        headers = [
            "model",
            "split",
            "n",
            "benchmark average",
            *(t.removeprefix("bench/") for t in tasks),
            "held-out loss",
            "accuracy, trained (%)",
            "accuracy, retention (%)",
            f"pairs apart (of {len(CONFLICTS[kind])})",
        ]
        table = [
            [
                _label(a),
                a["split"],
                a.get("benchmark_n", a["seeds"]),
                _pm(a, "benchmark", digits=1),
                *(f"{a[t]:.1f}" if t in a else "" for t in tasks),
                _pm(a, "loss"),
                _pm(a, "accuracy_trained", 100, 1),
                _pm(a, "accuracy_retention", 100, 1),
                f"{a['pairs_apart']:.1f}" if "pairs_apart" in a else "",
            ]
            for a in agg
        ]
        lines.append(f"**{kind} conflicts**:\n\n" + markdown_table(headers, table))
    return "\n\n".join(lines)


def _order(a: dict[str, Any]) -> tuple[int, float, float]:
    """The constant answers, θ0, the joint baselines by epochs, then the merges by K (first-seen
    order within a K)."""
    if a["split"] == "—":
        return (0, {CONSTANT_LABEL: -1, "theta0": 0}.get(a["model"], 1), a.get("joint_epochs", 1.0))
    return (1, a["K"], 0.0)


def paired_table(tests: list[dict[str, Any]]) -> str:
    def cell(v: float | None, fmt: str) -> str:
        return "" if v is None else format(v, fmt)

    headers = ["kind", "K", "merge", "difference", "n (seeds)", "mean", "95 % interval", "Wilcoxon p (one-sided)"]
    table = [
        [
            t["kind"],
            t["K"],
            t["merge"],
            f"MERIT-{t['K']} − {t['against']}",
            t["n"],
            cell(t["mean"], "+.2f"),
            f"[{t['low']:+.2f}, {t['high']:+.2f}]" if t["low"] is not None else "",
            cell(t["p"], ".3f"),
        ]
        for t in tests
    ]
    return markdown_table(headers, table)


def factor_table(rows: list[dict[str, Any]], factor: str, base: list[dict[str, Any]]) -> str:
    """One line per level (the base cases' first): benchmark average, held-out loss and pairs apart
    of MERIT's token-weighted merge, and θ0's and the joint baseline's benchmark average, over the
    seeds each level ran."""
    seeds, ks = {r["seed"] for r in rows}, {r.get("K") for r in rows}
    # The base cases at the factors' K (the smallest) and their 1-epoch joint: the other K and
    # joint budgets are not what a level changes.
    levels = {"default": [r for r in base if r["seed"] in seeds and r.get("K") in ks and not r.get("joint_epochs")]}
    levels |= {level: [r for r in rows if r.get("level") == level] for level in FACTORS[factor][1]}
    headers = ["level", "n", "θ0", "joint", f"{MERIT_MERGE} (MERIT)", "held-out loss", "pairs apart"]
    table = []
    for level, got in levels.items():
        merged = [r for r in got if r.get("merge") == MERIT_MERGE and str(r["split"]).startswith("MERIT-")]
        cells = [_mean_of(got, "theta0", "benchmark"), _mean_of(got, "joint", "benchmark")]
        cells += [_mean(merged, "benchmark", 1), _mean(merged, "loss", 3), _mean(merged, "pairs_apart", 1)]
        table.append([level, len(merged), *cells])
    return f"**{FACTORS[factor][0]}**\n\n" + markdown_table(headers, table)


def _mean_of(rows: list[dict[str, Any]], model: str, metric: str) -> str:
    return _mean([r for r in rows if r["model"] == model], metric, 1)


def _mean(rows: list[dict[str, Any]], metric: str, digits: int) -> str:
    values = [r[metric] for r in rows if r.get(metric) is not None]
    return f"{mean(values):.{digits}f}" if values else ""


def premise_sections(
    rows: list[dict[str, Any]], workdir: Path, drops: dict[str, dict[int, dict[str, float]]]
) -> list[str]:
    """Per kind of conflict, the four premises' tables (merit.bench.premises), each with whether it holds."""
    text = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        smallest = min(r["K"] for r in mine if "K" in r)
        seeds = sorted({r["seed"] for r in mine})
        cosines = {s: c for s in seeds if (c := premises.pair_cosines(workdir / f"{kind}-s{s}", kind))}
        if cosines:
            premises.plot_pair_cosines(cosines, workdir / f"premises-{kind}.png")
        apart = {r["seed"]: r["pairs_apart"] for r in mine if r["split"] == f"MERIT-{smallest}"}
        sections = [
            ("1. θ0 knows things", premises.knowledge_table(mine, CONSTANT_LABEL)),
            (
                f"2. The designed pairs conflict at θ0 and MERIT-{smallest} puts them apart",
                premises.conflict_table(cosines, apart, len(CONFLICTS[kind])),
            ),
        ]
        if drops.get(kind):
            sections.append(("3. Training a pair together interferes", premises.interference_table(drops[kind])))
        text.append(f"**Premises, {kind} conflicts**")
        for title, (table, holds) in sections:
            text += ["", f"{title}: {'holds' if holds else '**does not hold**'}", "", table]
        text += ["", "4. One basin: the loss barrier between the branches", "", premises.barrier_table(mine), ""]
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default="configs/benchmark.yaml", help="the base run config")
    parser.add_argument("--workdir", default="runs/bench-quality", help="one run directory per case, under here")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="run.seed of each repetition")
    parser.add_argument(
        "--full-seeds",
        type=int,
        default=None,
        help="how many of the seeds also run the larger K, Random-K and the other joint budgets (default: all)",
    )
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 8], help="numbers of branches K (powers of two)")
    parser.add_argument(
        "--joint-epochs", type=float, nargs="*", default=[], help="joint baselines besides the 1-epoch one, e.g. 0.5 2"
    )
    parser.add_argument("--kinds", nargs="+", default=["opposed"], choices=CONFLICT_KINDS)
    parser.add_argument(
        "--interference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="premise 3: train each seed's designed pairs apart and together (5 short branches a seed)",
    )
    parser.add_argument(
        "--shared-theta0",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one θ0 per kind for every seed, warmed up once at the config's run.seed, as the paper fine-tunes one "
        "pre-trained model (seeds vary the data, the calibration sample and the branches); "
        "--no-shared-theta0: a warm-up per seed",
    )
    parser.add_argument(
        "--factors",
        nargs="*",
        default=[],
        choices=["pca", "balance", "lora", "warmup", "lr", "epochs", "width"],
        help="factor tables (from the first kind's full seeds, at the smallest K)",
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")


def main(args: argparse.Namespace) -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")  # the figures, not every task's log
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    cases = plan_cases(args)
    start = time.perf_counter()
    drops: dict[str, dict[int, dict[str, float]]] = {kind: {} for kind in args.kinds}
    for n, case in enumerate(cases, 1):
        began = time.perf_counter()
        run_case(case, args.config, workdir)
        print(f"[{n}/{len(cases)}] {case.name}: {time.perf_counter() - began:.0f} s", flush=True)
        if args.interference and case.flow == "merit" and case.base is None and "factor" not in case.labels:
            kind, seed = case.labels["kind"], case.labels["seed"]
            began = time.perf_counter()
            measured = premises.measure_interference(
                args.config,
                shared_overrides(args, kind, seed),
                workdir / case.name,
                workdir / f"{case.name}-pairs",
                kind,
            )
            drops[kind][seed] = premises.interference_drop(measured)
            print(f"  premise 3, {case.name}: {time.perf_counter() - began:.0f} s", flush=True)
    main_rows = [r for c in cases if "factor" not in c.labels for r in c.rows]
    tests = paired_tests(main_rows)
    text = [
        f"## Quality: `merit {' '.join(sys.argv[1:])}`",
        "",
        *premise_sections(main_rows, workdir, drops),
        main_table(main_rows),
        "",
        "Paired differences of the benchmark average, seed by seed (same θ0 and data):",
        "",
        paired_table(tests),
    ]
    for factor in args.factors:
        rows = [r for c in cases if c.labels.get("factor") == factor for r in c.rows]
        text += ["", factor_table(rows, factor, main_rows)]
    minutes = (time.perf_counter() - start) / 60
    text += ["", f"{len(cases)} cases in {minutes:.1f} min (a case finished before is reused, not rerun)."]
    write_text_atomic(workdir / "quality.md", "\n".join(text) + "\n")
    rows = [r for c in cases for r in c.rows]
    write_text_atomic(
        workdir / "quality.json", json.dumps({"rows": rows, "paired": tests, "interference": drops}, indent=1)
    )
    for kind in args.kinds:
        agg = aggregate([r for r in main_rows if r["kind"] == kind], ("model", "split", "merge", "joint_epochs", "K"))
        smallest = min(args.k)
        plot_quality(
            [a for a in agg if not a.get("joint_epochs") and a["K"] == smallest], workdir / f"quality-{kind}.png"
        )
    print("\n".join(text))
    print(f"\nwritten: {workdir / 'quality.md'}, quality.json, quality-<kind>.png, premises-<kind>.png")
