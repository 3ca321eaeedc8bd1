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
from pipeline.eval.benchmarks import Slot
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
    from pipeline.eval.heldout import refuse_short_dev_share
    from pipeline.models import processor_for

    cfg = run_config(run_dir)
    manifest = prepare_data(cfg, run_dir, processor_for(cfg, run_dir))
    refuse_short_dev_share(cfg, run_dir)  # merge.search's dev split, known now: before anything trains
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
    from pipeline.controls import control_of
    from pipeline.layout import training_dir

    cfg = run_config(run_dir)
    run = run_remote(
        deployment,
        {"run_dir": run_dir, "name": name},
        "-".join(filter(None, ["branch", control_of(run_dir), name])),  # branch-0, branch-random-0
        training_dir(run_dir, name),
        # The branch's own timeout (its launcher's) fires first; the watcher's is for a run that hangs.
        job_spec(cfg, run_dir, name).train.timeout_s + cfg.flow.branch_stale_s,
        cfg.flow.branch_stale_s,
    )
    return {"name": name, "flow_run": run}


def run_remote(
    deployment: str, parameters: dict[str, Any], name: str, folder: Path, timeout_s: float, stale_s: float
) -> str:
    """A flow run of ``deployment`` that beats its heartbeat into ``folder``, waited for; returns
    its id, or raises when it fails, crashes or its machine is gone."""
    from prefect.deployments import run_deployment

    from flows.heartbeat import claim, wait_for

    run = run_deployment(deployment, parameters=parameters, flow_run_name=name, timeout=0)
    claim(folder, str(run.id))  # an earlier run of the same job, if still alive, stops at its next beat
    run = wait_for(run, folder, stale_s, timeout_s)
    if not run.state.is_completed():
        raise RuntimeError(
            f"{name}: flow run {run.name} of {deployment} ended {run.state.type.value}: {run.state.message}"
        )
    return str(run.id)


@task(name="aggregate-part", task_run_name="aggregate-{variant}-{r}-{s}")
def aggregate_part(run_dir: str, variant: str, r: int, workers: list[int], s: int) -> dict[str, Any]:
    """Part s of a DiLoCo round's aggregation (its share of the tensors); returns what it read."""
    from pipeline.diloco.plan import plan_of
    from pipeline.diloco.rounds import aggregate_part as aggregate

    cfg = run_config(run_dir)
    record = aggregate(plan_of(cfg, run_dir, variant), r, workers, s, cfg.merge.device, cfg.merge.block_mb)
    return {"part": s, "read": record["read"], "seconds": record["seconds"]["aggregate"]}


@task(name="aggregate-part-remote", task_run_name="aggregate-{variant}-{r}-{s}")
def aggregate_part_remote(deployment: str, run_dir: str, variant: str, r: int, workers: list[int], s: int) -> str:
    """Part s of a DiLoCo round as a flow run of ``deployment`` (a ``diloco-part`` deployment), on a
    machine of its pool, watched by its heartbeat like a remote branch; returns the run's id."""
    from pipeline.diloco.plan import plan_of
    from pipeline.diloco.rounds import part_beat_dir

    cfg = run_config(run_dir)
    parameters = {"run_dir": run_dir, "variant": variant, "r": r, "workers": workers, "s": s}
    folder = part_beat_dir(plan_of(cfg, run_dir, variant), r, s)
    return run_remote(
        deployment, parameters, f"part-{variant}/{r}/{s}", folder, cfg.train.timeout_s, cfg.flow.branch_stale_s
    )


@task(name="merge", task_run_name="merge-{name}")
def merge(run_dir: str, name: str) -> dict[str, Any]:
    from pipeline.merging import merge_run

    return merge_run(run_config(run_dir), run_dir, name)


@task(name="search-start", task_run_name="search-start-{merge}")
def search_start(run_dir: str, merge: str) -> int:
    """merge.search, before its workers: the trials left (``merge`` names the task run)."""
    from pipeline.merge_search import Search

    return Search(run_config(run_dir), run_dir).start()


@task(name="search-trials", task_run_name="search-{merge}-worker-{worker}")
def search_trials(run_dir: str, merge: str, trials: int, worker: int) -> None:
    """``trials`` trials of merge.search on worker ``worker``'s device, beside the other workers."""
    from pipeline.merge_search import Search

    Search(run_config(run_dir), run_dir, worker).optimize(trials)


@task(name="search-finish", task_run_name="search-finish-{merge}")
def search_finish(run_dir: str, merge: str) -> dict[str, Any]:
    """The chosen merge written, search.json and its plot; returns the given and chosen weights."""
    from pipeline.merge_search import Search

    result = Search(run_config(run_dir), run_dir).finish()
    return {k: result[k] for k in ("merge", "given", "best")}


@task(name="evaluate", task_run_name="evaluate-{model}")
def evaluate(run_dir: str, model: str, checkpoint: str) -> dict[str, Any]:
    """Held-out loss and exact-match accuracy of one model; returns its overall and per-role figures."""
    from pipeline.eval import evaluate_model

    result = evaluate_model(run_config(run_dir), run_dir, model, checkpoint)
    return {k: result[k] for k in ("model", "loss", "macro_loss", "token_accuracy", "accuracy", "roles") if k in result}


@task(name="benchmark", task_run_name="benchmark-{model}-{task}")
def benchmark(run_dir: str, model: str, checkpoint: str, task: str, slot: Slot) -> dict[str, Any]:
    """One lmms-eval job: one task of one model on ``slot``; returns its score (0–100) or its error."""
    from pipeline.eval.benchmarks import run_benchmark

    record = run_benchmark(run_config(run_dir), run_dir, model, checkpoint, task, slot)
    return {k: record[k] for k in ("model", "task", "error", "log_tail", "judge_failures") if k in record} | {
        "score": record["score"]["score"] if "score" in record else None
    }


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
