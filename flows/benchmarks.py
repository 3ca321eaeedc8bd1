"""The benchmark stage of a flow: a job per task of each model (:func:`pipeline.eval.benchmarks.run_benchmark`),
on this machine's slots (GPU groups or CPU shares), started as each model's held-out evaluation
ends, with a Prefect progress artifact and a log line per job."""

from __future__ import annotations

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.logging import get_run_logger

from flows import tasks
from flows.slots import SlotPool
from pipeline.config import RunConfig
from pipeline.eval.benchmarks import (
    CONSTANT,
    benchmark_slots,
    benchmarked,
    constant_answers,
    model_tasks,
    weights_bytes,
)

POLL_S = 2.0

Model = tuple[str, str, str]  # (run directory, model name, checkpoint)


class BenchmarkJobs:
    """The jobs of ``models`` (those benchmarked) and, when the run has toy tasks, of the
    constant-answer baseline (first: it takes seconds); ``add`` a model once it is ready."""

    def __init__(self, cfg: RunConfig, run_dir: str, models: list[Model], key: str):
        self.cfg = cfg
        models = [m for m in models if benchmarked(cfg, m[1])]
        constant = [(run_dir, CONSTANT, constant_answers(run_dir))] if models and model_tasks(cfg, CONSTANT) else []
        self.total = sum(len(model_tasks(cfg, model)) for _, model, _ in constant + models)
        weights = max((weights_bytes(checkpoint) for _, _, checkpoint in models), default=0)
        self.pool = SlotPool(benchmark_slots(cfg, len(models), weights), self._submit)
        self.artifact = create_progress_artifact(0.0, key=key, description=f"{self.total} benchmark jobs")
        for model in constant:
            self.add(*model)

    def _submit(self, job: tuple[str, str, str, str], slot):
        return tasks.benchmark.submit(*job, slot=slot)

    def add(self, where: str, model: str, checkpoint: str) -> None:
        if model == CONSTANT or benchmarked(self.cfg, model):
            for task in model_tasks(self.cfg, model):
                self.pool.add((where, model, task), (where, model, checkpoint, task))

    def poll(self) -> None:
        self.pool.poll()

    def wait(self) -> list[str]:
        """Every job ended; returns the failed ones, each named with its error."""
        failures, logger = [], get_run_logger()
        for ended, ((_, model, task), future) in enumerate(self.pool.finished(POLL_S), start=1):
            try:
                record = future.result()
            except Exception as err:  # not lmms-eval's failure (that is in the record): the job's own
                record = {"error": str(err), "log_tail": []}
            if "error" in record:
                failures.append(f"{model}/{task}: {record['error']}")
                tail = "".join(f"\n    {line}" for line in record["log_tail"])
                logger.warning(f"benchmark {model}/{task}: no score: {record['error']}{tail}")
            else:
                logger.info(f"benchmark {model}/{task}: {record['score']:.1f} ({ended}/{self.total} jobs)")
            update_progress_artifact(self.artifact, 100.0 * ended / self.total)
        return failures
