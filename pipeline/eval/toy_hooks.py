"""lmms-eval's hooks for the built-in toy benchmark tasks: the ``utils.py`` beside their task
files imports these, so lmms-eval builds the prompt, runs the model and aggregates the scores,
and this project only says how one record looks and how one answer scores."""

from __future__ import annotations

import base64
import io
from typing import Any

from PIL import Image

from pipeline.eval.scoring import score


def doc_to_visual(doc: dict[str, Any]) -> list[Image.Image]:
    return [Image.open(io.BytesIO(base64.b64decode(doc["image"]))).convert("RGB")]


def doc_to_text(doc: dict[str, Any], lmms_eval_specific_kwargs: dict[str, Any] | None = None) -> str:
    return doc["question"]


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return {doc["metric"]: score(doc["scoring"], results[0], doc["answer"], doc["options"])}
