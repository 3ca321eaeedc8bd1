"""lmms-eval's hooks for the built-in toy benchmark tasks: the ``utils.py`` beside their task
files imports these, so lmms-eval builds the prompt, runs the model and aggregates the scores,
and this project only says how one record looks and how one answer scores.

``toy_chat`` is judged as LLaVA-in-the-Wild is: lmms-eval's own judge client
(:mod:`lmms_eval.llm_judge`), configured from the environment as lmms-eval's judged tasks are
(``API_TYPE``, ``MODEL_VERSION``, and the provider's own ``OPENAI_API_URL``, the API's base URL
…/v1, and ``OPENAI_API_KEY``), rates the reference answer and the model's on one line, at
temperature 0; a call that fails after a few quick tries, or a reply without two ratings, is the
failed judgement ``[-1, -1]``, which the score leaves out (:func:`pipeline.eval.scoring.judged_score`).
"""

from __future__ import annotations

import base64
import io
import os
from functools import cache
from typing import Any

from lmms_eval.llm_judge import Request, ResponseParser, ServerConfig, get_server
from PIL import Image

from pipeline.eval.scoring import judged_score, score

JUDGE_MODEL = "gpt-4o-2024-11-20"  # lmms-eval's LLaVA-W default, without MODEL_VERSION
JUDGE_TRIES = 3  # a dead judge fails each question in about a second, not minutes
JUDGE_RETRY_DELAY_S = 0.5
JUDGE_TIMEOUT_S = 120
JUDGE_MAX_TOKENS = 512  # the two ratings and a short explanation
JUDGE_PROMPT = """[Question]
{question}

[Assistant 1]
{reference}

[End of Assistant 1]

[Assistant 2]
{answer}

[End of Assistant 2]

[System]
We would like to request your feedback on the performance of two AI assistants in response to \
the user question displayed above. The user asks the question on observing an image you cannot \
see; Assistant 1's answer was written by someone who saw it: take its facts as true.
Please rate the helpfulness, relevance, accuracy, level of details of their responses. Each \
assistant receives an overall score on a scale of 1 to 10, where a higher score indicates better \
overall performance.
Please first output a single line containing only two values indicating the scores for Assistant \
1 and 2, respectively. The two scores are separated by a space.
In the subsequent line, please provide a comprehensive explanation of your evaluation, avoiding \
any potential bias and ensuring that the order in which the responses were presented does not \
affect your judgment."""


def doc_to_visual(doc: dict[str, Any]) -> list[Image.Image]:
    return [Image.open(io.BytesIO(base64.b64decode(doc["image"]))).convert("RGB")]


def doc_to_text(doc: dict[str, Any], lmms_eval_specific_kwargs: dict[str, Any] | None = None) -> str:
    return doc["question"]


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return {doc["metric"]: score(doc["scoring"], results[0], doc["answer"], doc["options"])}


def judge_process_results(doc: dict[str, Any], results: list[str]) -> dict[str, dict[str, Any]]:
    """The judge's ratings of the reference answer and of the model's, ``scores``: [reference,
    answer] (``[-1, -1]`` when the judgement failed), with the review and the judge's model."""
    answer = results[0]
    judgement = {"question": doc["question"], "reference": doc["answer"], "answer": answer}
    try:
        reply = _judge().evaluate(Request(messages=[{"role": "user", "content": judge_prompt(doc, answer)}]))
    except Exception as err:  # any failure of the call is a failed judgement, as LLaVA-W counts it
        return {"judge_score": judgement | {"review": f"failed: {err}", "scores": [-1, -1], "eval_model": _model()}}
    scores = list(ResponseParser.parse_comparative_response(reply.content))
    return {"judge_score": judgement | {"review": reply.content, "scores": scores, "eval_model": reply.model_used}}


def judge_prompt(doc: dict[str, Any], answer: str) -> str:
    """LLaVA-W's comparison: the question, the reference as Assistant 1, the answer as Assistant 2."""
    return JUDGE_PROMPT.format(question=doc["question"], reference=doc["answer"], answer=answer)


def judge_score(judgements: list[dict[str, Any]]) -> float | None:
    return judged_score([judgement["scores"] for judgement in judgements])


def _model() -> str:
    return os.environ.get("MODEL_VERSION", JUDGE_MODEL)


def _judge() -> Any:
    environment = ("API_TYPE", "OPENAI_API_URL", "OPENAI_API_KEY")
    return _judge_for(_model(), *(os.environ.get(name, "") for name in environment))


@cache
def _judge_for(model: str, api_type: str, url: str, key: str) -> Any:
    """lmms-eval's judge client for these settings (its provider reads the URL and key from the
    environment when it is made)."""
    config = ServerConfig(
        model_name=model,
        max_tokens=JUDGE_MAX_TOKENS,
        timeout=JUDGE_TIMEOUT_S,
        num_retries=JUDGE_TRIES,
        retry_delay=JUDGE_RETRY_DELAY_S,
    )
    judge = get_server(api_type or "openai", config)
    if getattr(judge, "use_client", False):  # the OpenAI client would retry on its own and wait 10 minutes
        judge.client = judge.client.with_options(max_retries=0, timeout=JUDGE_TIMEOUT_S)
    return judge
