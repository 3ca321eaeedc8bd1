"""The run report, built from a synthetic run directory written to the producers' contract."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import write_json
from PIL import Image

from pipeline.checkpoint import checkpoint_id
from pipeline.config import load_config, save_config
from pipeline.layout import model_paths
from pipeline.report import build_report, markdown_table
from pipeline.report.build import train_seconds
from pipeline.train.spec import BranchSpec

SOURCES = ["captions", "counting", "ocr", "vqa"]
GROUPS = [["captions", "vqa"], ["counting", "ocr"]]
# model -> per-source held-out losses; the aggregate loss is their token-weighted mean (equal tokens)
LOSSES = {
    "theta0": [2.0, 2.2, 1.8, 2.0],
    "branch-0": [1.4, 2.0, 1.7, 1.3],
    "branch-1": [1.9, 1.5, 1.3, 1.9],
    "joint": [1.2, 1.2, 1.1, 1.3],
    "merged-avg": [1.4, 1.3, 1.2, 1.3],
    "merged-iso": [1.3, 1.2, 1.2, 1.3],
}


def write_base(run: Path) -> None:
    merges = "merge.methods=[{name: avg, method: weighted_average}, {name: iso, method: iso_c}]"
    save_config(load_config(None, [merges, "train.packing=false"]), run / "config.yaml")  # steps from examples
    info = {
        "examples": 20,
        "train_examples": 18,
        "heldout_indices": [0, 1],
        "supervised_tokens": 100,
        "format": "builtin",
        "truncated": 0,
        "skipped": 0,
    }
    sources = {s: {**info, "train_tokens": 1000 * (i + 1)} for i, s in enumerate(SOURCES)}
    write_json(
        run / "data" / "manifest.json",
        {"config_digest": "abc", "max_length": 1024, "sources": {**sources, "broken": {"dropped": True, "skipped": 3}}},
    )


def write_eval(run: Path, model: str) -> float:
    losses = LOSSES[model]
    loss = sum(losses) / len(losses)
    per_source = {s: {"loss": v, "token_accuracy": 0.5, "tokens": 50, "examples": 2} for s, v in zip(SOURCES, losses)}
    # the identity of the weights evaluated: the checkpoint's own when it exists (see the report's staleness check)
    path = model_paths(load_config(run / "config.yaml"), run).get(model, Path("absent"))
    write_json(
        run / "eval" / f"{model}.json",
        {
            "model": model,
            "checkpoint": str(path),
            "checkpoint_id": checkpoint_id(path),
            "config_digest": "abc",
            "sources": per_source,
            "loss": loss,
            "macro_loss": loss + 0.01,
            "token_accuracy": 0.6,
            "seconds": 1.0,
        },
    )
    return loss


def write_training(run: Path, folder: str, sources: list[str], records: list[dict], final: dict | None) -> None:
    out = run / folder
    cfg = load_config(run / "config.yaml")
    BranchSpec(
        name=folder, run_dir=str(run), init=str(run / "init"), sources=sources, out_dir=str(out), config=cfg
    ).save(out / "spec.json")
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if final is not None:
        write_json(out / "final" / "manifest.json", {"files": {}, "sources": sources, "branch": folder, **final})


def metrics(losses: list[float], tokens_per_step: int, rates: list[float], elapsed: list[float] | None) -> list[dict]:
    records = []
    for i, (loss, rate) in enumerate(zip(losses, rates)):
        r = {
            "step": i + 1,
            "loss": loss,
            "lr": 1e-3,
            "tokens": tokens_per_step * (i + 1),
            "tokens_per_s": rate,
            "grad_norm": 1.0,
        }
        if elapsed is not None:
            r["elapsed_s"] = elapsed[i]
        records.append(r)
    return records


@pytest.fixture
def full_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    write_base(run)
    write_training(run, "warmup", SOURCES, metrics([3.0, 2.5], 100, [100, 100], None), None)
    # branch 0: train_seconds in its final manifest wins over the metrics' elapsed_s
    write_training(
        run,
        "branches/0",
        GROUPS[0],
        metrics([2.0, 1.8, 1.5], 1000, [50, 50, 50], [10.0, 20.0, 39.0]),
        {"step": 3, "tokens_seen": 3000, "examples_seen": 24, "train_seconds": 40.0},
    )
    # branch 1: neither train_seconds nor elapsed_s (an older file): 1000/50 + 1000/50 + 1000/100 = 50 s
    write_training(
        run,
        "branches/1",
        GROUPS[1],
        metrics([2.1, 1.9, 1.6], 1000, [50, 50, 100], None),
        {"step": 3, "tokens_seen": 4500, "examples_seen": 24},  # longer examples than branch 0's
    )
    write_training(
        run,
        "joint",
        SOURCES,
        metrics([2.0, 1.7, 1.4, 1.2], 1500, [100] * 4, [15.0, 30.0, 45.0, 70.0]),
        {"step": 4, "tokens_seen": 6000},
    )
    for name, method, seconds in (("avg", "weighted_average", 1.5), ("iso", "iso_c", 4.25)):
        write_json(
            run / "merged" / name / "manifest.json",
            {
                "kind": "merge",
                "spec": {"method": method, "params": {}},
                "report": {"total_seconds": seconds, "tensors": 10, "method_counts": {method: 10}},
                "files": {},
            },
        )
    calibration = run / "calibration"
    write_json(
        calibration / "summary.json",
        {
            "groups": GROUPS,
            "tokens": [5000, 5000],
            "explained_variance": [0.62],
            "gradient_seconds": 0.7,
            "total_seconds": 0.9,
            "parameters": 1000,
            "dim": 64,
            "sketch": "projection",
            "plots": ["calibration/conflicts.png"],
        },
    )
    write_json(
        calibration / "split.json",
        {"groups": GROUPS, "tokens": [5000, 5000], "r": 1, "explained_variance": [0.62], "method": "pca", "seed": 0},
    )
    Image.new("RGB", (8, 8)).save(calibration / "conflicts.png")
    Image.new("RGB", (8, 8)).save(run / "branches" / "0" / "loss.png")
    for model in LOSSES:
        write_eval(run, model)
    return run


def mean_loss(model: str) -> float:
    return sum(LOSSES[model]) / len(SOURCES)


def test_full_report(full_run: Path):
    report = build_report(full_run)
    assert report == json.loads((full_run / "report" / "report.json").read_text())
    keys = {"run", "models", "branches", "budget", "split", "costs", "headline", "quality", "plots", "tables"}
    assert set(report) == keys  # no "controls": this run has none
    assert report["run"]["name"] == load_config(full_run / "config.yaml").run.name
    assert report["run"]["config_digest"] == load_config(full_run / "config.yaml").digest()
    assert report["run"]["dropped_sources"] == ["broken"]

    # fixed order: θ0, branches, joint, merges; Δ vs joint against the joint's loss
    assert [m["name"] for m in report["models"]] == list(LOSSES)
    assert [m["kind"] for m in report["models"]] == ["theta0", "branch", "branch", "joint", "merged", "merged"]
    for m in report["models"]:
        assert m["loss"] == pytest.approx(mean_loss(m["name"]))
        assert m["delta_vs_joint"] == pytest.approx(mean_loss(m["name"]) - mean_loss("joint"))
        assert m["sources"]["ocr"]["loss"] == LOSSES[m["name"]][2]
    table = report["tables"]["models"]
    assert table["headers"] == ["model", "kind", "held-out loss", "macro loss", "token accuracy", "Δ vs joint"]
    assert table["rows"][-1] == ["merged-iso", "merged", 1.25, 1.26, 0.6, round(1.25 - 1.2, 4)]
    per_source = report["tables"]["per_source"]
    assert per_source["headers"] == ["source", *LOSSES]
    assert per_source["rows"][1] == ["counting", *(LOSSES[m][1] for m in LOSSES)]

    headline = report["headline"]
    assert headline["model"] == "merged-iso"
    assert headline["vs_joint"]["relative_pct"] == pytest.approx(100 * (1.25 - 1.2) / 1.2)
    assert headline["vs_theta0"]["delta"] == pytest.approx(1.25 - 2.0)

    branches = {b["name"]: b for b in report["branches"]}
    assert list(branches) == ["warmup", "branch-0", "branch-1", "joint"]
    assert branches["branch-0"]["train_seconds"] == 40.0
    assert branches["branch-1"]["train_seconds"] == pytest.approx(50.0)
    assert branches["joint"]["train_seconds"] == 70.0
    assert branches["warmup"]["train_seconds"] == pytest.approx(2.0)  # no final manifest: from the metrics
    assert branches["branch-1"] | {"train_seconds": None} == {
        "name": "branch-1",
        "kind": "branch",
        "dir": "branches/1",
        "sources": GROUPS[1],
        "tokens": 4500,
        "examples": 24,
        "steps": 3,
        "train_seconds": None,
        "last_loss": 1.6,
        "data_examples": 36,
        "data_tokens": 2000 + 3000,  # counting, ocr
        "epochs": 24 / 36,
        "merge_weight": 5000 / (5000 + 5000),  # the groups' data, not the tokens seen
        "weight_by_tokens_seen": 4500 / (3000 + 4500),
    }
    assert "merge_weight" not in branches["joint"] and branches["joint"]["data_tokens"] == 10_000
    assert report["tables"]["branches"]["headers"][3:6] == ["data tokens (n_k)", "merge weight", "epochs"]
    row = ["branch-0", "branch", "captions, vqa", 5000, 0.5, round(24 / 36, 4), 3, 3000, 40.0, 1.5]
    assert report["tables"]["branches"]["rows"][1] == row
    assert report["budget"] == {"epochs": 1.0, "global_batch": 8, "batch": "8 examples"}
    markdown = (full_run / "report" / "report.md").read_text()
    assert "Budget: 1 epoch(s) over each branch's own data, the joint baseline 1 epoch(s) over all of it" in markdown
    assert "n_k, the tokens of its group's training data: 0.500 / 0.500 (by the tokens each branch saw" in markdown

    costs = report["costs"]
    assert costs["branch_train_seconds_mean"] == pytest.approx(45.0)
    assert costs["branch_train_seconds_max"] == pytest.approx(50.0)
    assert costs["calibration_share_pct"] == pytest.approx(100 * 0.9 / 45.0)
    assert costs["merges"] == {
        "avg": {"method": "weighted_average", "seconds": 1.5, "on_adapters": False, "format": "model"},
        "iso": {"method": "iso_c", "seconds": 4.25, "on_adapters": False, "format": "model"},
    }
    assert report["split"] == {
        "groups": GROUPS,
        "tokens": [5000, 5000],
        "r": 1,
        "explained_variance": [0.62],
        "method": "pca",
        "seed": 0,
    }

    quality = report["quality"]  # without controls: θ0, joint and MERIT's merges
    assert [(r["model"], r["split"]) for r in quality["rows"]] == [
        ("theta0", "—"),
        ("joint", "—"),
        ("avg: weighted_average", "MERIT-2"),
        ("iso: iso_c (scale 1.0)", "MERIT-2"),
    ]
    assert [r["loss"] for r in quality["rows"]] == pytest.approx(
        [mean_loss(m) for m in ("theta0", "joint", "merged-avg", "merged-iso")]
    )
    assert quality["verdict"] == "MERIT-2 beats the joint baseline for 0 of 2."
    # evaluations without accuracy (eval.accuracy off): no accuracy column, no empty panel
    assert report["tables"]["quality"]["headers"] == ["model", "split", "held-out loss", "‖θ − θ0‖ / ‖θ0‖"]

    own = ["heldout_loss.png", "per_source.png", "training_curves.png", "quality.png"]
    assert report["plots"] == [*own, "../calibration/conflicts.png", "../branches/0/loss.png"]  # relative to report/
    for path in report["plots"]:
        assert (full_run / "report" / path).is_file()
    for path in own:
        with Image.open(full_run / "report" / path) as image:
            assert image.format == "PNG" and image.size[0] > 300
        assert (full_run / "report" / path).stat().st_size > 5000

    md = (full_run / "report" / "report.md").read_text()
    assert "held-out loss **1.2500**" in md
    assert "(1.2000): +0.0500 (+4.17 %)" in md  # vs joint
    assert "(2.0000): -0.7500 (-37.50 %)" in md  # vs θ0
    assert "**2.00 %**" in md  # calibration share
    for link in (
        "![held-out loss](heldout_loss.png)",
        "](per_source.png)",
        "](training_curves.png)",
        "(../calibration/conflicts.png)",
        "(../branches/0/loss.png)",
    ):
        assert link in md
    for title in ("Headline", "Models", "Per-source held-out loss", "Branches", "Split", "Costs", "Other plots"):
        assert f"\n## {title}\n" in md
    assert "| merged-iso | merged | 1.2500 | 1.2600 | 0.6000 | 0.0500 |" in md
    assert not list((full_run / "report").glob(".*"))  # no temporary files left


def test_minimal_run(tmp_path: Path):
    """Only config, data manifest and θ0's evaluation: the report has what there is, no crash."""
    run = tmp_path / "run"
    write_base(run)
    write_eval(run, "theta0")
    report = build_report(run)
    assert set(report) == {"run", "models", "plots", "tables"}
    assert report["plots"] == ["heldout_loss.png"]
    assert set(report["tables"]) == {"models", "per_source"}
    assert report["tables"]["models"]["headers"][-1] == "token accuracy"  # no joint: no Δ column
    md = (run / "report" / "report.md").read_text()
    assert "## Models" in md and "## Headline" not in md and "## Branches" not in md and "## Costs" not in md
    assert "per_source.png" not in md

    (run / "eval" / "theta0.json").unlink()
    (run / "branches" / "0").mkdir(parents=True)  # a branch that started but wrote nothing yet
    report = build_report(run)
    assert set(report) == {"run", "plots", "tables"} and report["plots"] == []
    assert not (run / "report" / "heldout_loss.png").exists()  # stale plot removed


def test_report_without_joint_or_merges(full_run: Path):
    for path in [full_run / "eval" / "joint.json", *(full_run / "eval").glob("merged-*.json")]:
        path.unlink()
    shutil.rmtree(full_run / "merged")
    (full_run / "calibration" / "split.json").unlink()
    report = build_report(full_run)
    assert "headline" not in report and "merges" not in report["costs"]
    assert all("delta_vs_joint" not in m for m in report["models"])
    assert report["split"]["groups"] == GROUPS and "method" not in report["split"]  # from summary.json alone


def test_train_seconds_fallback():
    assert train_seconds([]) is None
    assert train_seconds(metrics([1.0, 1.0], 100, [10, 50], [3.0, 7.5])) == 7.5
    assert train_seconds(metrics([1.0, 1.0, 1.0], 100, [10, 50, 0], None)) == pytest.approx(
        10 + 2
    )  # a 0 rate is skipped


def test_markdown_table():
    text = markdown_table(["name", "n", "x"], [["a|b", 1234, 0.5], ["c", None, 1.0]])
    assert text.splitlines() == [
        "| name | n | x |",
        "|:---|---:|---:|",
        "| a\\|b | 1,234 | 0.5000 |",
        "| c |  | 1.0000 |",
    ]


def test_the_report_leaves_out_stale_evaluations(full_run):
    manifest = full_run / "merged" / "iso" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"tensors": 10', '"tensors": 11'))  # iso was merged again
    save_config(
        load_config(full_run / "config.yaml", ["merge.methods=[{name: iso, method: iso_c}]"]), full_run / "config.yaml"
    )
    names = [m["name"] for m in build_report(full_run)["models"]]
    assert names == ["theta0", "branch-0", "branch-1", "joint"]  # avg left the config; iso's weights changed


def test_a_corrupt_checkpoint_is_reported_as_such_not_left_out_silently(full_run: Path):
    final = full_run / "branches" / "1" / "final"
    manifest = json.loads((final / "manifest.json").read_text())
    (final / "model.safetensors").write_bytes(b"cut short")
    write_json(final / "manifest.json", {**manifest, "files": {"model.safetensors": "0" * 64}})
    report = build_report(full_run)
    assert report["problems"] == [
        f"branch-1: {final / 'model.safetensors'}: sha256 does not match the manifest (corrupt or truncated)"
    ]
    assert "branch-1" not in [m["name"] for m in report["models"]]  # its evaluation is of other weights
    markdown = (full_run / "report" / "report.md").read_text()
    assert "## Problems" in markdown and "- branch-1: " in markdown


def test_plots_are_inlined_for_the_prefect_ui_small_and_decodable(tmp_path):
    from pipeline.report.embed import MAX_WIDTH, embed_plots

    (tmp_path / "report").mkdir()
    (tmp_path / "branches").mkdir()
    Image.new("RGB", (1600, 900), "white").save(tmp_path / "report" / "loss.png")
    Image.new("RGB", (300, 200), "red").save(tmp_path / "branches" / "curve.png")
    markdown = "![loss](loss.png)\n\n- [curve](../branches/curve.png)\n\n![remote](https://example.org/x.png)\n"
    inlined = embed_plots(markdown, tmp_path / "report")
    uris = re.findall(r"!\[(\w+)\]\(data:image/png;base64,([^)]+)\)", inlined)
    assert [alt for alt, _ in uris] == ["loss", "curve"]
    images = [Image.open(io.BytesIO(base64.b64decode(data))) for _, data in uris]
    assert [im.size for im in images] == [(MAX_WIDTH, 450), (300, 200)]  # scaled down, never up
    assert "![remote](https://example.org/x.png)" in inlined  # absolute links are left alone


def record_merges(run: Path, tokens: list[int]) -> None:
    """The merges' manifests as the merge stage writes them: each spec lists the branches' finals
    with the tokens n_k (``weighting: tokens``) or nothing (``weighting: equal``) it merged with."""
    from pipeline.merging import entry_spec

    cfg = load_config(
        run / "config.yaml",
        ["merge.methods=[{name: avg, method: weighted_average}, {name: iso, method: iso_c, weighting: equal}]"],
    )
    finals = [run / "branches" / str(k) / "final" for k in range(len(GROUPS))]
    for entry in cfg.merge.methods:
        spec = entry_spec(cfg, entry, run / "init", finals, tokens, run / "merged" / entry.name)
        path = run / "merged" / entry.name / "manifest.json"
        write_json(path, json.loads(path.read_text()) | {"spec": spec.model_dump(mode="json")})


def test_the_merge_weights_shown_are_those_the_merges_recorded_not_the_data_manifests(full_run: Path):
    record_merges(full_run, [4000, 6000])  # n_k when the branches were merged
    data = full_run / "data" / "manifest.json"  # prepared again since, with other token counts
    manifest = json.loads(data.read_text())
    for info in manifest["sources"].values():
        info["train_tokens"] = 7 * info.get("train_tokens", 0)
    write_json(data, manifest)
    report = build_report(full_run)

    branches = {b["name"]: b for b in report["branches"]}
    assert branches["branch-0"]["merge_weight"] == 0.4 and branches["branch-1"]["merge_weight"] == 0.6
    assert branches["branch-0"]["data_tokens"] == 7 * 5000  # the data as prepared now, shown as such
    assert report["merge_weights"] == {
        "avg": {"weighting": "tokens", "weights": {"branch-0": 0.4, "branch-1": 0.6}},
        "iso": {"weighting": "equal", "weights": {"branch-0": 0.5, "branch-1": 0.5}},
    }
    assert [row[4] for row in report["tables"]["branches"]["rows"]] == [None, 0.4, 0.6, None]
    markdown = (full_run / "report" / "report.md").read_text()
    assert "training data: 0.400 / 0.600 (`avg`, as recorded; by the tokens each branch saw it would be" in markdown
    assert "Equally weighted merges weight the branches: 0.500 / 0.500 (`iso`, as recorded)." in markdown
    assert "No merge has recorded its weights yet" not in markdown

    # No weight no merge used: without a token-weighted merge the column is the equal merge's.
    shutil.rmtree(full_run / "merged" / "avg")
    report = build_report(full_run)
    assert [b.get("merge_weight") for b in report["branches"]] == [None, 0.5, 0.5, None]
    assert set(report["merge_weights"]) == {"iso"}
    assert "Token-weighted" not in (full_run / "report" / "report.md").read_text()


def test_before_any_merge_recorded_weights_the_report_says_the_weights_are_the_data_manifests(full_run: Path):
    shutil.rmtree(full_run / "merged")
    report = build_report(full_run)
    assert "merge_weights" not in report
    assert [b.get("merge_weight") for b in report["branches"]] == [None, 0.5, 0.5, None]  # n_k / Σ n_j
    markdown = (full_run / "report" / "report.md").read_text()
    assert "No merge has recorded its weights yet: n_k as the data manifest has it now." in markdown


def test_a_per_source_table_of_many_sources_is_folded_under_its_plot():
    from pipeline.report.render import FOLDED_ROWS, folded

    def table(n: int) -> dict:
        return {"headers": ["source", "theta0"], "rows": [[f"mix/s{i}", 1.0] for i in range(n)]}

    assert folded(table(FOLDED_ROWS), "sources") == markdown_table(**table(FOLDED_ROWS))
    many = folded(table(176), "sources")
    assert many.startswith("<details><summary>All 176 sources</summary>") and many.endswith("</details>")
    assert markdown_table(**table(176)) in many


def test_the_verdict_never_counts_a_merge_whose_weights_were_searched_on_the_held_out_loss():
    from pipeline.report.quality import verdict

    rows = [
        {"model": "joint", "split": "—", "loss": 1.0},
        {"model": "merged-avg", "merge": "avg", "split": "MERIT-2", "loss": 1.2},
        {"model": "merged-avg-tuned", "merge": "avg-tuned", "split": "MERIT-2", "loss": 0.9},
        {"model": "merged-avg", "merge": "avg", "split": "Random-2", "loss": 1.3},
    ]
    said = verdict(rows, ["MERIT-2", "Random-2"])
    assert said == (
        "MERIT-2 beats Random-2 by held-out loss for 1 of 1 merges; beats the joint baseline for 0 of 1 "
        "(the merge whose weights were searched by held-out loss not counted)."
    )
    # Searched on dev tasks, its held-out loss is no search's objective: counted.
    assert "for 1 of 2" in verdict(rows, ["MERIT-2", "Random-2"], searched=False)
