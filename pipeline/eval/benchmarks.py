"""Benchmarks none of the models trained on, run by lmms-eval on every model of a run: how the
MERIT paper judges a merge (SeedBench, MMBench, LLaVA-W, MM-Vet, TextVQA, AI2D, MathVista,
MMMU), and how users judge a model.

Each model is evaluated by lmms-eval's own ``qwen2_5_vl`` model (a LoRA adapter by the same
model with the adapter merged in, registered with lmms-eval as ``merit_qwen2_5_vl``), tasks,
prompts and metrics, in a process of its own (:mod:`pipeline.eval.lmms_run`); its results file and logged samples stay
as lmms-eval wrote them under ``eval/benchmarks/<model>/``, beside ``scores.json``: each task's
headline metric, on the paper's 0–100 scale, and what the figures depend on (reused while the
weights, the tasks and the judge are unchanged). Real tasks read their data from the Hugging
Face cache; the built-in corpus's ``toy_*`` tasks from the files ``prepare`` wrote
(:mod:`pipeline.data.benchmark`). Tasks scored by a judge model get it from ``eval.judge``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from statistics import mean
from typing import Any

from pipeline import prestart
from pipeline.checkpoint import checkpoint_id, staged_dir, write_json_atomic
from pipeline.config import JudgeSection, RunConfig
from pipeline.data.benchmark import MARKER, TASKS_DIR, is_toy_task, toy_tasks
from pipeline.hub import datasets_cache, hub_cache, offline
from pipeline.layout import EVAL
from pipeline.models.adapter import adapter_base, is_adapter
from pipeline.tensorboard import log_benchmarks
from pipeline.threads import SMALL_MODEL, threads_per_process

BENCHMARKS = "benchmarks"  # eval/benchmarks/<model>/
SCORES = "scores.json"
LOG = "lmms_eval.log"
LMMS_MODEL = "qwen2_5_vl"
LMMS_RUN = "pipeline.eval.lmms_run"
# What an evaluation imports before its first model call (lmms-eval itself, its Qwen2.5-VL model
# classes, ours over an adapter): imported once by a prestart server on a CPU machine (pipeline.prestart).
LMMS_PRELOAD = [LMMS_RUN, "lmms_eval.models.chat.qwen2_5_vl", "lmms_eval.models.simple.qwen2_5_vl"]
LMMS_PRELOAD += ["pipeline.eval.lmms_adapted"]
ADAPTED_MODEL = "merit_qwen2_5_vl"  # the same over θ0 + a LoRA adapter (pipeline.eval.lmms_plugin)
# Tasks scored by a judge model (by name prefix), and how their lmms-eval code reads the judge's
# OPENAI_API_URL: lmms-eval's llm_judge providers take the API's base URL (…/v1), MMBench's
# answer matcher (used for answers its rules cannot parse) the chat-completions endpoint itself.
JUDGED = {"llava_in_the_wild": "base", "mmvet": "base", "mathvista": "base", "mmbench": "endpoint"}
# Metrics lmms-eval reports as fractions; shown ×100, on the paper's scale (the judged ones are %).
FRACTIONS = {"accuracy", "token_f1", "exact_match", "mmmu_acc", "seed_all", "seed_image", "seed_video"}


def benchmarked(cfg: RunConfig, model: str) -> bool:
    """Whether a model of the run gets the benchmarks: every one but the branches, unless asked."""
    branch = model.startswith("branch-")
    return bool(cfg.eval.benchmarks) and (not branch or (cfg.eval.benchmark_branches and cfg.eval.branches))


def judge_style(task: str) -> str | None:
    """How a judged task reads the judge's URL (``base`` or ``endpoint``); None: no judge."""
    return next((style for prefix, style in JUDGED.items() if task.startswith(prefix)), None)


def check_benchmarks(cfg: RunConfig) -> str:
    """What would fail only when the benchmarks run, after hours of training: a judged task
    without a judge (or its key), a task lmms-eval does not know, a task whose data is not in the
    Hugging Face cache (with the command that fetches it). The built-in toy tasks are written by
    ``prepare``. Raises ValueError naming every problem."""
    tasks, judge = cfg.eval.benchmarks, cfg.eval.judge
    judged = [t for t in tasks if judge_style(t)]
    problems = []
    if judged and judge is None:
        problems.append(
            f"{judged} are scored by a judge model: set eval.judge (base_url, model, api_key_env) "
            "to an OpenAI-compatible server, e.g. a local vLLM, or leave these tasks out"
        )
    elif judged and not os.environ.get(judge.api_key_env):
        problems.append(f"{judged} need the judge's key in ${judge.api_key_env}, which is not set")
    real = [t for t in tasks if not is_toy_task(t)]
    if real:
        problems += _task_data_problems(real, cfg.eval.include_path)
    if problems:
        raise ValueError("; ".join(problems))
    return ", ".join(tasks) or "none"


def _task_data_problems(tasks: list[str], include_path: list[str]) -> list[str]:
    from lmms_eval.tasks import TaskManager
    from loguru import logger  # lmms-eval's logger: its task index logs every file it skips

    logger.disable("lmms_eval")
    try:
        manager = TaskManager(include_path=include_path or None)
    finally:
        logger.enable("lmms_eval")
    problems = []
    for task in tasks:
        if task not in manager.task_index:
            problems.append(f"lmms-eval has no task '{task}' (a task of your own: its YAML under eval.include_path)")
            continue
        for dataset in _datasets(manager, task):
            if not _cached(dataset):
                problems.append(
                    f"task '{task}': its data {dataset} is not in the Hugging Face cache {hub_cache()} "
                    "and HF_HUB_OFFLINE is set; "
                    f"fetch it first: hf download {dataset} --repo-type dataset"
                )
    return problems


def _datasets(manager: Any, task: str) -> list[str]:
    """The hub datasets a task (or each task of a group) reads; local ones need no download."""
    from lmms_eval.utils import load_yaml_config

    config = load_yaml_config(manager.task_index[task]["yaml_path"], mode="simple")
    if manager.task_index[task]["type"] != "task":
        return [d for sub in config.get("task", []) if isinstance(sub, str) for d in _datasets(manager, sub)]
    path = config.get("dataset_path")
    local = path is None or path in ("json", "csv", "parquet", "text", "arrow") or Path(path).exists()
    return [] if local else [path]


def _cached(dataset: str) -> bool:
    """A dataset repository in the hub cache, or built by ``datasets`` in its own cache; online,
    lmms-eval downloads what is missing."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    if not offline() or (datasets_cache() / dataset.replace("/", "___")).is_dir():
        return True
    try:
        snapshot_download(dataset, repo_type="dataset", cache_dir=hub_cache(), local_files_only=True)
    except LocalEntryNotFoundError:
        return False
    return True


def benchmark_dir(run_dir: str | Path, model: str) -> Path:
    return Path(run_dir) / EVAL / BENCHMARKS / model


def read_scores(run_dir: str | Path, model: str) -> dict[str, Any] | None:
    path = benchmark_dir(run_dir, model) / SCORES
    return json.loads(path.read_text()) if path.is_file() else None


def identity(cfg: RunConfig, run_dir: str | Path, checkpoint: str) -> dict[str, Any]:
    """What the scores depend on: the weights, the tasks (for toy tasks, the files they were
    written from), the judge, the example limit and lmms-eval's version; never device or batch."""
    marker = Path(run_dir) / TASKS_DIR / MARKER
    judge = cfg.eval.judge.model_dump(exclude={"api_key_env"}) if cfg.eval.judge else None
    return {
        "checkpoint_id": checkpoint_id(checkpoint),
        "tasks": cfg.eval.benchmarks,
        "toy_tasks": json.loads(marker.read_text()) if toy_tasks(cfg) and marker.is_file() else None,
        "judge": judge,
        "limit": cfg.eval.benchmark_limit,
        "lmms_eval": version("lmms_eval"),
    }


def run_benchmarks(
    cfg: RunConfig, run_dir: str | Path, model: str, checkpoint: str, force: bool = False
) -> dict[str, Any]:
    """Evaluate one model on ``eval.benchmarks`` (every task, lmms-eval's files kept) and write
    ``eval/benchmarks/<model>/``; an up-to-date result is returned without running anything."""
    run_dir, wanted = Path(run_dir).absolute(), identity(cfg, run_dir, checkpoint)
    cached = read_scores(run_dir, model)
    if cached and cached["identity"] == wanted and not force:
        return cached
    folder = benchmark_dir(run_dir, model)
    with staged_dir(folder) as tmp:
        commands = [_evaluate(cfg, run_dir, checkpoint, tasks, env, tmp, folder) for tasks, env in _invocations(cfg)]
        result = {
            "model": model,
            "checkpoint": str(checkpoint),
            "identity": wanted,
            "tasks": scores_of(_results(tmp), cfg.eval.benchmarks),
            "commands": commands,
        }
        result["average"] = mean(t["score"] for t in result["tasks"].values())
        write_json_atomic(tmp / SCORES, result)
    log_benchmarks(run_dir / EVAL / "tensorboard" / model / BENCHMARKS, result)
    return result


def _invocations(cfg: RunConfig) -> list[tuple[list[str], dict[str, str]]]:
    """The lmms-eval processes one model needs: one, unless judged tasks read the judge's URL in
    two ways (the environment is read when a task's module is imported)."""
    by_style: dict[str, list[str]] = {}
    for task in cfg.eval.benchmarks:
        by_style.setdefault(judge_style(task) or "base", []).append(task)
    return [(tasks, judge_environment(cfg.eval.judge, style)) for style, tasks in by_style.items()]


def judge_environment(judge: JudgeSection | None, style: str) -> dict[str, str]:
    """lmms-eval's judge settings (its tasks read them from the environment)."""
    if judge is None:
        return {}
    url = judge.base_url.rstrip("/")
    return {
        "API_TYPE": "openai",
        "MODEL_VERSION": judge.model,
        "OPENAI_API_URL": url + "/chat/completions" if style == "endpoint" else url,
        "OPENAI_API_KEY": os.environ.get(judge.api_key_env, ""),
    }


def run_spec(cfg: RunConfig, run_dir: Path, checkpoint: str, tasks: list[str], out: Path) -> dict[str, Any]:
    """The arguments of one lmms-eval evaluation (:mod:`pipeline.eval.lmms_run`)."""
    from pipeline.eval.heldout import eval_device

    device = eval_device(cfg)
    m = cfg.model
    # A LoRA adapter: lmms-eval's model over θ0 with the adapter merged in (pipeline.eval.lmms_adapted).
    adapter = {"pretrained": adapter_base(checkpoint), "adapter": str(checkpoint)} if is_adapter(checkpoint) else None
    model_args = {
        **(adapter or {"pretrained": str(checkpoint)}),
        "min_pixels": m.min_pixels,
        "max_pixels": m.max_pixels,
        "device_map": device,
        "attn_implementation": m.attn_implementation,
    }
    if any("," in str(v) or "=" in str(v) for v in model_args.values()):
        raise ValueError(f"lmms-eval's model_args cannot hold ',' or '=': {model_args}")
    folders = [str(run_dir / TASKS_DIR)] if toy_tasks(cfg) else []
    folders += [str(Path(p).absolute()) for p in cfg.eval.include_path]
    return {
        "model": ADAPTED_MODEL if adapter else LMMS_MODEL,
        "model_args": ",".join(f"{k}={v}" for k, v in model_args.items()),
        "tasks": tasks,
        "include_path": folders,
        "include_defaults": not all(is_toy_task(t) for t in tasks),
        "batch_size": cfg.eval.benchmark_batch_size,
        "device": device,
        "limit": cfg.eval.benchmark_limit,
        "seed": cfg.run.seed,
        "output_path": str(out),
    }


def cli_command(spec: dict[str, Any]) -> str:
    """The same evaluation as ``python -m lmms_eval`` would run it, for the record."""
    args = ["python", "-m", "lmms_eval", "--model", spec["model"], "--model_args", spec["model_args"]]
    args += ["--tasks", ",".join(spec["tasks"]), "--batch_size", str(spec["batch_size"]), "--device", spec["device"]]
    args += [f"--include_path={p}" for p in spec["include_path"]]
    args += ["--limit", str(spec["limit"])] if spec["limit"] else []
    args += ["--seed", str(spec["seed"]), "--output_path", spec["output_path"], "--log_samples"]
    return shlex.join(args)


def _evaluate(
    cfg: RunConfig, run_dir: Path, checkpoint: str, tasks: list[str], env: dict[str, str], out: Path, final: Path
) -> str:
    """One lmms-eval process writing into ``out`` (renamed ``final`` once whole); returns the
    ``python -m lmms_eval`` command that does the same."""
    spec = run_spec(cfg, run_dir, checkpoint, tasks, out)
    spec_path = out / f"spec-{len(list(out.glob('spec-*.json')))}.json"
    write_json_atomic(spec_path, spec)
    env = os.environ | _process_environment(checkpoint) | env
    with (out / LOG).open("a") as log:
        if prestart.usable():  # a fork of a process that imported lmms-eval
            proc = prestart.start(LMMS_RUN, [str(spec_path)], env, preload=LMMS_PRELOAD, stdout=log.fileno())
        else:
            proc = subprocess.Popen([sys.executable, "-m", LMMS_RUN, str(spec_path)], stdout=log, stderr=log, env=env)
        try:
            code = proc.wait(timeout=cfg.eval.benchmark_timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"lmms-eval on {checkpoint} ran past eval.benchmark_timeout_s") from None
    if code != 0:
        tail = (out / LOG).read_text().splitlines()[-15:]
        raise RuntimeError(f"lmms-eval on {checkpoint} failed (exit code {code}); its log ends:\n" + "\n".join(tail))
    return cli_command(spec | {"output_path": str(final)})


def _process_environment(checkpoint: str) -> dict[str, str]:
    """Offline datasets when the hub is offline; the evaluation's CPU threads (one for a model
    too small to split its operations, as in :func:`pipeline.threads.fit_threads_to_model`)."""
    env = {"HF_DATASETS_OFFLINE": "1"} if offline() else {}
    weights = sum(f.stat().st_size for f in Path(checkpoint).glob("*.safetensors"))
    threads = 1 if weights < 4 * SMALL_MODEL else threads_per_process()
    return env | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}


def _results(out: Path) -> dict[str, Any]:
    """The results files lmms-eval wrote under ``out`` (one per process), merged."""
    merged: dict[str, Any] = {"results": {}, "groups": {}, "higher_is_better": {}, "n-samples": {}}
    files = sorted(out.rglob("*_results.json"))
    if not files:
        raise RuntimeError(f"lmms-eval wrote no results file under {out}")
    for file in files:
        data = json.loads(file.read_text())
        for key in merged:
            merged[key] |= data.get(key, {})
    return merged


def scores_of(results: dict[str, Any], tasks: list[str]) -> dict[str, dict[str, Any]]:
    """Each task's headline metric (the first its config lists that lmms-eval reported), its value
    as lmms-eval reports it and its score on the paper's 0–100 scale; a group's own aggregate."""
    scores = {}
    for task in tasks:
        entry = results["groups"].get(task) or results["results"].get(task)
        if entry is None:
            raise RuntimeError(f"lmms-eval reported nothing for task '{task}'")
        reported = {key: v for key, v in entry.items() if "," in key and "_stderr" not in key}
        order = list(results["higher_is_better"].get(task, {})) + [key.split(",")[0] for key in reported]
        key = next((k for m in order for k in reported if k.split(",")[0] == m and _number(reported[k])), None)
        if key is None:
            raise RuntimeError(f"lmms-eval reported no numeric metric for task '{task}': {sorted(entry)}")
        metric, value = key.split(",")[0], float(reported[key])
        scores[task] = {
            "metric": key,
            "value": value,
            "score": 100 * value if metric in FRACTIONS else value,
            "examples": results["n-samples"].get(task, {}).get("effective"),
        }
    return scores


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
