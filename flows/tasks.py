"""Thin Prefect tasks: each loads the run's resolved config and calls ONE library function,
passing paths and small JSON-able results, never tensors or models.

Idempotence lives in the library (a stage whose outputs exist and verify returns them), so a
re-run flow, or a retried task, resumes where the last attempt stopped.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import task

from pipeline.config import RunConfig, load_config
from pipeline.layout import CONFIG


def run_config(run_dir: str) -> RunConfig:
    return load_config(Path(run_dir) / CONFIG)


@task(name="preflight")
def preflight(run_dir: str, diloco: bool = False) -> dict[str, str]:
    """Everything that would fail after hours of training (θ0, data paths, DeepSpeed config,
    merges, devices; DiLoCo's workers), checked first."""
    from pipeline.preflight import check_run

    return check_run(run_config(run_dir), run_dir, diloco)


@task(name="prepare")
def prepare(run_dir: str) -> dict[str, int]:
    """Load, split and encode every source; returns train tokens per source."""
    from pipeline.data import active_sources, prepare_data
    from pipeline.models import processor_for

    cfg = run_config(run_dir)
    manifest = prepare_data(cfg, run_dir, processor_for(cfg, run_dir))
    return {name: info["train_tokens"] for name, info in active_sources(manifest).items()}


@task(name="init")
def init(run_dir: str) -> dict[str, Any]:
    """Build the tiny model or locate the base model."""
    from pipeline.models import init_model

    return init_model(run_config(run_dir), run_dir)


@task(name="calibrate")
def calibrate(run_dir: str) -> dict[str, Any]:
    """Gradient conflicts at θ0 and the split into K groups."""
    from calibration.stage import calibrate as calibrate_stage

    summary = calibrate_stage(run_config(run_dir), run_dir)
    return {k: summary[k] for k in ("groups", "tokens", "explained_variance", "total_seconds")}


@task(name="make-control", task_run_name="control-{name}")
def make_control(run_dir: str, name: str) -> str:
    """The run directory of a control (``controls/<name>``): the run's data and θ0, its own split."""
    from pipeline.controls import make_control as make

    return str(make(run_config(run_dir), run_dir, name))


def worth_retrying(task, task_run, state) -> bool:
    """A retry resumes a killed, crashed or timed-out branch from its last checkpoint; a spec the
    library refused before launching (ValueError) would only be refused again."""
    return not isinstance(state.data, (ValueError, FileNotFoundError))


@task(name="train-branch", task_run_name="train-{name}")
def train(run_dir: str, name: str, gpus: list[int] | None = None, sharing: int = 1) -> dict[str, Any]:
    """Train, resume or skip one branch (``warmup``, ``joint`` or a group number) or DiLoCo worker
    (``<variant>/<k>``). A killed process group raises, so the task's retries relaunch it and it
    resumes from its checkpoint. ``sharing``: jobs that share this machine's cores at once."""
    from pipeline.train import train_branch

    cfg = run_config(run_dir)
    if "/" in name:
        from pipeline.diloco.launch import train_worker
        from pipeline.diloco.plan import plan_of

        variant, k = name.split("/")
        return train_worker(plan_of(cfg, run_dir, variant), int(k), echo=False, gpus=gpus, sharing=sharing)
    return asdict(train_branch(job_spec(cfg, run_dir, name), echo=False, gpus=gpus))


def job_spec(cfg: RunConfig, run_dir: str, name: str):
    """The branch spec of a branch or of a DiLoCo worker, by name."""
    from pipeline.train.plan import branch_spec

    if "/" in name:
        from pipeline.diloco.plan import plan_of

        variant, k = name.split("/")
        return plan_of(cfg, run_dir, variant).workers[int(k)]
    return branch_spec(cfg, run_dir, name)


@task(name="train-branch-remote", task_run_name="train-{name}")
def train_remote(deployment: str, run_dir: str, name: str) -> dict[str, Any]:
    """Train one branch as a flow run of ``deployment`` (a ``merit-branch`` deployment), on a
    machine of its work pool, and wait for it. A run that fails or crashes, or whose machine
    disappears (its heartbeat stops: ``flows.heartbeat``), raises, so this task's retries start a
    new run, which resumes from the checkpoints the last one left in the shared run directory."""
    from prefect.deployments import run_deployment

    from flows.heartbeat import claim, wait_for
    from pipeline.controls import control_of
    from pipeline.layout import training_dir

    cfg = run_config(run_dir)
    folder, timeout_s = training_dir(run_dir, name), job_spec(cfg, run_dir, name).train.timeout_s
    run = run_deployment(
        deployment,
        parameters={"run_dir": run_dir, "name": name},
        flow_run_name="-".join(filter(None, ["branch", control_of(run_dir), name])),  # branch-0, branch-random-0
        timeout=0,
    )
    claim(folder, str(run.id))  # an earlier run of this branch, if still alive, stops at its next beat
    # The branch's own timeout (its launcher's) fires first; the watcher's is for a run that hangs.
    run = wait_for(run, folder, cfg.flow.branch_stale_s, timeout_s + cfg.flow.branch_stale_s)
    if not run.state.is_completed():
        raise RuntimeError(
            f"branch {name}: flow run {run.name} of {deployment} ended {run.state.type.value}: {run.state.message}"
        )
    return {"name": name, "flow_run": str(run.id)}


@task(name="merge", task_run_name="merge-{name}")
def merge(run_dir: str, name: str) -> dict[str, Any]:
    from pipeline.merging import merge_run

    return merge_run(run_config(run_dir), run_dir, name)


@task(name="evaluate", task_run_name="evaluate-{model}")
def evaluate(run_dir: str, model: str, checkpoint: str) -> dict[str, Any]:
    """Held-out loss and exact-match accuracy of one model; returns its overall and per-role figures."""
    from pipeline.eval import evaluate_model

    result = evaluate_model(run_config(run_dir), run_dir, model, checkpoint)
    return {k: result[k] for k in ("model", "loss", "macro_loss", "token_accuracy", "accuracy", "roles") if k in result}


@task(name="benchmark", task_run_name="benchmark-{model}")
def benchmark(run_dir: str, model: str, checkpoint: str) -> dict[str, Any]:
    """The lmms-eval benchmarks of one model (a process of its own); returns its scores (0–100)."""
    from pipeline.eval.benchmarks import run_benchmarks

    result = run_benchmarks(run_config(run_dir), run_dir, model, checkpoint)
    return {"model": model, "average": result["average"], **{t: s["score"] for t, s in result["tasks"].items()}}


@task(name="diagnose")
def diagnose(run_dir: str) -> dict[str, Any]:
    """The loss barrier between the branches and every model's distance from θ0; returns the mean
    barrier and the relative distances."""
    from pipeline.eval import diagnose as diagnose_run

    result = diagnose_run(run_config(run_dir), run_dir)
    return {
        "barrier": (result["barrier"] or {}).get("barrier"),
        "relative_distance": {name: d["relative"] for name, d in result["distance_from_theta0"].items()},
    }
