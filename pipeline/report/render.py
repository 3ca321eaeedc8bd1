"""The report's third stage: the derived figures written out, as ``report/``'s PNGs (stale ones
removed), ``report.md`` and, last, ``report.json`` (its presence means the report is whole).
The flow's Prefect artifacts are made from what ``render`` returns (its tables and plots) and
from ``report.md`` (flows/report.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.checkpoint import write_json_atomic, write_text_atomic
from pipeline.report.benchmarks import CONSTANT_NOTE, stand_ins
from pipeline.report.derive import MERIT_SHARE_PCT, TARGET_SHARE_PCT, Derived, Figures, brief
from pipeline.report.plots import plot_diloco, plot_model_bars, plot_per_source, plot_quality, plot_training_curves

PLOT_FILES = {
    "benchmarks.png": "benchmark average",
    "heldout_loss.png": "held-out loss",
    "per_source.png": "per-source loss against θ0",
    "training_curves.png": "training curves",
    "diloco.png": "DiLoCo rounds",
    "quality.png": "merges on MERIT's split and the controls'",
}  # the report's own PNGs and their alt texts
FOLDED_ROWS = 30  # a longer per-source table is folded (<details>) under its plot
ROLE_WORDS = {"finetune": "fine-tuning", "warmup": "warm-up (θ0)", "unseen": "unseen", "retention": "retention"}


def render(derived: Derived, out: Path) -> dict[str, Any]:
    """Write ``out`` (the run's ``report/``): the plots, report.md, then report.json; return the report."""
    report, figures = derived.report, derived.figures
    write_plots(figures, out)
    write_text_atomic(out / "report.md", markdown(report, figures.own(), figures.others))
    write_json_atomic(out / "report.json", report)  # last: its presence means the report is whole
    return report


def write_plots(figures: Figures, out: Path) -> None:
    """The report's PNGs that have data; stale ones from an earlier build are removed."""
    if bars := figures.benchmarks:
        plot_model_bars(
            bars.labels,
            bars.kinds,
            bars.values,
            out / "benchmarks.png",
            "benchmark average (0–100)",
            "Benchmark average per model (higher is better)",
        )
    if bars := figures.heldout:
        plot_model_bars(
            bars.labels,
            bars.kinds,
            bars.values,
            out / "heldout_loss.png",
            "held-out loss (token-weighted)",
            "Held-out loss per model (lower is better)",
        )
    if figures.per_source:
        models, sources, delta = figures.per_source
        plot_per_source(models, sources, delta, out / "per_source.png")
    if figures.curves:
        plot_training_curves(figures.curves, out / "training_curves.png")
    if figures.quality:
        plot_quality(figures.quality, out / "quality.png")
    if figures.diloco:
        plot_diloco(figures.diloco, out / "diloco.png")
    for stale in set(PLOT_FILES) - set(figures.own()):
        (out / stale).unlink(missing_ok=True)


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


def folded(table: dict[str, Any], what: str) -> str:
    """A table of more than FOLDED_ROWS rows folded under a line that says how many (the plot above
    it is what a reader looks at first; at 176 sources the table is for looking one up)."""
    text = markdown_table(**table)
    if len(table["rows"]) <= FOLDED_ROWS:
        return text
    return f"<details><summary>All {len(table['rows'])} {what}</summary>\n\n{text}\n\n</details>"


def markdown(report: dict[str, Any], own: list[str], others: list[str]) -> str:
    """report.md: ``own``, the report's PNGs (in report/), ``others``, the stages' (relative to the run)."""
    run, tables = report["run"], report["tables"]
    counts = ", ".join(f"{n} {ROLE_WORDS.get(role, role)}" for role, n in run["sources_by_role"].items())
    dropped = f" ({len(run['dropped_sources'])} dropped)" if run["dropped_sources"] else ""
    lines = [
        f"# Run report: {run['name']}",
        "",
        f"Run directory `{run['run_dir']}`, config digest `{run['config_digest']}`, "
        f"model `{run['model']}`; sources: {counts}{dropped}.",
    ]
    if skipped := run.get("skipped_records"):
        reasons = ", ".join(f"{n} {reason}" for reason, n in skipped.items())
        lines += ["", f"Records left out (`data.on_bad_record: skip`): {sum(skipped.values())} ({reasons})."]
    if source := run.get("source"):
        lines += ["", f"Every checkpoint is written in the stored layout of `{source['path']}`: {source['layout']}."]

    def section(title: str, *blocks: str) -> None:
        lines.extend(["", f"## {title}", ""])
        lines.append("\n\n".join(b for b in blocks if b))

    figure = {name: f"![{PLOT_FILES[name]}]({name})" for name in own}

    if bench := report.get("benchmarks"):
        section(
            "Benchmarks",
            "lmms-eval tasks none of the models was fine-tuned on, each scored 0–100 by its headline metric "
            "(accuracy, or as a judge model rates the answers), and their mean, as in the MERIT paper's Table 2. "
            + stand_ins(bench["tasks"])
            + (CONSTANT_NOTE if any(r["kind"] == "baseline" for r in bench["rows"]) else ""),
            bench["verdict"],
            figure.get("benchmarks.png", ""),
            markdown_table(**tables["benchmarks"]),
            "\n".join(f"- {note}" for note in bench.get("notes", [])),
            "Each job's results file and samples, as lmms-eval wrote them, its log and the command that redoes "
            "it (`score.json`): `eval/benchmarks/<model>/<task>/`.",
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
            + "."
            + (
                f" {searched['model']} ({searched['loss']:.4f}) is not compared: merge.search chose its weights "
                "by the same measure, on other held-out examples of these sources (its dev split)."
                if (searched := head.get("searched"))
                else ""
            ),
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
    if search := report.get("search"):
        given, best = search["given"], search["best"]
        chosen = ", ".join(f"{w:.3f}" for w in best["weights"])
        params = ", ".join(f"{k} {v:.3g}" for k, v in best["params"].items())
        section(
            "Merge weight search",
            f"`merit tune-merge` searched the branch weights of merge `{search['merge']}` ({search['method']}) "
            f"with {search['sampler']} over {search['trials']} trials, each scored on a dev split "
            f"apart from the benchmarks: {search['metric']} ({search['dev']}). "
            f"Given weights ({', '.join(f'{w:.3f}' for w in given['weights'])}): {given['value']:.4f}; "
            f"chosen, trial {best['trial']} ({chosen}{'; ' + params if params else ''}): "
            f"{best['value']:.4f}. The chosen merge is scored above as the merge with its weights searched"
            + (
                ", on held-out examples apart from the search's dev split, chosen by that same measure, so no "
                "verdict counts it; its benchmark scores are independent of the search; the search's "
                if search["metric"] == "held-out loss"
                else "; the search's "
            )
            + "plot is among the other plots.",
        )
    if problems := report.get("problems"):
        intro = "Checkpoints of this run that exist but do not verify (left out of the evaluation):"
        section("Problems", intro, "\n".join(f"- {p}" for p in problems))
    if "models" in tables:
        section("Models", figure.get("heldout_loss.png", ""), markdown_table(**tables["models"]))
    if "per_source" in tables:
        section("Per-source held-out loss", figure.get("per_source.png", ""), folded(tables["per_source"], "sources"))
    if "branches" in tables:
        section(
            "Branches",
            _budget_line(report.get("budget", {}), report["branches"], report.get("merge_weights", {})),
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


def _lora_line(branches: list[dict[str, Any]], merges: dict[str, dict[str, Any]]) -> str:
    """What LoRA branches adapted, and which merges combined their ΔW."""
    lora = next((b["lora"] for b in branches if "lora" in b), None)
    if lora is None:
        return ""
    line = (
        f"LoRA branches: rank {lora['rank']}, alpha {lora['alpha']:g}, on {len(lora['modules'])} modules "
        f"({brief(lora['modules'], 4)})"
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


def _budget_line(budget: dict[str, Any], branches: list[dict[str, Any]], weights: dict[str, dict[str, Any]]) -> str:
    """The training budget and the merge weights, in words."""
    if "epochs" in budget:
        epochs = f"{budget['epochs']:g} epoch(s)"
        spent = f"{epochs} over each branch's own data, the joint baseline {epochs} over all of it"
    elif budget:
        spent = f"{budget['steps']} steps per branch, {budget['joint_steps']} for the joint baseline"
    else:
        return ""
    return f"Budget: {spent}, a step of {budget['batch']}." + _weights_text(branches, weights)


def _weights_text(branches: list[dict[str, Any]], weights: dict[str, dict[str, Any]]) -> str:
    """The weights each merge used, as its manifest records them, merges weighting alike together;
    without such a record, the n_k the branches' column was computed from (and a word that it was)."""
    groups = [b for b in branches if "merge_weight" in b]
    seen = " / ".join(f"{b['weight_by_tokens_seen']:.3f}" for b in groups) if groups else ""
    if groups and not all(b.get("weight_by_tokens_seen") for b in groups):
        seen = ""
    contrast = f"by the tokens each branch saw it would be {seen}" if seen else ""
    if not weights:
        if not groups:
            return ""
        column = " / ".join(f"{b['merge_weight']:.3f}" for b in groups)
        return (
            f" Token-weighted merges weight branch k by n_k, the tokens of its group's training data: {column}"
            + (f" ({contrast})" if contrast else "")
            + ". No merge has recorded its weights yet: n_k as the data manifest has it now."
        )
    alike: dict[tuple[str, tuple[float, ...]], list[str]] = {}
    for name, w in weights.items():
        alike.setdefault((w["weighting"], tuple(w["weights"].values())), []).append(name)
    first_tokens = next((key for key in alike if key[0] == "tokens"), None)  # the branches' column
    text = ""
    for key, names in alike.items():
        weighting, values = key
        shown = " / ".join(f"{v:.3f}" for v in values)
        merges = ", ".join(f"`{n}`" for n in names)
        notes = [f"{merges}, as recorded"] + ([contrast] if key == first_tokens and contrast else [])
        lead = {
            "tokens": "Token-weighted merges weight branch k by n_k, the tokens of its group's training data",
            "equal": "Equally weighted merges weight the branches",
        }.get(weighting, "Merges with given weights weight the branches")
        text += f" {lead}: {shown} ({'; '.join(notes)})."
    return text


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
