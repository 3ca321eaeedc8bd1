"""The MERIT paper's eight benchmarks as the shipped 3B config names them, run offline through the
project's path on the tiny θ0: lmms-eval's own task YAMLs over hub-shaped caches of their data
(tests/hub_datasets.py, as ``hf download`` leaves them), judged by a local OpenAI-compatible
server (tests/judge_server.py) that answers well, fails every call, or fails every other call.
Every task parses and gets its headline score, the MathVista group is scored from its variants,
a judge's failures are caught and cost the task its score, and nothing is deleted on a failure."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from hub_datasets import write_paper_datasets
from judge_server import JudgeServer

from pipeline.config import load_config
from pipeline.eval.benchmarks import (
    SCORE,
    benchmark_dir,
    check_benchmarks,
    lmms_results,
    read_scores,
    run_benchmark,
    task_plans,
)
from pipeline.eval.lmms_tasks import HEADLINES, score
from pipeline.eval.stored_answers import stored_answers

ROOT = Path(__file__).parent.parent
CONFIG = ROOT / "configs" / "qwen2_5_vl_3b.yaml"
GROUP = "mathvista_testmini"  # lmms-eval's group of three prompt variants, no aggregate
SIZES = [  # the shipped config with the tiny θ0, 2 questions a task, short answers; nothing else
    "model.name_or_path=tiny",
    "model.dtype=float32",
    "model.min_pixels=3136",
    "model.max_pixels=12544",
    "eval.benchmark_limit=2",
    "eval.benchmark_batch_size=2",
    "eval.benchmark_gen_kwargs={max_new_tokens: 16}",
]


def judged(judge: JudgeServer, *extra: str) -> list[str]:
    return [
        *SIZES,
        f"eval.judge={{base_url: '{judge.base_url}', model: {judge.model}, api_key_env: JUDGE_KEY}}",
        *extra,
    ]


@pytest.fixture(scope="module")
def paper(tiny_run, tmp_path_factory):
    """Every task of the shipped config and the MathVista group, on θ0, against a judge that answers well."""
    _, theta0_run = tiny_run
    root = tmp_path_factory.mktemp("paper")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HOME", str(root / "hf"))
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("JUDGE_KEY", "secret")
        write_paper_datasets(root / "hf", items=2)
        with JudgeServer("good") as judge:
            cfg = load_config(CONFIG, judged(judge))
            shipped = cfg.eval.benchmarks
            cfg = load_config(CONFIG, judged(judge, f"eval.benchmarks=[{', '.join([*shipped, GROUP])}]"))
            checked = check_benchmarks(cfg)
            theta0 = str(theta0_run / "init")
            records = {task: run_benchmark(cfg, root, "theta0", theta0, task) for task in cfg.eval.benchmarks}
            yield SimpleNamespace(root=root, cfg=cfg, judge=judge, shipped=shipped, checked=checked, records=records)


def test_the_shipped_tasks_pass_preflight_and_each_gets_its_headline_score(paper):
    root, cfg, judge, shipped, checked, records = (
        paper.root,
        paper.cfg,
        paper.judge,
        paper.shipped,
        paper.checked,
        paper.records,
    )
    answered = f"judge {judge.model} at {judge.base_url} answered '10 5 Scored by token overlap.'"
    assert checked == f"{', '.join(cfg.eval.benchmarks)}; {answered}"  # data in the hub cache, the judge answered
    assert shipped == [
        *("seedbench", "mmbench_en_dev", "ai2d", "textvqa_val", "mmmu_val"),
        *("mathvista_testmini_format", "llava_in_the_wild", "mmvet"),
    ]
    for task in shipped:
        record = records[task]
        if task == "mmbench_en_dev":
            continue  # below: its judge matched no option
        assert "error" not in record, (task, record.get("error"), record.get("log_tail"))
        assert record["score"]["metric"].split(",")[0] == HEADLINES[task].metric, task
        lmms = json.loads(lmms_results(benchmark_dir(root, "theta0") / task).read_text())
        value = lmms["results"][task][record["score"]["metric"]]
        assert record["score"]["value"] == (value if value is not None else 0.0)  # MathVista: None at zero
        assert record["score"]["score"] == pytest.approx(record["score"]["value"] * HEADLINES[task].scale)
        assert record["score"]["examples"] == 2
    # The judged tasks' samples were read for failures: the judge answered every call.
    assert {t: records[t]["judge_failures"] for t in ("llava_in_the_wild", "mmvet", "mathvista_testmini_format")} == {
        "llava_in_the_wild": 0,
        "mmvet": 0,
        "mathvista_testmini_format": 0,
    }
    assert records["seedbench"]["judge_failures"] is None and judge.failed == 0


def test_the_mathvista_group_without_an_aggregate_is_the_size_weighted_mean_of_its_variants(paper):
    root, records = paper.root, paper.records
    lmms = json.loads(lmms_results(benchmark_dir(root, "theta0") / GROUP).read_text())
    assert GROUP not in lmms.get("groups", {}) and lmms["results"][GROUP].keys() == {" ", "alias"}
    score = records[GROUP]["score"]
    assert set(score["parts"]) == {"mathvista_testmini_cot", "mathvista_testmini_solution", "mathvista_testmini_format"}
    weighted = sum(p["score"] * p["examples"] for p in score["parts"].values()) / score["examples"]
    assert score["examples"] == 6 and score["score"] == pytest.approx(weighted)


def test_mmbench_answers_the_judge_could_not_match_are_caught_not_scored_as_random_letters(paper):
    """The tiny θ0's answers name no option: lmms-eval asks the judge, which answers Z (none), then
    picks a random letter. Those are counted, and the task gets no score unless allowed."""
    root, judge, records = paper.root, paper.judge, paper.records
    record = records["mmbench_en_dev"]
    assert "score" not in record
    assert record["error"] == (
        f"2 of 2 judgements by {judge.model} at {judge.base_url} failed or were unusable (eval.judge.max_failures = 0)"
    )
    failed = benchmark_dir(root, "theta0") / "mmbench_en_dev.failed"
    assert (failed / "lmms_eval.log").is_file() and list(failed.rglob("*_samples_mmbench_en_dev.jsonl"))  # kept
    allowed = load_config(CONFIG, judged(judge, "eval.benchmarks=[mmbench_en_dev]", "eval.judge.max_failures=2"))
    rerun = run_benchmark(allowed, root, "theta0", record["checkpoint"], "mmbench_en_dev")
    assert rerun["judge_failures"] == 2 and rerun["judge_note"].startswith("2 of 2 judgements") and "score" in rerun
    assert rerun["answers_from"] == str(failed)  # its answers judged again, not generated again


def test_a_judge_that_fails_costs_its_tasks_their_scores_and_nothing_else(paper):
    root, records = paper.root, paper.records
    others = {
        t: (benchmark_dir(root, "theta0") / t / SCORE).stat().st_mtime_ns for t in records if "score" in records[t]
    }
    with JudgeServer("fail") as down:
        refused = load_config(CONFIG, judged(down))
        with pytest.raises(ValueError, match="refused a test request: HTTP 500.*the test judge is down"):
            check_benchmarks(refused)  # preflight: the server's own answer, before any training
        failing = load_config(CONFIG, judged(down, "eval.benchmarks=[llava_in_the_wild]", "eval.benchmark_limit=1"))
        record = run_benchmark(failing, root, "theta1", records["ai2d"]["checkpoint"], "llava_in_the_wild")
    assert down.failed == down.calls > 0
    assert record["error"].startswith(f"1 of 1 judgements by {down.model} at {down.base_url} failed")
    assert read_scores(failing, root, "theta1")["failed"]["llava_in_the_wild"]["error"] == record["error"]
    assert {t: (benchmark_dir(root, "theta0") / t / SCORE).stat().st_mtime_ns for t in others} == others

    with JudgeServer("flaky") as flaky:  # lmms-eval retries a failed call: every judgement lands
        settings = judged(flaky, "eval.benchmarks=[llava_in_the_wild]", "eval.benchmark_limit=1")
        record = run_benchmark(
            load_config(CONFIG, settings), root, "theta2", records["ai2d"]["checkpoint"], "llava_in_the_wild"
        )
    assert flaky.failed > 0 and record["judge_failures"] == 0 and "score" in record


def test_an_unusable_mmvet_judgement_fails_and_the_answers_are_judged_again_not_regenerated(paper):
    """MM-Vet against a judge that answers no number: the judgement fails (lmms-eval would score it
    0.0 under the judge's name), then another judge rates the answers the job logged."""
    root, theta0 = paper.root, paper.records["ai2d"]["checkpoint"]
    with JudgeServer("garbage") as garbage:
        cfg = load_config(CONFIG, judged(garbage, "eval.benchmarks=[mmvet]", "eval.benchmark_limit=1"))
        failed = run_benchmark(cfg, root, "rejudged", theta0, "mmvet")
    assert failed["judge_failures"] == 1 and failed["error"].startswith(f"1 of 1 judgements by {garbage.model}")
    assert failed["identity"]["gen_kwargs"]["temperature"] == 0  # MM-Vet samples at 0.2: answered greedily
    folder = benchmark_dir(root, "rejudged") / "mmvet"
    answers = stored_answers(folder.with_name("mmvet.failed"), "mmvet")
    with JudgeServer("good") as good:
        cfg = load_config(CONFIG, judged(good, "eval.benchmarks=[mmvet]", "eval.benchmark_limit=1"))
        again = run_benchmark(cfg, root, "rejudged", theta0, "mmvet")
    assert "score" in again and again["judge_failures"] == 0 and good.calls == 1
    assert again["answers_from"].endswith("mmvet.failed") and "--model merit_stored_answers" in again["command"]
    assert stored_answers(folder, "mmvet") == answers and not folder.with_name("mmvet.failed").exists()


def test_a_headline_override_is_scored_on_the_scale_its_metric_reports(paper):
    """seed_all, the documented override, is a fraction in lmms-eval (0.5 for half right): 50 here."""
    root, cfg = paper.root, paper.cfg
    override = cfg.model_copy(
        update={"eval": cfg.eval.model_copy(update={"benchmark_metrics": {"seedbench": "seed_all"}})}
    )
    plan = task_plans(override, root)["seedbench"]
    folder = benchmark_dir(root, "theta0") / "seedbench"
    samples = [json.loads(line) for line in next(folder.rglob("*_samples_seedbench.jsonl")).read_text().splitlines()]
    samples[0]["seed_all"]["pred"] = samples[0]["seed_all"]["answer"]  # one of the two right
    results = {"results": {"seedbench": {"seed_all,none": 0.5}}, "n-samples": {"seedbench": {"effective": 2}}}
    assert score(plan, results, {"seedbench": samples}) == {
        "metric": "seed_all,none",
        "value": 0.5,
        "scale": 100.0,
        "score": 50.0,
        "examples": 2,
    }


def test_the_first_real_run_page_downloads_every_data_set_of_the_shipped_benchmarks(tmp_path):
    """docs/first-real-run.md's download commands: exactly the data sets lmms-eval's task files name
    for the 3B config's eight benchmarks, each beside its task."""
    plans = task_plans(load_config(CONFIG), tmp_path)
    wanted = {(d, task) for task, plan in plans.items() for d in plan.datasets}
    page = (ROOT / "docs" / "first-real-run.md").read_text()
    listed = set(re.findall(r"^hf download (\S+) --repo-type dataset +# (\S+)$", page, re.MULTILINE))
    assert len(plans) == 8 and listed == wanted
