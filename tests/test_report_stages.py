"""The report's three stages, each alone: collect on a tiny fabricated run directory, derive on
hand-made records, render on hand-made derived figures (tests/test_report.py: all three at once)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import write_json
from PIL import Image

from pipeline.config import load_config, save_config
from pipeline.merge.spec import ModelEntry
from pipeline.report.branches import column_weights, merge_weights
from pipeline.report.collect import Calibration, Control, Evaluation, Merge, RunRecords, Training, collect
from pipeline.report.derive import Bars, Derived, Figures, derive
from pipeline.report.render import markdown as render_markdown
from pipeline.report.render import render

MERGES = "merge.methods=[{name: avg, method: weighted_average}, {name: eq, method: iso_c, weighting: equal}]"


def tiny_run(run: Path) -> Path:
    """Config, data manifest, one branch with a final manifest, a merge recording its models, two
    evaluations (one of weights since replaced), a DiLoCo variant without rounds."""
    save_config(load_config(None, [MERGES]), run / "config.yaml")
    sources = {"a": {"train_examples": 4, "train_tokens": 100}, "b": {"dropped": True}}
    write_json(run / "data" / "manifest.json", {"sources": sources})
    write_json(run / "calibration" / "split.json", {"groups": [["a"]], "method": "pca"})
    Image.new("RGB", (4, 4)).save(run / "calibration" / "conflicts.png")
    branch = run / "branches" / "0"
    write_json(branch / "spec.json", {"sources": ["a"]})
    (branch / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.0, "tokens": 10}\n{"step": 2, "loss": 1.5, "tokens": 20}\n'
    )
    final = {"files": {}, "sources": ["a"], "step": 2, "tokens_seen": 20}
    write_json(branch / "final" / "manifest.json", final)
    spec = {"method": "weighted_average", "models": [{"path": str(branch / "final"), "tokens": 100}], "out_path": "x"}
    write_json(run / "merged" / "avg" / "manifest.json", {"spec": spec, "report": {"total_seconds": 2.0}, "files": {}})
    write_json(run / "eval" / "theta0.json", {"checkpoint_id": "tiny", "checkpoint": "tiny", "loss": 2.0, "seconds": 1})
    write_json(run / "eval" / "branch-0.json", {"checkpoint_id": "other weights", "loss": 1.0})
    write_json(run / "diloco" / "avg-iid" / "plan.json", {"rounds": 1, "workers": [0]})  # no rounds.json yet
    return run


def test_collect_reads_the_run_directory_into_records(tmp_path: Path):
    run = tiny_run(tmp_path / "run")
    records = collect(run)
    assert records.run_dir == str(run.resolve()) and records.config.run.name == load_config(None, [MERGES]).run.name
    assert records.models == [
        Evaluation("theta0", "theta0", "tiny", {"loss": 2.0, "seconds": 1}, {})
    ]  # branch-0's evaluation is of other weights
    (branch,) = records.trainings
    assert branch == Training(
        name="branch-0",
        kind="branch",
        dir="branches/0",
        spec_sources=["a"],
        final=json.loads((run / "branches" / "0" / "final" / "manifest.json").read_text()),
        metrics=[{"step": 1, "loss": 2.0, "tokens": 10}, {"step": 2, "loss": 1.5, "tokens": 20}],
        adapter_bytes=None,
        loss_plot=None,
    )
    (merge,) = records.merges  # eq has no manifest: not merged yet
    assert merge.name == "avg" and merge.report == {"total_seconds": 2.0}
    assert merge.models == {"branch-0": ModelEntry(path=str(run / "branches" / "0" / "final"), tokens=100)}
    assert records.calibration == Calibration(
        summary={}, split={"groups": [["a"]], "method": "pca"}, plots=["calibration/conflicts.png"]
    )
    assert records.problems == [] and records.controls == [] and records.diloco == [] and records.benchmarks == {}
    assert records.hashed["checkpoints"] == 2  # the branch's final and the merge, each verified once
    assert records.data["sources"]["b"] == {"dropped": True}


def test_collect_names_a_merged_model_by_the_branch_it_was_wherever_the_run_was(tmp_path: Path):
    run = tiny_run(tmp_path / "run")
    manifest = run / "merged" / "avg" / "manifest.json"
    spec = {"method": "weighted_average", "out_path": "x"}
    spec["models"] = [{"path": "/elsewhere/run/branches/0/final", "weight": 2.0}, {"path": "/a/model", "weight": 1.0}]
    write_json(manifest, {"spec": spec, "files": {}})
    assert list(collect(run).merges[0].models) == ["branch-0", "/a/model"]
    write_json(manifest, {"spec": {"method": "weighted_average"}, "files": {}})  # an older manifest
    assert collect(run).merges[0].models == {}


def records(**changes) -> RunRecords:
    """A run of two branches, the joint baseline and two merges, as collect would read it."""
    cfg = load_config(None, [MERGES])
    data = {
        "sources": {"a": {"train_examples": 10, "train_tokens": 100}, "b": {"train_examples": 30, "train_tokens": 300}}
    }

    def evaluation(name: str, kind: str, loss: float) -> Evaluation:
        return Evaluation(name, kind, None, {"loss": loss}, {"a": {"loss": loss}, "b": {"loss": loss + 1}})

    def training(k: int, source: str, tokens: int) -> Training:
        final = {"step": 4, "tokens_seen": tokens, "examples_seen": 20, "train_seconds": 10.0 * (k + 1)}
        metrics = [{"step": 1, "loss": 2.0, "tokens": tokens}]
        return Training(f"branch-{k}", "branch", f"branches/{k}", [source], final, metrics, None, None)

    def merge(name: str, **weights) -> Merge:
        entries = {f"branch-{k}": ModelEntry(path=f"branches/{k}/final", **w) for k, w in weights.items()}
        return Merge(name, {"method": "weighted_average"}, {"total_seconds": 1.0}, entries)

    fields = {
        "run_dir": "/runs/r",
        "config": cfg,
        "data": data,
        "problems": [],
        "models": [
            evaluation("theta0", "theta0", 3.0),
            evaluation("joint", "joint", 2.0),
            evaluation("merged-avg", "merged", 2.5),
        ],
        "trainings": [training(0, "a", 50), training(1, "b", 150)],
        "calibration": Calibration({"total_seconds": 3.0}, {"groups": [["a"], ["b"]]}, []),
        "merges": [
            merge("eq", **{"0": {}, "1": {}}),
            merge("avg", **{"0": {"tokens": 40}, "1": {"tokens": 60}}),
        ],
        "hashed": {"checkpoints": 0},
        "diagnostics": {},
        "benchmarks": {},
        "controls": [],
        "diloco": [],
        "search": {},
    }
    return RunRecords(**(fields | changes))


def test_derive_shows_each_merges_weights_and_the_token_merges_in_the_column():
    report = derive(records()).report
    assert report["merge_weights"] == {
        "eq": {"weighting": "equal", "weights": {"branch-0": 0.5, "branch-1": 0.5}},
        "avg": {"weighting": "tokens", "weights": {"branch-0": 0.4, "branch-1": 0.6}},
    }
    branches = report["branches"]
    assert [b["merge_weight"] for b in branches] == [0.4, 0.6]  # the token-weighted merge's, not 100 / 400
    assert [b["weight_by_tokens_seen"] for b in branches] == [0.25, 0.75]
    assert [b["data_tokens"] for b in branches] == [100, 300] and [b["epochs"] for b in branches] == [2.0, 20 / 30]
    assert column_weights({}) is None
    assert merge_weights([Merge("old", {}, {})]) == {}  # a manifest without the spec's models


def test_derive_falls_back_to_the_data_manifest_only_when_no_merge_recorded_weights():
    only_equal = derive(records(merges=[records().merges[0]])).report
    assert [b["merge_weight"] for b in only_equal["branches"]] == [0.5, 0.5]
    unmerged = derive(records(merges=[])).report
    assert "merge_weights" not in unmerged
    assert [b["merge_weight"] for b in unmerged["branches"]] == [0.25, 0.75]  # n_k / Σ n_j: 100 / 400


def test_derive_computes_the_reports_figures_from_records_alone():
    derived = derive(records())
    report = derived.report
    assert [m["delta_vs_joint"] for m in report["models"]] == [1.0, 0.0, 0.5]
    assert report["headline"] == {
        "model": "merged-avg",
        "loss": 2.5,
        "vs_joint": {"loss": 2.0, "delta": 0.5, "relative_pct": 25.0},
        "vs_theta0": {"loss": 3.0, "delta": -0.5, "relative_pct": pytest.approx(-100 / 6)},
    }
    costs = report["costs"]
    assert costs["branch_train_seconds_mean"] == 15.0 and costs["calibration_share_pct"] == 20.0
    assert costs["merges"]["avg"] == {
        "method": "weighted_average",
        "seconds": 1.0,
        "on_adapters": False,
        "format": "model",
    }
    assert report["tables"]["branches"]["rows"][1][:5] == ["branch-1", "branch", "b", 300, 0.6]
    assert report["tables"]["split"]["rows"] == [[0, 1, "a", None], [1, 1, "b", None]]
    assert report["quality"]["verdict"] == "MERIT-2 beats the joint baseline for 0 of 1."
    figures = derived.figures
    assert figures.own() == ["heldout_loss.png", "per_source.png", "training_curves.png", "quality.png"]
    assert report["plots"] == figures.own()
    names, sources, delta = figures.per_source
    assert names == ["joint", "merged-avg"] and sources == ["a", "b"]
    np.testing.assert_allclose(delta, [[-1.0, -1.0], [-0.5, -0.5]])
    assert figures.curves == {"branch-0": ([1], [2.0]), "branch-1": ([1], [2.0])}


def test_derive_sets_controls_beside_the_run():
    control = Control(
        "random", load_config(None, [MERGES]), [Evaluation("merged-avg", "merged", None, {"loss": 2.7}, {})], {}, {}
    )
    report = derive(records(controls=[control])).report
    assert report["controls"] == {"random": [{"name": "merged-avg", "loss": 2.7}]}
    assert report["quality"]["verdict"].startswith("MERIT-2 beats Random-2 by held-out loss for 1 of 1 merges")


def derived_figures(**figures) -> Derived:
    report = {
        "run": {
            "name": "r",
            "run_dir": "/runs/r",
            "config_digest": "d",
            "model": "tiny",
            "sources": ["a"],
            "sources_by_role": {"finetune": 1},
            "dropped_sources": [],
        },
        "branches": [
            {"name": "branch-0", "kind": "branch", "merge_weight": 0.25, "weight_by_tokens_seen": 0.5},
            {"name": "branch-1", "kind": "branch", "merge_weight": 0.75, "weight_by_tokens_seen": 0.5},
        ],
        "merge_weights": {
            "avg": {"weighting": "tokens", "weights": {"branch-0": 0.25, "branch-1": 0.75}},
            "ties": {"weighting": "tokens", "weights": {"branch-0": 0.25, "branch-1": 0.75}},
            "eq": {"weighting": "equal", "weights": {"branch-0": 0.5, "branch-1": 0.5}},
        },
        "budget": {
            "steps": 4,
            "joint_steps": 8,
            "global_batch": 2,
            "batch": "2 packed micro batches of at most 512 tokens",
        },
        "tables": {
            "branches": {"headers": ["branch", "merge weight"], "rows": [["branch-0", 0.25], ["branch-1", 0.75]]}
        },
    }
    figures = Figures(**figures)
    return Derived(report | {"plots": figures.own() + [f"../{p}" for p in figures.others]}, figures)


def test_render_writes_the_markdown_and_json_of_derived_figures(tmp_path: Path):
    out = tmp_path / "report"
    out.mkdir()
    (out / "diloco.png").write_bytes(b"stale")
    derived = derived_figures(
        heldout=Bars(["theta0", "merged-avg"], ["theta0", "merged"], [2.0, 1.5]), others=["x.png"]
    )
    report = render(derived, out)
    assert report == derived.report == json.loads((out / "report.json").read_text())
    assert (out / "heldout_loss.png").stat().st_size > 1000 and not (out / "diloco.png").exists()
    md = (out / "report.md").read_text()
    assert md.startswith(
        "# Run report: r\n\nRun directory `/runs/r`, config digest `d`, model `tiny`; sources: 1 fine-tuning."
    )
    budget = next(line for line in md.splitlines() if line.startswith("Budget:"))
    assert budget == (
        "Budget: 4 steps per branch, 8 for the joint baseline, a step of 2 packed micro batches of at most 512 tokens. "
        "Token-weighted merges weight branch k by"
        " n_k, the tokens of its group's training data: 0.250 / 0.750 (`avg`, `ties`, as recorded; by the tokens each"
        " branch saw it would be 0.500 / 0.500). Equally weighted merges weight the branches: 0.500 / 0.500 (`eq`, as"
        " recorded)."
    )
    assert "| branch-1 | 0.7500 |" in md and "- [x.png](../x.png)" in md and "## Models" not in md
    assert not list(out.glob(".*"))  # no temporary files left


def test_derive_reports_the_merge_weight_search_and_links_its_plot():
    search = {
        "merge": "avg",
        "method": "weighted_average",
        "sampler": "tpe",
        "metric": "held-out loss",
        "dev": "6 held-out examples of 2 trained sources",
        "given": {"trial": 0, "value": 2.5, "weights": [0.4, 0.6]},
        "best": {"trial": 3, "value": 2.25, "weights": [0.7, 0.3], "params": {}, "checkpoint": "search/avg/best"},
        "trials": [{"trial": n, "value": 2.5 - n / 12, "weights": [0.5, 0.5], "params": {}} for n in range(4)],
    }
    derived = derive(records(search=search))
    assert derived.report["search"]["trials"] == 4 and derived.report["search"]["best"]["value"] == 2.25
    assert "../search/avg/search.png" in derived.report["plots"]
    markdown = render_markdown(derived.report, derived.figures.own(), derived.figures.others)
    assert "## Merge weight search" in markdown
    assert "Given weights (0.400, 0.600): 2.5000; chosen, trial 3 (0.700, 0.300): 2.2500" in markdown
    assert "search" not in derive(records()).report
