"""Launch one DiLoCo worker as its own process group (``pipeline.train.launch``), for the whole run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.diloco.plan import DilocoPlan
from pipeline.diloco.rounds import rounds_done
from pipeline.diloco.worker import WorkerJob
from pipeline.train.launch import run_job


def train_worker(
    plan: DilocoPlan, k: int, echo: bool = True, gpus: list[int] | None = None, sharing: int = 1
) -> dict[str, Any]:
    """Run worker k until its last round (resuming its inner state); nothing once the run is done."""
    spec = plan.workers[k]
    if rounds_done(plan) >= plan.final:
        return {"name": spec.name, "seconds": 0.0}
    spec.validate_inputs()
    job = WorkerJob(plan=plan, index=k).save(Path(spec.out_dir) / "job.json")
    return {"name": spec.name, "seconds": run_job(spec, job, "pipeline.diloco.worker", echo, gpus, sharing)}
