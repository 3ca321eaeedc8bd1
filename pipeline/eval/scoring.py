"""How the toy benchmark tasks score one answer, each the way its kind of benchmark is scored
(1.0 right, 0.0 wrong):

- ``choice``: the option the answer picks, by its letter alone (``B``, ``B.``, ``(B)``,
  ``B. blue``) or, without a letter, by the option's text (``blue``), as lmms-eval's MMBench
  and SeedBench matching do before any judge: right when it is the reference option.
- ``exact``: the normalised answer equals the reference (TextVQA's exact match).
- ``number``: the last integer in the answer equals the reference: the result, after any
  working ("4 dots, and 4 + 3 = 7"), as MathVista's answer extraction takes the final answer.

A judged task (``toy_chat``) is scored as LLaVA-in-the-Wild is: :func:`judged_score` of the
judge's ratings. :func:`token_f1` (SQuAD's) picks its constant answer (pipeline.data.benchmark).
"""

from __future__ import annotations

import re
from collections import Counter

from pipeline.eval.generate import normalise

_LETTER = re.compile(r"^\(?([A-Z])(?:[.):]|$)")
_INTEGER = re.compile(r"-?\d+")
_WORD = re.compile(r"[a-z0-9]+")
_ARTICLES = {"a", "an", "the"}


def picked_option(answer: str, options: list[str]) -> int | None:
    """The index of the option an answer picks: by its leading letter, else by its text."""
    text = answer.strip()
    if match := _LETTER.match(text):
        index = ord(match.group(1)) - ord("A")
        return index if index < len(options) else None
    said = normalise(text)
    return next((i for i, option in enumerate(options) if normalise(option) == said), None)


def _words(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in _ARTICLES]


def token_f1(answer: str, reference: str) -> float:
    said, wanted = _words(answer), _words(reference)
    common = sum((Counter(said) & Counter(wanted)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(said), common / len(wanted)
    return 2 * precision * recall / (precision + recall)


def score(scoring: str, answer: str, reference: str, options: list[str] | None = None) -> float:
    if scoring == "choice":
        return float(picked_option(answer, options or []) == ord(reference) - ord("A"))
    if scoring == "exact":
        return float(normalise(answer) == normalise(reference))
    if scoring == "number":
        found = _INTEGER.findall(answer)
        return float(bool(found) and int(found[-1]) == int(reference))
    raise ValueError(f"unknown scoring '{scoring}' (choice, exact, number)")


def judged_score(ratings: list[list[float]]) -> float | None:
    """LLaVA-in-the-Wild's score of a judged task: 100 × the mean rating of the answers / the
    mean rating of the references, over the judgements that did not fail (a failed one, or a
    reply without two ratings, is ``[-1, -1]``); None when none succeeded (or every reference
    was rated 0): never a number made of failures."""
    rated = [pair for pair in ratings if min(pair) >= 0]
    reference = sum(pair[0] for pair in rated)
    if not reference:
        return None
    return 100 * sum(pair[1] for pair in rated) / reference
