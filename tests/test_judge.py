"""The judge of the judged benchmarks: its check against a live server, and the count of failed
judgements on what lmms-eval 0.7.3 really writes, from its own task code (process_results and
aggregations of LLaVA-W, MM-Vet, MathVista, MMBench) against a test judge that answers, fails,
or fails every other call.

Run as a script (``python tests/test_judge.py MODE BASE_URL OUT``) this file is that lmms-eval
side: a process of its own, since lmms-eval's task modules read the judge from the environment
when imported.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest
from judge_server import MODES, JudgeServer

from pipeline.config import JudgeSection
from pipeline.eval.judge import (
    FALLBACK_MARKER,
    bound_mmvet_retries,
    check_judge,
    failed_judgements,
    judge_environment,
    judge_style,
    mark_judge_fallbacks,
)

KEY_ENV = "MERIT_TEST_JUDGE_KEY"
MODEL = "test-judge"
OUTPUT = "judge-run"  # the lmms-eval "model" name its samples are saved under

# Each task's lmms-eval YAML and a few docs shaped as its dataset's, with the model's response.
# Every response needs the judge (none is parsed by MathVista's or MMBench's rules first).
LLAVA_W = [
    ({"question_id": 0, "question": "What is the cat doing?", "gpt_answer": "The cat is sleeping on a red sofa.",
      "caption": ["A cat sleeps on a red sofa."], "category": "conv"}, "The cat is sleeping on a red sofa."),
    ({"question_id": 1, "question": "Describe the scene.", "gpt_answer": "A cat is sleeping on a red sofa.",
      "caption": ["A cat sleeps on a red sofa."], "category": "detail"}, "A cat sleeping."),
]  # fmt: skip
MMVET = [
    ({"question_id": "v1_0", "question": "What is x in the equation?", "answer": "-1<AND>-5",
      "capability": "ocr,math"}, "x = -1 or x = -5"),
    ({"question_id": "v1_1", "question": "What color is the bus?", "answer": "red<OR>crimson",
      "capability": "rec"}, "The bus is blue."),
]  # fmt: skip
MATHVISTA_META = {"split": "testmini", "language": "english", "source": "test", "category": "math-targeted-vqa",
                  "task": "figure question answering", "context": "natural image", "grade": "elementary school",
                  "skills": ["arithmetic reasoning"]}  # fmt: skip
MATHVISTA = [
    ({"pid": "1", "question": "How many apples are on the table?", "question_type": "free_form",
      "answer_type": "integer", "choices": None, "answer": "3", "precision": None, "unit": None,
      "query": "Hint: Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, "
               "3, at the end.\nQuestion: How many apples are on the table?",
      "metadata": MATHVISTA_META}, "I count 3 apples on the table."),
    ({"pid": "2", "question": "How many birds are there?", "question_type": "free_form",
      "answer_type": "integer", "choices": None, "answer": "5", "precision": None, "unit": None,
      "query": "Hint: Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, "
               "3, at the end.\nQuestion: How many birds are there?",
      "metadata": MATHVISTA_META}, "Two birds sit on the wire and 2 more fly, so 4 in all."),
]  # fmt: skip
MMBENCH_COMMON = {"hint": None, "source": "test", "split": "dev", "category": "object_localization",
                  "L2-category": "finegrained_perception (instance-level)"}  # fmt: skip
MMBENCH = [
    ({"index": 0, "question": "What is the main object in the image?", "answer": "B", "A": "dog", "B": "hot dog",
      "C": "cat", "D": "bird", **MMBENCH_COMMON}, "It shows a tasty hot dog with mustard."),
    ({"index": 1, "question": "What color is the car?", "answer": "D", "A": "red", "B": "green", "C": "blue",
      "D": "reddish brown", **MMBENCH_COMMON}, "The car looks reddish brown to me."),
]  # fmt: skip
TASKS = {
    "llava_in_the_wild": ("llava-in-the-wild/llava-in-the-wild.yaml", LLAVA_W),
    "mmvet": ("mmvet/mmvet.yaml", MMVET),
    "mathvista_testmini_format": ("mathvista/mathvista_testmini_format.yaml", MATHVISTA),
    "mmbench_en_dev": ("mmbench/mmbench_en_dev.yaml", MMBENCH),
}


def _judge(base_url: str) -> JudgeSection:
    return JudgeSection(base_url=base_url, model=MODEL, api_key_env=KEY_ENV)


def test_check_judge_gets_an_answer_from_a_working_judge(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    with JudgeServer("good") as server:
        said = check_judge(_judge(server.base_url))
    assert server.calls == 1 and "'10 5 Scored by token overlap.'" in said and MODEL in said


@pytest.mark.parametrize("mode", ["empty", "garbage"])
def test_check_judge_refuses_an_empty_or_unparsable_reply(monkeypatch, mode):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    with JudgeServer(mode) as server, pytest.raises(ValueError) as refused:
        check_judge(_judge(server.base_url))
    wanted = "with empty content" if mode == "empty" else "without two ratings: 'I cannot rate this.'"
    assert f"judge {MODEL} at {server.base_url} answered a test comparison {wanted}" == str(refused.value)


def test_check_judge_quotes_the_servers_refusal(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    with JudgeServer("fail") as server, pytest.raises(ValueError) as refused:
        check_judge(_judge(server.base_url))
    message = str(refused.value)
    assert server.base_url in message and MODEL in message
    assert "HTTP 500" in message and "the test judge is down" in message


def test_check_judge_names_an_unreachable_url(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    with JudgeServer("good") as server:
        closed = server.base_url  # nothing listens there once the server is gone
    with pytest.raises(ValueError, match="unreachable") as refused:
        check_judge(_judge(closed), timeout_s=5)
    assert f"{closed}/chat/completions" in str(refused.value) and "refused" in str(refused.value).lower()


def test_check_judge_refuses_without_a_key(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with JudgeServer("good") as server, pytest.raises(ValueError, match=KEY_ENV):
        check_judge(_judge(server.base_url))
    assert server.calls == 0


@pytest.fixture(scope="module")
def lmms_runs(tmp_path_factory):
    """Every task scored by lmms-eval's own code against a judge in each mode (three processes at
    once): mode → (server, the samples lmms-eval saved per task, its aggregates, its log)."""
    with ExitStack() as stack, ThreadPoolExecutor(len(MODES)) as pool:
        servers = {mode: stack.enter_context(JudgeServer(mode)) for mode in MODES}
        outs = {mode: tmp_path_factory.mktemp(f"lmms-{mode}") for mode in MODES}  # the factory is not thread-safe
        done = {mode: pool.submit(_run_lmms_side, mode, servers[mode], outs[mode]) for mode in MODES}
        return {mode: (servers[mode], *future.result()) for mode, future in done.items()}


def _run_lmms_side(mode: str, server: JudgeServer, out: Path) -> tuple[dict, dict, str]:
    env = os.environ | {KEY_ENV: "sk-test"}
    command = [sys.executable, __file__, mode, server.base_url, str(out)]
    with (out / "lmms_eval.log").open("w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=300).returncode
    log = (out / "lmms_eval.log").read_text()
    assert code == 0, f"the lmms-eval side in mode {mode} failed; its log ends:\n{log[-3000:]}"
    samples = {task: _read_samples(out, task) for task in TASKS}
    return samples, json.loads((out / "aggregates.json").read_text()), log


def _read_samples(out: Path, task: str) -> list[dict]:
    (path,) = (out / OUTPUT).glob(f"*_samples_{task}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def _failures(run: tuple) -> dict[str, int | None]:
    _server, samples, _aggregates, log = run
    return {task: failed_judgements(task, samples[task], log) for task in TASKS}


def test_no_judgement_fails_when_the_judge_answers(lmms_runs):
    server, samples, aggregates, log = lmms_runs["good"]
    assert server.calls > 0 and server.failed == 0
    assert _failures(lmms_runs["good"]) == dict.fromkeys(TASKS, 0)
    assert FALLBACK_MARKER not in log
    # The judge's answers reached lmms-eval's scores: 10 vs the answer's token F1 × 10, MM-Vet's
    # ground truth found, MathVista's last number, MMBench's longest matching option.
    assert [s["gpt_eval_llava_all"]["scores"] for s in samples["llava_in_the_wild"]] == [[10.0, 10.0], [10.0, 5.0]]
    assert [s["gpt_eval_score"]["score"] for s in samples["mmvet"]] == [1.0, 0.0]
    assert [s["llm_as_judge_eval"]["extraction"] for s in samples["mathvista_testmini_format"]] == ["3", "4"]
    assert aggregates == {"llava_in_the_wild": 75.0, "mmvet": 50.0, "mathvista_testmini_format": 50.0,
                          "mmbench_en_dev": 100.0}  # fmt: skip


def test_every_judgement_fails_when_the_judge_does(lmms_runs):
    server, _samples, aggregates, log = lmms_runs["fail"]
    assert server.failed == server.calls > 0
    assert _failures(lmms_runs["fail"]) == {task: len(docs) for task, (_, docs) in TASKS.items()}
    assert f"{FALLBACK_MARKER} 0" in log and f"{FALLBACK_MARKER} 1" in log
    # Why failures are counted at all: lmms-eval scores a judge that never answered as a perfect LLaVA-W.
    assert aggregates["llava_in_the_wild"] == 100.0


def test_unusable_replies_are_failures_and_mmvets_tries_are_bounded(lmms_runs):
    """An empty reply, one without a rating and a rating outside MM-Vet's 0–1: lmms-eval's MM-Vet
    would score the second 0.0 under the judge's name and ask again forever for the third (the
    fixture's lmms-eval side would never end). (A
    MathVista extraction that is a sentence or a number reads as an answer: only an empty one is
    a known failure.)"""
    for mode in ("empty", "garbage", "range"):
        _server, samples, _aggregates, _log = lmms_runs[mode]
        failures = _failures(lmms_runs[mode])
        assert [s["gpt_eval_score"]["eval_model"] for s in samples["mmvet"]] == ["", ""], mode
        assert [failures[t] for t in ("mmvet", "llava_in_the_wild", "mmbench_en_dev")] == [2, 2, 2], mode
        assert failures["mathvista_testmini_format"] == (2 if mode == "empty" else 0), mode


def test_isolated_judge_errors_are_retried_not_counted(lmms_runs):
    # Every other call fails, and every judgement still gets its answer: lmms-eval (and the OpenAI
    # client under it) retry a failed call, so only a judge that keeps failing fails a judgement.
    server = lmms_runs["flaky"][0]
    assert 0 < server.failed < server.calls
    assert _failures(lmms_runs["flaky"]) == dict.fromkeys(TASKS, 0)


def test_tasks_without_a_judge_have_no_failure_count():
    assert failed_judgements("ai2d", [{"doc_id": 0, "exact_match": 1.0}], "") is None
    assert judge_style("mathvista_testmini_format") == "base" and judge_style("mmbench_en_dev") == "endpoint"
    assert judge_style("toy_chat") == "base" and judge_style("seedbench") is None


def _score_in_lmms_eval(mode: str, base_url: str, out: Path) -> None:
    """lmms-eval's side: each task's process_results on its docs, its headline aggregation, and its
    samples saved by lmms-eval's own tracker, as ``--log_samples`` writes them."""
    # lmms-eval sleeps between retries (MM-Vet 10 s × 4 × 3 per failed doc): minutes of a failing
    # judge. Sleeping changes no outcome, so it is skipped (lmms-eval and the OpenAI client it uses
    # call time.sleep through the module).
    skipped = []
    time.sleep = skipped.append

    import lmms_eval
    from lmms_eval.loggers.evaluation_tracker import EvaluationTracker
    from lmms_eval.utils import load_yaml_config

    mark_judge_fallbacks()
    bound_mmvet_retries()
    tracker = EvaluationTracker(output_path=str(out))
    tracker.general_config_tracker.log_experiment_args(OUTPUT, f"pretrained={OUTPUT}", None, None, False)
    tracker.date_id = "2026-01-01T00-00-00"
    aggregates = {}
    for task, (yaml_file, docs) in TASKS.items():
        # As the runner does: a task reads the judge's URL in its own style, when imported and when judging.
        os.environ.update(judge_environment(_judge(base_url), judge_style(task)))
        config = load_yaml_config(str(Path(lmms_eval.__file__).parent / "tasks" / yaml_file), mode="full")
        records = []
        for doc_id, (doc, response) in enumerate(docs):
            metrics = config["process_results"](doc, [response])
            records.append({"doc_id": doc_id, "doc": doc, "target": str(doc.get("answer", doc.get("gpt_answer"))),
                            "arguments": [doc["question"]], "resps": [[response]], "filtered_resps": [response],
                            "token_counts": [None], "doc_hash": ""} | metrics)  # fmt: skip
        metric = config["metric_list"][0]
        values = [record[metric["metric"]] for record in records]
        aggregate = metric["aggregation"]
        args = SimpleNamespace(output_path=str(out))
        with_args = "args" in inspect.signature(aggregate).parameters  # as lmms-eval calls an aggregation
        aggregates[task] = aggregate(values, args=args) if with_args else aggregate(values)
        tracker.save_results_samples(task_name=task, samples=records)
    (out / "aggregates.json").write_text(json.dumps(aggregates))
    print(f"lmms-eval side, judge {mode}: skipped {sum(skipped):.0f} s of retry sleeps", flush=True)


if __name__ == "__main__":
    _score_in_lmms_eval(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
