"""Benchmarks none of the models trained on, run by lmms-eval on every model of a run: how the
MERIT paper judges a merge (SeedBench, MMBench, LLaVA-W, MM-Vet, TextVQA, AI2D, MathVista,
MMMU), and how users judge a model.

The unit is one task (or group) of one model, a *job*: one lmms-eval evaluation
(:mod:`pipeline.eval.lmms_run`) on a *slot* of the machine (a GPU, several GPUs data-parallel, or
CPU processes), writing ``eval/benchmarks/<model>/<task>/``: lmms-eval's results file and logged
samples as it wrote them, its log, and ``score.json``: the headline score on the paper's 0–100
scale (:mod:`pipeline.eval.lmms_tasks`), the judge's failed judgements, the command that redoes
the evaluation, and what the score depends on. A job's folder is written whole as soon as the job
ends, and a re-run reuses every job whose folder is current, so a failure or a kill loses at most
the jobs that were running. A job that fails (lmms-eval's error, the time limit, more failed
judgements than ``eval.judge.max_failures``) keeps its folder, with the error and the last lines
of its log, and gets no score; the other jobs keep theirs.

Models: lmms-eval's own ``qwen2_5_vl``; a LoRA adapter through the same model with the adapter
merged in (``merit_qwen2_5_vl``); and for the built-in toy tasks a constant-answer baseline
(``merit_constant``: each task's best single answer), scored like a model.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from statistics import mean
from typing import Any

from pipeline import prestart
from pipeline.checkpoint import checkpoint_id, sha256_file, staged_dir, write_json_atomic
from pipeline.config import RunConfig
from pipeline.data.benchmark import CONSTANT_MODEL, CONSTANTS, TASKS_DIR, is_toy_task, leaf_tasks, toy_tasks
from pipeline.eval.judge import check_judge, failed_judgements, judge_environment, judge_style
from pipeline.eval.lmms_tasks import TaskPlan, folder_digest, plan_tasks, plans_and_problems, score
from pipeline.hub import dataset_built, dataset_snapshot, hub_cache, offline
from pipeline.layout import EVAL
from pipeline.models.adapter import adapter_base, is_adapter
from pipeline.models.families import Family, family_of_config
from pipeline.tensorboard import log_benchmarks
from pipeline.threads import SMALL_MODEL, available_cpus, threads_per_process

BENCHMARKS = "benchmarks"  # eval/benchmarks/<model>/<task>/
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
    lmms-eval does not know or that cannot be scored (no headline metric; a group of groups), a
    task whose data is not in the Hugging Face cache (with the command that fetches it). The toy
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
    if problems:
        raise ValueError("; ".join(problems))
    left_out = [t for t in cfg.eval.benchmarks if t not in tasks]
    note = f" ({', '.join(left_out)} left out: scored by a judge model, and eval.judge is not set)" if left_out else ""
    return (", ".join(tasks) or "none") + note + (f"; judge {answered}" if judged else "")


def _missing(task: str, dataset: str) -> str:
    return (
        f"task '{task}': its data {dataset} is not in the Hugging Face cache {hub_cache()} and HF_HUB_OFFLINE is set; "
        f"fetch it first: hf download {dataset} --repo-type dataset"
    )


def _cached(dataset: str) -> bool:
    """A dataset repository in the hub cache, or built by ``datasets`` in its own cache; online,
    lmms-eval downloads what is missing."""
    return not offline() or dataset_built(dataset) or dataset_snapshot(dataset) is not None


# --- where and how: slots, plans, identities ------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """Where one job runs: ``processes`` lmms-eval ranks (data-parallel), on ``gpus`` (one each),
    or on the CPU when there are none."""

    processes: int = 1
    gpus: tuple[int, ...] = ()


def benchmark_slots(cfg: RunConfig, models: int) -> list[Slot]:
    """The slots the stage runs its jobs on, one job each at a time. On GPUs: disjoint groups of
    ``eval.benchmark_processes`` GPUs, by default the GPUs shared out among the models (8 GPUs and
    2 models: 2 jobs at a time on 4 GPUs each; 7 models: 8 single-GPU jobs), since a job on more
    GPUs finishes sooner but loads the model once per GPU and waits for its slowest rank. On the
    CPU: one process per job unless asked, as many jobs as the CPUs allow."""
    import torch

    gpus = torch.cuda.device_count()
    if gpus:
        per = min(gpus, cfg.eval.benchmark_processes or max(1, gpus // max(1, models)))
        return [Slot(per, tuple(range(i * per, (i + 1) * per))) for i in range(gpus // per)]
    per = cfg.eval.benchmark_processes or 1
    return [Slot(per)] * max(1, available_cpus() // per)


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
    (lmms-eval's model over θ0 with the adapter merged in), or the constant answers."""
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


def identity(cfg: RunConfig, model: str, args: dict[str, Any], checkpoint: str, plan: TaskPlan) -> dict[str, Any]:
    """What a job's score depends on: the weights, the task's files (prompts, generation
    settings, hooks, local data; lmms-eval's own tasks through its version too), the model's
    settings, the judge, the example limit, the generation settings over the tasks', the seed.
    Never devices, processes or batch size."""
    judge = cfg.eval.judge if any(judge_style(t) for t in plan.tasks) else None
    return {
        "checkpoint_id": weights_id(checkpoint),
        "task": plan.name,
        "task_files": folder_digest(plan.folders),
        "model": model,
        "model_args": {k: v for k, v in args.items() if k not in ("pretrained", "adapter", "answers", "device_map")},
        "judge": judge.model_dump(include={"base_url", "model"}) if judge else None,
        "limit": cfg.eval.benchmark_limit,
        "gen_kwargs": cfg.eval.benchmark_gen_kwargs,
        "seed": cfg.run.seed,
        "lmms_eval": version("lmms_eval"),
    }


# --- one job ----------------------------------------------------------------------------------


class JobFailed(RuntimeError):
    """lmms-eval did not score the task: its error, or the time limit."""


def run_benchmark(
    cfg: RunConfig, run_dir: str | Path, model: str, checkpoint: str, task: str, slot: Slot = Slot()
) -> dict[str, Any]:
    """One job: ``task`` of ``model`` on ``slot``, its folder ``eval/benchmarks/<model>/<task>/``
    written whole; returns its ``score.json``. A current folder is returned without running."""
    run_dir = Path(run_dir).absolute()
    plan = task_plans(cfg, run_dir)[task]
    if Path(checkpoint).name == CONSTANTS:
        slot = Slot()  # constant answers: no model to load, nothing to share out
    device = "cuda" if slot.gpus else "cpu"
    lmms_model, args = model_args(cfg, str(checkpoint), device if slot.processes > 1 or not slot.gpus else "cuda:0")
    wanted = identity(cfg, lmms_model, args, str(checkpoint), plan)
    folder = benchmark_dir(run_dir, model) / task
    done = _read(folder / SCORE)
    if done and done["identity"] == wanted and "error" not in done:
        return done
    with staged_dir(folder) as out:
        argv = lmms_arguments(cfg, lmms_model, args, plan, device, out)
        redo = recorded_command(cfg, plan, lmms_arguments(cfg, lmms_model, args, plan, device, folder), slot)
        record = {"model": model, "task": task, "checkpoint": str(checkpoint), "identity": wanted, "command": redo}
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
        average = read_scores(run_dir, model, model_tasks(cfg, model))["average"]
        log_benchmarks(run_dir / EVAL / "tensorboard" / model / BENCHMARKS, {task: record["score"]["score"]}, average)
    return record


# lmms-eval models that take one request at a time (internvl_hf asserts it): eval.benchmark_batch_size
# is capped for them rather than refused, since a run mixing families shares one setting.
ONE_AT_A_TIME = {"merit_internvl"}


def lmms_arguments(
    cfg: RunConfig, model: str, args: dict[str, Any], plan: TaskPlan, device: str, out: Path
) -> list[str]:
    """The runner's options (lmms-eval's names) for one job writing into ``out``."""
    e = cfg.eval
    argv = ["--model", model, "--model_args", ",".join(f"{k}={v}" for k, v in args.items()), "--tasks", plan.name]
    argv += [f"--include_path={folder}" for folder in plan.folders]
    batch_size = 1 if model in ONE_AT_A_TIME else e.benchmark_batch_size
    argv += ["--batch_size", str(batch_size), "--device", device]
    argv += ["--limit", str(e.benchmark_limit)] if e.benchmark_limit else []
    argv += ["--gen_kwargs", gen_kwargs(cfg)] if e.benchmark_gen_kwargs else []
    return [*argv, "--seed", str(cfg.run.seed), "--output_path", str(out), "--log_samples"]


def gen_kwargs(cfg: RunConfig) -> str:
    """``eval.benchmark_gen_kwargs`` as lmms-eval's ``--gen_kwargs`` string."""
    return ",".join(f"{k}={v}" for k, v in cfg.eval.benchmark_gen_kwargs.items())


def _launcher(slot: Slot) -> list[str]:
    """How the runner starts: one process, or ``torchrun`` with a rank per GPU (CPU: per process)."""
    if slot.processes == 1:
        return ["-m", LMMS_RUN]
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={slot.processes}", "-m", LMMS_RUN]


def job_environment(cfg: RunConfig, plan: TaskPlan, checkpoint: str | None = None) -> dict[str, str]:
    """Offline datasets when the hub is offline; the judge's settings for a judged task (its
    lmms-eval module reads them when imported); the job's CPU threads (one for a model too small
    to split its operations, as :func:`pipeline.threads.fit_threads_to_model`); transformers' hub
    kernels only when ``model.use_kernels`` asks (lmms-eval loads the model itself)."""
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"} if offline() else {}
    env["USE_HUB_KERNELS"] = "YES" if cfg.model.use_kernels else "NO"
    style = next((judge_style(t) for t in plan.tasks if judge_style(t)), None)
    if style:
        env |= judge_environment(cfg.eval.judge, style)
    if checkpoint is not None:
        weights = sum(f.stat().st_size for f in Path(checkpoint).glob("*.safetensors"))
        threads = 1 if weights < 4 * SMALL_MODEL else threads_per_process()
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", str(threads))
    return env


def recorded_command(cfg: RunConfig, plan: TaskPlan, argv: list[str], slot: Slot) -> str:
    """The shell command that redoes a job (``argv`` writing into its folder): the environment it
    needs (the judge's key by reference, never its value), then the runner as the job started it."""
    env = {k: shlex.quote(v) for k, v in job_environment(cfg, plan).items()}
    if "OPENAI_API_KEY" in env:
        env["OPENAI_API_KEY"] = f'"${cfg.eval.judge.api_key_env}"'
    folder = argv[argv.index("--output_path") + 1]
    runner = shlex.join(["python", *_launcher(slot), *argv])
    return f"cd {shlex.quote(folder)} && " + " ".join([*(f"{k}={v}" for k, v in env.items()), runner])


def _evaluate(cfg: RunConfig, plan: TaskPlan, argv: list[str], slot: Slot, checkpoint: str, out: Path) -> None:
    """Run lmms-eval for one job in ``out`` (its working folder, where stray files land too)."""
    env = os.environ | job_environment(cfg, plan, checkpoint)
    if slot.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slot.gpus))
    with (out / LOG).open("a") as log:
        if slot.processes == 1 and prestart.usable():  # a fork of a process that imported lmms-eval
            proc = prestart.start(LMMS_RUN, argv, env, preload=LMMS_PRELOAD, stdout=log.fileno(), cwd=str(out))
        else:
            command = [sys.executable, *_launcher(slot), *argv]
            proc = subprocess.Popen(command, stdout=log, stderr=log, env=env, cwd=out, start_new_session=True)
        try:
            code = proc.wait(timeout=cfg.eval.benchmark_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the job and its ranks (a session of their own)
            proc.wait()
            raise JobFailed(f"ran past eval.benchmark_timeout_s ({cfg.eval.benchmark_timeout_s} s)") from None
    if code != 0:
        raise JobFailed(f"lmms-eval failed (exit code {code})")


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
    run_dir: str | Path, model: str, tasks: list[str], checkpoint: str | None = None
) -> dict[str, Any] | None:
    """A model's jobs as their folders hold them (with ``checkpoint``, those of the weights it has
    now): scored tasks, failed tasks, and the average of the scores when every task has one (None
    otherwise: an average of some tasks would compare models on different benchmarks). None when
    no job of the model ran."""
    current = weights_id(checkpoint) if checkpoint and Path(checkpoint).exists() else None
    records = {t: r for t in tasks if (r := _read(benchmark_dir(run_dir, model) / t / SCORE))}
    records = {t: r for t, r in records.items() if current in (None, r["identity"]["checkpoint_id"])}
    if not records:
        return None
    scored = {t: r for t, r in records.items() if "score" in r}
    failed = {t: r for t, r in records.items() if "error" in r}
    return {
        "model": model,
        "tasks": {t: {**r["score"], "checkpoint_id": r["identity"]["checkpoint_id"]} for t, r in scored.items()},
        "judge_failures": {t: r["judge_failures"] for t, r in scored.items() if r.get("judge_failures") is not None},
        "failed": {t: {"error": r["error"], "log_tail": r.get("log_tail", [])} for t, r in failed.items()},
        "average": mean(r["score"]["score"] for r in scored.values()) if len(scored) == len(tasks) else None,
    }
