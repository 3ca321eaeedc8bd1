"""The measuring commands at their smallest settings: each runs through `merit bench`, prints its
table and leaves what it measured where it says (the merges, the trainer's metrics). Their
figures are for docs/results/; here only that they are figures of the real thing."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from merit.bench.merge import run_in_process
from merit.bench.train import model_flops
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


@pytest.mark.release  # a measurement command's own run
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


@pytest.mark.release  # a measurement command's own run
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


def test_model_flops_count_the_3b_widths_parameters_as_the_formula_takes_them(tmp_path):
    """At Qwen2.5-VL-3B's widths (built on the meta device): the blocks are every language parameter
    but the tied embedding, attention runs in all 36 layers, and a frozen tower costs 2 FLOPs per
    parameter and patch where a trained one costs 6."""
    from merit.bench.widths import width_overrides
    from pipeline.config import load_config
    from pipeline.models import build_tiny_processor
    from pipeline.models.tiny import tiny_config

    cfg = load_config(None, width_overrides("3b"))
    tiny_config(cfg.model, build_tiny_processor(cfg.model, 0).tokenizer).save_pretrained(tmp_path)
    flops = model_flops(tmp_path)
    hidden, inter, kv = 2048, 11008, 2 * 128
    layer = 2 * hidden * hidden + hidden + 2 * (hidden * kv + kv) + 3 * hidden * inter + 2 * hidden
    assert flops.blocks == 36 * layer + hidden  # the final norm too
    assert (flops.head, flops.attention_layers, flops.heads, flops.head_dim) == (151936 * hidden, 36, 16, 128)
    frozen, trained = (flops.per_token(0.8, 0.1, 1000.0, vision_trains=v) for v in (False, True))
    expected = 6 * flops.blocks + 6 * flops.head * 0.1 + 12 * 36 * 16 * 128 * 1000.0 + 2 * flops.vision * 4 * 0.8
    assert frozen == pytest.approx(expected) and trained - frozen == pytest.approx(4 * flops.vision * 4 * 0.8)


def bench_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.release  # a measurement command's own run
def test_train_at_a_real_width_ends_with_a_json_line_of_its_figures(tmp_path, capsys):
    """The path `merit bench train --device cuda` takes at 3B (the shipped 3B config's batch), at the
    small widths on CPU, with a smaller token budget, and a profile of two steps."""
    run_dir = tmp_path / "run"
    sizes = ["--size", "small", "--steps", "5", "--profile", "2", "--set", "train.max_tokens=1024"]
    merit(["bench", "train", DEMO, "--run-dir", str(run_dir), *sizes])
    (line,) = bench_lines(capsys.readouterr().out)
    out = bench_dir(run_dir, "train") / "trainer"
    records = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == line["steps"] == 5 and line["packing"] and line["mfu"] is None  # no MFU on a CPU
    assert line["padding_share"] == 0.0 and line["examples"] == records[-1]["examples"]
    assert line["attention"] == "merit_varlen" and line["liger"].startswith("off (there is no GPU")
    measured = records[3:]  # after the 3 warm-up steps
    tokens = records[-1]["tokens"] - records[2]["tokens"]
    seconds = records[-1]["elapsed_s"] - records[2]["elapsed_s"]
    assert line["tokens_per_s_with_wait"] == pytest.approx(tokens / seconds, rel=1e-6)
    assert line["tokens_per_s"] == pytest.approx(tokens / (seconds - sum(r["data_wait_s"] for r in measured)))
    profile = json.loads((out / "profile.json").read_text())
    assert profile["steps"] == 2 and 0 < profile["matmul_share"] < 1 and profile["top"]
    assert (out / "profile.md").read_text().startswith("# Profile: 2 steps on cpu")
