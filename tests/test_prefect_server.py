"""Integration with a real Prefect server: start it, create the process work pool, deploy
``merit/demo``, ``diloco/diloco-demo`` and ``merit-branch/branch-local`` from prefect.yaml,
``prefect deployment run`` the merit flow with its branches fanned out as flow runs that a worker
runs, and check through the API that the runs completed and published the report; then lose the
worker's machine mid-branch and check that the run still ends with the same weights; then the
DiLoCo flow with its workers fanned out the same way."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import stop_process_group
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from pipeline.checkpoint import is_complete
from pipeline.merge import CheckpointReader
from pipeline.train.launch import free_port

ROOT = Path(__file__).parent.parent
PREFECT = str(Path(sys.executable).parent / "prefect")  # the CLI of the environment running the tests
# The demo at test size; data, θ0 and split are made by the flow itself here, nothing is copied.
OVERRIDES = [
    "data.builtin.examples_per_source=24",
    "calibration.n_per_source=4",
    "warmup.steps=0",
    "train.steps=6",
    "train.micro_batch=4",
    "train.max_tokens=256",  # about 4 of the built-in examples a packed micro batch
    "train.checkpoint_every=3",
    "flow.joint_baseline=false",
    "merge.methods=[{name: token_average, method: weighted_average}]",
    "eval.benchmarks=[]",  # lmms-eval on every model: tests/test_flow.py
    "eval.max_examples_per_source=3",
    "eval.max_new_tokens=8",
    "eval.barrier_points=1",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A Prefect server on a free local port with its own PREFECT_HOME, the process pool and the
    deployments of prefect.yaml that need no GPU; stopped afterwards (its process group only)."""
    tmp_path = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
        # SQLite's wait for a lock (10 s by default): two test modules' flows and workers write at
        # once on 2 cores, where a heartbeat's write waiting 10 s was seen to fail.
        "PREFECT_SERVER_DATABASE_TIMEOUT": "60",
    }
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 (the server's output until teardown)
    proc = subprocess.Popen(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{env['PREFECT_API_URL']}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the Prefect server did not start in 180 s"
            time.sleep(0.5)
        prefect(env, "work-pool", "create", "merit-local", "--type", "process")
        deployments = ["demo", "diloco-demo", "branch-local", "diloco-part-local"]
        prefect(env, "deploy", *[a for name in deployments for a in ("--name", name)])
        yield env
    finally:
        stop_process_group(proc)
        log.close()


def prefect(env: dict, *args: str, timeout: int = 120) -> str:
    done = subprocess.run(
        [PREFECT, "--no-prompt", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def api(env: dict, path: str, body: dict | None) -> Any:
    """POST a filter (``body``) or GET a resource (``None``) from the server's REST API."""
    url = f"{env['PREFECT_API_URL']}/{path}"
    response = httpx.post(url, json=body, timeout=30) if body is not None else httpx.get(url, timeout=30)
    response.raise_for_status()
    return response.json()


def flow_run_id(deployment_run_output: str) -> str:
    return next(line.split()[-1] for line in deployment_run_output.splitlines() if "UUID:" in line)


FAN_OUT = [
    *OVERRIDES,
    "flow.branch_deployment=merit-branch/branch-local",
    "train.steps=20",  # long enough for a machine to be lost between the first checkpoint and the end
    "train.checkpoint_every=2",
    "flow.controls=[]",  # a control's branches fan out through the same submission: tests/test_flow.py runs one
    "eval.branches=false",
    "flow.heartbeat_s=1",
    "flow.branch_stale_s=6",
    "flow.retry_delay_s=0",
]
FINISHED = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def start_worker(server: dict, log: Path) -> subprocess.Popen:
    """A process worker of the merit-local pool: on a GPU pool, one machine. Five runs at once: a
    diloco run, its two workers (alive for the whole run) and its two aggregation parts."""
    return subprocess.Popen(
        [PREFECT, "worker", "start", "--pool", "merit-local", "--limit", "5"],
        env={**server, "PREFECT_WORKER_QUERY_SECONDS": "2"},
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def run_deployment(server: dict, tmp_path: Path, deployment: str, overrides: list[str]) -> tuple[Path, str]:
    """``prefect deployment run`` with a pool worker to run it and its children; waits for the end."""
    run_dir = tmp_path / "run"
    params = json.dumps({"overrides": overrides, "run_dir": str(run_dir)})
    parent_id = flow_run_id(prefect(server, "deployment", "run", deployment, "--params", params))
    worker = start_worker(server, tmp_path / "worker.log")
    try:
        deadline = time.monotonic() + 600
        while (state := api(server, f"flow_runs/{parent_id}", None)["state"]["type"]) not in FINISHED:
            assert time.monotonic() < deadline, "the merit run did not finish in 600 s"
            time.sleep(2)
    finally:
        stop_process_group(worker)
    assert state == "COMPLETED", (tmp_path / "worker.log").read_text()[-3000:]
    return run_dir, parent_id


@pytest.fixture(scope="module")
def fanned_out(server, tmp_path_factory) -> tuple[Path, str]:
    """flow.branch_deployment: every branch is a flow run of merit-branch/branch-local, picked up by
    the pool's worker like any run (on a GPU pool: a machine each), while the merit run waits."""
    return run_deployment(server, tmp_path_factory.mktemp("fan-out"), "merit/demo", FAN_OUT)


def test_a_deployment_run_fans_its_branches_out_and_publishes_the_report(server, fanned_out):
    run_dir, parent_id = fanned_out
    run = api(server, f"flow_runs/{parent_id}", None)
    assert run["state"]["type"] == "COMPLETED" and run["parameters"]["run_dir"] == str(run_dir)
    artifacts = api(server, "artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [parent_id]}}})
    report = next(a for a in artifacts if a["key"] == "demo-report")
    assert report["type"] == "markdown" and "## Models" in report["data"]
    assert any(a["type"] == "progress" and float(a["data"]) == 100.0 for a in artifacts)
    children = api(server, "flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [parent_id]}}})
    assert sorted(r["name"] for r in children) == ["branch-0", "branch-1"]
    assert all(r["state"]["type"] == "COMPLETED" and r["parameters"]["run_dir"] == str(run_dir) for r in children)
    assert is_complete(run_dir / "merged" / "token_average")
    AutoModelForImageTextToText.from_pretrained(run_dir / "merged" / "token_average")
    beat = json.loads((run_dir / "branches" / "0" / "heartbeat.json").read_text())
    assert beat["flow_run"] in {r["id"] for r in children} and beat["beats"] >= 1


def test_a_branch_whose_machine_is_lost_is_crashed_resubmitted_and_resumed(server, fanned_out, tmp_path):
    """A spot machine taken away: SIGKILL the worker running the branches and everything it
    started. Nobody reports their flow runs, which stay Running; the merit run notices the
    silent heartbeat, crashes them, resubmits them to the pool, and a new worker's runs resume
    from the checkpoints, ending with the same merged weights as the undisturbed run."""
    reference, _ = fanned_out
    run_dir = tmp_path / "run"
    first = start_worker(server, tmp_path / "worker-1.log")
    settings = [arg for override in FAN_OUT for arg in ("--set", override)]
    merit_run = subprocess.Popen(
        [str(Path(sys.executable).parent / "merit"), "run", "configs/demo.yaml", "--run-dir", str(run_dir), *settings],
        env=server,
        cwd=ROOT,
        stdout=(tmp_path / "merit.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    second = None
    try:
        latest, deadline = run_dir / "branches" / "0" / "checkpoints" / "latest.json", time.monotonic() + 300
        while not latest.is_file():
            assert merit_run.poll() is None and time.monotonic() < deadline, (tmp_path / "merit.log").read_text()[
                -3000:
            ]
            time.sleep(0.05)
        lost = descendants(first.pid)
        for pid in lost:  # the machine: the worker, its flow runs, their training processes
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert not is_complete(run_dir / "branches" / "0" / "final")
        second = start_worker(server, tmp_path / "worker-2.log")
        assert merit_run.wait(timeout=600) == 0, (tmp_path / "merit.log").read_text()[-3000:]
    finally:
        merit_run.kill()
        for worker in (first, second):
            if worker is not None and worker.poll() is None:
                stop_process_group(worker)
    runs = api(server, "flow_runs/filter", {"flow_runs": {"name": {"any_": ["branch-0"]}}})
    ours = [r for r in runs if r["parameters"]["run_dir"] == str(run_dir)]
    states = sorted(r["state"]["type"] for r in ours)
    assert states == ["COMPLETED", "CRASHED"], states
    crashed = next(r for r in ours if r["state"]["type"] == "CRASHED")
    assert "no heartbeat" in crashed["state"]["message"] and "machine is gone" in crashed["state"]["message"]
    assert "branch 0: resumed from step" in (run_dir / "branches" / "0" / "train.log").read_text()
    a, b = (load_file(d / "merged" / "token_average" / "model.safetensors") for d in (reference, run_dir))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


@pytest.mark.release  # the DiLoCo flow's deployment; its rounds: test_diloco
def test_a_diloco_deployment_run_trains_its_workers_as_flow_runs_of_the_branch_deployment(server, tmp_path):
    """The DiLoCo workers live for the whole run, each a flow run of merit-branch/branch-local (on
    a GPU pool: a machine each), while the diloco run aggregates their rounds in two parts, each a
    flow run of diloco-part/diloco-part-local (a machine each). In bf16, as on GPUs: the global
    weights stay fp32 (bf16 would round the outer steps away)."""
    overrides = [
        *OVERRIDES,
        "model.dtype=bfloat16",
        "flow.branch_deployment=merit-branch/branch-local",
        "diloco.aggregators=2",
        "diloco.aggregator_deployment=diloco-part/diloco-part-local",
        "diloco.inner_steps=2",
        "diloco.rounds=2",
        "diloco.eval_every=0",
        "diloco.methods=[{name: isoloco, method: iso_c, outer_lr: 1.8, outer_momentum: 0.8}]",
    ]
    run_dir, parent_id = run_deployment(server, tmp_path, "diloco/diloco-demo", overrides)
    children = api(server, "flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [parent_id]}}})
    parts = [f"part-isoloco-iid/{r}/{s}" for r in range(2) for s in range(2)]
    assert sorted(r["name"] for r in children) == ["branch-isoloco-iid/0", "branch-isoloco-iid/1", *parts]
    assert all(r["state"]["type"] == "COMPLETED" for r in children)
    records = json.loads((run_dir / "diloco" / "isoloco-iid" / "rounds.json").read_text())
    assert [(r["round"], r["workers"], r["aggregators"]) for r in records] == [(0, [0, 1], 2), (1, [0, 1], 2)]
    final = run_dir / "diloco" / "isoloco-iid" / "global" / "2"
    AutoModelForImageTextToText.from_pretrained(final)
    trained = CheckpointReader(final).get("model.layers.0.mlp.up_proj.weight")  # in one of two parts' files
    assert trained.dtype == torch.float32 and not torch.equal(trained, trained.bfloat16().float())
    artifacts = api(server, "artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [parent_id]}}})
    report = next(a for a in artifacts if a["key"] == "demo-report")
    assert "## DiLoCo" in report["data"] and "isoloco-iid" in report["data"]
