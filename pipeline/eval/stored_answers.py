"""lmms-eval's model ``merit_stored_answers``: every request answered with the model's answer an
earlier job logged for it (``*_samples_<task>.jsonl`` under ``answers``, lmms-eval's own sample
records, by task and document id), so that a job whose judge failed is judged again without
generating anything. lmms-eval then filters, judges and aggregates the answers as it did the first
time. What lmms-eval logs is the answer after the task's filters: the judged tasks (LLaVA-W, MM-Vet,
MathVista, MMBench) filter nothing, so their answers are judged as they were generated.
Registered like ``merit_constant`` (:mod:`pipeline.eval.lmms_plugin`)::

    python -m lmms_eval --model merit_stored_answers --model_args answers=RUN/eval/benchmarks/theta0/mmvet.failed \\
        --tasks mmvet
"""

from __future__ import annotations

import json
from pathlib import Path

from lmms_eval.api.instance import Instance
from lmms_eval.api.model import lmms

SAMPLES = "*_samples_{task}.jsonl"


def stored_answers(folder: str | Path, task: str) -> dict[int, str]:
    """The answers a job logged for ``task`` under ``folder`` (its latest samples file), by document id."""
    files = sorted(Path(folder).rglob(SAMPLES.format(task=task)), key=lambda p: p.name)
    if not files:
        return {}
    records = (json.loads(line) for line in files[-1].read_text().splitlines() if line.strip())
    return {r["doc_id"]: _answer(r) for r in records}


def _answer(record: dict) -> str:
    """The response lmms-eval logged: ``resps`` (after the task's filters, before reasoning tags
    are stripped), left out when it equals ``filtered_resps``; one response per request unwrapped."""
    answer = record.get("resps", record["filtered_resps"])
    while isinstance(answer, list):
        answer = answer[0]
    return answer


class StoredAnswers(lmms):
    """Answers a generation request with the answer logged for its document; a request no
    answer was logged for is an error naming the task and the document."""

    def __init__(
        self,
        answers: str,
        batch_size: int | str | None = None,  # the evaluator's settings: stored answers need none
        max_batch_size: int | str | None = None,
        device: str | None = None,
    ) -> None:
        super().__init__()
        self.folder = answers
        self.answers: dict[str, dict[int, str]] = {}

    def generate_until(self, requests: list[Instance]) -> list[str]:
        answered = []
        for request in requests:
            task, doc_id = request.task_name, request.doc_id
            if task not in self.answers:
                self.answers[task] = stored_answers(self.folder, task)
            if doc_id not in self.answers[task]:
                raise ValueError(f"{self.folder} logged no answer of '{task}' for document {doc_id}")
            answered.append(self.answers[task][doc_id])
        return answered

    def generate_until_multi_round(self, requests: list[Instance]) -> list[str]:
        raise TypeError("merit_stored_answers answers single-turn generation tasks only")

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        raise TypeError("merit_stored_answers answers generation tasks only")
