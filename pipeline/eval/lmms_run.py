"""One lmms-eval evaluation: ``python -m pipeline.eval.lmms_run --model … --tasks …``, the command
the benchmark stage runs and records for each task of each model (run as written, it redoes that
evaluation). Its options are lmms-eval's own (``python -m lmms_eval``), and it runs lmms-eval's
models, tasks, prompts and metrics through lmms-eval's API, writing its results file and logged
samples under ``--output_path``. It differs in these ways, each for a reason:

- only the task folders given by ``--include_path`` (repeatable) are indexed, not lmms-eval's own
  ~2,000 task files first (seconds per evaluation);
- ``--seed S`` sets all four of lmms-eval's seeds (Python, NumPy, torch, few-shot) to S;
- offline (``HF_HUB_OFFLINE=1``), a hub dataset fetched with ``hf download`` is read from the hub
  cache, where ``datasets`` alone would refuse it (:mod:`pipeline.eval.offline_datasets`);
- the tasks' model-specific prompts are those of the lmms-eval model this project's model extends
  (``merit_qwen3_vl`` gets a task's ``qwen3_vl`` prompts), as ``python -m lmms_eval`` picks them
  for its own models;
- MM-Vet's judge is asked a bounded number of times (:func:`pipeline.eval.judge.bound_mmvet_retries`).

Data-parallel: started by ``torchrun --nproc_per_node N``, each rank answers its share of the
questions and rank 0 writes the results (lmms-eval's ``torchrun`` mode; gloo on CPU). The ranks'
collectives wait up to ``--process_group_timeout_s`` (torch's default, 10 minutes, is shorter than
rank 0 alone loading a benchmark's data or waiting on its judge).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from lmms_eval import evaluator
from lmms_eval.loggers.evaluation_tracker import EvaluationTracker
from lmms_eval.tasks import TaskManager
from lmms_eval.utils import get_datetime_str

from pipeline.eval.judge import bound_mmvet_retries, mark_judge_fallbacks
from pipeline.eval.lmms_tasks import prompts_of
from pipeline.eval.offline_datasets import read_hub_datasets_from_cache


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline.eval.lmms_run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--model_args", default="")
    parser.add_argument("--tasks", required=True, help="comma-separated task or group names")
    parser.add_argument("--include_path", action="append", default=[], help="a folder of task YAMLs (repeatable)")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--gen_kwargs", default="", help="over the tasks' own, e.g. max_new_tokens=64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_path", required=True)
    parser.add_argument("--log_samples", action="store_true")
    parser.add_argument("--process_group_timeout_s", type=int, default=6 * 3600, help="data-parallel collectives")
    return parser.parse_args(argv)


def task_manager(args: argparse.Namespace) -> TaskManager:
    return TaskManager(
        include_path=args.include_path or None,
        include_defaults=not args.include_path,
        model_name=prompts_of(args.model),
    )


def evaluate(args: argparse.Namespace) -> None:
    read_hub_datasets_from_cache()
    mark_judge_fallbacks()
    bound_mmvet_retries()
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1 and not dist.is_initialized():  # torchrun: the ranks' group, before the model's Accelerator
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=args.process_group_timeout_s))
    tasks = task_manager(args)
    tracker = EvaluationTracker(output_path=args.output_path)
    when = get_datetime_str()
    results = evaluator.simple_evaluate(
        model=args.model,
        model_args=args.model_args,
        tasks=args.tasks.split(","),
        batch_size=args.batch_size,
        device=args.device,
        limit=args.limit,
        gen_kwargs=args.gen_kwargs or None,
        log_samples=args.log_samples,
        evaluation_tracker=tracker,
        task_manager=tasks,
        random_seed=args.seed,
        numpy_random_seed=args.seed,
        torch_random_seed=args.seed,
        fewshot_random_seed=args.seed,
        datetime_str=when,
        distributed_executor_backend="torchrun" if ranks > 1 else "accelerate",
    )
    if int(os.environ.get("RANK", "0")) != 0:
        return  # rank 0 gathers every rank's answers and writes the files
    if results is None:
        raise RuntimeError("lmms-eval returned no results")
    samples = results.pop("samples", None) or {}
    tracker.save_results_aggregated(results=results, samples=samples, datetime_str=when)
    for task in samples:
        tracker.save_results_samples(task_name=task, samples=samples[task])


if __name__ == "__main__":
    evaluate(parse(sys.argv[1:]))
