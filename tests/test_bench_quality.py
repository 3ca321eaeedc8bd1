"""``merit bench quality`` on the shipped configs/benchmark.yaml (sizes overridden, nothing else):
the real flow per case, cases that share θ0 linked to it, the tables' figures equal to those of
each case's own report, and mean ± std computed as the formula says."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean, stdev

import pytest

from pipeline.bench.quality import aggregate, plan_cases
from pipeline.cli import build_parser, main
from pipeline.data.builtin import CONFLICTS

ROOT = Path(__file__).parent.parent
SIZES = [
    "data.builtin.examples_per_source=12",
    "calibration.n_per_source=4",
    "warmup.steps=4",
    "train.micro_batch=4",
    "train.checkpoint_every=100",
    "eval.max_new_tokens=8",
    "flow.retry_delay_s=0",
    f"train.deepspeed={ROOT}/configs/deepspeed/zero2.json",
]


def bench_args(workdir: Path, *extra: str) -> list[str]:
    sets = [a for s in SIZES for a in ("--set", s)]
    return ["bench", "quality", str(ROOT / "configs/benchmark.yaml"), "--workdir", str(workdir), *sets, *extra]


def test_cases_share_theta0_only_where_it_is_the_same():
    args = build_parser().parse_args(bench_args(Path("w"), "--seeds", "0", "1", "--k", "2", "4"))
    cases = {c.name: c for c in plan_cases(args)}
    assert cases["cued-s1-k4"].base == "cued-s1" and "calibration.r=2" in cases["cued-s1-k4"].overrides
    assert cases["cued-s0-joint2"].flow == "joint" and "train.epochs=2" in cases["cued-s0-joint2"].overrides
    assert cases["lr-3e-4"].base == "cued-s0"  # the same θ0: linked
    assert cases["warmup-1000"].base is None and cases["width-256"].base is None  # θ0 remade
    assert all("flow.controls=[random]" in c.overrides for c in cases.values())
    # Without warmup.lr the warm-up trains at train.lr: a learning-rate level makes its own θ0.
    args = build_parser().parse_args(bench_args(Path("w"), "--k", "4", "--set", "warmup.lr=null"))
    cases = {c.name: c for c in plan_cases(args)}
    assert cases["lr-3e-4"].base is None and cases["epochs-2"].base == "cued-s0"
    assert cases["width-128"].labels["K"] == 4 and "calibration.r=2" in cases["width-128"].overrides


def test_aggregate_is_mean_and_sample_std_over_seeds():
    rows = [
        {"model": "m", "split": "s", "loss": v, "accuracy_trained": a} for v, a in ((1.0, 0.5), (2.0, 0.5), (4.0, 1.0))
    ]
    (agg,) = aggregate(rows, ("model", "split"))
    assert agg["seeds"] == 3 and agg["loss"] == pytest.approx(mean([1.0, 2.0, 4.0]))
    assert agg["loss_std"] == pytest.approx(stdev([1.0, 2.0, 4.0]))
    assert agg["accuracy_trained_std"] == pytest.approx(stdev([0.5, 0.5, 1.0]))


def test_the_bench_runs_the_shipped_config_and_reports_each_case(prefect_api, tmp_path):
    assert main(bench_args(tmp_path, "--seeds", "0", "--k", "2", "--kinds", "cued", "--factors")) == 0
    rows = json.loads((tmp_path / "quality.json").read_text())
    base = json.loads((tmp_path / "cued-s0" / "report" / "report.json").read_text())
    merges = ["token_average", "iso_c", "ties"]
    assert [r["split"] for r in rows if r.get("merge") == "ties"] == ["MERIT-2", "Random-2"]
    for row in rows:  # every figure is the case's own report's
        if row.get("joint_epochs"):
            continue
        same = next(r for r in base["quality"]["rows"] if (r["model"], r["split"]) == (row["model"], row["split"]))
        assert row["loss"] == same["loss"] and row.get("accuracy_unseen") == same.get("accuracy_unseen")
    assert {r.get("merge") for r in rows} == {None, *merges}
    for split, folder in (("MERIT-2", tmp_path / "cued-s0"), ("Random-2", tmp_path / "cued-s0/controls/random")):
        groups = json.loads((folder / "calibration" / "split.json").read_text())["groups"]
        apart = sum(not any(a in g and b in g for g in groups) for a, b in CONFLICTS)
        assert {r["pairs_apart"] for r in rows if r["split"] == split} == {apart}

    # joint for 2 epochs: twice the steps of the 1-epoch joint, from the same θ0 (linked, not remade)
    joint2 = tmp_path / "cued-s0-joint2"
    assert (joint2 / "warmup").is_symlink() and (joint2 / "warmup").resolve() == (tmp_path / "cued-s0" / "warmup")
    steps = [
        json.loads((d / "joint" / "final" / "manifest.json").read_text())["step"]
        for d in (tmp_path / "cued-s0", joint2)
    ]
    assert 2 * steps[0] - 1 <= steps[1] <= 2 * steps[0]  # ⌈2n / B⌉ against ⌈n / B⌉
    text = (tmp_path / "quality.md").read_text()
    assert "joint (2 epochs)" in text and "Random-2" in text and "± 0.000" in text  # one seed: std 0
    assert (tmp_path / "quality-cued.png").stat().st_size > 5_000
