"""Benchmarks through lmms-eval: how the toy tasks score an answer, the toy suite and its task
files, lmms-eval itself on the tiny model against a hand count, and preflight's refusals."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from conftest import small_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipeline.data import builtin
from pipeline.data.benchmark import MARKER, TASKS, TASKS_DIR, items, write_tasks
from pipeline.eval.benchmarks import check_benchmarks, run_benchmarks
from pipeline.eval.scoring import picked_option, score, token_f1

OPTIONS = ["red", "blue", "green", "yellow"]


def test_choice_answers_count_by_their_letter_or_the_option_text():
    for answer in ("B", "B.", "(B)", "B. blue", "  B\n", "blue", "Blue."):
        assert score("choice", answer, "B", OPTIONS) == 1.0, answer
    assert picked_option("A red circle", OPTIONS) is None  # the article, not option A
    assert picked_option("E", OPTIONS) is None  # no fifth option
    assert score("choice", "C", "B", OPTIONS) == 0.0
    assert score("choice", "purple", "B", OPTIONS) == 0.0


def test_free_form_answers_score_by_exact_match_token_f1_or_the_first_integer():
    assert score("exact", " Cake.", "cake") == 1.0 and score("exact", "a cake", "cake") == 0.0
    # articles and punctuation aside: {small, red, circle} against {small, blue, circle}
    assert token_f1("A small red circle.", "A small blue circle") == pytest.approx(2 / 3)
    assert token_f1("nothing alike", "A small blue circle") == 0.0
    assert score("f1", "A small blue circle on the left.", "A small blue circle on the left.") == 1.0
    assert score("number", "The answer is 7, I think 8", "7") == 1.0
    assert score("number", "seven", "7") == 0.0 and score("number", "17", "7") == 0.0


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


def test_the_toy_suite_draws_its_own_inputs_deterministically():
    assert items("toy_reasoning", 20, 0, 56) == items("toy_reasoning", 20, 0, 56)
    assert items("toy_reasoning", 20, 0, 56) != items("toy_reasoning", 20, 1, 56)
    # The warm-up teaches the multiple-choice and description formats on draws of its own.
    for task, skill in (("toy_perception", "skill_choice"), ("toy_describe", "skill_describe")):
        scenes = {builtin.draw(skill, i, 0, 56)[0] for i in range(50)}
        assert not scenes & {item.scene for item in items(task, 50, 0, 56)}
    dots = items("toy_reasoning", 50, 0, 56)
    assert all(int(i.answer) == len(i.scene.shapes) + int(i.question.split("Add ")[1].split()[0]) for i in dots)
    assert {TASKS[t].stands_for for t in TASKS} >= {"AI2D", "TextVQA", "LLaVA-in-the-Wild"}


def test_prepare_writes_task_files_that_lmms_eval_loads(tmp_path):
    from lmms_eval.utils import load_yaml_config

    cfg = small_config("eval.benchmarks=[toy_perception, toy_describe]", "data.builtin.benchmark_examples=5")
    folder = write_tasks(cfg, tmp_path)
    assert folder == tmp_path / TASKS_DIR
    config = load_yaml_config(str(folder / "toy_describe.yaml"), mode="full")
    records = [json.loads(line) for line in (folder / "toy_describe.jsonl").read_text().splitlines()]
    assert len(records) == 5 and config["task"] == "toy_describe"
    assert config["dataset_kwargs"]["data_files"]["test"] == str(folder / "toy_describe.jsonl")
    image = config["doc_to_visual"](records[0])[0]
    assert image.tobytes() == items("toy_describe", 1, cfg.run.seed, 112)[0].scene().tobytes()  # lossless PNG
    assert config["process_results"](records[0], [records[0]["answer"]]) == {"token_f1": 1.0}
    stamp = (folder / MARKER).stat().st_mtime_ns
    assert write_tasks(cfg, tmp_path) == folder and (folder / MARKER).stat().st_mtime_ns == stamp  # up to date
    write_tasks(small_config("eval.benchmarks=[toy_reading]"), tmp_path)
    assert sorted(p.name for p in folder.glob("*.yaml")) == ["toy_reading.yaml"]


@pytest.fixture(scope="module")
def benchmarked(tiny_run):
    """lmms-eval's qwen2_5_vl on the tiny θ0, two toy tasks of 12 questions."""
    _, run_dir = tiny_run
    cfg = small_config(
        "eval.benchmarks=[toy_perception, toy_describe]",
        "data.builtin.benchmark_examples=12",
        "eval.benchmark_batch_size=4",
    )
    write_tasks(cfg, run_dir)
    return cfg, run_dir, run_benchmarks(cfg, run_dir, "theta0", str(run_dir / "init"))


def test_lmms_eval_scores_the_tiny_model_as_a_hand_count_of_its_answers(benchmarked):
    _, run_dir, result = benchmarked
    folder = run_dir / "eval" / "benchmarks" / "theta0"
    (results_file,) = folder.rglob("*_results.json")  # lmms-eval's own, as it wrote it
    lmms = json.loads(results_file.read_text())
    for task, metric in (("toy_perception", "accuracy"), ("toy_describe", "token_f1")):
        (samples_file,) = folder.rglob(f"*_samples_{task}.jsonl")
        answers = {s["doc_id"]: s["filtered_resps"][0] for s in map(json.loads, samples_file.read_text().splitlines())}
        docs = [json.loads(line) for line in (run_dir / TASKS_DIR / f"{task}.jsonl").read_text().splitlines()]
        hand = sum(score(d["scoring"], answers[i], d["answer"], d["options"]) for i, d in enumerate(docs)) / len(docs)
        assert len(answers) == 12
        assert lmms["results"][task][f"{metric},none"] == pytest.approx(hand)
        assert result["tasks"][task] == {
            "metric": f"{metric},none",
            "value": pytest.approx(hand),
            "score": pytest.approx(100 * hand),
            "examples": 12,
        }
    assert result["average"] == pytest.approx(sum(t["score"] for t in result["tasks"].values()) / 2)
    assert "python -m lmms_eval --model qwen2_5_vl" in result["commands"][0]
    events = EventAccumulator(str(run_dir / "eval" / "tensorboard" / "theta0" / "benchmarks")).Reload()
    assert events.Scalars("benchmarks/average")[0].value == pytest.approx(result["average"])


def test_benchmarks_up_to_date_are_not_run_again(benchmarked):
    cfg, run_dir, result = benchmarked
    scores = run_dir / "eval" / "benchmarks" / "theta0" / "scores.json"
    stamp = scores.stat().st_mtime_ns
    assert run_benchmarks(cfg, run_dir, "theta0", str(run_dir / "init")) == result
    assert scores.stat().st_mtime_ns == stamp


def dataset_snapshot(hf_home: Path, repo_id: str) -> None:
    """A dataset as ``huggingface_hub`` caches a download (its files do not matter here)."""
    snapshot = hf_home / "hub" / f"datasets--{repo_id.replace('/', '--')}" / "snapshots" / ("ab" * 20)
    snapshot.mkdir(parents=True)
    (snapshot / "README.md").write_text("cached")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("ab" * 20)


def test_preflight_refuses_a_judged_task_without_a_judge_and_a_task_without_data(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    tasks = "eval.benchmarks=[ai2d, mmvet, toy_perception, no_such_task]"
    with pytest.raises(ValueError) as refused:
        check_benchmarks(small_config(tasks))
    message = str(refused.value)
    assert "['mmvet'] are scored by a judge model: set eval.judge" in message
    assert "fetch it first: hf download lmms-lab-encoder/ai2d --repo-type dataset" in message
    assert "task 'mmvet': its data lmms-lab-encoder/MMVet is not in the Hugging Face cache" in message
    assert "lmms-eval has no task 'no_such_task'" in message and "toy_perception" not in message

    judge = "eval.judge={base_url: 'http://127.0.0.1:9/v1', model: judge, api_key_env: JUDGE_KEY}"
    with pytest.raises(ValueError, match=r"need the judge's key in \$JUDGE_KEY"):
        check_benchmarks(small_config(tasks, judge))
    for repo in ("lmms-lab-encoder/ai2d", "lmms-lab-encoder/MMVet"):
        dataset_snapshot(tmp_path / "hf", repo)
    monkeypatch.setenv("JUDGE_KEY", "secret")
    cfg = small_config("eval.benchmarks=[ai2d, mmvet, toy_perception]", judge)
    assert check_benchmarks(cfg) == "ai2d, mmvet, toy_perception"
