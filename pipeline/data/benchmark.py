"""The built-in corpus's benchmark suite: tasks shaped like the MERIT paper's benchmarks, never
fine-tuned on, that lmms-eval runs like any real task: ``prepare`` writes them as task files (a
YAML file and the data per task), and their hooks are :mod:`pipeline.eval.toy_hooks`.

Each task stands in for one or two of the paper's benchmarks, in the shape lmms-eval gives them,
and is scored the way its kind is scored there (:mod:`pipeline.eval.scoring`):

- ``toy_perception`` (SeedBench, MMBench): one shape; its colour, kind or place, as a
  multiple-choice question of four options answered by a letter; accuracy.
- ``toy_diagram`` (AI2D): two shapes of different sizes; a relation between them (the colour of
  the bigger one, the kind on one side), four options; accuracy.
- ``toy_reading`` (TextVQA): the word on a coloured sign, asked in TextVQA's words; exact match.
- ``toy_reasoning`` (MathVista, MMMU): a group of two prompt variants of one question set, as
  MathVista testmini is in lmms-eval, without an aggregate of its own: ``toy_reasoning_direct``
  asks for the number of dots plus a number, ``toy_reasoning_steps`` to count first, then add;
  accuracy of the last integer of the answer.
- ``toy_chat`` (LLaVA-in-the-Wild): what is in the picture and where, answered in a sentence;
  the judge (``eval.judge``) rates the reference answer and the model's, and ``judge_score`` is
  100 × mean(answer's rating) / mean(reference's), as LLaVA-W's.

Each task's **constant baseline**, the best single answer to every question by the task's own
scoring, is written beside the task files (:data:`CONSTANTS`) and answered by lmms-eval's model
``merit_constant`` (:mod:`pipeline.eval.constant_model`), so that a report scores it as it scores
the models: a model beats it only with the skill. The right letters, words and sums cycle with
the question's index, so each is equally frequent. At the demo's sizes (seed 0, 200 questions a
task) the baselines are ``A``: 25 % on both multiple-choice tasks (no other letter or option text
does better), a word (``bell``; each scores 5 %) on ``toy_reading``, ``2``: 7.5 % on both
reasoning variants; ``toy_chat``'s is the reference answer with the highest mean token F1 against
all references ("The picture shows a purple square in its bottom half.", 0.73), which only the
judge scores.

θ0's warm-up (the toy's pre-training) teaches the skills the suite asks: ``skill_choice`` and
``skill_relation_choice`` answer multiple-choice questions about one shape and about two,
``skill_read_placed`` reads a word wherever it is, ``skill_count_add`` counts and adds. The suite
asks them in its own scenes and words: drawn in a namespace of its own (``benchmark/<task>``), by the
choice families and families of its own (:data:`~pipeline.data.builtin.BENCHMARK_FAMILIES`), every
shape outlined (:class:`~pipeline.data.builtin.OutlinedScene`) and every word on a sign, as no
suite draws them; ``toy_chat``'s reference is a sentence no source answers in. No benchmark image
is a fine-tuning or warm-up image, and no reference answer is written in a fine-tuning or warm-up
answer's template (the answer with its facts' words masked; a bare fact, a letter, word or number,
has none): ``tests/test_toy_suite.py`` checks both at the demo's sizes. What a model keeps of the
skills after fine-tuning is what the suite measures, as the paper's benchmarks measure what a
fine-tuned θ0 retains.
"""

from __future__ import annotations

import base64
import io
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pipeline.checkpoint import staged_dir, write_json_atomic
from pipeline.config import RunConfig
from pipeline.data.builtin import (
    BENCHMARK_FAMILIES,
    FAMILIES,
    LETTERS,
    Draw,
    OutlinedScene,
    Scene,
    Sign,
    choice_prompt,
)
from pipeline.eval.scoring import score, token_f1

WORD_PROMPT = "Answer the question using a single word or phrase."  # TextVQA's, in lmms-eval
DIGITS = "Answer with digits."


@dataclass(frozen=True)
class Task:
    """A toy benchmark task (or a group of prompt variants): the benchmarks it stands for, the
    family that draws its questions, how an answer is scored and what the reference answer is."""

    stands_for: str
    family: str
    scoring: str  # choice | exact | number (pipeline.eval.scoring) | judge (pipeline.eval.toy_hooks)
    reference: str  # the fact that is the answer (a multiple-choice question's: its letter)
    cue: str = "{question}"  # the question asked: "{question}" is the family's, other fields its facts
    variants: dict[str, str] = field(default_factory=dict)  # a group's subtasks and their cues


TASKS: dict[str, Task] = {
    "toy_perception": Task("SeedBench, MMBench", "choice", "choice", "letter"),
    "toy_diagram": Task("AI2D", "relation_choice", "choice", "letter"),
    "toy_reading": Task("TextVQA", "sign_word", "exact", "word", f"{{question}}\n{WORD_PROMPT}"),
    "toy_reasoning": Task(
        "MathVista, MMMU",
        "dots_plus",
        "number",
        "value",
        variants={
            "toy_reasoning_direct": f"{{question}} {DIGITS}",
            "toy_reasoning_steps": f"First count the dots in the image, then add {{extra}} to the count. {DIGITS}",
        },
    ),
    "toy_chat": Task("LLaVA-in-the-Wild", "scene_chat", "judge", "text"),
}
SUBTASKS = {subtask: group for group, spec in TASKS.items() for subtask in spec.variants}


@dataclass(frozen=True)
class Item:
    """One benchmark question: its image, the prompt, the reference answer, the options of a
    multiple-choice question (the answer is then a letter)."""

    scene: Scene | Sign
    question: str
    answer: str
    options: tuple[str, ...] = ()


def is_toy_task(task: str) -> bool:
    """A toy task, group or a group's subtask."""
    return task in TASKS or task in SUBTASKS


def leaf_tasks(tasks: list[str]) -> list[str]:
    """The tasks lmms-eval runs for these names: a group's subtasks in its place."""
    leaves = [leaf for task in tasks for leaf in (_variants(task) or [task])]
    return list(dict.fromkeys(leaves))


def _variants(task: str) -> list[str]:
    """A group's subtasks; none for a task."""
    return list(TASKS[task].variants) if task in TASKS else []


def items(task: str, examples: int, seed: int, image_size: int) -> list[Item]:
    """The ``examples`` questions of a toy task (not a group: one of its subtasks), deterministic
    by seed; a group's subtasks ask the same questions, each in its own words."""
    group = SUBTASKS.get(task, task)
    spec = TASKS.get(group)
    if spec is None or (spec.variants and task == group):
        raise ValueError(f"unknown built-in benchmark task '{task}'; known: {sorted(set(TASKS) | set(SUBTASKS))}")
    cue = spec.variants.get(task, spec.cue)
    return [
        _item(spec, cue, i, *_draw(spec.family, random.Random(f"{seed}/benchmark/{group}/{i}"), image_size, i))
        for i in range(examples)
    ]


def _draw(family: str, rng: random.Random, image_size: int, index: int) -> Draw:
    """A family's draw, its shapes outlined: no benchmark image is then a suite's."""
    if family in BENCHMARK_FAMILIES:
        scene, question, facts = BENCHMARK_FAMILIES[family](rng, image_size, index)
    else:
        scene, question, facts = FAMILIES[family](rng, image_size)
    if isinstance(scene, Scene):
        scene = OutlinedScene(scene.size, scene.shapes, scene.text)
    return scene, question, facts


def _item(spec: Task, cue: str, index: int, scene: Scene | Sign, question: str, facts: dict[str, Any]) -> Item:
    """A benchmark question; a multiple-choice one with its options turned so that the right one
    is letter ``index`` mod 4: every letter is right equally often, so answering one letter to
    everything scores chance exactly (the bias MMBench's circular evaluation removes)."""
    if "options" not in facts:
        return Item(scene, cue.format(question=question, **facts), str(facts[spec.reference]))
    options, at = facts["options"], index % len(LETTERS)
    shift = LETTERS.index(facts["letter"]) - at
    turned = options[shift:] + options[:shift]
    prompt = cue.format(question=choice_prompt(facts["stem"], turned), **facts)
    return Item(scene, prompt, LETTERS[at], tuple(turned))


# --- lmms-eval task files -------------------------------------------------------------------
TASKS_DIR = Path("data") / "benchmarks"  # under the run directory; lmms-eval runs with it as cwd
MARKER = "tasks.json"  # written last: the folder is whole and what it was written from
CONSTANTS = "constants.json"  # each task's constant baseline, answered by CONSTANT_MODEL
CONSTANT_MODEL = "merit_constant"  # lmms-eval's name of pipeline.eval.constant_model
STORED_MODEL = "merit_stored_answers"  # lmms-eval model: answers an earlier job logged, judged again
METRIC = {"choice": "accuracy", "exact": "accuracy", "number": "accuracy", "judge": "judge_score"}
# Generated per answer: a chat answer, or a sum with its working, is a sentence (the tiny
# tokenizer spells toy_chat's longest reference in 19 tokens).
MAX_NEW_TOKENS = 48
UTILS = '''"""lmms-eval hooks of the built-in toy benchmark tasks (written by `merit prepare`)."""

from pipeline.eval.toy_hooks import doc_to_text, doc_to_visual, judge_process_results, judge_score, process_results

__all__ = ["doc_to_text", "doc_to_visual", "judge_process_results", "judge_score", "process_results"]
'''
YAML = """# {stands_for}'s place in the built-in corpus's benchmark suite (written by `merit prepare`)
task: {task}
dataset_path: json
dataset_kwargs:
  data_files: {{test: {task}.jsonl}}
test_split: test
output_type: generate_until
doc_to_visual: !function utils.doc_to_visual
doc_to_text: !function utils.doc_to_text
doc_to_target: answer
generation_kwargs: {{max_new_tokens: {max_new_tokens}, temperature: 0, do_sample: false}}
{scored}metadata: {{version: 1.0}}
"""
SCORED_BY_RULE = """process_results: !function utils.process_results
metric_list:
  - {{metric: {metric}, aggregation: mean, higher_is_better: true}}
"""
SCORED_BY_JUDGE = """process_results: !function utils.judge_process_results
metric_list:
  - metric: judge_score
    aggregation: !function utils.judge_score
    higher_is_better: true
"""
# A group without aggregate_metric_list, as MathVista testmini: lmms-eval reports each subtask.
GROUP_YAML = """# {stands_for}'s place in the built-in corpus's benchmark suite (written by `merit prepare`)
group: {group}
task:
{subtasks}metadata: {{version: 1.0}}
"""


def toy_tasks(cfg: RunConfig) -> list[str]:
    """The toy tasks of the run: its benchmarks' and merge.search's dev tasks."""
    return [task for task in dict.fromkeys([*cfg.eval.benchmarks, *cfg.merge.search.tasks]) if is_toy_task(task)]


def write_tasks(cfg: RunConfig, run_dir: str | Path) -> Path | None:
    """The toy tasks that ``eval.benchmarks`` and ``merge.search.tasks`` name, as lmms-eval task files under
    ``run_dir/data/benchmarks/``: a YAML file and a JSON-lines file (images inline as base64
    PNG) per task, a YAML file per group, the ``utils.py`` their hooks come from and each task's
    constant baseline (:data:`CONSTANTS`). Kept while up to date."""
    tasks = toy_tasks(cfg)
    if not tasks:
        return None
    b, folder = cfg.data.builtin, Path(run_dir) / TASKS_DIR
    identity = {
        "version": 3,  # of the questions' design: 3, the suite that ranks models (constant baselines)
        "tasks": tasks,
        "seed": cfg.run.seed,
        "examples": b.benchmark_examples,
        "image_size": b.image_size,
    }
    marker = folder / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == identity:
        return folder
    with staged_dir(folder) as tmp:
        (tmp / "utils.py").write_text(UTILS)
        for group in (task for task in tasks if _variants(task)):
            subtasks = "".join(f"  - {subtask}\n" for subtask in _variants(group))
            (tmp / f"{group}.yaml").write_text(GROUP_YAML.format(group=group, subtasks=subtasks, **_about(group)))
        constants = {}
        for task in tqdm(leaf_tasks(tasks), desc="prepare: benchmark tasks", unit="task", leave=False):
            spec = TASKS[SUBTASKS.get(task, task)]
            scored = SCORED_BY_JUDGE if spec.scoring == "judge" else SCORED_BY_RULE.format(metric=METRIC[spec.scoring])
            text = YAML.format(task=task, scored=scored, max_new_tokens=MAX_NEW_TOKENS, **_about(task))
            (tmp / f"{task}.yaml").write_text(text)
            questions = items(task, b.benchmark_examples, cfg.run.seed, b.image_size)
            records = [_record(index, item, spec.scoring) for index, item in enumerate(questions)]
            (tmp / f"{task}.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
            constants[task] = constant_baseline(records)
        write_json_atomic(tmp / CONSTANTS, constants)
        write_json_atomic(tmp / MARKER, identity)
    return folder


def _about(task: str) -> dict[str, str]:
    return {"stands_for": TASKS[SUBTASKS.get(task, task)].stands_for}


def _record(index: int, item: Item, scoring: str) -> dict[str, Any]:
    png = io.BytesIO()
    item.scene().save(png, format="PNG")
    return {
        "id": index,
        "image": base64.b64encode(png.getvalue()).decode(),
        "question": item.question,
        "answer": item.answer,
        "options": list(item.options),
        "scoring": scoring,
        "metric": METRIC[scoring],
    }


def constant_candidates(records: list[dict[str, Any]]) -> list[str]:
    """The single answers a constant baseline is chosen from: every distinct reference answer, and
    of a multiple-choice task also every option letter and every option's text; sorted."""
    options = {text for record in records for text in record["options"]}
    letters = set(LETTERS) if options else set()
    return sorted({record["answer"] for record in records} | options | letters)


def constant_baseline(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The best single answer to every question of a task, by its own scoring (the first of the
    sorted candidates on a tie): ``answer``, ``metric`` and ``value`` (as lmms-eval reports the
    metric). A judged task's candidate is the reference answer with the highest mean token F1
    against all references (``token_f1``); its ``value`` is None: only the judge scores it."""
    scoring = records[0]["scoring"]
    candidates = constant_candidates(records)
    if scoring == "judge":
        references = Counter(record["answer"] for record in records)
        f1 = {c: sum(n * token_f1(c, ref) for ref, n in references.items()) / len(records) for c in candidates}
        best = max(candidates, key=f1.__getitem__)
        return {"answer": best, "metric": METRIC[scoring], "value": None, "token_f1": f1[best]}
    value = {c: sum(score(scoring, c, r["answer"], r["options"]) for r in records) / len(records) for c in candidates}
    best = max(candidates, key=value.__getitem__)
    return {"answer": best, "metric": METRIC[scoring], "value": value[best]}
