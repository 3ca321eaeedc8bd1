"""The `merit` command as a user runs it (a real subprocess)."""

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).parent.parent
SMALL = ["--set", "data.builtin.examples_per_source=10"]


def merit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_demo_prints_the_summary_and_keeps_the_resolved_config(tmp_path):
    run = merit("demo", "configs/demo.yaml", "--run-dir", str(tmp_path), *SMALL)
    assert run.returncode == 0, run.stderr
    assert "θ0:" in run.stdout and "parameters" in run.stdout
    total = next(line for line in run.stdout.splitlines() if line.startswith("total"))
    assert total.split()[1] == "180"  # 18 sources x 10 examples
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["data"]["builtin"]["examples_per_source"] == 10
    assert (tmp_path / "init" / "manifest.json").is_file() and (tmp_path / "data" / "manifest.json").is_file()
    assert "split into 2 groups" in run.stdout and (tmp_path / "calibration" / "split.json").is_file()
    # Any stage re-runs alone from the run directory's resolved config.
    again = merit("prepare", "--run-dir", str(tmp_path))
    assert again.returncode == 0, again.stderr
    assert next(line for line in again.stdout.splitlines() if line.startswith("total")) == total


def test_bad_override_exits_2_naming_the_key(tmp_path):
    run = merit("prepare", "configs/demo.yaml", "--run-dir", str(tmp_path), "--set", "data.max_lenght=3")
    assert run.returncode == 2
    assert "data.max_lenght" in run.stderr and "Traceback" not in run.stderr


def test_bad_data_exits_2_naming_file_and_record(tmp_path):
    data = tmp_path / "d.json"
    data.write_text('[{"conversations": [{"from": "alien", "value": "x"}]}]')
    sources = f'data.sources=[{{name: d, format: llava, path: "{data}"}}]'
    run = merit("prepare", "configs/demo.yaml", "--run-dir", str(tmp_path / "run"), "--set", sources)
    assert run.returncode == 2
    assert f"{data} record 0: unknown role 'alien'" in run.stderr


def test_bench_data_prints_rates(tmp_path):
    run = merit("bench", "data", "--run-dir", str(tmp_path), "--examples", "64", "--steps", "2", "--workers", "0", *SMALL)
    assert run.returncode == 0, run.stderr
    ratio = next(line for line in run.stdout.splitlines() if line.startswith("encoding / training"))
    assert float(ratio.split()[-4].rstrip("x")) > 0
