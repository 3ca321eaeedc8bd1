"""lmms-eval's model ``merit_constant``: every request of a task answered with that task's constant
baseline, the best single answer (:func:`pipeline.data.benchmark.constant_baseline`), read from the
``constants.json`` that ``prepare`` writes beside the toy task files. lmms-eval then scores the
baseline exactly as it scores a model: its own prompts, metrics and aggregation, the judge for a
judged task. Registered through lmms-eval's entry-point group ``lmms_eval.models``
(:mod:`pipeline.eval.lmms_plugin`)::

    python -m lmms_eval --model merit_constant --model_args answers=RUN/data/benchmarks/constants.json \\
        --tasks toy_perception,toy_reasoning --include_path RUN/data/benchmarks
"""

from __future__ import annotations

import json
from pathlib import Path

from lmms_eval.api.instance import Instance
from lmms_eval.api.model import lmms


class ConstantAnswers(lmms):
    """Answers a generation request with its task's constant; nothing else is asked of it."""

    def __init__(
        self,
        answers: str,
        batch_size: int | str | None = None,  # the evaluator's settings: a constant needs none
        max_batch_size: int | str | None = None,
        device: str | None = None,
    ) -> None:
        super().__init__()
        self.answers = {task: entry["answer"] for task, entry in json.loads(Path(answers).read_text()).items()}
        self.source = answers

    def generate_until(self, requests: list[Instance]) -> list[str]:
        unknown = sorted({r.task_name for r in requests} - set(self.answers))
        if unknown:
            raise ValueError(f"{self.source} holds no constant answer for tasks {unknown}")
        return [self.answers[request.task_name] for request in requests]

    def generate_until_multi_round(self, requests: list[Instance]) -> list[str]:
        raise TypeError("merit_constant answers single-turn generation tasks only")

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        raise TypeError("merit_constant answers generation tasks only")
