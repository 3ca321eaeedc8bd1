"""The `merit` command: its entry point as a real subprocess once, then its commands in-process
(``merit.cli.main``, the same function, without paying the imports again)."""

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import yaml
from conftest import write_image, write_json

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
    assert total.split()[1] == "450"  # 18 fine-tuning, 22 warm-up and 5 unseen sources x 10 examples
    roles = [line.split()[2] for line in run.stdout.splitlines()[2:-1]]
    assert (roles.count("finetune"), roles.count("warmup"), roles.count("unseen")) == (18, 22, 5)
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
    # A stage with a command of its own re-runs alone from the run directory's resolved config.
    again = merit("prepare", "--run-dir", str(tmp_path))
    assert again.returncode == 0, again.stderr
    assert next(line for line in again.stdout.splitlines() if line.startswith("total")) == total


def test_commands_that_read_a_run_never_write_its_config(tmp_path, capsys, monkeypatch):
    """`merit check` and `merit report` only read the run, whatever CONFIG or `--set` they are
    given; a stage re-run from the run directory as it is leaves the config as it was; without
    CONFIG or `--run-dir` every command refuses in one line, naming the runs there."""
    monkeypatch.chdir(tmp_path)  # runs/ here holds one run
    merit = partial(merit_in_process, capsys)
    run_dir = tmp_path / "runs" / "mine"
    assert merit("init", str(ROOT / "configs/demo.yaml"), "--run-dir", str(run_dir), *SMALL).returncode == 0
    assert merit("prepare", "--run-dir", str(run_dir)).returncode == 0
    config = run_dir / "config.yaml"
    saved, stamp = config.read_text(), config.stat().st_mtime_ns
    for command in ("check", "report"):
        for extra in ([], ["--set", "train.lr=0.5"], [str(ROOT / "configs/demo.yaml")]):
            merit(command, "--run-dir", str(run_dir), *extra)  # a run prepared, nothing trained
            assert config.read_text() == saved and config.stat().st_mtime_ns == stamp, (command, extra)
    assert merit("init", "--run-dir", str(run_dir)).returncode == 0  # the run as it is: not rewritten
    assert config.stat().st_mtime_ns == stamp
    for command in ("check", "report", "init", "prepare", "calibrate"):
        refused = merit(command)
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, (command, refused.stderr)
        assert "pass CONFIG, or --run-dir DIR of a run (here: runs/mine)" in refused.stderr
    assert not (tmp_path / "runs" / "demo").exists()
    changed = merit("init", "--run-dir", str(run_dir), "--set", "train.lr=0.5")  # a change: saved
    assert changed.returncode == 0 and yaml.safe_load(config.read_text())["train"]["lr"] == 0.5


def test_the_first_real_run_pages_own_data_prepares_as_written(tmp_path, capsys, monkeypatch):
    """docs/first-real-run.md's bring-your-own-data block, its paths moved to small files of each
    format it names: every source is read, none is skipped."""
    page = (ROOT / "docs" / "first-real-run.md").read_text()
    block = page.split("## Your own data", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    mine = tmp_path / "mine"
    sources = yaml.safe_load(block.replace("/data/mine", str(mine)))["data"]["sources"]
    images = mine / "images"
    for i in range(4):
        write_image(images / f"{i}.png", colour=(60 * i, 0, 0))
    turns = [("<image>\nWhat colour is it?", "red"), ("<image>\nWhat is the total?", "12")]
    for name, (prompt, answer) in zip(("charts", "receipts"), turns):
        records = [
            {
                "image": f"{i}.png",
                "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}],
            }
            for i in range(4)
        ]
        write_json(mine / f"{name}.json", records)
    lines = [
        {"conversations": [{"from": "human", "value": f"What is {i} + 1?"}, {"from": "gpt", "value": str(i + 1)}]}
        for i in range(4)
    ]
    (mine / "arithmetic.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    captions = [
        {
            "messages": [
                {"role": "user", "content": "<image>Describe it."},
                {"role": "assistant", "content": "A square."},
            ],
            "images": [f"{i}.png"],
        }
        for i in range(4)
    ]
    write_json(mine / "captions.json", captions)

    monkeypatch.chdir(ROOT)
    merit = partial(merit_in_process, capsys)
    settings = [f"data.sources={json.dumps(sources)}", "warmup.steps=0", "warmup.sources=[]", "eval.sources=[]"]
    run_dir = str(tmp_path / "run")
    assert (
        merit(
            "init", "configs/demo.yaml", "--run-dir", run_dir, *[a for s in settings for a in ("--set", s)]
        ).returncode
        == 0
    )
    prepared = merit("prepare", "--run-dir", run_dir)
    assert prepared.returncode == 0, prepared.stderr
    manifest = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())["sources"]
    assert set(manifest) == {"charts", "receipts", "arithmetic", "captions"}
    assert all(
        info["examples"] == 4 and info["skipped"] == 0 and info["role"] == "finetune" for info in manifest.values()
    )


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
