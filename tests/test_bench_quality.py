"""``merit bench quality`` on the shipped configs/benchmark.yaml (sizes and, in the end-to-end run, the
merge list overridden: each merge is a benchmark run of its own per split):
the real flow per case, cases that share θ0 linked to it, the tables' figures equal to those of
each case's own report, and mean ± std computed as the formula says."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from statistics import mean, stdev

import pytest
from scipy import stats

from merit.bench.quality import CONSTANT_LABEL, add_arguments, aggregate, factor_table, paired, plan_cases
from merit.cli import main
from pipeline.config import load_config
from pipeline.data import load_sources
from pipeline.data.builtin import CONFLICTS, FINETUNE, SHORT
from pipeline.eval.benchmarks import CONSTANT

ROOT = Path(__file__).parent.parent
SIZES = [
    "data.builtin.examples_per_source=12",
    "warmup.sources.0.max_examples=12",  # the shipped warm-up generates 1,200 a skill
    "calibration.n_per_source=4",
    "warmup.steps=4",
    "train.micro_batch=4",
    "train.max_tokens=256",  # about 4 of the built-in examples a packed micro batch
    "train.checkpoint_every=100",
    "eval.max_new_tokens=8",
    "data.builtin.benchmark_examples=4",
    "eval.benchmarks=[toy_reading]",  # one task: the bench reads every task's score alike
    "flow.retry_delay_s=0",
    "flow.parallel_branches=2",  # on 2 cores: a tiny branch is mostly its process's start-up
    "train.deepspeed=zero2",
]


def bench_args(workdir: Path, *extra: str) -> list[str]:
    sets = [a for s in SIZES for a in ("--set", s)]
    return ["bench", "quality", str(ROOT / "configs/benchmark.yaml"), "--workdir", str(workdir), *sets, *extra]


def parsed(*extra: str) -> argparse.Namespace:
    """The quality bench's options as ``merit bench quality`` parses them."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(bench_args(Path("w"), *extra)[2:])


def test_cases_share_theta0_only_where_it_is_the_same():
    defaults = parsed()
    assert (defaults.kinds, defaults.interference, defaults.full_seeds, defaults.joint_epochs) == (
        ["opposed"],
        True,
        None,
        [],
    )
    assert defaults.shared_theta0
    factors = ["--factors", "pca", "lr", "warmup", "width"]
    args = parsed("--seeds", "0", "1", "--k", "2", "4", "--kinds", "cued", "--joint-epochs", "0.5", "2", *factors)
    planned = plan_cases(args)
    assert [c.base is None for c in planned] == sorted((c.base is None for c in planned), reverse=True)  # bases first
    cases = {c.name: c for c in planned}
    assert cases["cued-s1-k4"].base == "cued-s1" and "calibration.r=2" in cases["cued-s1-k4"].overrides
    assert "merge.methods=[{name: token_average, method: weighted_average}]" in cases["cued-s1-k4"].overrides
    for epochs in ("0.5", "2"):
        joint = cases[f"cued-s0-joint{epochs}"]
        assert joint.flow == "joint" and f"train.epochs={float(epochs)}" in joint.overrides and joint.base == "cued-s0"
    assert (
        cases["pca-uncentred-s1"].base == "cued-s1"
        and "calibration.pca=uncentred" in cases["pca-uncentred-s1"].overrides
    )
    assert cases["lr-3e-4-s0"].base == "cued-s0"  # the same θ0: linked
    assert cases["warmup-1000-s0"].base is None and cases["width-256-s1"].base is None  # θ0 remade
    # One θ0 for both seeds, warmed up once, named by every case that does not remake it.
    assert planned[0].name == "cued-theta0" and planned[0].flow == "theta0"
    theta0 = f"model.name_or_path={Path('w').absolute() / 'cued-theta0' / 'warmup' / 'final'}"
    for name, case in cases.items():
        shares = case.flow != "theta0" and case.labels.get("factor") not in ("warmup", "width")
        assert (theta0 in case.overrides and "warmup.steps=0" in case.overrides) == shares, name
    assert all(
        "flow.controls=[random]" in c.overrides
        for c in cases.values()
        if "factor" not in c.labels and c.flow != "theta0"
    )
    # Seeds past --full-seeds: MERIT at the smallest K and the 1-epoch joint only (no larger K, no
    # Random-K, no 0.5/2-epoch joint, no factors).
    args = parsed(
        "--seeds", "0", "1", "--full-seeds", "1", "--factors", "pca", "--kinds", "cued", "--joint-epochs", "2"
    )
    cases = {c.name: c for c in plan_cases(args)}
    assert "flow.controls=[]" in cases["cued-s1"].overrides and "cued-s1-joint2" not in cases
    assert {c for c in cases if c.startswith("pca")} == {"pca-uncentred-s0"}
    assert "cued-s0-k8" in cases and "cued-s1-k8" not in cases
    # Without warmup.lr the warm-up trains at train.lr: a learning-rate level makes its own θ0.
    args = parsed("--k", "4", "--set", "warmup.lr=null", "--kinds", "cued", *factors)
    cases = {c.name: c for c in plan_cases(args)}
    assert cases["lr-3e-4-s0"].base is None and cases["pca-uncentred-s0"].base == "cued-s0"
    assert cases["width-128-s0"].labels["K"] == 4 and "calibration.r=2" in cases["width-128-s0"].overrides


def test_aggregate_is_mean_and_sample_std_over_seeds():
    rows = [
        {"model": "m", "split": "s", "loss": v, "accuracy_trained": a, "benchmark": b}
        for v, a, b in ((1.0, 0.5, 10.0), (2.0, 0.5, None), (4.0, 1.0, 30.0))
    ]
    (agg,) = aggregate(rows, ("model", "split"))
    assert agg["seeds"] == 3 and agg["loss"] == pytest.approx(mean([1.0, 2.0, 4.0]))
    assert agg["loss_std"] == pytest.approx(stdev([1.0, 2.0, 4.0]))
    assert agg["accuracy_trained_std"] == pytest.approx(stdev([0.5, 0.5, 1.0]))
    assert (agg["benchmark"], agg["benchmark_n"]) == (20.0, 2)  # the values it has


def test_paired_statistics_are_the_papers():
    """Five seeds all in favour: the exact one-sided Wilcoxon p is 1/2^5 = 0.031, the paper's."""
    diffs = [1.0, 2.0, 3.0, 0.5, 1.5]
    got = paired(diffs)
    half = stats.t.ppf(0.975, 4) * stdev(diffs) / math.sqrt(5)
    assert got["n"] == 5 and got["p"] == pytest.approx(1 / 32) and got["mean"] == pytest.approx(1.6)
    assert (got["low"], got["high"]) == (pytest.approx(1.6 - half), pytest.approx(1.6 + half))
    assert paired([-1.0, -2.0, -3.0])["p"] == pytest.approx(1.0) and paired([0.0, 0.0])["p"] is None
    assert paired([2.0])["low"] is None  # one value: no interval


@pytest.mark.release  # a measurement command's own run
def test_the_bench_runs_the_shipped_config_and_reports_each_case(prefect_api, tmp_path):
    args = ["--seeds", "0", "--k", "2", "--factors", "--full-seeds", "1", "--joint-epochs", "2"]  # opposed conflicts
    merges = ["token_average", "ties"]
    methods = "merge.methods=[{name: token_average, method: weighted_average}, {name: ties, method: ties}]"
    assert main(bench_args(tmp_path, *args, "--set", methods)) == 0
    out = json.loads((tmp_path / "quality.json").read_text())
    rows, tests = out["rows"], out["paired"]
    base = json.loads((tmp_path / "opposed-s0" / "report" / "report.json").read_text())
    assert [r["split"] for r in rows if r.get("merge") == "ties"] == ["MERIT-2", "Random-2"]
    scores = {(r["model"], r["split"]): r for r in base["benchmarks"]["rows"]}
    constant = next(r for r in rows if r["model"] == CONSTANT_LABEL)  # once, from the case that made the data
    assert constant["benchmark"] == scores[(CONSTANT, "—")]["average"] and "loss" not in constant
    for row in rows:  # every figure is the case's own report's
        if row.get("joint_epochs") or row.get("factor") or row is constant:
            continue
        same = next(r for r in base["quality"]["rows"] if (r["model"], r["split"]) == (row["model"], row["split"]))
        assert row["loss"] == same["loss"] and row.get("accuracy_unseen") == same.get("accuracy_unseen")
        model = f"merged-{row['merge']}" if "merge" in row else row["model"]
        assert row["benchmark"] == scores[(model, row["split"])]["average"]
        assert row["bench/toy_reading"] == scores[(model, row["split"])]["toy_reading"]
    assert {r.get("merge") for r in rows if not r.get("factor")} == {None, *merges}
    for split, folder in (("MERIT-2", tmp_path / "opposed-s0"), ("Random-2", tmp_path / "opposed-s0/controls/random")):
        groups = json.loads((folder / "calibration" / "split.json").read_text())["groups"]
        apart = sum(not any(a in g and b in g for g in groups) for a, b in CONFLICTS["opposed"])
        assert {r["pairs_apart"] for r in rows if r["split"] == split and not r.get("factor")} == {apart}
    # one seed: a difference each, no interval
    merit = {r["merge"]: r for r in rows if r["split"] == "MERIT-2" and not r.get("factor")}
    random = {r["merge"]: r for r in rows if r["split"] == "Random-2"}
    joint = next(r for r in rows if r["model"] == "joint" and not r.get("joint_epochs"))
    for t in tests:
        other = random[t["merge"]] if t["against"] == "Random-2" else joint
        assert t["n"] == 1 and t["mean"] == pytest.approx(merit[t["merge"]]["benchmark"] - other["benchmark"])
    assert {(t["merge"], t["against"]) for t in tests} == {(m, a) for m in merges for a in ("Random-2", "joint")}

    # joint for 2 epochs: twice the steps of the 1-epoch joint, from the same θ0 (linked, not remade;
    # θ0's evaluations copied, not recomputed)
    joint2 = tmp_path / "opposed-s0-joint2"
    theta0 = tmp_path / "opposed-theta0" / "warmup" / "final"
    assert json.loads((theta0 / "manifest.json").read_text())["step"] == 4  # the shared θ0: the config's warm-up
    for case in (tmp_path / "opposed-s0", joint2):
        assert load_config(case / "config.yaml").model.name_or_path == str(theta0) and not (case / "warmup").exists()
    steps = [
        json.loads((d / "joint" / "final" / "manifest.json").read_text())["step"]
        for d in (tmp_path / "opposed-s0", joint2)
    ]
    assert 2 * steps[0] - 1 <= steps[1] <= 2 * steps[0]  # ⌈2n / B⌉ against ⌈n / B⌉
    assert not (tmp_path / "opposed-s0" / "eval" / "branch-0.json").exists()  # eval.branches: false
    job = Path("eval") / "benchmarks" / "theta0" / "toy_reading" / "score.json"
    assert (joint2 / job).read_text() == (tmp_path / "opposed-s0" / job).read_text()
    text = (tmp_path / "quality.md").read_text()
    assert "joint (2 epochs)" in text and "MERIT-2 − Random-2" in text and "benchmark average" in text
    assert "**Premises, opposed conflicts**" in text and "3. Training a pair together interferes" in text

    # Premise 3: the pairs' two sides apart (two trained groups, the unpaired third not trained) and
    # together (one), from the seed's θ0, scored on the paired sources' held-out examples.
    pairs = tmp_path / "opposed-s0-pairs"
    measured = json.loads((pairs / "interference.json").read_text())
    paired = {s for pair in CONFLICTS["opposed"] for s in pair}
    for arrangement, trained in (("apart", 2), ("together", 1)):
        groups = json.loads((pairs / arrangement / "calibration" / "split.json").read_text())["groups"]
        assert len(groups) == trained + 1 and set(groups[-1]).isdisjoint(paired)
        assert [(pairs / arrangement / "branches" / str(k) / "final").is_dir() for k in range(len(groups))] == [
            True
        ] * trained + [False]
        assert set(measured["accuracy"][arrangement]) == set(measured["accuracy"]["theta0"]) == paired
        assert load_config(pairs / arrangement / "config.yaml").model.name_or_path == str(theta0)
    drop = out["interference"]["opposed"]["0"]
    apart, together = (measured["accuracy"][a] for a in ("apart", "together"))
    assert drop["drop/all"] == pytest.approx(mean(apart[s] for s in paired) - mean(together[s] for s in paired))
    assert (tmp_path / "quality-opposed.png").stat().st_size > 5_000


def test_a_factor_table_sets_each_level_beside_the_default_at_the_same_seeds():
    base = [{"seed": s, "model": "theta0", "split": "—", "benchmark": 10.0} for s in (0, 1)] + [
        {
            "seed": s,
            "model": "m",
            "merge": "token_average",
            "split": "MERIT-2",
            "benchmark": b,
            "loss": 1.0,
            "pairs_apart": 4,
        }
        for s, b in ((0, 20.0), (1, 30.0), (2, 99.0))  # seed 2 ran no factor level: left out
    ]
    # Left out too: the larger K (factors run at the smallest) and the joint of another budget.
    base += [{"seed": 0, "model": "m", "merge": "token_average", "split": "MERIT-4", "K": 4, "benchmark": 99.0}]
    base += [{"seed": 0, "model": "joint", "split": "—", "joint_epochs": 2.0, "benchmark": 99.0}]
    rows = [
        {
            "seed": s,
            "model": "m",
            "merge": "token_average",
            "split": "MERIT-2",
            "level": "uncentred",
            "benchmark": b,
            "loss": 2.0,
            "pairs_apart": 3,
        }
        for s, b in ((0, 10.0), (1, 20.0))
    ]
    table = factor_table(rows, "pca", base)
    assert "| default | 2 | 10.0 |  | 25.0 | 1.000 | 4.0 |" in table
    assert "| uncentred | 2 |  |  | 15.0 | 2.000 | 3.0 |" in table


def test_the_earlier_testbed_config_still_loads_as_it_ran():
    """configs/benchmark-cued.yaml: the quality bench's setting until 2026-12-03 (cued pairs, the
    0.2 M model, a 300-step warm-up on the 15 skills of then), its sources generated at 4 examples."""
    cfg = load_config(ROOT / "configs/benchmark-cued.yaml", ["data.builtin.examples_per_source=4"])
    assert (cfg.data.builtin.conflicts, cfg.model.tiny.hidden_size, cfg.warmup.steps) == ("cued", 64, 300)
    loaded = load_sources(cfg.data, cfg.run.seed, cfg.warmup.sources, cfg.eval.sources)
    skills = [name for name, role in loaded.roles.items() if role == "warmup" and name in loaded.examples]
    new = {"shape_check", "side_check", "count_check", "sum_check", "read_placed", "count_add", "relation_choice"}
    assert skills == [f"skill_{family}" for family in SHORT if family not in new]
    assert [n for n, r in loaded.roles.items() if r == "finetune" and n in loaded.examples] == FINETUNE["cued"]
