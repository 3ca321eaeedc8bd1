"""One lmms-eval evaluation of one model, in a process of its own:
``python -m pipeline.eval.lmms_run SPEC.json`` (the spec :func:`pipeline.eval.benchmarks.run_spec`
writes). It does what ``python -m lmms_eval`` does, through lmms-eval's own API: its
``qwen2_5_vl`` model, its tasks, prompts and metrics, its results file and logged samples under
the spec's ``output_path``; only the task index is narrowed to the run's task folders when every
task is one of them (lmms-eval otherwise indexes its ~1,000 task files first, seconds a model).

A process per model: a 7B model's memory is given back when its evaluation ends, and a task
module that reads its environment at import (the judged tasks do) sees this model's settings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lmms_eval import evaluator
from lmms_eval.loggers.evaluation_tracker import EvaluationTracker
from lmms_eval.tasks import TaskManager
from lmms_eval.utils import get_datetime_str


def evaluate(spec: dict) -> None:
    tasks = TaskManager(include_path=spec["include_path"] or None, include_defaults=spec["include_defaults"])
    tracker = EvaluationTracker(output_path=spec["output_path"])
    when = get_datetime_str()
    results = evaluator.simple_evaluate(
        model=spec["model"],
        model_args=spec["model_args"],
        tasks=spec["tasks"],
        batch_size=spec["batch_size"],
        device=spec["device"],
        limit=spec["limit"],
        log_samples=True,
        evaluation_tracker=tracker,
        task_manager=tasks,
        random_seed=spec["seed"],
        datetime_str=when,
    )
    if results is None:  # lmms-eval returns None on ranks other than 0; this process is rank 0
        raise RuntimeError("lmms-eval returned no results")
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples, datetime_str=when)
    for task in results["configs"]:
        tracker.save_results_samples(task_name=task, samples=samples[task])


if __name__ == "__main__":
    evaluate(json.loads(Path(sys.argv[1]).read_text()))
