"""Integration with a real Prefect server: start it, create the process work pool, deploy
``merit/demo`` from prefect.yaml, ``prefect deployment run`` it, let a worker run it once, and
check through the API that the run completed and published its report."""

from __future__ import annotations

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
from transformers import AutoModelForImageTextToText

from pipeline.checkpoint import is_complete
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
    "train.checkpoint_every=3",
    "flow.joint_baseline=false",
    "merge.methods=[{name: token_average, method: weighted_average}]",
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
        prefect(env, "deploy", "--name", "demo", "--name", "branch-local")
        yield env
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
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


def test_deployment_run_by_a_worker_completes_and_publishes_the_report(server, tmp_path):
    run_dir = tmp_path / "run"
    params = json.dumps({"overrides": OVERRIDES, "run_dir": str(run_dir)})
    run_id = flow_run_id(prefect(server, "deployment", "run", "merit/demo", "--params", params))
    # --limit makes --run-once wait for the run it picked up before the worker exits.
    prefect(server, "worker", "start", "--pool", "merit-local", "--run-once", "--limit", "1", timeout=900)

    run = api(server, f"flow_runs/{run_id}", None)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["parameters"]["run_dir"] == str(run_dir)
    artifacts = api(server, "artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}})
    report = next(a for a in artifacts if a["key"] == "demo-report")
    assert report["type"] == "markdown" and "## Models" in report["data"]
    assert any(a["type"] == "progress" and float(a["data"]) == 100.0 for a in artifacts)
    assert is_complete(run_dir / "merged" / "token_average")
    AutoModelForImageTextToText.from_pretrained(run_dir / "merged" / "token_average")


def test_branches_fan_out_as_flow_runs_of_the_branch_deployment(server, tmp_path):
    """flow.branch_deployment: every branch is a flow run of merit-branch/branch-local, picked up by
    the pool's worker like any run (on a GPU pool: a machine each), while the merit run waits."""
    run_dir = tmp_path / "run"
    overrides = [*OVERRIDES, "flow.branch_deployment=merit-branch/branch-local"]
    params = json.dumps({"overrides": overrides, "run_dir": str(run_dir)})
    parent_id = flow_run_id(prefect(server, "deployment", "run", "merit/demo", "--params", params))
    log = open(tmp_path / "worker.log", "w")  # noqa: SIM115 (the worker's output until it ends)
    worker = subprocess.Popen(
        [PREFECT, "worker", "start", "--pool", "merit-local", "--limit", "3"],
        env=server,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600
        while (state := api(server, f"flow_runs/{parent_id}", None)["state"]["type"]) not in (
            "COMPLETED",
            "FAILED",
            "CRASHED",
        ):
            assert time.monotonic() < deadline, "the merit run did not finish in 600 s"
            time.sleep(2)
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=60)
        log.close()
    assert state == "COMPLETED", (tmp_path / "worker.log").read_text()[-3000:]
    children = api(server, "flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [parent_id]}}})
    assert sorted(r["name"] for r in children) == ["branch-0", "branch-1"]
    assert all(r["state"]["type"] == "COMPLETED" and r["parameters"]["run_dir"] == str(run_dir) for r in children)
    assert is_complete(run_dir / "merged" / "token_average")
