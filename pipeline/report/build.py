"""The run report: every stage's outputs in a run directory gathered into ``report/report.json``
(machine form, with ready-made tables for the flow's artifacts), ``report/report.md`` and plots.

It reads only the run directory, so it can be rebuilt after any stage. Every part but
``config.yaml`` and ``data/manifest.json`` may be missing (no joint baseline, no merges yet, ...):
the report then leaves that section out.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from statistics import mean
from typing import Any

import numpy as np

from pipeline.checkpoint import (
    MANIFEST,
    CheckpointError,
    bytes_hashed,
    checkpoint_id,
    verify_checkpoint,
    write_json_atomic,
)
from pipeline.checkpoint import read_manifest as read_checkpoint_manifest
from pipeline.config import RunConfig, load_config
from pipeline.controls import controls_of
from pipeline.data.manifest import active_sources
from pipeline.data.manifest import read_manifest as read_data_manifest
from pipeline.layout import (
    BRANCHES,
    CALIBRATION,
    CONFIG,
    DIAGNOSTICS,
    EVAL,
    JOINT,
    MERGED,
    REPORT,
    WARMUP,
    diloco_finals,
    model_paths,
)
from pipeline.report.benchmarks import benchmark_section, stand_ins
from pipeline.report.diloco import diloco_section
from pipeline.report.plots import plot_model_bars, plot_per_source, plot_quality, plot_training_curves
from pipeline.report.quality import quality_section

KINDS = ("theta0", "branch", "joint", "merged", "diloco")  # the models' fixed order; a model's kind is its name prefix
MERIT_SHARE_PCT = 0.8  # calibration / mean branch training time reported by MERIT at 7B
TARGET_SHARE_PCT = 5.0  # ours
PLOT_FILES = {
    "benchmarks.png": "benchmark average",
    "heldout_loss.png": "held-out loss",
    "per_source.png": "per-source loss against θ0",
    "training_curves.png": "training curves",
    "diloco.png": "DiLoCo rounds",
    "quality.png": "merges on MERIT's split and the controls'",
}  # the report's own PNGs and their alt texts


MODEL_FIGURES = ("loss", "macro_loss", "token_accuracy", "accuracy", "roles")  # of an evaluation, in the report


def build_report(run_dir: str | Path) -> dict[str, Any]:
    """Gather the run's outputs, write ``report/`` (PNGs, report.md, then report.json) and return the report."""
    run_dir = Path(run_dir)
    out = run_dir / REPORT
    cfg = load_config(run_dir / CONFIG)
    data = read_data_manifest(run_dir)
    models = _models(cfg, run_dir)
    trained = _trained_dirs(cfg, run_dir)
    metrics = {name: _read_metrics(folder / "metrics.jsonl") for name, _, folder in trained}
    branches = [b for name, kind, folder in trained if (b := _branch(run_dir, name, kind, folder, metrics[name]))]
    _budget_and_weights(branches, active_sources(data))
    summary = _read_json(run_dir / CALIBRATION / "summary.json")
    split = _pick(summary, "groups", "tokens", "explained_variance") | _pick(
        _read_json(run_dir / CALIBRATION / "split.json"),
        "groups",
        "tokens",
        "r",
        "explained_variance",
        "method",
        "seed",
    )
    sources = [s for s in active_sources(data) if any(s in m["sources"] for m in models)]

    report: dict[str, Any] = {
        "run": {
            "name": cfg.run.name,
            "run_dir": str(run_dir.resolve()),
            "config_digest": cfg.digest(),
            "model": cfg.model.name_or_path,
            "sources": list(active_sources(data)),
            "sources_by_role": dict(Counter(i.get("role", "finetune") for i in active_sources(data, None).values())),
            "dropped_sources": sorted(s for s, info in data["sources"].items() if info.get("dropped")),
        },
        "problems": _problems(cfg, run_dir),
        "models": models,
        "branches": branches,
        "budget": _budget(cfg) if branches else {},
        "split": split,
        "costs": _costs(summary, branches, _merges(cfg, run_dir), bytes_hashed(run_dir)),
        "headline": _headline(models),
    }
    report = {k: v for k, v in report.items() if v}
    # Branches and the joint baseline start where the warm-up ends (from θ0): plot them from there.
    start = {name: 0 if name == "warmup" else len(metrics.get("warmup", [])) for name in metrics}
    curves = {
        name: ([start[name] + r["step"] for r in rs], [r["loss"] for r in rs]) for name, rs in metrics.items() if rs
    }
    own = _write_plots(out, models, sources, curves)
    others = sorted(str(p.relative_to(run_dir)) for p in (run_dir / CALIBRATION).glob("*.png"))
    others += [
        str((folder / "loss.png").relative_to(run_dir)) for _, _, folder in trained if (folder / "loss.png").is_file()
    ]
    folders = controls_of(cfg, run_dir)
    controls = {name: _models(load_config(folder / CONFIG), folder) for name, folder in folders.items()}
    if benchmarks := benchmark_section(cfg, run_dir, models, {n: (folders[n], ms) for n, ms in controls.items()}):
        report["benchmarks"] = {k: benchmarks[k] for k in ("tasks", "rows", "verdict")}
        rows = benchmarks["rows"]
        labels = [r["label"] + ("" if r["split"] == "—" else f" ({r['split']})") for r in rows]
        plot_model_bars(
            labels,
            [r["kind"] for r in rows],
            [r["average"] for r in rows],
            out / "benchmarks.png",
            "benchmark average (0–100)",
            "Benchmark average per model (higher is better)",
        )
        own.insert(0, "benchmarks.png")
    diagnostics = {"merit": _read_json(run_dir / EVAL / DIAGNOSTICS)}
    diagnostics |= {name: _read_json(folder / EVAL / DIAGNOSTICS) for name, folder in folders.items()}
    quality = quality_section(cfg, models, controls, diagnostics)
    if quality:
        report["quality"] = {k: quality[k] for k in ("rows", "verdict", "differences", "barriers")}
        if controls:
            report["controls"] = {
                name: [_pick(m, "name", "loss", "accuracy", "roles") for m in ms] for name, ms in controls.items()
            }
        own.append(plot_quality(quality["rows"], out / "quality.png"))
    if diloco := diloco_section(run_dir, out, models):
        report["diloco"] = {k: diloco[k] for k in ("rows", "notes")}
        own.append(diloco["plot"])
    report["plots"] = own + [f"../{p}" for p in others]  # relative to report/, as report.md links them
    report["tables"] = (
        ({"benchmarks": benchmarks["table"]} if benchmarks else {})
        | ({"quality": quality["table"]} if quality else {})
        | _tables(models, sources, branches, split)
        | ({"diloco": diloco["table"]} if diloco else {})
    )

    _write_text_atomic(out / "report.md", _markdown(report, own, others))
    write_json_atomic(out / "report.json", report)  # last: its presence means the report is whole
    return report


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A GitHub markdown table: numeric columns right-aligned, ints with thousands separators."""
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) for i in range(len(headers))]

    def cell(v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return str(v).replace("|", "\\|")
        return f"{v:,}" if isinstance(v, int) else f"{v:.4f}"

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" if n else ":---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def model_kind(name: str) -> str:
    return next((k for k in KINDS if name == k or name.startswith(f"{k}-")), "other")


def _natural(name: str) -> list[Any]:
    """``branch-10`` after ``branch-9``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _order(name: str) -> tuple[int, list[Any]]:
    kind = model_kind(name)
    return (KINDS.index(kind) if kind in KINDS else len(KINDS), _natural(name))


def _read_json(path: Path) -> dict[str, Any]:
    """An optional part of the run: empty when missing."""
    return json.loads(path.read_text()) if path.is_file() else {}


def _pick(data: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: data[k] for k in keys if k in data}


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []


def _models(cfg: RunConfig, run_dir: Path) -> list[dict[str, Any]]:
    """The evaluations of the run's models as configured now: not those of merges dropped from the
    config or of branches from an earlier split, nor those of weights since replaced."""
    models, finals = [], diloco_finals(run_dir)
    paths = model_paths(cfg, run_dir)
    for name, checkpoint in sorted(paths.items(), key=lambda kv: _order("diloco" if kv[0] in finals else kv[0])):
        path = run_dir / EVAL / f"{name}.json"
        result = json.loads(path.read_text()) if path.is_file() else None
        if result is None or (checkpoint.exists() and result.get("checkpoint_id") != checkpoint_id(checkpoint)):
            continue
        models.append(
            {
                "name": path.stem,
                "kind": "diloco" if name in finals else model_kind(name),
                "checkpoint": result.get("checkpoint"),
                **_pick(result, *MODEL_FIGURES, "seconds"),
                "sources": result.get("sources", {}),
            }
        )
    joint = next((m["loss"] for m in models if m["name"] == "joint"), None)
    if joint is not None:
        for m in models:
            m["delta_vs_joint"] = m["loss"] - joint
    return models


def _trained_dirs(cfg: RunConfig, run_dir: Path) -> list[tuple[str, str, Path]]:
    """(name, kind, folder) of every training: warm-up, the split's branches in order, joint baseline."""
    names = [n for n in model_paths(cfg, run_dir) if n.startswith("branch-")]
    branches = [(name, "branch", run_dir / BRANCHES / name.removeprefix("branch-")) for name in names]
    found = [("warmup", "warmup", run_dir / WARMUP), *branches, ("joint", "joint", run_dir / JOINT)]
    return [t for t in found if t[2].is_dir()]


def _branch(run_dir: Path, name: str, kind: str, folder: Path, records: list[dict[str, Any]]) -> dict[str, Any] | None:
    final = read_checkpoint_manifest(folder / "final") if (folder / "final" / MANIFEST).is_file() else {}
    if not final and not records:
        return None  # started but nothing written yet
    spec = folder / "spec.json"
    last = records[-1] if records else {}
    return {
        "name": name,
        "kind": kind,
        "dir": str(folder.relative_to(run_dir)),
        # The spec's sources as written (read as JSON: a spec from an older version may not load).
        "sources": json.loads(spec.read_text())["sources"] if spec.is_file() else final.get("sources", []),
        "tokens": final.get("tokens_seen", last.get("tokens")),
        "examples": final.get("examples_seen", last.get("examples")),
        "steps": final.get("step", last.get("step")),
        "train_seconds": final["train_seconds"] if "train_seconds" in final else train_seconds(records),
        "last_loss": last.get("loss"),
    } | _adapter_facts(folder / "final", final)


def _adapter_facts(final: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """A LoRA branch's rank, modules, trainable parameters and adapter bytes."""
    lora = manifest.get("lora")
    if not lora:
        return {}
    return {
        "lora": {k: lora[k] for k in ("rank", "alpha", "modules", "modules_to_save")},
        "trainable_parameters": lora["trainable_parameters"],
        "adapter_mb": sum(f.stat().st_size for f in final.glob("adapter_model*.safetensors")) / 1e6,
    }


def _budget_and_weights(branches: list[dict[str, Any]], sources: dict[str, dict[str, Any]]) -> None:
    """Each training's data (examples, tokens) and the passes over it; for the branches, MERIT's
    merge weight n_k / Σ n_j with n_k the tokens of the group's training data."""
    for b in branches:
        b["data_examples"] = sum(sources.get(s, {}).get("train_examples", 0) for s in b["sources"])
        b["data_tokens"] = sum(sources.get(s, {}).get("train_tokens", 0) for s in b["sources"])
        b["epochs"] = b["examples"] / b["data_examples"] if b["examples"] and b["data_examples"] else None
    groups = [b for b in branches if b["kind"] == "branch"]
    total = sum(g["data_tokens"] for g in groups)
    for b in groups if total else []:
        b["merge_weight"] = b["data_tokens"] / total
        seen = [g["tokens"] for g in groups]  # what weighting by tokens seen would give, for contrast
        b["weight_by_tokens_seen"] = b["tokens"] / sum(seen) if all(seen) else None


def _budget(cfg: RunConfig) -> dict[str, Any]:
    t = cfg.train
    if t.steps:
        return {"steps": t.steps, "joint_steps": cfg.branch_count * t.steps, "global_batch": t.global_batch()}
    return {"epochs": t.epochs, "global_batch": t.global_batch()}


def _problems(cfg: RunConfig, run_dir: Path) -> list[str]:
    """The run's checkpoints that exist but do not verify: reported, never silently left out."""
    problems = []
    for name, path in model_paths(cfg, run_dir).items():
        if (path / MANIFEST).is_file() or (name != "theta0" and path.exists()):
            try:
                verify_checkpoint(path)
            except CheckpointError as err:
                problems.append(f"{name}: {err}")
    return problems


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


def _merges(cfg: RunConfig, run_dir: Path) -> dict[str, dict[str, Any]]:
    merges = {}
    for folder in (run_dir / MERGED / m.name for m in cfg.merge.methods):
        if (folder / MANIFEST).is_file():
            manifest = read_checkpoint_manifest(folder)
            spec, report = manifest.get("spec", {}), manifest.get("report", {})
            merges[folder.name] = {
                "method": spec.get("method") or "rules",
                "seconds": report.get("total_seconds"),
                "on_adapters": any(m.get("adapter") for m in spec.get("models", [])),
                "format": spec.get("out_format", "model"),
            }
    return merges


def _costs(
    summary: dict[str, Any], branches: list[dict[str, Any]], merges: dict[str, dict[str, Any]], hashed: dict[str, int]
) -> dict[str, Any]:
    costs: dict[str, Any] = {"hashing": hashed} if hashed["checkpoints"] else {}
    if "total_seconds" in summary:
        costs["calibration_seconds"] = summary["total_seconds"]
        costs["calibration_gradient_seconds"] = summary.get("gradient_seconds")
    for b in branches:
        if b["kind"] != "branch" and b["train_seconds"] is not None:
            costs[f"{b['kind']}_train_seconds"] = b["train_seconds"]
    seconds = [b["train_seconds"] for b in branches if b["kind"] == "branch" and b["train_seconds"] is not None]
    if seconds:
        costs["branch_train_seconds_mean"] = mean(seconds)
        costs["branch_train_seconds_max"] = max(seconds)
    if "calibration_seconds" in costs and seconds and mean(seconds) > 0:
        costs["calibration_share_pct"] = 100 * costs["calibration_seconds"] / mean(seconds)
        costs["calibration_share_merit_pct"] = MERIT_SHARE_PCT
        costs["calibration_share_target_pct"] = TARGET_SHARE_PCT
    if merges:
        costs["merges"] = merges
    return costs


def _headline(models: list[dict[str, Any]]) -> dict[str, Any]:
    """The best merged model against the joint baseline and θ0; empty without a merged model."""
    merged = [m for m in models if m["kind"] == "merged"]
    if not merged:
        return {}
    best = min(merged, key=lambda m: m["loss"])
    headline: dict[str, Any] = {"model": best["name"], "loss": best["loss"]}
    for ref in (m for name in ("joint", "theta0") for m in models if m["name"] == name):
        delta = best["loss"] - ref["loss"]
        headline[f"vs_{ref['name']}"] = {"loss": ref["loss"], "delta": delta, "relative_pct": 100 * delta / ref["loss"]}
    return headline


def _r(value: Any) -> Any:
    """Table cells: floats rounded to 4 decimals, everything JSON-serialisable."""
    return round(value, 4) if isinstance(value, float) else value


def _tables(
    models: list[dict[str, Any]], sources: list[str], branches: list[dict[str, Any]], split: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    tables = {}
    if models:
        joint = "delta_vs_joint" in models[0]
        headers = ["model", "kind", "held-out loss", "macro loss", "token accuracy"] + (["Δ vs joint"] if joint else [])
        keys = ["name", "kind", "loss", "macro_loss", "token_accuracy"] + (["delta_vs_joint"] if joint else [])
        tables["models"] = {"headers": headers, "rows": [[_r(m.get(k)) for k in keys] for m in models]}
    if sources:
        rows = [[s, *(_r(m["sources"].get(s, {}).get("loss")) for m in models)] for s in sources]
        tables["per_source"] = {"headers": ["source", *(m["name"] for m in models)], "rows": rows}
    if branches:
        columns = {
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
        if any("lora" in b for b in branches):
            columns |= {"trainable_parameters": "trainable parameters", "adapter_mb": "adapter MB"}
        rows = [[_r(_brief(b[k]) if k == "sources" else b.get(k)) for k in columns] for b in branches]
        tables["branches"] = {"headers": list(columns.values()), "rows": rows}
    if "groups" in split:
        tokens = split.get("tokens", [None] * len(split["groups"]))
        rows = [[k, len(g), ", ".join(g), t] for k, (g, t) in enumerate(zip(split["groups"], tokens))]
        tables["split"] = {"headers": ["group", "sources", "names", "training tokens"], "rows": rows}
    return tables


def _brief(sources: list[str], shown: int = 6) -> str:
    """A branch's sources in one cell: vision_flan splits into ~190 sources."""
    more = f", … ({len(sources)} in all)" if len(sources) > shown else ""
    return ", ".join(sources[:shown]) + more


def _write_plots(
    out: Path, models: list[dict[str, Any]], sources: list[str], curves: dict[str, tuple[list[int], list[float]]]
) -> list[str]:
    """The report's PNGs that have data; stale ones from an earlier build are removed."""
    written = []
    if models:
        plot_model_bars(
            [m["name"] for m in models],
            [m["kind"] for m in models],
            [m["loss"] for m in models],
            out / "heldout_loss.png",
            "held-out loss (token-weighted)",
            "Held-out loss per model (lower is better)",
        )
        written.append("heldout_loss.png")
    theta0 = next((m for m in models if m["name"] == "theta0"), None)
    others = [m for m in models if m is not theta0]
    if theta0 and others and sources:
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
        plot_per_source([m["name"] for m in others], sources, delta, out / "per_source.png")
        written.append("per_source.png")
    if curves:
        plot_training_curves(curves, out / "training_curves.png")
        written.append("training_curves.png")
    for stale in set(PLOT_FILES) - set(written):
        (out / stale).unlink(missing_ok=True)
    return written


def _markdown(report: dict[str, Any], own: list[str], others: list[str]) -> str:
    run, tables = report["run"], report["tables"]
    counts = ", ".join(f"{n} {ROLE_WORDS.get(role, role)}" for role, n in run["sources_by_role"].items())
    dropped = f" ({len(run['dropped_sources'])} dropped)" if run["dropped_sources"] else ""
    lines = [
        f"# Run report: {run['name']}",
        "",
        f"Run directory `{run['run_dir']}`, config digest `{run['config_digest']}`, "
        f"model `{run['model']}`; sources: {counts}{dropped}.",
    ]

    def section(title: str, *blocks: str) -> None:
        lines.extend(["", f"## {title}", ""])
        lines.append("\n\n".join(b for b in blocks if b))

    figure = {name: f"![{PLOT_FILES[name]}]({name})" for name in own}

    if bench := report.get("benchmarks"):
        section(
            "Benchmarks",
            "lmms-eval tasks none of the models was fine-tuned on, scored 0–100 (accuracy, token F1, or as a "
            "judge model rates the answers), and their mean, as in the MERIT paper's Table 2. "
            + stand_ins(bench["tasks"]),
            bench["verdict"],
            figure.get("benchmarks.png", ""),
            markdown_table(**tables["benchmarks"]),
            "Each model's results file and samples, as lmms-eval wrote them: `eval/benchmarks/<model>/`.",
        )

    if head := report.get("headline"):
        refs = {"vs_joint": "the joint baseline", "vs_theta0": "θ0"}
        against = [
            f"against {label} ({v['loss']:.4f}): {v['delta']:+.4f} ({v['relative_pct']:+.2f} %)"
            for key, label in refs.items()
            if (v := head.get(key))
        ]
        section(
            "Headline",
            f"Best merged model **{head['model']}**: held-out loss **{head['loss']:.4f}**; "
            + ("; ".join(against) or "no joint baseline or θ0 evaluated")
            + ".",
        )
    if quality := report.get("quality"):
        barriers = ", ".join(f"{split} {b:.4f}" for split, b in quality["barriers"].items())
        section(
            "Did the split pay off?",
            quality["verdict"],
            "\n".join(f"- {line}" for line in quality["differences"]),
            figure.get("quality.png", ""),
            markdown_table(**tables["quality"]),
            "Accuracy: exact match of the greedy answer (case, spacing and end punctuation aside), macro-averaged "
            "over the sources of each role: trained (held-out examples of the fine-tuning sources), unseen "
            "(eval.sources never trained on), retention (what θ0 learned in its warm-up or eval.sources it could "
            "already do). Distance: of the merged weights from θ0, relative to θ0's norm."
            + (
                f" Loss barrier on the straight line between the branches (mean over pairs): {barriers}."
                if barriers
                else ""
            ),
        )
    if problems := report.get("problems"):
        intro = "Checkpoints of this run that exist but do not verify (left out of the evaluation):"
        section("Problems", intro, "\n".join(f"- {p}" for p in problems))
    if "models" in tables:
        section("Models", figure.get("heldout_loss.png", ""), markdown_table(**tables["models"]))
    if "per_source" in tables:
        section("Per-source held-out loss", figure.get("per_source.png", ""), markdown_table(**tables["per_source"]))
    if "branches" in tables:
        section(
            "Branches",
            _budget_line(report.get("budget", {}), report["branches"]),
            _lora_line(report["branches"], report.get("costs", {}).get("merges", {})),
            figure.get("training_curves.png", ""),
            markdown_table(**tables["branches"]),
        )
    if "diloco" in tables:
        section(
            "DiLoCo",
            "Multi-round training from the same θ0: R workers, H inner steps a round, the merge library "
            "aggregating their pseudo-gradients, an outer step on the global weights. Bytes: what the "
            "workers sent, and against a data-parallel run all-reducing fp32 gradients every step.",
            "\n".join(f"- {note}" for note in report["diloco"]["notes"]),
            figure.get("diloco.png", ""),
            markdown_table(**tables["diloco"]),
        )
    if split := report.get("split"):
        variance = ", ".join(f"{100 * v:.1f} %" for v in split.get("explained_variance", []))
        facts = [
            f"method `{split['method']}`" if "method" in split else "",
            f"r = {split['r']}" if split.get("r") else "",
            f"explained variance of the principal axes: {variance}" if variance else "",
        ]
        about = "; ".join(filter(None, facts))
        table = markdown_table(**tables["split"]) if "split" in tables else ""
        section("Split", f"Split: {about}." if about else "", table)
    if costs := report.get("costs"):
        section("Costs", "\n".join(_cost_lines(costs)))
    if others:
        section("Other plots", "\n".join(f"- [{p}](../{p})" for p in others))
    return "\n".join(lines) + "\n"


ROLE_WORDS = {"finetune": "fine-tuning", "warmup": "warm-up (θ0)", "unseen": "unseen", "retention": "retention"}


def _lora_line(branches: list[dict[str, Any]], merges: dict[str, dict[str, Any]]) -> str:
    """What LoRA branches adapted, and which merges combined their ΔW."""
    lora = next((b["lora"] for b in branches if "lora" in b), None)
    if lora is None:
        return ""
    line = (
        f"LoRA branches: rank {lora['rank']}, alpha {lora['alpha']:g}, on {len(lora['modules'])} modules "
        f"({_brief(lora['modules'], 4)})"
        + (f", {', '.join(lora['modules_to_save'])} trained in full" if lora["modules_to_save"] else "")
        + "."
    )
    on_delta = [
        f"`{name}`" + (" (as an adapter)" if m["format"] == "adapter" else "")
        for name, m in merges.items()
        if m.get("on_adapters")
    ]
    if on_delta:
        line += f" Merged on ΔW = (alpha / rank) · B A of each adapted module: {', '.join(on_delta)}."
    return line


def _budget_line(budget: dict[str, Any], branches: list[dict[str, Any]]) -> str:
    """The training budget and MERIT's merge weights, in words."""
    if "epochs" in budget:
        epochs = f"{budget['epochs']:g} epoch(s)"
        spent = f"{epochs} over each branch's own data, the joint baseline {epochs} over all of it"
    elif budget:
        spent = f"{budget['steps']} steps per branch, {budget['joint_steps']} for the joint baseline"
    else:
        return ""
    line = f"Budget: {spent}, global batch {budget['global_batch']}."
    groups = [b for b in branches if "merge_weight" in b]
    if groups:
        weights = " / ".join(f"{b['merge_weight']:.3f}" for b in groups)
        line += f" Token-weighted merges weight branch k by n_k, the tokens of its group's training data: {weights}"
        if all(b.get("weight_by_tokens_seen") for b in groups):
            seen = " / ".join(f"{b['weight_by_tokens_seen']:.3f}" for b in groups)
            line += f" (by the tokens each branch saw it would be {seen})"
        line += "."
    return line


def _cost_lines(costs: dict[str, Any]) -> list[str]:
    labels = {
        "calibration_seconds": "calibration",
        "calibration_gradient_seconds": "calibration gradients",
        "warmup_train_seconds": "warm-up training",
        "branch_train_seconds_mean": "branch training, mean",
        "branch_train_seconds_max": "branch training, max",
        "joint_train_seconds": "joint baseline training",
    }
    lines = [f"- {label}: {costs[key]:,.2f} s" for key, label in labels.items() if costs.get(key) is not None]
    if "calibration_share_pct" in costs:
        lines.append(
            f"- **calibration share** (calibration / mean branch training): **{costs['calibration_share_pct']:.2f} %**"
            f" (MERIT: ≤ {MERIT_SHARE_PCT} % at 7B; target ≤ {TARGET_SHARE_PCT} %)"
        )
    lines += [
        f"- merge `{name}` ({m['method']}): {m['seconds']:,.2f} s"
        for name, m in costs.get("merges", {}).items()
        if m["seconds"] is not None
    ]
    if hashed := costs.get("hashing"):
        lines.append(
            f"- checkpoint hashing: {hashed['write_bytes_hashed'] / 1e6:,.1f} MB when written, "
            f"{hashed['verify_bytes_hashed'] / 1e6:,.1f} MB in {hashed['verifications']} verification(s) "
            f"of {hashed['checkpoints']} checkpoint(s) (each is verified once, then only re-stat'ed)"
        )
    return lines


def _write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
