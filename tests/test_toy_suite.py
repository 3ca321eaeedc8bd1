"""The built-in corpus's toy benchmark suite: how its tasks score an answer, its questions, its task
files as lmms-eval reads them (a group of two prompt variants), no benchmark image or reference
template among the fine-tuning and warm-up examples, the constant baselines, lmms-eval's own
evaluator answering with them (``merit_constant``), and ``toy_chat``'s judge."""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import pytest
from conftest import small_config
from judge_server import JudgeServer
from lmms_eval.llm_judge import Request, Response

from pipeline.config import load_config
from pipeline.data import builtin
from pipeline.data.benchmark import CONSTANT_MODEL, CONSTANTS, MARKER, TASKS, TASKS_DIR, is_toy_task, items, write_tasks
from pipeline.eval import toy_hooks
from pipeline.eval.scoring import judged_score, picked_option, score, token_f1

DEMO = Path(__file__).parents[1] / "configs" / "demo.yaml"
SUITE = ["toy_perception", "toy_diagram", "toy_reading", "toy_reasoning", "toy_chat"]
LEAVES = ["toy_perception", "toy_diagram", "toy_reading", "toy_reasoning_direct", "toy_reasoning_steps", "toy_chat"]
OPTIONS = ["red", "blue", "green", "yellow"]


def records(folder: Path, task: str) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{task}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def demo_suite(tmp_path_factory):
    """The whole suite written at the demo's sizes (seed 0, 200 questions a task, 112 px)."""
    cfg = load_config(DEMO, [f"eval.benchmarks=[{', '.join(SUITE)}]"])
    return cfg, write_tasks(cfg, tmp_path_factory.mktemp("run"))


@pytest.fixture
def judge(monkeypatch):
    """``judge(mode)``: tests/judge_server.py's judge, set in the environment as lmms-eval's
    judged tasks read it; its ``good`` mode rates LLaVA-W's comparison ``10 K``, K the answer's
    token F1 against the reference × 10."""
    with ExitStack() as servers:

        def start(mode: str = "good") -> JudgeServer:
            server = servers.enter_context(JudgeServer(mode))
            for name, value in (("API_TYPE", "openai"), ("MODEL_VERSION", "judge"), ("OPENAI_API_KEY", "test")):
                monkeypatch.setenv(name, value)
            monkeypatch.setenv("OPENAI_API_URL", server.base_url)
            return server

        yield start


# --- scoring --------------------------------------------------------------------------------
def test_choice_answers_count_by_their_letter_or_the_option_text():
    for answer in ("B", "B.", "(B)", "B. blue", "  B\n", "blue", "Blue."):
        assert score("choice", answer, "B", OPTIONS) == 1.0, answer
    assert picked_option("A red circle", OPTIONS) is None  # the article, not option A
    assert picked_option("E", OPTIONS) is None  # no fifth option
    assert score("choice", "C", "B", OPTIONS) == 0.0
    assert score("choice", "purple", "B", OPTIONS) == 0.0


def test_free_form_answers_score_by_exact_match_or_the_last_integer():
    assert score("exact", " Cake.", "cake") == 1.0 and score("exact", "a cake", "cake") == 0.0
    assert score("number", "There are 4 dots, and 4 + 3 = 7.", "7") == 1.0  # the result, after the working
    assert score("number", "7 dots", "7") == 1.0 and score("number", "7, I think 8", "7") == 0.0
    assert score("number", "seven", "7") == 0.0 and score("number", "17", "7") == 0.0
    # articles and punctuation aside: {small, red, circle} against {small, blue, circle}
    assert token_f1("A small red circle.", "A small blue circle") == pytest.approx(2 / 3)


def test_a_judged_score_is_the_answers_mean_rating_over_the_references_leaving_failures_out():
    assert judged_score([[8, 6], [10, 4], [-1, -1]]) == pytest.approx(100 * 5 / 9)
    assert judged_score([[-1, -1], [-1, -1]]) is None and judged_score([]) is None


# --- questions ------------------------------------------------------------------------------
def test_a_multiple_choice_answer_names_the_option_that_is_true_of_the_scene():
    for task in ("toy_perception", "toy_diagram"):
        for item in items(task, 60, 0, 112):
            truth = item.options[ord(item.answer) - ord("A")]
            shapes = item.scene.shapes
            if "colour" in item.question and task == "toy_perception":
                assert truth == shapes[0].colour
            elif "bigger" in item.question:
                assert truth == max(shapes, key=lambda s: s.radius).colour
            elif "on the left" in item.question:
                assert truth == min(shapes, key=lambda s: s.cx).kind
            elif "on the right" in item.question:
                assert truth == max(shapes, key=lambda s: s.cx).kind
            assert len(set(item.options)) == 4 and item.answer in "ABCD"
        # every letter right equally often: one letter answered to everything scores chance, 25 %
        assert Counter(item.answer for item in items(task, 60, 0, 112)) == dict.fromkeys("ABCD", 15)


def test_the_suite_draws_its_own_questions_deterministically():
    assert items("toy_reading", 20, 0, 56) == items("toy_reading", 20, 0, 56)
    assert items("toy_reading", 20, 0, 56) != items("toy_reading", 20, 1, 56)
    reading = items("toy_reading", 40, 0, 56)
    assert [item.answer for item in reading] == builtin.WORDS * 2 and all(i.scene.word == i.answer for i in reading)
    # the group's two variants: one question set, each asked in its own words
    direct, steps = items("toy_reasoning_direct", 28, 0, 56), items("toy_reasoning_steps", 28, 0, 56)
    assert [(i.scene, i.answer) for i in direct] == [(i.scene, i.answer) for i in steps]
    assert direct[0].question == "How many dots are there? Add 1 to that number. Answer with digits."
    assert steps[0].question == "First count the dots in the image, then add 1 to the count. Answer with digits."
    assert [int(i.answer) for i in direct] == [*range(2, 16)] * 2
    assert all(int(i.answer) == len(i.scene.shapes) + int(re.findall(r"\d+", i.question)[0]) for i in direct)
    chat = items("toy_chat", 8, 0, 56)
    assert chat[0].question == "What do you see in this picture, and where is it?"
    assert all(f"{i.scene.shapes[0].colour} {i.scene.shapes[0].kind} in its" in i.answer for i in chat)
    with pytest.raises(ValueError, match="unknown built-in benchmark task 'toy_reasoning'"):
        items("toy_reasoning", 1, 0, 56)  # a group: its subtasks have the questions
    assert all(map(is_toy_task, SUITE + LEAVES)) and not is_toy_task("toy_describe")
    assert [TASKS[t].stands_for for t in SUITE] == [
        "SeedBench, MMBench",
        "AI2D",
        "TextVQA",
        "MathVista, MMMU",
        "LLaVA-in-the-Wild",
    ]


# --- task files -----------------------------------------------------------------------------
def test_prepare_writes_task_files_that_lmms_eval_loads(tmp_path):
    from lmms_eval.utils import load_yaml_config

    cfg = small_config("eval.benchmarks=[toy_perception, toy_chat]", "data.builtin.benchmark_examples=5")
    folder = write_tasks(cfg, tmp_path)
    assert folder == tmp_path / TASKS_DIR
    assert sorted(p.name for p in folder.glob("*.yaml")) == ["toy_chat.yaml", "toy_perception.yaml"]
    config = load_yaml_config(str(folder / "toy_perception.yaml"), mode="full")
    docs = records(folder, "toy_perception")
    assert len(docs) == 5 and config["task"] == "toy_perception"
    assert config["dataset_kwargs"]["data_files"]["test"] == str(folder / "toy_perception.jsonl")
    image = config["doc_to_visual"](docs[0])[0]
    assert image.tobytes() == items("toy_perception", 1, cfg.run.seed, 112)[0].scene().tobytes()  # lossless PNG
    assert config["process_results"](docs[0], [docs[0]["answer"]]) == {"accuracy": 1.0}
    chat = load_yaml_config(str(folder / "toy_chat.yaml"), mode="full")
    assert chat["process_results"] is toy_hooks.judge_process_results
    assert [m["metric"] for m in chat["metric_list"]] == ["judge_score"]
    assert chat["metric_list"][0]["aggregation"] is toy_hooks.judge_score
    assert set(json.loads((folder / CONSTANTS).read_text())) == {"toy_perception", "toy_chat"}
    stamp = (folder / MARKER).stat().st_mtime_ns
    assert write_tasks(cfg, tmp_path) == folder and (folder / MARKER).stat().st_mtime_ns == stamp  # up to date
    write_tasks(small_config("eval.benchmarks=[toy_reading]"), tmp_path)
    assert sorted(p.name for p in folder.glob("*.yaml")) == ["toy_reading.yaml"]


def test_toy_reasoning_is_a_group_of_two_prompt_variants_without_an_aggregate(demo_suite):
    from lmms_eval.tasks import TaskManager

    _, folder = demo_suite
    manager = TaskManager(include_path=[str(folder)], include_defaults=False)
    assert manager.task_index["toy_reasoning"]["type"] == "group"
    ((group, subtasks),) = manager.load_task_or_group(["toy_reasoning"]).items()
    assert group.group == "toy_reasoning" and sorted(subtasks) == ["toy_reasoning_direct", "toy_reasoning_steps"]
    assert "aggregate_metric_list" not in (folder / "toy_reasoning.yaml").read_text()  # as MathVista testmini
    assert not group.config.get("aggregate_metric_list")


# --- no leakage -----------------------------------------------------------------------------
def sha256(image) -> str:
    return hashlib.sha256(image.tobytes()).hexdigest()


# The facts an answer states: colours, kinds, places, sizes, numbers, the reading vocabulary (and its
# reversals), yes and no, option letters (so the article "a" too: every answer is masked alike).
FACT_WORDS = {*builtin.COLOURS, *builtin.SHAPE_OPTIONS, *builtin.NUMBER_WORDS, *builtin.PLACES, "large", "small"}
FACT_WORDS |= {*builtin.WORDS, *(word[::-1] for word in builtin.WORDS), "yes", "no", *builtin.LETTERS.lower()}


def template(answer: str) -> str | None:
    """An answer's template: its words, lower-cased, every fact word and number masked as ``{}``;
    None for a bare fact (a letter, a word, a number: nothing but facts), which has no wording."""
    masked = ["{}" if w in FACT_WORDS or w.isdigit() else w for w in re.findall(r"[a-z0-9]+", answer.lower())]
    return None if set(masked) <= {"{}"} else " ".join(masked)


def test_no_benchmark_image_or_reference_template_is_a_fine_tuning_or_warm_up_one(demo_suite):
    cfg, folder = demo_suite
    sources = {  # every kind of conflict's fine-tuning and warm-up suites
        name: kind for kind in builtin.CONFLICT_KINDS for name in [*builtin.FINETUNE[kind], *builtin.WARMUP[kind]]
    }
    trained = [
        builtin.make_example(name, i, cfg.run.seed, cfg.data.builtin.image_size, kind)
        for name, kind in sources.items()
        for i in range(cfg.data.builtin.examples_per_source)
    ]
    assert len(trained) == 80 * (18 + 9 + 22 + 10 + 5)  # cued's, opposed's other 9, the skills, either_*, *_true_false
    scenes = {scene for example in trained for scene in example.images}
    trained_images = {sha256(scene()) for scene in scenes}
    trained_templates = {template(example.answer()) for example in trained} - {None}
    assert {"{} {} {} {} on the {}", "the answer is {}"} <= trained_templates  # the caption's, a pair's
    for task in LEAVES:
        docs = records(folder, task)
        images = {sha256(toy_hooks.doc_to_visual(doc)[0]) for doc in docs}
        assert len(docs) == 200 and not images & trained_images, task
        templates = {template(doc["answer"]) for doc in docs}
        if task == "toy_chat":  # a sentence: "The picture shows a red circle in its left half."
            article = {"the picture shows {} {} {} in its {} half", "the picture shows an {} {} in its {} half"}
            assert templates == article  # "a" is masked as an option letter would be, "an" is not
            assert not templates & trained_templates
        else:  # letters, words, sums: the short answers the skills give
            assert templates == {None}, task
    reading = {sha256(toy_hooks.doc_to_visual(doc)[0]) for doc in records(folder, "toy_reading")}
    assert len(reading) == 200  # never the 20 images of the words in the middle of a white image


# --- constant baselines ---------------------------------------------------------------------
def test_each_constant_baseline_is_the_best_single_answer_and_scores_low(demo_suite):
    _, folder = demo_suite
    constants = json.loads((folder / CONSTANTS).read_text())
    assert list(constants) == LEAVES
    figures = {}
    for task in LEAVES:
        docs = records(folder, task)
        if task == "toy_chat":  # the reference closest to all of them; only the judge scores it
            references = sorted({doc["answer"] for doc in docs})
            f1 = {ref: sum(token_f1(ref, doc["answer"]) for doc in docs) / len(docs) for ref in references}
            assert constants[task]["token_f1"] == pytest.approx(max(f1.values()))
            assert f1[constants[task]["answer"]] == max(f1.values()) and constants[task]["value"] is None
            continue
        # every letter, option text, reference and number up to 30: no single answer does better
        candidates = {*"ABCD", *(o for doc in docs for o in doc["options"]), *(doc["answer"] for doc in docs)}
        candidates |= {str(n) for n in range(31)}
        value = {c: sum(score(d["scoring"], c, d["answer"], d["options"]) for d in docs) / 200 for c in candidates}
        best = max(value.values())
        assert constants[task]["value"] == pytest.approx(best) == value[constants[task]["answer"]], task
        figures[task] = (constants[task]["answer"], best)
    assert figures == {
        "toy_perception": ("A", 0.25),
        "toy_diagram": ("A", 0.25),
        "toy_reading": ("bell", 0.05),
        "toy_reasoning_direct": ("2", 0.075),
        "toy_reasoning_steps": ("2", 0.075),
    }
    assert constants["toy_chat"]["answer"] == "The picture shows a purple square in its bottom half."


def test_the_constant_model_scores_exactly_the_baseline_through_lmms_eval(demo_suite, judge):
    """lmms-eval's evaluator, ``merit_constant`` answering: the first 40 questions hold every
    letter 10 times, every word twice and the constant sum 3 times, so each score is the baseline;
    toy_chat's is the judge's (its ratings of the constant sentence against each reference)."""
    from lmms_eval import evaluator
    from lmms_eval.tasks import TaskManager

    _, folder = demo_suite
    server = judge()
    constants = json.loads((folder / CONSTANTS).read_text())
    results = evaluator.simple_evaluate(
        model=CONSTANT_MODEL,
        model_args=f"answers={folder / CONSTANTS}",
        tasks=["toy_perception", "toy_reading", "toy_reasoning", "toy_chat"],
        limit=40,
        task_manager=TaskManager(include_path=[str(folder)], include_defaults=False),
        batch_size=1,
        device="cpu",
        log_samples=True,
    )
    for task in ("toy_perception", "toy_reading", "toy_reasoning_direct", "toy_reasoning_steps"):
        assert results["results"][task]["accuracy,none"] == pytest.approx(constants[task]["value"]), task
    assert results["group_subtasks"]["toy_reasoning"] == ["toy_reasoning_direct", "toy_reasoning_steps"]
    constant = constants["toy_chat"]["answer"]
    ratings = [round(10 * token_f1(constant, doc["answer"])) for doc in records(folder, "toy_chat")[:40]]
    assert results["results"]["toy_chat"]["judge_score,none"] == pytest.approx(100 * sum(ratings) / (10 * 40))
    assert {s["filtered_resps"][0] for s in results["samples"]["toy_chat"]} == {constant}
    assert server.calls == 40 and server.failed == 0


# --- the judge ------------------------------------------------------------------------------
def test_toy_chat_asks_the_judge_to_rate_the_reference_and_the_answer(demo_suite, judge):
    _, folder = demo_suite
    doc = records(folder, "toy_chat")[0]  # "The picture shows a green circle in its bottom half."
    prompt = toy_hooks.judge_prompt(doc, "A green circle.")
    assert prompt.startswith(f"[Question]\n{doc['question']}\n\n[Assistant 1]\n{doc['answer']}\n\n[End of Assistant 1]")
    assert "[Assistant 2]\nA green circle.\n\n[End of Assistant 2]\n\n[System]\n" in prompt
    assert "first output a single line containing only two values indicating the scores for Assistant" in prompt
    judge()
    (judgement,) = toy_hooks.judge_process_results(doc, ["A green circle."]).values()
    assert judgement["scores"] == [10, 4] and judgement["eval_model"] == "judge"  # token F1 0.4
    assert toy_hooks.judge_score([judgement, judgement | {"scores": [8, 8]}]) == pytest.approx(100 * 12 / 18)
    flaky = judge("flaky")  # the first try fails, the second is answered
    assert toy_hooks.judge_process_results(doc, ["A green circle."])["judge_score"]["scores"] == [10, 4]
    assert (flaky.calls, flaky.failed) == (2, 1)


def test_a_failed_judgement_is_minus_one_and_only_failures_score_none(demo_suite, judge, monkeypatch):
    _, folder = demo_suite
    doc = records(folder, "toy_chat")[0]
    server = judge("fail")
    start = time.monotonic()
    failed = toy_hooks.judge_process_results(doc, ["A red circle."])["judge_score"]
    assert failed["scores"] == [-1, -1] and failed["review"].startswith("failed: ")
    assert server.calls == toy_hooks.JUDGE_TRIES and time.monotonic() - start < 5  # a dead judge fails fast

    class Rambling:  # a judge whose reply has no two ratings on its first line
        def evaluate(self, request: Request) -> Response:
            return Response(content="I cannot rate these.\n7 and 8", model_used="judge")

    monkeypatch.setattr(toy_hooks, "_judge", Rambling)
    garbled = toy_hooks.judge_process_results(doc, ["A red circle."])["judge_score"]
    assert garbled["scores"] == [-1, -1]
    assert toy_hooks.judge_score([garbled, failed]) is None
    assert toy_hooks.judge_score([garbled, failed, {"scores": [10, 5]}]) == pytest.approx(50.0)


def test_lmms_eval_reports_no_judge_score_when_every_judgement_failed(demo_suite, judge):
    from lmms_eval import evaluator
    from lmms_eval.tasks import TaskManager

    _, folder = demo_suite
    judge("fail")
    results = evaluator.simple_evaluate(
        model=CONSTANT_MODEL,
        model_args=f"answers={folder / CONSTANTS}",
        tasks=["toy_chat"],
        limit=2,
        task_manager=TaskManager(include_path=[str(folder)], include_defaults=False),
        batch_size=1,
        device="cpu",
    )
    assert results["results"]["toy_chat"]["judge_score,none"] is None  # never a number from failures
