"""lmms-eval's tasks as the benchmark stage reads them, before and after they run: where a task's
files are, whether it is a group, which hub datasets it reads, and its headline metric (the one
number the report shows for it, on the paper's 0–100 scale).

The headline of each of the MERIT paper's eight benchmarks is named in :data:`HEADLINES`, never
guessed: lmms-eval reports several metrics for most tasks (SEED-Bench image, video and all; LLaVA-W
overall and per category), and a report that takes "the first number it finds" shows another
benchmark's figure when the headline is missing. A task of one's own is scored by the first metric
of its ``metric_list`` unless ``eval.benchmark_metrics`` names another.

Scale: lmms-eval reports some metrics as fractions (SEED-Bench's accuracy, 0.7) and others in
percent (MM-Vet, 70.0). Outside the table, the scale is read from the metric itself
(:func:`detected_scale`): the task's own aggregation run on its logged answers one at a time gives
at most 1 for a fraction and up to 100 for a percentage, whatever the metric is called.

Groups: lmms-eval reports a group's aggregate only when its YAML has an ``aggregate_metric_list``
(and writes ``{" ": " ", "alias": …}`` for the group otherwise, as for ``mathvista_testmini``); a
group without one is scored here as the mean of its subtasks' headline scores weighted by their
numbers of examples, and the report says so.
"""

from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# This project's lmms-eval models and the lmms-eval model whose prompts they answer (a task's
# ``lmms_eval_specific_kwargs`` key): merit_qwen3_vl gets a task's qwen3_vl prompts.
PROMPTS_OF = {"merit_qwen2_5_vl": "qwen2_5_vl", "merit_qwen3_vl": "qwen3_vl", "merit_internvl": "internvl_hf"}
# How a task's code asks a judge model in lmms-eval 0.7.3 (21 task folders do).
JUDGE_CLIENT = re.compile(r"\bllm_judge\b|\bget_server\(")
# Local dataset builders: a task reading one of these (or a folder) needs no download.
LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "imagefolder"}


@dataclass(frozen=True)
class Headline:
    """A task's headline metric, the factor that puts lmms-eval's value on the 0–100 scale (None:
    read from the metric, :func:`detected_scale`), and whether lmms-eval's aggregate returns None
    for a score of zero (MathVista's does)."""

    metric: str
    scale: float | None = 1.0
    none_is_zero: bool = False


# The paper's eight benchmarks (Table 2) as lmms-eval 0.7.3 names them. Why these metrics:
# SEED-Bench: its image questions (the models are fine-tuned on images; the LLaVA line reports
# SEED-image); MathVista: testmini with lmms-eval's format prompt, the variant its single
# `mathvista_testmini` task ran before lmms-eval made that name a group of three prompt variants.
HEADLINES: dict[str, Headline] = {
    "seedbench": Headline("seed_image", 100.0),
    "mmbench_en_dev": Headline("gpt_eval_score"),
    "ai2d": Headline("exact_match", 100.0),
    "textvqa_val": Headline("exact_match", 100.0),
    "mmmu_val": Headline("mmmu_acc", 100.0),
    "mathvista_testmini_format": Headline("llm_as_judge_eval", none_is_zero=True),
    "mathvista_testmini_cot": Headline("llm_as_judge_eval", none_is_zero=True),
    "mathvista_testmini_solution": Headline("llm_as_judge_eval", none_is_zero=True),
    "llava_in_the_wild": Headline("gpt_eval_llava_all"),
    "mmvet": Headline("gpt_eval_score"),
}
# Metrics read as fractions where the aggregation cannot be run on single answers (a judged task's,
# which would call the judge); the others are taken as they are.
FRACTIONS = {"accuracy", "acc", "exact_match", "anls", "relaxed_accuracy", "token_f1"}
SCALE_PROBES = 64  # logged answers aggregated one at a time to read a metric's scale


@dataclass(frozen=True)
class TaskPlan:
    """One entry of ``eval.benchmarks`` as lmms-eval will run it: its folders (all lmms-eval indexes
    for it), the hub datasets it reads, its headline (a task, or a group with an aggregate) or its
    parts' headlines (a group without one), and a group's tasks."""

    name: str
    folders: tuple[str, ...]
    datasets: tuple[str, ...]
    headline: Headline | None
    parts: dict[str, Headline] = field(default_factory=dict)
    members: tuple[str, ...] = ()
    yamls: dict[str, str] = field(default_factory=dict)  # each task's YAML file
    max_new_tokens: int | None = None  # the most its tasks' own generation settings allow
    sampled: bool = False  # whether a task's own generation settings sample (temperature > 0)
    calls_judge: bool = False  # whether its code asks a judge model (lmms-eval's llm_judge)

    @property
    def tasks(self) -> list[str]:
        """The tasks lmms-eval runs: the task, or the group's."""
        return list(self.members) or [self.name]


def prompts_of(model: str) -> str:
    """The model name whose prompts a task gives ``model``."""
    return PROMPTS_OF.get(model, model)


_index_lock = threading.Lock()
_indexes: dict[tuple[str | bool, ...], Any] = {}


def task_index(include_path: list[str], defaults: bool = True) -> Any:
    """lmms-eval's TaskManager over ``include_path`` and (``defaults``) its own tasks; built once
    per process (its ~2,000 task files take seconds to index)."""
    key = (*include_path, defaults)
    with _index_lock:
        if key not in _indexes:
            from lmms_eval.tasks import TaskManager
            from loguru import logger  # lmms-eval's logger: its index logs every file it skips

            logger.disable("lmms_eval")
            try:
                _indexes[key] = TaskManager(include_path=include_path or None, include_defaults=defaults)
            finally:
                logger.enable("lmms_eval")
        return _indexes[key]


def plan_tasks(
    names: list[str], include_path: list[str], metrics: dict[str, str], defaults: bool = True
) -> dict[str, TaskPlan]:
    """The plan of every task named, found in ``include_path`` and (``defaults``) lmms-eval's own
    tasks; a ValueError naming every task that cannot be run or scored."""
    plans, problems = plans_and_problems(names, include_path, metrics, defaults)
    if problems:
        raise ValueError("; ".join(problems))
    return plans


def plans_and_problems(
    names: list[str], include_path: list[str], metrics: dict[str, str], defaults: bool = True
) -> tuple[dict[str, TaskPlan], list[str]]:
    """The plans of the tasks that can be run and scored, and a line for each that cannot."""
    manager = task_index(include_path, defaults)
    plans, problems = {}, []
    for name in names:
        try:
            plans[name] = _plan(manager, name, metrics)
        except ValueError as err:
            problems.append(str(err))
    return plans, problems


def _plan(manager: Any, name: str, metrics: dict[str, str]) -> TaskPlan:
    entry = manager.task_index.get(name)
    if entry is None:
        raise ValueError(f"lmms-eval has no task '{name}' (a task of your own: its YAML under eval.include_path)")
    config = _config(entry["yaml_path"])
    if entry["type"] != "group":
        headline = _headline(name, config, metrics)
        return TaskPlan(name, (_folder(entry),), _datasets(config), headline, **_generation({name: entry}, [config]))
    subtasks = [t if isinstance(t, str) else t.get("task") for t in config.get("task", [])]
    if not subtasks or not all(isinstance(t, str) and manager.task_index.get(t) for t in subtasks):
        raise ValueError(f"group '{name}': its tasks {subtasks} are not all tasks lmms-eval knows")
    if any(manager.task_index[t]["type"] == "group" for t in subtasks):
        raise ValueError(f"group '{name}' holds groups: name its tasks in eval.benchmarks instead")
    configs = {t: _config(manager.task_index[t]["yaml_path"]) for t in subtasks}
    generation = _generation({t: manager.task_index[t] for t in subtasks}, list(configs.values()))
    folders = tuple(dict.fromkeys([_folder(entry), *(_folder(manager.task_index[t]) for t in subtasks)]))
    datasets = tuple(dict.fromkeys(d for c in configs.values() for d in _datasets(c)))
    aggregates = [m["metric"] for m in config.get("aggregate_metric_list") or [] if "metric" in m]
    if aggregates:
        metric = metrics.get(name, aggregates[0])
        if metric not in aggregates:
            raise ValueError(f"group '{name}' aggregates {aggregates}, not '{metric}' (eval.benchmark_metrics)")
        return TaskPlan(name, folders, datasets, Headline(metric, None), members=tuple(subtasks), **generation)
    parts = {t: _headline(t, c, metrics) for t, c in configs.items()}
    return TaskPlan(name, folders, datasets, None, parts, tuple(subtasks), **generation)


def _generation(entries: dict[str, dict[str, Any]], configs: list[dict[str, Any]]) -> dict[str, Any]:
    """A plan's YAML files and what its tasks' own generation settings allow."""
    settings = [c.get("generation_kwargs") or {} for c in configs]
    caps = [g["max_new_tokens"] for g in settings if isinstance(g.get("max_new_tokens"), int)]
    sampled = any(float(g.get("temperature") or 0) > 0 or g.get("do_sample") is True for g in settings)
    yamls = {t: e["yaml_path"] for t, e in entries.items()}
    code = [f for y in yamls.values() for f in Path(y).parent.glob("*.py")]
    calls_judge = any(JUDGE_CLIENT.search(f.read_text(errors="replace")) for f in code)
    return {
        "yamls": yamls,
        "max_new_tokens": max(caps) if caps else None,
        "sampled": sampled,
        "calls_judge": calls_judge,
    }


def _config(yaml_path: str) -> dict[str, Any]:
    from lmms_eval.utils import load_yaml_config

    return load_yaml_config(yaml_path, mode="simple")


def _folder(entry: dict[str, Any]) -> str:
    return str(Path(entry["yaml_path"]).parent)


def _datasets(config: dict[str, Any]) -> tuple[str, ...]:
    """The hub dataset a task reads; none for local data."""
    path = config.get("dataset_path")
    local = path is None or path in LOCAL_BUILDERS or Path(path).exists()
    return () if local else (path,)


def _headline(task: str, config: dict[str, Any], metrics: dict[str, str]) -> Headline:
    listed = [m["metric"] for m in config.get("metric_list") or [] if isinstance(m.get("metric"), str)]
    known = HEADLINES.get(task)
    metric = metrics.get(task) or (known.metric if known else listed[0] if listed else None)
    if metric is None or metric not in listed:
        raise ValueError(f"task '{task}': no headline metric among its metrics {listed} (eval.benchmark_metrics)")
    if known and known.metric == metric:
        return known
    return Headline(metric, None)


def folder_digest(folders: tuple[str, ...]) -> str:
    """The hash of every file of a task's folders (its YAMLs, hooks and local data): what a task
    is, beyond lmms-eval's version, for a task of one's own or a toy task rewritten."""
    digest = hashlib.sha256()
    for folder in folders:
        for file in sorted(p for p in Path(folder).iterdir() if p.is_file() and p.suffix != ".pyc"):
            digest.update(file.name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


# --- scoring what lmms-eval reported -----------------------------------------------------


def score(plan: TaskPlan, results: dict[str, Any], samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The task's headline value as lmms-eval reports it, its score on 0–100 and the examples
    scored; for a group without an aggregate, each part's and their size-weighted mean. A
    ValueError names the task and the metric that has no value."""
    if plan.headline is not None:
        table = "groups" if plan.name in results.get("groups", {}) else "results"  # a group's own aggregate
        value, key = _value(plan.name, plan.headline, results[table].get(plan.name, {}), samples)
        examples = sum(_examples(results, t) or 0 for t in plan.tasks)
        scale = _scale(plan, plan.tasks[0], plan.headline, samples)
        return {"metric": key, "value": value, "scale": scale, "score": value * scale, "examples": examples}
    parts = {}
    for task, headline in plan.parts.items():
        value, key = _value(task, headline, results["results"].get(task, {}), samples)
        examples, scale = _examples(results, task), _scale(plan, task, headline, samples)
        parts[task] = {"metric": key, "value": value, "scale": scale, "score": value * scale, "examples": examples}
    examples = sum(p["examples"] for p in parts.values())
    mean = sum(p["score"] * p["examples"] for p in parts.values()) / examples
    return {"metric": "size-weighted mean of its tasks", "score": mean, "examples": examples, "parts": parts}


def _value(task: str, headline: Headline, entry: dict[str, Any], samples: dict[str, list]) -> tuple[float, str]:
    keys = [k for k in entry if k.split(",")[0] == headline.metric and "," in k]
    if not keys:
        raise ValueError(f"lmms-eval reported no '{headline.metric}' for task '{task}' (it reported {sorted(entry)})")
    if len(keys) > 1:  # one metric under several filters: the unfiltered one, else say which
        keys = [k for k in keys if k.endswith(",none")] or keys
        if len(keys) > 1:
            raise ValueError(f"task '{task}': '{headline.metric}' is reported under several filters {keys}")
    value = entry[keys[0]]
    if value is None and headline.none_is_zero and _all_wrong(samples.get(task, []), headline.metric):
        value = 0.0  # lmms-eval's aggregate returns None for zero correct answers; the samples say zero
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"task '{task}': its headline metric '{keys[0]}' has no value ({value!r})")
    return float(value), keys[0]


def _all_wrong(samples: list[dict[str, Any]], metric: str) -> bool:
    return bool(samples) and all(not (s.get(metric) or {}).get("true_false", True) for s in samples)


def _examples(results: dict[str, Any], task: str) -> int | None:
    return (results.get("n-samples", {}).get(task) or {}).get("effective")


def _scale(plan: TaskPlan, task: str, headline: Headline, samples: dict[str, list[dict[str, Any]]]) -> float:
    if headline.scale is not None:
        return headline.scale
    from pipeline.eval.judge import judge_style

    if not judge_style(task):  # a judged task's aggregation may call the judge: never run here
        try:
            return detected_scale(plan.yamls[task], headline.metric, samples.get(task, []))
        except TypeError:  # an aggregation that needs more than the answers (lmms-eval's args)
            pass
    return 100.0 if headline.metric in FRACTIONS else 1.0


def detected_scale(yaml_path: str, metric: str, samples: list[dict[str, Any]]) -> float:
    """100 for a metric lmms-eval reports as a fraction, 1 for one in percent: the task's own
    aggregation of single logged answers is at most 1 in the first case, and reaches above 1 for
    any answer that scores in the second. When every answer scored 0 the score is 0 on either
    scale (100 is returned)."""
    import lmms_eval.api.metrics  # noqa: F401  (registers lmms-eval's named aggregations)
    from lmms_eval.api.registry import get_aggregation
    from lmms_eval.utils import load_yaml_config

    config = load_yaml_config(yaml_path, mode="full")
    entry = next((m for m in config.get("metric_list") or [] if m.get("metric") == metric), {})
    aggregate = entry.get("aggregation", "mean")
    aggregate = get_aggregation(aggregate) if isinstance(aggregate, str) else aggregate
    values = [s[metric] for s in samples if metric in s][:SCALE_PROBES]
    if aggregate is None or not values:
        raise ValueError(f"{yaml_path}: the scale of '{metric}' cannot be read: no aggregation or no logged values")
    singles = [aggregate([value]) for value in values]
    return 1.0 if any(isinstance(v, int | float) and v > 1 for v in singles) else 100.0
