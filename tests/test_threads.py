"""Thread settings: the CPUs a process may use, passive OpenMP waiting, each stage's share."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from merit.bench.merge import generate
from pipeline.threads import available_cpus, cgroup_quota, map_chunks, threads_per_process
from pipeline.train.launch import rank_environment

ROOT = Path(__file__).parent.parent
ONE_CPU = sorted(os.sched_getaffinity(0))[:1]


def python(code: str, env: dict | None = None, one_cpu: bool = False) -> str:
    """``code``'s output in a fresh interpreter (pinned to one CPU with ``one_cpu``)."""
    pin = (lambda: os.sched_setaffinity(0, ONE_CPU)) if one_cpu else None
    environment = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    return subprocess.run(
        [sys.executable, "-c", code],
        env=environment | (env or {}),
        preexec_fn=pin,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout.strip()


def cgroup_files(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_cgroup_quotas_v2_take_the_tightest_along_the_path_and_v1_divides_quota_by_period(tmp_path):
    v2 = cgroup_files(
        tmp_path / "v2",
        {"cpu.max": "max 100000\n", "job/cpu.max": "150000 100000\n", "job/step/cpu.max": "max 100000\n"},
    )
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job/step\n")
    assert cgroup_quota(v2, proc) == 1.5
    proc.write_text("0::/\n")
    assert cgroup_quota(v2, proc) is None  # "max": no limit
    v1 = cgroup_files(tmp_path / "v1", {"cpu/cpu.cfs_quota_us": "250000\n", "cpu/cpu.cfs_period_us": "100000\n"})
    proc.write_text("4:memory:/x\n3:cpu,cpuacct:/\n")
    assert cgroup_quota(v1, proc) == 2.5
    (v1 / "cpu/cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_quota(v1, proc) is None
    assert cgroup_quota(tmp_path / "absent", tmp_path / "absent") is None


def test_a_pinned_process_uses_one_thread_and_openmp_waits_passively_unless_told_otherwise():
    code = "import torch, pipeline.threads as t; print(t.available_cpus(), t.set_threads(), torch.get_num_threads())"
    assert python(code, one_cpu=True) == "1 1 1"
    assert python(code) == f"{available_cpus()} {available_cpus()} {available_cpus()}"
    policy = "import pipeline, os; print(os.environ['OMP_WAIT_POLICY'])"
    assert python(policy) == "PASSIVE"
    assert python(policy, {"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"  # the user's setting wins


def test_ranks_get_their_share_of_the_cpus_and_inherit_passive_waiting():
    env = rank_environment(ranks_sharing=2, gpus=None)
    assert env["OMP_NUM_THREADS"] == str(threads_per_process(2)) == str(max(1, available_cpus() // 2))
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"  # set on import of pipeline; ranks inherit os.environ


def test_map_chunks_keeps_order_and_runs_its_threads_single_threaded():
    seen = []

    def work(chunk: slice, buffers: list) -> tuple[int, int]:
        seen.append(torch.get_num_threads())
        return chunk.start, len(buffers)

    chunks = [slice(i, i + 1) for i in range(10)]
    assert map_chunks(work, chunks, lambda: [None], workers=3) == [(i, 1) for i in range(10)]
    assert set(seen) == {1}
    before = torch.get_num_threads()
    map_chunks(work, chunks, lambda: [], workers=2)
    assert torch.get_num_threads() == before  # the caller's setting is its own


def test_a_small_model_runs_single_threaded_and_a_large_one_keeps_its_share():
    fit = "import pipeline.threads as t; t.set_threads(); print(t.fit_threads_to_model({}))"
    assert python(fit.format(10**9)) == str(available_cpus())
    assert python(fit.format(10**5)) == "1"


@pytest.mark.parametrize("one_cpu", [True, False])
def test_a_merge_process_records_the_threads_it_used(tmp_path, one_cpu):
    base, models = generate(tmp_path, 2, 0.2)
    spec = tmp_path / "spec.yaml"
    out = tmp_path / "merged"
    models = [{"path": str(m)} for m in models]
    spec.write_text(yaml.safe_dump({"base_model": str(base), "models": models, "method": "ties", "out_path": str(out)}))
    python(f"from merit.cli import main; main(['merge', {str(spec)!r}])", one_cpu=one_cpu)
    report = json.loads((out / "manifest.json").read_text())["report"]
    assert report["threads"] == (1 if one_cpu else available_cpus())


def test_bench_merge_prints_each_merge_unloaded_and_beside_busy_processes(capsys):
    from merit.cli import main as merit

    merit(["bench", "merge", "--k", "2", "--size-mb", "1", "--repeats", "1", "--load", "1", "--methods", "ties"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["2"]]
    assert [row[1] for row in rows] == ["floor", "floor", "ties"]
    assert all(row[-5] == "100" for row in rows[:2])  # % floor: each floor is its own reference
    assert float(rows[-1][-2]) > 0 and float(rows[-1][-1]) > 0  # loaded seconds and loaded / unloaded
