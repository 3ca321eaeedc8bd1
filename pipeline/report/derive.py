"""The report's second stage: the figures of the report from the collected records, by pure
functions (no file is read or written here): models, branches and the merge weights as the
merges recorded them (``branches``), costs, headline, the sections of benchmarks, quality and
DiLoCo (``benchmarks``, ``quality``, ``diloco``), the tables, and what each plot draws.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from statistics import mean
from typing import Any

import numpy as np

from pipeline.config import RunConfig
from pipeline.data.manifest import active_sources
from pipeline.layout import SEARCH, SEARCH_PLOT, tuned_name
from pipeline.report.benchmarks import benchmark_section
from pipeline.report.branches import branch_rows, budget, budget_and_weights, merge_weights
from pipeline.report.collect import Evaluation, Merge, RunRecords, Training
from pipeline.report.diloco import diloco_summary
from pipeline.report.quality import quality_section

MERIT_SHARE_PCT = 0.8  # calibration / mean branch training time reported by MERIT at 7B
TARGET_SHARE_PCT = 5.0  # ours


@dataclass(frozen=True)
class Bars:
    """One bar per model: a bar plot's data."""

    labels: list[str]
    kinds: list[str]
    values: list[float]


@dataclass(frozen=True)
class Figures:
    """What each of the report's own plots draws (None: no such plot), and the run's own plots."""

    benchmarks: Bars | None = None
    heldout: Bars | None = None
    per_source: tuple[list[str], list[str], np.ndarray] | None = None  # models, sources, Δ loss vs θ0
    curves: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    quality: list[dict[str, Any]] | None = None  # the quality section's rows
    diloco: dict[str, list[dict[str, Any]]] | None = None  # "<variant> (<sync>)" -> its round records
    others: list[str] = field(default_factory=list)  # the stages' plots, relative to the run directory

    def own(self) -> list[str]:
        """The report's PNGs in the order report.json lists them."""
        names = [
            ("benchmarks.png", self.benchmarks),
            ("heldout_loss.png", self.heldout),
            ("per_source.png", self.per_source),
            ("training_curves.png", self.curves),
            ("quality.png", self.quality),
            ("diloco.png", self.diloco),
        ]
        return [name for name, data in names if data]


@dataclass(frozen=True)
class Derived:
    report: dict[str, Any]  # report.json as written
    figures: Figures


def derive(records: RunRecords) -> Derived:
    cfg, data = records.config, records.data
    models = model_rows(records.models)
    branches = branch_rows(records.trainings)
    weights = merge_weights(records.merges)
    budget_and_weights(branches, active_sources(data), weights)
    sources = [s for s in active_sources(data) if any(s in m["sources"] for m in models)]
    split = split_facts(records.calibration.summary, records.calibration.split)
    report: dict[str, Any] = {
        "run": run_facts(records),
        "problems": records.problems,
        "models": models,
        "branches": branches,
        "merge_weights": weights,
        "budget": budget(cfg) if branches else {},
        "split": split,
        "costs": costs(records.calibration.summary, branches, merge_facts(records.merges), records.hashed),
        "headline": headline(models, searched_on_heldout(cfg)),
    }
    report = {k: v for k, v in report.items() if v}

    controls = {c.name: model_rows(c.models) for c in records.controls}
    scores = {c.name: (controls[c.name], c.benchmarks) for c in records.controls}
    benchmarks = benchmark_section(cfg, models, records.benchmarks, scores)
    if benchmarks:
        report["benchmarks"] = {k: benchmarks[k] for k in ("tasks", "rows", "verdict", "notes")}
    diagnostics = {"merit": records.diagnostics} | {c.name: c.diagnostics for c in records.controls}
    quality = quality_section(cfg, models, controls, diagnostics)
    if quality:
        report["quality"] = {k: quality[k] for k in ("rows", "verdict", "differences", "barriers")}
        if controls:
            report["controls"] = {
                name: [{k: m[k] for k in ("name", "loss", "accuracy", "roles") if k in m} for m in ms]
                for name, ms in controls.items()
            }
    diloco = diloco_summary(records.diloco, models)
    if diloco:
        report["diloco"] = {k: diloco[k] for k in ("rows", "notes")}
    if search := records.search:
        report["search"] = {k: search[k] for k in ("merge", "method", "sampler", "metric", "dev", "given", "best")}
        report["search"]["trials"] = len(search["trials"])

    figures = Figures(
        benchmarks=benchmark_bars(benchmarks["rows"]) if benchmarks else None,
        heldout=Bars([m["name"] for m in models], [m["kind"] for m in models], [m["loss"] for m in models])
        if models
        else None,
        per_source=per_source_delta(models, sources),
        curves=training_curves(records.trainings),
        quality=quality["rows"] if quality else None,
        diloco={f"{run['variant']} ({run['sync']})": run["records"] for run in records.diloco} or None,
        others=records.calibration.plots
        + [t.loss_plot for t in records.trainings if t.loss_plot]
        + ([f"{SEARCH}/{records.search['merge']}/{SEARCH_PLOT}"] if records.search else []),
    )
    report["plots"] = figures.own() + [f"../{p}" for p in figures.others]  # relative to report/
    report["tables"] = (
        ({"benchmarks": benchmarks["table"]} if benchmarks else {})
        | ({"quality": quality["table"]} if quality else {})
        | tables(models, sources, branches, split)
        | ({"diloco": diloco["table"]} if diloco else {})
    )
    return Derived(report, figures)


def run_facts(records: RunRecords) -> dict[str, Any]:
    cfg, data = records.config, records.data
    return {
        "name": cfg.run.name,
        "run_dir": records.run_dir,
        "config_digest": cfg.digest(),
        "model": cfg.model.name_or_path,
        "sources": list(active_sources(data)),
        "sources_by_role": dict(Counter(i.get("role", "finetune") for i in active_sources(data, None).values())),
        "dropped_sources": sorted(s for s, info in data["sources"].items() if info.get("dropped")),
        "skipped_records": skipped_records(data),
        "source": records.source,
    }


def skipped_records(data: dict[str, Any]) -> dict[str, int]:
    """Records ``on_bad_record: skip`` left out, by reason, over every source (most first)."""
    counts = Counter()
    for info in data["sources"].values():
        counts.update(info.get("skipped_by_reason", {}))
    return dict(counts.most_common())


def model_rows(evaluations: list[Evaluation]) -> list[dict[str, Any]]:
    """The models as report.json lists them; each one's Δ vs the joint baseline where it was evaluated."""
    models = [
        {"name": e.name, "kind": e.kind, "checkpoint": e.checkpoint, **e.figures, "sources": e.sources}
        for e in evaluations
    ]
    joint = next((m["loss"] for m in models if m["name"] == "joint"), None)
    if joint is not None:
        for m in models:
            m["delta_vs_joint"] = m["loss"] - joint
    return models


def split_facts(summary: dict[str, Any], split: dict[str, Any]) -> dict[str, Any]:
    """The split's groups, tokens, explained variance, method and seed (split.json's over summary.json's)."""

    def pick(data: dict[str, Any], *keys: str) -> dict[str, Any]:
        return {k: data[k] for k in keys if k in data}

    return pick(summary, "groups", "tokens", "explained_variance") | pick(
        split, "groups", "tokens", "r", "explained_variance", "method", "seed"
    )


def merge_facts(merges: list[Merge]) -> dict[str, dict[str, Any]]:
    return {
        m.name: {
            "method": m.spec.get("method") or "rules",
            "seconds": m.report.get("total_seconds"),
            "on_adapters": any(e.get("adapter") for e in m.spec.get("models", [])),
            "format": m.spec.get("out_format", "model"),
        }
        for m in merges
    }


def costs(
    summary: dict[str, Any], branches: list[dict[str, Any]], merges: dict[str, dict[str, Any]], hashed: dict[str, int]
) -> dict[str, Any]:
    found: dict[str, Any] = {"hashing": hashed} if hashed["checkpoints"] else {}
    if "total_seconds" in summary:
        found["calibration_seconds"] = summary["total_seconds"]
        found["calibration_gradient_seconds"] = summary.get("gradient_seconds")
    for b in branches:
        if b["kind"] != "branch" and b["train_seconds"] is not None:
            found[f"{b['kind']}_train_seconds"] = b["train_seconds"]
    seconds = [b["train_seconds"] for b in branches if b["kind"] == "branch" and b["train_seconds"] is not None]
    if seconds:
        found["branch_train_seconds_mean"] = mean(seconds)
        found["branch_train_seconds_max"] = max(seconds)
    if "calibration_seconds" in found and seconds and mean(seconds) > 0:
        found["calibration_share_pct"] = 100 * found["calibration_seconds"] / mean(seconds)
        found["calibration_share_merit_pct"] = MERIT_SHARE_PCT
        found["calibration_share_target_pct"] = TARGET_SHARE_PCT
    if merges:
        found["merges"] = merges
    return found


def searched_on_heldout(cfg: RunConfig) -> str | None:
    """The model whose merge weights ``merge.search`` chose by held-out loss (None: none, or chosen on
    dev tasks): its held-out figures measure the search's own objective, so no verdict rests on them."""
    return tuned_name(cfg) if cfg.merge.search.enabled and not cfg.merge.search.tasks else None


def headline(models: list[dict[str, Any]], searched: str | None = None) -> dict[str, Any]:
    """The best merged model against the joint baseline and θ0, never ``searched`` (named beside it);
    empty without a merged model."""
    merged = [m for m in models if m["kind"] == "merged" and m["name"] != searched]
    if not merged:
        return {}
    best = min(merged, key=lambda m: m["loss"])
    found: dict[str, Any] = {"model": best["name"], "loss": best["loss"]}
    if tuned := next((m for m in models if m["name"] == searched), None):
        found["searched"] = {"model": searched, "loss": tuned["loss"]}
    for ref in (m for name in ("joint", "theta0") for m in models if m["name"] == name):
        delta = best["loss"] - ref["loss"]
        found[f"vs_{ref['name']}"] = {"loss": ref["loss"], "delta": delta, "relative_pct": 100 * delta / ref["loss"]}
    return found


def _r(value: Any) -> Any:
    """Table cells: floats rounded to 4 decimals, everything JSON-serialisable."""
    return round(value, 4) if isinstance(value, float) else value


BRANCH_COLUMNS = {
    "name": "branch",
    "kind": "kind",
    "sources": "sources",
    "data_tokens": "data tokens (n_k)",
    "merge_weight": "merge weight",
    "epochs": "epochs",
    "steps": "steps",
    "tokens": "tokens seen",
    "train_seconds": "train seconds",
    "last_loss": "last training loss",
}
LORA_COLUMNS = {"trainable_parameters": "trainable parameters", "adapter_mb": "adapter MB"}


def tables(
    models: list[dict[str, Any]], sources: list[str], branches: list[dict[str, Any]], split: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """The models, per-source, branches and split tables: headers and rows (floats to 4 decimals)."""
    found = {}
    if models:
        joint = "delta_vs_joint" in models[0]
        headers = ["model", "kind", "held-out loss", "macro loss", "token accuracy"] + (["Δ vs joint"] if joint else [])
        keys = ["name", "kind", "loss", "macro_loss", "token_accuracy"] + (["delta_vs_joint"] if joint else [])
        found["models"] = {"headers": headers, "rows": [[_r(m.get(k)) for k in keys] for m in models]}
    if sources:
        rows = [[s, *(_r(m["sources"].get(s, {}).get("loss")) for m in models)] for s in sources]
        found["per_source"] = {"headers": ["source", *(m["name"] for m in models)], "rows": rows}
    if branches:
        columns = BRANCH_COLUMNS | (LORA_COLUMNS if any("lora" in b for b in branches) else {})
        rows = [[_r(brief(b[k]) if k == "sources" else b.get(k)) for k in columns] for b in branches]
        found["branches"] = {"headers": list(columns.values()), "rows": rows}
    if "groups" in split:
        tokens = split.get("tokens", [None] * len(split["groups"]))
        rows = [[k, len(g), ", ".join(g), t] for k, (g, t) in enumerate(zip(split["groups"], tokens))]
        found["split"] = {"headers": ["group", "sources", "names", "training tokens"], "rows": rows}
    return found


def brief(sources: list[str], shown: int = 6) -> str:
    """A branch's sources in one cell: vision_flan splits into ~190 sources."""
    more = f", … ({len(sources)} in all)" if len(sources) > shown else ""
    return ", ".join(sources[:shown]) + more


def benchmark_bars(rows: list[dict[str, Any]]) -> Bars | None:
    """The benchmark average of every row that has one."""
    rows = [r for r in rows if r["average"] is not None]
    labels = [r["label"] + ("" if r["split"] == "—" else f" ({r['split']})") for r in rows]
    return Bars(labels, [r["kind"] for r in rows], [r["average"] for r in rows]) if rows else None


def per_source_delta(
    models: list[dict[str, Any]], sources: list[str]
) -> tuple[list[str], list[str], np.ndarray] | None:
    """Each model's held-out loss per source minus θ0's (NaN where either is missing)."""
    theta0 = next((m for m in models if m["name"] == "theta0"), None)
    others = [m for m in models if m is not theta0]
    if not (theta0 and others and sources):
        return None
    delta = np.array(
        [
            [
                m["sources"].get(s, {}).get("loss", np.nan) - theta0["sources"].get(s, {}).get("loss", np.nan)
                for s in sources
            ]
            for m in others
        ],
        dtype=float,
    )
    return [m["name"] for m in others], sources, delta


def training_curves(trainings: list[Training]) -> dict[str, tuple[list[int], list[float]]]:
    """Training loss per step; branches and the joint baseline start where the warm-up ends (from θ0)."""
    warmup = next((len(t.metrics) for t in trainings if t.name == "warmup"), 0)
    return {
        t.name: ([(0 if t.name == "warmup" else warmup) + r["step"] for r in t.metrics], [r["loss"] for r in t.metrics])
        for t in trainings
        if t.metrics
    }
