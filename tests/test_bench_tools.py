"""The measuring commands at their smallest settings: each runs through `merit bench`, prints its
table and leaves what it measured where it says (the merges, the trainer's metrics). Their
figures are for docs/benchmarks/results/; here only that they are figures of the real thing."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from benchmarks.merge import run_in_process
from benchmarks.train import flops_per_token
from merit.cli import main as merit
from pipeline.checkpoint import verify_checkpoint
from pipeline.layout import bench_dir

ROOT = Path(__file__).parent.parent
DEMO = str(ROOT / "configs" / "demo.yaml")


def table_rows(out: str, first: str) -> dict[str, list[str]]:
    """The rows of a printed table (cells two spaces apart) that start with one of ``first``'s
    words, by name."""
    rows = {}
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) > 2 and cells[0].startswith(first):
            rows[cells[0]] = cells[1:]
    return rows


def number(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_isoc_newton_schulz_is_exact_iso_c_up_to_its_iterations(capsys):
    merit(["bench", "isoc", "--shapes", "64x96", "--repeats", "1"])
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("64x96")]
    assert [line[1] for line in lines] == ["gaussian", "power0.5", "power1"]
    for line in lines:
        svd_s, ns_s, err_inner = number(line[2]), number(line[3]), number(line[5])
        assert svd_s > 0 and ns_s > 0 and err_inner < 1e-4


def test_isoc_refuses_a_shape_that_is_not_m_by_n(capsys):
    with pytest.raises(SystemExit):
        merit(["bench", "isoc", "--shapes", "64"])
    assert "'64': a shape is MxN" in capsys.readouterr().err


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    """One run directory at the small widths, shared by memory and load (θ0 built once)."""
    return tmp_path_factory.mktemp("bench") / "run"


def test_a_measurement_whose_process_dies_first_raises_instead_of_waiting_for_its_result():
    # sys.exit(queue): the child exits with code 1 and puts nothing (as a merge on a full disk did)
    with pytest.raises(RuntimeError, match="exit exited with code 1 and no result"):
        run_in_process(sys.exit)


def test_memory_measures_every_stage_and_the_merge_it_ran(small_run, capsys):
    sizes = ["--size", "small", "--k", "2", "--methods", "weighted_average", "--steps", "2"]
    merit(["bench", "memory", DEMO, "--run-dir", str(small_run), *sizes])
    out = capsys.readouterr().out
    stages = table_rows(out, ("calibrate", "train", "fisher", "evaluate", "weighted_average"))
    assert list(stages) == ["calibrate", "train steps (1 rank)", "fisher", "evaluate", "weighted_average, K=2"]
    for name, cells in stages.items():
        resident, anonymous = number(cells[0]), number(cells[1])
        assert resident >= anonymous > 0, name  # anonymous pages are part of the resident set
    assert verify_checkpoint(bench_dir(small_run, "merged"))["kind"] == "merge"
    metrics = (bench_dir(small_run, "train") / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2]


def test_load_times_every_stage_alone_and_beside_busy_processes(small_run, capsys):
    sizes = ["--size", "small", "--steps", "3", "--repeats", "1", "--load", "1"]
    merit(["bench", "load", DEMO, "--run-dir", str(small_run), *sizes])
    rows = table_rows(capsys.readouterr().out, ("calibrate", "train", "merge"))
    assert list(rows) == ["calibrate", "train step (1 rank)", "merge weighted_average, K = 2", "merge ties, K = 2"]
    for name, (unloaded, loaded, ratio) in rows.items():
        assert number(unloaded) > 0 and number(loaded) > 0, name
        # the ratio is of the unrounded times: it lies within what the printed, rounded times allow
        low, high = bounds(loaded)[0] / bounds(unloaded)[1], bounds(loaded)[1] / bounds(unloaded)[0]
        assert low - 0.005 <= number(ratio) <= high + 0.005, name


def bounds(cell: str) -> tuple[float, float]:
    """The interval of values a cell printed with its number of decimals stands for."""
    digits = len(cell.strip().split(".")[1]) if "." in cell else 0
    half = 0.5 * 10**-digits
    return number(cell) - half, number(cell) + half


def test_mfu_counts_a_frozen_vision_tower_forward_only():
    # The 3B widths: 3,754.6 M parameters, 668.7 M of them vision; 83 % of the tokens image tokens
    frozen = flops_per_token(3754.6e6, 668.7e6, 0.83, vision_trains=False)
    trained = flops_per_token(3754.6e6, 668.7e6, 0.83, vision_trains=True)
    assert frozen == pytest.approx(6 * 3085.9e6 + 2 * 4 * 0.83 * 668.7e6)
    assert trained - frozen == pytest.approx(4 * 4 * 0.83 * 668.7e6)  # the tower's backward: 4 per parameter


def test_train_at_a_real_width_reports_tokens_per_second_and_mfu(tmp_path, capsys):
    """The path `merit bench train --device cuda` takes at 3B, at the small widths on CPU."""
    run_dir = tmp_path / "run"
    merit(["bench", "train", DEMO, "--run-dir", str(run_dir), "--size", "small", "--steps", "4", "--micro-batch", "1"])
    out = capsys.readouterr().out
    rate = float(re.search(r"tokens/s \(median after 3 steps\): ([\d,]+)", out)[1].replace(",", ""))
    records = [json.loads(line) for line in (bench_dir(run_dir, "train") / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4 and records[3]["tokens_per_s"] > 0
    assert rate == pytest.approx(records[3]["tokens_per_s"], abs=0.5)  # the median of the one step after warm-up
    assert re.search(r"model FLOPs utilisation: [\d.]+ % of 989 TFLOP/s", out)
