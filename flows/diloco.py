"""The DiLoCo flow: multi-round training with the merge library as the aggregator.

diloco: preflight → prepare → init → warm-up (θ0) → [calibrate, for merit shards] → per method
of ``diloco.methods``: R workers (alive for the whole run: a task each on this machine, or a flow
run each of ``flow.branch_deployment``), and the rounds, aggregated here as the workers' payloads
arrive → held-out evaluation → report. A re-run resumes after the last round whose global
weights exist; the workers resume their inner state from their own checkpoints.
"""

from __future__ import annotations

from functools import partial

import prefect.runtime
from prefect import flow
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.logging import get_run_logger

from flows import tasks
from flows.heartbeat import heartbeat
from flows.merit import evaluate_and_report, start
from flows.report import artifact_key
from pipeline.config import DilocoMethod, RunConfig
from pipeline.diloco.loop import run_rounds, worker_slots
from pipeline.diloco.plan import DilocoPlan, diloco_plan, plan_of, worker_name
from pipeline.diloco.rounds import part_beat_dir, rounds_done
from pipeline.layout import start_run


def run_variant(cfg: RunConfig, run_dir: str, method: DilocoMethod) -> None:
    """One DiLoCo variant's rounds (``pipeline.diloco.loop``) with its workers as Prefect tasks
    (on this machine, or flow runs of ``flow.branch_deployment``: a machine each), its parts as
    tasks or flow runs of ``diloco.aggregator_deployment``, and a progress artifact."""
    plan = diloco_plan(cfg, run_dir, method)
    retries = {"retries": cfg.flow.branch_retries, "retry_delay_seconds": cfg.flow.retry_delay_s}
    local = tasks.train.with_options(**retries, retry_condition_fn=tasks.worth_retrying)
    remote = tasks.train_remote.with_options(**retries)
    slots, deployment = worker_slots(cfg, plan.size), cfg.flow.branch_deployment

    def launch(k: int):
        name = worker_name(plan.variant, k)
        if deployment:
            return remote.submit(deployment, run_dir, name)
        return local.submit(run_dir, name, gpus=slots[k], sharing=plan.size)

    key = artifact_key(cfg.run.name, plan.variant, "rounds")
    artifact = create_progress_artifact(100.0 * rounds_done(plan) / plan.final, key=key, description=plan.variant)
    progress = lambda pct: update_progress_artifact(artifact, pct)
    run_rounds(cfg, run_dir, plan, launch, partial(aggregate_parts, cfg, plan), get_run_logger(), progress)


def aggregate_parts(cfg: RunConfig, plan: DilocoPlan, r: int, sent: list[int]) -> None:
    """Round r's S parts at once: each a flow run of ``diloco.aggregator_deployment`` (a machine
    of its pool each: every machine reads 1/S of the payloads), or a task of this flow (a thread
    each, so S cores of this machine). A part whose machine is lost is run again by its retries."""
    run_dir, deployment = plan.workers[0].run_dir, cfg.diloco.aggregator_deployment
    retries = {"retries": cfg.flow.branch_retries, "retry_delay_seconds": cfg.flow.retry_delay_s}
    futures = [
        tasks.aggregate_part_remote.with_options(**retries).submit(deployment, run_dir, plan.variant, r, sent, s)
        if deployment
        else tasks.aggregate_part.submit(run_dir, plan.variant, r, sent, s)
        for s in range(plan.aggregators)
    ]
    for future in futures:
        future.result()


@flow(name="diloco-part", log_prints=True)
def part(run_dir: str, variant: str, r: int, workers: list[int], s: int) -> dict:
    """Part s of round r of a DiLoCo variant on whatever machine runs this flow: the unit a diloco
    run fans its aggregation out to when ``diloco.aggregator_deployment`` names this deployment."""
    cfg = tasks.run_config(run_dir)
    folder = part_beat_dir(plan_of(cfg, run_dir, variant), r, s)
    with heartbeat(folder, str(prefect.runtime.flow_run.id), cfg.flow.heartbeat_s):
        return tasks.aggregate_part(run_dir, variant, r, workers, s)


@flow(name="diloco", log_prints=True)
def diloco(
    config: str | None = "configs/demo.yaml", overrides: list[str] | None = None, run_dir: str | None = None
) -> str:
    """DiLoCo / IsoLoCo on one run directory (every method of ``diloco.methods``, from the same θ0
    and budget); returns the path of the report."""
    cfg, run_dir = start_run(config, overrides or [], run_dir)
    run_dir = str(run_dir.absolute())
    start(run_dir, cfg, diloco=True)
    if cfg.diloco.shards == "merit":
        tasks.calibrate(run_dir)
    for method in cfg.diloco.methods:
        run_variant(cfg, run_dir, method)
    return evaluate_and_report(cfg, run_dir)
