"""Benchmarks none of the models trained on, run by lmms-eval on every model of a run: how the
MERIT paper judges a merge (SeedBench, MMBench, LLaVA-W, MM-Vet, TextVQA, AI2D, MathVista,
MMMU), and how users judge a model.

The unit is one task (or group) of one model, a *job*: one lmms-eval evaluation
(:mod:`pipeline.eval.lmms_run`) on a *slot* of the machine (a GPU, several GPUs data-parallel, or
CPU processes; a model larger than one GPU: one process over several, ``device_map="auto"``),
writing ``eval/benchmarks/<model>/<task>/``: lmms-eval's results file and logged samples as it
wrote them, its log, and ``score.json``: the headline score on the paper's 0–100 scale
(:mod:`pipeline.eval.lmms_tasks`), the judge's failed judgements, the command that redoes the
evaluation, and what the score depends on (its *identity*). A job's folder is written whole as
soon as the job ends, and a re-run reuses every job whose folder is current, so a failure or a
kill loses at most the jobs that were running.

A folder is only ever replaced by a result: a job that fails (lmms-eval's error, the time limit,
more failed judgements than ``eval.judge.max_failures``) is written beside the last good one, in
``<task>.failed/``, with the error and the last lines of its log, and gets no score; the last good
result stays as it was, byte for byte, and counts as a score only while its identity is the
current one. A job that failed on its judge alone is judged again from the answers it logged
(``merit_stored_answers``), not generated again. Every process a job starts dies with it: on its
time limit, on a cancelled task and with the flow's process.

Models: lmms-eval's own ``qwen2_5_vl``; a LoRA adapter through the same model with the adapter
merged in (``merit_qwen2_5_vl``); and for the built-in toy tasks a constant-answer baseline
(``merit_constant``: each task's best single answer), scored like a model.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from statistics import mean
from typing import Any

import psutil

from pipeline import prestart
from pipeline.checkpoint import checkpoint_id, sha256_file, staged_dir, write_json_atomic
from pipeline.config import RunConfig
from pipeline.data.benchmark import (
    CONSTANT_MODEL,
    CONSTANTS,
    STORED_MODEL,
    TASKS_DIR,
    is_toy_task,
    leaf_tasks,
    toy_tasks,
)
from pipeline.devices import benchmark_gpus, visible_devices
from pipeline.eval.judge import check_judge, failed_judgements, judge_environment, judge_style
from pipeline.eval.lmms_tasks import TaskPlan, folder_digest, plan_tasks, plans_and_problems, prompts_of, score
from pipeline.hub import dataset_built, dataset_snapshot, hub_access, hub_cache
from pipeline.layout import EVAL
from pipeline.models.adapter import adapter_base, is_adapter
from pipeline.models.families import Family, family_of_config
from pipeline.tensorboard import log_benchmarks
from pipeline.threads import available_cpus, threads_per_process
from pipeline.train.lifetime import parent_environment

BENCHMARKS = "benchmarks"  # eval/benchmarks/<model>/<task>/
FAILED = ".failed"  # eval/benchmarks/<model>/<task>.failed/: the last attempt, when it failed
SCORE = "score.json"
LOG = "lmms_eval.log"
RESULTS_NAME = re.compile(r"\d{8}_\d{6}_results\.json")
LOG_TAIL = 15  # lines of a failed job's log kept in its score.json
EXCEPTION = re.compile(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception)\b")  # a traceback's last line
CONSTANT = "constant"  # the run's constant-answer baseline, benchmarked on the toy tasks like a model
JUDGED_TOY = "toy_chat"  # the built-in suite's judged task: left out of a run without a judge
LMMS_RUN = "pipeline.eval.lmms_run"
# What an evaluation imports before its first model call (lmms-eval itself, its Qwen2.5-VL model
# classes, ours over an adapter, and nltk, which lmms-eval imports for every task's standard error:
# a second a job): imported once by a prestart server on a CPU machine (pipeline.prestart).
LMMS_PRELOAD = [LMMS_RUN, "lmms_eval.models.chat.qwen2_5_vl", "pipeline.eval.lmms_adapted", "nltk"]
# This project's code a score depends on: its lmms-eval models, the runner's patches, the judge's
# bounds and failure marks, the adapter merge (an edit here changes every job's identity).
SCORING_CODE = [
    "eval/lmms_adapted.py",
    "eval/lmms_run.py",
    "eval/judge.py",
    "eval/constant_model.py",
    "eval/stored_answers.py",
    "eval/offline_datasets.py",
    "models/adapter.py",
]
WEIGHTS_MARGIN = 1.25  # a model's weights × this (activations, KV cache) must fit a job's GPU memory


def checkpoint_family(checkpoint: str, adapter: bool) -> Family:
    """The family of a checkpoint (of its θ0 for an adapter), which names its lmms-eval model."""
    base = adapter_base(checkpoint) if adapter else checkpoint
    return family_of_config(json.loads((Path(base) / "config.json").read_text()), str(base))


def benchmark_tasks(cfg: RunConfig) -> list[str]:
    """What the stage runs: ``eval.benchmarks``, but the judged toy task when no judge is set."""
    return [t for t in cfg.eval.benchmarks if t != JUDGED_TOY or cfg.eval.judge is not None]


def search_config(cfg: RunConfig) -> RunConfig:
    """The run's config with merge.search's dev tasks (and limit) as its benchmarks: what a trial runs."""
    search = cfg.merge.search
    dev = cfg.eval.model_copy(update={"benchmarks": search.tasks, "benchmark_limit": search.limit})
    return cfg.model_copy(update={"eval": dev})


def leaves(cfg: RunConfig, tasks: list[str]) -> set[str]:
    """The tasks lmms-eval runs for ``tasks``, a group's expanded (a task it does not know: itself)."""
    toys, real = [t for t in tasks if is_toy_task(t)], [t for t in tasks if not is_toy_task(t)]
    folders = [str(Path(p).absolute()) for p in cfg.eval.include_path]
    plans = plans_and_problems(real, folders, cfg.eval.benchmark_metrics)[0] if real else {}
    return set(leaf_tasks(toys)) | {t for name in real for t in (plans[name].tasks if name in plans else [name])}


def model_tasks(cfg: RunConfig, model: str) -> list[str]:
    """The tasks a model is scored on: all of the stage's, the toy ones for the constant baseline."""
    tasks = benchmark_tasks(cfg)
    return [t for t in tasks if is_toy_task(t)] if model == CONSTANT else tasks


def benchmarked(cfg: RunConfig, model: str) -> bool:
    """Whether a model of the run gets the benchmarks: every one but the branches, unless asked."""
    branch = model.startswith("branch-")
    return bool(benchmark_tasks(cfg)) and (not branch or (cfg.eval.benchmark_branches and cfg.eval.branches))


# --- before: what would fail late ----------------------------------------------------------


def check_benchmarks(cfg: RunConfig) -> str:
    """What would fail only when the benchmarks run, after hours of training: a judged task
    without a judge, a judge that does not answer (one real request; its answer quoted), a task
    lmms-eval does not know or that cannot be scored (no headline metric; a group of groups; a
    judge whose failures cannot be counted), a task whose data is not in the Hugging Face cache
    (with the command that fetches it). The toy
    tasks are written by ``prepare``. Raises ValueError naming every problem."""
    tasks, judge = benchmark_tasks(cfg), cfg.eval.judge
    judged = [t for t in tasks if judge_style(t)]
    problems = []
    if judged and judge is None:
        problems.append(
            f"{judged} are scored by a judge model: set eval.judge (base_url, model, api_key_env) "
            "to an OpenAI-compatible server, e.g. a local vLLM, or leave these tasks out"
        )
    elif judged and not os.environ.get(judge.api_key_env):
        problems.append(f"{judged} need the judge's key in ${judge.api_key_env}, which is not set")
    elif judged:
        try:
            answered = check_judge(judge)
        except ValueError as err:
            problems.append(str(err))
    real = [t for t in tasks if not is_toy_task(t)]
    if real:
        folders = [str(Path(p).absolute()) for p in cfg.eval.include_path]
        plans, unknown = plans_and_problems(real, folders, cfg.eval.benchmark_metrics)
        problems += [_missing(task, d) for task, p in plans.items() for d in p.datasets if not _cached(d)] + unknown
        problems += [_uncounted(task) for task, p in plans.items() if p.calls_judge and not judge_style(task)]
    if problems:
        raise ValueError("; ".join(problems))
    left_out = [t for t in cfg.eval.benchmarks if t not in tasks]
    note = f" ({', '.join(left_out)} left out: scored by a judge model, and eval.judge is not set)" if left_out else ""
    return (", ".join(tasks) or "none") + note + (f"; judge {answered}" if judged else "")


def _uncounted(task: str) -> str:
    return (
        f"task '{task}' is scored by a judge model its code calls, and only the failed judgements of "
        "llava_in_the_wild, mmvet, mathvista_* and mmbench_* are counted (lmms-eval scores a failed one as a "
        "number): leave it out"
    )


def _missing(task: str, dataset: str) -> str:
    return (
        f"task '{task}': its data {dataset} is not in the Hugging Face cache {hub_cache()}; "
        f"fetch it first: `hf download {dataset} --repo-type dataset`{hub_access(dataset, 'dataset')}"
    )


def _cached(dataset: str) -> bool:
    """A dataset repository in the hub cache, or built by ``datasets`` in its own cache. Online or
    not, the same answer: the jobs read their data from the caches only (:func:`job_environment`)."""
    return dataset_built(dataset) or dataset_snapshot(dataset) is not None


# --- where and how: slots, plans, identities ------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """Where one job runs: ``processes`` lmms-eval ranks (data-parallel), on ``gpus`` (one each;
    ``sharded``: one process holding the model across them), or on the CPU when there are none;
    ``threads`` CPU threads per process (the machine's CPUs shared out among the slots)."""

    processes: int = 1
    gpus: tuple[int, ...] = ()
    threads: int = 1
    sharded: bool = False


def benchmark_slots(cfg: RunConfig, models: int, model_bytes: int = 0) -> list[Slot]:
    """The slots the stage runs its jobs on, one job each at a time. On GPUs (the benchmark's,
    :func:`pipeline.devices.benchmark_gpus`): disjoint groups of ``eval.benchmark_processes`` GPUs,
    by default the GPUs shared out among the models (8 GPUs and 2 models: 2 jobs at a time on 4
    GPUs each; 7 models: 8 single-GPU jobs), since a job on more GPUs finishes sooner but loads
    the model once per GPU and waits for its slowest rank. A model of ``model_bytes`` that does not
    fit one GPU takes as many as it needs, in one process (Qwen3-VL-30B-A3B in bf16 on 40 GB cards:
    2). On the CPU: one process per job unless asked, as many jobs as the CPUs allow."""
    import torch

    gpus = benchmark_gpus(cfg)
    if gpus:
        memory = min(torch.cuda.get_device_properties(i).total_memory for i in gpus)
        shards = math.ceil(model_bytes * WEIGHTS_MARGIN / memory) if model_bytes else 1
        if shards > len(gpus):
            raise ValueError(
                f"a model of {model_bytes / 1e9:.1f} GB needs {shards} GPUs of {memory / 1e9:.0f} GB "
                f"for its benchmarks; the stage has {len(gpus)}"
            )
        if shards > 1:
            return _slots(gpus, shards, 1, sharded=True)
        per = min(len(gpus), cfg.eval.benchmark_processes or max(1, len(gpus) // max(1, models)))
        return _slots(gpus, per, per)
    per = cfg.eval.benchmark_processes or 1
    jobs = max(1, available_cpus() // per)
    return [Slot(per, threads=threads_per_process(jobs * per))] * jobs


def _slots(gpus: list[int], per: int, processes: int, sharded: bool = False) -> list[Slot]:
    groups = [tuple(gpus[i * per : (i + 1) * per]) for i in range(len(gpus) // per)]
    threads = threads_per_process(len(groups) * processes)
    return [Slot(processes, group, threads, sharded) for group in groups]


def weights_bytes(checkpoint: str) -> int:
    """The bytes of a model's weights (θ0's for an adapter), as the benchmark jobs load them."""
    base = adapter_base(checkpoint) if is_adapter(checkpoint) else checkpoint
    return sum(f.stat().st_size for f in Path(base).glob("*.safetensors"))


def task_folders(cfg: RunConfig, run_dir: str | Path) -> list[str]:
    """The folders of the run's own tasks: the toy tasks ``prepare`` wrote, ``eval.include_path``."""
    toys = [str(Path(run_dir).absolute() / TASKS_DIR)] if toy_tasks(cfg) else []
    return toys + [str(Path(p).absolute()) for p in cfg.eval.include_path]


def task_plans(cfg: RunConfig, run_dir: str | Path) -> dict[str, TaskPlan]:
    """The plan of every task of the stage; lmms-eval's own tasks are indexed only when one is named."""
    tasks = benchmark_tasks(cfg)
    defaults = not all(is_toy_task(t) for t in tasks)
    return plan_tasks(tasks, task_folders(cfg, run_dir), cfg.eval.benchmark_metrics, defaults)


def benchmark_dir(run_dir: str | Path, model: str) -> Path:
    return Path(run_dir) / EVAL / BENCHMARKS / model


def constant_answers(run_dir: str | Path) -> str:
    """The constant-answer baseline's 'checkpoint': the toy tasks' best single answers."""
    return str(Path(run_dir).absolute() / TASKS_DIR / CONSTANTS)


def weights_id(checkpoint: str) -> str:
    """A checkpoint's identity (:func:`pipeline.checkpoint.checkpoint_id`); a file's (the constant
    answers) is its hash."""
    return sha256_file(checkpoint) if Path(checkpoint).is_file() else checkpoint_id(checkpoint)


def model_args(cfg: RunConfig, checkpoint: str, device: str) -> tuple[str, dict[str, Any]]:
    """The lmms-eval model and its arguments for a checkpoint: a model folder, a LoRA adapter
    (lmms-eval's model over θ0 with the adapter merged in), or the constant answers. ``device``:
    lmms-eval's ``device_map`` (``auto`` for a model across the slot's GPUs)."""
    if Path(checkpoint).name == CONSTANTS:
        return CONSTANT_MODEL, {"answers": checkpoint}
    m = cfg.model
    adapter = {"pretrained": adapter_base(checkpoint), "adapter": checkpoint} if is_adapter(checkpoint) else None
    family = checkpoint_family(checkpoint, adapter is not None)
    model = family.lmms_adapted if adapter else family.lmms_model
    args = adapter or {"pretrained": checkpoint}
    if family.pixel_bounds:  # a tiling family's (InternVL) tiles are its processor config's
        args |= {"min_pixels": m.min_pixels, "max_pixels": m.max_pixels}
    args |= {"device_map": device, "attn_implementation": m.attn_implementation}
    if model in ("merit_qwen3_vl", "merit_internvl"):
        args["dtype"] = m.dtype
    if any("," in str(v) or "=" in str(v) for v in args.values()):
        raise ValueError(f"lmms-eval's model_args cannot hold ',' or '=': {args}")
    return model, args


@dataclass(frozen=True)
class JobSettings:
    """One task's example limit, seed and generation settings over its own, from the stage's and
    ``eval.benchmark_tasks.<task>``."""

    limit: int | None
    seed: int
    gen_kwargs: dict[str, int | float | str]


def job_settings(cfg: RunConfig, plan: TaskPlan) -> JobSettings:
    """``eval.benchmark_gen_kwargs``, then greedy answers for a task that samples
    (``eval.benchmark_greedy``), the cap on new tokens where the task's own allow more
    (``eval.benchmark_max_new_tokens``; a group: its tasks' largest own allowance, capped), then
    the task's own settings."""
    e, own = cfg.eval, cfg.eval.benchmark_tasks.get(plan.name)
    generation = dict(e.benchmark_gen_kwargs)
    if e.benchmark_greedy and plan.sampled and "temperature" not in generation:
        generation["temperature"] = 0
    cap, allowed = e.benchmark_max_new_tokens, plan.max_new_tokens
    if cap and "max_new_tokens" not in generation and (allowed is None or allowed > cap):
        generation["max_new_tokens"] = cap
    limit, seed = e.benchmark_limit, cfg.run.seed
    if own:
        generation |= own.gen_kwargs | ({"max_new_tokens": own.max_new_tokens} if own.max_new_tokens else {})
        limit = own.limit or limit
        seed = own.seed if own.seed is not None else seed
    return JobSettings(limit, seed, generation)


@functools.cache
def scoring_code() -> str:
    """The digest of :data:`SCORING_CODE`."""
    digest = hashlib.sha256()
    for name in SCORING_CODE:
        digest.update(name.encode() + b"\0" + (Path(__file__).parent.parent / name).read_bytes())
    return digest.hexdigest()


def identity(cfg: RunConfig, model: str, args: dict[str, Any], checkpoint: str, plan: TaskPlan) -> dict[str, Any]:
    """What a job's score depends on: the weights, the task's files (prompts, generation
    settings, hooks, local data; lmms-eval's own tasks through its version too), the prompts'
    model, the model's settings, this project's scoring code, the example limit, the generation
    settings over the tasks', the seed; and, for a judged task, under ``judge``, the judge and
    how many of its failures a score may hold. Everything but ``judge`` is what the answers
    depend on. Never devices, processes or batch size."""
    judge = cfg.eval.judge if any(judge_style(t) for t in plan.tasks) else None
    settings = job_settings(cfg, plan)
    return {
        "checkpoint_id": weights_id(checkpoint),
        "task": plan.name,
        "task_files": folder_digest(plan.folders),
        "model": model,
        "prompts": prompts_of(model),
        "model_args": {k: v for k, v in args.items() if k not in ("pretrained", "adapter", "answers", "device_map")},
        "code": scoring_code(),
        "limit": settings.limit,
        "gen_kwargs": settings.gen_kwargs,
        "seed": settings.seed,
        "lmms_eval": version("lmms_eval"),
        "judge": judge.model_dump(include={"base_url", "model", "max_failures"}) if judge else None,
    }


def same_answers(one: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether two identities give the same answers (they may differ in their judge)."""
    return {k: v for k, v in one.items() if k != "judge"} == {k: v for k, v in other.items() if k != "judge"}


def wanted_identity(cfg: RunConfig, run_dir: str | Path, checkpoint: str, task: str, slot: Slot = Slot()) -> dict:
    """The identity a job of ``task`` on ``checkpoint`` has under ``cfg`` now."""
    plan = task_plans(cfg, run_dir)[task]
    lmms_model, args = model_args(cfg, str(checkpoint), job_device(slot))
    return identity(cfg, lmms_model, args, str(checkpoint), plan)


def job_device(slot: Slot) -> str:
    """lmms-eval's ``device_map`` on a slot: its one GPU, every rank's own, or all of them (sharded)."""
    if not slot.gpus:
        return "cpu"
    return "auto" if slot.sharded else "cuda" if slot.processes > 1 else "cuda:0"


# --- one job ----------------------------------------------------------------------------------


class JobFailed(RuntimeError):
    """lmms-eval did not score the task: its error, or the time limit."""


def run_benchmark(
    cfg: RunConfig, run_dir: str | Path, model: str, checkpoint: str, task: str, slot: Slot = Slot()
) -> dict[str, Any]:
    """One job: ``task`` of ``model`` on ``slot``, its folder ``eval/benchmarks/<model>/<task>/``
    written whole when it scores (``<task>.failed/`` when it does not); returns its ``score.json``.
    A current result is returned without running; answers logged under the current identity but
    another judge are judged again without generating them."""
    run_dir = Path(run_dir).absolute()
    plan = task_plans(cfg, run_dir)[task]
    if Path(checkpoint).name == CONSTANTS:
        slot = Slot()  # constant answers: no model to load, nothing to share out
    lmms_model, args = model_args(cfg, str(checkpoint), job_device(slot))
    wanted = identity(cfg, lmms_model, args, str(checkpoint), plan)
    folder = benchmark_dir(run_dir, model) / task
    failed = folder.with_name(task + FAILED)
    done = _read(folder / SCORE)
    if done and done["identity"] == wanted and "score" in done:
        return done
    answers = _logged_answers(wanted, folder, failed)
    redo_args = args
    if answers:  # judged again: the stored answers' files are read while the new ones are written
        lmms_model, args, slot = STORED_MODEL, {"answers": str(answers)}, Slot()
        redo_args = {"answers": str(folder)}  # where the same answers are logged once this job scores
    device = "cuda" if slot.gpus else "cpu"
    with staged_dir(failed) as out:
        argv = lmms_arguments(cfg, lmms_model, args, plan, device, out, slot)
        redo = lmms_arguments(cfg, lmms_model, redo_args, plan, device, folder, slot)
        redo = recorded_command(cfg, plan, redo, slot)
        record = {"model": model, "task": task, "checkpoint": str(checkpoint), "identity": wanted, "command": redo}
        record |= {"answers_from": str(answers)} if answers else {}
        started = time.monotonic()
        try:
            _evaluate(cfg, plan, argv, slot, str(checkpoint), out)
            record |= _scored(cfg, plan, out)
        except (JobFailed, ValueError) as err:
            record["error"] = str(err)
            record["log_tail"] = log_tail(out / LOG)
        record["seconds"] = round(time.monotonic() - started, 1)
        write_json_atomic(out / SCORE, record)
    if "score" in record:
        _publish(failed, folder)
        average = read_scores(cfg, run_dir, model, str(checkpoint))["average"]
        log_benchmarks(run_dir / EVAL / "tensorboard" / model / BENCHMARKS, {task: record["score"]["score"]}, average)
    return record


def _publish(attempt: Path, folder: Path) -> None:
    """A scored attempt becomes the task's folder, in one rename (the old folder aside until then)."""
    with staged_dir(folder) as staged:
        staged.rmdir()
        attempt.rename(staged)


def _logged_answers(wanted: dict[str, Any], *folders: Path) -> Path | None:
    """The folder of a job whose answers are the ones ``wanted`` asks for, but that was judged by
    another judge or failed on its judge alone: its answers need only be judged again."""
    if wanted["judge"] is None:
        return None
    for folder in folders:
        record = _read(folder / SCORE)
        if record and same_answers(record["identity"], wanted) and (record.get("judge_failures") or "score" in record):
            return folder
    return None


# lmms-eval models that take one request at a time (internvl_hf asserts it): eval.benchmark_batch_size
# is capped for them rather than refused, since a run mixing families shares one setting.
ONE_AT_A_TIME = {"merit_internvl"}


def lmms_arguments(
    cfg: RunConfig, model: str, args: dict[str, Any], plan: TaskPlan, device: str, out: Path, slot: Slot = Slot()
) -> list[str]:
    """The runner's options (lmms-eval's names) for one job writing into ``out``."""
    e, settings = cfg.eval, job_settings(cfg, plan)
    argv = ["--model", model, "--model_args", ",".join(f"{k}={v}" for k, v in args.items()), "--tasks", plan.name]
    argv += [f"--include_path={folder}" for folder in plan.folders]
    batch_size = 1 if model in ONE_AT_A_TIME else e.benchmark_batch_size
    argv += ["--batch_size", str(batch_size), "--device", device]
    argv += ["--limit", str(settings.limit)] if settings.limit else []
    argv += (
        ["--gen_kwargs", ",".join(f"{k}={v}" for k, v in settings.gen_kwargs.items())] if settings.gen_kwargs else []
    )
    argv += ["--process_group_timeout_s", str(e.benchmark_timeout_s)] if slot.processes > 1 else []
    return [*argv, "--seed", str(settings.seed), "--output_path", str(out), "--log_samples"]


def _launcher(slot: Slot, lifetime: bool = False) -> list[str]:
    """How the runner starts: one process, or ``torchrun`` with a rank per GPU (CPU: per process).
    ``lifetime``: each process run by :mod:`pipeline.train.lifetime`, dying with the one that
    started it from its first line on (a rank still importing lmms-eval included)."""
    runner = ["-m", "pipeline.train.lifetime", LMMS_RUN] if lifetime else ["-m", LMMS_RUN]
    if slot.processes == 1:
        return runner
    torchrun = ["torch.distributed.run", "--standalone", f"--nproc_per_node={slot.processes}"]
    return [*(["-m", "pipeline.train.lifetime", *torchrun] if lifetime else ["-m", *torchrun]), *runner]


def job_environment(cfg: RunConfig, plan: TaskPlan, slot: Slot = Slot()) -> dict[str, str]:
    """Offline always: the data sets from the caches, where preflight found them (online, a gated
    set would need a token at evaluation, after the training); the judge's settings for a judged
    task (its lmms-eval module reads them when imported); the job's CPU threads (its share of the
    machine's: :func:`benchmark_slots`); its GPUs, through this process' own list; transformers'
    hub kernels only when ``model.use_kernels`` asks (lmms-eval loads the model itself)."""
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["USE_HUB_KERNELS"] = "YES" if cfg.model.use_kernels else "NO"
    style = next((judge_style(t) for t in plan.tasks if judge_style(t)), None)
    if style:
        env |= judge_environment(cfg.eval.judge, style)
    env["OMP_NUM_THREADS"] = str(slot.threads)
    if slot.gpus:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(list(slot.gpus))
    return env


def recorded_command(cfg: RunConfig, plan: TaskPlan, argv: list[str], slot: Slot) -> str:
    """The shell command that redoes a job (``argv`` writing into its folder): the environment it
    needs (the judge's key by reference, never its value), then the runner as the job started it."""
    env = {k: shlex.quote(v) for k, v in job_environment(cfg, plan, slot).items()}
    if "OPENAI_API_KEY" in env:
        env["OPENAI_API_KEY"] = f'"${cfg.eval.judge.api_key_env}"'
    folder = argv[argv.index("--output_path") + 1]
    runner = shlex.join(["python", *_launcher(slot), *argv])
    return f"cd {shlex.quote(folder)} && " + " ".join([*(f"{k}={v}" for k, v in env.items()), runner])


def _evaluate(cfg: RunConfig, plan: TaskPlan, argv: list[str], slot: Slot, checkpoint: str, out: Path) -> None:
    """Run lmms-eval for one job in ``out`` (its working folder, where stray files land too).
    Every process it starts dies with it: torchrun and a lone runner with this process
    (``pipeline.train.lifetime``), each rank with torchrun, all of them on the time limit or when
    this task stops (cancelled, interrupted)."""
    env = os.environ | job_environment(cfg, plan, slot) | parent_environment()
    with (out / LOG).open("a") as log:
        if slot.processes == 1 and prestart.usable():  # a fork of a process that imported lmms-eval
            proc = prestart.start(LMMS_RUN, argv, env, preload=LMMS_PRELOAD, stdout=log.fileno(), cwd=str(out))
        else:
            command = [sys.executable, *_launcher(slot, lifetime=True), *argv]
            proc = subprocess.Popen(command, stdout=log, stderr=log, env=env, cwd=out, start_new_session=True)
        try:
            code = proc.wait(timeout=cfg.eval.benchmark_timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            raise JobFailed(f"ran past eval.benchmark_timeout_s ({cfg.eval.benchmark_timeout_s} s)") from None
        except BaseException:  # a cancelled task or Ctrl-C: the ranks run in sessions of their own
            kill_tree(proc.pid)
            proc.wait()
            raise
    if code != 0:
        kill_tree(proc.pid)  # ranks a failed launcher left
        raise JobFailed(f"lmms-eval failed (exit code {code})")


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every process it started. torchrun starts each rank in a session of
    its own, so no process group holds them all: the tree is read first (a killed parent's
    children are re-parented and could no longer be found), then each is killed."""
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        for proc in [*root.children(recursive=True), root]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


def _scored(cfg: RunConfig, plan: TaskPlan, out: Path) -> dict[str, Any]:
    """The job's score from lmms-eval's files and the judge's failed judgements; an error instead
    of a score when the judge failed more often than ``eval.judge.max_failures``."""
    results = json.loads(lmms_results(out).read_text())
    samples = {t: _samples(out, t) for t in plan.tasks}
    log = (out / LOG).read_text(errors="replace")
    counts = [failed_judgements(t, samples[t], log) for t in plan.tasks]
    judged = [c for c in counts if c is not None]
    failures = sum(judged) if judged else None
    record = {"judge_failures": failures}
    if failures:
        judge, limit = cfg.eval.judge, cfg.eval.judge.max_failures
        judgements = sum(len(s) for s in samples.values())
        message = f"{failures} of {judgements} judgements by {judge.model} at {judge.base_url} failed or were unusable"
        if failures > limit:
            return record | {
                "error": f"{message} (eval.judge.max_failures = {limit})",
                "log_tail": log_tail(out / LOG),
            }
        record["judge_note"] = message
    return record | {"score": score(plan, results, samples)}


def lmms_results(out: Path) -> Path:
    """The results file lmms-eval's tracker wrote under ``out`` (``[<model>/]<date>_<time>_results.json``;
    tasks write files of their own beside it, e.g. MMBench's ``submissions/…_results.json``), the
    latest when the recorded command was run again in the folder."""
    found = sorted((p for p in out.rglob("*_results.json") if RESULTS_NAME.fullmatch(p.name)), key=lambda p: p.name)
    if not found:
        raise JobFailed(f"lmms-eval wrote no results file under {out}")
    return found[-1]


def _samples(out: Path, task: str) -> list[dict[str, Any]]:
    files = sorted(out.rglob(f"*_samples_{task}.jsonl"), key=lambda p: p.name)
    if not files:
        raise JobFailed(f"lmms-eval logged no samples of '{task}'")
    return [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]


def log_tail(log: Path) -> list[str]:
    """A failed job's last log lines, led by its last exception line when that is further up (a
    rank's error comes before torchrun's own report of the rank's exit)."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    tail = lines[-LOG_TAIL:]
    raised = [line for line in lines if EXCEPTION.match(line) and "ChildFailedError" not in line]
    return ([raised[-1], "…"] if raised and raised[-1] not in tail else []) + tail


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


# --- after: a model's scores ------------------------------------------------------------------


def read_scores(
    cfg: RunConfig, run_dir: str | Path, model: str, checkpoint: str | None = None
) -> dict[str, Any] | None:
    """A model's jobs as their folders hold them: the scores of the current identity (with
    ``checkpoint``: of the weights it has now, under ``cfg``'s settings), the tasks whose latest
    attempt failed, the earlier scores of another identity (``stale``: never in the table or the
    average, with the identity keys they differ in), and the average of the scores when every
    task has a current one (None otherwise: an average of some tasks would compare models on
    different benchmarks). None when no job of the model ran."""
    tasks, folder = model_tasks(cfg, model), benchmark_dir(run_dir, model)
    current = checkpoint if checkpoint and Path(checkpoint).exists() else None
    scored, failed, stale = {}, {}, {}
    for task in tasks:
        good, attempt = _read(folder / task / SCORE), _read(folder / f"{task}{FAILED}" / SCORE)
        if good and "error" in good:  # a folder written before failures were kept apart
            good, attempt = None, attempt or good
        if good is None and attempt is None:
            continue
        wanted = wanted_identity(cfg, run_dir, current, task) if current else None
        if good and wanted in (None, good["identity"]):
            scored[task] = good
            continue
        if attempt and wanted in (None, attempt["identity"]):
            failed[task] = {"error": attempt["error"], "log_tail": attempt.get("log_tail", [])}
        if good:
            differs = sorted(k for k in good["identity"] if good["identity"][k] != wanted.get(k))
            stale[task] = {"score": good["score"]["score"], "differs": differs}
    if not (scored or failed or stale):
        return None
    return {
        "model": model,
        "tasks": {t: {**r["score"], "checkpoint_id": r["identity"]["checkpoint_id"]} for t, r in scored.items()},
        "judge_failures": {t: r["judge_failures"] for t, r in scored.items() if r.get("judge_failures") is not None},
        "failed": failed,
        "stale": stale,
        "average": mean(r["score"]["score"] for r in scored.values()) if len(scored) == len(tasks) else None,
    }
