"""The MERIT flow and the joint-baseline flow.

merit: preflight → prepare → init → warm-up (θ0) → calibrate → K branches (+ the joint baseline), fanned
out with retries that resume from checkpoints → merges → held-out evaluation → report.
Every stage is idempotent, so re-running a flow on the same run directory resumes it.
"""

from __future__ import annotations

import queue
from collections.abc import Callable

import prefect.runtime.flow_run
import torch
from prefect import flow
from prefect.futures import PrefectFuture
from prefect.logging import get_run_logger

from flows import tasks
from flows.heartbeat import heartbeat
from flows.progress import BranchProgress
from flows.report import artifact_key, report
from pipeline.config import RunConfig
from pipeline.layout import JOINT, WARMUP, run_models, start_run, training_dir
from pipeline.train.plan import branch_spec

POLL_S = 2.0  # how often the flow refreshes the training progress


def branch_slots(cfg: RunConfig, branches: int) -> list[list[int] | None]:
    """The devices of each branch that may train at once: disjoint sets of ``train.processes``
    GPUs. On CPU, one branch at a time unless asked: its ranks already use every core. Branches
    on a deployment bring their own machines: all at once unless asked."""
    if cfg.flow.branch_deployment:
        return [None] * (cfg.flow.parallel_branches or branches)
    gpus, per = torch.cuda.device_count(), cfg.train.processes
    if gpus == 0:
        return [None] * (cfg.flow.parallel_branches or 1)
    fits = gpus // per
    if fits == 0:  # more ranks than GPUs: let the launcher see every GPU and say so
        return [None]
    return [list(range(i * per, (i + 1) * per)) for i in range(min(cfg.flow.parallel_branches or fits, fits))]


def branch_submitter(cfg: RunConfig, run_dir: str) -> Callable[[str, list[int] | None], PrefectFuture]:
    """Start one branch: a task of this flow run on the given GPUs, or a flow run of the branch
    deployment on a machine of its own. Either is retried and resumes from its checkpoints."""
    retries = {"retries": cfg.flow.branch_retries, "retry_delay_seconds": cfg.flow.retry_delay_s}
    local = tasks.train.with_options(**retries, retry_condition_fn=tasks.worth_retrying)
    remote = tasks.train_remote.with_options(**retries)

    def submit(name: str, gpus: list[int] | None) -> PrefectFuture:
        if cfg.flow.branch_deployment:
            return remote.submit(cfg.flow.branch_deployment, run_dir, name)
        return local.submit(run_dir, name, gpus=gpus)

    return submit


def train_branches(cfg: RunConfig, run_dir: str, names: list[str], progress_key: str) -> dict[str, dict]:
    """Train the named branches, at most one per slot at a time. A branch that fails after its
    retries does not stop the others: they finish and stay on disk, then the flow fails naming
    every failed branch, and a re-run trains only those."""
    submit = branch_submitter(cfg, run_dir)
    progress = BranchProgress([branch_spec(cfg, run_dir, n) for n in names], artifact_key(cfg.run.name, progress_key))
    free, pending, running, finished = branch_slots(cfg, len(names)), list(names), {}, queue.Queue()
    results, failures = {}, {}
    while pending or running:
        while pending and free:
            name, slot = pending.pop(0), free.pop(0)
            running[name] = (submit(name, slot), slot)
            running[name][0].add_done_callback(lambda _, name=name: finished.put(name))
        try:
            name = finished.get(timeout=POLL_S)
        except queue.Empty:
            progress.update()
            continue
        future, slot = running.pop(name)
        free.append(slot)
        try:
            results[name] = future.result()
        except Exception as err:
            failures[name] = str(err) if f"branch {name}" in str(err) else f"branch {name}: {err}"
    progress.update()
    if failures:
        raise RuntimeError(f"{len(failures)} branch(es) failed for good: " + "; ".join(failures.values()))
    return results


def evaluate_and_report(cfg: RunConfig, run_dir: str) -> str:
    for model, checkpoint in run_models(cfg, run_dir).items():
        tasks.evaluate(run_dir, model, checkpoint)
    done = report(run_dir, cfg.run.name)
    get_run_logger().info(f"report: {done['report']}")
    return done["report"]


def start(run_dir: str, cfg: RunConfig, diloco: bool = False) -> None:
    """preflight → prepare → init → warm-up: the data and θ0 every later stage needs."""
    tasks.preflight(run_dir, diloco)
    tasks.prepare(run_dir)
    tasks.init(run_dir)
    if cfg.warmup.steps:
        train_branches(cfg, run_dir, [WARMUP], "warmup")


@flow(name="merit", log_prints=True)
def merit(
    config: str | None = "configs/demo.yaml", overrides: list[str] | None = None, run_dir: str | None = None
) -> str:
    """The MERIT pipeline on one run directory; returns the path of the report."""
    cfg, run_dir = start_run(config, overrides or [], run_dir)
    run_dir = str(run_dir.absolute())
    start(run_dir, cfg)
    groups = tasks.calibrate(run_dir)["groups"]
    baseline = [JOINT] if cfg.flow.joint_baseline else []  # first: the longest job, so slots end together
    train_branches(cfg, run_dir, baseline + [str(k) for k in range(len(groups))], "training")
    for entry in cfg.merge.methods:
        tasks.merge(run_dir, entry.name)
    return evaluate_and_report(cfg, run_dir)


@flow(name="merit-branch", log_prints=True)
def branch(run_dir: str, name: str) -> dict:
    """One branch of a run (``warmup``, ``joint`` or a group number) on whatever machine runs this
    flow: the unit the merit flow fans out over a work pool when ``flow.branch_deployment`` is set.
    No retries here: the merit flow starts a new run, on a new machine if need be; the heartbeat
    tells it when this machine is gone."""
    cfg = tasks.run_config(run_dir)  # the heartbeat first: finding θ0 may take a download
    with heartbeat(training_dir(run_dir, name), str(prefect.runtime.flow_run.id), cfg.flow.heartbeat_s):
        return tasks.train(run_dir, name)


@flow(name="joint", log_prints=True)
def joint(
    config: str | None = "configs/demo.yaml", overrides: list[str] | None = None, run_dir: str | None = None
) -> str:
    """The joint baseline alone: every source in one branch with the K branches' total budget."""
    cfg, run_dir = start_run(config, overrides or [], run_dir)
    run_dir = str(run_dir.absolute())
    start(run_dir, cfg)
    train_branches(cfg, run_dir, [JOINT], "training")
    return evaluate_and_report(cfg, run_dir)
