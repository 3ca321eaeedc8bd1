"""The built-in corpus's benchmark suite: tasks shaped like the MERIT paper's eight benchmarks,
never fine-tuned on, that lmms-eval runs like any real task: ``prepare`` writes them as task
files (a YAML file and the data per task), and their hooks are :mod:`pipeline.eval.toy_hooks`.

Each task stands in for one or two of the paper's benchmarks and is scored the way its kind is
scored there, without a judge model (:mod:`pipeline.eval.scoring`):

- ``toy_perception`` (SeedBench, MMBench): one shape; its colour, kind or place, as a
  multiple-choice question of four options answered by a letter (chance 25 %).
- ``toy_diagram`` (AI2D): two shapes of different sizes; a relation between them (the colour of
  the bigger one, the kind on one side), four options.
- ``toy_reading`` (TextVQA): the word written in the image, asked in TextVQA's words; exact match.
- ``toy_describe`` (LLaVA-in-the-Wild): a detailed description of one or two shapes, scored by
  token F1 against the reference (a judge's place).
- ``toy_reasoning`` (MathVista, MMMU): count the dots, then add a number; the first integer of
  the answer is compared.

θ0's warm-up (the toy's pre-training) teaches the formats an instruction-tuned model knows:
the ``skill_choice`` and ``skill_describe`` skills answer multiple-choice questions about one
shape and describe scenes, the other skills read words, count and add. The benchmark asks in
those formats about other scenes, relations (``toy_diagram``) and compositions
(``toy_reasoning``) no suite trains. Its inputs are drawn in a namespace of its own
(``benchmark/<task>``), so no fine-tuning, warm-up or unseen example is a benchmark example
(only chance repeats of a small space remain). The fine-tuning suite asks none of these formats:
what a model keeps of them after fine-tuning is what the benchmark measures, as the paper's
benchmarks measure what a fine-tuned θ0 retains.
"""

from __future__ import annotations

import base64
import io
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pipeline.checkpoint import staged_dir, write_json_atomic
from pipeline.config import RunConfig
from pipeline.data.builtin import FAMILIES, LETTERS, Facts, Scene, choice_prompt

WORD_PROMPT = "Answer the question using a single word or phrase."  # TextVQA's, in lmms-eval


@dataclass(frozen=True)
class Task:
    """A toy benchmark task: the benchmarks it stands for, the family that draws its questions,
    how an answer is scored and what the reference answer is."""

    stands_for: str
    family: str
    scoring: str  # choice | exact | f1 | number (pipeline.eval.scoring)
    reference: str  # the fact that is the answer
    question: str | None = None  # replaces the family's question


TASKS: dict[str, Task] = {
    "toy_perception": Task("SeedBench, MMBench", "choice", "choice", "letter"),
    "toy_diagram": Task("AI2D", "relation_choice", "choice", "letter"),
    "toy_reading": Task("TextVQA", "read_word", "exact", "word", f"What is written in the image?\n{WORD_PROMPT}"),
    "toy_describe": Task("LLaVA-in-the-Wild", "describe", "f1", "text"),
    "toy_reasoning": Task("MathVista, MMMU", "count_plus", "number", "value"),
}


@dataclass(frozen=True)
class Item:
    """One benchmark question: its image, the prompt, the reference answer, the options of a
    multiple-choice question (the answer is then a letter)."""

    scene: Scene
    question: str
    answer: str
    options: tuple[str, ...] = ()


def is_toy_task(task: str) -> bool:
    return task in TASKS


def items(task: str, examples: int, seed: int, image_size: int) -> list[Item]:
    """The ``examples`` questions of a toy task, deterministic by seed."""
    if task not in TASKS:
        raise ValueError(f"unknown built-in benchmark task '{task}'; known: {sorted(TASKS)}")
    spec = TASKS[task]
    draw = FAMILIES[spec.family]
    return [_item(spec, i, *draw(random.Random(f"{seed}/benchmark/{task}/{i}"), image_size)) for i in range(examples)]


def _item(spec: Task, index: int, scene: Scene | None, question: str, facts: Facts) -> Item:
    """A benchmark question; a multiple-choice one with its options turned so that the right one
    is letter ``index`` mod 4: every letter is right equally often, so answering one letter to
    everything scores chance exactly (the bias MMBench's circular evaluation removes)."""
    if "options" not in facts:
        return Item(scene, spec.question or question, str(facts[spec.reference]))
    options, at = facts["options"], index % len(LETTERS)
    shift = LETTERS.index(facts["letter"]) - at
    turned = options[shift:] + options[:shift]
    return Item(scene, choice_prompt(facts["stem"], turned), LETTERS[at], tuple(turned))


# --- lmms-eval task files -------------------------------------------------------------------
TASKS_DIR = Path("data") / "benchmarks"  # under the run directory; lmms-eval runs with it as cwd
MARKER = "tasks.json"  # written last: the folder is whole and what it was written from
METRIC = {"choice": "accuracy", "exact": "accuracy", "number": "accuracy", "f1": "token_f1"}
MAX_NEW_TOKENS = 32  # generated per answer: the longest reference (two shapes described) is 16 tiny tokens
UTILS = '''"""lmms-eval hooks of the built-in toy benchmark tasks (written by `merit prepare`)."""

from pipeline.eval.toy_hooks import doc_to_text, doc_to_visual, process_results

__all__ = ["doc_to_text", "doc_to_visual", "process_results"]
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
process_results: !function utils.process_results
metric_list:
  - {{metric: {metric}, aggregation: mean, higher_is_better: true}}
metadata: {{version: 1.0}}
"""


def toy_tasks(cfg: RunConfig) -> list[str]:
    return [task for task in cfg.eval.benchmarks if is_toy_task(task)]


def write_tasks(cfg: RunConfig, run_dir: str | Path) -> Path | None:
    """The toy tasks that ``eval.benchmarks`` names, as lmms-eval task files under
    ``run_dir/data/benchmarks/``: a YAML file and a JSON-lines file (images inline as base64
    PNG) per task, and the ``utils.py`` their hooks come from. Kept while up to date."""
    tasks = toy_tasks(cfg)
    if not tasks:
        return None
    b, folder = cfg.data.builtin, Path(run_dir) / TASKS_DIR
    identity = {
        "version": 2,  # of the questions' design: 2, the right letters balanced
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
        for task in tqdm(tasks, desc="prepare: benchmark tasks", unit="task", leave=False):
            questions = items(task, b.benchmark_examples, cfg.run.seed, b.image_size)
            spec = TASKS[task]
            metric = METRIC[spec.scoring]
            text = YAML.format(task=task, stands_for=spec.stands_for, metric=metric, max_new_tokens=MAX_NEW_TOKENS)
            (tmp / f"{task}.yaml").write_text(text)
            with (tmp / f"{task}.jsonl").open("w") as out:
                for index, item in enumerate(questions):
                    out.write(json.dumps(_record(index, item, spec.scoring, metric)) + "\n")
        write_json_atomic(tmp / MARKER, identity)
    return folder


def _record(index: int, item: Item, scoring: str, metric: str) -> dict[str, Any]:
    png = io.BytesIO()
    item.scene().save(png, format="PNG")
    return {
        "id": index,
        "image": base64.b64encode(png.getvalue()).decode(),
        "question": item.question,
        "answer": item.answer,
        "options": list(item.options),
        "scoring": scoring,
        "metric": metric,
    }
