"""The judge model of the judged benchmarks (``eval.judge``): which tasks it scores, how lmms-eval
reads it from the environment, one real request to check it answers, and how many of a task's
judgements failed.

lmms-eval 0.7.3 turns a failed judgement into a number, silently: LLaVA-W scores it ``[-1, -1]``
(every call failing aggregates to 100.0), MM-Vet 0.0, MathVista an empty extraction (a wrong
answer), MMBench a random letter. :func:`failed_judgements` counts them from each task's own
failure marker in its logged samples; MMBench's, which lmms-eval neither logs nor saves, from the
marker line :func:`mark_judge_fallbacks` prints into the task's log.

MM-Vet's own loop gives an unparsable reply four tries and then records 0.0 under the judge's
name (no marker), and asks again forever for a number outside 0–1 (until the job's time limit):
:func:`bound_mmvet_retries` replaces its per-answer function with one that makes the same calls,
at most :data:`MMVET_TEMPERATURES`, and marks a judgement that got no usable reply.
"""

from __future__ import annotations

import functools
import json
import os
import urllib.error
import urllib.request
from typing import Any

from pipeline.config import JudgeSection

# Tasks scored by a judge model (by name prefix), and how their lmms-eval code reads the judge's
# OPENAI_API_URL: lmms-eval's llm_judge providers take the API's base URL (…/v1), MMBench's
# answer matcher (used for answers its rules cannot parse) the chat-completions endpoint itself.
JUDGED = {"llava_in_the_wild": "base", "mmvet": "base", "mathvista": "base", "mmbench": "endpoint", "toy_chat": "base"}
# Printed once per MMBench answer lmms-eval picked at random after its judge failed, with the item's index.
FALLBACK_MARKER = "MERIT judge fallback: MMBench picked a random option for item"
MMBENCH_RANDOM = "Failed to predict, thus randomly generate one. "  # lmms-eval's own note on such an answer
REPLY_SHOWN = 300  # characters of a server's answer quoted in an error
# MM-Vet's tries of one judgement: lmms-eval's own temperatures (0, raised by 0.5 after an unparsable reply).
MMVET_TEMPERATURES = (0.0, 0.5, 1.0, 1.5)
# Preflight's request: a LLaVA-W comparison; the judge must answer two ratings on its first line.
PROBE = (
    "[Question]\nWhat colour is the sky on a clear day?\n\n[Assistant 1]\nBlue.\n\n[End of Assistant 1]\n\n"
    "[Assistant 2]\nIt is blue.\n\n[End of Assistant 2]\n\n[System]\nRate the two answers on a scale of 1 "
    "to 10. Output a single line containing only the two scores, separated by a space."
)


def judge_style(task: str) -> str | None:
    """How a judged task reads the judge's URL (``base`` or ``endpoint``); None: no judge."""
    return next((style for prefix, style in JUDGED.items() if task.startswith(prefix)), None)


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


def check_judge(judge: JudgeSection, timeout_s: float = 30) -> str:
    """One real chat completion from the judge, a comparison as LLaVA-W asks it; what it answered,
    or a ValueError naming the server and quoting its refusal, an empty answer or one without two
    ratings (parsed as lmms-eval parses them), or the OS error when it cannot be reached."""
    key = os.environ.get(judge.api_key_env, "")
    if not key:  # lmms-eval's judge client refuses to send a request without one
        raise ValueError(f"judge {judge.model} at {judge.base_url}: ${judge.api_key_env} holds no key")
    url = judge.base_url.rstrip("/") + "/chat/completions"
    body = {"model": judge.model, "messages": [{"role": "user", "content": PROBE}], "max_tokens": 64, "temperature": 0}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            reply = response.read()
    except urllib.error.HTTPError as e:
        raise ValueError(
            f"judge {judge.model} at {judge.base_url} refused a test request: HTTP {e.code} {_trimmed(e.read())}"
        ) from None
    except OSError as e:  # URLError or a timeout: refused, unknown host, no answer in time
        raise ValueError(f"judge {judge.model}: {url} is unreachable: {getattr(e, 'reason', e)}") from None
    try:
        answer = json.loads(reply)["choices"][0]["message"]["content"]
    except (ValueError, LookupError, TypeError):
        raise ValueError(f"judge at {url} answered no chat completion: {_trimmed(reply)}") from None
    if not (answer or "").strip():
        raise ValueError(f"judge {judge.model} at {judge.base_url} answered a test comparison with empty content")
    from lmms_eval.llm_judge import ResponseParser

    if list(ResponseParser.parse_comparative_response(answer)) == [-1, -1]:
        raise ValueError(
            f"judge {judge.model} at {judge.base_url} answered a test comparison without two ratings: "
            f"{_trimmed(answer)!r}"
        )
    return f"{judge.model} at {judge.base_url} answered {_trimmed(answer)!r}"


def _trimmed(text: str | bytes) -> str:
    text = text.decode(errors="replace") if isinstance(text, bytes) else text
    text = " ".join(text.split())
    return text if len(text) <= REPLY_SHOWN else text[:REPLY_SHOWN] + "…"


def failed_judgements(task: str, samples: list[dict[str, Any]], log: str) -> int | None:
    """How many of a task's judgements failed, by the task's own failure marker in its logged
    samples (lmms-eval's ``--log_samples`` records) or, for MMBench, the marker lines of
    :func:`mark_judge_fallbacks` in its log; None for a task no judge scores."""
    if judge_style(task) is None:
        return None
    if task.startswith("mmbench"):
        return log.count(FALLBACK_MARKER)
    if task.startswith("mathvista"):
        return sum(_extraction_failed(sample) for sample in samples)
    key, failed = next(rule for prefix, rule in _RATED.items() if task.startswith(prefix))
    return sum(failed(sample.get(key)) for sample in samples)


def _comparison_failed(judged: Any) -> bool:
    """LLaVA-W's (and toy_chat's) scores when the judge gave no two scores."""
    return isinstance(judged, dict) and list(judged.get("scores", [])) == [-1, -1]


def _mmvet_failed(judged: Any) -> bool:
    """MM-Vet names no judge model when no call gave a usable correctness (and scores 0.0)."""
    return isinstance(judged, dict) and judged.get("eval_model") == ""


# The tasks whose judge rates each sample: the per-sample metric, and how a failed judgement reads there.
_RATED = {
    "llava_in_the_wild": ("gpt_eval_llava_all", _comparison_failed),
    "toy_chat": ("judge_score", _comparison_failed),
    "mmvet": ("gpt_eval_score", _mmvet_failed),
}


def _extraction_failed(sample: dict[str, Any]) -> bool:
    """MathVista's extraction is empty when its judge failed, and when the model said nothing."""
    judged = sample.get("llm_as_judge_eval") or sample.get("submission")
    if not isinstance(judged, dict) or "extraction" not in judged:
        return False  # a variant scored without the judge's extraction
    response = sample.get("filtered_resps")
    response = response[0] if isinstance(response, list) and response else response
    return judged["extraction"] == "" and bool(str(response or "").strip())


def mark_judge_fallbacks() -> None:
    """Print :data:`FALLBACK_MARKER` (with the item's index) to stdout, the task's log, each time
    MMBench answers at random after its judge failed: lmms-eval neither logs nor saves that, so
    it is the only trace. Call once, at the start of the lmms-eval process; nothing else changes."""
    from lmms_eval.tasks.mmbench.mmbench_evals import MMBench_Evaluator

    extract = MMBench_Evaluator.extract_answer_from_item
    if getattr(extract, "marks_fallbacks", False):
        return

    @functools.wraps(extract)
    def marked(self: Any, item: Any) -> Any:
        answer = extract(self, item)
        if answer is not None and answer[1] == MMBENCH_RANDOM:
            print(f"{FALLBACK_MARKER} {item['index']}", flush=True)
        return answer

    marked.marks_fallbacks = True
    MMBench_Evaluator.extract_answer_from_item = marked


def bound_mmvet_retries() -> None:
    """Make every MM-Vet task lmms-eval loads from now on judge each answer with
    :func:`bounded_mmvet`. lmms-eval imports a task's ``!function`` afresh for every YAML it reads
    (a module of its own each time), so the function is replaced where it is imported. Call once,
    at the start of the lmms-eval process."""
    import lmms_eval.utils

    load = lmms_eval.utils.import_function
    if getattr(load, "bounds_mmvet", False):
        return

    @functools.wraps(load)
    def loading(loader: Any, node: Any) -> Any:
        function = load(loader, node)
        return bounded_mmvet(function) if getattr(function, "__name__", "") == "mmvet_process_results" else function

    loading.bounds_mmvet = True
    lmms_eval.utils.import_function = loading


def bounded_mmvet(lmms_process_results: Any) -> Any:
    """MM-Vet's per-answer judgement as lmms-eval 0.7.3 makes it (its prompt, its client, its
    record), with at most one call per temperature of :data:`MMVET_TEMPERATURES`; a judgement
    without a correctness between 0 and 1 scores 0.0 with no judge named, the mark
    :func:`failed_judgements` counts."""
    module = lmms_process_results.__globals__  # the task's utils, as lmms-eval imported them

    def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, Any]:
        answer = doc["answer"].replace("<AND>", " <AND> ").replace("<OR>", " <OR> ")
        prompt = f"{module['MM_VET_PROMPT']}\n{doc['question']} | {answer} | {results[0]} |"
        score, judge = 0.0, ""
        for temperature in MMVET_TEMPERATURES:
            content, model = module["get_chat_response"](prompt, temperature=temperature)
            if (rated := _correctness(content)) is not None:
                score, judge = rated, model
                break
        record = {"question_id": doc["question_id"], "question": doc["question"], "gt_answer": doc["answer"]}
        record |= {"capabilities": doc["capability"], "pred_answer": results[0], "score": score, "eval_model": judge}
        return {"gpt_eval_score": record}

    return process_results


def _correctness(reply: str) -> float | None:
    """MM-Vet's reading of a reply (its first word as a number), when it is between 0 and 1."""
    try:
        value = float((reply or "").strip().split(" ")[0])
    except ValueError:
        return None
    return value if 0.0 <= value <= 1.0 else None
