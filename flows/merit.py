"""The MERIT flow, the joint-baseline flow and the θ0 flow.

merit: preflight → prepare → init → warm-up (θ0) → calibrate (and each control's split) → K branches
(+ the joint baseline, + each control's K), fanned out with retries that resume from checkpoints →
merges → evaluation and diagnostics → report.
joint: the same start, then the joint baseline alone. theta0: the start alone, a pre-trained θ0 that
other runs share by naming it as their model.
Every stage is idempotent, so re-running a flow on the same run directory resumes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import prefect.runtime.flow_run
from prefect import flow
from prefect.futures import PrefectFuture
from prefect.logging import get_run_logger

from flows import tasks
from flows.benchmarks import BenchmarkJobs
from flows.heartbeat import heartbeat
from flows.progress import BranchProgress
from flows.report import artifact_key, report
from flows.slots import SlotPool
from pipeline.config import RunConfig
from pipeline.controls import control_of, controls_of
from pipeline.devices import usable_gpus
from pipeline.eval.heldout import evaluated
from pipeline.layout import JOINT, WARMUP, init_path, run_models, start_run, training_dir
from pipeline.threads import set_threads
from pipeline.train.plan import branch_spec

POLL_S = 2.0  # how often the flow refreshes the training progress
Job = tuple[str, str]  # (run directory, branch name): the run's own branches or a control's


def branch_slots(cfg: RunConfig, branches: int) -> list[list[int] | None]:
    """The devices of each branch that may train at once: disjoint sets of ``train.processes``
    GPUs. On CPU, one branch at a time unless asked: its ranks already use every core. Branches
    on a deployment bring their own machines: all at once unless asked."""
    if cfg.flow.branch_deployment:
        return [None] * (cfg.flow.parallel_branches or branches)
    gpus, per = usable_gpus(cfg), cfg.train.processes
    if not gpus:
        return [None] * (cfg.flow.parallel_branches or 1)
    fits = len(gpus) // per
    if fits == 0:  # more ranks than GPUs: let the launcher see every GPU and say so
        return [None]
    return [gpus[i * per : (i + 1) * per] for i in range(min(cfg.flow.parallel_branches or fits, fits))]


def branch_submitter(cfg: RunConfig) -> Callable[[Job, list[int] | None], PrefectFuture]:
    """Start one branch: a task of this flow run on the given GPUs, or a flow run of the branch
    deployment on a machine of its own. Either is retried and resumes from its checkpoints."""
    retries = {"retries": cfg.flow.branch_retries, "retry_delay_seconds": cfg.flow.retry_delay_s}
    local = tasks.train.with_options(**retries, retry_condition_fn=tasks.worth_retrying)
    remote = tasks.train_remote.with_options(**retries)

    def submit(job: Job, gpus: list[int] | None) -> PrefectFuture:
        run_dir, name = job
        if cfg.flow.branch_deployment:
            return remote.submit(cfg.flow.branch_deployment, run_dir, name)
        return local.submit(run_dir, name, gpus=gpus)

    return submit


def job_label(job: Job) -> str:
    """``joint``, ``0`` for the run's own branches; ``random/0`` for a control's."""
    where, name = job
    control = control_of(where)
    return f"{control}/{name}" if control else name


def train_branches(cfg: RunConfig, run_dir: str, jobs: list[Job], progress_key: str) -> dict[str, dict]:
    """Train the jobs (run directory, branch name: the run's or a control's), at most one per slot
    at a time. A branch that fails after its retries does not stop the others: they finish and
    stay on disk, then the flow fails naming every failed branch, and a re-run trains only those."""
    submit = branch_submitter(cfg)
    labels = {job_label(job): job for job in jobs}
    specs = {label: branch_spec(tasks.run_config(where), where, name) for label, (where, name) in labels.items()}
    progress = BranchProgress(specs, artifact_key(cfg.run.name, progress_key))
    pool = SlotPool(branch_slots(cfg, len(jobs)), submit)
    for label, job in labels.items():
        pool.add(label, job)
    results, failures = {}, {}
    for label, future in pool.finished(POLL_S, progress.update):
        try:
            results[label] = future.result()
        except Exception as err:
            name = labels[label][1]
            failures[label] = str(err) if f"branch {name}" in str(err) else f"branch {label}: {err}"
    progress.update()
    if failures:
        raise RuntimeError(f"{len(failures)} branch(es) failed for good: " + "; ".join(failures.values()))
    return results


def evaluate_and_report(cfg: RunConfig, run_dir: str) -> str:
    """Evaluate every model of the run and of its controls (held-out figures, then the lmms-eval
    benchmarks: a job per task of each model on this machine's slots, beside the next models'
    held-out evaluations), their diagnostics, then the report. A control's θ0 is the run's
    (linked): evaluated once, with the run. Benchmark jobs that got no score fail the flow after
    the report is written, each named; a re-run runs only those."""
    places = [run_dir, *map(str, controls_of(cfg, run_dir).values())]
    models = [
        (where, model, checkpoint)
        for where in places
        for model, checkpoint in run_models(tasks.run_config(where), where).items()
        if (where == run_dir or model != "theta0") and evaluated(cfg, model)
    ]
    benchmarks = BenchmarkJobs(cfg, run_dir, models, artifact_key(cfg.run.name, "benchmark-jobs"))
    for where in places:
        for model in (m for m in models if m[0] == where):
            tasks.evaluate(*model)
            benchmarks.add(*model)
        tasks.diagnose(where)
    failures = benchmarks.wait()
    done = report(run_dir, cfg.run.name)
    get_run_logger().info(f"report: {done['report']}")
    if failures:
        raise RuntimeError(f"{len(failures)} benchmark job(s) got no score: " + "; ".join(failures))
    return done["report"]


def start(run_dir: str, cfg: RunConfig, diloco: bool = False) -> None:
    """preflight → prepare → init → warm-up: the data and θ0 every later stage needs."""
    set_threads()  # this process's stages (calibration, merges, evaluation): its share of the CPUs
    tasks.preflight(run_dir, diloco)
    tasks.prepare(run_dir)
    tasks.init(run_dir)
    if cfg.warmup.steps:
        train_branches(cfg, run_dir, [(run_dir, WARMUP)], "warmup")


@flow(name="merit", log_prints=True)
def merit(
    config: str | None = "configs/demo.yaml", overrides: list[str] | None = None, run_dir: str | None = None
) -> str:
    """The MERIT pipeline on one run directory; returns the path of the report."""
    cfg, run_dir = start_run(config, overrides or [], run_dir)
    run_dir = str(run_dir.absolute())
    start(run_dir, cfg)
    splits = {run_dir: len(tasks.calibrate(run_dir)["groups"])}
    for name in cfg.flow.controls:  # the same K, budget and merges on the control's split
        control = tasks.make_control(run_dir, name)
        splits[control] = len(tasks.calibrate(control)["groups"])
    baseline = [(run_dir, JOINT)] if cfg.flow.joint_baseline else []  # first: the longest job, so slots end together
    branches = [(where, str(k)) for where, groups in splits.items() for k in range(groups)]
    train_branches(cfg, run_dir, baseline + branches, "training")
    for where in splits:
        for entry in cfg.merge.methods:
            tasks.merge(where, entry.name)
    if cfg.merge.search.enabled:  # on MERIT's split: the controls keep their configured weights
        tune_merge(cfg, run_dir)
    return evaluate_and_report(cfg, run_dir)


def tune_merge(cfg: RunConfig, run_dir: str) -> dict[str, Any]:
    """merge.search: its trials shared out among ``parallel`` workers, a task each, on one study."""
    merge, workers = cfg.merge.search.merge, cfg.merge.search.parallel
    left = tasks.search_start(run_dir, merge)
    shares = [left // workers + (w < left % workers) for w in range(workers)]
    futures = [tasks.search_trials.submit(run_dir, merge, n, w) for w, n in enumerate(shares) if n]
    for future in futures:
        future.result()  # a worker's error (a dev task without a score) fails the flow, named
    return tasks.search_finish(run_dir, merge)


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
    train_branches(cfg, run_dir, [(run_dir, JOINT)], "training")
    return evaluate_and_report(cfg, run_dir)


@flow(name="theta0", log_prints=True)
def theta0(
    config: str | None = "configs/demo.yaml", overrides: list[str] | None = None, run_dir: str | None = None
) -> str:
    """θ0 alone (prepare, init, warm-up); returns its folder. Runs that set it as
    ``model.name_or_path`` with ``warmup.steps=0`` share one pre-trained start, as fine-tuning
    runs of a released model do."""
    cfg, run_dir = start_run(config, overrides or [], run_dir)
    run_dir = str(run_dir.absolute())
    start(run_dir, cfg)
    return init_path(cfg, run_dir)
