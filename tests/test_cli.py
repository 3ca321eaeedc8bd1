"""The `merit` command: its entry point as a real subprocess once, then its commands in-process
(``merit.cli.main``, the same function, without paying the imports again)."""

import subprocess
import sys
from functools import partial
from pathlib import Path

import yaml

from merit.cli import main

ROOT = Path(__file__).parent.parent
SMALL = ["--set", "data.builtin.examples_per_source=10", "--set", "warmup.steps=0"]


def merit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "merit", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def merit_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def test_stages_print_summaries_and_keep_the_resolved_config(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    merit = partial(merit_in_process, capsys)
    init = merit("init", "configs/demo.yaml", "--run-dir", str(tmp_path), *SMALL)
    assert init.returncode == 0, init.stderr
    assert "θ0:" in init.stdout and "parameters" in init.stdout
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["data"]["builtin"]["examples_per_source"] == 10
    run = merit("prepare", "--run-dir", str(tmp_path))  # the run directory's config from here on
    assert run.returncode == 0, run.stderr
    total = next(line for line in run.stdout.splitlines() if line.startswith("total"))
    assert total.split()[1] == "380"  # 18 fine-tuning, 15 warm-up and 5 unseen sources x 10 examples
    roles = [line.split()[2] for line in run.stdout.splitlines()[2:-1]]
    assert (roles.count("finetune"), roles.count("warmup"), roles.count("unseen")) == (18, 15, 5)
    split = merit("calibrate", "--run-dir", str(tmp_path))
    assert split.returncode == 0, split.stderr
    assert (tmp_path / "init" / "manifest.json").is_file() and (tmp_path / "data" / "manifest.json").is_file()
    assert "split into 2 groups" in split.stdout and (tmp_path / "calibration" / "split.json").is_file()
    early = merit("calibrate", "--run-dir", str(tmp_path), "--set", "warmup.steps=5")  # θ0 is now the warm-up's
    assert early.returncode == 2
    assert (
        f"θ0 {tmp_path / 'warmup' / 'final'} is missing" in early.stderr
        and "merit train --branch warmup" in early.stderr
    )
    # Any stage re-runs alone from the run directory's resolved config.
    again = merit("prepare", "--run-dir", str(tmp_path))
    assert again.returncode == 0, again.stderr
    assert next(line for line in again.stdout.splitlines() if line.startswith("total")) == total


def test_bad_override_exits_2_naming_the_key(tmp_path):
    run = merit("prepare", "configs/demo.yaml", "--run-dir", str(tmp_path), "--set", "data.max_lenght=3")
    assert run.returncode == 2
    assert "data.max_lenght" in run.stderr and "Traceback" not in run.stderr


def test_bad_data_exits_2_naming_file_and_record(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    merit = partial(merit_in_process, capsys)
    data = tmp_path / "d.json"
    data.write_text('[{"conversations": [{"from": "alien", "value": "x"}]}]')
    sources = f'data.sources=[{{name: d, format: llava, path: "{data}"}}]'
    run = merit("prepare", "configs/demo.yaml", "--run-dir", str(tmp_path / "run"), "--set", sources)
    assert run.returncode == 2
    assert f"{data} record 0: unknown role 'alien'" in run.stderr


def test_bench_data_prints_rates(tmp_path):
    run = merit(
        "bench", "data", "--run-dir", str(tmp_path), "--examples", "64", "--steps", "2", "--workers", "0", *SMALL
    )
    assert run.returncode == 0, run.stderr
    ratio = next(line for line in run.stdout.splitlines() if line.startswith("encoding / training"))
    assert float(ratio.split()[-4].rstrip("x")) > 0
